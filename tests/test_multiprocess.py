"""The link across real spawned processes over the SharedMemory transport (issue 3's acceptance)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import cudalink
from cudalink.tools.monitor import read_snapshot

from . import _content, _procs
from .conftest import DEFAULT, SIGKILL, PairFactory, Spawned

pytestmark = pytest.mark.usefixtures("control")  # every test runs over the Unix and the TCP channel


def test_10000_checksummed_frames_to_3_consumers_and_a_slow_one(spawned: Spawned, name: str) -> None:
    go, result = spawned.event(), spawned.queue()
    shape = (24, 32, 4)
    prod = spawned.ready(_procs.host_producer, name, 10_000, shape, "uint8", 6, go=go, every=0.0001)
    consumers = [spawned(_procs.host_consumer, name, 10_000, result, 0.0, False) for _ in range(3)]
    consumers.append(spawned(_procs.host_consumer, name, 10_000, result, 0.002, True))  # holds frames
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # all 4 consumers joined, as a monitor sees it (read-only)
        if len(read_snapshot(name).consumers) >= 4:
            break
        time.sleep(0.02)
    go.set()
    outs = [result.get(timeout=120) for _ in consumers]
    prod.join(30)
    total = 0
    for pid, got, mism, tail, _skipped, ordered in outs:
        assert got > 0, (pid, tail)
        assert mism == 0, f"consumer {pid} saw {mism} torn/overwritten frames"
        assert ordered, f"consumer {pid} got frames out of order: {tail}"
        total += got
    fast = sorted(o[1] for o in outs)[1:]
    assert min(fast) >= 5_000, outs  # in-order consumers that keep up get most of the 10,000
    assert total >= 15_000


def test_producer_sigkill_raises_producer_gone_and_a_new_generation_is_picked_up(spawned: Spawned, name: str) -> None:
    prod = spawned.ready(_procs.host_producer_forever, name, (16, 16), "float32", forever=True)
    rx = cudalink.Receiver(name, timeout=10)
    first = rx.recv(2)
    old_gen = rx.generation
    held = np.from_dlpack(first)  # a frame of the dead generation, kept across the crash
    os.kill(prod.pid, SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(cudalink.ProducerGone):
        while True:
            rx.recv(timeout=5).release()
    assert time.monotonic() - t0 < 0.5, "ProducerGone took too long"
    prod.join(10)
    # leftovers of the dead producer must never be served: nothing attaches until a new producer starts,
    # and a new Receiver says so at once instead of waiting out its timeout (issue 32)
    with pytest.raises(cudalink.ProducerGone, match="died"):
        cudalink.Receiver(name, timeout=30)
    try:
        spawned.ready(_procs.host_producer_forever, name, (16, 16), "float32", forever=True)
        with cudalink.Receiver(name, timeout=10) as fresh:
            f = fresh.recv(2)
            assert fresh.generation != old_gen and f.generation == fresh.generation
            assert _content.stamp(np.from_dlpack(f), f.seq) == f.meta
        f2 = rx.recv(timeout=5)  # the old Receiver re-attaches to the new generation by itself
        assert rx.generation != old_gen and rx.reattached == 1
        assert _content.stamp(np.from_dlpack(f2), f2.seq) == f2.meta
        assert held.shape == (16, 16)  # the dead generation's frame stayed readable
    finally:
        rx.close()


def test_consumer_sigkill_with_a_lease_is_reclaimed(spawned: Spawned, pair: PairFactory) -> None:
    tx, rx = pair(DEFAULT, shape=(8,), dtype="uint8", slots=2)
    tx.send(np.zeros(8, np.uint8))
    # the victim holds one of the two slots; with `rx` holding the other, the ring is full
    victim = spawned.ready(_procs.hold_lease_forever, tx.name, forever=True)
    tx.send(np.ones(8, np.uint8))
    keep = rx.recv(1)
    assert keep.seq == 2  # `rx` joined before any frame: this frame is its first, the victim took seq 1
    assert tx.send(np.ones(8, np.uint8)) is None  # both slots held
    spawned.kill(victim)
    deadline = time.monotonic() + 1.0
    while tx.send(np.full(8, 3, np.uint8)) is None:
        assert time.monotonic() < deadline, "the dead consumer's lease was not reclaimed"
        time.sleep(0.005)
    assert np.from_dlpack(rx.recv(1))[0] == 3
    assert tx.stats()["consumers"] == 1
    keep.release()


@pytest.mark.skipif(not hasattr(os, "sysconf") or not os.path.isdir("/dev/shm"), reason="POSIX shared memory")
def test_a_consumer_writing_into_a_received_frame_faults_alone(spawned: Spawned, pair: PairFactory) -> None:
    """A received frame is read-only, but torch ignores DLPack's read-only flag: an in-place op on
    ``torch.from_dlpack(frame)`` wrote into the slot the producer and every other consumer read."""
    tx, rx = pair(DEFAULT, shape=(4096,), dtype="uint8", slots=2)
    tx.send(np.full(4096, 7, np.uint8))
    writer = spawned.ready(_procs.write_into_a_received_frame, tx.name)
    mine = rx.recv(1)  # the same frame, in the same slot
    writer.join(10)
    assert writer.exitcode == -signal.SIGSEGV, f"the writing consumer ended with {writer.exitcode}"
    assert (np.from_dlpack(mine) == 7).all(), "another consumer's write reached this consumer's frame"
    mine.release()
    for value in range(3):  # the producer goes on: the writer's lease came back, and its slots hold what it wrote
        assert tx.send(np.full(4096, value, np.uint8)) is not None
        with rx.recv(1) as frame:
            assert (np.from_dlpack(frame) == value).all()


def test_resolution_change_across_processes(spawned: Spawned, name: str) -> None:
    result = spawned.queue()
    with cudalink.Sender(name, shape=(4, 4, 4), dtype="uint8", capacity=16 * 16 * 4 * 4, slots=8) as tx:
        spawned(_procs.host_consumer, name, 0, result, 0.0, False)
        end = time.monotonic() + 30
        while tx.stats()["consumers"] < 1 and time.monotonic() < end:
            time.sleep(0.01)
        for seq in range(1, 4):
            a = _content.pattern(seq, (4, 4, 4), "uint8")
            tx.send(a, meta=_content.stamp(a, seq))
        tx.reconfigure(shape=(16, 16, 4), dtype="float32")
        for seq in range(4, 7):
            a = _content.pattern(seq, (16, 16, 4), "float32")
            tx.send(a, meta=_content.stamp(a, seq))
        time.sleep(0.5)
    _pid, got, mism, seqs, _skipped, ordered = result.get(timeout=30)
    assert (got, mism, ordered) == (6, 0, True), seqs


def test_stale_segment_is_replaced_not_served(spawned: Spawned, name: str, pair: PairFactory) -> None:
    spawned.kill(spawned.ready(_procs.host_producer_forever, name, (4,), "int32", forever=True))
    from cudalink import _platform

    prefix = _platform.segment_name(name)
    assert any(f.startswith(prefix) for f in os.listdir("/dev/shm"))  # leftovers are there...
    tx, rx = pair(DEFAULT, shape=(4,), dtype="int32")  # ...and are reused, not refused
    assert rx.generation == tx.generation
    tx.send(np.arange(4, dtype=np.int32))
    assert rx.recv(1).seq == 1


@pytest.mark.parametrize("latest", [True, False], ids=["latest", "in-order"])
def test_a_receiver_holding_every_slot_is_told_so_when_its_wait_times_out(
    spawned: Spawned, name: str, latest: bool
) -> None:
    """A consumer that keeps every frame it receives (``frames.append(rx.recv())``) soon holds all the producer's
    slots: no new frame can land (the producer drops them, or blocks), so its next ``recv()`` waits out its whole
    timeout. It was told only "no frame within 0.3s", as if the producer had stopped. The timeout now says that
    this Receiver holds every slot, and how to fix it; releasing one lets frames flow again."""
    spawned.ready(_procs.host_producer_forever, name, (4, 4), "uint8", forever=True)  # slots=4, a frame each 0.5 ms
    with cudalink.Receiver(name, timeout=5.0, latest=latest) as rx:
        held = [rx.recv(timeout=5.0) for _ in range(4)]
        with pytest.raises(cudalink.LinkTimeout) as info:
            rx.recv(timeout=0.3)
        message = str(info.value)
        assert message.startswith("cudalink: ") and "holds all 4" in message and "release" in message, message
        held.pop(0).release()
        with rx.recv(timeout=5.0) as frame:  # the slot given back carries a new frame
            assert frame.seq > max(f.seq for f in held)
        for frame in held:
            frame.release()
