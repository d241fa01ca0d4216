"""``bench --breakdown``: where one frame's time goes, stage by stage, across both processes.

The parent sends frames at the bench's cadence with :mod:`cudalink._trace` on; a spawned consumer
receives them with tracing on, exports each one (``torch.from_dlpack``/``cupy.from_dlpack`` on the
GPU, ``np.from_dlpack`` on the CPU) and releases it. Marks are matched by sequence number, and each
stage is the time from the previous mark (CLOCK_MONOTONIC, one clock for the machine). It is what to
optimise with, and what a user runs when a pipeline is slow.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import queue as queue_mod
import time
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np

from .. import _trace

if TYPE_CHECKING:
    import multiprocessing.queues as mpq

    from ..link import Sender, WaitMode

    #: each frame's trace marks, by seq
    Marks = dict[int, list[tuple[str, int]]]
    #: what the traced consumer tells the parent: it is ready (its pid), its marks, or why it failed
    BreakdownMsg = tuple[Literal["ready"], int] | tuple[Literal["result"], Marks] | tuple[Literal["error"], str]

#: each stage is named by the mark that ends it and lasts from the previous mark of the same frame, so
#: a backend that skips a step (the CPU has no events) folds its time into the next stage, never loses it.
#: The wake-ups are the exception: the consumer may run before the producer returns from the write, so
#: both the write and the OS wake are timed from the mark taken just before it (as the floor is). A
#: consumer woken ahead (``Receiver(wake_ahead=True)``) wakes during the send; its lease is timed from
#: the later of its wake and the publish, and the spin in between is a total below.
STAGES: tuple[tuple[str, str, str], ...] = (
    (_trace.SOURCE_READ, "read and check the source array (pointer, shape, stream)", "producer"),
    (_trace.WAKING_AHEAD, "claim a slot, find consumers to wake ahead (CPU: copy the frame's head)", "producer"),
    (_trace.AHEAD_SENT, "write the wake-up ahead (syscall)", "producer"),
    (_trace.SLOT_CLAIMED, "claim a slot (unless above), check release fences", "producer"),
    (_trace.FENCES_WAITED, "queue waits on pending release fences", "producer"),
    (_trace.COPY_QUEUED, "copy (GPU: queue cuMemcpyAsync; CPU: memcpy, after a wake-up ahead its tail)", "producer"),
    (_trace.EVENT_RECORDED, "record the slot's ready event", "producer"),
    (_trace.PUBLISHED, "update the send-time average, publish: record, stamp, fence", "producer"),
    (_trace.WAKING, "find the sleeping consumers", "producer"),
    (_trace.WAKE_SENT, "write the wake-up byte (syscall)", "producer"),
    (_trace.WOKEN, "OS wake: wake-up written -> consumer running", "both"),
    (_trace.LEASED, "find and lease the slot", "consumer"),
    (_trace.FRAME_BUILT, "build the Frame, return from recv()", "consumer"),
    (_trace.EXPORTED, "export (from_dlpack)", "consumer"),
    (_trace.RELEASED, "release (GPU fence, lease cleared)", "consumer"),
)
#: stages timed from a fixed mark (the first of the candidates the frame has) rather than the previous one
_FROM = {
    _trace.AHEAD_SENT: (_trace.WAKING_AHEAD,),
    _trace.WAKE_SENT: (_trace.WAKING,),
    _trace.WOKEN: (_trace.WAKING_AHEAD, _trace.WAKING),
}
#: the chain "previous mark" follows; the writes hang off their marks and start nothing after them,
#: except the wake-up ahead, which the producer's own work goes on from
_CHAIN = [_trace.SEND_ENTERED, *(m for m, _, _ in STAGES if m != _trace.WAKE_SENT)]
#: the producer's marks: a producer stage runs from the latest of them before its end in time, whatever
#: the chain's order (a slow host copy wakes ahead after its head, ``Sender._copy_late``: there the
#: wake-up ahead comes after the claim, and the claim must not be counted in both stages)
_PRODUCER = [_trace.SEND_ENTERED, *(m for m, _, side in STAGES if side == "producer" and m != _trace.WAKE_SENT)]
#: end-to-end spans over the same marks
TOTALS: tuple[tuple[str, str, str], ...] = (
    ("send(): entered -> published", _trace.SEND_ENTERED, _trace.PUBLISHED),
    ("handoff: published -> recv() returns", _trace.PUBLISHED, _trace.FRAME_BUILT),
    ("end to end: send() entered -> recv() returns", _trace.SEND_ENTERED, _trace.FRAME_BUILT),
    ("woken ahead: woken -> published (the consumer spins)", _trace.WOKEN, _trace.PUBLISHED),
    ("consumer: woken -> exported -> released", _trace.WOKEN, _trace.RELEASED),
)


def stage_start(end: str, m: dict[str, int]) -> str | None:
    """The mark a stage ending at ``end`` is timed from, in one frame's marks ``m``."""
    fixed = _FROM.get(end)
    if fixed is not None:
        return next((c for c in fixed if c in m), None)
    if end == _trace.LEASED and _trace.WOKEN in m and _trace.PUBLISHED in m:
        return max((_trace.WOKEN, _trace.PUBLISHED), key=m.__getitem__)  # woken ahead: after the publish
    at = m.get(end)
    pool = [c for c in _PRODUCER if c != end] if end in _PRODUCER else _CHAIN[: _CHAIN.index(end)]
    earlier = [c for c in pool if c in m and (at is None or m[c] <= at)]
    return max(earlier, key=lambda c: (m[c], _CHAIN.index(c))) if earlier else None


def total_span(a: str, b: str, m: dict[str, int]) -> int | None:
    """One frame's span ``a`` -> ``b``; the spin of a consumer woken ahead only where it was."""
    if a not in m or b not in m:
        return None
    if (a, b) == (_trace.WOKEN, _trace.PUBLISHED):
        return max(0, m[b] - m[a]) if _trace.WAKING_AHEAD in m else None
    return m[b] - m[a]


class Stage(TypedDict):
    stage: str
    side: str  # "producer" | "consumer" | "both"
    mark: str
    us: dict[str, float] | None  # measure.summarize's


#: an end-to-end span (the functional form: "from" is a keyword)
Total = TypedDict("Total", {"span": str, "from": str, "to": str, "us": dict[str, float] | None})


class Breakdown(TypedDict):
    """What :func:`run` returns (the bench report's ``breakdown``)."""

    frames: int
    wait: str
    wake_ahead: bool
    stages: list[Stage]
    totals: list[Total]
    reserve_commit: dict[str, float] | None
    reserve_commit_attached: dict[str, float] | None
    ring_cycle: dict[str, dict[str, float] | None]


def breakdown_consumer(
    name: str, device: int, lib: str, wait: WaitMode, ahead: bool, out: mpq.Queue[BreakdownMsg]
) -> None:
    """The traced consumer: recv, export, release; one list of marks per frame, sent back at the end."""
    from ..errors import ProducerGone
    from ..link import Receiver
    from .measure import GpuLib, _child_init, _one_line

    _child_init()
    per_frame: Marks = {}
    try:
        g = GpuLib(lib, device) if device >= 0 else None
        if g is not None:
            g.context()
        export = g.mod.from_dlpack if g is not None else np.from_dlpack
        rx = Receiver(name, wait=wait, wake_ahead=ahead, timeout=30.0)
        out.put(("ready", os.getpid()))
        _trace.enable()
        mark = _trace.mark
        while True:
            try:
                f = rx.recv()
            except ProducerGone:
                break
            x = export(f)
            mark(_trace.EXPORTED)
            del x
            f.release()
            mark(_trace.RELEASED)
            per_frame[f.seq] = _trace.take()
            del f
        rx.close()
        out.put(("result", per_frame))
    except BaseException as exc:
        out.put(("error", _one_line(exc)))


def _reserve_costs(tx: Sender, n: int) -> list[int]:
    """``reserve()`` + commit, back to back, nothing written: the API's own CPU cost, hot."""
    mono = time.monotonic_ns
    out = []
    for _ in range(n):
        t0 = mono()
        with tx.reserve():
            pass
        out.append(mono() - t0)
    return out


def ring_cycles(n: int = 20_000, batch: int = 50) -> dict[str, dict[str, float] | None]:
    """One frame's ring operations (claim, publish, take, release), hot, in process, per implementation.

    Each ring built here is timed over the same header layout and spec, so the compiled core's share of
    a frame is read off the same run as the Python ring it replaces. Samples are per-frame means over
    ``batch`` frames (a single frame is below the clock's resolution).
    """
    from .. import _ring
    from ..frames.spec import FrameSpec
    from ..transport import wire
    from .measure import summarize

    # (producer ring, consumer ring) classes; the timed loop uses a take's result unchecked (no None test)
    impls: dict[str, tuple[Any, Any]] = {"python": (_ring.PyProducerRing, _ring.PyConsumerRing)}
    if _ring._native_ring is not None:
        impls["compiled"] = (_ring._NativeProducerRing, _ring._native_ring.ConsumerCore)
    layout = wire.Layout(4, 4)
    spec = FrameSpec((64, 64, 4), np.dtype("uint8"))
    out: dict[str, dict[str, float] | None] = {}
    for label, (prod, cons) in impls.items():
        buf = memoryview(bytearray(layout.size))
        tx, rx = prod(buf, layout), cons(buf, layout, 0, spec.nbytes)
        seq = 0
        samples = []
        for _ in range(max(n // batch, 5)):
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                seq += 1
                slot = tx.claim(seq)
                tx.publish(slot, seq, 1, spec, b"")
                got = rx.take(seq - 1, True)
                rx.release(got[0], seq, False)
            samples.append((time.perf_counter_ns() - t0) // batch)
        out[label] = summarize(samples[len(samples) // 5 :])
    return out


def run(
    device: int,
    lib: str,
    shape: tuple[int, ...],
    frames: int,
    interval: float,
    warm: int,
    wait: WaitMode = "block",
    wake_ahead: bool = True,
) -> Breakdown:
    """One traced run; returns ``{"stages": [...], "totals": [...], "reserve_commit": summary}``."""
    from ..errors import LinkError
    from ..link import Sender
    from .measure import GpuLib, summarize

    ctx = mp.get_context("spawn")
    name = f"breakdown-{os.getpid()}-{time.monotonic_ns() & 0xFFFFFF:x}"
    host = (np.arange(int(math.prod(shape))) % 251).astype(np.uint8).reshape(shape)
    g = GpuLib(lib, device) if device >= 0 else None
    src = g.from_numpy(host) if g is not None else host
    if g is not None:
        g.sync()
    out: mpq.Queue[BreakdownMsg] = ctx.Queue()
    produced: Marks = {}
    reserve_attached: list[int] = []
    with Sender(name, shape=shape, dtype="uint8", device=device if device >= 0 else "cpu") as tx:
        reserve = _reserve_costs(tx, max(frames // 4, 20))  # before any consumer: nobody to wake
        p = ctx.Process(target=breakdown_consumer, args=(name, device, lib, wait, wake_ahead, out), daemon=True)
        p.start()
        try:
            msg = out.get(timeout=120)
            if msg[0] == "error":
                raise LinkError(f"cudalink: breakdown consumer failed: {msg[1]}")
            deadline = time.monotonic() + 30
            while tx.stats()["consumers"] < 1:
                if time.monotonic() > deadline:
                    raise LinkError("cudalink: breakdown consumer never attached")
                time.sleep(0.002)
            _trace.enable()
            for _ in range(frames):
                seq = tx.send(src)
                marks = _trace.take()
                if seq is not None:
                    produced[seq] = marks
                time.sleep(interval)
            _trace.enable(False)
            reserve_attached = _reserve_costs(tx, max(frames // 4, 20))
        finally:
            _trace.enable(False)
            tx.close(timeout=15.0)
            try:
                msg = out.get(timeout=60)
            except queue_mod.Empty:
                msg = ("error", "sent no result")
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    if msg[0] != "result":  # an error (a consumer's "ready" came first, above)
        raise LinkError(f"cudalink: breakdown consumer failed: {msg[1]}")
    consumed = msg[1]
    # the first ``warm`` timed sends warm up; by their order, not their seq (reserve() costs took seqs before)
    kept = set(sorted(produced)[warm:])
    both = [{**dict(produced[s]), **dict(consumed[s])} for s in sorted(consumed) if s in kept]
    durations: dict[str, list[int]] = {m: [] for m, _, _ in STAGES}
    for m in both:
        for end, _, _ in STAGES:
            start = stage_start(end, m) if end in m else None
            if start is not None:
                durations[end].append(m[end] - m[start])
    stages: list[Stage] = [
        {"stage": label, "side": side, "mark": m, "us": summarize(durations[m])} for m, label, side in STAGES
    ]
    totals: list[Total] = []
    for label, a, b in TOTALS:
        vals = [v for m in both if (v := total_span(a, b, m)) is not None]
        totals.append({"span": label, "from": a, "to": b, "us": summarize(vals)})
    with contextlib.suppress(Exception):
        out.close()
    return {
        "frames": len(both),
        "wait": wait,
        "wake_ahead": wake_ahead,
        "stages": stages,
        "totals": totals,
        "reserve_commit": summarize(reserve[len(reserve) // 5 :]),  # the first fifth warms up
        "reserve_commit_attached": summarize(reserve_attached[len(reserve_attached) // 5 :]),
        "ring_cycle": ring_cycles(),
    }
