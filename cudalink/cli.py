"""``python -m cudalink demo|info|monitor|bench``: see it work, check a machine, watch a link, measure.

Every command prints one ``cudalink: ...`` line on failure (``--debug`` shows the traceback), so a
user sees what to do instead of a stack. ``monitor`` maps the header segment read-only and never
joins the link, so watching a production link cannot disturb it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from . import _cuda, _native, _platform
from ._measure import summarize
from ._ring import read_record
from ._version import __version__
from .errors import LinkError
from .frames.spec import FrameSpec
from .transport import wire

__all__ = ["main", "read_snapshot"]


def _console(stderr: bool = False) -> Console:
    """Wide enough for the tables when output is piped (rich would assume 80 columns)."""
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    width = None if tty or "COLUMNS" in os.environ else 160
    return Console(stderr=stderr, width=width, highlight=False)


def _us(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    if abs(v) >= 10_000:
        return f"{v / 1000:,.1f} ms"
    return f"{v:,.1f} µs" if abs(v) < 100 else f"{v:,.0f} µs"


def _pcts(values_ns: Sequence[int]) -> tuple[float | None, float | None]:
    """p50/p99 in µs through the bench's one summary (``_measure.summarize``)."""
    got = summarize(values_ns)
    return (got["p50"], got["p99"]) if got else (None, None)


def _ago(ns: int, now_ns: int) -> str:
    if not ns:
        return "never"
    return f"{_us((now_ns - ns) / 1e3)} ago"


# ============================================================================================ monitor


@dataclass(frozen=True)
class LeaseInfo:
    slot: int
    seq: int
    frames_behind: int
    age_s: float | None  # since that frame was published, when its record is still readable


@dataclass(frozen=True)
class ConsumerInfo:
    index: int
    pid: int
    alive: bool
    received: int
    skipped: int
    joined_ns: int
    last_recv_ns: int
    leases: tuple[LeaseInfo, ...]


@dataclass(frozen=True)
class Snapshot:
    """One read-only look at a link's header."""

    name: str
    fixed: wire.Fixed
    mono: float
    now_ns: int
    newest_seq: int
    newest_slot: int
    newest: wire.SlotRecord | None
    consumers: tuple[ConsumerInfo, ...]
    producer_alive: bool


def _map_readonly(name: str) -> tuple[Any, Callable[[], None]]:
    """The header segment mapped read-only (POSIX) or copied (Windows): a monitor can never write to it."""
    from .transport.shm import header_segment, map_readonly

    seg = header_segment(name)
    try:
        buf, close = map_readonly(seg)
    except FileNotFoundError as exc:
        raise LinkError(
            f"cudalink: no link named {name!r} here (no shared-memory segment {seg}); "
            "check the name, and that its producer runs on this machine as this user"
        ) from exc
    if len(buf) < wire.FIXED_SIZE:
        close()
        raise LinkError(f"cudalink: segment {seg} is {len(buf)} bytes: not a cudalink link (or still being created)")
    return buf, close


def read_snapshot(name: str) -> Snapshot:
    """Decode a link's header through a read-only mapping; never connects to the producer."""
    buf, close = _map_readonly(name)
    try:
        fixed = wire.read_fixed(buf, len(buf))
        layout = fixed.layout
        now_ns, mono = time.time_ns(), time.monotonic()
        stamps = wire.read_stamps(buf, layout)
        even = [(int(s) >> 1, i) for i, s in enumerate(stamps) if s and not s & 1]
        newest_seq, newest_slot = max(even) if even else (0, -1)
        records = {slot: read_record(buf, layout, slot, fixed.capacity) for slot in range(layout.nslots)}
        newest = records.get(newest_slot) if newest_slot >= 0 else None
        columns = [wire.read_column(buf, layout, slot) for slot in range(layout.nslots)]
        consumers = []
        for c in range(layout.nconsumers):
            state, pid, _token, received, skipped, joined, last = wire.CONSUMER.unpack_from(buf, layout.consumer(c))
            if state != 1:
                continue
            leases = []
            for slot in range(layout.nslots):
                seq = int(columns[slot][c])
                if seq:
                    rec = records.get(slot)
                    age = (now_ns - rec.timestamp_ns) / 1e9 if rec is not None and rec.seq == seq else None
                    leases.append(LeaseInfo(slot, seq, max(0, newest_seq - seq), age))
            consumers.append(
                ConsumerInfo(c, pid, _platform.pid_alive(pid), received, skipped, joined, last, tuple(leases))
            )
        return Snapshot(
            name,
            fixed,
            mono,
            now_ns,
            newest_seq,
            newest_slot,
            newest,
            tuple(consumers),
            _platform.pid_alive(fixed.pid),
        )
    finally:
        close()


def _flags(flags: int) -> str:
    names = [
        n
        for bit, n in (
            (wire.FLAG_READY, "ready"),
            (wire.FLAG_SHUTDOWN, "shutdown"),
            (wire.FLAG_PRODUCER_WAITING, "producer-waiting"),
        )
        if flags & bit
    ]
    return ",".join(names) or "none"


def _rate(cur: int, old: int, dt: float) -> float | None:
    return (cur - old) / dt if dt > 0 and cur >= old else None


def render_snapshot(snap: Snapshot, prev: Snapshot | None) -> Group:
    """Header lines plus a consumer table; rates come from the previous snapshot of the same generation."""
    f = snap.fixed
    same = prev is not None and prev.fixed.generation == f.generation
    dt = snap.mono - prev.mono if same and prev is not None else 0.0
    fps = _rate(f.published, prev.fixed.published, dt) if same and prev is not None else None
    drop_rate = _rate(f.dropped, prev.fixed.dropped, dt) if same and prev is not None else None
    device = "cpu" if f.backend == wire.BACKEND_HOST else f"cuda:{f.device}"
    alive = "alive" if snap.producer_alive else "NOT RUNNING (stale segment)"
    lines = [
        Text.assemble(
            ("cudalink monitor ", "bold"),
            (snap.name, "bold cyan"),
            f"  generation {f.generation:016x}  ",
            f"producer pid {f.pid} ({alive})",
        ),
        Text(
            f"backend {wire.BACKEND_NAMES.get(f.backend, '?')} on {device} · {f.nslots} slots of "
            f"{f.capacity:,} bytes · up to {f.nconsumers} consumers · flags {_flags(f.flags)}"
        ),
    ]
    if snap.newest is not None:
        spec = snap.newest.spec
        fmt = f" {spec.pixel_format.value}" if spec.pixel_format else ""
        lines.append(
            Text(
                f"newest frame: seq {snap.newest_seq} in slot {snap.newest_slot}: {spec.shape} "
                f"{spec.dtype.name}{fmt} (origin {spec.origin.value}), "
                f"published {_ago(snap.newest.timestamp_ns, snap.now_ns)}"
            )
        )
    else:
        lines.append(Text("newest frame: none published yet"))
    fps_text = f"{fps:,.1f} fps" if fps is not None else "fps n/a (one sample)"
    drops = f" ({drop_rate:,.1f}/s now)" if drop_rate else ""
    lines.append(
        Text(
            f"published {f.published:,} · {fps_text} · dropped {f.dropped:,}{drops} · "
            f"last publish {_ago(f.last_publish_ns, snap.now_ns)}"
        )
    )
    table = Table(title=f"consumers ({len(snap.consumers)} joined)", title_justify="left")
    for col in (
        "#",
        "pid",
        "received",
        "skipped",
        "fps",
        "last recv",
        "leases (slot:seq · frames behind · age)",
    ):
        table.add_column(col, justify="right" if col not in ("leases (slot:seq · frames behind · age)",) else "left")
    old = {c.index: c for c in prev.consumers} if same and prev is not None else {}
    for c in snap.consumers:
        o = old.get(c.index)
        r = _rate(c.received, o.received, dt) if o is not None and o.pid == c.pid else None
        leases = ", ".join(
            f"{lease.slot}:{lease.seq} · {lease.frames_behind} · "
            + (_us(lease.age_s * 1e6) if lease.age_s is not None else "?")
            for lease in c.leases
        )
        pid = f"{c.pid}" if c.alive else f"{c.pid} (dead)"
        table.add_row(
            str(c.index),
            pid,
            f"{c.received:,}",
            f"{c.skipped:,}",
            f"{r:,.1f}" if r is not None else "—",
            _ago(c.last_recv_ns, snap.now_ns),
            leases or "none",
        )
    return Group(*lines, table)


def cmd_monitor(args: argparse.Namespace) -> int:
    console = _console()
    interval = max(0.05, float(args.interval))
    if args.once:
        first = read_snapshot(args.name)
        time.sleep(interval)
        try:
            second = read_snapshot(args.name)
        except LinkError:
            second = None  # the producer went away between the two looks: show what we saw
        console.print(render_snapshot(second or first, first if second is not None else None))
        return 0
    deadline = time.monotonic() + args.seconds if args.seconds else math.inf
    prev: Snapshot | None = None
    with Live(Text(f"attaching to {args.name!r} (read-only)…"), console=console, auto_refresh=False) as live:
        try:
            while time.monotonic() < deadline:
                try:
                    snap = read_snapshot(args.name)
                except LinkError as exc:
                    live.update(Text(f"{exc}\nwaiting for a producer… (Ctrl-C to stop)"), refresh=True)
                    prev = None
                else:
                    live.update(render_snapshot(snap, prev), refresh=True)
                    prev = snap
                time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            pass
    if not console.is_terminal:
        console.line()
    return 0


# ============================================================================================ info


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_versions() -> tuple[str | None, str | None]:
    """(CUDA driver API version, kernel driver version); None where no driver answers."""
    cuda_v = kernel_v = None
    try:
        from cuda.core import system

        fn = getattr(system, "get_user_mode_driver_version", None)
        if fn is not None:
            cuda_v = ".".join(map(str, fn()))
        kfn = getattr(system, "get_kernel_mode_driver_version", None) or getattr(system, "get_driver_version", None)
        if kfn is not None:
            v = kfn()
            kernel_v = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    except Exception:
        pass
    if cuda_v is None:
        try:
            drv: Any = importlib.import_module("cuda.bindings.driver")
            v = int(_cuda.check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
            cuda_v = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
    return cuda_v, kernel_v


def gather_info() -> dict[str, Any]:
    """Everything ``info`` reports, each probe wrapped so a missing driver is a finding, not a crash."""
    from ._measure import short_reason

    out: dict[str, Any] = {
        "cudalink": __version__,
        "python": f"{sys.version.split()[0]} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "packages": {
            d: _version(d)
            for d in (
                "cuda-core",
                "cuda-bindings",
                "numpy",
                "rich",
                "torch",
                "cupy-cuda13x",
                "cupy-cuda12x",
                "jax",
            )
        },
    }
    cuda_v, kernel_v = _driver_versions()
    out["driver"] = {"cuda": cuda_v, "kernel": kernel_v}
    out["core"] = _native.status()  # after the driver probe, which decides the driver calls' module
    gpus: list[dict[str, Any]] = []
    try:
        dev0 = _cuda.device(0)
    except Exception as exc:
        out["gpu_error"] = short_reason(exc)
    else:
        try:
            import cuda.core

            devs = list(cuda.core.Device.get_all_devices())
        except Exception:
            devs = [dev0]
        for d in devs:
            g: dict[str, Any] = {"ordinal": int(d.device_id)}
            for key, attr in (
                ("name", "name"),
                ("uuid", "uuid"),
                ("compute_capability", "compute_capability"),
            ):
                try:
                    v = getattr(d, attr)
                    g[key] = ".".join(map(str, tuple(v))) if key == "compute_capability" else str(v)
                except Exception:
                    g[key] = None
            try:
                g["ipc"] = _cuda.ipc_support(d)
            except Exception as exc:
                g["ipc"] = {}
                g["ipc_error"] = short_reason(exc)
            try:
                g["ipc"]["ipc_event_supported"] = bool(d.properties.ipc_event_supported)
            except Exception:
                g["ipc"].setdefault("ipc_event_supported", False)
            gpus.append(g)
    out["gpus"] = gpus
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    try:
        du = shutil.disk_usage(shm_dir)
        out["shm"] = {"path": shm_dir, "total": du.total, "free": du.free}
    except OSError as exc:
        out["shm"] = {"path": shm_dir, "error": str(exc)}
    try:
        out["runtime_dir"] = _platform.runtime_dir()
    except Exception as exc:
        out["runtime_dir_error"] = str(exc)
    return out


def _verdict(info: dict[str, Any]) -> tuple[bool, str]:
    """(ready, one line that says what works and what to do)."""
    if "runtime_dir_error" in info:
        return False, f"not ready: {info['runtime_dir_error']}"
    shm = info.get("shm", {})
    low = ""
    if "free" in shm and shm["free"] < 256 << 20:
        low = f"; note {shm['path']} has only {shm['free'] >> 20} MiB free (in Docker pass --shm-size=1g or --ipc=host)"
    gpus = info.get("gpus", [])
    ready = [
        g
        for g in gpus
        if all(
            g.get("ipc", {}).get(k)
            for k in ("memory_pools_supported", "handle_type_posix_file_descriptor_supported", "linux")
        )
    ]
    if ready:
        events = "" if all(g["ipc"].get("ipc_event_supported") for g in ready) else " (IPC events unsupported!)"
        ords = ", ".join(str(g["ordinal"]) for g in ready)
        return (
            True,
            f"CUDA IPC ready on GPU {ords}{events}: Sender(name, shape=..., device=0) shares frames zero-copy{low}",
        )
    if gpus:
        return True, (
            "GPU found, but cuda.core IPC memory pools are not available here: use "
            f"Sender(..., handles='legacy') (cuIpc handles) or device='cpu'{low}"
        )
    why = info.get("gpu_error", "no GPU")
    return True, (
        f"no GPU ({why}): CPU backend works; use Sender(name, shape=..., device='cpu') (same API, numpy "
        f"frames). For CUDA IPC, run on a Linux machine with an NVIDIA driver and GPU{low}"
    )


def cmd_info(args: argparse.Namespace) -> int:
    console = _console()
    info = gather_info()
    table = Table(title=f"cudalink {__version__} · {info['platform']}", show_header=False, title_justify="left")
    table.add_column("check", style="bold")
    table.add_column("value")
    table.add_row("python", info["python"])
    pk = info["packages"]
    table.add_row(
        "cuda.core / cuda-bindings",
        f"{pk['cuda-core'] or 'not installed'} / {pk['cuda-bindings'] or 'not installed'}",
    )
    frameworks = [f"{d} {pk[d]}" for d in ("torch", "cupy-cuda13x", "cupy-cuda12x", "jax") if pk.get(d)]
    table.add_row("numpy / frameworks", f"{pk['numpy']} / {', '.join(frameworks) or 'none (numpy only)'}")
    table.add_row("compiled core", " · ".join(f"{k} {v}" for k, v in info["core"].items()))
    drv = info["driver"]
    if drv["cuda"] or drv["kernel"]:
        table.add_row("driver", f"CUDA {drv['cuda'] or '?'} · kernel driver {drv['kernel'] or '?'}")
    else:
        table.add_row("driver", "no CUDA driver")
    if info["gpus"]:
        for g in info["gpus"]:
            ipc = g.get("ipc", {})
            marks = " · ".join(
                f"{label} {'yes' if ipc.get(key) else 'no'}"
                for key, label in (
                    ("memory_pools_supported", "IPC pool"),
                    ("handle_type_posix_file_descriptor_supported", "POSIX fd handle"),
                    ("ipc_event_supported", "IPC event"),
                    ("linux", "Linux"),
                )
            )
            table.add_row(f"GPU {g['ordinal']}", f"{g.get('name')} (sm {g.get('compute_capability')}) · {marks}")
    else:
        table.add_row("GPUs", f"none ({info.get('gpu_error', 'no CUDA driver')})")
    shm = info["shm"]
    if "free" in shm:
        table.add_row(
            "shared memory",
            f"{shm['path']}: {shm['free'] / 2**30:,.1f} GiB free of {shm['total'] / 2**30:,.1f} GiB",
        )
    else:
        table.add_row("shared memory", f"{shm['path']}: {shm.get('error')}")
    table.add_row("control sockets", info.get("runtime_dir") or f"ERROR {info.get('runtime_dir_error')}")
    console.print(table)
    ok, line = _verdict(info)
    console.print(Text("verdict: " + line, style="bold green" if ok else "bold red"), soft_wrap=True)
    return 0 if ok else 1


# ============================================================================================ demo


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
    stats: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    fps: float = 0.0
    _mark: tuple[float, int] = (0.0, 0)


def _update_fps(state: _ConsumerState | _ProducerState, count: int) -> None:
    now = time.monotonic()
    t, n = state._mark
    if t == 0.0:
        state._mark = (now, count)
    elif now - t >= 0.5:
        state.fps = (count - n) / (now - t)
        state._mark = (now, count)


def _demo_view(
    cfg: Any, backend: str, prod: _ProducerState, cons: list[_ConsumerState], snap: Snapshot | None
) -> Group:
    st = prod.stats
    head = Text.assemble(
        ("cudalink demo ", "bold"),
        (cfg.name, "bold cyan"),
        f"  {backend} · {'x'.join(map(str, cfg.shape))} {cfg.dtype} · {cfg.slots} slots · "
        f"{cfg.consumers} consumer(s) · {f'{cfg.fps:g} fps' if cfg.fps else 'max rate'}",
    )
    ptext = Text(
        f"producer pid {prod.pid or '?'} [{prod.status}]: published {st.get('published', 0):,} · "
        f"{prod.fps:,.1f} fps · dropped {st.get('dropped', 0):,} · "
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
        "fps",
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


def cmd_demo(args: argparse.Namespace) -> int:
    from . import _bench

    console = _console()
    shape = _parse_shape(args.shape)
    spec = FrameSpec(shape, args.dtype)  # validates shape and dtype before any process starts
    if args.consumers < 1 or args.consumers > wire.MAX_CONSUMERS:
        raise LinkError(f"cudalink: --consumers must be 1..{wire.MAX_CONSUMERS}")
    backend = _bench.resolve_backend(args.device)
    if backend.note:
        console.print(Text(backend.note, style="yellow"))
    seconds = args.seconds if args.seconds is not None else (None if args.frames else 5.0)
    name = args.name or f"demo-{os.getpid()}"
    cfg = _bench.DemoConfig(
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
    out: Any = ctx.Queue()
    stop: Any = ctx.Event()
    prod = _ProducerState()
    cons = [_ConsumerState(i) for i in range(args.consumers)]
    producer = ctx.Process(target=_bench.demo_producer, args=(cfg, out, stop), daemon=True)
    producer.start()
    prod.pid = producer.pid or 0
    workers: list[Any] = []
    budget = (seconds or 0) + (args.frames or 0) / max(1.0, args.fps or 1000.0) + 90.0
    hard_deadline = time.monotonic() + budget
    stop_deadline: float | None = None
    producer_done = interrupted = False
    snap: Snapshot | None = None
    last_snap = 0.0
    with Live(_demo_view(cfg, backend.label, prod, cons, None), console=console, auto_refresh=False) as live:
        while True:
            try:
                try:
                    msg = out.get(timeout=0.1)
                except queue_mod.Empty:
                    msg = None
                while msg is not None:
                    kind = msg[0]
                    if kind == "ready":
                        prod.status, prod.generation = "waiting for consumers", int(msg[2])
                        for c in cons:
                            w = ctx.Process(target=_bench.demo_consumer, args=(cfg, c.index, out, stop), daemon=True)
                            w.start()
                            c.pid = w.pid or 0
                            workers.append(w)
                    elif kind == "streaming":
                        prod.status = "streaming"
                    elif kind in ("producer", "producer_done"):
                        prod.stats = dict(msg[1])
                        _update_fps(prod, int(prod.stats.get("published", 0)))
                        if kind == "producer_done":
                            prod.status, producer_done = "done", True
                    elif kind == "attached":
                        cons[msg[1]].status = "receiving"
                    elif kind == "consumer":
                        _, i, pid, received, skipped, mism, lat, first = msg
                        c = cons[i]
                        c.pid, c.received, c.skipped, c.mismatches = pid, received, skipped, mism
                        c.first_error = c.first_error or first
                        c.lat.extend(lat)
                        c.recent.extend(lat)
                        _update_fps(c, received)
                    elif kind == "done":
                        cons[msg[1]].status = "done"
                    elif kind == "error":
                        if msg[1] == "producer":
                            prod.status, prod.error, producer_done = "failed", msg[2], True
                            stop.set()
                        else:
                            cons[msg[1]].status, cons[msg[1]].error = "failed", msg[2]
                    try:
                        msg = out.get_nowait()
                    except queue_mod.Empty:
                        msg = None
                for c, w in zip(cons, workers, strict=False):
                    if c.status in ("starting", "receiving") and not w.is_alive():
                        c.status, c.error = "crashed", f"exit code {w.exitcode}"
                if not producer_done and not producer.is_alive():
                    prod.status, prod.error, producer_done = "crashed", f"exit code {producer.exitcode}", True
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
            except KeyboardInterrupt:
                interrupted = True
                stop.set()
                stop_deadline = time.monotonic() + 10.0
    if not console.is_terminal:
        console.line()  # a non-terminal Live ends its last render without a newline
    for p in (producer, *workers):
        p.join(timeout=5.0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
    return _demo_summary(console, cfg, backend.label, prod, cons, interrupted)


def _demo_summary(
    console: Console,
    cfg: Any,
    backend: str,
    prod: _ProducerState,
    cons: list[_ConsumerState],
    interrupted: bool,
) -> int:
    st = prod.stats
    elapsed = float(st.get("elapsed", 0.0)) or 1e-9
    published = int(st.get("published", 0))
    total = sum(c.received for c in cons)
    mism = sum(c.mismatches for c in cons)
    bad = [c for c in cons if c.status != "done"]
    all_lat = [x for c in cons for x in c.lat]
    p50, p99 = _pcts(all_lat)
    console.print(
        f"summary: {published:,} frames published in {elapsed:.1f} s ({published / elapsed:,.1f} fps) "
        f"on {backend}, {int(st.get('dropped', 0)):,} dropped"
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
        return 130 if interrupted else 0
    why = (
        prod.error
        or (f"{mism} mismatched frames" if mism else "")
        or (f"consumer {bad[0].index} {bad[0].status}" if bad else "a consumer received no frames")
    )
    print(f"cudalink: demo failed: {why}", file=sys.stderr)
    return 1


# ============================================================================================ bench


def _core_label(report: dict[str, Any]) -> str:
    """Which implementation the figures came from: 'compiled core', 'pure-Python core', or a mix."""
    core = report.get("machine", {}).get("core", {})
    kinds = {v.split()[0] for v in core.values() if not v.endswith("(not loaded yet)")}
    return (
        {"compiled": "compiled core", "python": "pure-Python core"}.get(kinds.pop(), "")
        if len(kinds) == 1
        else (" / ".join(f"{k} {v.split()[0]}" for k, v in core.items()) or "core unknown")
    )


def _bench_tables(report: dict[str, Any]) -> list[Any]:
    rows = report["rows"]
    table = Table(
        title=f"cudalink {report['cudalink_version']} vs peers · backend {report['backend']} · {_core_label(report)}"
        f"{' · quick' if report['quick'] else ''} · lower is better · ratio = cudalink / peer",
        title_justify="left",
    )
    for col in ("metric", "peer", "cudalink p50", "p99", "peer p50", "p99", "ratio p50", "ratio p99", "note"):
        table.add_column(col, justify="left" if col in ("metric", "peer", "note") else "right")
    skipped: dict[str, list[str]] = {}

    def ratio(v: float | None) -> Text:
        if v is None:
            return Text("—")
        return Text(f"{v:.2f}x", style="green" if v <= 1.0 else "red")

    for r in rows:
        if r["status"] == "skipped":
            key = f"{r['peer_label']}: {r['reason']}"
            skipped.setdefault(key, []).append(r["id"])
            continue
        c, p = r["cudalink"] or {}, r["peer"] or {}
        unit = "" if r["unit"] == "us" else f" ({r['unit']})"
        note = r["note"] if r["status"] == "ok" else f"ERROR {r['reason']}"
        table.add_row(
            r["metric"] + unit,
            r["peer_label"],
            _us(c.get("p50")),
            _us(c.get("p99")),
            _us(p.get("p50")),
            _us(p.get("p99")),
            ratio(r["ratio_p50"]),
            ratio(r["ratio_p99"]),
            Text(note, style="red" if r["status"] == "error" else ""),
        )
    waits = Table(title=f"wait modes (issue 5) · handoff latency on {report['backend']}", title_justify="left")
    for col in ("mode", "API", "p50", "p99", "samples"):
        waits.add_column(col, justify="left" if col in ("mode", "API") else "right")
    for w in report["wait_modes"]:
        h = w["handoff"] or {}
        waits.add_row(
            w["mode"],
            w["api"],
            _us(h.get("p50")),
            _us(h.get("p99")),
            f"{int(h.get('n', 0))}" if w["status"] == "ok" else f"ERROR {w['reason']}",
        )
    out: list[Any] = [table, waits]
    if skipped:
        lines = [Text("skipped (not measured on this machine):", style="bold")]
        lines += [Text(f"  {k}  [{', '.join(dict.fromkeys(v))}]") for k, v in skipped.items()]
        out.append(Group(*lines))
    return out


FLOOR_LABELS = {
    "wake": "bare socketpair wake between two Python processes (2 ms cadence)",
    "spin": "bare Python spin on a shared-memory word",
    "view_read": "numpy view of a SharedMemory slot, made + read after a wake",
    "wait_event": "cuStreamWaitEvent on an IPC event imported from the producer",
    "dlpack_cached": "from_dlpack of a view built once",
    "wait_dlpack": "cuStreamWaitEvent + from_dlpack of a cached view",
    "record_ipc_event": "cuEventRecord of an IPC event (consumer, after a wake)",
    "memcpy": "cuMemcpyDtoDAsync of one 1080p uint8 frame (producer)",
    "record": "cuEventRecord of an IPC event (producer)",
    "memcpy_record": "cuMemcpyDtoDAsync + cuEventRecord (producer)",
}


def _breakdown_tables(report: dict[str, Any]) -> list[Any]:
    """Floors (what the machine allows) and the per-stage breakdown of cudalink's own path."""
    out: list[Any] = []
    floors = report.get("floors")
    ft = Table(title=f"floors on {report['backend']} · no cudalink code · measured in this run", title_justify="left")
    for col in ("floor", "what", "p50", "p99", "samples"):
        ft.add_column(col, justify="left" if col in ("floor", "what") else "right")
    if isinstance(floors, dict):
        for k, v in floors.items():
            v = v or {}
            ft.add_row(k, FLOOR_LABELS.get(k, k), _us(v.get("p50")), _us(v.get("p99")), f"{int(v.get('n', 0))}")
        out.append(ft)
    else:
        out.append(Text(f"floors: ERROR {floors}", style="red"))
    bd = report.get("breakdown")
    if isinstance(bd, dict):
        bt = Table(
            title=f"breakdown · one frame, stage by stage · wait={bd['wait']!r} · {bd['frames']} frames",
            title_justify="left",
        )
        for col in ("stage", "side", "p50", "p99"):
            bt.add_column(col, justify="left" if col in ("stage", "side") else "right")
        for st in bd["stages"]:
            u = st["us"] or {}
            bt.add_row(st["stage"], st["side"], _us(u.get("p50")), _us(u.get("p99")))
        for tot in bd["totals"]:
            u = tot["us"] or {}
            bt.add_row(Text(tot["span"], style="bold"), "total", _us(u.get("p50")), _us(u.get("p99")))
        for key, label in (
            ("reserve_commit", "reserve() + commit, back to back, no consumer"),
            ("reserve_commit_attached", "reserve() + commit, back to back, a consumer waiting"),
        ):
            rc = bd.get(key) or {}
            bt.add_row(Text(label, style="bold"), "producer", _us(rc.get("p50")), _us(rc.get("p99")))
        for impl, rc in (bd.get("ring_cycle") or {}).items():
            rc = rc or {}
            label = f"ring ops of one frame, hot, {impl} ring (claim, publish, take, release)"
            bt.add_row(Text(label, style="bold"), "both", _us(rc.get("p50")), _us(rc.get("p99")))
        out.append(bt)
    else:
        out.append(Text(f"breakdown: ERROR {bd}", style="red"))
    return out


def _goals_table(report: dict[str, Any]) -> Table:
    gt = Table(title="goals · cudalink against its floor from this run", title_justify="left")
    for col in ("goal", "cudalink", "reference", "against", "ratio", "target", "met"):
        gt.add_column(col, justify="left" if col in ("goal", "against", "target") else "right")
    for g in report.get("goals", []):
        fps = "fps" in g["goal"]
        share = "share" in g["goal"]

        def fmt(v: float | None, fps: bool = fps, share: bool = share) -> str:
            if v is None:
                return "—"
            if share:
                return f"{v:.0%}"
            return f"{v:,.0f} fps" if fps else _us(v)

        met = g["met"]
        gt.add_row(
            g["goal"],
            fmt(g["cudalink"]),
            fmt(g["reference"]) if not share else "100%",
            g["reference_label"],
            "—" if g["ratio"] is None else f"{g['ratio']:.2f}x",
            g["target"],
            Text(
                "—" if met is None else ("yes" if met else "no"),
                style="" if met is None else ("green" if met else "red"),
            ),
        )
    return gt


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import _bench

    console, err = _console(), _console(stderr=True)
    device = args.device or ("cpu" if args.quick else "auto")
    backend = _bench.resolve_backend(device)
    if backend.note:
        err.print(Text(backend.note, style="yellow"))
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise LinkError(f"cudalink: cannot write --json {args.json}: no directory {parent}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("bench", total=None)

        def on_step(desc: str, i: int, n: int) -> None:
            progress.update(task, description=f"bench: {desc}", completed=i, total=n)

        bench = _bench.Bench(
            quick=args.quick,
            backend=backend,
            frames=args.frames,
            fanout=args.fanout,
            debug=bool(getattr(args, "debug", False)),
            progress=on_step,
            breakdown_only=args.breakdown,
        )
        report = bench.run()
    tables = _breakdown_tables(report)
    if not args.breakdown:
        tables = _bench_tables(report) + tables + [_goals_table(report)]
    for t in tables:
        console.print(t)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        console.print(f"JSON written to {args.json}")
    else:
        sys.stdout.write(text + "\n")
    errors = [r for r in report.get("rows", []) if r["status"] == "error"]
    errors += [w for w in report.get("wait_modes", []) if w["status"] == "error"]
    errors += [
        {"reason": f"{part}: {report[part]}"} for part in ("floors", "breakdown") if isinstance(report.get(part), str)
    ]
    code = 0
    if errors:
        first = errors[0]
        print(f"cudalink: {len(errors)} bench measurement(s) failed; first: {first['reason']}", file=sys.stderr)
        code = 1
    if _bench._KEEP_UNTIL_EXIT:
        # the GPU peers' shared tensors/buffers crash torch/cuda.core when freed (see _bench); skip teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# ============================================================================================ main


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show full tracebacks instead of one-line errors",
    )
    parser = argparse.ArgumentParser(
        prog="python -m cudalink",
        parents=[common],
        description="cudalink: zero-copy GPU (and CPU) frames between processes.",
    )
    parser.add_argument("--version", action="version", version=f"cudalink {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,info,monitor,bench}")

    p = sub.add_parser("demo", parents=[common], help="one producer and N consumer processes on one link, live stats")
    p.add_argument("--device", default="auto", help="cpu | 0 | cuda:N | auto (default: a GPU if usable, else cpu)")
    p.add_argument("--consumers", type=int, default=2, help="consumer processes (default 2)")
    p.add_argument("--shape", default="720,1280,4", help="frame shape (default 720,1280,4)")
    p.add_argument("--dtype", default="uint8", help="frame dtype (default uint8)")
    p.add_argument("--slots", type=int, default=4, help="ring slots (default 4)")
    p.add_argument("--fps", type=float, default=60.0, help="producer frame rate; 0 = as fast as possible (default 60)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default 5 unless --frames)")
    p.add_argument("--frames", type=int, default=None, help="stop after this many published frames")
    p.add_argument("--name", default=None, help="link name (default demo-<pid>)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "info", parents=[common], help="driver, GPUs, IPC support, shared memory: is this machine ready?"
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("monitor", parents=[common], help="watch a link read-only (never joins it)")
    p.add_argument("name", help="link name, as given to Sender")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until Ctrl-C)")
    p.set_defaults(func=cmd_monitor)

    p = sub.add_parser("bench", parents=[common], help="latency/throughput vs torch.multiprocessing and other peers")
    p.add_argument("--quick", action="store_true", help="short CPU-backend run (CI: under a minute on 2 cores)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the JSON report here (default: stdout)")
    p.add_argument("--device", default=None, help="cpu | 0 | cuda:N | auto (default: auto; cpu with --quick)")
    p.add_argument("--frames", type=int, default=None, help="frames per latency run (overrides the plan)")
    p.add_argument("--fanout", type=int, default=8, help="consumers in the fan-out run (default 8)")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="only the floors and where one frame's time goes, stage by stage, across both processes",
    )
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m cudalink`` and the ``cudalink`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    import multiprocessing

    # every child we start is spawned; making it the default too keeps torch's queue feeders from
    # assuming fork (and warning) when CUDA tensors are pickled in this process
    multiprocessing.set_start_method("spawn", force=True)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("cudalink: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            traceback.print_exc()
        text = " ".join(str(exc).split()) or type(exc).__name__
        if not text.startswith("cudalink:"):
            text = f"cudalink: {type(exc).__name__}: {text}" if not isinstance(exc, LinkError) else f"cudalink: {text}"
        print(text, file=sys.stderr)
        return 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
