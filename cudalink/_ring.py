"""The ring protocol over a header region: claim, publish, lease, release, reclaim.

Shared by every backend and transport: it reads and writes only the cells ``transport.wire``
defines. See that module's docstring for the stamp/lease handshake.

One protocol, two implementations of its per-frame operations: the Python classes here, and the
compiled ``cudalink._native.ring`` (C atomics instead of a lock round trip as the fence), used where it
was built. :func:`producer_ring` and :func:`consumer_ring` pick; ``CUDALINK_PURE_PYTHON=1`` forces
Python. Both write the same cells, so a compiled producer and a pure-Python consumer interoperate.

Everything a frame touches is resolved when the ring is built (offsets per slot and per consumer,
bound ``pack_into``/``unpack_from`` of precompiled structs), so a frame costs a handful of
struct calls and no allocation beyond the integers they return.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from . import _native
from .errors import ProtocolError
from .frames.spec import FrameSpec
from .transport import wire
from .transport.wire import Layout

_barrier_lock = threading.Lock()
_acquire = _barrier_lock.acquire
_release = _barrier_lock.release
_put64 = wire.U64.pack_into
_get64 = wire.U64.unpack_from
_put32 = wire.U32.pack_into
_get32 = wire.U32.unpack_from


def full_fence() -> None:
    """A full memory barrier between our last store and our next load.

    The claim/lease handshake is Dekker's: each side stores its cell, then loads the other's. x86 (TSO)
    may let that load pass the store still sitting in the store buffer, which is exactly when the other
    core is spinning on the line. Python has no fence, but an uncontended lock acquire/release executes
    locked atomic instructions (``lock cmpxchg``/``xadd``), and those drain the store buffer.
    """
    _acquire()
    _release()


def mask_bits(mask: int) -> list[int]:
    """The consumer indexes a mask names (bit i: index i), lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class _ProducerCold:
    """What runs once per consumer or per flag change: one implementation for both rings."""

    buf: wire.Buf
    layout: Layout

    def set_flag(self, flag: int, on: bool) -> None:
        flags = wire.read_u32(self.buf, wire.OFF_FLAGS)
        wire.write_u32(self.buf, wire.OFF_FLAGS, (flags | flag) if on else (flags & ~flag))
        full_fence()  # a waiting producer re-checks leases after raising its flag

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

    def token(self, index: int) -> int:
        return wire.read_u64(self.buf, self.layout.consumer(index) + 8)


class PyProducerRing(_ProducerCold):
    """The producer's per-frame operations in Python (the reference; see ``_native/ring.pyx``)."""

    def __init__(self, buf: wire.Buf, layout: Layout) -> None:
        self.buf = buf
        self.layout = layout
        n, c = layout.nslots, layout.nconsumers
        self._slots = range(n)
        self._stamp_off = [layout.stamp(i) for i in range(n)]
        self._record_off = [layout.record(i) for i in range(n)]
        self._column_off = [layout.lease(i, 0) for i in range(n)]
        self._fence_off = [layout.fence(i, 0) for i in range(n)]
        self._waiting_off = [layout.consumer(i) + wire.CONSUMER_OFF_WAITING for i in range(c)]
        self._stamps = layout.stamps_struct.unpack_from
        self._column = layout.column_struct.unpack_from
        self._fences = layout.fence_column_struct.unpack_from
        self._published = wire.read_u64(buf, wire.OFF_PUBLISHED)
        self._dropped = wire.read_u64(buf, wire.OFF_DROPPED)

    def _leased(self, slot: int) -> bool:
        return any(self._column(self.buf, self._column_off[slot]))

    def claim(self, seq: int, skip: int = 0) -> int | None:
        """Take the oldest slot no consumer holds and not in ``skip`` (bit i: slot i, those an open ``reserve()``
        writes), marking it 'being written' for frame ``seq``. A slot left odd by a claim that never published
        (an exception between the two) is taken again like any other."""
        buf = self.buf
        stamps = self._stamps(buf, self.layout.stamps)
        tried = skip  # bit mask of slots not to take: skipped, or lost a race to a consumer this call
        while True:
            slot, oldest = -1, 0
            for i in self._slots:  # the oldest unleased slot: a min over a few ints, no sort
                st = stamps[i]
                if (slot < 0 or st < oldest) and not (tried >> i) & 1 and not self._leased(i):
                    slot, oldest = i, st
            if slot < 0:
                return None
            off = self._stamp_off[slot]
            _put64(buf, off, 2 * seq + 1)
            _acquire()  # full fence: our odd stamp is visible before we re-read the leases
            _release()
            if not self._leased(slot):
                return slot
            _put64(buf, off, oldest)  # a consumer leased it between our check and our claim
            tried |= 1 << slot

    def abort(self, slot: int) -> None:
        """The slot's old content may be half overwritten: mark it empty, never restore it."""
        _put64(self.buf, self._stamp_off[slot], 0)

    def publish(self, slot: int, seq: int, timestamp_ns: int | None, spec: FrameSpec, meta: bytes) -> int:
        """Write the record, stamp the slot even, count it, fence. Returns the frame's timestamp.

        The closing fence makes the stamp visible before the caller reads which consumers sleep: it pairs
        with :meth:`PyConsumerRing.set_waiting`.

        Without a caller's timestamp the frame is stamped here, after the spec bytes are written, so
        ``timestamp_ns`` is the publication itself and handoff figures start there.
        """
        buf = self.buf
        off = self._record_off[slot]
        wire.pack_record_spec(buf, off, spec, meta)
        ts = time.time_ns() if timestamp_ns is None else timestamp_ns
        wire.U64X2.pack_into(buf, off, seq, ts)
        _put64(buf, self._stamp_off[slot], 2 * seq)
        self._published += 1
        wire.U64X3.pack_into(buf, wire.OFF_PUBLISHED, self._published, self._dropped, ts)
        _acquire()
        _release()
        return ts

    def count_drop(self) -> None:
        self._dropped += 1
        _put64(self.buf, wire.OFF_DROPPED, self._dropped)

    def take_fences(self, slot: int) -> list[int]:
        """Consumers that left a GPU release fence on ``slot``; the flags are cleared."""
        base = self._fence_off[slot]
        col = self._fences(self.buf, base)
        if not any(col):
            return []
        out = [c for c, v in enumerate(col) if v]
        for c in out:
            _put32(self.buf, base + 4 * c, 0)
        return out

    def _bits(self, among: int) -> list[int]:
        if among < 0 or among >> self.layout.nconsumers:
            raise IndexError(
                f"cudalink: consumer mask {among:#x} names consumers outside 0..{self.layout.nconsumers - 1}"
            )
        return mask_bits(among)

    def _waiting(self, among: int, mask: int, value: int) -> int:
        """Of the consumers in ``among``, those whose waiting word has ``word & mask == value``."""
        buf, offs, out = self.buf, self._waiting_off, 0
        for i in self._bits(among):
            if _get32(buf, offs[i])[0] & mask == value:
                out |= 1 << i
        return out

    def sleepers(self, among: int) -> int:
        """Of the consumers in ``among`` (bit i: consumer i), those asleep with no wake-up on its way:
        wake them after a publish."""
        return self._waiting(among, wire.WAIT_ON, wire.WAIT_ON)

    def wake_ahead(self, among: int) -> int:
        """Of the consumers in ``among``, those that asked to be woken ahead of the frame; each is marked
        ``WOKEN_AHEAD`` (a wake-up is on its way), so it gets no second one after the publish."""
        buf, offs, out = self.buf, self._waiting_off, 0
        for i in self._bits(among):
            if _get32(buf, offs[i])[0] == wire.WAIT_AHEAD:
                _put32(buf, offs[i], wire.WOKEN_AHEAD)
                out |= 1 << i
        return out

    def woken_ahead(self, among: int) -> int:
        """Of the consumers in ``among``, those still marked ``WOKEN_AHEAD``: woken ahead, and not yet run
        since (a woken consumer sets its word as soon as it runs)."""
        return self._waiting(among, 0xFFFFFFFF, wire.WOKEN_AHEAD)


class PyConsumerRing:
    """The consumer's operations in Python (the reference; see ``_native/ring.pyx``)."""

    def __init__(self, buf: wire.Buf, layout: Layout, index: int, capacity: int) -> None:
        self.buf = buf
        self.layout = layout
        self.index = index
        self.capacity = capacity
        self._entry = layout.consumer(index)
        n = layout.nslots
        self._stamps = layout.stamps_struct.unpack_from
        self._stamps_off = layout.stamps
        self._stamp_off = [layout.stamp(i) for i in range(n)]
        self._record_off = [layout.record(i) for i in range(n)]
        self._lease_off = [layout.lease(i, index) for i in range(n)]
        self._fence_off = [layout.fence(i, index) for i in range(n)]
        self._waiting_off = self._entry + wire.CONSUMER_OFF_WAITING
        self._counts_off = self._entry + wire.CONSUMER_OFF_RECEIVED
        self._last_recv_off = self._entry + wire.CONSUMER_OFF_LAST_RECV

    def take(self, after: int, newest: bool) -> tuple[int, wire.SlotRecord] | None:
        """Lease the newest frame after ``after`` (the oldest when ``newest`` is False) and read its record.

        One call does find and lease, because it is the first thing a woken consumer runs: the stamp is
        leased, fenced, re-read, and a producer that took the slot meanwhile makes us look again.

        The loop is bounded: each retry means the producer took the slot in the few instructions between
        our read and our lease, so ``wire.TAKE_RETRIES`` in a row means the header is being scribbled on, and we
        report no frame (the caller's deadline then holds). A stamp that stays even under our lease while
        its record names another frame is a lie no producer tells: :class:`ProtocolError`.
        """
        buf = self.buf
        lo = 2 * after
        for _ in range(wire.TAKE_RETRIES):
            slot, best = -1, 0
            for i, stamp in enumerate(self._stamps(buf, self._stamps_off)):
                if stamp > lo and not stamp & 1 and (best == 0 or (stamp > best if newest else stamp < best)):
                    slot, best = i, stamp
            if not best:
                return None
            seq = best >> 1
            off = self._lease_off[slot]
            _put64(buf, off, seq)
            _acquire()  # full fence: our lease is visible before we re-read the stamp
            _release()
            if _get64(buf, self._stamp_off[slot])[0] == best:
                try:
                    rec = wire.unpack_record(buf, self._record_off[slot], self.capacity)
                except BaseException:
                    _put64(buf, off, 0)
                    raise
                if rec.seq != seq:
                    _put64(buf, off, 0)
                    raise ProtocolError(wire.stamp_lie(slot, seq, rec.seq))
                if newest or not self._older(buf, lo, best):
                    return slot, rec
            _put64(buf, off, 0)  # the producer reclaimed it, or published older ones we missed: look again
        return None

    def _older(self, buf: wire.Buf, lo: int, best: int) -> bool:
        """Oldest first: does a frame older than ``best`` hold a slot after all? The scan is not one atomic read:
        a producer publishing while it ran can show us a later slot's new frame after we passed an earlier
        slot just before its (older) frame landed. Those were published before ``best``, so after our fence
        a second scan sees them."""
        return any(lo < st < best and not st & 1 for st in self._stamps(buf, self._stamps_off))

    def forget(self) -> None:
        """A forked child's copy: from now on it reads and writes a private blank header, never the shared one
        whose leases and counts are the parent's (a frame the child drops must not end the parent's lease)."""
        self.buf = bytearray(len(self.buf))

    def release(self, slot: int, seq: int, fenced: bool) -> int:
        """Clear our lease of ``slot`` if it still holds ``seq``; returns the header flags, read after it."""
        buf = self.buf
        off = self._lease_off[slot]
        if _get64(buf, off)[0] == seq:
            if fenced:
                _put32(buf, self._fence_off[slot], 1)
            _put64(buf, off, 0)
            _acquire()  # full fence: the lease is clear before we read FLAG_PRODUCER_WAITING
            _release()
        return int(_get32(buf, wire.OFF_FLAGS)[0])

    def flags(self) -> int:
        return int(_get32(self.buf, wire.OFF_FLAGS)[0])

    def set_waiting(self, state: int) -> None:
        """Announce (``wire.WAIT_ON``/``WAIT_AHEAD``) or withdraw (0) that we sleep; re-check the stamps after."""
        if not 0 <= state <= wire.WAIT_AHEAD:
            raise ValueError(f"cudalink: waiting state {state} is not one of 0..{wire.WAIT_AHEAD}")
        _put32(self.buf, self._waiting_off, state)
        if state:
            full_fence()

    def count(self, received: int, skipped: int) -> None:
        wire.U64X2.pack_into(self.buf, self._counts_off, received, skipped)
        _put64(self.buf, self._last_recv_off, time.time_ns())


def read_record(buf: wire.ReadBuf, layout: Layout, slot: int, capacity: int) -> wire.SlotRecord | None:
    """A seqlock read for observers that take no lease (the monitor, on a read-only mapping).

    The record counts only if the slot's stamp is even and unchanged around it, and names the same frame.
    """
    off = layout.stamp(slot)
    for _ in range(5):
        before = wire.read_u64(buf, off)
        if before == 0 or before & 1:
            return None
        try:
            rec = wire.unpack_record(buf, layout.record(slot), capacity)
        except ProtocolError:
            rec = None
        if wire.read_u64(buf, off) == before:
            return rec if rec is not None and rec.seq == before >> 1 else None
    return None


class ProducerRing(Protocol):
    """What ``Sender`` uses of its ring, whichever implementation it got."""

    buf: wire.Buf
    layout: Layout

    def claim(self, seq: int, skip: int = 0) -> int | None: ...
    def abort(self, slot: int) -> None: ...
    def publish(self, slot: int, seq: int, timestamp_ns: int | None, spec: FrameSpec, meta: bytes) -> int: ...
    def count_drop(self) -> None: ...
    def take_fences(self, slot: int) -> list[int]: ...
    def sleepers(self, among: int) -> int: ...
    def wake_ahead(self, among: int) -> int: ...
    def woken_ahead(self, among: int) -> int: ...
    def set_flag(self, flag: int, on: bool) -> None: ...
    def join(self, index: int, pid: int, token: int) -> None: ...
    def leave(self, index: int) -> None: ...
    def free_index(self) -> int | None: ...
    def token(self, index: int) -> int: ...


class ConsumerRing(Protocol):
    """What ``Receiver`` uses of its ring, whichever implementation it got."""

    def take(self, after: int, newest: bool) -> tuple[int, wire.SlotRecord] | None: ...
    def release(self, slot: int, seq: int, fenced: bool) -> int: ...
    def forget(self) -> None: ...
    def flags(self) -> int: ...
    def set_waiting(self, state: int) -> None: ...
    def count(self, received: int, skipped: int) -> None: ...


_native_ring = _native.ring
if _native_ring is not None:
    from ._native.ring import ProducerCore

    class _NativeProducerRing(ProducerCore, _ProducerCold):
        """The compiled per-frame operations, with the cold ones above."""


def producer_ring(buf: wire.Buf, layout: Layout) -> ProducerRing:
    """The compiled ring where it was built and ``buf`` suits it (aligned, writable), else the Python one."""
    if _native_ring is not None:
        try:
            return _NativeProducerRing(buf, layout)
        except (ValueError, BufferError):
            pass
    return PyProducerRing(buf, layout)


def consumer_ring(buf: wire.Buf, layout: Layout, index: int, capacity: int) -> ConsumerRing:
    if _native_ring is not None:
        try:
            return _native_ring.ConsumerCore(buf, layout, index, capacity)  # type: ignore[no-any-return]
        except (ValueError, BufferError):
            pass
    return PyConsumerRing(buf, layout, index, capacity)
