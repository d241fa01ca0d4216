"""``Sender(NAME, ..., protocol="cuda-link")``: publish frames in cuda-link's segment layout, so an existing
cuda-link importer or TouchDesigner component (its CUDA IPC In TOP / Python extension) reads them.

The layout (:mod:`.transport.cuda_link_wire`) has no control channel, no leases and no back-pressure: each
slot is a ``cuMemAlloc`` block (rounded up to 2 MiB, frame at offset 0) shared with ``cuIpcGetMemHandle``,
with one IPC event (interprocess, timing disabled) recorded after each copy. Per frame: the copy on the
caller's stream (or the link's), the slot's event, the timestamp, shutdown = 0, and ``write_idx + 1`` last;
the CPU never waits for the GPU (on Windows it then rings cuda-link's doorbell event). The slot written is
``write_idx mod N``, whoever still reads it: cuda-link's readers copy or finish a frame within ``N`` frames
(cudalink's own ``Receiver("cuda-link:...")`` copies by default).

Initialisation writes everything else first and the version (old + 1) last, as cuda-link's C++ TOP does (its
Python writers bump the version first; cudalink's reader guards against that, see ``cuda_link_source``); a
segment that already exists under the name (a previous producer's, gone or idle) is taken over, so readers see a
version change and re-import; one of another slot count is closed for its readers (shutdown = 1) and replaced.
One whose frames keep coming (a live writer: the layout names none) is refused, as is a second cudalink writer.
``reconfigure`` re-initialises the same way (cuda-link's metadata describes every slot at once, so a format
change is a restart for its readers). ``close``: shutdown = 1, handles zeroed, ~100 ms of
grace for readers to let go, then the slots are freed and the segment unlinked.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import DTypeLike

from . import _backends, _platform
from .cuda import devices
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    FormatError,
    LinkClosed,
    LinkError,
    int_arg,
    seconds_arg,
    timestamp_arg,
)
from .frames.frame import Frame
from .frames.spec import FrameSpec, PixelFormat, RowOrigin
from .transport import cuda_link_wire as cw
from .transport import wire
from .transport.cuda_link_source import strip_prefix
from .transport.shm import EmptySegment, _open_segment, _unlink_segment

if TYPE_CHECKING:
    from multiprocessing import shared_memory

    from .cuda.objects import Stream

__all__ = ["GRACE_S", "CudaLinkSender"]

#: how long ``close`` leaves readers to see the shutdown flag and let go before the slots are freed
GRACE_S = 0.1


class CudaLinkSender:
    """The same public API as :class:`cudalink.Sender` (``send``, ``reserve``, ``reconfigure``, ``stats``,
    ``close``, a context manager), writing cuda-link's layout. Made by ``Sender(..., protocol="cuda-link")``.

    ``slots`` is cuda-link's N (1..10). There is no ``policy="block"`` (cuda-link readers take no leases) and no
    ``meta`` (the layout has no room for it); frames are (height, width, channels) images of uint8, uint16,
    float16 or float32, the types cuda-link's own exporter writes (its readers turn the rest into other types),
    bottom-up as TD lays them out (``origin="bottom"``: the layout cannot say otherwise).
    """

    def __init__(
        self,
        name: str,
        *,
        shape: tuple[int, ...] | list[int],
        dtype: DTypeLike = "uint8",
        slots: int = 3,
        device: int | str = 0,
        pixel_format: PixelFormat | str | None = None,
        origin: RowOrigin | str = RowOrigin.BOTTOM,
        strides: tuple[int, ...] | None = None,
        capacity: int | None = None,
        policy: str = "drop",
        timeout: float = 1.0,
        max_consumers: int = 16,
        handles: str = "auto",
        transport: object = None,
        protocol: str = "cuda-link",
        magic: int = cw.MAGIC,
    ) -> None:
        self._closed = True  # until the segment is ours: a refused Sender never unlinks the name (a live one)
        self.name = strip_prefix(name)
        if device == "cpu":
            raise ArgumentError(
                "cudalink: cuda-link's layout shares GPU memory only (cudaIpcMemHandle); pass device=0 (or "
                "'cuda:N'), or use protocol='cudalink' for a CPU link"
            )
        not_int = isinstance(slots, bool) or not isinstance(slots, int)
        if not_int or not cw.MIN_SLOTS <= slots <= cw.MAX_SLOTS:
            raise (ArgumentTypeError if not_int else ArgumentError)(
                f"cudalink: cuda-link segments have 1..10 slots, got slots={slots!r}"
            )
        timeout = seconds_arg(timeout, "timeout", "timeout=1.0", none_ok=True)
        int_arg(
            max_consumers, "max_consumers", 1, wire.MAX_CONSUMERS, "max_consumers=16"
        )  # no use here: checked as Sender does
        if capacity is not None:
            int_arg(capacity, "capacity", 0, 2**62, "capacity=None (one frame)")
        if policy != "drop":
            raise ArgumentError(
                "cudalink: cuda-link readers take no leases, so a cuda-link Sender always overwrites the oldest slot; "
                "leave policy='drop'"
            )
        if handles not in ("auto", "legacy"):
            raise ArgumentError(f"cudalink: cuda-link shares legacy cuIpc handles; handles={handles!r} is not possible")
        if magic not in cw.MAGICS:
            raise ArgumentError(
                f"cudalink: magic must be cuda-link's 0x{cw.MAGIC:08X} (or v0.9's 0x{cw.MAGIC_V09:08X})"
            )
        spec = FrameSpec(shape, dtype, strides, pixel_format, origin)
        meta = _written_meta(spec)
        if magic == cw.MAGIC_V09:
            cw.write_metadata(bytearray(cw.segment_size(1)), 1, meta, magic)  # refuses what v0.9 cannot name
        self.timeout = timeout
        self.policy = policy
        self.magic = magic
        self.capacity = cw.allocation_size(max(int(capacity or 0), spec.nbytes))
        self._spec = spec
        self._meta = meta
        self._n = slots
        self._seq = 0
        self._idx = 0  # write_idx as published
        self._dropped = 0
        self._lock = threading.RLock()
        self._wall = time.time_ns() - time.perf_counter_ns()
        self._bell: _platform.Doorbell | None = None
        # cuda-link's layout names no writer, so two cudalink writers of one name would overwrite each other's
        # handles under the readers: the first holds this lock (dropped by the OS if it dies) and refuses a second
        owner = _platform.ProcessLock(writer_lock_path(self.name))
        if not owner.acquire(0.2):
            raise LinkError(
                f"cudalink: cuda-link segment {self.name!r} is already published by a live cudalink Sender; close "
                "that one first, or choose another name"
            )
        try:
            with devices.gpu_only("a cuda-link Sender"):
                self._slots = _backends.CudaSlots(devices.parse_device(device), slots, self.capacity, "legacy")
        except BaseException:
            owner.remove_and_release()
            raise
        self._owner = owner
        self.device = f"cuda:{self._slots.device}"
        try:
            self._shm = self._segment()
            assert self._shm.buf is not None
            self._buf: memoryview = self._shm.buf
            self._initialise()
            self._bell = _platform.Doorbell.create(self.name)  # Windows only: cuda-link's optional doorbell
        except BaseException:
            shm = getattr(self, "_shm", None)
            if shm is not None:  # the segment was ours already: say so to readers and take it away
                with contextlib.suppress(Exception):
                    cw.write_shutdown(shm.buf, self._n, True)
                with contextlib.suppress(Exception):
                    _unlink_segment(self.name)
                with contextlib.suppress(Exception):
                    shm.close()
            self._slots.close(0)
            owner.remove_and_release()
            raise
        self._closed = False

    # -- the segment -------------------------------------------------------------------------------------------

    def _segment(self) -> shared_memory.SharedMemory:
        """This name's segment: a previous producer's is taken over (its version continues), else a new one."""
        size = cw.segment_size(self._n)
        try:
            old = _open_segment(self.name)
        except EmptySegment:  # a producer that died before sizing it: start afresh
            _unlink_segment(self.name)
            old = None
        except FileNotFoundError:
            old = None
        except OSError as exc:  # a name the OS refuses (too long, '.'): said as ours, with the way out
            raise LinkError(
                f"cudalink: cannot use {self.name!r} as a cuda-link segment name ({exc}); choose another name, "
                f"such as cuda-link's {cw.DEFAULT_NAMES[2]!r}"
            ) from exc
        version = 0
        if old is not None:
            buf = old.buf
            assert buf is not None
            try:
                header: cw.Header | None = cw.read_header(buf, self.name)
            except LinkError:  # another layout: start afresh
                header = None
            if _written_now(buf, None if header is None else header.num_slots):
                old.close()
                raise LinkError(
                    f"cudalink: cuda-link segment {self.name!r} is being written by a live producer (a TD "
                    "component or a cuda-link exporter: its frames keep coming); close it first, or choose "
                    "another name"
                )
            if header is not None:
                version = header.version
                if header.num_slots == self._n and len(buf) >= size:
                    self._version = header.version
                    return old
                _say_shutdown(buf, header.num_slots)  # another slot count: its readers must let go, then find ours
            old.close()
            _unlink_segment(self.name)  # another layout or slot count: start afresh
        self._version = 0
        try:
            return _open_segment(self.name, create=True, size=size)
        except FileExistsError as exc:
            # Windows: nothing unlinks a name, which lives while any reader (a TD TOP) holds its mapping. Take
            # that mapping over, laid out anew for our slot count, where it is large enough (Windows rounds
            # mappings up to a page, which holds 10 slots); its version continues, so readers see the change
            again = _open_segment(self.name)
            if again.buf is not None and len(again.buf) >= size:
                self._version = version
                return again
            again.close()
            raise LinkError(
                f"cudalink: cannot create cuda-link segment {self.name!r}: a reader still holds the old one, too small "
                f"for {self._n} slots; close its readers (or keep the slot count), then start again"
            ) from exc
        except OSError as exc:
            raise LinkError(f"cudalink: cannot create cuda-link segment {self.name!r}: {exc}") from exc

    def _initialise(self) -> None:
        """Magic, N, write_idx = 0, handles, shutdown = 0, metadata, timestamp; the version (+1) last."""
        buf, n = self._buf, self._n
        cw.write_header_start(buf, self.magic, n)
        for i, h in enumerate(self._slots.handles()):
            cw.write_handles(buf, i, h.memory, h.event)
        cw.write_shutdown(buf, n, False)
        cw.write_metadata(buf, n, self._meta, self.magic)
        cw.write_timestamp(buf, n, 0.0)
        self._idx = 0
        self._version = self._version % cw.MAX_VERSION + 1  # past u64's last it goes to 1: 0 means "initialising"
        cw.write_version(buf, self._version)

    def _publish(self, timestamp_ns: int | None) -> int:
        """The per-frame tail, after the copy and the slot's event were queued: timestamp, shutdown, write_idx."""
        buf, n = self._buf, self._n
        ts = time.perf_counter() if timestamp_ns is None else (timestamp_ns - self._wall) / 1e9
        cw.write_timestamp(buf, n, ts)
        cw.write_shutdown(buf, n, False)
        self._idx += 1
        cw.write_write_idx(buf, self._idx)  # last: readers take the frame from here
        if self._bell is not None:
            self._bell.ring()  # Windows: wake readers that sleep on cuda-link's doorbell
        self._seq += 1
        return self._seq

    # -- properties ------------------------------------------------------------------------------------------

    @property
    def spec(self) -> FrameSpec:
        return self._spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype[np.generic]:
        return self._spec.dtype

    @property
    def slots(self) -> int:
        return self._n

    @property
    def seq(self) -> int:
        """Sequence number of the last published frame."""
        return self._seq

    @property
    def version(self) -> int:
        """The segment's version: +1 at each (re)initialisation."""
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stream(self) -> Stream | None:
        """The link's own CUDA stream (cuda.core ``Stream``)."""
        return self._slots.stream

    def stats(self) -> dict[str, int]:
        """``published`` and ``dropped`` as a cudalink Sender has; ``consumers`` is unknown here (-1): the
        layout does not say who reads."""
        return {"published": self._seq, "dropped": self._dropped, "consumers": -1, "version": self._version}

    def __repr__(self) -> str:
        return f"<cudalink.Sender cuda-link:{self.name!r} {self._spec.label} slots={self._n} {self.device}>"

    def __reduce__(self) -> tuple[object, ...]:
        """Refused clearly, as a cudalink Sender is: it is this process's writer of the segment."""
        raise ArgumentTypeError(
            f"cudalink: a Sender can't be pickled or passed to another process; make Sender('cuda-link:{self.name}', "
            "...) in the process that produces the frames"
        )

    def _check_open(self, meta: bytes = b"") -> None:
        if self._closed:
            raise LinkClosed(f"cudalink: Sender cuda-link:{self.name!r} is closed; create a new one")
        if meta:
            raise FormatError("cudalink: cuda-link frames carry no meta bytes (the layout has no room for them)")

    # -- sending -------------------------------------------------------------------------------------------------

    def send(
        self,
        array: object,
        *,
        stream: object = None,
        timestamp_ns: int | None = None,
        meta: bytes = b"",
        timeout: float | None = None,
    ) -> int | None:
        """Copy ``array`` into the next slot (queued on ``stream``, or torch's current one, or the link's), record
        the slot's event and publish; returns the frame's seq. The CPU never waits for the GPU."""
        with self._lock:
            if self._closed or meta:
                self._check_open(meta)
            if timestamp_ns is not None:  # refused before a slot is written, as on a cudalink link
                timestamp_ns = timestamp_arg(timestamp_ns)
            checked = self._slots.source(self._spec, array, stream)  # a refused array takes no slot
            slot = self._idx % self._n
            self._slots.copy_in(slot, self._spec, array, stream, [], checked)
            return self._publish(timestamp_ns)

    def reserve(
        self, *, stream: object = None, meta: bytes = b"", timeout: float | None = None, timestamp_ns: int | None = None
    ) -> contextlib.AbstractContextManager[Frame]:
        """Zero-copy: the next slot as a writable Frame, published when the block exits cleanly (the slot's
        event recorded after your streams), stamped ``timestamp_ns`` as ``send()``'s. If the block raises,
        nothing is published."""
        self._check_open(meta)  # here, not only when the block begins
        # a stamp that is no u64 is refused now, as a cudalink link's, not as the block ends
        return _Reservation(self, stream, meta, timestamp_arg(timestamp_ns))

    def reconfigure(
        self,
        shape: tuple[int, ...] | list[int] | None = None,
        dtype: DTypeLike | None = None,
        *,
        pixel_format: PixelFormat | str | None = None,
        origin: RowOrigin | str | None = None,
        strides: tuple[int, ...] | list[int] | None = None,
    ) -> FrameSpec:
        """Change the format; the segment is re-initialised (version + 1), which cuda-link readers treat as a
        restart. Must fit the slots (``capacity``). cuda-link's frames are tightly packed: no ``strides``."""
        with self._lock:
            self._check_open()
            if strides is not None:
                raise FormatError("cudalink: cuda-link frames are tightly packed HWC; reconfigure takes no strides")
            spec = self._spec.reconfigured(shape, dtype, pixel_format, origin, self.capacity)
            meta = _written_meta(spec)
            self._spec, self._meta = spec, meta
            self._initialise()
            if self._bell is not None:
                self._bell.ring()  # a reader asleep on the doorbell sees the new version now, not at its timeout
            return spec

    async def send_async(
        self,
        array: object,
        *,
        stream: object = None,
        timestamp_ns: int | None = None,
        meta: bytes = b"",
        timeout: float | None = None,
    ) -> int | None:
        """``send``, which never waits here (no back-pressure); async for API parity."""
        return self.send(array, stream=stream, timestamp_ns=timestamp_ns, meta=meta)

    # -- teardown ------------------------------------------------------------------------------------------------

    def close(self, timeout: float | None = GRACE_S) -> None:
        """Shutdown = 1 and handles zeroed, ``timeout`` seconds (default 0.1; at most 5, which ``None`` means) for
        readers to let go, then free the slots and unlink the segment."""
        timeout = min(seconds_arg(timeout, "timeout", "close(timeout=0.1)", none_ok=True), 5.0)
        if self._closed:
            return
        with self._lock:
            self._closed = True
            try:
                buf, n = self._buf, self._n
                _say_shutdown(buf, n)
                if self._bell is not None:
                    self._bell.ring()  # cuda-link rings once more at shutdown: a sleeping reader lets go now
                time.sleep(timeout)
            finally:
                self._buf = memoryview(b"")
                with contextlib.suppress(Exception):
                    _unlink_segment(self.name)
                with contextlib.suppress(Exception):
                    self._shm.close()
                if self._bell is not None:
                    self._bell.close()
                    self._bell = None
                self._slots.close(timeout)
                self._owner.remove_and_release()  # last: a new writer of the name finds the segment gone

    def __enter__(self) -> CudaLinkSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # not contextlib.suppress: modules may be torn down at interpreter exit
            if not self._closed:
                self.close()
        except Exception:
            pass


#: how long a new writer watches an existing segment for another writer's frames before it takes it over
LIVE_LOOK_S = 0.1


def _written_now(buf: memoryview, nslots: int | None) -> bool:
    """Whether another writer publishes into ``buf`` now (write_idx or the timestamp moves within LIVE_LOOK_S):
    cuda-link's layout names no writer, so a live one (TD's Out TOP, an exporter) is told by its frames. One that
    is idle or dead is taken over, as before; a closed one (shutdown) needs no look. ``nslots`` None: a header
    we do not parse (cuda-link v0.6.6, a writer half-way through its initialisation), told by its first 20
    bytes, which every cuda-link release lays out alike (write_idx, version, N)."""

    def look() -> object:
        if nslots is None:
            return bytes(buf[: cw.HEADER_SIZE])
        return (cw.read_write_idx(buf), cw.read_timestamp(buf, nslots))

    if nslots is not None and cw.read_shutdown(buf, nslots):
        return False
    first = look()
    end = time.monotonic() + LIVE_LOOK_S
    while time.monotonic() < end:
        time.sleep(0.005)
        if look() != first:
            return True
    return False


def writer_lock_path(name: str) -> str:
    """The lock a cudalink writer of cuda-link segment ``name`` holds; '@' keeps it out of ``clean``'s link
    names (cuda-link names are not cudalink's alphabet, hence the hash)."""
    import hashlib

    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return _platform.lock_path(f"@cuda-link-{digest}")


#: what cuda-link's exporter writes; other readers than its latest decode int8/int16 unsigned, and every
#: version reads int32/uint32 as float32
WRITTEN_DTYPES = ("uint8", "uint16", "float16", "float32")


def _written_meta(spec: FrameSpec) -> cw.Metadata:
    """The metadata for frames of ``spec``, refusing dtypes cuda-link's readers would silently misread, and rows
    they would show upside down: the layout has no origin, and every cuda-link reader (TD's component, its
    importer, cudalink's) takes the rows as TD lays them out, bottom-up."""
    if spec.origin is not RowOrigin.BOTTOM:
        raise FormatError(
            "cudalink: a cuda-link segment's rows run bottom-up (TD's layout; it has no field to say otherwise), so "
            "cuda-link readers would show top-down frames upside down; flip each frame's rows (t.flip(0)) and "
            "pass origin='bottom' (the default for protocol='cuda-link')"
        )
    if spec.dtype.name not in WRITTEN_DTYPES:
        raise FormatError(
            f"cudalink: cuda-link readers (TD's CUDA IPC component, its importer) read {spec.dtype.name} frames as "
            f"another type; send {', '.join(WRITTEN_DTYPES)} (convert first), or use protocol='cudalink'"
        )
    return cw.meta_from_spec(spec)


def _say_shutdown(buf: memoryview, n: int) -> None:
    """Shutdown = 1 and every handle zeroed: how cuda-link tells its readers to let go and look again."""
    cw.write_shutdown(buf, n, True)
    for i in range(n):
        cw.write_handles(buf, i, bytes(cw.HANDLE_SIZE), bytes(cw.HANDLE_SIZE))


class _Reservation:
    """One ``reserve()`` block: the Sender's lock from entry to exit, the slot published on a clean exit."""

    __slots__ = ("_frame", "_stream", "_ts", "_tx")

    def __init__(self, tx: CudaLinkSender, stream: object, meta: bytes, ts: int | None) -> None:
        tx._check_open(meta)
        self._tx = tx
        self._stream = stream
        self._ts = ts
        self._frame: Frame | None = None

    def __enter__(self) -> Frame:
        if self._frame is not None:
            raise LinkError("cudalink: a reserve() block is entered once; call tx.reserve() again for the next frame")
        tx = self._tx
        tx._lock.acquire()
        try:
            tx._check_open()
            slot = tx._idx % tx._n
            self._frame = tx._slots.writable_frame(slot, tx._spec, tx._seq + 1, time.time_ns(), [])
        except BaseException:
            tx._lock.release()
            raise
        return self._frame

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        frame = self._frame
        if frame is None:
            return
        tx = self._tx
        try:
            streams = frame._export_streams()
            frame.release()
            if exc_type is None:
                tx._slots.commit(tx._idx % tx._n, streams, self._stream)
                tx._publish(self._ts)
        finally:
            tx._lock.release()
