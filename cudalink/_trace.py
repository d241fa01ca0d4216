"""Stage timestamps of the per-frame path, for ``python -m cudalink bench --breakdown``.

Off by default: each stage costs the hot path one module-attribute test (``if _trace.ON``). When a
breakdown turns it on, every stage appends ``(stage, time.monotonic_ns())`` to this process's list;
CLOCK_MONOTONIC is one clock for the whole machine on Linux, so a producer's and a consumer's marks
can be subtracted across processes.
"""

from __future__ import annotations

import time

#: producer stages, in the order one ``send`` passes them
SEND_ENTERED = "send entered"
SOURCE_READ = "source described"  # read and checked before a slot is claimed
WAKING_AHEAD = "waking ahead"  # slot claimed, sleepers that asked for it found: wake them before the copy
AHEAD_SENT = "wake-up ahead sent"
SLOT_CLAIMED = "slot claimed"
FENCES_WAITED = "fences waited"
COPY_QUEUED = "copy queued"
EVENT_RECORDED = "event recorded"
PUBLISHED = "published"
WAKING = "waking"  # about to write the wake-up byte: the OS wake is timed from here, as the floor's is
WAKE_SENT = "wake sent"
#: consumer stages, in the order one ``recv`` (and the caller's export and release) passes them
WOKEN = "woken"
LEASED = "slot leased"
FRAME_BUILT = "frame built"
EXPORTED = "exported"
RELEASED = "released"

ON = False
_marks: list[tuple[str, int]] = []
_clock = time.monotonic_ns


def mark(stage: str) -> None:
    _marks.append((stage, _clock()))


def enable(on: bool = True) -> None:
    global ON
    ON = on
    _marks.clear()


def take() -> list[tuple[str, int]]:
    """The marks since the last ``take`` (and forget them)."""
    out = list(_marks)
    _marks.clear()
    return out
