"""Terminal output the commands share: one rich console, microsecond formatting, percentiles."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from .measure import summarize


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
    """p50/p99 in µs through the bench's one summary (``measure.summarize``)."""
    got = summarize(values_ns)
    return (got["p50"], got["p99"]) if got else (None, None)


def _ago(ns: int, now_ns: int) -> str:
    if not ns:
        return "never"
    return f"{_us((now_ns - ns) / 1e3)} ago"
