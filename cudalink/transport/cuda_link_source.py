"""``Receiver("cuda-link:NAME")``: frames from a cuda-link producer (its TD component or its Python exporter).

cuda-link's segment (layout in :mod:`.cuda_link_wire`) has no control channel: no wake-up, no death notice, no
lease. So this source

- **polls** ``write_idx``. There is no socket to sleep on, so a waiting ``recv()`` sleeps in short bounded
  steps, planned from the stream's own rhythm: it learns the interval between frames, sleeps in one piece
  until ~1.5 ms before the next frame is due, then looks every 100 µs until 2 ms after it; with nothing
  there it looks every 1 ms, and after 100 ms of silence every 5 ms. An idle receiver costs ~200 short
  wake-ups a second; a 60 fps stream ~30 per frame around its arrival. A frame is seen ≤ ~0.2 ms after its
  publish when the stream is regular, ≤ ~1 ms otherwise (plus OS jitter). ``wait="spin"`` polls without
  sleeping (lowest latency, one busy core). ``fileno()`` starts one small poller thread (same plan) that
  makes a socket readable when a frame may be there, for selectors and asyncio. On Windows, where a cuda-link
  producer may ring a doorbell (the auto-reset event ``Local\\cudalink_db_<name>``), a waiting ``recv()``
  sleeps on it instead, with the same plan as its timeout, where ``CUDALINK_DOORBELL=1`` says this reader is
  its only waiter (each ring wakes one waiter: cuda-link's rule; untested on Windows so far).
- delivers the newest frame only: the layout describes just that one (``latest=False`` acts as ``True``).
- gives each frame ``seq = write_idx`` (frames the producer published since it initialised the segment);
  frames overwritten before we looked count as skipped.
- treats a version change as a restart: the attachment reports the producer gone, the Receiver re-attaches,
  re-imports every handle, and a new ``generation`` begins (no frame of the old version is delivered).
- treats the shutdown flag as ``ProducerGone``. A producer that dies without setting it is seen only as
  silence (``LinkTimeout``): the layout has no liveness signal.
- ``copy="auto"`` (default) or ``"always"``: each frame is copied on the GPU into a buffer this Receiver owns,
  after the slot's ready event (the CPU never blocks), so it stays valid however long it is held: cuda-link's
  producer never waits for readers and rewrites a slot ``N`` frames later. ``copy="never"``: zero copy, the
  frame points into the producer's slot; **it may be overwritten while you read it** once the producer has
  published ``N`` more frames (N = its slot count, typically 2 to 3: ~33 ms at 60 fps). Use it only when you
  finish with each frame quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Protocol

from .. import _platform
from ..errors import ArgumentError, ArgumentTypeError, LinkError, ProtocolError
from ..frames.frame import Frame, _Hold
from . import cuda_link_wire as cw
from .base import NoProducer
from .shm import EmptySegment, Segment, _open_segment
from .source import account, copy_mode

if TYPE_CHECKING:
    from .._native.dlpack import Exporter
    from ..cuda.driver import RawEvent
    from ..cuda.landing import Landed, Landing
    from ..frames.spec import FrameSpec
    from .source import Attachment

__all__ = ["PREFIX", "CudaLinkAttachment", "CudaLinkSource", "SlotMemory", "strip_prefix"]

PREFIX = "cuda-link:"

_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_WRAP = 1 << 32
#: a timestamp past this (seconds on the writer's perf_counter) is not one: the frame gets its arrival time
_TS_MAX_S = 1e9

#: the poll plan (seconds): see the module docstring
FINE_STEP = 1e-4
COARSE_STEP = 1e-3
IDLE_STEP = 5e-3
IDLE_AFTER = 0.1
EARLY = 1.5e-3
LATE = 2e-3


def strip_prefix(name: str) -> str:
    """``cuda-link:NAME`` -> ``NAME``, taken as given (cuda-link's names hold ``>`` and other characters)."""
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"cudalink: a cuda-link segment name is a str, got {type(name).__name__} {name!r}; write it as cuda-link "
            f"shows it (e.g. 'cuda-link:{cw.DEFAULT_NAMES[1]}')"
        )
    seg = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    if not _platform.segment_name_ok(seg):
        raise ArgumentError(
            f"cudalink: {name!r} is not a cuda-link segment name; write cuda-link:NAME with NAME as cuda-link "
            f"shows it (e.g. cuda-link:{cw.DEFAULT_NAMES[1]})"
        )
    return seg


def _perf_to_wall_ns() -> int:
    """Offset that turns the producer's ``time.perf_counter()`` into ``time.time_ns()``: perf_counter is the
    system-wide monotonic clock on Linux (CLOCK_MONOTONIC) and Windows (QPC), so it is shared by processes."""
    return time.time_ns() - time.perf_counter_ns()


# -- slot memory: CUDA IPC handles, or host memory in the tests ---------------------------------------------


class SlotMemory(Protocol):
    """How an attachment reaches the producer's slots and builds frames from them."""

    device: int  #: CUDA ordinal; -1 for host memory (the tests' stand-in)

    def open(self, slot: int, memory: bytes, event: bytes) -> int:
        """Map ``slot`` from its handles (once per version); return the bytes it can hold."""

    def frame(self, slot: int, spec: FrameSpec, seq: int, ts_ns: int, generation: int) -> Frame:
        """A frame of ``slot``'s current content (copied or not, as the memory was built)."""

    def held(self) -> int:
        """Frames (and their exports) still alive."""

    def close(self) -> None:
        """Unmap everything (once nothing is held)."""


class _Sync:
    """A CUDA frame's ordering: the consumer's stream waits on one event (GPU-side)."""

    __slots__ = ("ev", "stream")

    def __init__(self, ev: RawEvent, stream: int) -> None:
        self.ev = ev
        self.stream = stream

    def wait(self, stream: int) -> None:
        from ..cuda import driver

        driver.wait(stream, self.ev)

    def cai_stream(self) -> int | None:
        from ..cuda import driver

        driver.wait(self.stream, self.ev)
        return self.stream


class _LandedHold(_Hold):
    """A copied frame's hold: its death fences the consumer's reads and gives the landing buffer back."""

    __slots__ = ("landed",)

    def __init__(self, landed: Landed) -> None:
        self.owner = landed
        self.ptr = landed.ptr
        self.streams = []
        self.on_release = None
        self.landed: Landed | None = landed

    def __del__(self) -> None:
        landed = self.landed
        if landed is not None:
            self.landed = None
            try:  # not contextlib.suppress: modules may be torn down at interpreter exit
                landed.give_back(self.streams)
            except Exception:
                pass


class _SlotHold(_Hold):
    """A zero-copy frame's hold: counts the frame alive, so the slots stay mapped while it is."""

    __slots__ = ("mem",)

    def __init__(self, mem: CudaSlotMemory, ptr: int) -> None:
        self.owner = mem
        self.ptr = ptr
        self.streams = []
        self.on_release = None
        self.mem: CudaSlotMemory | None = mem

    def __del__(self) -> None:
        mem = self.mem
        if mem is not None:
            self.mem = None
            try:  # not contextlib.suppress: modules may be torn down at interpreter exit
                mem.gone()
            except Exception:
                pass


#: landing buffers a copying Receiver may hold at once (frames held + copies in flight)
LANDING_LIMIT = 16


class CudaSlotMemory:
    """Slots mapped from cuda-link's legacy handles (``cudaIpcMemHandle_t``/``cudaIpcEventHandle_t``).

    With ``copy`` every frame lands in a buffer of issue 36's landing pool, copied on this memory's stream
    after the slot's event; the slots are unmapped as soon as those copies have run. Without it frames point
    into the slots, which stay mapped until the last one is released.
    """

    def __init__(self, ordinal: int, copy: bool) -> None:
        from ..cuda import devices, driver, memory

        self._driver = driver
        self.dev = devices.device(ordinal)
        self.device = ordinal
        self.dev.set_current()
        self.stream = self.dev.create_stream()
        self.stream_int = driver.stream_handle(self.stream)
        self.importer = memory.LegacyImporter(self.dev, [])
        self._allocation_bytes = memory.allocation_bytes
        self.copy = copy
        self.landing: Landing | None = None
        self._slots: dict[int, tuple[int, object, object, RawEvent | None]] = {}
        self._exports: dict[tuple[int, int], tuple[FrameSpec, Exporter | None]] = {}
        self._live = 0
        self._lock = threading.Lock()
        self._closing = False
        self._closed = False
        self._tls = threading.local()
        self._tls.ok = True  # set_current above

    def _current(self) -> None:
        """Our device's context current on this thread (attach may run on a worker thread, frames on another)."""
        if not getattr(self._tls, "ok", False):
            self.dev.set_current()
            self._tls.ok = True

    def open(self, slot: int, memory: bytes, event: bytes) -> int:
        from ..cuda import devices

        with devices.keep_current():  # opened in the producer GPU's context, whatever device the caller is on
            self.dev.set_current()
            return self._open(slot, memory, event)

    def _open(self, slot: int, memory: bytes, event: bytes) -> int:
        d = self._driver
        if not any(memory):
            raise NoProducer(f"slot {slot} has no memory handle yet (the producer is starting or closing)")
        try:
            ptr, keep = self.importer.open(memory, 0, self.stream)
        except LinkError as exc:
            raise NoProducer(f"could not open slot {slot}'s memory handle ({exc}); the producer may be gone") from exc
        ev_obj: object = None
        ev: RawEvent | None = None
        if any(event):
            try:
                ev_obj = d.import_event(event, 0)
            except LinkError as exc:
                self.importer.close_one(keep, self.stream)
                raise NoProducer(
                    f"could not open slot {slot}'s event handle ({exc}); the producer may be gone"
                ) from exc
            ev = d.raw(ev_obj)  # type: ignore[arg-type]
        self._slots[slot] = (ptr, keep, ev_obj, ev)
        return self._allocation_bytes(ptr)

    def frame(self, slot: int, spec: FrameSpec, seq: int, ts_ns: int, generation: int) -> Frame:
        if not getattr(self._tls, "ok", False):
            self._current()
        ptr, _, _, ev = self._slots[slot]
        hold: _Hold
        sync: object
        if self.copy:
            landing = self.landing
            if landing is None or landing.nbytes < spec.nbytes:
                from ..cuda.landing import Landing

                if landing is not None:
                    landing.close()  # held buffers are freed as their frames go
                landing = self.landing = Landing(self.device, spec.nbytes, limit=LANDING_LIMIT, stream=self.stream_int)
            landed = landing.land(ptr, spec.nbytes, after=ev, stream=self.stream_int)
            dst = landed.ptr
            hold, sync = _LandedHold(landed), landed
        else:
            dst = ptr
            hold = _SlotHold(self, ptr)
            sync = _Sync(ev, self.stream_int) if ev is not None else None
            with self._lock:
                self._live += 1
        export = self._export(dst, spec)
        return Frame._received(spec, hold, self.device, seq, ts_ns, b"", sync, generation, None, export)  # type: ignore[arg-type]

    def _export(self, ptr: int, spec: FrameSpec) -> Exporter | None:
        key = (ptr, id(spec))
        got = self._exports.get(key)
        if got is None or got[0] is not spec:
            from ..cuda import arrays

            if len(self._exports) > 256:
                self._exports.clear()
            got = self._exports[key] = (spec, arrays.dlpack_exporter(ptr, spec, self.device))
        return got[1]

    def gone(self) -> None:
        with self._lock:
            self._live -= 1
            last = self._live == 0 and self._closing
        if last:
            self._close_now()

    def held(self) -> int:
        if self.landing is not None:
            return int(self.landing.stats()["held"])
        return self._live

    def close(self) -> None:
        """Unmap now (copied frames live in our own buffers), or when the last zero-copy frame goes."""
        with self._lock:
            self._closing = True
            now = self._live == 0
        if now:
            self._close_now()

    def _close_now(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            self.dev.set_current()
            self.stream.sync()  # every copy out of the slots has run
        if self.landing is not None:
            with contextlib.suppress(Exception):
                self.landing.close()  # idle buffers now, held ones as their frames go
        for _ptr, keep, _ev_obj, _ev in self._slots.values():
            with contextlib.suppress(Exception):
                self.importer.close_one(keep, self.stream)  # (our own slots, in a same-process pair: nothing)
        # imported events are dropped, not closed: in a same-process pair they are the Sender's own
        self._slots.clear()
        self._exports.clear()


# -- the source ------------------------------------------------------------------------------------------------


def _generation(ino: int, version: int, handle: bytes = b"") -> int:
    """A producer generation from the segment's identity, its version and slot 0's memory handle: a producer
    that re-creates the segment (version back to 1, maybe the same inode) is a new generation too."""
    digest = hashlib.blake2b(f"{ino}:{version}:".encode() + handle, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1 | 1


def _ino(shm_fd: int) -> int:
    try:
        return os.fstat(shm_fd).st_ino if shm_fd >= 0 else 0
    except OSError:
        return 0


def doorbell_wanted(env: str | None = None) -> bool:
    """``CUDALINK_DOORBELL=1``, cuda-link's own switch: this reader is the doorbell's only waiter."""
    value = os.environ.get("CUDALINK_DOORBELL", "") if env is None else env
    return value.strip().lower() in ("1", "true", "yes", "on")


class CudaLinkSource:
    """Where a ``Receiver("cuda-link:NAME")`` gets its frames: cuda-link's segment, by polling."""

    def __init__(
        self,
        name: str,
        *,
        device: int | str | None = None,
        copy: object = "auto",
        memory: object = None,
    ) -> None:
        #: the SharedMemory segment's name, as cuda-link spells it
        self.segment = strip_prefix(name)
        #: what the Receiver's messages show
        self.name = PREFIX + self.segment
        self.copy = copy_mode(copy) != "never"  # auto = copy: the producer never waits for us
        if device == "cpu" and memory is None:
            raise ArgumentError(
                "cudalink: cuda-link segments hold GPU memory only; use device=None or a CUDA device "
                "(device='cpu' exists for cudalink's own links)"
            )
        self._device = device
        #: builds the slot memory of each attachment (tests pass a host stand-in)
        self._memory = memory
        #: the write_idx of the last frame our previous attachment took: where a writer that keeps counting
        #: across an in-place re-init (cuda-link's TD extension) carries on from
        self._prior = 0

    def _make_memory(self) -> SlotMemory:
        if self._memory is not None:
            made: SlotMemory = self._memory() if callable(self._memory) else self._memory  # type: ignore[assignment]
            return made
        from ..cuda import devices

        ordinal = 0 if self._device is None else devices.parse_device(self._device)
        with devices.gpu_only("reading a cuda-link segment"):
            return CudaSlotMemory(ordinal, self.copy)

    def attach(self, deadline: float, dead_generation: int) -> CudaLinkAttachment:
        try:
            shm = _open_segment(self.segment)
        except EmptySegment as exc:
            raise NoProducer(str(exc)) from exc
        except FileNotFoundError as exc:
            raise NoProducer(f"no cuda-link segment named {self.segment!r} (start the cuda-link producer)") from exc
        except OSError as exc:
            raise LinkError(
                f"cudalink: cannot open cuda-link segment {self.segment!r}: {exc}; check the name (cuda-link's "
                f"component shows it, e.g. {cw.DEFAULT_NAMES[1]!r})"
            ) from exc
        seg = Segment(shm)
        buf = seg.buf
        try:
            if len(buf) >= cw.HEADER_SIZE:
                if _U32.unpack_from(buf, cw.OFF_MAGIC)[0] == 0:
                    raise NoProducer("the segment exists but its producer has not initialised it yet")
                if _U32.unpack_from(buf, cw.OFF_NUM_SLOTS)[0] == 0:  # cuda-link's Python writers: magic, version, N
                    raise NoProducer("the producer is initialising the segment (no slots yet)")
            header = cw.read_header(buf, self.segment)
            if header.version == 0:
                raise NoProducer("the producer is initialising the segment (version 0)")
            n = header.num_slots
            if cw.read_shutdown(buf, n):
                raise NoProducer("the producer closed this segment; waiting for a new one")
            # the handles as read once: what is imported below and what the first frame checks (a writer may
            # write new ones while the imports, milliseconds each on a GPU, run)
            handles = bytes(buf[: cw.off_memory(n)])
            generation = _generation(_ino(getattr(shm, "_fd", -1)), header.version, cw.read_handles(handles, n, 0)[0])
            if generation == dead_generation:
                raise NoProducer("only the closed producer's leftovers are there")
            try:
                meta = cw.read_metadata(buf, n, header.magic)
            except cw.FormatNotPublished as exc:
                raise NoProducer("the producer has not published a frame format yet") from exc
            spec = cw.spec_from_meta(meta)
            mem = self._make_memory()
            try:
                sizes = [mem.open(i, *cw.read_handles(handles, n, i)) for i in range(n)]
            except BaseException:
                mem.close()
                raise
            if cw.read_version(buf) != header.version:
                mem.close()
                raise NoProducer("the producer re-initialised the segment while we attached")
        except BaseException:
            del buf
            seg = None  # type: ignore[assignment]
            raise
        att = CudaLinkAttachment(
            self.segment, seg, header, meta, spec, mem, generation, min(sizes), handles[cw.off_memory(0) :]
        )
        # cuda-link's doorbell is an auto-reset event: each ring wakes exactly one waiter, so a reader that
        # waits on it steals the wake-ups of the TD TOP or importer beside it (cuda-link calls it single-waiter
        # and makes its own importer opt in): ours waits on it only where asked, as cuda-link's does
        if doorbell_wanted():
            att._bell = _platform.Doorbell.open(self.segment)  # Windows, where the producer rings one; else None
        att._source, att._prior = self, self._prior
        return att

    def close(self) -> None:
        pass


def _receive(rx: object, att: CudaLinkAttachment) -> Frame | None:
    """The newest unseen frame, or None; never blocks (one read of write_idx when there is none)."""
    w = _U32.unpack_from(att.buf, cw.OFF_WRITE_IDX)[0]
    if w == att._seen:
        return None
    return att._take(rx, w)


def _sleep_receive(rx: object, att: CudaLinkAttachment, timeout: float, waiting: int, after: int) -> Frame | None:
    """Sleep by the poll plan until a frame may be there (or ``timeout``), then take it (or None)."""
    frame = _receive(rx, att)
    if frame is not None:
        return frame
    att.wait_change(timeout)
    return _receive(rx, att)


class CudaLinkAttachment:
    """One cuda-link producer version, as one Receiver sees it."""

    backend = "cuda-link"

    def __init__(
        self,
        name: str,
        seg: Segment,
        header: cw.Header,
        meta: cw.Metadata,
        spec: FrameSpec,
        mem: SlotMemory,
        generation: int,
        capacity: int,
        handles: bytes = b"",
    ) -> None:
        self.name = name
        self.seg = seg
        self.buf = seg.buf
        self.n = header.num_slots
        self.magic = header.magic
        self.version = header.version
        self.generation = generation
        self.mem = mem
        self.device = "cpu" if mem.device < 0 else f"cuda:{mem.device}"
        #: how frames reach the Receiver (``stats()["path"]``): copied into its own buffers, or the slot itself
        self.path = "copy" if getattr(mem, "copy", False) else "zero-copy"
        self.capacity = capacity
        #: the handle bytes imported: cuda-link's Python writers bump the version *before* writing new handles,
        #: so an attach in between imports the old ones; the first frame (published after its writer's init)
        #: checks them (a mismatch is a restart)
        self._handles = handles
        #: frames published before we joined: the newest of them is still delivered, none counts as skipped
        self.floor = max(0, header.write_idx - 1)
        self._fresh = header.write_idx == 0  # joined a segment just (re)initialised
        self._source: CudaLinkSource | None = None
        self._prior = 0
        self._ino = _ino(getattr(seg._shm, "_fd", -1))
        self._off_meta = cw.off_metadata(self.n)
        self._off_ts = cw.off_timestamp(self.n)
        self._off_shutdown = cw.off_shutdown(self.n)
        self._meta_raw = bytes(self.buf[self._off_meta : self._off_meta + cw.META_SIZE])
        self._spec = spec
        self._meta = meta
        self._seen = 0  # the write_idx last looked at: a frame taken, or 0 (nothing there)
        self._taken = 0  # the write_idx of the last frame taken (0: none yet), for seeing it wrap
        self._epoch = 0  # write_idx wraps at 2**32: seq keeps counting
        self._shift = 0  # seq minus the writer's count, where its write_idx went back (see _take)
        self._restarted = False
        self._wall = _perf_to_wall_ns()
        self._last_arrival = 0.0
        self._period = 0.0
        self._poller: _Poller | None = None
        self._detached = False
        self._interrupted = False
        #: cuda-link's optional doorbell (Windows): a waiting recv sleeps on it, the poll plan as its timeout
        self._bell: _platform.Doorbell | None = None

    # -- per frame ---------------------------------------------------------------------------------------

    receive = staticmethod(_receive)
    sleep_receive = staticmethod(_sleep_receive)

    def _take(self, rx: object, w: int) -> Frame | None:
        buf = self.buf
        for _ in range(8):  # the producer may publish while we read: re-read until write_idx holds still
            if _U32.unpack_from(buf, cw.OFF_WRITE_IDX)[0] != w:
                w = _U32.unpack_from(buf, cw.OFF_WRITE_IDX)[0]
                continue
            if struct.unpack_from("<Q", buf, cw.OFF_VERSION)[0] != self.version:
                self._restarted = True
                return None
            if w == 0:
                self._seen = 0  # looked at: a waiting recv sleeps until it changes (not spins on it)
                return None
            raw = bytes(buf[self._off_meta : self._off_meta + cw.META_SIZE])
            ts = _F64.unpack_from(buf, self._off_ts)[0]
            w2 = _U32.unpack_from(buf, cw.OFF_WRITE_IDX)[0]
            if w2 == w:
                break
            w = w2
        else:
            return None  # the producer outran eight reads: take it next time
        if not self._taken and not self._first(rx, w):
            return None
        if raw != self._meta_raw:
            meta = cw.read_metadata(bytes(self._off_meta) + raw, self.n, self.magic)  # the bytes read with w
            self._spec = cw.spec_from_meta(meta)
            self._meta, self._meta_raw = meta, raw
        spec = self._spec
        if spec.nbytes > self.capacity:
            raise ProtocolError(
                f"cudalink: cuda-link producer of {self.name!r} announced {spec.shape} {spec.dtype.name} "
                f"({spec.nbytes} bytes) but its slots hold {self.capacity}; the producer must re-initialise the "
                f"segment when its frame grows"
            )
        if w <= self._taken:
            if self._taken - w > _WRAP // 2:
                self._epoch += _WRAP  # past 2**32: the u32 wrapped
            else:  # a step back with the same version, against the layout (a writer counting anew, a glitch):
                self._shift += self._taken - w + 1  # seq still grows by one; the slot follows the writer's count
        count = self._epoch + w  # the writer's own count of frames: what picks the slot
        seq = count + self._shift
        self._seen = self._taken = w
        now = time.monotonic()
        if self._last_arrival:
            dt = now - self._last_arrival
            if dt < 1.0:
                self._period = dt if not self._period else self._period + (dt - self._period) / 8
        self._last_arrival = now
        account(rx, seq)  # type: ignore[arg-type]
        ts_ns = int(ts * 1e9) + self._wall if 0 < ts < _TS_MAX_S else time.time_ns()
        # the slot from the unwrapped count: past 2**32 a writer keeps counting slots (N need not divide 2**32)
        return self.mem.frame((count - 1) % self.n, spec, seq, ts_ns, self.generation)

    def _first(self, rx: object, w: int) -> bool:
        """The attachment's first frame: are the handles we imported still the segment's? Else the producer
        re-initialised while we attached (a restart, seen as one). Also where its count starts: a writer that
        kept counting across an in-place re-init (cuda-link's TD extension: its first frame comes within a ring
        of the last one we took) skipped only what it published since that frame, not its whole count."""
        if self._handles and bytes(self.buf[cw.off_memory(0) : cw.off_memory(self.n)]) != self._handles:
            self._restarted = True
            return False
        if self._fresh and 0 < self._prior < w <= self._prior + self.n and getattr(rx, "_floor", None) == 0:
            rx._floor = self._prior  # type: ignore[attr-defined]
        return True

    # -- waiting -------------------------------------------------------------------------------------------

    def interrupt(self) -> None:
        """The Receiver is being closed: its waiting recv stops sleeping (at the next step of the poll plan)."""
        self._interrupted = True

    def _changed(self) -> bool:
        buf = self.buf
        return bool(
            self._interrupted
            or _U32.unpack_from(buf, cw.OFF_WRITE_IDX)[0] != self._seen
            or buf[self._off_shutdown]
            or struct.unpack_from("<Q", buf, cw.OFF_VERSION)[0] != self.version
        )

    def _step(self, now: float, since: float) -> float:
        """How long to sleep now, by the poll plan (``since``: when this wait began)."""
        period, last = self._period, self._last_arrival
        if period > 0 and last and now - last < max(IDLE_AFTER, 4 * period):
            due = last + period
            if now > due + LATE:  # frames missed: plan for the next one due
                due += period * math.ceil((now - LATE - due) / period)
            if now < due - EARLY:
                return due - EARLY - now
            if now < due + LATE:
                return FINE_STEP
        return IDLE_STEP if now - since > IDLE_AFTER else COARSE_STEP

    def wait_change(self, timeout: float) -> None:
        """Sleep by the poll plan until write_idx, the version or the shutdown flag changes, or ``timeout``."""
        start = time.monotonic()
        end = start + max(0.0, timeout)
        bell = self._bell
        while not self._changed():
            now = time.monotonic()
            if now >= end:
                return
            step = min(self._step(now, start), end - now)
            if bell is not None:
                bell.wait(step)  # rung at the publish: no poll latency; the plan still bounds the sleep
            else:
                time.sleep(step)

    async def wait_async(self, timeout: float | None) -> None:
        start = time.monotonic()
        end = None if timeout is None else start + max(0.0, timeout)
        while not self._changed():
            now = time.monotonic()
            if end is not None and now >= end:
                return
            step = self._step(now, start)
            await asyncio.sleep(step if end is None else min(step, end - now))

    # -- state ----------------------------------------------------------------------------------------------

    def closing(self) -> bool:
        return bool(self.buf[self._off_shutdown])

    def alive(self) -> bool:
        """False once the producer set shutdown, re-initialised (version change) or a new segment replaced ours."""
        if self._poller is not None:
            self._poller.drain()
        if self._restarted or self.closing():
            return False
        if struct.unpack_from("<Q", self.buf, cw.OFF_VERSION)[0] != self.version:
            self._restarted = True
            return False
        if self._ino:
            now = _platform.shm_inode(self.name)
            if now is not None and now != self._ino:
                return False  # unlinked without a shutdown flag (0), or created anew by another producer
        return True

    def set_waiting(self, state: int) -> None:
        pass  # no one to tell: the producer never wakes anyone

    def count(self, received: int, skipped: int) -> None:
        pass  # the layout has no consumer entries for monitors

    def fileno(self) -> int:
        """A socket readable when a frame may be waiting, made readable by a small poller thread (same plan)."""
        if self._poller is None:
            self._poller = _Poller(self)
        return self._poller.fileno()

    def detach(self) -> None:
        if self._detached:
            return
        self._detached = True
        if self._source is not None and self._taken:
            self._source._prior = self._taken
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        self.mem.close()


class _Poller:
    """A thread that polls for the attachment and writes one byte to a socket when a frame may be there."""

    def __init__(self, att: CudaLinkAttachment) -> None:
        self.att = att
        self.rsock, self.wsock = socket.socketpair()
        self.rsock.setblocking(False)
        self.wsock.setblocking(False)
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"cudalink-poll-{att.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        att = self.att
        signalled = -1
        since = time.monotonic()
        while not self.stop_flag.is_set():
            w = _U32.unpack_from(att.buf, cw.OFF_WRITE_IDX)[0]
            closing = att.closing()
            if (w != att._seen and w != signalled) or closing:
                signalled = w
                since = time.monotonic()
                with contextlib.suppress(OSError):
                    self.wsock.send(b"\x01")
                if closing:
                    return
            self.stop_flag.wait(att._step(time.monotonic(), since))

    def fileno(self) -> int:
        return self.rsock.fileno()

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while self.rsock.recv(256):
                pass

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(1.0)
        self.rsock.close()
        self.wsock.close()


if TYPE_CHECKING:

    def _is_attachment(att: CudaLinkAttachment) -> Attachment:
        return att
