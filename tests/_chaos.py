"""Child processes for the reliability suite (the frames they send and their checks are in ``_content``)."""

from __future__ import annotations

import os
import random
import time
import traceback
from typing import Any

import numpy as np

import cudalink
from cudalink.transport import wire

from ._content import CHAOS_SHAPE, checksum, content


def chaos_producer(name: str, ready: Any) -> None:
    with cudalink.Sender(name, shape=CHAOS_SHAPE, dtype="uint8", slots=4) as tx:
        ready.set()
        seq = 0
        while True:
            seq += 1
            arr = content(tx.generation, seq)
            if random.random() < 0.5:
                tx.send(arr, meta=checksum(arr))
            else:
                with tx.reserve(meta=checksum(arr)) as f:
                    np.from_dlpack(f)[...] = arr


def other_user_producer(name: str, ready: Any, stop: Any) -> None:
    os.setgid(65534)
    os.setuid(65534)
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
        tx.send(np.arange(4, dtype=np.uint8))
        ready.set()
        stop.wait(30)


def squat_segment(path: str) -> None:
    """Another user (uid 65533) makes an empty, world-writable file where a link of uid 65534 puts its header:
    anyone may write in /dev/shm."""
    os.setgid(65533)
    os.setuid(65533)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    os.fchmod(fd, 0o666)
    os.close(fd)


def victim_of_a_squat(name: str, out: Any) -> None:
    """As uid 65534: start a Sender on ``name``, clean it, wait for its producer; what each did goes to ``out``."""
    from cudalink.transport.shm import clean  # imported before the uid changes: root's files are not 65534's

    os.setgid(65534)
    os.setuid(65534)
    got = []
    for step in ("sender", "clean", "receiver"):
        try:
            if step == "sender":
                cudalink.Sender(name, shape=(4,), dtype="uint8").close()
            elif step == "clean":
                clean(only=[name])
            else:
                cudalink.Receiver(name, timeout=0.2).close()
            got.append((step, "ok", ""))
        except Exception as exc:
            got.append((step, type(exc).__name__, str(exc)))
    out.put(got)


def churn_consumer(name: str, seconds: float, seed: int) -> None:
    """Join, take frames, sometimes hold them, leave or die: over and over."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with cudalink.Receiver(name, timeout=5) as rx:
                held = []
                for _ in range(rng.randint(1, 20)):
                    f = rx.recv(timeout=2)
                    if rng.random() < 0.3:
                        held.append(f)  # keep a few leases
                    else:
                        f.release()
                if rng.random() < 0.2:
                    os._exit(0)  # die holding leases: no goodbye, no cleanup
                del held
        except cudalink.LinkError:
            time.sleep(0.01)


# -- a header that lies while frames flow (issue 32) ------------------------------------------------------

RECV_TIMEOUT = 0.5


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
