"""A forked child (multiprocessing's default on Linux before 3.14, DataLoader and Pool workers) inherits copies
of every link's lock and sockets. Its copies must neither keep a killed parent looking alive to its peers nor
end, as they die, the leases the parent still holds: the child closes its copies and its links are closed."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import cudalink

from . import _procs
from .conftest import Spawned

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")


def _kill(pid: int) -> None:
    if pid > 1:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_consumers_forked_worker_neither_keeps_it_alive_nor_ends_its_leases(spawned: Spawned, control: str) -> None:
    name = f"fork-rx-{os.getpid()}-{control}"
    frame = np.zeros(8, np.uint8)
    with cudalink.Sender(name, shape=(8,), dtype="uint8", device="cpu", slots=2, policy="block", timeout=5.0) as tx:
        ready, dropped = spawned.event(), spawned.event()
        worker, closed_in_worker = spawned.ctx.Value("i", 0), spawned.ctx.Value("i", -1)
        consumer = spawned(_procs.forking_consumer, name, ready, dropped, worker, closed_in_worker, forever=True)
        end = time.monotonic() + 30
        while tx.stats()["consumers"] == 0:
            assert time.monotonic() < end and consumer.is_alive(), "the consumer never joined"
            time.sleep(0.01)
        tx.send(frame)
        tx.send(frame)
        try:
            assert ready.wait(30) and dropped.wait(30)
            assert closed_in_worker.value == 2, "the worker's copy of the Receiver is not closed, or not said why"
            # the worker's copies of both frames ended: the parent's leases must hold all the same
            with pytest.raises(cudalink.LinkTimeout):
                tx.send(frame, timeout=0.3)
            _kill(consumer.pid or 0)  # the worker lives on with its copies of the fds (of the process sentinel too:
            # join once the worker is gone)
            t0 = time.monotonic()
            tx.send(frame, timeout=5.0)
            assert time.monotonic() - t0 < 1.0
            assert tx.stats()["consumers"] == 0
        finally:
            _kill(worker.value)
            consumer.join(10)


def test_a_producers_forked_worker_does_not_keep_it_alive(spawned: Spawned, control: str) -> None:
    name = f"fork-tx-{os.getpid()}-{control}"
    worker, closed_in_worker = spawned.ctx.Value("i", 0), spawned.ctx.Value("i", -1)
    producer = spawned.ready(_procs.forking_producer, name, worker, closed_in_worker, forever=True)
    try:
        with cudalink.Receiver(name, timeout=10.0) as rx:
            with rx.recv(timeout=5.0) as f:
                assert f.numpy().tolist() == [5] * 8
            _kill(producer.pid or 0)
            t0 = time.monotonic()
            with pytest.raises(cudalink.ProducerGone):
                rx.recv(timeout=5.0)
            assert time.monotonic() - t0 < 1.0
        assert closed_in_worker.value == 2  # the worker's copy of the Sender is closed there, and says why
        with cudalink.Sender(name, shape=(8,), dtype="uint8", device="cpu"):  # the name is free again
            pass
    finally:
        _kill(worker.value)
        producer.join(10)


def test_a_worker_forked_while_threads_send_and_recv_is_refused_at_once(spawned: Spawned) -> None:
    # a send() waiting for a slot holds the Sender's lock, a recv() waiting for a frame marks its Receiver busy:
    # in a worker forked meanwhile the lock's owner and the waiter do not exist. Its send() and reconfigure()
    # waited for the lock forever, its recv() said another recv() was waiting
    result = spawned.queue()
    spawned(_procs.forking_while_busy, f"fork-busy-{os.getpid()}", result)
    said = result.get(timeout=60)
    assert said == {"send": "forked", "reconfigure": "forked", "recv": "forked"}, said
