"""Terminal output the commands share: one rich console, microsecond formatting, percentiles."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rich.console import Console

from ..errors import LinkError
from .measure import summarize


def _console(stderr: bool = False) -> Console:
    """Wide enough for the tables when output is piped (rich would assume 80 columns). ``COLUMNS`` is taken
    only as a positive number: rich lays out ``COLUMNS=0`` (``$(tput cols)`` with no terminal) as zero
    columns, which prints nothing at all."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream is not None and stream.isatty()  # None: Python started with it closed (``>&-``)
    columns = os.environ.get("COLUMNS", "")
    if (columns.isdigit() and int(columns) > 0) or (tty and not columns.isdigit()):
        width = None  # rich: COLUMNS, else the terminal's own width (followed as it changes)
    else:
        width = shutil.get_terminal_size().columns if tty else 160
    return Console(stderr=stderr, width=width, highlight=False)


class Stopped(BaseException):
    """SIGTERM (``timeout``, a service manager): leave the command's loop as Ctrl-C does, through its cleanup.

    A BaseException, as KeyboardInterrupt is: raised wherever the main thread stands, an ``Exception`` went
    into the library's ``except Exception`` cleanups (a released frame's credit, say) and was lost there, and
    the relay ran on after SIGTERM (1 run in 6 of its test, 2026-11-27)."""


_stop = threading.Event()
_stop_signal = 0  # the signal that set _stop


def _on_sigterm(signum: int, frame: object) -> None:
    global _stop_signal
    _stop_signal = signum
    _stop.set()  # seen at the loop's next turn, even where the raise lands in a finalizer, which drops it
    raise Stopped


def stop_requested() -> bool:
    """SIGTERM came inside :func:`sigterm_stops`: a command's loop checks it each turn (see :class:`Stopped`)."""
    return _stop.is_set()


def stop_signal() -> int:
    """Which of :func:`sigterm_stops`'s signals came (0: none): a command that exits as that signal would
    reports ``128 + it``, as a shell does."""
    return _stop_signal if _stop.is_set() else 0


@contextlib.contextmanager
def sigterm_stops(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[None]:
    """While inside, SIGTERM (or each of ``signals``) raises :class:`Stopped` in the main thread instead of
    killing the process where it stands. The command's own process: a handler here takes nothing from an
    application (the library installs none)."""
    main = threading.current_thread() is threading.main_thread()  # signal handlers live on the main thread
    _stop.clear()
    previous = {sig: signal.signal(sig, _on_sigterm) for sig in signals} if main else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _us(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    if abs(v) >= 10_000:
        return f"{v / 1000:,.1f} ms"
    return f"{v:,.1f} µs" if abs(v) < 100 else f"{v:,.0f} µs"


def _pcts(values_ns: Sequence[int]) -> tuple[float | None, float | None]:
    """p50/p99 in µs through the bench's one summary (``measure.summarize``)."""
    got = summarize(values_ns)
    return (got["p50"], got["p99"]) if got else (None, None)


def _ago(ns: int, now_ns: int) -> str:
    if not ns:
        return "never"
    return f"{_us((now_ns - ns) / 1e3)} ago"


def _finite(x: object) -> object:
    """``x`` with every float that is not a number (NaN, ±inf) made None: ``json.dumps`` would write those as
    ``NaN``/``Infinity``, which no strict JSON reader takes."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def check_json_path(path: str | None) -> None:
    """``--json PATH`` that cannot be written, refused before a run of minutes rather than after it."""
    if not path or path == "-":
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise LinkError(f"cudalink: cannot write --json {path}: no directory {parent}")
    if os.path.isdir(path):
        raise LinkError(f"cudalink: --json {path} is a directory; name a file in it, e.g. {path}/bench.json")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise LinkError(f"cudalink: cannot write --json {path} (no permission); name a file you may write")


def write_json(report: Mapping[str, object], path: str | None, console: Console) -> None:
    """The full report (hundreds of lines) only when asked for: ``--json PATH``, or ``--json -`` for stdout
    (where the caller printed its tables to stderr). A figure that is not a number is written as null."""
    if not path:
        return
    text = json.dumps(_finite(report), indent=2, allow_nan=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise LinkError(f"cudalink: cannot write --json {path}: {exc.strerror}; name another file") from exc
    console.print(f"JSON written to {path}")


def print_then_json(print_report: Callable[[dict[str, Any]], None], report: dict[str, Any], path: str | None) -> None:
    """A bench of its own rows (``--remote``, ``--multi-gpu``): its tables, then ``--json``. With ``--json -``
    stdout is the JSON alone (for a pipe), so the tables go to stderr."""
    with contextlib.redirect_stdout(sys.stderr) if path == "-" else contextlib.nullcontext():
        print_report(report)
    write_json(report, path, _console())
