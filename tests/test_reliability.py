"""Reliability and security (issue 7): crashes, restarts, churn, corrupt segments, other users.

The fast versions run in CI; ``nox -s soak`` runs the long ones (200 chaos cycles, 1,000,000 frames).
"""

from __future__ import annotations

import gc
import os
import queue
import random
import signal
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cudalink
from cudalink import _platform
from cudalink.transport import wire
from cudalink.transport.base import Peer
from cudalink.transport.shm import _open_segment, _unlink_segment

from . import _chaos, _content, _procs
from .conftest import DEFAULT, SIGKILL, PairFactory, Spawned, header_bytes


def _chaos_cycles(spawned: Spawned, name: str, cycles: int) -> dict[str, float]:
    rx = cudalink.Receiver(name, connect=False, timeout=30)
    gone_after: list[float] = []
    frames = 0
    generations = set()
    rng = random.Random(1234)
    try:
        for _ in range(cycles):
            prod = spawned.ready(_chaos.chaos_producer, name, forever=True)
            first = rx.recv(timeout=30)  # re-attaches to the new generation by itself
            assert rx.generation not in generations, "a dead generation was served again"
            generations.add(rx.generation)
            problem = _content.verify(first, rx.generation)
            assert problem is None, problem
            first.release()
            stop_at = time.monotonic() + rng.uniform(0.0, 0.05)
            while time.monotonic() < stop_at:  # kill at a random point of the producer's loop
                f = rx.recv(timeout=5)
                problem = _content.verify(f, rx.generation)
                assert problem is None, problem
                f.release()
                frames += 1
            os.kill(prod.pid, SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(cudalink.ProducerGone):
                while True:
                    f = rx.recv(timeout=5)  # frames already published stay valid until it notices
                    problem = _content.verify(f, rx.generation)
                    assert problem is None, problem
                    f.release()
            gone_after.append(time.monotonic() - t0)
            prod.join(10)
    finally:
        rx.close()
    return {"max_gone_s": max(gone_after), "frames": frames, "cycles": cycles}


def test_producer_kill_restart_chaos(spawned: Spawned, name: str, control: str) -> None:
    stats = _chaos_cycles(spawned, name, 15)
    assert stats["max_gone_s"] < 0.1, stats  # EOF on the control socket, not a timeout


@pytest.mark.slow
def test_producer_kill_restart_chaos_200(spawned: Spawned, name: str) -> None:
    stats = _chaos_cycles(spawned, name, 200)
    print("chaos:", stats)
    assert stats["max_gone_s"] < 0.1, stats


def _lease_cells(tx: cudalink.Sender) -> list[int]:
    buf = header_bytes(tx.name)  # as a monitor reads it; the layout comes from the header itself
    lay = wire.read_fixed(buf).layout
    return [wire.read_u64(buf, lay.lease(s, c)) for s in range(lay.nslots) for c in range(lay.nconsumers)]


def _churn(spawned: Spawned, name: str, seconds: float) -> None:
    with cudalink.Sender(name, shape=(64, 64), dtype="uint16", slots=4, max_consumers=16) as tx:
        procs = [spawned(_chaos.churn_consumer, name, seconds, i) for i in range(8)]
        accounted = []
        worst = 0.0
        end = time.monotonic() + seconds + 5
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            for _ in range(50):
                t0 = time.monotonic()
                tx.send(np.full((64, 64), tx.seq % 65535, np.uint16))
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.0005)
            st = tx.stats()
            accounted.append(st["published"] + st["dropped"])
        for p in procs:
            p.join(10)
        # the producer never stalled: every send returned at once and was published or counted as dropped,
        # however the consumers held, left or died
        assert len(accounted) > 5 and set(np.diff(accounted)) == {50}, accounted
        assert worst < 0.5, worst
        assert tx.stats()["published"] > 0
        deadline = time.monotonic() + 1.0
        while (tx.stats()["consumers"] or any(_lease_cells(tx))) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.stats()["consumers"] == 0
        assert not any(_lease_cells(tx)), "leases of departed consumers were not reclaimed"


def test_eight_consumers_join_leave_and_die_at_random(spawned: Spawned, name: str, control: str) -> None:
    _churn(spawned, name, 4.0)


@pytest.mark.slow
def test_consumer_churn_long(spawned: Spawned, name: str) -> None:
    _churn(spawned, name, 120.0)


@pytest.mark.skipif(not hasattr(signal, "SIGPIPE"), reason="SIGPIPE is POSIX's")
def test_a_killed_producer_never_kills_its_consumer_with_sigpipe(spawned: Spawned, name: str, control: str) -> None:
    """A consumer whose SIGPIPE is at its default action releases frames after its producer was killed while it
    waited for a slot: the release's note to that producer meets a dead socket, an EPIPE, never a SIGPIPE."""
    prod = spawned.ready(_procs.blocked_producer_forever, name, forever=True)
    go = spawned.event()
    consumer = spawned.ready(_procs.sigpipe_default_consumer, name, go=go)
    time.sleep(0.3)  # the producer waits in send() for one of the two slots the consumer holds
    spawned.kill(prod)
    go.set()
    consumer.join(30)
    assert consumer.exitcode == 0, f"the consumer ended with {consumer.exitcode} (-13: SIGPIPE) as its producer died"


@pytest.mark.skipif(not hasattr(signal, "SIGPIPE"), reason="SIGPIPE is POSIX's")
def test_a_consumer_gone_mid_stream_never_kills_its_producer_with_sigpipe(
    spawned: Spawned, name: str, control: str
) -> None:
    """A producer whose SIGPIPE is at its default action wakes a consumer whose end is already closed (it died, or
    closed, and the control thread has not taken it out yet): an EPIPE it ignores, never a SIGPIPE."""
    joined, held, left = spawned.event(), spawned.event(), spawned.event()
    prod = spawned.ready(_procs.sigpipe_default_producer, name, joined=joined, held=held, left=left)
    rx = cudalink.Receiver(name, timeout=10.0)
    rx.fileno()  # woken for every frame from now on
    joined.set()
    assert held.wait(30)
    rx.close()
    left.set()
    prod.join(30)
    assert prod.exitcode == 0, f"the producer ended with {prod.exitcode} (-13: SIGPIPE) as its consumer left"


def test_a_consumer_that_never_releases_gets_the_full_ring_policy(pair: PairFactory) -> None:
    tx, hog = pair(DEFAULT, shape=(8,), dtype="uint8", slots=3, policy="drop", rx={"latest": False})
    held = []
    for i in range(3):
        tx.send(np.full(8, i, np.uint8))
        held.append(hog.recv(1))
    for _ in range(5):
        assert tx.send(np.ones(8, np.uint8)) is None  # dropped, counted, never overwritten
    assert tx.stats()["dropped"] == 5
    assert [int(np.from_dlpack(f)[0]) for f in held] == [0, 1, 2]
    hog.close()  # leaving with frames held: the leases stay until the frames go
    del held
    gc.collect()
    assert tx.send(np.ones(8, np.uint8)) is not None


def _flat_resources(ctx: Any, name: str, cycles: int) -> tuple[int, int, int, int]:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def segs() -> int:
        return len([n for n in os.listdir("/dev/shm") if n.startswith(f"cudalink-{_platform.uid()}-{name}")])

    def settled(tx: cudalink.Sender) -> tuple[int, int]:
        """The counts once the producer's control thread has closed its end of the last Receiver's
        connection: that happens on its own thread, a moment after close() returns (CI's pure-Python pass
        read 32 then 31 fds, and 31 then 32, when a snapshot fell inside that moment)."""
        gc.collect()
        deadline = time.monotonic() + 2.0
        while tx.stats()["consumers"] and time.monotonic() < deadline:
            time.sleep(0.005)
        last = fds()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now, last = last, fds()
            if now == last:
                break
        return last, segs()

    with cudalink.Sender(name, shape=(32, 32), dtype="float32", slots=4) as tx:
        for i in range(cycles + 5):
            if i == 5:
                f0, s0 = settled(tx)
            rx = cudalink.Receiver(name, timeout=2)
            tx.send(np.zeros((32, 32), np.float32))
            f = rx.recv(1)
            _ = np.from_dlpack(f).sum()
            f.release()
            rx.close()
        f1, s1 = settled(tx)
        return f0, f1, s0, s1


def test_fds_and_segments_stay_flat(ctx: Any, name: str, control: str) -> None:
    f0, f1, s0, s1 = _flat_resources(ctx, name, 100)
    assert (f1, s1) == (f0, s0)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"cudalink-{_platform.uid()}-{name}")]


@pytest.mark.slow
def test_fds_segments_and_rss_flat_long(ctx: Any, name: str) -> None:
    import resource

    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    f0, f1, s0, s1 = _flat_resources(ctx, name, 5000)
    r1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("fds", f0, f1, "segments", s0, s1, "maxrss KiB", r0, r1)
    assert (f1, s1) == (f0, s0) and r1 - r0 < 50_000


@pytest.mark.slow
def test_torn_read_soak_one_million_frames(spawned: Spawned, name: str) -> None:
    go, result = spawned.event(), spawned.queue()
    n = 1_000_000
    prod = spawned.ready(_procs.host_producer, name, n, (8, 8, 4), "uint8", 4, go=go, every=0.0)
    spawned(_procs.host_consumer, name, n, result, 0.0005, True, 3600.0)  # slow
    spawned(_procs.host_consumer, name, n, result, 0.0, False, 3600.0)  # fast
    time.sleep(3)
    go.set()
    outs = [result.get(timeout=3600) for _ in range(2)]
    prod.join(60)
    print("soak:", [(o[1], o[2]) for o in outs])
    assert all(o[2] == 0 for o in outs), outs
    assert sum(o[1] for o in outs) >= n // 2


# -- security ----------------------------------------------------------------------------------------------


def test_other_uid_is_refused_at_the_handshake(spawned: Spawned, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping privileges in a child needs root")
    stop = spawned.event()
    spawned.ready(_chaos.other_user_producer, name, stop=stop)
    try:
        # root reaches another user's files; only the producer's SO_PEERCRED check can refuse it
        monkeypatch.setattr(_platform, "uid", lambda: 65534)
        with pytest.raises(cudalink.ProtocolError, match="private to the user"):
            cudalink.Receiver(name, timeout=2)
    finally:
        stop.set()


def test_handshake_rejects_a_foreign_uid_and_bad_hellos(name: str) -> None:
    from cudalink.link import _Handler

    with cudalink.Sender(name, shape=(4,)) as tx:
        h = _Handler(tx)
        good = wire.pack_hello(wire.Hello(tx.generation, 1, os.getpid()))
        assert not h.on_hello(1, good, Peer(os.getpid(), _platform.uid() + 1)).accepted
        assert not h.on_hello(2, b"garbage" * 4, Peer(os.getpid(), _platform.uid())).accepted
        stale = wire.pack_hello(wire.Hello(tx.generation ^ 1, 1, os.getpid()))
        assert not h.on_hello(3, stale, Peer(os.getpid(), _platform.uid())).accepted
        assert h.on_hello(4, good, Peer(os.getpid(), _platform.uid())).accepted


def test_garbage_on_the_control_socket_does_not_hurt_the_producer(name: str) -> None:
    import socket

    with cudalink.Sender(name, shape=(4,)) as tx:
        for junk in (b"", b"x", b"CLHI" + b"\xff" * 24, os.urandom(28), os.urandom(500)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(_platform.socket_path(name))
            s.sendall(junk)
            s.close()
        with cudalink.Receiver(name, timeout=2) as rx:
            tx.send(np.ones(4, np.uint8))
            assert rx.recv(1).seq == 1


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=0, max_size=4096))
def test_a_corrupt_segment_under_the_name_gives_a_clear_error(data: bytes) -> None:
    name = f"fz{os.getpid()}"
    seg_name = _platform.segment_name(name)
    _unlink_segment(seg_name)
    seg = _open_segment(seg_name, create=True, size=max(len(data), 1))
    try:
        assert seg.buf is not None
        seg.buf[: len(data)] = data
        with pytest.raises(cudalink.LinkError):
            cudalink.Receiver(name, timeout=0.05)
    finally:
        seg.close()
        _unlink_segment(seg_name)


def test_a_corrupted_live_header_is_refused_clearly(name: str) -> None:
    with cudalink.Sender(name, shape=(4,)) as tx:
        buf = tx._server.header
        saved = bytes(buf[:16])
        buf[8:10] = (99).to_bytes(2, "little")  # a future layout version
        with pytest.raises(cudalink.ProtocolError, match="version"):
            cudalink.Receiver(name, timeout=0.5)
        buf[:16] = saved
        with cudalink.Receiver(name, timeout=2) as rx:  # and the link is fine again
            tx.send(np.zeros(4, np.uint8))
            assert rx.recv(1).seq == 1


# -- a header that lies while frames flow (issue 32): no hang, no crash, only cudalink errors ----------


def _scribble_while_streaming(spawned: Spawned, name: str, seconds: float, seed: int) -> dict[str, int]:
    """A producer streams, a consumer ``recv(timeout=0.5)``s, this process writes random lies into the header.

    No recv may take longer than its timeout + 1 s, nothing may crash, and only cudalink errors may come out.
    (The consumer's recv in its own process: a take that spins holding the GIL could not be timed here.)
    """
    report = spawned.queue()
    spawned.ready(_chaos.streaming_producer, name, report, forever=True)
    beat = spawned.ctx.Value("d", 0.0)
    consumer = spawned.ready(_chaos.timed_consumer, name, seconds, beat, report)
    limit = _chaos.RECV_TIMEOUT + 1.0
    buf, seg = _chaos.header_of(name)
    try:
        rng = random.Random(seed)
        scribbler = _chaos.Scribbler(buf, wire.read_fixed(buf).layout, rng)
        end = time.monotonic() + seconds
        while consumer.is_alive():
            now = time.monotonic()
            if now < end:
                scribbler.step(now)
            elif now > end + 30:
                pytest.fail("the consumer did not finish")
            stalled = time.monotonic() - beat.value
            if stalled > limit:
                pytest.fail(f"recv() has not returned for {stalled:.2f} s (timeout {_chaos.RECV_TIMEOUT} s): a hang")
            time.sleep(rng.uniform(0.0, 0.004))
    finally:
        del buf
        seg.close()
    assert consumer.exitcode == 0, f"the consumer died with exit code {consumer.exitcode} (negative: a signal)"
    done = None
    errors = []
    while True:
        try:
            msg = report.get(timeout=1.0)
        except queue.Empty:
            break
        if msg[0] == "done":
            done = msg
        else:
            errors.append(msg)
    assert not errors, errors
    assert done is not None
    _, longest, outcomes = done
    assert longest <= limit, f"a recv() took {longest:.2f} s"
    assert set(outcomes) <= {"frame", "LinkTimeout", "ProtocolError", "ProducerGone"}, outcomes
    return outcomes  # type: ignore[no-any-return]


def test_scribbling_on_a_live_header_never_hangs_or_crashes(spawned: Spawned, name: str) -> None:
    outcomes = _scribble_while_streaming(spawned, name, 3.0, seed=int(time.time()))
    assert sum(outcomes.values()) > 0


@pytest.mark.slow
def test_scribbling_on_a_live_header_for_30_s(spawned: Spawned, name: str) -> None:
    outcomes = _scribble_while_streaming(spawned, name, 30.0, seed=int(time.time()))
    assert sum(outcomes.values()) > 30
