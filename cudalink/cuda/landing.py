"""Landing: a small pool of GPU buffers this process owns, where frames from elsewhere land.

A frame that cannot be handed over zero-copy (it lives on another GPU, came over the network, sits in a
cuda-link segment) is copied into one of these buffers and the consumer's frame points there. Nothing
here blocks the CPU per frame:

- :meth:`Landing.land` queues the copy on a copy stream, after the source's ready event (``after=``), and
  records the landed buffer's own ready event after it. The frame's sync makes a consumer stream wait
  on that event on the GPU (:meth:`Landed.wait`).
- :meth:`Landed.give_back` (called when the frame and every export of it are gone) records a fence on
  each consumer stream the frame was exported to. The buffer is reused once its fences have passed;
  when every buffer still has a fence pending, the next copy waits on the oldest one on the GPU.

Copies between GPUs use cuMemcpyPeerAsync with peer access enabled where cuDeviceCanAccessPeer says so
(:data:`~cudalink.cuda.devices.PATH_PEER`), else the same call, which the driver stages through host memory
(:data:`~cudalink.cuda.devices.PATH_STAGED`). :attr:`Landing.path` says which.

The copy stream lives on the *source's* GPU by default: a source's events (a producer's IPC release
events, say) can only be recorded on a stream of their own context, and the caller usually records one
after the copy. Events are created in the context of whatever stream they are recorded on.

The pool's bookkeeping talks to the GPU only through :class:`Ops`, so it is tested with fake pointers and
events on machines without one (``tests/test_landing.py``).

Usage::

    pool = Landing(device=1, nbytes=frame_bytes, src_device=0)
    landed = pool.land(src_ptr, frame_bytes, after=ready_event)   # queued; the CPU does not wait
    consumer_stream_waits = landed.wait                            # a FrameSync: wait(stream), cai_stream()
    ...                                                            # landed.ptr on cuda:1, landed.nbytes
    landed.give_back(streams_the_frame_went_to)                    # GPU-side fence; the buffer returns
    pool.close()                                                   # frees idle buffers now, held ones later
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Protocol, SupportsInt, cast

from ..errors import LandingFull, LinkError
from . import devices, driver
from .driver import RawEvent

__all__ = ["Landed", "Landing", "LandingFull", "Ops"]

#: buffers a pool may own at most unless told otherwise (frames held + copies in flight + fences pending)
DEFAULT_LIMIT = 8


class Ops(Protocol):
    """What the pool asks of the GPU. :class:`CudaOps` is the real one; tests pass fakes."""

    device: int  #: where the buffers live
    path: str  #: devices.PATH_*: how copies into them run

    def alloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def context_of(self, stream: int) -> int:
        """The context a stream belongs to (events recorded on it must come from there)."""
        ...

    def new_event(self, ctx: int) -> RawEvent: ...
    def destroy_event(self, ev: RawEvent) -> None: ...
    def record(self, ev: RawEvent, stream: int) -> None: ...
    def wait(self, stream: int, ev: RawEvent) -> None: ...
    def done(self, ev: RawEvent) -> bool: ...
    def sync(self, ev: RawEvent) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def copy_2d(self, dst: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None: ...
    def copy_stream(self) -> int:
        """The stream copies run on when the caller names none (made once)."""
        ...

    def local_stream(self) -> int:
        """A stream on :attr:`device`, for ``__cuda_array_interface__`` (made once)."""
        ...

    def close(self) -> None: ...


class _Buffer:
    """One buffer of the pool: its memory, its events (per context) and the fences its last frame left."""

    __slots__ = ("fences", "held", "ptr", "ready")

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.held = False
        self.ready: dict[int, RawEvent] = {}  # ctx -> the ready event recorded after copies there
        self.fences: dict[int, tuple[RawEvent, bool]] = {}  # stream -> (event, recorded for the last frame)


class Landed:
    """One landed frame's buffer: ``ptr`` on ``device``, ready once :attr:`ready` has passed.

    It is also a ``FrameSync`` (:meth:`wait`, :meth:`cai_stream`), so a Frame can order its consumers
    after the copy with it. :meth:`give_back` exactly once, when the frame and all its exports are gone.
    """

    __slots__ = ("_buf", "_pool", "device", "nbytes", "ptr", "ready")

    def __init__(self, pool: Landing, buf: _Buffer, nbytes: int, ready: RawEvent | None) -> None:
        self._pool: Landing | None = pool
        self._buf = buf
        self.ptr = buf.ptr
        self.nbytes = nbytes
        self.device = pool.device
        self.ready = ready

    def wait(self, stream: int) -> None:
        """Make ``stream`` wait, on the GPU, until the copy into this buffer has run."""
        pool = self._pool
        if pool is not None and self.ready is not None:
            pool.ops.wait(stream, self.ready)

    def cai_stream(self) -> int | None:
        """A stream on this buffer's GPU where the data is ready (``__cuda_array_interface__``'s ``stream``)."""
        pool = self._pool
        if pool is None:
            return None
        s = pool.ops.local_stream()
        self.wait(s)
        return s

    def mark_ready(self, stream: int) -> None:
        """For buffers from :meth:`Landing.take`: record the ready event after what ``stream`` queued."""
        pool = self._pool
        if pool is None:
            raise LinkError("cudalink: this landed buffer was given back")
        self.ready = pool._record_ready(self._buf, stream)

    def give_back(self, streams: list[int]) -> None:
        """The frame and every export are gone: fence the buffer on ``streams`` (the consumer streams it was
        exported to) and return it to the pool. Safe to call twice; the second call does nothing."""
        pool = self._pool
        if pool is not None:
            self._pool = None
            pool._give_back(self._buf, streams)


class Landing:
    """A pool of up to ``limit`` buffers of ``nbytes`` on GPU ``device``, for frames copied from
    ``src_device`` (default: the same GPU). Buffers are allocated as needed and kept for reuse.

    ``stream``: the copy stream (a raw handle) when the caller's copies all go on one of its own; by
    default the pool makes one on ``src_device``. ``ops`` replaces the GPU (tests).
    """

    def __init__(
        self,
        device: int,
        nbytes: int,
        *,
        src_device: int | None = None,
        limit: int = DEFAULT_LIMIT,
        stream: int | None = None,
        ops: Ops | None = None,
    ) -> None:
        if nbytes <= 0:
            raise LinkError(f"cudalink: a landing buffer needs a positive size, got {nbytes}")
        if limit < 1:
            raise LinkError(f"cudalink: a landing pool needs at least one buffer, got limit={limit}")
        self.ops: Ops = ops if ops is not None else CudaOps(device, device if src_device is None else src_device)
        self.device = self.ops.device
        self.nbytes = nbytes
        self.limit = limit
        self._stream = stream
        self._lock = threading.RLock()  # a frame's __del__ may give a buffer back inside _acquire
        self._bufs: list[_Buffer] = []
        self._free: list[_Buffer] = []  # given back, oldest first
        self._closed = False
        self.copies = 0
        self.gpu_waits = 0  # copies that had to wait on the GPU for a consumer's fence

    @property
    def path(self) -> str:
        """``same-device``, ``peer`` or ``staged``: how copies into this pool run."""
        return self.ops.path

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, int | str]:
        with self._lock:
            held = sum(1 for b in self._bufs if b.held)
            return {
                "path": self.path,
                "buffers": len(self._bufs),
                "held": held,
                "copies": self.copies,
                "gpu_waits": self.gpu_waits,
                "bytes": len(self._bufs) * self.nbytes,
            }

    # -- taking a buffer ------------------------------------------------------------------------------------

    def available(self) -> bool:
        """Whether a copy now gets a buffer without waiting on the GPU for a consumer's fence: one given back
        whose fences passed, or room to allocate one. Also True when every buffer is held by a frame (a copy
        then raises :class:`LandingFull`, which says what to do, rather than waiting for nothing)."""
        with self._lock:
            if len(self._bufs) < self.limit or not self._free:
                return True
            ops = self.ops
            return any(all(ops.done(ev) for ev, live in b.fences.values() if live) for b in self._free)

    def check_room(self) -> None:
        """Raise :class:`LandingFull` now if every buffer is held by a frame: a source calls it before it takes
        a frame it would then have to drop."""
        with self._lock:
            if len(self._bufs) >= self.limit and not self._free:
                raise self._full()

    def _full(self) -> LandingFull:
        return LandingFull(
            f"cudalink: all {len(self._bufs)} landing buffers on cuda:{self.device} are held by frames "
            "(or tensors made from them) that were not released; release frames once used (a `with` "
            "block, or drop the tensors), or keep copies of what you must hold on to"
        )

    def wait_available(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (CPU-side, polling the fences) for :meth:`available`.

        For a consumer whose own GPU work is behind: it waits before taking the next frame, so the source it
        copies from never waits for it (the copy stream would otherwise wait on the GPU for the fence).
        """
        import time

        deadline = time.monotonic() + timeout
        pause = 20e-6
        while not self.available():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1e-3)
        return True

    def take(self, stream: int | None = None) -> tuple[Landed, int]:
        """A buffer to write into yourself, and the stream to write on (``stream`` or the copy stream), which
        already waits for any fence still pending on the buffer. Call :meth:`Landed.mark_ready` after."""
        s = self.ops.copy_stream() if stream is None else stream
        buf = self._acquire(s)
        return Landed(self, buf, self.nbytes, None), s

    def land(
        self,
        src_ptr: int,
        nbytes: int,
        *,
        after: RawEvent | None = None,
        stream: int | None = None,
        pitch: tuple[int, int, int] | None = None,
    ) -> Landed:
        """Copy ``nbytes`` at ``src_ptr`` into a free buffer, on ``stream`` (default: the copy stream), after
        ``after`` (the source's ready event; None: the caller already ordered ``stream``), and record the
        buffer's ready event. ``pitch=(src_pitch, width, height)`` makes it one 2-D copy of ``height`` rows of
        ``width`` bytes into a packed buffer. Never blocks the CPU; raises :class:`LandingFull` when every
        buffer is held by a frame."""
        if nbytes > self.nbytes or nbytes < 0:
            raise LinkError(f"cudalink: {nbytes} bytes do not fit this landing pool's {self.nbytes}-byte buffers")
        if pitch is not None and (pitch[1] * pitch[2] > self.nbytes or pitch[0] < pitch[1]):
            raise LinkError(
                f"cudalink: a {pitch[2]} x {pitch[1]}-byte copy (source pitch {pitch[0]}) does not fit this "
                f"landing pool's {self.nbytes}-byte buffers"
            )
        ops = self.ops
        s = ops.copy_stream() if stream is None else stream
        if after is not None:
            ops.wait(s, after)
        buf = self._acquire(s)
        try:
            if pitch is None:
                ops.copy(buf.ptr, src_ptr, nbytes, s)
            else:
                src_pitch, width, height = pitch
                ops.copy_2d(buf.ptr, src_ptr, src_pitch, width, height, s)
            ready = self._record_ready(buf, s)
        except BaseException:
            self._give_back(buf, [])
            raise
        self.copies += 1
        return Landed(self, buf, nbytes, ready)

    def _acquire(self, stream: int) -> _Buffer:
        """A buffer for a copy on ``stream``: one whose fences have passed, else a new one (up to the limit),
        else the one given back longest ago, with ``stream`` waiting on its fences on the GPU."""
        ops = self.ops
        with self._lock:
            if self._closed:
                raise LinkError("cudalink: this landing pool is closed")
            pick = None
            for buf in self._free:
                if all(ops.done(ev) for ev, live in buf.fences.values() if live):
                    pick = buf
                    break
            if pick is None and len(self._bufs) < self.limit:
                pick = _Buffer(ops.alloc(self.nbytes))
                self._bufs.append(pick)
            elif pick is None and self._free:
                pick = self._free[0]
                for ev, live in pick.fences.values():
                    if live:
                        ops.wait(stream, ev)
                self.gpu_waits += 1
            elif pick is None:
                raise self._full()
            if pick in self._free:
                self._free.remove(pick)
                for ev in pick.ready.values():  # its last copy, if it ran on another stream, must end first
                    if not ops.done(ev):
                        ops.wait(stream, ev)
            pick.held = True
            for k, (ev, _) in list(pick.fences.items()):
                pick.fences[k] = (ev, False)  # ordered before this copy: done with
            return pick

    def _record_ready(self, buf: _Buffer, stream: int) -> RawEvent:
        ops = self.ops
        ctx = ops.context_of(stream)
        ev = buf.ready.get(ctx)
        if ev is None:
            ev = buf.ready[ctx] = ops.new_event(ctx)
        ops.record(ev, stream)
        return ev

    # -- giving it back ---------------------------------------------------------------------------------------

    def _give_back(self, buf: _Buffer, streams: list[int]) -> None:
        ops = self.ops
        with self._lock:
            if not buf.held:
                return
            for s in streams:
                got = buf.fences.get(s)
                ev = ops.new_event(ops.context_of(s)) if got is None else got[0]
                try:
                    ops.record(ev, s)
                except LinkError:
                    # a stream that died (its framework freed it): nothing of it can still read the buffer
                    if got is None:
                        ops.destroy_event(ev)
                    continue
                buf.fences[s] = (ev, True)
            if len(buf.fences) > 8:  # streams come and go (a framework's per-call streams): keep the live ones
                for s, (ev, live) in list(buf.fences.items()):
                    if not live:
                        ops.destroy_event(ev)
                        del buf.fences[s]
            buf.held = False
            if self._closed:
                self._free_buffer(buf)
                self._finish_if_empty()
            else:
                self._free.append(buf)

    # -- teardown ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free every buffer no frame holds (after its fences pass), and each held one when it is given back."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for buf in list(self._free):
                self._free_buffer(buf)
            self._free.clear()
            self._finish_if_empty()

    def _free_buffer(self, buf: _Buffer) -> None:
        """Under the lock: wait (CPU-side, at teardown only) for the buffer's fences and copies, then free it."""
        ops = self.ops
        for ev, live in buf.fences.values():
            if live:
                ops.sync(ev)
        for ev in buf.ready.values():
            ops.sync(ev)
        for ev, _ in buf.fences.values():
            ops.destroy_event(ev)
        for ev in buf.ready.values():
            ops.destroy_event(ev)
        buf.fences.clear()
        buf.ready.clear()
        ops.free(buf.ptr)
        self._bufs.remove(buf)

    def _finish_if_empty(self) -> None:
        if not self._bufs:
            self.ops.close()

    def __del__(self) -> None:
        if sys.is_finalizing():  # the process is ending: the driver frees it all, and calls into it may crash
            return
        try:
            self.close()
        except Exception:
            pass


# ============================================================================================ the real GPU


class CudaOps:
    """:class:`Ops` on the CUDA driver: buffers from ``cuMemAlloc`` on ``device``, copies from ``src_device``."""

    def __init__(self, device: int, src_device: int) -> None:
        devices.check_ordinal(device)
        devices.check_ordinal(src_device)
        self.device = device
        self.src_device = src_device
        with devices.keep_current():  # the caller's current device stays theirs
            self.path = devices.copy_path(src_device, device)
            self.dst_ctx = devices.context(device)
            self.src_ctx = devices.context(src_device)
        self._drv = driver.bindings()
        self._dst_cu = self._drv.CUcontext(self.dst_ctx)  # made once: the per-frame copy names both contexts
        self._src_cu = self._drv.CUcontext(self.src_ctx)
        self._ctx_of: dict[int, int] = {}
        self._events: dict[int, object] = {}  # raw (as handed out) -> the CUevent object, for cuEventDestroy
        self._copy_stream: object = None
        self._local_stream: object = None
        self._closed = False

    # contexts: every call that makes something runs with the right context current, and puts the old one back

    def _in(self, ctx: int, fn: Callable[[], object]) -> object:
        drv = self._drv
        driver.check(drv.cuCtxPushCurrent(drv.CUcontext(ctx)), "cuCtxPushCurrent")
        try:
            return fn()
        finally:
            drv.cuCtxPopCurrent()

    def alloc(self, nbytes: int) -> int:
        drv = self._drv
        ptr = self._in(self.dst_ctx, lambda: driver.check(drv.cuMemAlloc(nbytes), "cuMemAlloc"))
        return int(cast(SupportsInt, ptr))

    def free(self, ptr: int) -> None:
        drv = self._drv
        self._in(self.dst_ctx, lambda: drv.cuMemFree(drv.CUdeviceptr(ptr)))

    def context_of(self, stream: int) -> int:
        if stream <= devices.LAST_DEFAULT_STREAM:  # DLPack's default streams: the landing GPU's (devices.on_stream)
            return self.dst_ctx
        got = self._ctx_of.get(stream)
        if got is None:
            ctx = driver.check(self._drv.cuStreamGetCtx(driver.cu_stream(stream)), "cuStreamGetCtx")
            if len(self._ctx_of) > 256:
                self._ctx_of.clear()
            got = self._ctx_of[stream] = int(ctx)
        return got

    def new_event(self, ctx: int) -> RawEvent:
        ev = self._in(ctx, driver.new_event)
        raw: RawEvent = int(cast(SupportsInt, ev)) if driver.compiled() else ev
        self._events[id(raw) if not isinstance(raw, int) else raw] = ev
        return raw

    def destroy_event(self, ev: RawEvent) -> None:
        obj = self._events.pop(id(ev) if not isinstance(ev, int) else ev, None)
        if obj is not None:
            driver.destroy_event(obj)

    def record(self, ev: RawEvent, stream: int) -> None:
        devices.on_stream(self.dst_ctx, stream, driver.record, ev, stream)  # a release runs on any thread

    def wait(self, stream: int, ev: RawEvent) -> None:
        devices.on_stream(self.dst_ctx, stream, driver.wait, stream, ev)

    def done(self, ev: RawEvent) -> bool:
        return driver.event_done(ev)

    def sync(self, ev: RawEvent) -> None:
        drv = self._drv
        obj = self._events.get(id(ev) if not isinstance(ev, int) else ev, ev)
        drv.cuEventSynchronize(obj)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if self.path == devices.PATH_SAME:
            driver.memcpy_dtod(dst, src, nbytes, stream)
            return
        drv = self._drv
        err = drv.cuMemcpyPeerAsync(dst, self._dst_cu, src, self._src_cu, nbytes, driver.cu_stream(stream))[0]
        if err:
            driver.check((err,), "cuMemcpyPeerAsync")

    def copy_2d(self, dst: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        if self.path == devices.PATH_SAME:
            driver.memcpy_2d_dtod(dst, width, src, src_pitch, width, height, stream)
            return
        drv = self._drv
        p = drv.CUDA_MEMCPY3D_PEER()
        p.srcMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.srcDevice = src
        p.srcContext = self._src_cu
        p.srcPitch = src_pitch
        p.srcHeight = height
        p.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.dstDevice = dst
        p.dstContext = self._dst_cu
        p.dstPitch = width
        p.dstHeight = height
        p.WidthInBytes = width
        p.Height = height
        p.Depth = 1
        driver.check(drv.cuMemcpy3DPeerAsync(p, driver.cu_stream(stream)), "cuMemcpy3DPeerAsync")

    def _new_stream(self, ctx: int) -> object:
        drv = self._drv
        flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        return self._in(ctx, lambda: driver.check(drv.cuStreamCreate(flags), "cuStreamCreate"))

    def copy_stream(self) -> int:
        if self._copy_stream is None:
            self._copy_stream = self._new_stream(self.src_ctx)
        return int(cast(SupportsInt, self._copy_stream))

    def local_stream(self) -> int:
        if self._local_stream is None:
            self._local_stream = self._new_stream(self.dst_ctx)
        return int(cast(SupportsInt, self._local_stream))

    def close(self) -> None:
        """The pool is empty: drop our streams (after what they queued) and any events left."""
        if self._closed:
            return
        self._closed = True
        drv = self._drv
        for s in (self._copy_stream, self._local_stream):
            if s is not None:
                drv.cuStreamSynchronize(s)
                drv.cuStreamDestroy(s)
        self._copy_stream = self._local_stream = None
        for obj in self._events.values():
            driver.destroy_event(obj)
        self._events.clear()
