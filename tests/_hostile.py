"""Child processes for ``test_hostile``: what may hang or crash runs here, never in the pytest process.

A take loop that spins on a corrupt header holds the GIL (the compiled one never lets go), so no timeout
inside the test process could stop it; the parent waits on a queue and kills the child instead.
"""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

import numpy as np

import cudalink
from cudalink.frames.spec import FrameSpec
from cudalink.transport import wire

RECV_TIMEOUT = 0.5


def take_over_a_lying_stamp(impl: str, out: Any) -> None:
    """The ring alone: slot 0's stamp says frame 1000 (even: "ready") over the record of frame 1."""
    from cudalink import _native, _ring

    layout = wire.Layout(4, 2)
    view = memoryview(bytearray(layout.size))
    if impl == "python":
        tx: Any = _ring.PyProducerRing(view, layout)
        rx: Any = _ring.PyConsumerRing(view, layout, 0, 1 << 20)
    else:
        assert _native.ring is not None
        tx = _ring._NativeProducerRing(view, layout)
        rx = _native.ring.ConsumerCore(view, layout, 0, 1 << 20)
    spec = FrameSpec((4,), "uint8")
    for seq in (1, 2, 3):
        slot = tx.claim(seq)
        tx.publish(slot, seq, 0, spec, b"")
    wire.write_u64(view, layout.stamp(0), 2 * 1000)
    t0 = time.monotonic()
    try:
        got = rx.take(0, True)
        result = ("returned", repr(got))
    except Exception as exc:
        result = (type(exc).__name__, str(exc))
    out.put((*result, time.monotonic() - t0, wire.read_u64(view, layout.lease(0, 0))))


def recv_over_a_lying_stamp(name: str, out: Any) -> None:
    """A whole link: the same lie in a live header, under ``recv(timeout=0.5)``."""
    with (
        cudalink.Sender(name, shape=(4,), dtype="uint8", slots=4) as tx,
        cudalink.Receiver(name, timeout=2.0) as rx,
    ):
        for _ in range(3):
            tx.send(np.zeros(4, np.uint8))
        wire.write_u64(tx._server.header, tx._layout.stamp(0), 2 * 1000)  # over frame 1's record
        t0 = time.monotonic()
        try:
            f = rx.recv(timeout=RECV_TIMEOUT)
            result = ("returned", f"seq {f.seq}")
        except Exception as exc:
            result = (type(exc).__name__, str(exc))
        out.put((*result, time.monotonic() - t0))


def streaming_producer(name: str, report: Any, ready: Any, every: float = 0.0005) -> None:
    """Stream frames until killed; anything but a cudalink error goes to ``report`` and ends the child."""
    try:
        with cudalink.Sender(name, shape=(8, 8), dtype="uint8", slots=4) as tx:
            ready.set()
            seq = 0
            while True:
                seq += 1
                try:
                    if seq % 2:
                        tx.send(np.full((8, 8), seq % 251, np.uint8), meta=seq.to_bytes(8, "little"))
                    else:
                        with tx.reserve(meta=seq.to_bytes(8, "little")) as f:
                            np.from_dlpack(f)[...] = seq % 251
                except cudalink.LinkError:
                    pass
                time.sleep(every)
    except Exception:
        report.put(("producer", traceback.format_exc()))
        raise


def timed_consumer(name: str, seconds: float, beat: Any, report: Any, ready: Any) -> None:
    """``recv(timeout=RECV_TIMEOUT)`` over and over for ``seconds``; ``beat`` is the monotonic time of the last
    return (the parent's hang detector). Reports the longest recv, the outcomes, and any non-cudalink error."""
    longest = 0.0
    outcomes: dict[str, int] = {}
    rx = None
    try:
        rx = cudalink.Receiver(name, timeout=30.0)
        beat.value = time.monotonic()
        ready.set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                f = rx.recv(timeout=RECV_TIMEOUT)
                f.numpy().sum()  # read it: a lying handle must not make this fault
                f.release()
                kind = "frame"
            except cudalink.LinkError as exc:
                kind = type(exc).__name__
                if isinstance(exc, cudalink.ProducerGone):  # a lying shutdown flag: this Receiver believes it
                    rx.close()
                    rx = cudalink.Receiver(name, timeout=RECV_TIMEOUT, connect=False)
            now = time.monotonic()
            beat.value = now
            longest = max(longest, now - t0)
            outcomes[kind] = outcomes.get(kind, 0) + 1
    except Exception:
        report.put(("consumer", traceback.format_exc()))
        raise
    finally:
        if rx is not None:
            rx.close()
    report.put(("done", longest, outcomes))


class Scribbler:
    """Lies written into a live header, each undone after a while (unless the producer rewrote the bytes first).

    Most lies last a few milliseconds, so frames keep flowing and every path gets its turn; one stamp lie in
    ten (one other lie in a hundred) lasts longer than a recv's timeout + 1 s, which is what turns a take
    loop that ignores its deadline into a hang the parent sees.
    """

    def __init__(self, buf: memoryview, layout: wire.Layout, rng: random.Random) -> None:
        self.buf = buf
        self.layout = layout
        self.rng = rng
        self.pending: list[tuple[float, int, bytes, bytes]] = []  # (undo at, offset, original, lie)

    def _lie(self) -> tuple[int, bytes]:
        rng, layout, buf = self.rng, self.layout, self.buf
        r = rng.random()
        if r < 0.4:  # a stamp: even ("ready") or odd ("being written"), near the live seqs or far from them
            off = layout.stamp(rng.randrange(layout.nslots))
            live = wire.read_u64(buf, off)
            value = rng.choice([live + 2, live + 1, 2 * rng.randrange(1 << 40), rng.randrange(1 << 64), 0])
            return off, wire.U64.pack(value)
        if r < 0.7:  # the slot records (seq, spec bytes, meta length)
            return layout.records + rng.randrange(layout.nslots * wire.RECORD_SIZE), bytes([rng.randrange(256)])
        if r < 0.75:  # the fixed part: flags, counts, generation (what a re-attach reads)
            return rng.randrange(wire.FIXED_SIZE), bytes([rng.randrange(256)])
        # handles, leases, fences, consumer entries
        return layout.handles + rng.randrange(layout.size - layout.handles), bytes([rng.randrange(256)])

    def step(self, now: float) -> None:
        """Undo the lies that are due, and tell a new one."""
        keep = []
        for due, off, original, lie in self.pending:
            if due > now:
                keep.append((due, off, original, lie))
            elif bytes(self.buf[off : off + len(lie)]) == lie:
                self.buf[off : off + len(lie)] = original
        self.pending = keep
        off, lie = self._lie()
        original = bytes(self.buf[off : off + len(lie)])
        self.buf[off : off + len(lie)] = lie
        long = 0.1 if off < self.layout.records else 0.01  # the stamps lie longest
        hold = self.rng.uniform(1.0, 2.5) if self.rng.random() < long else self.rng.uniform(0.0, 0.02)
        self.pending.append((now + hold, off, original, lie))


def header_of(name: str) -> tuple[memoryview, Any]:
    """A live link's header segment mapped writable, and the segment (keep it alive while the view is used)."""
    from cudalink.transport.shm import _open_segment, header_segment

    seg = _open_segment(header_segment(name))
    assert seg.buf is not None
    return seg.buf, seg
