"""``monitor``: watch a live link through a read-only mapping of its header; never joins it. ``cuda-link:NAME``
watches a cuda-link segment the same way (:mod:`.cuda_link_view`)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .. import _platform
from .._ring import read_record
from ..errors import ArgumentError, LinkError
from ..frames.spec import FrameSpec
from ..link import _COUNT_EVERY
from ..transport import wire
from . import cuda_link_view
from .ui import Stopped, _ago, _console, _us, sigterm_stops, stop_requested


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


def _map_readonly(name: str) -> tuple[wire.ReadBuf, Callable[[], None]]:
    """The header segment mapped read-only (POSIX) or copied (Windows): a monitor can never write to it."""
    from ..transport.shm import header_segment, map_readonly

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
        if wire.header_pending(buf):  # the producer maps its segment before it writes the header (magic last)
            raise LinkError(f"cudalink: link {name!r} is starting: its producer has not written its header yet")
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


def device_label(f: wire.Fixed) -> str:
    """Where a link's slots live: ``cpu`` or ``cuda:N``."""
    return "cpu" if f.backend == wire.BACKEND_HOST else f"cuda:{f.device}"


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


def _spec_text(spec: FrameSpec) -> str:
    """A frame's format as the views print it: ``(8, 8, 4) uint8 RGBA (origin top)``."""
    fmt = f" {spec.pixel_format.value}" if spec.pixel_format else ""
    return f"{spec.shape} {spec.dtype.name}{fmt} (origin {spec.origin.value})"


def _lease_text(lease: LeaseInfo) -> str:
    """One lease as the views print it: slot:seq · frames behind · age."""
    return f"{lease.slot}:{lease.seq} · {lease.frames_behind} · " + (
        _us(lease.age_s * 1e6) if lease.age_s is not None else "?"
    )


def render_snapshot(snap: Snapshot, prev: Snapshot | None) -> Group:
    """Header lines plus a consumer table; rates come from the previous snapshot of the same generation."""
    f = snap.fixed
    same = prev is not None and prev.fixed.generation == f.generation
    dt = snap.mono - prev.mono if same and prev is not None else 0.0
    fps = _rate(f.published, prev.fixed.published, dt) if same and prev is not None else None
    drop_rate = _rate(f.dropped, prev.fixed.dropped, dt) if same and prev is not None else None
    device = device_label(f)
    alive = (
        "alive"
        if snap.producer_alive
        else f"NOT RUNNING: leftovers of a dead producer; `python -m cudalink clean {snap.name}` removes them"
    )
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
        lines.append(
            Text(
                f"newest frame: seq {snap.newest_seq} in slot {snap.newest_slot}: {_spec_text(snap.newest.spec)}, "
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
    # A consumer writes its counts into the header off its latency path (Receiver._publish_counts): before it sleeps,
    # and every 8th frame while one is always waiting. The column was "last recv", but it is the time of that report;
    # a consumer that took 5 frames without waiting read "0, never" while it held the fifth.
    note = Text(
        "received, skipped, fps: each consumer's counts as it last reported them (when it last waited for a frame, "
        f"or at every {_COUNT_EVERY + 1}th frame while one is always waiting); leases: as they are now",
        style="dim",
    )
    table = Table(title=f"consumers ({len(snap.consumers)} joined)", title_justify="left")
    for col in (
        "#",
        "pid",
        "received",
        "skipped",
        "fps",
        "reported",
        "leases (slot:seq · frames behind · age)",
    ):
        table.add_column(col, justify="right" if col not in ("leases (slot:seq · frames behind · age)",) else "left")
    old = {c.index: c for c in prev.consumers} if same and prev is not None else {}
    for c in snap.consumers:
        o = old.get(c.index)
        r = _rate(c.received, o.received, dt) if o is not None and o.pid == c.pid else None
        leases = ", ".join(map(_lease_text, c.leases))
        pid = f"{c.pid}" if c.alive else f"{c.pid} (dead)"
        table.add_row(
            str(c.index),
            pid,
            f"{c.received:,}",
            f"{c.skipped:,}",
            f"{r:,.1f}" if r is not None else "—",
            _ago(c.last_recv_ns, snap.now_ns) if c.last_recv_ns else "not yet",
            leases or "none",
        )
    return Group(*lines, table, *([note] if snap.consumers else []))


def plain_line(snap: Snapshot, prev: Snapshot | None) -> str:
    """One line per sample for a pipe or a log (no terminal to redraw): time, producer, rates, the newest frame's
    spec, consumers and the age of each lease."""
    f = snap.fixed
    same = prev is not None and prev.fixed.generation == f.generation
    dt = snap.mono - prev.mono if same and prev is not None else 0.0
    fps = _rate(f.published, prev.fixed.published, dt) if same and prev is not None else None
    old = {c.index: c for c in prev.consumers} if same and prev is not None else {}
    parts = []
    for c in snap.consumers:
        o = old.get(c.index)
        r = _rate(c.received, o.received, dt) if o is not None and o.pid == c.pid else None
        rate = f" {r:.1f}fps" if r is not None else ""
        ages = f" ({', '.join(map(_lease_text, c.leases))})" if c.leases else ""
        parts.append(
            f"#{c.index} pid {c.pid}{'' if c.alive else ' (dead)'} received {c.received} skipped {c.skipped}"
            f"{rate} leases {len(c.leases)}{ages}"
        )
    stamp = time.strftime("%H:%M:%S", time.localtime(snap.now_ns / 1e9))
    spec = f" spec {_spec_text(snap.newest.spec)}" if snap.newest is not None else ""
    return (
        f"{stamp} {snap.name} gen {f.generation:016x} pid {f.pid} "
        f"{'alive' if snap.producer_alive else 'NOT RUNNING'} published {f.published} "
        f"fps {f'{fps:.1f}' if fps is not None else 'n/a'} dropped {f.dropped} seq {snap.newest_seq}{spec} "
        f"consumers {len(snap.consumers)}" + ("".join(f"; {p}" for p in parts))
    )


def cmd_monitor(args: argparse.Namespace) -> int:
    console = _console()
    if not 0 < args.interval < 3600:  # NaN fails this too
        raise ArgumentError(f"cudalink: --interval must be between 0 and 3600 seconds, got {args.interval}")
    if args.seconds is not None and not 0 <= args.seconds < math.inf:
        raise ArgumentError(
            f"cudalink: --seconds must be a number >= 0, got {args.seconds}; omit it to run until Ctrl-C"
        )
    interval = max(0.05, float(args.interval))
    read: Callable[[str], Any] = read_snapshot
    render: Callable[[Any, Any], Group] = render_snapshot
    line: Callable[[Any, Any], str] = plain_line
    if args.name.startswith(cuda_link_view.PREFIX):  # a cuda-link segment: its own layout, read the same way
        read, render, line = cuda_link_view.read_snapshot, cuda_link_view.render, cuda_link_view.plain_line
    if args.once:
        first = read(args.name)
        time.sleep(interval)
        try:
            second = read(args.name)
        except LinkError:
            second = None  # the producer went away between the two looks: show what we saw
        console.print(render(second or first, first if second is not None else None))
        return 0
    deadline = math.inf if args.seconds is None else time.monotonic() + args.seconds
    try:
        with sigterm_stops():
            if console.is_terminal:
                seen = _watch_live(args.name, interval, deadline, console, read, render)
            else:
                seen = _watch_plain(args.name, interval, deadline, read, line)
    except (KeyboardInterrupt, Stopped):
        return 0  # stopped by the user (or a service manager): whatever was watched, that is a success
    except BrokenPipeError:  # the reader of our pipe stopped (``| head -1``): a stop from outside too
        _quiet_stdout()
        return 0
    if stop_requested():  # SIGTERM whose Stopped was dropped on its way (see ui.Stopped): stopped all the same
        return 0
    if not seen:  # --seconds ran out and no producer ever published: as --once would, fail (a script can tell)
        raise LinkError(
            f"cudalink: no producer published {args.name!r} here within --seconds {args.seconds:g}; start its "
            "producer (or check the name: python -m cudalink info lists the links here), or pass a longer --seconds"
        )
    return 0


def _quiet_stdout() -> None:
    """What is left in stdout's buffer goes nowhere: its reader is gone, and the flush at exit would otherwise
    print an ignored BrokenPipeError and end the process with status 120."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _watch_live(
    name: str,
    interval: float,
    deadline: float,
    console: Console,
    read: Callable[[str], Any],
    render: Callable[[Any, Any], Group],
) -> bool:
    """Redraw the view each interval until ``deadline``; whether the link was ever read."""
    prev: Any = None
    seen = False
    with Live(Text(f"attaching to {name!r} (read-only)…"), console=console, auto_refresh=False) as live:
        first = True  # one look even at --seconds 0
        while first or (time.monotonic() < deadline and not stop_requested()):
            first = False
            try:
                snap = read(name)
            except ArgumentError:  # a name that can never be valid: no producer will come
                raise
            except LinkError as exc:
                live.update(Text(f"{exc}\nwaiting for a producer… (Ctrl-C to stop)"), refresh=True)
                prev = None
            else:
                live.update(render(snap, prev), refresh=True)
                prev, seen = snap, True
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    return seen


def _watch_plain(
    name: str, interval: float, deadline: float, read: Callable[[str], Any], line_of: Callable[[Any, Any], str]
) -> bool:
    """Not a terminal (piped, a log, ``timeout``): a live view would print nothing until the end. A line a
    sample while the link can be read; why it cannot (no producer yet, one starting, gone again) once, when
    that changes, not every interval. Returns whether the link was ever read."""
    prev: Any = None
    told = ""  # the reason last printed for not reading the link
    seen = False
    first = True  # one look even at --seconds 0
    while first or (time.monotonic() < deadline and not stop_requested()):
        first = False
        try:
            snap = read(name)
        except ArgumentError:  # a name that can never be valid: no producer will come
            raise
        except LinkError as exc:
            prev = None
            why = " ".join(str(exc).split())
            if why != told:
                print(f"{time.strftime('%H:%M:%S')} {why}; waiting for a producer", flush=True)
                told = why
        else:
            print(line_of(snap, prev), flush=True)
            prev, told, seen = snap, "", True
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    return seen
