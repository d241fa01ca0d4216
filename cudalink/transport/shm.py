"""The default transport: ``multiprocessing.shared_memory`` segments plus a control channel.

Names are per user (``cudalink-<user>-<name>``); segments, sockets and rendezvous files are 0600 in a
private directory. A producer holds ``<name>.lock`` (an OS lock, dropped when it dies) for its whole
life: a name whose lock is held is live and refused; otherwise whatever carries the name is a dead
producer's leftovers, cleaned and reused. Data segments (and, over TCP, the header) carry the
generation id, so a restart never collides with leftovers that Windows keeps while anyone maps them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

from .. import _platform
from ..errors import LinkError, ProtocolError
from . import wire
from .base import NoProducer, Server, ServerHandler, Transport
from .channel import CHANNELS, DENIED, Channel, Found, Listening, channel, find
from .control import ClientSocket, ControlLoop, SocketClient

__all__ = ["SharedMemoryTransport"]

_track_lock = threading.Lock()


def _open_segment(name: str, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    """Open without the resource tracker: it would unlink a live producer's segment when a consumer exits."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)  # type: ignore[call-arg]
    from multiprocessing import resource_tracker

    with _track_lock:
        saved = resource_tracker.register
        resource_tracker.register = lambda *a, **k: None  # type: ignore[assignment]
        try:
            return shared_memory.SharedMemory(name, create=create, size=size)
        finally:
            resource_tracker.register = saved  # type: ignore[assignment]


def _create_segment(name: str, size: int, what: str) -> shared_memory.SharedMemory:
    """A new segment whose pages are reserved (``_platform.reserve_shm``): a full /dev/shm is an error here."""
    shm = _open_segment(name, create=True, size=size)
    try:
        _platform.reserve_shm(getattr(shm, "_fd", -1), size, what)
    except BaseException:
        with contextlib.suppress(Exception):
            shm.close()
        _unlink_segment(name)
        raise
    return shm


def _unlink_segment(name: str) -> None:
    try:
        seg = _open_segment(name)
    except (FileNotFoundError, OSError):
        return
    with contextlib.suppress(OSError):
        seg.unlink() if sys.version_info >= (3, 13) else _posix_unlink(seg)
    with contextlib.suppress(Exception):
        seg.close()


def _posix_unlink(seg: shared_memory.SharedMemory) -> None:
    try:
        import _posixshmem  # type: ignore[import-not-found]

        _posixshmem.shm_unlink(seg._name)  # type: ignore[attr-defined]
    except ImportError:  # Windows: the segment goes with its last handle
        pass


class Segment:
    """A mapped segment whose mapping outlives every frame that points into it."""

    def __init__(self, shm: shared_memory.SharedMemory) -> None:
        self._shm = shm
        assert shm.buf is not None
        self.buf: memoryview = shm.buf
        arr = np.frombuffer(self.buf, np.uint8)
        self.address = int(arr.ctypes.data) if len(arr) else 0
        del arr

    @property
    def name(self) -> str:
        return str(self._shm.name)

    def unlink(self) -> None:
        _unlink_segment(self._shm.name)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.buf = memoryview(b"")
            self._shm.close()


class _ShmServer(Server):
    data_segment: Segment | None  # a Region that can also be unlinked

    def __init__(
        self, name: str, header: Segment, data: Segment | None, listening: Listening, lock: _platform.ProcessLock
    ) -> None:
        self._name = name
        self.header_segment = header
        self.data_segment = data
        self.header = header.buf
        self.data = data.buf if data is not None else None
        self._listening = listening
        self._lock = lock
        self._loop = ControlLoop(listening.listener, listening.gate)
        self._closed = False

    def start(self, handler: ServerHandler) -> None:
        self._loop.start(handler)

    def wake(self, byte: bytes = b"\x01", conns: list[int] | None = None) -> None:
        self._loop.wake(byte, conns)

    def wakers(self, conns: list[int], byte: bytes = b"\x01") -> list[Callable[[], object]] | None:
        return self._loop.wakers(conns, byte)

    def disconnect(self, conn: int) -> None:
        self._loop.disconnect(conn)

    def connection_count(self) -> int:
        return self._loop.connection_count()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._listening.close()
        self._loop.close()
        self.header_segment.unlink()
        if self.data_segment is not None:
            self.data_segment.unlink()
        self._lock.release()


class _ShmClient(SocketClient):
    def __init__(self, name: str, header: Segment, found: Found) -> None:
        self._name = name
        self.header_segment = header
        self.header = header.buf
        self._found = found
        self._sock: ClientSocket | None = None
        self.data_segment: Segment | None = None

    def handshake(self, hello: bytes, reply_size: int, timeout: float) -> tuple[bytes, list[int]]:
        self._sock = self._found.connect(timeout)
        return self._sock.handshake(hello, reply_size, timeout)

    def map_data(self, generation: int, size: int) -> memoryview:
        try:
            seg = Segment(_open_segment(_platform.segment_name(self._name, f"-{generation:016x}")))
        except FileNotFoundError as exc:
            raise NoProducer("data segment vanished") from exc
        if len(seg.buf) < size:
            raise ProtocolError(
                f"cudalink: data segment is {len(seg.buf)} bytes, the header promises {size}: the header is corrupt"
            )
        self.data_segment = seg
        return seg.buf


class SharedMemoryTransport(Transport):
    """POSIX/Windows shared memory for state and frames, and a control channel (see ``channel.py``).

    ``control`` picks the producer's channel: ``"unix"``, ``"tcp"``, or ``None`` for the
    ``CUDALINK_CONTROL`` variable / the platform's best. Consumers find either kind by themselves.
    """

    def __init__(self, control: str | None = None) -> None:
        self._channel = channel(control) if control is not None else None

    @property
    def channel(self) -> Channel:
        return self._channel if self._channel is not None else channel(None)

    @property
    def passes_fds(self) -> bool:  # type: ignore[override]
        return self.channel.passes_fds

    def serve(self, name: str, header_size: int, data_size: int, generation: int = 0) -> _ShmServer:
        _platform.check_name(name)
        chan = self.channel
        lock = _platform.ProcessLock(os.path.join(_platform.runtime_dir(), f"{name}.lock"))
        if not lock.acquire():
            raise LinkError(
                f"cudalink: link {name!r} is already published by a live producer; close it or choose another name"
            )
        listening: Listening | None = None
        segments: list[Segment] = []
        try:
            self._clean_stale(name)
            what = f"link {name!r}"
            header = Segment(_create_segment(chan.header(name, generation), header_size, f"{what} (its header)"))
            segments.append(header)
            data = None
            if data_size:
                data_name = _platform.segment_name(name, f"-{generation:016x}")
                data = Segment(_create_segment(data_name, data_size, what))
                segments.append(data)
            listening = chan.listen(name, generation)
        except BaseException:
            for seg in segments:
                seg.unlink()
            lock.release()
            raise
        return _ShmServer(name, header, data, listening, lock)

    @staticmethod
    def _clean_stale(name: str) -> None:
        """We hold the name's lock: whatever carries the name is a dead producer's leftovers."""
        generations: list[int] = []
        for chan in CHANNELS.values():
            files, gens = chan.leftovers(name)
            generations += gens
            for path in files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        seg_name = _platform.segment_name(name)
        try:
            old = _open_segment(seg_name)
        except FileNotFoundError:
            pass
        else:
            try:
                buf = old.buf
                if buf is not None and len(buf) >= wire.FIXED.size:
                    magic, *_rest = wire.FIXED.unpack_from(buf, 0)
                    if magic == wire.MAGIC:
                        generations.append(wire.read_u64(buf, 16))
            finally:
                with contextlib.suppress(Exception):
                    old.close()
            _unlink_segment(seg_name)
        for gen in generations:
            _unlink_segment(_platform.segment_name(name, f"-{gen:016x}"))
            _unlink_segment(_platform.segment_name(name, f"-h{gen:016x}"))

    def connect(self, name: str) -> _ShmClient:
        _platform.check_name(name)
        found = find(name)
        if found is None:
            raise NoProducer(f"no link named {name!r}")
        try:
            seg = _open_segment(found.header)
        except FileNotFoundError as exc:
            raise NoProducer(f"no link named {name!r}") from exc
        except PermissionError as exc:
            raise LinkError(DENIED.format(name=name)) from exc
        return _ShmClient(name, Segment(seg), found)


def header_segment(name: str) -> str:
    """The header segment's name for a published link (monitors map it read-only)."""
    found = find(_platform.check_name(name))
    return found.header if found is not None else _platform.segment_name(name)


def map_readonly(segment: str) -> tuple[wire.ReadBuf, Callable[[], None]]:
    """``segment`` mapped PROT_READ where POSIX shm exists, else a byte copy; and how to let go of it."""
    mm = _platform.shm_map_readonly(segment)
    if isinstance(mm, bytes):
        return mm, lambda: None
    if mm is not None:
        return mm, mm.close
    shm = _open_segment(segment)
    data = bytes(shm.buf or b"")
    shm.close()
    return data, lambda: None
