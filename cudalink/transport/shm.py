"""The default transport: ``multiprocessing.shared_memory`` segments plus a Unix control socket.

Names are per user (``cudalink-<uid>-<name>``), segments and the socket are 0600, and the socket
sits in a private 0700 directory. A name whose socket refuses connections is stale (its producer
died) and is cleaned and reused; a name whose socket answers is live and is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
from multiprocessing import shared_memory

import numpy as np

from .. import _platform
from ..errors import LinkError
from . import wire
from .base import NoProducer, Peer, Server, ServerHandler, Transport
from .control import ClientSocket, ControlLoop, SocketClient

__all__ = ["SharedMemoryTransport"]

_track_lock = threading.Lock()
_DENIED = (
    "cudalink: permission denied for link {name!r}: links are private to the user that created them; "
    "run the consumer as the same user"
)


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


def _peer(sock: socket.socket) -> Peer:
    pid, uid = _platform.peer_credentials(sock)
    return Peer(pid, uid)


class _ShmServer(Server):
    def __init__(self, name: str, header: Segment, data: Segment | None, listener: socket.socket, path: str) -> None:
        self._name = name
        self.header_segment = header
        self.data_segment = data
        self.header = header.buf
        self.data = data.buf if data is not None else None
        self._listener = listener
        self._path = path
        self._loop = ControlLoop(listener, _peer)
        self._closed = False

    def start(self, handler: ServerHandler) -> None:
        self._loop.start(handler)

    def wake(self, byte: bytes = b"\x01", conns: list[int] | None = None) -> None:
        self._loop.wake(byte, conns)

    def disconnect(self, conn: int) -> None:
        self._loop.disconnect(conn)

    def connection_count(self) -> int:
        return self._loop.connection_count()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        self._loop.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.header_segment.unlink()
        if self.data_segment is not None:
            self.data_segment.unlink()


class _ShmClient(SocketClient):
    def __init__(self, name: str, header: Segment) -> None:
        self._name = name
        self.header_segment = header
        self.header = header.buf
        self._sock: ClientSocket | None = None
        self.data_segment: Segment | None = None

    def handshake(self, hello: bytes, reply_size: int, timeout: float) -> tuple[bytes, list[int]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(_platform.socket_path(self._name))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise NoProducer(str(exc)) from None
        except PermissionError:
            sock.close()
            raise LinkError(_DENIED.format(name=self._name)) from None
        except OSError:
            sock.close()
            raise
        self._sock = ClientSocket(sock)
        return self._sock.handshake(hello, reply_size, timeout)

    def map_data(self, generation: int, size: int) -> memoryview:
        try:
            seg = Segment(_open_segment(_platform.segment_name(self._name, f"-{generation:016x}")))
        except FileNotFoundError:
            raise NoProducer("data segment vanished") from None
        if len(seg.buf) < size:
            raise LinkError(f"cudalink: data segment is {len(seg.buf)} bytes, header promises {size}")
        self.data_segment = seg
        return seg.buf


class SharedMemoryTransport(Transport):
    """POSIX/Windows shared memory for state and frames, a Unix socket for the handshake and wake-ups."""

    def serve(self, name: str, header_size: int, data_size: int, generation: int = 0) -> _ShmServer:
        _platform.check_name(name)
        path = _platform.socket_path(name)
        listener = self._bind(name, path)
        try:
            self._clean_stale(name)
            header = Segment(_open_segment(_platform.segment_name(name), create=True, size=header_size))
            data = None
            if data_size:
                data = Segment(
                    _open_segment(_platform.segment_name(name, f"-{generation:016x}"), create=True, size=data_size)
                )
        except BaseException:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return _ShmServer(name, header, data, listener, path)

    @staticmethod
    def _bind(name: str, path: str) -> socket.socket:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: its producer died without cleaning up
        except OSError:
            pass
        else:
            raise LinkError(
                f"cudalink: link {name!r} is already published by a live producer; close it or choose another name"
            )
        finally:
            probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            listener.bind(path)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise LinkError(f"cudalink: link {name!r} was just claimed by another producer") from None
            raise
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        listener.listen(64)
        return listener

    @staticmethod
    def _clean_stale(name: str) -> None:
        """We own the socket now: whatever segments carry the name are a dead producer's leftovers."""
        seg_name = _platform.segment_name(name)
        try:
            old = _open_segment(seg_name)
        except FileNotFoundError:
            return
        try:
            buf = old.buf
            if buf is not None and len(buf) >= wire.FIXED.size:
                magic, *_rest = wire.FIXED.unpack_from(buf, 0)
                if magic == wire.MAGIC:
                    gen = wire.read_u64(buf, 16)
                    _unlink_segment(_platform.segment_name(name, f"-{gen:016x}"))
        finally:
            with contextlib.suppress(Exception):
                old.close()
        _unlink_segment(seg_name)

    def connect(self, name: str) -> _ShmClient:
        _platform.check_name(name)
        try:
            seg = _open_segment(_platform.segment_name(name))
        except FileNotFoundError:
            raise NoProducer(f"no link named {name!r}") from None
        except PermissionError:
            raise LinkError(_DENIED.format(name=name)) from None
        return _ShmClient(name, Segment(seg))
