"""The engine behind ``python -m cudalink bench`` .

Every child entry point lives here, at module level: ``spawn`` children import their target by
name, and functions defined in ``__main__`` do not survive that. Times compared across processes
come from ``time.monotonic_ns`` (CLOCK_MONOTONIC is one clock for the whole machine on Linux);
``perf_counter`` would only be valid inside one process.

A bench run measures cudalink and its peers in the same process tree, frame for frame: the parent
is the producer, spawned children are the consumers, and each side records its own timestamps.
Rows a machine cannot run (GPU rows on a CPU-only box, torch rows without torch) are reported as
skipped with the reason, never estimated.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import importlib.util
import itertools
import math
import multiprocessing as mp
import multiprocessing.queues as mpq
import os
import platform
import queue as queue_mod
import select
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, cast

import numpy as np

from .. import _native, _platform
from .._version import __version__
from ..cuda import devices
from ..errors import LinkError, LinkTimeout, ProducerGone
from ..frames.frame import Frame
from .measure import Backend, GpuLib, _child_init, _one_line, summarize
from .peers import ConsumerJob
from .peers.link import LinkProducer, LinkSource
from .peers.mpqueue import QueueProducer, QueueSource
from .peers.shm import ShmProducer, ShmSource

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnProcess
    from multiprocessing.process import BaseProcess

    from ..link import WaitMode
    from .breakdown import Breakdown
    from .copysend import CopySend
    from .floors import CopyRecordFloor
    from .gpuclock import GpuClock, Series
    from .peers import Channel, Producer, QueueItem, Source

_F = TypeVar("_F")

#: p50/p99/mean/n in microseconds, as ``measure.summarize`` makes it
Summary = dict[str, float]


class ConsumerResult(TypedDict):
    """One consumer's samples, frame by frame (the costs only in poll mode)."""

    seq: list[int]
    t: list[int]  # monotonic ns when the frame arrived
    wall: list[int]  # time.time_ns when it arrived
    pub: list[int]  # the producer's publish stamp (time.time_ns)
    cost: list[int]  # take + export
    rcost: list[int]  # frame.release()
    dcost: list[int]  # deleting the export
    second: list[bool]  # poll mode: the paired floor ran first after this frame's wake
    floor: list[int]  # poll mode, host links: the paired view_read floor per frame (-1: not this frame)
    wake: list[int]  # recv mode, ``wake_floor``: the bare wake a beat after this frame, ns (-1: not a wake)
    skipped: int
    cpu_ns: int  # CPU time the consumer process used while receiving (user + system)


if TYPE_CHECKING:
    #: what a consumer tells the parent: it is ready (its pid), its samples, or why it failed
    ConsumerMsg = (
        tuple[Literal["ready"], int, int]
        | tuple[Literal["result"], int, ConsumerResult]
        | tuple[Literal["error"], int, str]
    )


#: a ConsumerResult's per-frame series besides ``seq``, each one value per received frame where it is taken
_SERIES = ("t", "wall", "pub", "cost", "rcost", "dcost", "second", "floor", "wake")

#: the paired wake floor's message, written a beat after each send: that frame's seq, and when it was written
_BEAT = struct.Struct("<qq")


def _kept(xs: list[_F], keep: list[int]) -> list[_F]:
    """The per-frame samples at ``keep``; none where a mode takes none (costs exist in poll mode only)."""
    return [xs[j] for j in keep] if xs else []


def _pipe(chan: Channel) -> Connection:
    if chan is None or isinstance(chan, mpq.Queue):
        raise LinkError(f"cudalink: the shm peer's consumer needs a pipe, got {type(chan).__name__}")
    return chan


def _queue(chan: Channel) -> mpq.Queue[QueueItem]:
    if not isinstance(chan, mpq.Queue):
        raise LinkError(f"cudalink: an mp.Queue peer's consumer needs a queue, got {type(chan).__name__}")
    return chan


def bench_consumer(
    job: ConsumerJob, chan: Channel, out: mpq.Queue[ConsumerMsg], beats: Connection | None = None
) -> None:
    """One consumer of one bench run: per frame, its seq, publish and arrival times, and (poll) take cost.

    Arrival is recorded twice: ``time.time_ns`` to compare with the producer's publish stamp (the
    frame's own ``timestamp_ns`` for cudalink, one carried in the message for peers), and
    ``time.monotonic_ns`` to compare with the moment the producer's send call returned. ``beats``: the
    socket of the paired wake floor (``Bench._run(wake_floor=True)``).
    """
    _child_init()
    wake = _BareWake(beats) if beats is not None else None
    try:
        if job.peer == "cudalink":
            _consume(job, out, lambda: LinkSource(job), wake)
        elif job.peer == "shm":
            _consume(job, out, lambda: ShmSource(job, _pipe(chan)), wake)
        else:
            _consume(job, out, lambda: QueueSource(job, _queue(chan)), wake)
    finally:
        if wake is not None:
            wake.close()


class _BareWake:
    """The wake floor paired with a run: a beat after each frame the producer writes one message on a bare
    socketpair, and this consumer, blocked in a bare read as the floor step's child is, times it.

    Both figures then come from the same two processes at the same cadence, in the same minutes: on a
    shared 2-vCPU VM the floor step's wake, taken a minute apart, moved 2x between runs.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn  # owns the fd; the socket below is a view of it
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))

    def after(self, seq: int) -> int:
        """Block for frame ``seq``'s beat: ns from its write to here, or -1 when it was no wake (it was
        already waiting, or the producer left). A later frame's beat is left for that frame."""
        sock, fd = self._sock, self._sock.fileno()
        while True:
            waited = not select.select([fd], [], [], 0)[0]
            data = sock.recv(_BEAT.size, socket.MSG_PEEK)
            t = time.monotonic_ns()
            if len(data) < _BEAT.size:
                return -1
            got, sent = _BEAT.unpack(data)
            if got > seq:  # we are behind (this frame was late): not its beat, and keep that frame's
                return -1
            sock.recv(_BEAT.size)
            if got == seq:
                return t - sent if waited else -1

    def close(self) -> None:
        self._sock.close()
        self._conn.close()


def _consume(
    job: ConsumerJob, out: mpq.Queue[ConsumerMsg], open_source: Callable[[], Source[_F]], wake: _BareWake | None
) -> None:
    src: Source[_F] | None = None
    seqs: list[int] = []
    times: list[int] = []
    walls: list[int] = []
    pubs: list[int] = []
    costs: list[int] = []
    dcosts: list[int] = []  # poll mode: deleting the exported array/tensor
    rcosts: list[int] = []  # poll mode: frame.release()
    second: list[bool] = []  # poll mode: the paired floor ran first after this frame's wake
    floors: list[int] = []  # poll mode, host links: the paired view_read floor per frame (-1: not this frame)
    wakes: list[int] = []  # recv mode, a paired wake floor: the bare wake a beat after each frame
    try:
        src = open_source()
        out.put(("ready", job.index, os.getpid()))
        cpu0 = time.process_time_ns()
        if job.mode == "async":
            if not isinstance(src, LinkSource):
                raise LinkError(f"cudalink: async mode receives through cudalink, not {job.peer}")
            asyncio.run(_consume_async(src, seqs, times, walls, pubs))
        elif job.mode == "poll":
            # host links: every other frame, the view_read floor runs first after the wake, in this same
            # process (its cudalink costs are then not first after the wake, and are marked so)
            bare = src.bare_view_ns if isinstance(src, LinkSource) and job.device < 0 else None
            spec: tuple[tuple[int, ...], np.dtype[np.generic]] | None = None
            while True:
                if not src.ready(job.timeout):
                    raise LinkTimeout(f"cudalink: no frame within {job.timeout}s")
                floor_ns = bare(*spec) if bare is not None and spec is not None and len(seqs) % 2 else None
                t0 = time.monotonic_ns()
                got = src.take_now()
                if got is None:
                    break
                if got is False:
                    continue
                seq, obj, pub = got
                x = src.export(obj)
                t1 = time.monotonic_ns()
                del x  # the framework frees its tensor/array (timed apart: not cudalink's code)
                t2 = time.monotonic_ns()
                src.done(obj)  # frame.release(): the GPU fence and the lease
                t3 = time.monotonic_ns()
                seqs.append(seq)
                times.append(t0)
                walls.append(time.time_ns())
                pubs.append(pub)
                costs.append(t1 - t0)
                dcosts.append(t2 - t1)
                rcosts.append(t3 - t2)
                second.append(floor_ns is not None)
                if spec is None and bare is not None and isinstance(obj, Frame):
                    spec = (obj.shape, obj.dtype)  # the floor's view has the frames' shape (read untimed)
                floors.append(-1 if floor_ns is None else floor_ns)
        else:
            while True:
                took = src.take()
                if took is None:
                    break
                seq, obj, pub, t, wall = took
                seqs.append(seq)
                times.append(t)
                walls.append(wall)
                pubs.append(pub)
                src.done(obj)
                del obj
                if wake is not None:
                    wakes.append(wake.after(seq))
        result: ConsumerResult = {
            "seq": seqs,
            "t": times,
            "wall": walls,
            "pub": pubs,
            "cost": costs,
            "rcost": rcosts,
            "dcost": dcosts,
            "second": second,
            "floor": floors,
            "wake": wakes,
            "skipped": int(src.skipped),
            "cpu_ns": time.process_time_ns() - cpu0,
        }
        out.put(("result", job.index, result))
    except BaseException as exc:
        out.put(("error", job.index, _one_line(exc)))
    finally:
        if src is not None:
            with contextlib.suppress(Exception):
                src.close()


async def _consume_async(src: LinkSource, seqs: list[int], times: list[int], walls: list[int], pubs: list[int]) -> None:
    while True:
        try:
            f = await src.rx.recv_async()
        except ProducerGone:
            return
        times.append(time.monotonic_ns())
        walls.append(time.time_ns())
        seqs.append(f.seq)
        pubs.append(f.timestamp_ns)
        f.release()


# ============================================================================================ the bench


@dataclass(frozen=True)
class Plan:
    """Sample counts and pacing; ``quick`` is sized for a 2-core CI box in well under a minute."""

    latency_frames: int
    small_seconds: float  # the max-rate run is time-bounded: a short burst is one scheduler decision
    fanout_frames: int
    bw_iters: int
    warm: int
    interval_s: float = 0.002
    fanout_interval_s: float = 0.004
    frame_shape: tuple[int, ...] = (1080, 1920, 4)
    small_shape: tuple[int, ...] = (64, 64, 4)
    slots: int = 4
    #: cudalink's fan-out runs in this many turns with a one-consumer run at the same cadence: its goal's
    #: reference then sees the same minutes of the machine (on one H100 its p99 went 324, 301, 65 us in 3 rounds)
    fanout_turns: int = 4


QUICK = Plan(latency_frames=200, small_seconds=0.5, fanout_frames=400, bw_iters=20, warm=10, fanout_turns=4)
FULL = Plan(latency_frames=2000, small_seconds=3.0, fanout_frames=1000, bw_iters=200, warm=50)

PEER_LABELS_CPU = {"shm": "SharedMemory copy + pipe"}
PEER_LABELS_GPU = {
    "torch-mp": "torch.multiprocessing CUDA tensor via mp.Queue",
    "shm": "SharedMemory D2H copy + pipe + H2D upload",
    "core-pickle": "cuda.core IPC Buffer pickled via mp.Queue",
}
PEER_ORDER = ("torch-mp", "shm", "core-pickle")

#: the parts ``bench --only`` can pick (comma-separated); each names one or more steps of a run
ONLY_CHOICES = (
    "floors",
    "breakdown",
    "handoff",
    "recv-export",
    "small",
    "fanout",
    "wait-modes",
    "copy-send",
    "gpu-clock",
)
#: what a part that ``--only`` left out reads in the report (not an error)
NOT_SELECTED = "not selected (--only)"


class _RunArgs(TypedDict):
    shape: tuple[int, ...]
    n: int
    interval: float


class RunArgs(_RunArgs, total=False):
    """One measured run's settings (:meth:`Bench._run`'s keywords)."""

    seconds: float
    k: int
    mode: str
    wait: WaitMode
    ahead: bool
    latest: bool
    send_floor: bool
    wake_floor: bool
    graph: bool


# -- the report (the bench's JSON) -------------------------------------------------------------------------


class _RowFields(TypedDict):
    id: str
    metric: str
    detail: str
    unit: str
    peer_name: str
    peer_label: str
    status: str  # "ok" | "skipped" | "error"
    reason: str
    cudalink: Summary | None
    peer: Summary | None
    ratio_p50: float | None
    ratio_p99: float | None
    note: str


class Row(_RowFields, total=False):
    """One metric, cudalink against one peer (or a plain D2D copy)."""

    from_send_return: dict[str, Summary | None]  # handoff and fan-out rows


class WaitEntry(TypedDict):
    mode: str
    api: str
    status: str
    reason: str
    handoff: Summary | None
    end_to_end: Summary | None  # send() entered -> recv returned
    wake_paired: Summary | None  # the bare wake in the same two processes, a beat after each frame
    wake_ratio_p50: float | None  # the median over frames of handoff / the bare wake a beat after it
    consumer_cpu_us: float | None  # the consumer's CPU time per frame


class Goal(TypedDict):
    goal: str
    cudalink: float | None
    reference: float | None
    reference_label: str
    ratio: float | None
    target: str
    met: bool | None


#: cudalink figures the goals need that no peer row carries
Extra = TypedDict(
    "Extra",
    {
        "release": Summary | None,
        "recv_export_release": Summary | None,
        "view_read_paired": Summary | None,  # host links: the view_read floor, in the consumer, alternate frames
        "send_floor_paired": Summary | None,  # CUDA: memcpy + record in the producer, halfway between sends
        "fanout_single": Summary | None,  # one consumer's handoff, in turns with the fan-out runs, same cadence
        "fanout_skipped": int | None,  # frames the fan-out's consumers skipped (latest=True), counted, not lost
        "fanout_floor": Summary | None,  # k bare processes woken by one write each, in turns with the fan-out
        "fanout_consumers": int,  # k, the fan-out's consumers
        "cores": int | None,  # CPUs this process may run on (its affinity), where the OS says
        "small_fps_cudalink": float | None,
        "small_fps_torch-mp": float | None,
        "copy_peak_gbps": float | None,  # the card's D2D copy rate, bytes copied per second / 1e9
        "view_read_ratio_p50": float | None,  # median over frame pairs: poll + export + release / the bare view
    },
    total=False,
)


class PlanInfo(TypedDict):
    latency_frames: int
    small_seconds: float
    fanout_frames: int
    fanout_consumers: int
    warmup_frames: int
    interval_ms: float
    slots: int


class _MachineFields(TypedDict):
    python: str
    platform: str
    cpus: int | None
    numpy: str
    control: str


class Machine(_MachineFields, total=False):
    gpu: str
    core: dict[str, str]


#: floor name -> its summary, or why the floors could not be measured
Floors = dict[str, Summary | None] | str


class GoalInputs(TypedDict):
    """What :func:`goals` reads of the report."""

    rows: list[Row]
    wait_modes: list[WaitEntry]
    floors: Floors


class _ReportFields(TypedDict):
    cudalink_version: str
    backend: str
    gpu_lib: str | None
    quick: bool
    duration_s: float
    machine: Machine
    floors: Floors
    breakdown: Breakdown | str


class BenchReport(_ReportFields, total=False):
    """The bench's JSON; a ``--breakdown`` run has only the fields above."""

    backend_note: str
    ratio: str
    clock: str
    plan: PlanInfo
    rows: list[Row]
    wait_modes: list[WaitEntry]
    extra: Extra
    gpu_clock: GpuClock
    goals: list[Goal]


@dataclass
class RunResult:
    sent: dict[int, int]  # seq -> monotonic ns when send() returned
    costs: list[int]  # ns inside send()
    results: list[ConsumerResult]
    drops: int
    warm: int
    entered: dict[int, int]  # seq -> monotonic ns when send() was entered
    #: the bare cuMemcpyDtoDAsync + cuEventRecord timed halfway between sends (``send_floor=True``), ns
    send_floor: list[int]

    @classmethod
    def pooled(cls, runs: Sequence[RunResult]) -> RunResult:
        """Runs of one kind, taken in turns with another kind, as one run: each run's warm-up frames are
        dropped, and its seqs moved past the previous run's so that none collide."""
        sent: dict[int, int] = {}
        entered: dict[int, int] = {}
        per: dict[int, dict[str, Any]] = {}  # consumer index -> its pooled result
        base = 0
        for run in runs:
            sent.update({base + s: t for s, t in run.sent.items() if s > run.warm})
            entered.update({base + s: t for s, t in run.entered.items() if s > run.warm})
            for i, r in enumerate(run.results):
                keep = [j for j, s in enumerate(r["seq"]) if s > run.warm]
                out = per.setdefault(i, {"seq": [], **{k: [] for k in _SERIES}, "skipped": 0, "cpu_ns": 0})
                out["seq"] += [base + r["seq"][j] for j in keep]
                for k in _SERIES:
                    out[k] += _kept(r[k], keep)  # type: ignore[literal-required]
                out["skipped"] += r["skipped"]
                out["cpu_ns"] += r["cpu_ns"]
            base += max([*run.sent, *(s for r in run.results for s in r["seq"])], default=0)
        results = [cast("ConsumerResult", out) for _, out in sorted(per.items())]
        costs = [c for run in runs for c in run.costs[run.warm :]]
        floor = [f for run in runs for f in run.send_floor]
        return cls(sent, costs, results, sum(run.drops for run in runs), 0, entered, floor)

    def handoff(self) -> list[int]:
        """Publish (the producer's stamp, taken once the frame is in place) -> receive returned."""
        return [
            w - p for r in self.results for s, w, p in zip(r["seq"], r["wall"], r["pub"], strict=True) if s > self.warm
        ]

    def from_send_return(self) -> list[int]:
        """send() returned -> receive returned; negative when the consumer wins the race with that return."""
        return self._arrived_since(self.sent)

    def from_send_entry(self) -> list[int]:
        """send() entered -> receive returned: end to end, whatever of the send the wake-up overlaps."""
        return self._arrived_since(self.entered)

    def _arrived_since(self, stamps: dict[int, int]) -> list[int]:
        return [
            t - stamps[s]
            for r in self.results
            for s, t in zip(r["seq"], r["t"], strict=True)
            if s > self.warm and s in stamps
        ]

    def consumer_cpu_us(self) -> float | None:
        """Consumer CPU time per received frame (µs), all consumers pooled: what waiting costs."""
        frames = sum(len(r["seq"]) for r in self.results)
        return sum(r["cpu_ns"] for r in self.results) / frames / 1e3 if frames else None

    def send_costs(self) -> list[int]:
        return self.costs[self.warm :]

    def _first(self, r: ConsumerResult, key: Literal["cost", "rcost", "dcost"]) -> list[int]:
        """Per-frame costs of frames whose cudalink code ran first after the wake (see ``paired_floor``)."""
        second = r["second"] or [False] * len(r["seq"])
        return [c for s, c, x in zip(r["seq"], r[key], second, strict=False) if s > self.warm and not x]

    def recv_costs(self) -> list[int]:
        return [c for r in self.results for c in self._first(r, "cost")]

    def release_costs(self) -> list[int]:
        """Poll mode: ``frame.release()`` once the exported array/tensor is gone."""
        return [c for r in self.results for c in self._first(r, "rcost")]

    def recv_release_costs(self) -> list[int]:
        """Poll mode: take + export + delete the export + release, per frame."""
        return [
            a + b + c
            for r in self.results
            for a, b, c in zip(self._first(r, "cost"), self._first(r, "dcost"), self._first(r, "rcost"), strict=True)
        ]

    def wake_floor(self) -> list[int]:
        """``wake_floor=True`` runs: the bare socketpair wake a beat after each frame, same two processes."""
        return [w for r in self.results for s, w in zip(r["seq"], r["wake"], strict=False) if s > self.warm and w >= 0]

    def wake_ratios(self) -> list[float]:
        """``wake_floor=True`` runs: each frame's handoff over the bare wake a beat after it, frame by frame."""
        return [
            (w - p) / b
            for r in self.results
            for s, w, p, b in zip(r["seq"], r["wall"], r["pub"], r["wake"], strict=False)
            if s > self.warm and b > 0
        ]

    def floor_ratios(self) -> list[float]:
        """Poll mode, host links: each frame's take + export + delete + release (cudalink first after its
        wake) over the paired view_read floor of the next frame (the floor first after its wake)."""
        out: list[float] = []
        for r in self.results:
            if not r["second"]:
                continue
            rows = list(zip(r["seq"], r["cost"], r["dcost"], r["rcost"], r["second"], r["floor"], strict=False))
            for (s, a, b, c, second, _), nxt in itertools.pairwise(rows):
                if s > self.warm and not second and nxt[4] and nxt[5] > 0:
                    out.append((a + b + c) / nxt[5])
        return out

    def paired_floor(self) -> list[int]:
        """Poll mode, host links: the view_read floor timed in the consumer itself, on alternate frames."""
        return [f for r in self.results for s, f in zip(r["seq"], r["floor"], strict=False) if s > self.warm and f >= 0]

    def intervals(self) -> list[int]:
        out: list[int] = []
        for r in self.results:
            t = [x for s, x in zip(r["seq"], r["t"], strict=True) if s > self.warm]
            out.extend(int(d) for d in np.diff(np.asarray(t, dtype=np.int64)))
        return out

    def fps(self) -> float | None:
        rates = []
        for r in self.results:
            t = [x for s, x in zip(r["seq"], r["t"], strict=True) if s > self.warm]
            if len(t) > 1 and t[-1] > t[0]:
                rates.append((len(t) - 1) / ((t[-1] - t[0]) / 1e9))
        return float(np.mean(rates)) if rates else None

    def skipped(self) -> int:
        return sum(int(r.get("skipped", 0)) for r in self.results)


@dataclass
class Bench:
    """One bench run: cudalink and every peer this machine can run, measured side by side."""

    quick: bool
    backend: Backend
    frames: int | None = None
    fanout: int = 8
    debug: bool = False
    progress: Callable[[str, int, int], None] | None = None
    breakdown_only: bool = False  # ``--breakdown``: the floors and the stage breakdown, nothing else
    wake_ahead: bool = True  # the breakdown consumer's ``Receiver(wake_ahead=...)``
    only: frozenset[str] | None = None  # ``--only``: the parts of ONLY_CHOICES to run (None: all)
    mps: bool = False  # ``--mps``: the GPU-clock rows also run under the MPS daemon, started and stopped here
    plan: Plan = field(init=False)
    _floors: dict[str, list[int]] | str | None = field(default=None, init=False)
    _fanout_floor: list[int] = field(default_factory=list, init=False)
    _breakdown: Breakdown | str | None = field(default=None, init=False)
    _runs: dict[tuple[str, str], RunResult | str] = field(default_factory=dict, init=False)
    _bw: dict[str, CopySend | str] = field(default_factory=dict, init=False)
    _gpu_clock: GpuClock | None = field(default=None, init=False)
    _lib: GpuLib | None = field(default=None, init=False)
    _counter: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        base = QUICK if self.quick else FULL
        if self.frames is not None:
            n = max(self.frames, base.warm + 10)
            base = Plan(n, base.small_seconds, max(10 + base.warm, n // 2), base.bw_iters, base.warm)
        self.plan = base
        self._ctx = mp.get_context("spawn")

    # -- what runs ----------------------------------------------------------------------------------

    def _selected(self, part: str) -> bool:
        """Whether ``--only`` (if given) picked ``part``, one of ONLY_CHOICES."""
        return self.only is None or part in self.only

    def peers(self) -> dict[str, str | None]:
        """Peer -> None if it runs here, else the reason it is skipped."""
        gpu_reason = "needs a CUDA GPU (this run uses the CPU backend)"
        out: dict[str, str | None] = {}
        for p in PEER_ORDER:
            if p == "shm":
                out[p] = None
            elif not self.backend.is_cuda:
                out[p] = gpu_reason
            elif p == "torch-mp" and importlib.util.find_spec("torch") is None:
                out[p] = "torch is not installed"
            else:
                out[p] = None
        return out

    def peer_label(self, peer: str) -> str:
        labels = PEER_LABELS_GPU if self.backend.is_cuda else {**PEER_LABELS_GPU, **PEER_LABELS_CPU}
        return labels.get(peer, peer)

    def _steps(self) -> list[tuple[str, Callable[[], None]]]:
        """The run's steps, in order, less those ``--only`` left out."""
        return [(desc, fn) for part, desc, fn in self._all_steps() if self._selected(part)]

    def _all_steps(self) -> list[tuple[str, str, Callable[[], None]]]:
        """(part of ONLY_CHOICES, description, step) for everything a run can measure here."""
        pl = self.plan
        live = [p for p, why in self.peers().items() if why is None]
        steps: list[tuple[str, str, Callable[[], None]]] = [
            ("floors", "floors · bare OS and driver", self._floors_step),
            ("breakdown", "breakdown · cudalink stages", self._breakdown_step),
        ]
        if self.breakdown_only:
            return steps
        part_of = {"handoff": "handoff", "recv_export": "recv-export", "small_throughput": "small", "fanout": "fanout"}
        runs: list[tuple[str, RunArgs]] = [
            (
                "handoff",
                {"shape": pl.frame_shape, "n": pl.latency_frames, "interval": pl.interval_s, "send_floor": True},
            ),
            (
                "recv_export",
                {"shape": pl.frame_shape, "n": pl.latency_frames, "interval": pl.interval_s, "mode": "poll"},
            ),
            (
                "small_throughput",
                {
                    "shape": pl.small_shape,
                    "n": 1 << 62,
                    "seconds": pl.small_seconds,
                    "interval": 0.0,
                    "latest": False,
                },
            ),
            (
                "fanout",
                {
                    "shape": pl.frame_shape,
                    "n": pl.fanout_frames,
                    "interval": pl.fanout_interval_s,
                    "k": self.fanout,
                },
            ),
        ]
        for metric, kw in runs:
            for peer in ("cudalink", *live):
                turns = (metric, peer) == ("fanout", "cudalink")
                step = self._fanout_step(kw) if turns else self._step(metric, peer, kw)
                steps.append((part_of[metric], f"{metric} · {peer}", step))
        # the sleeping modes are judged against a bare wake a beat after each of their frames (``wake_floor``)
        modes: tuple[Literal["spin", "hybrid", "block", "async"], ...] = ("spin", "hybrid", "block", "async")
        for mode in modes:
            kw = {
                "shape": pl.frame_shape,
                "n": pl.latency_frames,
                "interval": pl.interval_s,
                "wait": "hybrid" if mode == "async" else mode,
                "mode": "async" if mode == "async" else "recv",
                "wake_floor": mode in ("hybrid", "block"),
            }
            steps.append(("wait-modes", f"wait={mode} · cudalink", self._step(f"wait_{mode}", "cudalink", kw)))
        # the same block run with the consumer sleeping until each publish: what waking ahead buys
        kw = {
            "shape": pl.frame_shape,
            "n": pl.latency_frames,
            "interval": pl.interval_s,
            "wait": "block",
            "ahead": False,
            "wake_floor": True,
        }
        step = self._step("wait_block_noahead", "cudalink", kw)
        steps.append(("wait-modes", "wait=block wake_ahead=False · cudalink", step))
        if self.backend.is_cuda:  # the same block run with send()'s copy + ready event as one CUDA graph
            kw = {
                **kw,
                "ahead": True,
                "graph": True,
                "n": max(pl.latency_frames // 2, pl.warm + 10),
            }  # the 8-min budget
            steps.append(
                ("wait-modes", "wait=block, send() as a CUDA graph", self._step("wait_block_graph", "cudalink", kw))
            )
        if self.backend.is_cuda:
            for key, shape in (("copy_bw_1080p_f32", (1080, 1920, 4)), ("copy_bw_4k_f32", (2160, 3840, 4))):
                steps.append(("copy-send", f"{key} · send vs bare copy", self._bw_step(key, shape)))
            steps.append(("gpu-clock", "gpu clock · kernel to kernel", self._gpu_clock_step))
        return steps

    def _step(self, metric: str, peer: str, kw: RunArgs) -> Callable[[], None]:
        def run() -> None:
            try:
                self._runs[(metric, peer)] = self._run(peer, **kw)
            except Exception as exc:
                if self.debug:
                    traceback.print_exc()
                self._runs[(metric, peer)] = _one_line(exc)

        return run

    def _fanout_step(self, kw: RunArgs) -> Callable[[], None]:
        """cudalink's fan-out in turns with one consumer at the same cadence (``Plan.fanout_turns``): the
        fan-out goal compares the two, so both must see the same minutes of the machine."""

        from . import floors as _floors

        def run() -> None:
            turns = max(1, self.plan.fanout_turns)
            each: RunArgs = {**kw, "n": -(-kw["n"] // turns) + self.plan.warm}
            # as many samples as the fan-out pools (k consumers): a p99 of n samples is its n/100-th largest,
            # and one hiccup of the machine moves the p99 of the smaller sample
            single: RunArgs = {**each, "k": 1, "n": (each["n"] - self.plan.warm) * kw["k"] + self.plan.warm}
            fan: list[RunResult] = []
            one: list[RunResult] = []
            pl, b = self.plan, self.backend
            try:
                for _ in range(turns):
                    one.append(self._run("cudalink", **single))
                    fan.append(self._run("cudalink", **each))
                    try:  # the OS's own fan-out at the same cadence: k bare processes, one write each
                        self._fanout_floor += _floors.fanout_wake(
                            kw["k"], pl.frame_shape, each["n"] - pl.warm, kw["interval"], pl.warm, b.device
                        )
                    except Exception:
                        if self.debug:
                            traceback.print_exc()
                self._runs[("fanout", "cudalink")] = RunResult.pooled(fan)
                self._runs[("fanout_single", "cudalink")] = RunResult.pooled(one)
            except Exception as exc:
                if self.debug:
                    traceback.print_exc()
                self._runs[("fanout", "cudalink")] = _one_line(exc)

        return run

    def _floors_step(self) -> None:
        from . import floors as _floors

        pl, b = self.plan, self.backend
        try:
            self._floors = _floors.measure(b.device, b.lib, pl.frame_shape, pl.latency_frames, pl.interval_s, pl.warm)
        except Exception as exc:
            if self.debug:
                traceback.print_exc()
            self._floors = _one_line(exc)

    def _breakdown_step(self) -> None:
        from . import breakdown as _breakdown

        pl, b = self.plan, self.backend
        try:
            self._breakdown = _breakdown.run(
                b.device,
                b.lib,
                pl.frame_shape,
                pl.latency_frames,
                pl.interval_s,
                pl.warm,
                wait="block",
                wake_ahead=self.wake_ahead,
            )
        except Exception as exc:
            if self.debug:
                traceback.print_exc()
            self._breakdown = _one_line(exc)

    def _gpu_clock_step(self) -> None:
        """Kernel to kernel on the GPU's clock (:mod:`.gpuclock`), in a process tree of its own."""
        from . import gpuclock

        b = self.backend
        try:
            self._gpu_clock = gpuclock.run(b.device, b.lib, self.plan.frame_shape, self.quick, self.mps)
        except Exception as exc:
            if self.debug:
                traceback.print_exc()
            self._gpu_clock = {"status": "error", "reason": _one_line(exc), "labels": {}, "setups": {}}

    def _gpu_clock_report(self) -> GpuClock:
        if self._gpu_clock is not None:
            return self._gpu_clock
        if not self.backend.is_cuda:
            why = "GPU only: kernels on both sides"
        elif not self._selected("gpu-clock"):
            why = NOT_SELECTED
        else:
            why = "not run"
        return {"status": "skipped" if why != "not run" else "error", "reason": why, "labels": {}, "setups": {}}

    def _bw_step(self, key: str, shape: tuple[int, ...]) -> Callable[[], None]:
        def run() -> None:
            try:
                self._bw[key] = self._copy_bw(shape)
            except Exception as exc:
                if self.debug:
                    traceback.print_exc()
                self._bw[key] = _one_line(exc)

        return run

    # -- one measured run ------------------------------------------------------------------------------

    def _gpu(self) -> GpuLib:
        if self._lib is None:
            self._lib = GpuLib(self.backend.lib, self.backend.device)
        return self._lib

    def _source(self, shape: tuple[int, ...], dtype: str) -> object:
        host = (np.arange(int(math.prod(shape))) % 251).astype(dtype).reshape(shape)
        if not self.backend.is_cuda:
            return host
        lib = self._gpu()
        dev = lib.from_numpy(host)
        lib.sync()
        return dev

    def _name(self) -> str:
        self._counter += 1
        return f"bench-{os.getpid()}-{self._counter}"

    def _producer(self, peer: str, shape: tuple[int, ...], dtype: str, k: int) -> Producer:
        b, slots = self.backend, self.plan.slots
        if peer == "cudalink":
            return LinkProducer(self._name(), shape, dtype, k, slots, b)
        lib = self._gpu() if b.is_cuda else None
        if peer == "shm":
            return ShmProducer(self._ctx, f"cudalink-peer-{self._name()}", shape, dtype, k, slots, lib)
        assert lib is not None
        return QueueProducer(self._ctx, peer, self._name(), shape, dtype, k, slots, lib, b.device)

    def _run(
        self,
        peer: str,
        *,
        shape: tuple[int, ...],
        n: int,
        interval: float,
        seconds: float = math.inf,
        k: int = 1,
        mode: str = "recv",
        wait: WaitMode = "hybrid",
        ahead: bool = True,
        latest: bool = True,
        dtype: str = "uint8",
        send_floor: bool = False,
        wake_floor: bool = False,
        graph: bool = False,
    ) -> RunResult:
        if graph:  # _backends.SEND_GRAPH for this run only: the producer is this process
            from .. import _backends

            _backends.SEND_GRAPH = True
            try:
                return self._run(
                    peer,
                    shape=shape,
                    n=n,
                    interval=interval,
                    seconds=seconds,
                    k=k,
                    mode=mode,
                    wait=wait,
                    ahead=ahead,
                    latest=latest,
                    dtype=dtype,
                    send_floor=send_floor,
                    wake_floor=wake_floor,
                )
            finally:
                _backends.SEND_GRAPH = False
        src = self._source(shape, dtype)
        paired: CopyRecordFloor | None = None
        if send_floor and peer == "cudalink" and self.backend.is_cuda and interval:
            from .floors import CopyRecordFloor

            paired = CopyRecordFloor(self.backend.device, self.backend.lib, shape)
        beats: tuple[Connection, Connection] | None = None
        if wake_floor and k == 1 and interval and not _platform.IS_WINDOWS:  # a socketpair there, not a pipe
            beats = self._ctx.Pipe(duplex=True)
        floor: list[int] = []
        out: mpq.Queue[ConsumerMsg] = self._ctx.Queue()
        prod = self._producer(peer, shape, dtype, k)
        procs: list[SpawnProcess] = []
        try:
            for i in range(k):
                job = ConsumerJob(
                    peer=peer,
                    index=i,
                    name=prod.name,
                    mode=mode,
                    wait=wait,
                    ahead=ahead,
                    latest=latest,
                    shape=shape,
                    dtype=dtype,
                    device=self.backend.device,
                    lib=self.backend.lib,
                    **prod.job_fields(),
                )
                args = (job, prod.chan(i), out, beats[1] if beats else None)
                p = self._ctx.Process(target=bench_consumer, args=args, daemon=True)
                p.start()
                procs.append(p)
            beat = self._beat(beats[0], src) if beats else None
            self._collect(out, "ready", k, procs, 120.0)
            prod.wait_connected(k, 30.0)
            sent: dict[int, int] = {}
            entered: dict[int, int] = {}
            costs: list[int] = []
            drops = 0
            mono = time.monotonic_ns
            end = mono() + (seconds * 1e9 if math.isfinite(seconds) else 1 << 62)
            for _ in range(n):
                t0 = mono()
                if t0 >= end:
                    break
                seq = prod.send(src)
                t1 = mono()
                if beat is not None:  # asleep at once, as after a beat: the consumer often waits for this core
                    time.sleep(interval / 2)
                if seq is None:
                    drops += 1
                else:
                    sent[seq] = t1
                    entered[seq] = t0
                    costs.append(t1 - t0)
                if paired is not None:  # the floor halfway between two sends: the same sleep before each
                    time.sleep(interval / 2)
                    floor.append(sum(paired()))
                    time.sleep(interval / 2)
                elif beat is not None:  # the bare wake half a period after the send: the consumer sleeps as long
                    if seq is not None:  # before each, and frames still come every ``interval`` (the rows' cadence)
                        beat(seq)
                    time.sleep(interval / 2)
                elif interval:
                    time.sleep(interval)
            prod.finish()
            # queue peers have no back-pressure: at max rate a slow consumer still drains a backlog after
            # the producer stops (the cuda.core pickle peer needed over 60 s on one H100), so allow for it
            results = self._collect(out, "result", k, procs, 60.0 + min(240.0, 0.004 * len(sent)))
            # a graph run whose graph the driver refused measured the plain calls: say so, do not report it
            slots = prod.tx._slots if isinstance(prod, LinkProducer) else None
            fell_back = str(getattr(slots, "graph_error", ""))
        finally:
            # importers first, exporter last: freeing a pool while consumers still map it is undefined
            # behaviour in the driver (it segfaulted the core-pickle peer on an H200)
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=2.0)
            prod.close()
            if paired is not None:
                paired.close()
            for conn in beats or ():
                conn.close()
            with contextlib.suppress(Exception):
                out.close()
        if fell_back:
            raise LinkError(f"cudalink: send() fell back from the CUDA graph to the plain calls: {fell_back}")
        return RunResult(sent, costs, results, drops, self.plan.warm, entered, floor[self.plan.warm :])

    def _beat(self, conn: Connection, src: object) -> Callable[[int], None]:
        """The producer's half of the paired wake floor: what the floor step's parent does before each wake
        (on the CPU backend a host producer's copy of the frame, so the write starts from the same cache
        state), then one bare write."""
        fd, pack, mono = conn.fileno(), _BEAT.pack, time.monotonic_ns
        pair = (np.empty_like(src), src) if isinstance(src, np.ndarray) else None

        def beat(seq: int) -> None:
            if pair is not None:
                np.copyto(*pair)
            os.write(fd, pack(seq, mono()))

        return beat

    @staticmethod
    def _collect(
        out: mpq.Queue[ConsumerMsg],
        kind: Literal["ready", "result"],
        k: int,
        procs: Sequence[BaseProcess],
        timeout: float,
    ) -> list[ConsumerResult]:
        """Wait for every consumer's ``kind`` message; the results, in consumer order (none for "ready")."""
        got: dict[int, ConsumerResult | None] = {}
        deadline = time.monotonic() + timeout
        while len(got) < k:
            try:
                msg = out.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
            if msg is None:
                if time.monotonic() > deadline:
                    raise LinkTimeout(f"cudalink: {k - len(got)} consumer(s) sent no '{kind}' in {timeout:.0f}s")
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise LinkError(f"cudalink: a consumer process died (exit code {dead[0].exitcode})")
                continue
            if msg[0] == "error":
                raise LinkError(f"cudalink: consumer {msg[1]} failed: {msg[2]}")
            if msg[0] == kind:
                got[int(msg[1])] = msg[2] if msg[0] == "result" else None
        return [r for i in sorted(got) if (r := got[i]) is not None]

    def _copy_send_row(self, key: str, label: str, got: CopySend | str | None, peak: float | None, burst: bool) -> Row:
        """One copy-send row: a send at a time (``key``), or :data:`copysend.BURST` back to back (``key`` with
        ``_burst``), each against the bare copy of the same bytes timed the same way."""
        from .copysend import BURST

        if burst:
            row = _row(
                key.replace("copy_bw", "copy_burst"),
                f"copy-send {label}, {BURST} back to back (us/frame)",
                f"{BURST} send(stream=s) until every ready event fired vs {BURST} cuMemcpyDtoDAsync, CUDA events on s",
                "us",
                "d2d",
                f"{BURST} bare cuMemcpyDtoDAsync, same bytes",
            )
        else:
            row = _row(
                key,
                f"copy-send {label}",
                "GPU time by CUDA events on the stream both copies run on: send(stream=s) vs cuMemcpyDtoDAsync",
                "us",
                "d2d",
                "bare cuMemcpyDtoDAsync, same bytes",
            )
        if not self.backend.is_cuda:
            row["status"], row["reason"] = "skipped", "GPU only: compares against a device-to-device copy"
            return row
        if got is None and not self._selected("copy-send"):
            row["status"], row["reason"] = "skipped", NOT_SELECTED
            return row
        if got is None or isinstance(got, str):
            row["status"], row["reason"] = "error", got or "not run"
            return row
        ours, bare = (got["burst_send"], got["burst_bare"]) if burst else (got["send"], got["bare"])
        row["cudalink"], row["peer"] = summarize(ours), summarize(bare)
        _ratios(row)
        rates = {  # bytes copied per second / 1e9 (p50 is in us)
            who: got["nbytes"] / (s["p50"] * 1e3)
            for who, s in (("cudalink", row["cudalink"]), ("bare copy", row["peer"]))
            if s and s["p50"] > 0
        }
        parts = [f"{who} {r:,.0f} GB/s" for who, r in rates.items()]
        bare_p50 = row["peer"]["p50"] if row["peer"] else 0.0
        if not burst:
            ev = summarize(got.get("bare_event") or [])
            if ev and ev["p50"] > 0:  # what send() queued on the copy's stream before 2026-11-26
                parts.append(
                    f"bare copy + IPC event record on its stream {ev['p50']:.1f} us ({bare_p50 / ev['p50']:.0%})"
                )
            ready = summarize(got.get("send_ready") or [])
            if ready and ready["p50"] > 0:  # one frame, until a consumer's stream could start on it
                parts.append(f"send until its ready event fired {ready['p50']:.1f} us ({bare_p50 / ready['p50']:.0%})")
        if got["timing"] != "gated":
            parts.append("stream not gated: queueing time counts (no cuStreamWaitValue32)")
        if peak and "cudalink" in rates:
            parts.append(f"card's peak {peak:,.0f} GB/s (cudalink at {rates['cudalink'] / peak:.0%} of it)")
        row["note"] = " · ".join(parts)
        return row

    def _copy_bw(self, shape: tuple[int, ...]) -> CopySend:
        """``send()`` vs a bare ``cuMemcpyDtoDAsync`` of the same float32 frame, timed by CUDA events on the
        one stream both copies run on (:mod:`.copysend`); the card's peak once per run."""
        from . import copysend

        b = self.backend
        return copysend.measure(b.device, b.lib, shape, self.plan.bw_iters, peak=not self._bw)

    # -- everything ---------------------------------------------------------------------------------------

    def run(self) -> BenchReport:
        started = time.time()
        steps = self._steps()
        for i, (desc, fn) in enumerate(steps):
            if self.progress is not None:
                self.progress(desc, i, len(steps))
            fn()
        if self.progress is not None:
            self.progress("done", len(steps), len(steps))
        return self._report(time.time() - started)

    def _get(self, metric: str, peer: str) -> RunResult | str | None:
        return self._runs.get((metric, peer))

    def _report(self, duration: float) -> BenchReport:
        if self.breakdown_only:
            return self._report_breakdown(duration)
        export = f"{self.backend.lib}.from_dlpack" if self.backend.is_cuda else "np.from_dlpack"
        k = self.fanout
        pl = self.plan
        frame = "x".join(map(str, pl.frame_shape)) + " uint8"
        small = "x".join(map(str, pl.small_shape)) + " uint8"
        metrics: list[tuple[str, str, str, str, Callable[[RunResult], list[int]]]] = [
            (
                "handoff",
                "handoff latency",
                f"{frame}; publish (frame in place, stamped) -> recv() returns in another process",
                "us",
                RunResult.handoff,
            ),
            ("send_cost", "producer send cost", f"{frame}; time inside send()", "us", RunResult.send_costs),
            (
                "recv_export",
                f"recv + {export}",
                f"{frame}; consumer takes a waiting frame and exports it",
                "us",
                RunResult.recv_costs,
            ),
            (
                "small_throughput",
                "small-frame throughput",
                f"{small}; time per delivered frame, max rate",
                "us/frame",
                RunResult.intervals,
            ),
            (
                "fanout",
                f"{k}-consumer fan-out latency",
                f"{frame}; publish -> each of {k} consumers' recv() returns",
                "us",
                RunResult.handoff,
            ),
        ]
        run_of = {"send_cost": "handoff"}
        rows: list[Row] = []
        peers = self.peers()
        for mid, title, detail, unit, fn in metrics:
            run_id = run_of.get(mid, mid)
            ours = self._get(run_id, "cudalink")
            part = {"send_cost": "handoff", "recv_export": "recv-export", "small_throughput": "small"}.get(mid, mid)
            for peer in PEER_ORDER:
                row = _row(mid, title, detail, unit, peer, self.peer_label(peer))
                if not self._selected(part):
                    row["status"], row["reason"] = "skipped", NOT_SELECTED
                    rows.append(row)
                    continue
                _fill(row, ours, fn, "cudalink")
                why = peers[peer]
                if why is not None:
                    row["status"], row["reason"] = "skipped", why
                else:
                    _fill(row, self._get(run_id, peer), fn, "peer")
                _ratios(row)
                if mid in ("handoff", "fanout"):
                    theirs = self._get(run_id, peer) if why is None else None
                    row["from_send_return"] = {
                        who: summarize(run.from_send_return()) if isinstance(run, RunResult) else None
                        for who, run in (("cudalink", ours), ("peer", theirs))
                    }
                if mid == "small_throughput":
                    row["note"] = _throughput_note(ours, self._get(run_id, peer) if why is None else None)
                    if peer == "shm" and why is None:
                        row["note"] += " · peer has no back-pressure: its ring is overwritten while unread"
                if mid == "send_cost" and peer == "torch-mp" and why is None:
                    row["note"] = "put() only enqueues; pickling runs in the queue's feeder thread"
                if mid == "send_cost" and peer == "core-pickle" and why is None:
                    row["note"] = "includes a stream sync: a pickled Buffer carries no IPC event"
                rows.append(row)
        bw_rows = (("copy_bw_1080p_f32", "1080x1920x4 float32"), ("copy_bw_4k_f32", "2160x3840x4 float32"))
        peak = next((got["peak_gbps"] for got in self._bw.values() if not isinstance(got, str)), None)
        for key, label in bw_rows:
            got = self._bw.get(key)
            for burst in (False, True):
                rows.append(self._copy_send_row(key, label, got, peak, burst))
        waits: list[WaitEntry] = []
        wait_modes = ("spin", "hybrid", "block", "block_noahead", "async")
        for mode in (*wait_modes, "block_graph") if self.backend.is_cuda else wait_modes:
            run = self._get(f"wait_{mode}", "cudalink")
            api = f"Receiver(wait={mode!r}).recv()"
            if mode == "async":
                api = "await rx.recv_async()"
            elif mode == "block_noahead":
                api = "Receiver(wait='block', wake_ahead=False).recv()"
            elif mode == "block_graph":
                api = "Receiver(wait='block').recv(); send() as one CUDA graph (_backends.SEND_GRAPH)"
            entry: WaitEntry = {
                "mode": mode,
                "api": api,
                "status": "ok",
                "reason": "",
                "handoff": None,
                "end_to_end": None,
                "wake_paired": None,
                "wake_ratio_p50": None,
                "consumer_cpu_us": None,
            }
            if run is None and not self._selected("wait-modes"):
                entry["status"], entry["reason"] = "skipped", NOT_SELECTED
            elif isinstance(run, RunResult):
                entry["handoff"] = summarize(run.handoff())
                entry["end_to_end"] = summarize(run.from_send_entry())
                entry["wake_paired"] = summarize(run.wake_floor())
                ratios = run.wake_ratios()
                entry["wake_ratio_p50"] = float(np.median(ratios)) if ratios else None
                entry["consumer_cpu_us"] = run.consumer_cpu_us()
            else:
                entry["status"], entry["reason"] = "error", run or "not run"
            waits.append(entry)
        floors: Floors
        if isinstance(self._floors, dict):
            floors = {k: summarize(v) for k, v in self._floors.items()}
        else:
            floors = self._floors or ("not run" if self._selected("floors") else NOT_SELECTED)
        report_rows: GoalInputs = {"rows": rows, "wait_modes": waits, "floors": floors}
        return {
            "cudalink_version": __version__,
            "backend": self.backend.label,
            "gpu_lib": self.backend.lib or None,
            "backend_note": self.backend.note,
            "quick": self.quick,
            "duration_s": round(duration, 2),
            "ratio": "cudalink / peer; below 1 means cudalink is faster (every metric is lower-is-better)",
            "clock": (
                "handoff: the producer's time.time_ns() publish stamp vs the consumer's time.time_ns() (one "
                "system-wide clock); from_send_return and costs: time.monotonic_ns (CLOCK_MONOTONIC, "
                "system-wide on Linux)"
            ),
            "plan": {
                "latency_frames": pl.latency_frames,
                "small_seconds": pl.small_seconds,
                "fanout_frames": pl.fanout_frames,
                "fanout_consumers": k,
                "warmup_frames": pl.warm,
                "interval_ms": pl.interval_s * 1e3,
                "slots": pl.slots,
            },
            "machine": machine_info(self.backend),
            "rows": rows,
            "wait_modes": waits,
            "floors": floors,
            "breakdown": self._breakdown
            if self._breakdown is not None
            else ("not run" if self._selected("breakdown") else NOT_SELECTED),
            "extra": self._extra(),
            "gpu_clock": self._gpu_clock_report(),
            "goals": goals(report_rows, self._breakdown, self._extra(), self.backend.is_cuda, self._gpu_clock_report()),
        }

    def _report_breakdown(self, duration: float) -> BenchReport:
        floors: Floors
        if isinstance(self._floors, dict):
            floors = {k: summarize(v) for k, v in self._floors.items()}
        else:
            floors = self._floors or ("not run" if self._selected("floors") else NOT_SELECTED)
        return {
            "cudalink_version": __version__,
            "backend": self.backend.label,
            "gpu_lib": self.backend.lib or None,
            "quick": self.quick,
            "duration_s": round(duration, 2),
            "machine": machine_info(self.backend),
            "floors": floors,
            "breakdown": self._breakdown
            if self._breakdown is not None
            else ("not run" if self._selected("breakdown") else NOT_SELECTED),
        }

    def _extra(self) -> Extra:
        """cudalink figures the goals need that no peer row carries."""
        out: Extra = {}
        run = self._get("recv_export", "cudalink")
        if isinstance(run, RunResult):
            out["release"] = summarize(run.release_costs())
            out["recv_export_release"] = summarize(run.recv_release_costs())
            if run.paired_floor():
                out["view_read_paired"] = summarize(run.paired_floor())
                ratios = run.floor_ratios()
                out["view_read_ratio_p50"] = float(np.median(ratios)) if ratios else None
        run = self._get("handoff", "cudalink")
        if isinstance(run, RunResult) and run.send_floor:
            out["send_floor_paired"] = summarize(run.send_floor)
        run = self._get("fanout_single", "cudalink")
        if isinstance(run, RunResult):
            out["fanout_single"] = summarize(run.handoff())
        run = self._get("fanout", "cudalink")
        if isinstance(run, RunResult):
            out["fanout_skipped"] = run.skipped()
        if self._fanout_floor:
            out["fanout_floor"] = summarize(self._fanout_floor)
        out["fanout_consumers"] = self.fanout
        out["cores"] = _platform.usable_cores()
        small = self._get("small_throughput", "cudalink")
        if isinstance(small, RunResult):
            out["small_fps_cudalink"] = small.fps()
        small = self._get("small_throughput", "torch-mp")
        if isinstance(small, RunResult):
            out["small_fps_torch-mp"] = small.fps()
        peak = next((got["peak_gbps"] for got in self._bw.values() if not isinstance(got, str)), None)
        if peak is not None:
            out["copy_peak_gbps"] = peak
        return out


#: how a goal's figure is judged against its reference: (target text, test)
_GOAL_KINDS: dict[str, tuple[str, Callable[[float, float], bool] | None]] = {
    "1.5x": ("<= 1.5x", lambda v, r: v <= 1.5 * r),
    "2x": ("<= 2x", lambda v, r: v <= 2 * r),
    "3x": ("<= 3x", lambda v, r: v <= 3 * r),
    "3x, unjudged": ("<= 3x", None),  # the figure is shown, its verdict is "—": the label says why
    "1x": ("<= 1x", lambda v, r: v <= r),
    "+10us": ("<= floor + 10 us", lambda v, r: v <= r + 10),
    "+20us": ("<= floor + 20 us", lambda v, r: v <= r + 20),
    "10us": ("<= 10 us", lambda v, r: v <= r),
    "95%": (">= 95%", lambda v, r: v >= 0.95),
    "fps": (">= 50,000 fps or >= 4x", lambda v, r: v >= 50_000 or v >= 4 * r),
}


def goals(
    report: GoalInputs,
    breakdown: Breakdown | str | None,
    extra: Extra,
    cuda: bool,
    gpu_clock: GpuClock | None = None,
) -> list[Goal]:
    """The per-frame path's targets, each as cudalink's figure against its floor (or peer) from this run."""
    floors = report["floors"] if isinstance(report["floors"], dict) else {}
    rows = {(r["id"], r["peer_name"]): r for r in report["rows"]}
    waits = {w["mode"]: w["handoff"] for w in report["wait_modes"]}
    beats = {w["mode"]: w.get("wake_paired") for w in report["wait_modes"]}
    e2e = {w["mode"]: w.get("end_to_end") for w in report["wait_modes"]}
    reserve = breakdown.get("reserve_commit") if isinstance(breakdown, dict) else None

    def stat(summary: Summary | None, key: str = "p50") -> float | None:
        return None if not summary else summary.get(key)

    def side(mid: str, peer: str, who: Literal["cudalink", "peer"], key: str = "p50") -> float | None:
        """One side of a row; cudalink's stands where the peer was skipped or failed (a cupy-only install has
        no torch.multiprocessing): only the peer's side needs the row to be whole."""
        row = rows.get((mid, peer))
        if not row or (who == "peer" and row.get("status") != "ok"):
            return None
        return stat(row.get(who), key)

    from .copysend import BURST

    def share(key: str) -> float | None:  # copy-send speed as a share of the D2D copy's
        c, d = side(key, "d2d", "cudalink"), side(key, "d2d", "peer")
        return None if c is None or d is None else d / c

    def wake(mode: str) -> tuple[float | None, str]:
        """A sleeping mode's reference: the bare wake a beat after each of its frames where its run took
        one (the same processes, the same minutes), else the floor step's."""
        beat = beats.get(mode)
        if beat:
            return stat(beat), "bare socketpair wake, same two processes, half a period after each frame"
        return stat(floors.get("wake")), "bare socketpair wake"

    peer = "torch-mp" if cuda else "shm"
    spin = stat(floors.get("spin"))
    sleeping = (  # woken ahead, the consumer's OS wake runs during send(): no wake is in those spans
        ("handoff p50, wait='block', 2 ms cadence (woken ahead: no OS wake in this span)", "block"),
        ("handoff p50, wait='block', wake_ahead=False", "block_noahead"),
        ("handoff p50, wait='hybrid', 2 ms cadence (woken ahead: no OS wake in this span)", "hybrid"),
    )
    table: list[tuple[str, float | None, float | None, str, str]] = [
        (goal, stat(waits.get(mode)), *wake(mode), "1.5x") for goal, mode in sleeping
    ]
    table += [
        ("handoff p50, wait='spin'", stat(waits.get("spin")), spin, "bare spin", "+10us"),
        ("reserve() + commit p50 (in process, no consumer)", stat(reserve), 10.0, "10 us", "10us"),
    ]
    if cuda:
        send = side("send_cost", peer, "cudalink")
        table += [
            (
                "end to end p50, wait='block': send() entered -> recv returned",
                stat(e2e.get("block")),
                stat(e2e.get("block_noahead")),
                "the same with wake_ahead=False",
                "1x",
            ),
            (
                "recv + from_dlpack p50, cross-process",
                side("recv_export", peer, "cudalink"),
                stat(floors.get("wait_dlpack")),
                "cuStreamWaitEvent + from_dlpack of a cached view",
                "2x",
            ),
            (
                "release() p50, cross-process",
                stat(extra.get("release")),
                stat(floors.get("record_ipc_event")),
                "cuEventRecord on an IPC event",
                "2x",
            ),
            (
                "send() p50, 1080p uint8, a consumer attached",
                send,
                stat(floors.get("memcpy_record")),
                "cuMemcpyAsync + cuEventRecord, a loop of their own",
                "2x",
            ),
            (
                "send() p50 vs the same driver calls timed between the sends",
                send,
                stat(extra.get("send_floor_paired")),
                "cuMemcpyAsync + cuEventRecord, halfway between sends",
                "2x",
            ),
            ("send() p50 vs torch.multiprocessing put", send, side("send_cost", peer, "peer"), "Queue.put", "1x"),
            *_end_to_end_goals(e2e, beats, floors, extra),
            (
                "end to end p50, wait='block', send() as one CUDA graph (experiment, off by default)",
                stat(e2e.get("block_graph")),
                stat(e2e.get("block")),
                "plain send(), same run: kept only if it wins",
                "1x",
            ),
            *(
                (
                    f"copy-send {size}_f32{how} as a share of the bare copy (higher is better)",
                    share(f"{key}_{size}_f32"),
                    1.0,
                    f"cuMemcpyDtoDAsync, same bytes, same stream, CUDA events{what}",
                    "95%",
                )
                for size in ("1080p", "4k")
                for key, how, what in (
                    ("copy_bw", "", ""),
                    ("copy_burst", f", {BURST} back to back", ", until every ready event fired"),
                )
            ),
            *_clock_goals(gpu_clock),
            (
                "small frames 64x64x4, delivered fps (higher is better)",
                extra.get("small_fps_cudalink"),
                extra.get("small_fps_torch-mp"),
                "torch.multiprocessing fps",
                "fps",
            ),
        ]
    else:
        paired = extra.get("view_read_paired")
        table.append(
            (
                "poll + np.from_dlpack + release p50",
                stat(extra.get("recv_export_release")),
                stat(paired) if paired else stat(floors.get("view_read")),
                "numpy view of its slot, same consumer, alternate frames"
                if paired
                else "numpy view of a SharedMemory slot",
                "3x",
            )
        )
    single = extra.get("fanout_single")
    k, cores = extra.get("fanout_consumers"), extra.get("cores")
    crowded = k is not None and cores is not None and cores <= k  # not a core each for them and the producer
    label = "one consumer, same cadence, in turns with the fan-out" if single else "single-consumer handoff p99"
    if crowded:
        label += (
            f"; not judged: {k} consumers and the producer on {cores} cores cannot all run at once, so this ratio "
            "measures the core count (the OS's own fan-out row judges the fan-out here)"
        )
    table.append(
        (
            "fan-out p99 vs one consumer's p99",
            side("fanout", peer, "cudalink", "p99"),
            stat(single, "p99") if single else stat(waits.get("hybrid"), "p99"),
            label,
            "3x, unjudged" if crowded else "3x",
        )
    )
    bare_fan = extra.get("fanout_floor")
    if bare_fan:
        table.append(
            (
                "fan-out p99 vs the OS's own fan-out p99",
                side("fanout", peer, "cudalink", "p99"),
                stat(bare_fan, "p99"),
                "as many bare processes woken by one write each, same cadence, in turns with the fan-out (a "
                "whole OS wake; the fan-out's consumers are woken ahead: no OS wake in its span)",
                "1.5x",
            )
        )
    out: list[Goal] = []
    for goal, value, ref, label, kind in table:
        target, test = _GOAL_KINDS[kind]
        out.append(
            {
                "goal": goal,
                "cudalink": value,
                "reference": ref,
                "reference_label": label,
                "ratio": None if value is None or not ref else value / ref,
                "target": target,
                "met": None if value is None or ref is None or test is None else bool(test(value, ref)),
            }
        )
    return out


def _end_to_end_goals(
    e2e: dict[str, Summary | None], beats: dict[str, Summary | None], floors: dict[str, Summary | None], extra: Extra
) -> list[tuple[str, float | None, float | None, str, str]]:
    """End to end with a sleeping consumer against the larger of its two floors (issue 35): the driver calls
    a send makes (timed between the sends, else in a loop of their own) and the bare wake (the same two
    processes, a beat after each frame): waking ahead exists so that the two overlap."""
    copy = extra.get("send_floor_paired") or floors.get("memcpy_record")
    out: list[tuple[str, float | None, float | None, str, str]] = []
    for mode, label in (("block", "send()"), ("block_graph", "send() as one CUDA graph")):
        value = (e2e.get(mode) or {}).get("p50")
        parts = [x["p50"] for x in (copy, beats.get(mode) or beats.get("block")) if x]
        ref = max(parts) if len(parts) == 2 else None
        if mode == "block_graph" and value is None:
            continue
        out.append(
            (
                f"end to end p50, wait='block', {label} entered -> recv returned, vs the larger floor",
                value,
                ref,
                "max(cuMemcpyAsync + cuEventRecord between the sends, bare wake in the same processes)",
                "1.5x",
            )
        )
    return out


def _clock_goals(clock: GpuClock | None) -> list[tuple[str, float | None, float | None, str, str]]:
    """The GPU-clock goal, per pass (without MPS, and with it where it ran): cudalink's pipelined handoff
    p50, producer's kernel -> consumer's kernel, against the same two kernels in one process."""
    setups = clock["setups"] if clock else {}
    out: list[tuple[str, float | None, float | None, str, str]] = []
    for name in ("no MPS", "MPS"):
        setup = setups.get(name)
        if name == "MPS" and (setup is None or setup["status"] == "skipped"):
            continue
        series = setup["series"] if setup else {}

        def p50(key: str, series: dict[str, Series] = series) -> float | None:
            got = series.get(key)
            summary = summarize(got["ns"]) if got else None
            return summary["p50"] if summary else None

        for key, floor, label in (
            ("send_2ms_ahead", "floor_ahead", "2 ms cadence"),
            ("send_60fps_ahead", "floor_60fps_ahead", "60 fps"),
        ):
            out.append(
                (
                    f"GPU handoff p50, kernel to kernel, send() ahead of its kernel, {label} ({name})",
                    p50(key),
                    p50(floor),
                    f"the same two kernels in one process, two streams, one event wait, {label}",
                    "+20us",
                )
            )
    return out


def _row(mid: str, title: str, detail: str, unit: str, peer: str, label: str) -> Row:
    return {
        "id": mid,
        "metric": title,
        "detail": detail,
        "unit": unit,
        "peer_name": peer,
        "peer_label": label,
        "status": "ok",
        "reason": "",
        "cudalink": None,
        "peer": None,
        "ratio_p50": None,
        "ratio_p99": None,
        "note": "",
    }


def _fill(
    row: Row, run: RunResult | str | None, fn: Callable[[RunResult], list[int]], key: Literal["cudalink", "peer"]
) -> None:
    if isinstance(run, RunResult):
        row[key] = summarize(fn(run))
        if row[key] is None and row["status"] == "ok":
            row["status"], row["reason"] = "error", f"{key}: no samples"
    elif row["status"] == "ok":
        row["status"] = "error"
        row["reason"] = f"{key}: {run or 'not run'}"


def _ratios(row: Row) -> None:
    a, b = row["cudalink"], row["peer"]
    if a and b and row["status"] == "ok":
        row["ratio_p50"] = a["p50"] / b["p50"] if b["p50"] > 0 else None
        row["ratio_p99"] = a["p99"] / b["p99"] if b["p99"] > 0 else None


def _throughput_note(ours: RunResult | str | None, theirs: RunResult | str | None) -> str:
    parts = []
    for who, run in (("cudalink", ours), ("peer", theirs)):
        if isinstance(run, RunResult) and run.fps():
            skipped = f" ({run.skipped()} skipped)" if who == "cudalink" else ""
            parts.append(f"{who} {run.fps():,.0f} fps{skipped}")
    return " · ".join(parts)


def machine_info(backend: Backend) -> Machine:
    info: Machine = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "control": _platform.default_control(),
    }
    if backend.is_cuda:
        with contextlib.suppress(Exception):
            info["gpu"] = str(devices.device(backend.device).name)
    info["core"] = _native.status()
    return info
