"""Copy-send bandwidth: ``Sender.send`` of a float32 frame against a bare ``cuMemcpyDtoDAsync`` of the same
bytes, both timed the same way.

Both sides run on one stream the bench makes and passes to ``send(stream=)``, and each is timed by a pair
of CUDA events recorded on that stream around it: GPU time, read on the GPU's clock. Timing the send with
the CPU clock plus a sync of the link's stream was wrong twice over: with no ``stream=`` a torch tensor is
copied on torch's current stream, not the link's, so the sync waited for nothing and the copy ran after
the clock stopped (the rows read 154% and 119% of "a plain copy"). The pairs alternate which side goes
first, so neither always starts on a GPU the other just warmed.

The card's peak is the best of a few bare copies of 256 MiB, on the same stream, timed the same way.

A third side, timed in the same rounds: the bare copy followed by a ``cuEventRecord`` of an interprocess
event on its stream, which is what ``send()`` queued until 2026-11-26. On an H100 (2026-11-25) that
record took ~3 µs of GPU time where a plain event's took none (90% of the bare copy at 1080p float32).
Since 2026-11-26 ``send()`` records the slot's ready event off the copy's stream while the GPU is behind
(the previous frame's ready event has not fired: frames queue up), and on it otherwise, where the extra
hop would only add latency (``CudaSlots._mark_ready``). One send at a time, as ``paired`` times them,
the GPU keeps up; back to back it does not. So two more figures:

- ``send_ready``: a send, then the copy's stream waits until the slot's ready event has been recorded:
  when the frame is ready for others, one frame alone (without what a consumer's wait on an IPC event
  costs, the same before and after);
- ``burst_send`` / ``burst_bare``: :data:`BURST` sends (copies) queued back to back, until every ready
  event fired: the GPU time per frame a producer queueing frames pays, where the ready event's record
  overlaps the next copy. The copy-send goal reads this one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol, TypedDict

from ..cuda import devices, driver

#: bytes of the copy the card's peak is read from (large enough that launch costs vanish)
PEAK_BYTES = 256 << 20


class StreamTimer(Protocol):
    """Times the GPU work queued on one stream between :meth:`start` and :meth:`stop`."""

    def start(self, stream: int) -> None: ...

    def stop(self, stream: int) -> int:
        """Nanoseconds of GPU time since :meth:`start` on ``stream``; waits for that work to finish."""
        ...


class Sends(Protocol):
    """What the measurement needs of a ``Sender``."""

    def send(self, array: object, *, stream: object = None) -> int | None: ...


class EventTimer:
    """Two timing-enabled CUDA events recorded on the measured stream (``cuEventElapsedTime``, ~0.5 µs)."""

    def __init__(self) -> None:
        drv = self._drv = driver.bindings()
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT  # timing on: the link's events turn it off, these need it
        self._a = driver.check(drv.cuEventCreate(flags), "cuEventCreate")
        self._b = driver.check(drv.cuEventCreate(flags), "cuEventCreate")

    def start(self, stream: int) -> None:
        driver.check(self._drv.cuEventRecord(self._a, driver.cu_stream(stream)), "cuEventRecord")

    def stop(self, stream: int) -> int:
        drv = self._drv
        driver.check(drv.cuEventRecord(self._b, driver.cu_stream(stream)), "cuEventRecord")
        driver.check(drv.cuEventSynchronize(self._b), "cuEventSynchronize")
        ms = driver.check(drv.cuEventElapsedTime(self._a, self._b), "cuEventElapsedTime")
        return int(float(ms) * 1e6)

    def close(self) -> None:
        for ev in (self._a, self._b):
            self._drv.cuEventDestroy(ev)


class GatedTimer(EventTimer):
    """:class:`EventTimer` on a stream held shut until everything timed is queued: GPU time alone.

    Without the gate the start event runs the moment it is recorded, and the GPU then idles while the CPU
    is still inside ``send()`` queueing its copy: the sample counted ``send()``'s CPU path as copy time
    (the first H100 run read 69% / 77% of the bare copy for that reason). A ``cuStreamWaitValue32`` on a
    counter in device memory holds the stream; a write from a second stream opens it once the stop event
    is queued, so both sides are timed from their first GPU operation to their last.
    """

    def __init__(self) -> None:
        super().__init__()
        drv = self._drv
        self._gate = driver.check(drv.cuMemAlloc(4), "cuMemAlloc")
        driver.check(drv.cuMemsetD32(self._gate, 0, 1), "cuMemsetD32")
        self._opener = driver.check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self._k = 0

    def start(self, stream: int) -> None:
        drv = self._drv
        self._k = (self._k + 1) & 0x7FFFFFFF
        flag = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        driver.check(
            drv.cuStreamWaitValue32(driver.cu_stream(stream), self._gate, self._k, flag), "cuStreamWaitValue32"
        )
        super().start(stream)

    def stop(self, stream: int) -> int:
        drv = self._drv
        driver.check(drv.cuEventRecord(self._b, driver.cu_stream(stream)), "cuEventRecord")
        flag = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        driver.check(drv.cuStreamWriteValue32(self._opener, self._gate, self._k, flag), "cuStreamWriteValue32")
        driver.check(drv.cuEventSynchronize(self._b), "cuEventSynchronize")
        ms = driver.check(drv.cuEventElapsedTime(self._a, self._b), "cuEventElapsedTime")
        return int(float(ms) * 1e6)

    def close(self) -> None:
        self._drv.cuStreamSynchronize(self._opener)
        self._drv.cuStreamDestroy(self._opener)
        self._drv.cuMemFree(self._gate)
        super().close()


def make_timer() -> EventTimer:
    """The gated timer where the driver has stream memory operations, else the plain one (the result's
    ``timing`` says which)."""
    try:
        return GatedTimer()
    except Exception:  # a driver without cuStreamWaitValue32: the plain pair, which counts queueing time too
        return EventTimer()


def paired(
    tx: Sends,
    src: object,
    bare: Callable[[int], object],
    stream: int,
    stream_obj: object,
    timer: StreamTimer,
    iters: int,
    warm: int = 3,
    extra: Callable[[int], object] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """``tx.send(src, stream=stream_obj)``, ``bare(stream)`` and ``extra(stream)`` (if given), each timed by
    ``timer`` on ``stream``.

    ``stream_obj`` is the stream as ``send`` takes it; ``stream`` its raw handle. Returns (send ns, bare
    ns, extra ns: empty without ``extra``), ``iters`` each after ``warm`` rounds; odd rounds run them in
    reverse order.
    """
    ours: list[int] = []
    plain: list[int] = []
    more: list[int] = []

    def send(_: int) -> object:
        return tx.send(src, stream=stream_obj)

    sides: list[tuple[Callable[[int], object], list[int]]] = [(send, ours), (bare, plain)]
    if extra is not None:
        sides.append((extra, more))
    for i in range(iters + warm):
        order = sides if i % 2 == 0 else sides[::-1]
        for fn, out in order:
            timer.start(stream)
            fn(stream)
            ns = timer.stop(stream)
            if i >= warm:
                out.append(ns)
    return ours, plain, more


class CopySend(TypedDict):
    """One frame size's result (ns per sample, or per frame for the bursts) and the card's peak copy rate."""

    send: list[int]  # GPU time send() leaves on the stream its copy ran on
    bare: list[int]
    bare_event: list[int]  # the bare copy + a cuEventRecord of an IPC event on its stream: send() before 2026-11-26
    send_ready: list[int]  # send(), then that stream waits until the slot's ready event has been recorded
    burst_send: list[int]  # BURST sends queued back to back, until every ready event fired: per frame
    burst_bare: list[int]  # BURST bare copies queued back to back: per frame
    nbytes: int
    peak_gbps: float | None  # bytes copied per second / 1e9, best of a few large bare copies
    timing: str  # "gated" (GPU time alone) or "plain" (a driver without stream memory operations)


#: sends per burst; the link gets as many slots, so no send in a burst waits for an earlier one's slot
BURST = 8


def bursts(
    sides: list[tuple[Callable[[int], object], Callable[[int], object] | None, list[int]]],
    stream: int,
    timer: StreamTimer,
    n: int,
    iters: int,
) -> None:
    """Each side's call made ``n`` times back to back, then its tail (if any), timed by ``timer`` on
    ``stream``; appends the GPU time per call, ``iters`` samples after one warm round. Work a call leaves
    off ``stream`` that overlaps the next call is counted once, as a producer queueing frames sees it,
    which the per-call samples of :func:`paired` cannot show."""
    for i in range(iters + 1):
        for fn, tail, out in sides if i % 2 == 0 else sides[::-1]:
            timer.start(stream)
            for _ in range(n):
                fn(stream)
            if tail is not None:
                tail(stream)
            ns = timer.stop(stream)
            if i:
                out.append(ns // n)


def measure(device: int, lib: str, shape: tuple[int, ...], iters: int, peak: bool = True) -> CopySend:
    """``send()`` of a float32 frame of ``shape`` vs the bare copy, on one fresh stream, in this process."""
    from ..link import Sender
    from .measure import GpuLib

    g = GpuLib(lib, device)
    src = g.empty(shape, "float32")
    dst = g.empty(shape, "float32")
    g.sync()
    nbytes = g.nbytes(src)
    dev = devices.device(device)
    dev.set_current()
    stream_obj = dev.create_stream()
    s = driver.stream_handle(stream_obj)
    drv = driver.bindings()
    cs = driver.cu_stream(s)
    src_ptr, dst_ptr = g.ptr(src), g.ptr(dst)

    def bare(_: int) -> None:
        driver.check(drv.cuMemcpyDtoDAsync(dst_ptr, src_ptr, nbytes, cs), "cuMemcpyDtoDAsync")

    ipc_event = driver.new_ipc_event(stream_obj)  # as a slot's ready event is made
    ipc_raw = driver.raw(ipc_event)

    def bare_event(_: int) -> None:
        bare(s)
        driver.record(ipc_raw, s)

    timer = make_timer()
    try:
        name = f"copysend-{os.getpid()}-{time.monotonic_ns() & 0xFFFFFF:x}"
        with Sender(name, shape=shape, dtype="float32", slots=BURST, device=device) as tx:
            # The link's ready stream (this tool is part of the package): its records run in order, so a plain
            # event after them fires once every ready event has. Waiting on the IPC events themselves would
            # add what a wait on an IPC event costs (several us on an H200), which bare_event never pays.
            ready_s = driver.stream_handle(tx._slots.ready_stream)  # type: ignore[attr-defined]
            mark = driver.new_event()

            def fired(_: int) -> None:
                driver.record(mark, ready_s)
                driver.wait(s, mark)

            def send_ready(_: int) -> None:
                tx.send(src, stream=stream_obj)
                fired(s)

            ours, plain, evented = paired(tx, src, bare, s, stream_obj, timer, iters, extra=bare_event)
            readied: list[int] = []
            for i in range(iters + 3):
                timer.start(s)
                send_ready(s)
                ns = timer.stop(s)
                if i >= 3:
                    readied.append(ns)
            burst_send: list[int] = []
            burst_bare: list[int] = []

            def send(_: int) -> None:
                tx.send(src, stream=stream_obj)

            bursts([(send, fired, burst_send), (bare, None, burst_bare)], s, timer, BURST, max(5, iters // 4))
            driver.destroy_event(mark)
        rate = peak_gbps(s, timer) if peak else None
    finally:
        stream_obj.sync()
        timer.close()
    timing = "gated" if isinstance(timer, GatedTimer) else "plain"
    return {
        "send": ours,
        "bare": plain,
        "bare_event": evented,
        "send_ready": readied,
        "burst_send": burst_send,
        "burst_bare": burst_bare,
        "nbytes": nbytes,
        "peak_gbps": rate,
        "timing": timing,
    }


def peak_gbps(stream: int, timer: StreamTimer, nbytes: int = PEAK_BYTES, iters: int = 8) -> float:
    """The card's D2D copy rate: bytes copied per second (not read + written) / 1e9, best of ``iters``."""
    drv = driver.bindings()
    a = driver.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
    b = driver.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
    cs = driver.cu_stream(stream)
    try:
        best = None
        for i in range(iters + 1):
            timer.start(stream)
            driver.check(drv.cuMemcpyDtoDAsync(b, a, nbytes, cs), "cuMemcpyDtoDAsync")
            ns = timer.stop(stream)
            if i and ns > 0:
                best = ns if best is None else min(best, ns)
        return nbytes / best if best else float("nan")
    finally:
        drv.cuMemFree(a)
        drv.cuMemFree(b)
