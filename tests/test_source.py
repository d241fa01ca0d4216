"""The Receiver facade over a mock frame source: its loops, timeouts and errors, with no process and no ring.

What users see (wait modes, recv/poll/recv_async/async for, LinkTimeout/ProducerGone, stats) is written once in
``Receiver``; a source only attaches and hands over frames. These tests drive the facade through
``transport.source``'s protocol alone, as httpx's tests drive its client through ``MockTransport``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque

import numpy as np
import pytest

import cudalink
from cudalink.frames.frame import Frame
from cudalink.transport import wire
from cudalink.transport.base import NoProducer
from cudalink.transport.source import account, copy_mode


class MockAttachment:
    """One generation of a fake producer: frames are queued by the test, wake-ups go through a socketpair."""

    backend = "mock"
    path = "zero-copy"
    capacity = 1 << 20
    floor = 0

    def __init__(self, generation: int, latest: bool) -> None:
        self.generation = generation
        self.latest = latest
        self.queue: deque[tuple[int, np.ndarray]] = deque()
        self.lock = threading.Lock()
        self.rsock, self.wsock = socket.socketpair()
        self.rsock.setblocking(False)
        self.shutdown = False
        self.dead = False
        self.waiting: list[int] = []
        self.detached = False
        self.counted = (0, 0)

    device = "cpu"

    def push(self, seq: int, array: np.ndarray) -> None:
        with self.lock:
            self.queue.append((seq, array))
        self.wsock.send(b"\x01")

    @staticmethod
    def receive(rx: cudalink.Receiver, att: MockAttachment) -> Frame | None:
        with att.lock:
            if not att.queue:
                return None
            if rx.latest:
                while len(att.queue) > 1:
                    att.queue.popleft()
            seq, array = att.queue.popleft()
        account(rx, seq)
        return Frame.from_array(array, seq=seq)

    @staticmethod
    def sleep_receive(
        rx: cudalink.Receiver, att: MockAttachment, timeout: float, waiting: int, after: int
    ) -> Frame | None:
        att.waiting.append(waiting)
        frame = MockAttachment.receive(rx, att)
        if frame is None:
            import select

            select.select([att.rsock], [], [], max(0.0, timeout))
        att.waiting.append(after)
        return frame if frame is not None else MockAttachment.receive(rx, att)

    def closing(self) -> bool:
        return self.shutdown

    def alive(self) -> bool:
        try:
            while self.rsock.recv(64):
                pass
        except BlockingIOError:
            pass
        return not self.dead

    def set_waiting(self, state: int) -> None:
        self.waiting.append(state)

    def count(self, received: int, skipped: int) -> None:
        self.counted = (received, skipped)

    def fileno(self) -> int:
        return self.rsock.fileno()

    async def wait_async(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(self.rsock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            loop.remove_reader(self.rsock.fileno())

    def detach(self) -> None:
        self.detached = True
        self.rsock.close()
        self.wsock.close()


class MockSource:
    """Attaches to the newest MockAttachment the test made; ``NoProducer`` while there is none."""

    name = "mock"

    def __init__(self, latest: bool = True) -> None:
        self.latest = latest
        self.current: MockAttachment | None = None
        self.attaches: list[tuple[float, int]] = []
        self.closed = False

    def start(self, generation: int) -> MockAttachment:
        self.current = MockAttachment(generation, self.latest)
        return self.current

    def attach(self, deadline: float, dead_generation: int) -> MockAttachment:
        self.attaches.append((deadline, dead_generation))
        att = self.current
        if att is None or att.generation == dead_generation:
            raise NoProducer("mock: nothing published")
        return att

    def close(self) -> None:
        self.closed = True


def _frame(value: int) -> np.ndarray:
    return np.full((4, 4), value, np.uint8)


@pytest.mark.parametrize("wait", ["spin", "hybrid", "block"])
def test_recv_takes_frames_through_the_source_in_every_wait_mode(wait: str) -> None:
    src = MockSource(latest=False)
    att = src.start(7)
    rx = cudalink.Receiver("ignored", source=src, wait=wait, timeout=2.0, latest=False)  # type: ignore[arg-type]
    assert rx.name == "mock" and rx.generation == 7 and rx.device == "cpu" and rx.backend == "mock"
    for seq in (1, 2, 3):
        att.push(seq, _frame(seq))
    got = [int(rx.recv().numpy()[0, 0]) for _ in range(3)]
    assert got == [1, 2, 3]
    threading.Timer(0.05, att.push, (4, _frame(4))).start()  # arrives while recv sleeps or spins
    assert rx.recv(timeout=2.0).seq == 4
    assert rx.stats() == {"received": 4, "skipped": 0, "reattached": 0, "reconnects": 0, "path": "zero-copy"}
    rx.close()
    assert att.detached and src.closed


@pytest.mark.parametrize("wait", ["spin", "hybrid"])
def test_a_source_landed_by_our_own_thread_is_slept_on_never_spun(wait: str) -> None:
    """A network source's frames are landed by a thread of this process: a recv() spinning with the GIL
    would starve it (on an H100 a spinning ucx:// consumer got its frames 2-18x later). ``spins = False``
    makes every wait mode sleep on the fd, with no spin after the wake-up either."""
    takes = 0

    class Landed(MockAttachment):
        spins = False

        @staticmethod
        def receive(rx: cudalink.Receiver, att: MockAttachment) -> Frame | None:
            nonlocal takes
            takes += 1
            return MockAttachment.receive(rx, att)

    src = MockSource()
    att = Landed(1, True)
    src.current = att
    rx = cudalink.Receiver("m", source=src, wait=wait, timeout=2.0)  # type: ignore[arg-type]
    for k in range(3):  # the first frames teach hybrid that they come within its spin
        att.push(k, _frame(k))
        assert rx.recv().seq == k
    takes = 0
    threading.Timer(0.1, att.push, (9, _frame(9))).start()
    assert rx.recv(timeout=2.0).seq == 9
    assert takes <= 4, f"recv() spun: {takes} takes while the frame was 100 ms away"
    assert wire.WAIT_ON in att.waiting or wire.WAIT_AHEAD in att.waiting  # it slept on the fd
    rx.close()


def test_latest_counts_the_frames_it_skips() -> None:
    src = MockSource(latest=True)
    att = src.start(1)
    rx = cudalink.Receiver("m", source=src, timeout=1.0)  # type: ignore[arg-type]
    for seq in range(1, 6):
        att.push(seq, _frame(seq))
    assert rx.recv().seq == 5
    assert rx.stats()["skipped"] == 4
    assert rx.poll() is None


def test_a_silent_source_times_out_on_time_and_a_missing_one_names_the_wait() -> None:
    src = MockSource()
    src.start(1)
    rx = cudalink.Receiver("m", source=src, wait="block", timeout=1.0)  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(cudalink.LinkTimeout):
        rx.recv(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 1.0
    empty = MockSource()
    t0 = time.monotonic()
    with pytest.raises(cudalink.LinkTimeout, match="mock: nothing published"):
        cudalink.Receiver("m", source=empty, timeout=0.2)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 1.0 and len(empty.attaches) > 1  # retried until the deadline


def test_shutdown_and_death_give_producer_gone_and_a_new_generation_is_attached() -> None:
    src = MockSource()
    first = src.start(1)
    rx = cudalink.Receiver("m", source=src, wait="block", timeout=1.0)  # type: ignore[arg-type]
    first.shutdown = True
    with pytest.raises(cudalink.ProducerGone):
        rx.recv(timeout=0.5)
    assert first.detached
    with pytest.raises(cudalink.ProducerGone):  # the dead generation is never attached again
        rx.recv(timeout=0.1)
    assert src.attaches[-1][1] == 1
    second = src.start(2)
    second.push(1, _frame(9))
    assert rx.recv(timeout=1.0).seq == 1 and rx.generation == 2
    assert rx.stats()["reattached"] == 1
    second.dead = True
    with pytest.raises(cudalink.ProducerGone):
        rx.recv(timeout=0.5)


def test_reconnects_a_source_made_are_counted_across_its_generations() -> None:
    """``stats()["reconnects"]`` sums the ``resumes`` of every attachment, the dropped ones included, and is 0
    for a source that never reconnects (no ``resumes``)."""
    src = MockSource()
    first = src.start(1)
    rx = cudalink.Receiver("m", source=src, wait="block", timeout=1.0)  # type: ignore[arg-type]
    assert rx.stats()["reconnects"] == 0
    first.resumes = 2  # type: ignore[attr-defined]
    assert rx.stats()["reconnects"] == 2
    first.dead = True
    with pytest.raises(cudalink.ProducerGone):
        rx.recv(timeout=0.5)
    assert rx.stats()["reconnects"] == 2  # the dropped attachment's count is kept
    second = src.start(2)
    second.resumes = 1  # type: ignore[attr-defined]
    second.push(1, _frame(1))
    assert rx.recv(timeout=1.0).seq == 1
    stats = rx.stats()
    assert stats["reconnects"] == 3 and stats["reattached"] == 1, stats
    rx._drop(second)  # a close() on another thread and the waiter it woke both leave the same attachment
    rx._drop(second)
    assert rx.stats()["reconnects"] == 3
    rx.close()
    assert rx.stats()["reconnects"] == 3


def test_producer_gone_says_what_the_source_knows_of_the_end() -> None:
    src = MockSource()
    att = src.start(1)
    rx = cudalink.Receiver("m", source=src, wait="block", timeout=1.0)  # type: ignore[arg-type]
    att.reason = "server error: sending frame 7 failed: UCXError: no transport"  # type: ignore[attr-defined]
    att.dead = True
    with pytest.raises(cudalink.ProducerGone, match=r"closed or died \(server error: sending frame 7 failed"):
        rx.recv(timeout=0.5)


def test_recv_async_and_async_for_wait_on_the_sources_fd() -> None:
    src = MockSource(latest=False)
    att = src.start(3)
    rx = cudalink.Receiver("m", source=src, timeout=2.0, latest=False)  # type: ignore[arg-type]

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        for seq in (1, 2):
            loop.call_later(0.02 * seq, att.push, seq, _frame(seq))
        got = [(await rx.recv_async()).seq]
        async for frame in rx:
            got.append(frame.seq)
            if frame.seq == 2:
                att.shutdown = True  # the loop ends on ProducerGone
        return got

    assert asyncio.run(main()) == [1, 2]
    assert wire.WAIT_AHEAD in att.waiting  # asleep, asking to be woken ahead as recv() does (WAIT_ON | 2)


def test_fileno_asks_the_source_for_every_wake_up() -> None:
    src = MockSource()
    att = src.start(1)
    rx = cudalink.Receiver("m", source=src)  # type: ignore[arg-type]
    assert rx.fileno() == att.fileno()
    assert att.waiting[-1] == wire.WAIT_ON


@pytest.mark.parametrize(
    ("given", "mode"), [(True, "always"), (False, "never"), ("auto", "auto"), ("never", "never"), ("always", "always")]
)
def test_copy_takes_words_and_booleans(given: object, mode: str) -> None:
    assert copy_mode(given) == mode


@pytest.mark.parametrize("bad", ["sometimes", 1, None])
def test_a_bad_copy_is_a_clear_error(bad: object) -> None:
    with pytest.raises(cudalink.LinkError, match="copy must be"):
        cudalink.Receiver("x", copy=bad, connect=False)  # type: ignore[arg-type]


def test_frames_older_than_the_floor_taken_first_leave_none_uncounted() -> None:
    """A latest=False Receiver joins at seq 27 (the floor) and first takes 24, 25, 26 still in the slots; the
    next it gets is 44: 27..43 went by, 17 skipped (the floor's own frame too), not 16."""

    class Rx:
        latest = False
        received = 0
        skipped = 0
        _last = 0
        _floor = 27

    rx = Rx()
    for seq in (24, 25, 26, 44):
        account(rx, seq)  # type: ignore[arg-type]
    assert (rx.received, rx.skipped) == (4, 44 - 24 + 1 - 4)
    late = Rx()  # a latest=True joiner whose first frame comes after the floor still counts from it
    account(late, 30)  # type: ignore[arg-type]
    assert late.skipped == 2
