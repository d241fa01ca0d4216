"""The default transport: ``multiprocessing.shared_memory`` segments plus a control channel.

Names are per user (``cudalink-<user>-<name>``); segments, sockets and rendezvous files are 0600 in a
private directory. A producer holds ``<name>.lock`` (an OS lock, dropped when it dies) for its whole
life: a name whose lock is held is live and refused; otherwise whatever carries the name is a dead
producer's leftovers, cleaned and reused. Data segments (and, over TCP, the header) carry the
generation id, so a restart never collides with leftovers that Windows keeps while anyone maps them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
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


class EmptySegment(FileNotFoundError):
    """A segment of 0 bytes: its creator has not sized it yet (``shm_open`` comes before ``ftruncate``), or died
    in between. To a reader it is not there yet; ``clean`` and a new producer remove it."""


class _Opened(shared_memory.SharedMemory):
    """A segment someone else made, opened to read: ``SharedMemory`` unlinks the segment when its own mapping
    fails (a FIFO in its place, a 64 TiB sparse file), which a reader must never do to another's name."""

    _opened = False

    def __init__(self, name: str, **kw: object) -> None:
        super().__init__(name, **kw)  # type: ignore[arg-type]
        self._opened = True

    def unlink(self) -> None:
        if self._opened:
            super().unlink()


def _open_segment(name: str, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    """Open without the resource tracker: it would unlink a live producer's segment when a consumer exits."""
    kind = shared_memory.SharedMemory if create else _Opened
    try:
        if sys.version_info >= (3, 13):
            return kind(name, create=create, size=size, track=False)  # type: ignore[call-arg]
        from multiprocessing import resource_tracker

        with _track_lock:
            saved = resource_tracker.register
            resource_tracker.register = lambda *a, **k: None  # type: ignore[assignment]
            try:
                return kind(name, create=create, size=size)
            finally:
                resource_tracker.register = saved  # type: ignore[assignment]
    except ValueError as exc:  # "cannot mmap an empty file" (the half-made object's __del__ closes its fd)
        if create:
            raise
        raise EmptySegment(
            f"shared-memory segment {name!r} is empty: its producer is creating it (or died doing so)"
        ) from exc


def _create_segment(name: str, size: int, what: str) -> shared_memory.SharedMemory:
    """A new segment whose pages are reserved (``_platform.reserve_shm``): a full /dev/shm is an error here."""
    try:
        shm = _open_segment(name, create=True, size=size)
    except FileExistsError as exc:  # ours were removed as a dead producer's: this one is not ours to remove
        owner = _platform.shm_owner(name)
        whose = f"another user's (uid {owner})" if owner is not None and owner != _platform.uid() else "not ours"
        raise LinkError(
            f"cudalink: cannot publish {what}: shared-memory segment {name!r} exists and is {whose}; choose "
            f"another link name, or have its owner (or an administrator) remove /dev/shm/{name}"
        ) from exc
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
    except EmptySegment:
        _unlink_name(name)
        return
    except (FileNotFoundError, OSError):
        return
    with contextlib.suppress(OSError):
        seg.unlink() if sys.version_info >= (3, 13) else _unlink_name(seg._name)  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        seg.close()


def _unlink_name(name: str) -> None:
    """Unlink a POSIX segment by name (its mapping, if any, stays valid); Windows: it goes with its last handle."""
    try:
        import _posixshmem  # type: ignore[import-not-found]
    except ImportError:
        return
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(name if name.startswith("/") else "/" + name)


def _address(buf: memoryview) -> int:
    """Where a mapping starts in this process (0 for an empty one): host frames point into it."""
    arr = np.frombuffer(buf, np.uint8)
    return int(arr.ctypes.data) if len(arr) else 0


class Segment:
    """A mapped segment whose mapping outlives every frame that points into it."""

    def __init__(self, shm: shared_memory.SharedMemory) -> None:
        self._shm = shm
        assert shm.buf is not None
        self.buf: memoryview = shm.buf
        self.address = _address(self.buf)

    @property
    def name(self) -> str:
        return str(self._shm.name)

    def unlink(self) -> None:
        _unlink_segment(self._shm.name)

    def discard(self) -> None:
        """Free the segment's pages now (``MADV_REMOVE``: the mapping stays and reads zeros), rather than when
        the last mapping goes, where the OS can. Only for memory nobody reads any more."""
        mm = getattr(self._shm, "_mmap", None)
        advice = getattr(mmap, "MADV_REMOVE", None)
        if mm is not None and advice is not None:
            mm.madvise(advice)

    def __del__(self) -> None:
        try:  # not contextlib.suppress: modules may be torn down at interpreter exit
            self.buf = memoryview(b"")
            self._shm.close()
        except Exception:
            pass


class _ReadOnly:
    """A consumer's mapping of a producer's data segment, PROT_READ: a received frame is read-only, and torch
    ignores DLPack's read-only flag, so an in-place op on ``torch.from_dlpack(frame)`` wrote into the slot the
    producer and every other consumer read. Mapped read-only, that write faults in the process that made it."""

    def __init__(self, mm: mmap.mmap) -> None:
        self._mmap = mm
        self.buf = memoryview(mm)
        self.address = _address(self.buf)

    @classmethod
    def open(cls, name: str) -> _ReadOnly | None:
        """None where POSIX shared memory does not exist (Windows maps it read-write, as before)."""
        mm = _platform.shm_map_readonly(name)
        if mm is None:
            return None
        if not isinstance(mm, mmap.mmap):  # 0 bytes: not sized yet (see EmptySegment)
            raise EmptySegment(f"shared-memory segment {name!r} is empty: its producer is creating it")
        return cls(mm)

    def __del__(self) -> None:
        try:  # frames keep this object (their mapping) alive: nothing points into it any more
            self.buf.release()
            self._mmap.close()
        except Exception:
            pass


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
        self._lock.remove_and_release()  # nothing of ours stays behind, not even the lock file

    def discard_frames(self) -> None:
        """The frames' memory back to the OS at close, once no consumer holds a frame: the mappings (ours
        until the Sender is collected, theirs until they let go) would keep it in /dev/shm meanwhile."""
        if self.data_segment is not None:
            with contextlib.suppress(OSError, ValueError):
                self.data_segment.discard()

    def forget_after_fork(self) -> None:
        """In a forked child: close our copies of the listener, the connections and the lock (never unlocking
        or shutting down what the parent uses) and remove nothing."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listening.listener.close()
        self._loop.forget_after_fork()
        self._lock.forget()


class _ShmClient(SocketClient):
    def __init__(self, name: str, header: Segment, found: Found, read_only: bool = True) -> None:
        self._name = name
        self._read_only = read_only
        self.header_segment = header
        self.header = header.buf
        self._found = found
        self._sock: ClientSocket | None = None
        self.data_segment: Segment | _ReadOnly | None = None

    def handshake(self, hello: bytes, reply_size: int, timeout: float) -> tuple[bytes, list[int]]:
        self._sock = self._found.connect(timeout)
        with contextlib.suppress(ProtocolError, ValueError):
            self._sock.peer_pid = wire.read_fixed(self.header).pid
        return self._sock.handshake(hello, reply_size, timeout)

    def map_data(self, generation: int, size: int) -> memoryview:
        name = _platform.segment_name(self._name, f"-{generation:016x}")
        try:
            seg: Segment | _ReadOnly | None = _ReadOnly.open(name) if self._read_only else None
            seg = seg or Segment(_open_segment(name))
        except FileNotFoundError as exc:
            raise NoProducer("data segment vanished") from exc
        except OSError as exc:  # something else under its name (a FIFO, a device): never the producer's memory
            raise ProtocolError(
                f"cudalink: the data segment {name!r} of link {self._name!r} cannot be mapped ({exc.strerror or exc}): "
                "another process replaced it; restart the producer"
            ) from exc
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
    ``read_only`` (consumers): map a host producer's frames read-only where the OS can (POSIX).
    """

    def __init__(self, control: str | None = None, *, read_only: bool = True) -> None:
        self._channel = channel(control) if control is not None else None
        #: consumers map a host producer's frames PROT_READ (see ``_ReadOnly``); False maps them read-write, for
        #: a trusted reader that hands them to an engine which may register them for writing (UCX over RDMA)
        self.read_only = read_only

    @property
    def channel(self) -> Channel:
        return self._channel if self._channel is not None else channel(None)

    @property
    def passes_fds(self) -> bool:  # type: ignore[override]
        return self.channel.passes_fds

    def serve(self, name: str, header_size: int, data_size: int, generation: int = 0) -> _ShmServer:
        _platform.check_name(name)
        chan = self.channel
        lock = _platform.ProcessLock(_platform.lock_path(name))
        if not lock.acquire(_LOOK_S):
            raise LinkError(
                f"cudalink: link {name!r} is already published by a live producer; close it or choose another name"
            )
        listening: Listening | None = None
        segments: list[Segment] = []
        try:
            _refuse_look_alike(name)
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
            lock.remove_and_release()
            raise
        return _ShmServer(name, header, data, listening, lock)

    @staticmethod
    def _clean_stale(name: str) -> None:
        """We hold the name's lock: whatever carries the name is a dead producer's leftovers."""
        files, segments = leftovers(name, unrecorded=True)
        for path in files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for seg in segments:
            _unlink_segment(seg)

    def abandoned(self, name: str) -> bool:
        """True when ``name`` carries a dead producer's leftovers: nobody holds its lock, yet its socket,
        rendezvous file or segments are there. A name with nothing there is not dead, only not started.

        The lock is held only for the instant of each test, never while we look: a consumer stopped (SIGSTOP,
        Ctrl-Z, a debugger) or descheduled in the middle of its look would keep the producer from starting.
        A producer that started meanwhile holds the lock at the second test."""
        if _held(name):  # a producer holds it (alive, starting or closing), or another look does
            return False
        base = _segment_of_live(name)
        if base is not None:  # no dead producer: a name copied from /dev/shm (``ls``), one of a live link's segments
            raise LinkError(
                f"cudalink: {name!r} is not a link but the shared memory of live link {base!r}; receive from {base!r}"
            )
        files, segments = leftovers(name)
        return bool(files or segments) and not _held(name)

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
        return _ShmClient(name, Segment(seg), found, self.read_only)


#: how long a producer tries for its name's lock: a Receiver or ``cudalink clean`` may hold it for a moment
_LOOK_S = 0.25
#: how long ``clean`` tries for a dead link's lock: another look (a second ``clean``, a Receiver asking whether
#: the producer lives) holds it for a moment, which is not a live producer
_PEEK_S = 0.1


def _generation_of(seg_name: str) -> int | None:
    """The generation a leftover Unix-channel header names (its data segment carries it), if readable."""
    try:
        old = _open_segment(seg_name)
    except (FileNotFoundError, OSError):
        return None
    try:
        buf = old.buf
        if buf is not None and len(buf) >= wire.FIXED.size:
            magic, *_rest = wire.FIXED.unpack_from(buf, 0)
            if magic == wire.MAGIC:
                return wire.read_u64(buf, 16)
        return None
    finally:
        with contextlib.suppress(Exception):
            old.close()


def _exists(seg_name: str) -> bool:
    try:
        seg = _open_segment(seg_name)
    except EmptySegment:
        return True
    except (FileNotFoundError, OSError):
        return False
    with contextlib.suppress(Exception):
        seg.close()
    return True


def leftovers(name: str, unrecorded: bool = False) -> tuple[list[str], list[str]]:
    """What a producer of ``name`` made that is still there: (files, segment names). Only meaningful to a
    caller that holds the name's lock (or knows its producer is dead). ``unrecorded``: also the segments no
    record names, found by listing /dev/shm (a cost for the next Sender and ``clean``, not for a Receiver's
    every look while it waits)."""
    files: list[str] = []
    generations: list[int] = []
    for chan in CHANNELS.values():
        paths, gens = chan.leftovers(name)
        for path in paths:
            if os.path.isdir(path) and not os.path.islink(path):
                raise _platform.in_the_way(path, f"the control socket or rendezvous file of link {name!r}")
            if os.path.lexists(path):
                files.append(path)
        generations += gens
    segments = []
    header = _platform.segment_name(name)
    gen = _generation_of(header)
    if gen is not None:
        generations.append(gen)
    if _exists(header):
        segments.append(header)
    for gen in generations:
        for suffix in (f"-{gen:016x}", f"-h{gen:016x}"):
            seg = _platform.segment_name(name, suffix)
            # a live link named NAME-<gen> has its header there: it started after NAME died
            if seg not in segments and _exists(seg) and not _held(name + suffix):
                segments.append(seg)
    if unrecorded:
        segments += [seg for seg in _unrecorded(name) if seg not in segments]
    return files, [seg for seg in segments if _ours(seg)]


def _ours(seg: str) -> bool:
    """Whether segment ``seg`` is this user's: anyone may make files in /dev/shm, and one another user made under
    our name is no producer's leftover of ours (we could not remove it; a Sender refuses the name, saying whose)."""
    owner = _platform.shm_owner(seg)
    return owner is None or owner == _platform.uid()


def _unrecorded(name: str) -> list[str]:
    """``name``'s segments that no record names: a producer killed while it made them (before the header or
    rendezvous file said which generation) or while it removed them. Listed where the OS can list them; a
    look-alike link's header (a link named ``NAME-<16 hex>``) is left alone while its producer lives."""
    prefix = _platform.segment_name(name)
    out = []
    for seg in _platform.shm_segments(prefix):
        rest = seg[len(prefix) :]
        if not _SUFFIX.fullmatch(rest) or _held(name + rest):  # a live link named NAME-<16 hex> or NAME-h<16 hex>
            continue
        out.append(seg)
    return out


def _segment_of_live(name: str) -> str | None:
    """The live link whose shared memory carries the name ``name``, if any: a name ``BASE-<G>`` (or ``BASE-h<G>``,
    G 16 hex digits) while BASE lives at generation G is BASE's data segment (or loopback header), not a link."""
    base = _SUFFIX.sub("", name)
    if base == name or not _held(base):
        return None
    generation = name[len(base) :].lstrip("-h")
    live = [_generation_of(_platform.segment_name(base))] + [g for c in CHANNELS.values() for g in c.leftovers(base)[1]]
    return base if int(generation, 16) in live else None


def _refuse_look_alike(name: str) -> None:
    """A link named like a live link's segment: its header would have that segment's name, which its start would
    remove as a leftover."""
    base = _segment_of_live(name)
    if base is not None:
        raise LinkError(
            f"cudalink: link name {name!r} is the name of live link {base!r}'s shared memory "
            f"({name[len(base) :].lstrip('-h')} is its generation); choose another link name"
        )


def published(name: str) -> bool:
    """Whether a live producer holds link ``name`` now (it may be starting or closing)."""
    return _held(name)


def live_links() -> list[str]:
    """This user's links a live producer holds now (``info`` lists them): a producer holds its name's lock file
    in the runtime directory for its whole life, which ``published`` tells from one a dead producer left."""
    try:
        entries = os.listdir(_platform.runtime_dir())
    except OSError:
        return []
    return [n for n in sorted(e.removesuffix(".lock") for e in entries if e.endswith(".lock")) if published(n)]


def _held(name: str) -> bool:
    """Is link ``name`` held by a live producer (its lock taken)? A lock file made by this look is removed."""
    try:
        lock = _platform.ProcessLock(_platform.lock_path(_platform.check_name(name)))
    except LinkError:
        return False
    existed = os.path.exists(lock.path)
    if not lock.acquire():
        return True
    if existed:
        lock.release()
    else:
        lock.remove_and_release()
    return False


_SUFFIX = re.compile(r"-h?[0-9a-f]{16}$")
_TMP = re.compile(r".+\.tcp\.[0-9]+\.tmp")


def clean(
    dry_run: bool = False, only: Sequence[str] | None = None, on_error: Callable[[LinkError], None] | None = None
) -> list[tuple[str, list[str]]]:
    """Remove the links whose producer is dead (its lock free, its leftovers there), and only those.

    Returns each such name with what it left (files and segments). Candidates come from this user's
    runtime directory (locks, sockets, rendezvous files) and, where they can be listed, its shared-memory
    segments; each is judged by taking its lock, which no live producer would let go of. ``only``: just
    these link names. ``on_error``: called with a link that cannot be cleaned (a directory where its socket goes,
    say), and the others cleaned still; without it, that error is raised.
    """
    names: set[str] = set()
    for entry in os.listdir(_platform.runtime_dir()):
        stem, dot, ext = entry.rpartition(".")
        if dot and ext in ("lock", "sock", "tcp"):
            names.add(stem)
        elif _TMP.fullmatch(entry):  # a rendezvous file a producer was killed while writing
            names.add(entry.rsplit(".", 3)[0])
    prefix = _platform.segment_name("")
    for seg in _platform.shm_segments(prefix):
        rest = seg[len(prefix) :]
        names.add(rest)  # a header, or a name that ends like a data segment's suffix: try both
        names.add(_SUFFIX.sub("", rest))
    if only is not None:
        keep = {_platform.check_name(n) for n in only}
        names = {n for n in names if n in keep or _SUFFIX.sub("", n) in keep}
    out = []
    seen: set[str] = set()  # segments already reported under the name they belong to
    for name in sorted(names, key=lambda n: (bool(_SUFFIX.search(n)), n)):  # names before their data segments
        try:
            _platform.check_name(name)
        except LinkError:
            continue  # not one of ours
        # "cam0-<16 hex>" may be the data segment of "cam0": judge it only while cam0 is dead too
        base = _SUFFIX.sub("", name)
        locks = [_platform.ProcessLock(_platform.lock_path(n)) for n in dict.fromkeys((base, name))]
        existed = [os.path.exists(lock.path) for lock in locks]
        had_lock = existed[-1]
        taken: list[_platform.ProcessLock] = []
        try:
            for lock in locks:
                if not lock.acquire(_PEEK_S):
                    break  # alive (or starting, or closing): never touched
                taken.append(lock)
            else:
                files, segments = leftovers(name, unrecorded=True)
                segments = [seg for seg in segments if seg not in seen]
                seen.update(segments)
                if not dry_run:
                    for path in files:
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                    for seg in segments:
                        _unlink_segment(seg)
                left = files + segments + ([locks[-1].path] if had_lock else [])
                if left:
                    out.append((name, left))
        except LinkError as exc:  # something in the way of this link (a directory where its lock goes, say)
            if on_error is None:
                raise
            on_error(exc)
        finally:
            for lock, was in reversed(list(zip(locks, existed, strict=True))):
                if lock not in taken:
                    continue
                if dry_run and was:
                    lock.release()  # a dry run changes nothing
                else:
                    lock.remove_and_release()  # a lock file alone means nothing: a producer makes its own
    return out


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
