"""The ring protocol over a header region: claim, publish, lease, release, reclaim.

Shared by every backend and transport: it reads and writes only the cells ``transport.wire``
defines. See that module's docstring for the stamp/lease handshake.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .frames.spec import FrameSpec
from .transport import wire
from .transport.wire import Layout

_barrier_lock = threading.Lock()


def full_fence() -> None:
    """A full memory barrier between our last store and our next load.

    The claim/lease handshake is Dekker's: each side stores its cell, then loads the other's. x86 (TSO)
    may let that load pass the store still sitting in the store buffer, which is exactly when the other
    core is spinning on the line. Python has no fence, but an uncontended lock acquire/release executes
    locked atomic instructions (``lock cmpxchg``/``xadd``), and those drain the store buffer.
    """
    _barrier_lock.acquire()
    _barrier_lock.release()


class ProducerRing:
    def __init__(self, buf: Any, layout: Layout) -> None:
        self.buf = buf
        self.layout = layout
        self._stamp_off = [layout.stamps + 8 * i for i in range(layout.nslots)]

    def _leased(self, slot: int) -> bool:
        return any(wire.read_column(self.buf, self.layout, slot))

    def claim(self, seq: int) -> int | None:
        """Take the oldest slot no consumer holds, marking it 'being written' for frame ``seq``."""
        stamps = wire.read_stamps(self.buf, self.layout)
        for slot in sorted(range(self.layout.nslots), key=stamps.__getitem__):
            if self._leased(slot):
                continue
            old = stamps[slot]
            wire.write_u64(self.buf, self._stamp_off[slot], 2 * seq + 1)
            full_fence()
            if self._leased(slot):  # a consumer leased it between our check and our claim
                wire.write_u64(self.buf, self._stamp_off[slot], old)
                continue
            return slot
        return None

    def abort(self, slot: int) -> None:
        """The slot's old content may be half overwritten: mark it empty, never restore it."""
        wire.write_u64(self.buf, self._stamp_off[slot], 0)

    def publish(self, slot: int, seq: int, timestamp_ns: int, spec: FrameSpec, meta: bytes) -> None:
        wire.pack_record(self.buf, self.layout.record(slot), seq, timestamp_ns, spec, meta)
        wire.write_u64(self.buf, self._stamp_off[slot], 2 * seq)
        wire.write_u64(self.buf, wire.OFF_PUBLISHED, wire.read_u64(self.buf, wire.OFF_PUBLISHED) + 1)
        wire.write_u64(self.buf, wire.OFF_LAST_PUBLISH, timestamp_ns)

    def count_drop(self) -> None:
        wire.write_u64(self.buf, wire.OFF_DROPPED, wire.read_u64(self.buf, wire.OFF_DROPPED) + 1)

    def set_flag(self, flag: int, on: bool) -> None:
        flags = wire.read_u32(self.buf, wire.OFF_FLAGS)
        wire.write_u32(self.buf, wire.OFF_FLAGS, (flags | flag) if on else (flags & ~flag))
        full_fence()  # a waiting producer re-checks leases after raising its flag

    def take_fences(self, slot: int) -> list[int]:
        """Consumers that left a GPU release fence on ``slot``; the flags are cleared."""
        col = wire.read_fence_column(self.buf, self.layout, slot)
        out = [c for c, v in enumerate(col) if v]
        for c in out:
            wire.write_u32(self.buf, self.layout.fence(slot, c), 0)
        return out

    def join(self, index: int, pid: int, token: int) -> None:
        self._clear(index)
        wire.CONSUMER.pack_into(self.buf, self.layout.consumer(index), 1, pid, token, 0, 0, time.time_ns(), 0)

    def leave(self, index: int) -> None:
        self._clear(index)
        wire.write_u32(self.buf, self.layout.consumer(index), 0)

    def _clear(self, index: int) -> None:
        for slot in range(self.layout.nslots):
            wire.write_u64(self.buf, self.layout.lease(slot, index), 0)
            wire.write_u32(self.buf, self.layout.fence(slot, index), 0)

    def free_index(self) -> int | None:
        for i in range(self.layout.nconsumers):
            if wire.read_u32(self.buf, self.layout.consumer(i)) == 0:
                return i
        return None

    def waiting(self, index: int) -> bool:
        return wire.read_u32(self.buf, self.layout.consumer(index) + wire.CONSUMER_OFF_WAITING) != 0

    def token(self, index: int) -> int:
        return wire.read_u64(self.buf, self.layout.consumer(index) + 8)


class ConsumerRing:
    def __init__(self, buf: Any, layout: Layout, index: int, capacity: int) -> None:
        self.buf = buf
        self.layout = layout
        self.index = index
        self.capacity = capacity
        self._entry = layout.consumer(index)

    def find(self, after: int, newest: bool) -> tuple[int, int] | None:
        """(slot, seq) of the newest frame after ``after``, or of the oldest one when ``newest`` is False."""
        best_slot, best = -1, 0
        lo = 2 * after
        for slot, stamp in enumerate(wire.read_stamps(self.buf, self.layout)):
            if stamp > lo and not stamp & 1 and (best == 0 or (stamp > best if newest else stamp < best)):
                best_slot, best = slot, stamp
        return (best_slot, best >> 1) if best else None

    def acquire(self, slot: int, seq: int) -> wire.SlotRecord | None:
        """Lease ``slot`` for ``seq`` and read its record, or None if the producer took the slot first."""
        off = self.layout.lease(slot, self.index)
        wire.write_u64(self.buf, off, seq)
        full_fence()
        if wire.read_u64(self.buf, self.layout.stamps + 8 * slot) != 2 * seq:
            wire.write_u64(self.buf, off, 0)
            return None
        rec = wire.unpack_record(self.buf, self.layout.record(slot), self.capacity)
        if rec.seq != seq:
            wire.write_u64(self.buf, off, 0)
            return None
        return rec

    def release(self, slot: int, seq: int, fenced: bool) -> None:
        off = self.layout.lease(slot, self.index)
        if wire.read_u64(self.buf, off) != seq:
            return
        if fenced:
            wire.write_u32(self.buf, self.layout.fence(slot, self.index), 1)
        wire.write_u64(self.buf, off, 0)
        full_fence()  # before the caller reads FLAG_PRODUCER_WAITING

    def flags(self) -> int:
        return wire.read_u32(self.buf, wire.OFF_FLAGS)

    def set_waiting(self, on: bool) -> None:
        """Announce (or withdraw) that we are about to sleep; re-check the stamps after announcing."""
        wire.write_u32(self.buf, self._entry + wire.CONSUMER_OFF_WAITING, 1 if on else 0)
        if on:
            full_fence()

    def count(self, received: int, skipped: int) -> None:
        wire.write_u64(self.buf, self._entry + 16, received)
        wire.write_u64(self.buf, self._entry + 24, skipped)
        wire.write_u64(self.buf, self._entry + 40, time.time_ns())
