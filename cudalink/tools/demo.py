"""``demo``: a producer and consumers in spawned processes, verifying every frame, with a live view.

The child entry points are module-level functions (``spawn`` imports them by name).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .. import _native, _platform
from ..errors import ArgumentError, LinkError, LinkTimeout, ProducerGone, int_arg
from ..frames.spec import FrameSpec, as_dtype
from ..transport import wire
from .measure import GpuLib, _child_init, _one_line, resolve_backend
from .monitor import Snapshot, read_snapshot
from .ui import Stopped, _console, _pcts, _us, sigterm_stops, stop_requested, stop_signal

if TYPE_CHECKING:
    import multiprocessing.queues as mpq
    from multiprocessing.context import SpawnProcess
    from multiprocessing.synchronize import Event

PATTERN_PERIOD = 113  # prime, so frame k's content differs from k-1's; 0..112 fits every dtype exactly
DEMO_META = struct.Struct("<QQ")  # frame counter k, byte checksum


@dataclass(frozen=True)
class DemoConfig:
    name: str
    shape: tuple[int, ...]
    dtype: str
    slots: int
    device: int  # -1: host backend
    lib: str
    consumers: int
    seconds: float | None
    frames: int | None
    fps: float
    report_s: float = 0.25


# -- what the children tell the parent (through one mp.Queue) ---------------------------------------------


@dataclass(frozen=True)
class ProducerReady:
    """The Sender is up; consumers may start."""

    pid: int
    generation: int


@dataclass(frozen=True)
class Streaming:
    """Every consumer attached: frames flow from now (``time.time()``)."""

    since: float


@dataclass(frozen=True)
class ProducerStats:
    """The Sender's counters, plus ``attempts`` and ``elapsed``; ``final`` once the producer stopped."""

    stats: dict[str, float]
    final: bool = False


@dataclass(frozen=True)
class Attached:
    index: int
    pid: int


@dataclass(frozen=True)
class ConsumerStats:
    """A consumer's counts so far, and the latencies (ns) since its previous report."""

    index: int
    pid: int
    received: int
    skipped: int
    mismatches: int
    lat: list[int]
    first_error: str
    at: float = 0.0  #: the consumer's monotonic clock when it counted ``received``


@dataclass(frozen=True)
class ConsumerDone:
    index: int


@dataclass(frozen=True)
class Failed:
    """A child's error: ``index`` is the consumer's, None for the producer."""

    index: int | None
    error: str


DemoMsg = ProducerReady | Streaming | ProducerStats | Attached | ConsumerStats | ConsumerDone | Failed


class Pattern:
    """Frame k is element i -> (i + k) mod 113, cast to the dtype: changing content, closed-form checksum.

    The producer sends views into one precomputed array (no per-frame generation cost); consumers
    check sampled elements against k and the whole frame's byte sum against the stamped checksum,
    so a stale, torn or foreign frame is caught.
    """

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape = shape
        self.dtype = as_dtype(dtype)  # bfloat16 too: a spawned child has not imported ml_dtypes (np.dtype refuses it)
        self.n = int(math.prod(shape))
        m = PATTERN_PERIOD
        per = np.arange(m).astype(self.dtype)
        self._bytes = per.view(np.uint8).reshape(m, self.dtype.itemsize).sum(axis=1).astype(np.int64)
        self.sample_idx = sorted({0, self.n // 2, self.n - 1})

    def source(self) -> npt.NDArray[np.generic]:
        """One flat array; frame k is ``source[k % 113 : k % 113 + n]``."""
        return (np.arange(self.n + PATTERN_PERIOD) % PATTERN_PERIOD).astype(self.dtype)

    def checksum(self, k: int) -> int:
        m, s = PATTERN_PERIOD, k % PATTERN_PERIOD
        q, rem = divmod(self.n, m)
        part = int(self._bytes[(s + np.arange(rem)) % m].sum()) if rem else 0
        return q * int(self._bytes.sum()) + part

    def expected(self, k: int) -> npt.NDArray[np.generic]:
        idx = np.asarray(self.sample_idx)
        return ((idx + k % PATTERN_PERIOD) % PATTERN_PERIOD).astype(self.dtype)


def demo_producer(cfg: DemoConfig, out: mpq.Queue[DemoMsg], stop: Event) -> None:
    """Publish pattern frames until ``stop``, --seconds or --frames; report stats to ``out`` as it goes."""
    _child_init()
    from ..link import Sender

    tx: Sender | None = None
    try:
        pat = Pattern(cfg.shape, cfg.dtype)
        lib = GpuLib(cfg.lib, cfg.device) if cfg.device >= 0 else None
        host = pat.source()
        src = host if lib is None else lib.from_numpy(host)
        if lib is not None:
            lib.sync()
        tx = Sender(
            cfg.name,
            shape=cfg.shape,
            dtype=cfg.dtype,
            slots=cfg.slots,
            device=cfg.device if cfg.device >= 0 else "cpu",
            max_consumers=max(16, cfg.consumers),
        )
        out.put(ProducerReady(os.getpid(), tx.generation))
        deadline = time.monotonic() + 60.0
        while tx.stats()["consumers"] < cfg.consumers and not stop.is_set():
            if time.monotonic() > deadline:
                n = tx.stats()["consumers"]
                raise LinkTimeout(f"cudalink: only {n} of {cfg.consumers} consumers attached within 60s")
            time.sleep(0.01)
        out.put(Streaming(time.time()))
        start = last = time.monotonic()
        period = 1.0 / cfg.fps if cfg.fps > 0 else 0.0
        next_t = start
        k = 0
        while not stop.is_set():
            now = time.monotonic()
            if cfg.frames is not None and tx.seq >= cfg.frames:
                break
            if cfg.seconds is not None and now - start >= cfg.seconds:
                break
            s = k % PATTERN_PERIOD
            frame = src[s : s + pat.n].reshape(*cfg.shape)
            tx.send(frame, meta=DEMO_META.pack(k, pat.checksum(k)))
            k += 1
            if now - last >= cfg.report_s:
                out.put(ProducerStats(dict(tx.stats(), attempts=k, elapsed=now - start)))
                last = now
            if period:
                next_t += period
                delay = next_t - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -period:
                    next_t = time.monotonic()  # fell behind: do not burst to catch up
        out.put(ProducerStats(dict(tx.stats(), attempts=k, elapsed=time.monotonic() - start), final=True))
    except BaseException as exc:
        out.put(Failed(None, _one_line(exc)))
    finally:
        if tx is not None:
            with contextlib.suppress(Exception):
                tx.close(timeout=5.0)


def demo_consumer(cfg: DemoConfig, index: int, out: mpq.Queue[DemoMsg], stop: Event) -> None:
    """Receive, verify content against the stamped counter/checksum, report latency and counts."""
    _child_init()
    from ..link import Receiver

    received = mismatches = 0
    lat: list[int] = []
    last = time.monotonic()
    rx: Receiver | None = None
    first_error = ""
    try:
        pat = Pattern(cfg.shape, cfg.dtype)
        lib = GpuLib(cfg.lib, cfg.device) if cfg.device >= 0 else None
        if lib is not None:
            lib.context()
        rx = Receiver(cfg.name, timeout=30.0, wait="hybrid")
        out.put(Attached(index, os.getpid()))
        while True:
            try:
                frame = rx.recv(timeout=0.5)
            except LinkTimeout:
                if stop.is_set():
                    break
                continue
            except ProducerGone:
                break
            lat.append(time.time_ns() - frame.timestamp_ns)
            received += 1
            k, checksum = DEMO_META.unpack(frame.meta[: DEMO_META.size])
            if lib is not None:
                t = lib.from_dlpack(frame)
                got, total = lib.take(t, pat.sample_idx), lib.bytesum(t)
                del t
            else:
                flat = frame.numpy().reshape(-1)
                got = flat[pat.sample_idx]
                total = int(flat.view(np.uint8).sum(dtype=np.uint64))
                del flat
            frame.release()
            if total != checksum or not np.array_equal(got, pat.expected(k)):
                mismatches += 1
                if not first_error:
                    first_error = f"frame {frame.seq} (k={k}): byte sum {total} vs {checksum}, samples {got}"
            now = time.monotonic()
            if now - last >= cfg.report_s:
                out.put(ConsumerStats(index, os.getpid(), received, rx.skipped, mismatches, lat, first_error, now))
                lat = []
                last = now
        out.put(ConsumerStats(index, os.getpid(), received, rx.skipped, mismatches, lat, first_error, time.monotonic()))
        out.put(ConsumerDone(index))
    except BaseException as exc:
        out.put(Failed(index, _one_line(exc)))
    finally:
        if rx is not None:
            with contextlib.suppress(Exception):
                rx.close()


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError as exc:
        raise LinkError(f"cudalink: --shape must be integers like 720,1280,4; got {text!r}") from exc
    if not shape or any(s <= 0 for s in shape):
        raise LinkError(f"cudalink: --shape must be positive integers like 720,1280,4; got {text!r}")
    return shape


@dataclass
class _ConsumerState:
    index: int
    pid: int = 0
    status: str = "starting"
    received: int = 0
    skipped: int = 0
    mismatches: int = 0
    first_error: str = ""
    error: str = ""
    lat: list[int] = field(default_factory=list)
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=2000))
    fps: float = 0.0
    _mark: tuple[float, int] = (0.0, 0)


@dataclass
class _ProducerState:
    pid: int = 0
    status: str = "starting"
    generation: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    error: str = ""
    fps: float = 0.0
    since: float = 0.0  #: ``time.time()`` when it started streaming
    counted: bool = True  #: False: it crashed and its count could not be read back: ``published`` is a floor
    _mark: tuple[float, int] = (0.0, 0)


def _recount_crashed(prod: _ProducerState, cons: list[_ConsumerState], name: str) -> None:
    """A crashed producer's counts from the link's header, which its every send updated: its last report (up to
    ``report_s`` old) said fewer frames than its consumers had received. With the header gone too, the most any
    consumer saw is a floor, and the summary says the count is lost."""
    try:
        snap = read_snapshot(name)
    except LinkError:
        snap = None
    if snap is not None and snap.fixed.generation == prod.generation:
        f = snap.fixed
        prod.stats.update(published=f.published, dropped=f.dropped)
        if prod.since and f.last_publish_ns:
            prod.stats["elapsed"] = max(float(prod.stats.get("elapsed", 0.0)), f.last_publish_ns / 1e9 - prod.since)
        return
    seen = max((c.received + c.skipped for c in cons), default=0)
    if seen > prod.stats.get("published", 0):
        prod.stats["published"] = seen
    prod.counted = False


def _average_fps(stats: dict[str, float]) -> float:
    """Frames published over the producer's own streaming time: what the summary prints."""
    return float(stats.get("published", 0)) / (float(stats.get("elapsed", 0.0)) or 1e-9)


def _update_fps(state: _ConsumerState | _ProducerState, count: int, at: float | None = None) -> None:
    """The rate over the last half second or more, timed on the clock of the process that counted: ``at``.

    Timed on this process's clock (when a report arrived here, behind a render and other reports), a
    steady 60 fps read anywhere from 45 to 70: the producer's live line and the summary disagreed."""
    now = time.monotonic() if at is None else at
    t, n = state._mark
    if t == 0.0:
        state._mark = (now, count)
    elif now - t >= 0.5:
        state.fps = (count - n) / (now - t)
        state._mark = (now, count)


def _demo_view(
    cfg: DemoConfig, backend: str, prod: _ProducerState, cons: list[_ConsumerState], snap: Snapshot | None
) -> Group:
    st = prod.stats
    head = Text.assemble(
        ("cudalink demo ", "bold"),
        (cfg.name, "bold cyan"),
        f"  {backend} · {'x'.join(map(str, cfg.shape))} {cfg.dtype} · {cfg.slots} slots · "
        f"{cfg.consumers} consumer(s) · {f'{cfg.fps:g} fps' if cfg.fps else 'max rate'}",
    )
    ptext = Text(
        f"producer pid {prod.pid or '?'} [{prod.status}]: published {'' if prod.counted else 'at least '}"
        f"{st.get('published', 0):,} · "
        f"{prod.fps:,.1f} fps {'on average' if prod.status == 'done' else 'now'} · dropped {st.get('dropped', 0):,} · "
        f"consumers attached {st.get('consumers', 0)}" + (f" · ERROR {prod.error}" if prod.error else "")
    )
    leases: dict[int, str] = {}
    if snap is not None:
        for info in snap.consumers:
            leases[info.pid] = ", ".join(f"{lease.slot}:{lease.seq}" for lease in info.leases) or "none"
    table = Table(title_justify="left")
    for col in (
        "consumer",
        "pid",
        "state",
        "received",
        "fps now",
        "skipped",
        "mismatches",
        "latency p50",
        "p99",
        "leases (slot:seq)",
    ):
        table.add_column(col, justify="left" if col in ("state", "leases (slot:seq)") else "right")
    for c in cons:
        p50, p99 = _pcts(list(c.recent))
        state = c.status + (f": {c.error}" if c.error else "")
        table.add_row(
            str(c.index),
            str(c.pid or "?"),
            state,
            f"{c.received:,}",
            f"{c.fps:,.1f}",
            f"{c.skipped:,}",
            Text(str(c.mismatches), style="bold red" if c.mismatches else ""),
            _us(p50),
            _us(p99),
            leases.get(c.pid, "—"),
        )
    return Group(head, ptext, table)


#: what stops the demo as Ctrl-C does (its children stopped, where a kill left them running on to their own end):
#: ``timeout`` and service managers send SIGTERM, a closed terminal SIGHUP
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


def cmd_demo(args: argparse.Namespace) -> int:
    console = _console()
    shape = _parse_shape(args.shape)
    spec = FrameSpec(shape, args.dtype)  # validates shape and dtype before any process starts
    # every flag checked before any process starts (a bad one only showed after an empty table)
    int_arg(args.consumers, "--consumers", 1, wire.MAX_CONSUMERS, "--consumers 2")
    int_arg(args.slots, "--slots", 1, wire.MAX_SLOTS, "--slots 4")
    if args.frames is not None and args.frames < 1:
        raise ArgumentError(f"cudalink: --frames must be at least 1, got {args.frames}")
    if args.seconds is not None and not args.seconds > 0:
        raise ArgumentError(f"cudalink: --seconds must be more than 0, got {args.seconds}")
    if not args.fps >= 0:
        raise ArgumentError(f"cudalink: --fps must be 0 (as fast as possible) or more, got {args.fps}")
    if args.name is not None:
        _platform.check_name(args.name)
    backend = resolve_backend(args.device)
    if backend.is_cuda and spec.dtype.name == "bfloat16":
        if backend.lib != "torch":
            raise ArgumentError(
                "cudalink: cupy has no bfloat16, and torch (which has) is not installed: pip install torch for a "
                "bfloat16 demo on the GPU, or pass --device cpu"
            )
        if _native.dlpack is None:
            raise ArgumentError(
                "cudalink: bfloat16 CUDA frames reach torch through cudalink's compiled core, which this install "
                f"lacks ({_native.missing.get('dlpack')}); reinstall cudalink where a C compiler exists, or pass "
                "--device cpu"
            )
    if backend.note:
        console.print(Text(backend.note, style="yellow"))
    seconds = args.seconds if args.seconds is not None else (None if args.frames else 5.0)
    name = args.name or f"demo-{os.getpid()}"
    cfg = DemoConfig(
        name,
        shape,
        spec.dtype.name,
        args.slots,
        backend.device,
        backend.lib,
        args.consumers,
        seconds,
        args.frames,
        args.fps,
    )
    ctx = mp.get_context("spawn")
    out: mpq.Queue[DemoMsg] = ctx.Queue()
    stop = ctx.Event()
    prod = _ProducerState()
    cons = [_ConsumerState(i) for i in range(args.consumers)]
    producer = ctx.Process(target=demo_producer, args=(cfg, out, stop), daemon=True)
    producer.start()
    prod.pid = producer.pid or 0
    workers: list[SpawnProcess] = []
    budget = (seconds or 0) + (args.frames or 0) / max(1.0, args.fps or 1000.0) + 90.0
    hard_deadline = time.monotonic() + budget
    stop_deadline: float | None = None
    producer_done = interrupted = False
    snap: Snapshot | None = None
    last_snap = 0.0
    with (
        sigterm_stops(_STOP_SIGNALS),
        Live(_demo_view(cfg, backend.label, prod, cons, None), console=console, auto_refresh=False) as live,
    ):
        while True:
            try:
                if stop_requested() and not interrupted:  # a signal whose raise was dropped on its way
                    raise Stopped
                try:
                    msg = out.get(timeout=0.1)
                except queue_mod.Empty:
                    msg = None
                while msg is not None:
                    if isinstance(msg, ProducerReady):
                        prod.status, prod.generation = "waiting for consumers", int(msg.generation)
                        for c in cons:
                            w = ctx.Process(target=demo_consumer, args=(cfg, c.index, out, stop), daemon=True)
                            w.start()
                            c.pid = w.pid or 0
                            workers.append(w)
                    elif isinstance(msg, Streaming):
                        prod.status, prod.since = "streaming", msg.since
                    elif isinstance(msg, ProducerStats):
                        prod.stats = dict(msg.stats)
                        _update_fps(prod, int(prod.stats.get("published", 0)), float(prod.stats["elapsed"]))
                        if msg.final:  # from now on the line shows the run's average: the summary's figure
                            prod.status, producer_done = "done", True
                            prod.fps = _average_fps(prod.stats)
                    elif isinstance(msg, Attached):
                        cons[msg.index].status = "receiving"
                    elif isinstance(msg, ConsumerStats):
                        c = cons[msg.index]
                        c.pid, c.received, c.skipped, c.mismatches = msg.pid, msg.received, msg.skipped, msg.mismatches
                        c.first_error = c.first_error or msg.first_error
                        c.lat.extend(msg.lat)
                        c.recent.extend(msg.lat)
                        _update_fps(c, msg.received, msg.at or None)
                    elif isinstance(msg, ConsumerDone):
                        cons[msg.index].status = "done"
                    elif msg.index is None:  # Failed: the producer
                        prod.status, prod.error, producer_done = "failed", msg.error, True
                        stop.set()
                    else:
                        cons[msg.index].status, cons[msg.index].error = "failed", msg.error
                    try:
                        msg = out.get_nowait()
                    except queue_mod.Empty:
                        msg = None
                for c, w in zip(cons, workers, strict=False):
                    if c.status in ("starting", "receiving") and not w.is_alive():
                        c.status, c.error = "crashed", f"exit code {w.exitcode}"
                if not producer_done and not producer.is_alive():
                    prod.status, prod.error, producer_done = "crashed", f"exit code {producer.exitcode}", True
                    _recount_crashed(prod, cons, name)
                    stop.set()
                now = time.monotonic()
                if now - last_snap > 0.5:
                    last_snap = now
                    try:
                        snap = read_snapshot(name)
                    except LinkError:
                        snap = None
                live.update(_demo_view(cfg, backend.label, prod, cons, snap), refresh=True)
                finished = all(c.status in ("done", "failed", "crashed") for c in cons)
                if producer_done and (finished or not workers):
                    break
                if now > hard_deadline and stop_deadline is None:
                    stop.set()
                    stop_deadline = now + 10.0
                if stop_deadline is not None and now > stop_deadline:
                    for c in cons:
                        if c.status in ("starting", "receiving"):
                            c.status, c.error = "failed", "did not stop in time"
                    break
            except (KeyboardInterrupt, Stopped):
                interrupted = True
                stop.set()
                stop_deadline = time.monotonic() + 10.0
    if not console.is_terminal:
        console.line()  # a non-terminal Live ends its last render without a newline
    for p in (producer, *workers):  # told to stop already: a signal now ends only this wait
        p.join(timeout=5.0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
    code = 128 + stop_signal() if stop_signal() else 130  # what a shell reports for a process that signal ended
    return _demo_summary(console, cfg, backend.label, prod, cons, code if interrupted else 0)


def _demo_summary(
    console: Console,
    cfg: DemoConfig,
    backend: str,
    prod: _ProducerState,
    cons: list[_ConsumerState],
    interrupted: int = 0,
) -> int:
    """Print the summary; the exit status. ``interrupted``: the status of a run stopped by a signal (130 for
    Ctrl-C, 143 for SIGTERM), returned when everything it ran was verified."""
    st = prod.stats
    elapsed = float(st.get("elapsed", 0.0)) or 1e-9
    published = int(st.get("published", 0))
    average = _average_fps(st)
    total = sum(c.received for c in cons)
    mism = sum(c.mismatches for c in cons)
    bad = [c for c in cons if c.status != "done"]
    all_lat = [x for c in cons for x in c.lat]
    p50, p99 = _pcts(all_lat)
    lost = "" if prod.counted else "at least "  # a crashed producer whose header was gone too
    console.print(
        f"summary: {lost}{published:,} frames published in {elapsed:.1f} s ({average:,.1f} fps on average) "
        f"on {backend}, {int(st.get('dropped', 0)):,} dropped"
        + ("" if prod.counted else " (the producer crashed and its own count was lost)")
    )
    for c in cons:
        c50, c99 = _pcts(c.lat)
        console.print(
            f"  consumer {c.index} (pid {c.pid}): {c.status}, received {c.received:,}, "
            f"skipped {c.skipped:,}, mismatches {c.mismatches}, latency p50 {_us(c50)} p99 {_us(c99)}"
            + (f" — {c.error}" if c.error else "")
            + (f" — first mismatch: {c.first_error}" if c.first_error else "")
        )
    console.print(
        f"frames received: {total}, mismatches: {mism}, failed consumers: {len(bad)}, "
        f"handoff latency p50 {_us(p50)} p99 {_us(p99)}"
    )
    ok = not prod.error and not bad and mism == 0 and all(c.received > 0 for c in cons)
    if ok:
        console.print(Text(f"OK: {len(cons)} consumer(s) verified {total:,} frames, 0 mismatches", style="bold green"))
        return interrupted
    why = (
        prod.error
        or (f"{mism} mismatched frames" if mism else "")
        or (f"consumer {bad[0].index} {bad[0].status}" if bad else "a consumer received no frames")
    )
    print(f"cudalink: demo failed: {why}", file=sys.stderr)
    return 1
