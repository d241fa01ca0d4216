"""Edges a user hits without meaning to: no time limit, a close() from another thread, a per-call timeout
that is not a number, a segment caught half made, a byte order the link does not carry."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import cudalink
from cudalink import _platform
from cudalink.transport import MemoryTransport, SharedMemoryTransport
from cudalink.transport.base import Transport
from cudalink.transport.shm import EmptySegment, _exists, _open_segment, _unlink_segment

from .conftest import DEFAULT, PairFactory, Spawned, close_while_waiting


@pytest.fixture(params=["memory", "shm"])
def transport(request: pytest.FixtureRequest) -> Transport:
    return MemoryTransport() if request.param == "memory" else SharedMemoryTransport()


def _later(delay: float, fn: Any, *args: Any) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn(*args)), daemon=True)
    t.start()
    return t


# -- no time limit -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["timeout=None", "recv(timeout=inf)", "recv(timeout=None)"])
def test_no_time_limit_attaches_and_waits_for_the_frame(name: str, how: str) -> None:
    """``timeout=None`` is "no limit": it attaches, and a recv waits for a frame sent later (it once failed
    with OverflowError at attach, where the handshake's socket timeout became infinite)."""
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
        if how == "timeout=None":
            rx = cudalink.Receiver(name, timeout=None)
            call = rx.recv
        elif how == "recv(timeout=inf)":
            rx = cudalink.Receiver(name, connect=False)
            call = functools.partial(rx.recv, timeout=math.inf)
        else:  # None on one call is no limit too, whatever the Receiver's own timeout
            rx = cudalink.Receiver(name, timeout=0.05)
            call = functools.partial(rx.recv, timeout=None)
        with rx:
            _later(0.3, tx.send, np.full(4, 7, np.uint8))
            frame = call()
            assert frame.numpy().tolist() == [7, 7, 7, 7]
            frame.release()


def test_recv_async_with_timeout_none_waits_past_the_receivers_timeout(name: str) -> None:
    async def main() -> list[int]:
        with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx, cudalink.Receiver(name, timeout=0.05) as rx:
            _later(0.3, tx.send, np.full(4, 5, np.uint8))
            frame = await rx.recv_async(timeout=None)
            with pytest.raises(cudalink.LinkTimeout):  # not given: the Receiver's own 0.05 s
                await rx.recv_async()
            return list(frame.numpy().tolist())

    assert asyncio.run(main()) == [5] * 4


def test_no_time_limit_async(name: str) -> None:
    async def main() -> list[int]:
        with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
            rx = cudalink.Receiver(name, timeout=None, connect=False)
            _later(0.3, tx.send, np.full(4, 3, np.uint8))
            async for frame in rx:
                got = frame.numpy().tolist()
                frame.release()
                rx.close()
                return list(got)
        return []

    assert asyncio.run(main()) == [3, 3, 3, 3]


# -- close() from another thread -------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", ["block", "hybrid", "spin"])
def test_close_from_another_thread_wakes_a_waiting_recv(pair: PairFactory, transport: Transport, wait: str) -> None:
    tx, rx = pair(transport, rx={"wait": wait, "timeout": 30.0})
    got = close_while_waiting(rx)
    assert not got["stuck"], "recv() still waiting after close()"
    assert isinstance(got.get("error"), cudalink.LinkClosed), got
    assert "closed" in str(got["error"])
    assert got["took"] < 3.0
    deadline = time.monotonic() + 3.0  # it left the link: the producer sees it go
    while tx.stats()["consumers"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.stats()["consumers"] == 0
    with pytest.raises(cudalink.LinkClosed):
        rx.recv(timeout=0.1)
    tx.send(np.ones((4, 4), np.uint16))  # the producer goes on


def test_close_from_another_thread_ends_a_for_loop_and_keeps_held_frames(name: str) -> None:
    """A frame held when close() ends the loop stays valid (its slot is not reused under it) until released."""
    with cudalink.Sender(name, shape=(4,), dtype="uint8", slots=2) as tx:
        rx = cudalink.Receiver(name, timeout=30.0)
        tx.send(np.full(4, 5, np.uint8))
        held: list[cudalink.Frame] = []

        def worker() -> None:
            for frame in rx:
                held.append(frame)

        t = threading.Thread(target=worker, daemon=True)
        t.start()
        deadline = time.monotonic() + 5
        while not held and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # asleep again, waiting for the second frame
        rx.close()
        t.join(5.0)
        assert not t.is_alive(), "the for loop did not end with close()"
        assert len(held) == 1
        for i in range(4):  # the producer goes on; two slots, one held: the held one is never written
            tx.send(np.full(4, 10 + i, np.uint8))
        assert held[0].numpy().tolist() == [5, 5, 5, 5]
        held[0].release()


def test_close_from_another_task_ends_an_async_for(name: str) -> None:
    async def main() -> str:
        with cudalink.Sender(name, shape=(4,), dtype="uint8"):
            rx = cudalink.Receiver(name, timeout=30.0)

            async def consume() -> str:
                async for frame in rx:
                    frame.release()
                return "ended"

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.3)
            rx.close()
            return await asyncio.wait_for(task, 5.0)

    assert asyncio.run(main()) == "ended"


def test_closing_a_sender_ends_a_send_waiting_for_a_slot(name: str) -> None:
    """policy='block', no time limit, every slot held: close() from another thread ends the waiting send with
    LinkClosed (it held the lock close() needs, and close() hung)."""
    tx = cudalink.Sender(name, shape=(4,), dtype="uint8", slots=1, policy="block", timeout=None)
    rx = cudalink.Receiver(name, timeout=2.0)
    tx.send(np.zeros(4, np.uint8))
    held = rx.recv()
    got: dict[str, object] = {}

    def sender() -> None:
        try:
            got["seq"] = tx.send(np.ones(4, np.uint8))
        except cudalink.LinkError as exc:
            got["error"] = exc

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # waiting for the slot, as asked
    closer = threading.Thread(target=tx.close, kwargs={"timeout": 0.5}, daemon=True)
    closer.start()
    closer.join(5.0)
    t.join(5.0)
    assert not closer.is_alive(), "close() hung behind the waiting send"
    assert isinstance(got.get("error"), cudalink.LinkClosed), got
    held.release()
    rx.close()


# -- per-call timeouts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "kind"),
    [("0.1", cudalink.ArgumentTypeError), (math.nan, cudalink.ArgumentError), (-1, cudalink.ArgumentError)],
)
def test_per_call_timeouts_are_checked(pair: PairFactory, bad: object, kind: type[Exception]) -> None:
    tx, rx = pair(slots=1, policy="block", rx={"timeout": 1.0})
    calls = {
        "recv": lambda: rx.recv(timeout=bad),
        "recv_async": lambda: asyncio.run(rx.recv_async(timeout=bad)),
        "send": lambda: tx.send(np.zeros((4, 4), np.uint16), timeout=bad),
        "reserve": lambda: tx.reserve(timeout=bad),
    }
    for what, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(kind, match=r"^cudalink: timeout must be") as info:
            call()
        assert time.monotonic() - t0 < 1.0, what  # refused at once, not after waiting
        assert "timeout=1.0" in str(info.value), what
    assert tx.seq == 0  # nothing was sent


def test_good_per_call_timeouts_still_work(pair: PairFactory) -> None:
    tx, rx = pair(rx={"timeout": 1.0})
    for t in (0, 0.05, 1, np.float32(0.05)):
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=t)  # type: ignore[arg-type]
    tx.send(np.zeros((4, 4), np.uint16), timeout=1)
    rx.recv(timeout=1).release()


# -- the end of a stream, by every way in -------------------------------------------------------------------------


def _gone_receiver(name: str) -> cudalink.Receiver:
    tx = cudalink.Sender(name, shape=(4,), dtype="uint8")
    rx = cudalink.Receiver(name, timeout=1.0)
    tx.close()
    with pytest.raises(cudalink.ProducerGone):
        rx.recv(timeout=1.0)
    return rx


def test_after_producer_gone_recv_async_agrees_with_recv(name: str) -> None:
    rx = _gone_receiver(name)
    with pytest.raises(cudalink.ProducerGone):
        rx.recv(timeout=0.2)
    with pytest.raises(cudalink.ProducerGone):
        asyncio.run(rx.recv_async(timeout=0.2))
    rx.close()


@pytest.mark.parametrize("how", ["recv", "recv_async", "poll"])
def test_a_restart_is_counted_however_it_is_picked_up(name: str, how: str) -> None:
    rx = _gone_receiver(name)
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
        tx.send(np.ones(4, np.uint8))
        if how == "recv":
            frame = rx.recv(timeout=1.0)
        elif how == "recv_async":
            frame = asyncio.run(rx.recv_async(timeout=1.0))
        else:
            frame = rx.poll()
        assert frame is not None and frame.seq == 1
        assert rx.stats()["reattached"] == 1
        frame.release()
        rx.close()


# -- a segment caught half made ------------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm is Linux's")
def test_an_empty_segment_is_not_there_yet(name: str) -> None:
    """A 0-byte segment (``shm_open`` done, ``ftruncate`` not yet, or its maker died between): a Receiver
    waits for it as for a missing one, and says so when its time is up; ``clean`` removes it."""
    seg = _platform.segment_name(name)
    path = f"/dev/shm/{seg}"
    open(path, "wb").close()
    try:
        with pytest.raises(EmptySegment):
            _open_segment(seg)
        assert _exists(seg)
        with pytest.raises(cudalink.LinkError, match="is empty"):
            cudalink.Receiver(f"cuda-link:{seg}", timeout=0.3)
        _unlink_segment(seg)
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


# -- messages that name the fix -------------------------------------------------------------------------------------


def test_a_byte_order_mismatch_says_so(pair: PairFactory) -> None:
    tx, _rx = pair(transport=DEFAULT, shape=(2, 3), dtype="uint16")
    other = "<u2" if sys.byteorder == "big" else ">u2"
    with pytest.raises(cudalink.FormatError, match=r"endian.*newbyteorder") as info:
        tx.send(np.zeros((2, 3), other))
    assert "reconfigure" not in str(info.value)
    assert tx.seq == 0


def test_fileno_before_attaching_names_the_fix(name: str) -> None:
    rx = cudalink.Receiver(name, connect=False)
    with pytest.raises(cudalink.LinkError, match=r"poll\(\) or recv\(\) first"):
        rx.fileno()
    rx.close()
    with pytest.raises(cudalink.LinkClosed):
        rx.fileno()


def test_close_from_another_thread_ends_a_recv_waiting_for_a_producer(name: str) -> None:
    rx = cudalink.Receiver(name, timeout=30.0, connect=False)
    got = close_while_waiting(rx, join=3.0)  # no producer: it waits for one
    assert not got["stuck"], "recv() still waiting for a producer after close()"
    assert isinstance(got.get("error"), cudalink.LinkClosed), got


def test_a_shutdown_byte_instead_of_a_welcome_means_the_producer_is_going(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer closing while we join wakes every connection, ours too: its shutdown byte arrives where the
    WELCOME would. That is a producer going (wait for the next), not a ProtocolError."""
    from cudalink.transport import memory

    tr = MemoryTransport()
    with cudalink.Sender(name, shape=(4,), dtype="uint8", transport=tr):
        real = memory._MemoryClient.handshake
        calls = []

        def closing(self: Any, hello: bytes, size: int, timeout: float) -> tuple[bytes, list[int]]:
            calls.append(1)
            if len(calls) == 1:
                return b"\x00", []
            return real(self, hello, size, timeout)

        monkeypatch.setattr(memory._MemoryClient, "handshake", closing)
        with cudalink.Receiver(name, transport=tr, timeout=2.0) as rx:  # the next attempt attaches
            assert rx.generation
        assert len(calls) == 2


# -- asyncio: one waiter, cancellation -------------------------------------------------------------------------------


def test_a_second_waiter_on_one_receiver_is_refused(pair: PairFactory) -> None:
    """Two tasks awaiting one Receiver each replaced the other's reader on the loop: one got nothing."""
    tx, rx = pair(rx={"timeout": 5.0})

    async def main() -> tuple[object, object]:
        first = asyncio.ensure_future(rx.recv_async(timeout=2.0))
        await asyncio.sleep(0.1)
        try:
            await rx.recv_async(timeout=0.1)
            second: object = None
        except cudalink.LinkError as exc:
            second = exc
        tx.send(np.ones((4, 4), np.uint16))
        got = await first
        return second, got

    second, got = asyncio.run(main())
    assert isinstance(second, cudalink.LinkError) and "one waiter at a time" in str(second)
    assert isinstance(got, cudalink.Frame)
    got.release()
    # the first waiter's end freed the place: a next call works
    tx.send(np.ones((4, 4), np.uint16))
    rx.recv(timeout=1.0).release()


def test_a_cancelled_first_recv_async_never_joins_a_closed_receiver(name: str) -> None:
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:

        async def main() -> None:
            rx = cudalink.Receiver(name, timeout=5.0, connect=False)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rx.recv_async(), 0.0001)  # cancelled while its attach runs in a thread
            rx.close()

        asyncio.run(main())
        deadline = time.monotonic() + 3.0
        while tx.stats()["consumers"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.stats()["consumers"] == 0
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.0  # close() had no consumer to wait out


def test_a_cancelled_send_async_sends_nothing_and_lets_the_sender_go(name: str) -> None:
    """It went on waiting in its thread, holding the Sender's lock, and sent the frame later."""
    tx = cudalink.Sender(name, shape=(4,), dtype="uint8", slots=1, policy="block", timeout=None)
    rx = cudalink.Receiver(name, timeout=2.0, latest=False)
    tx.send(np.zeros(4, np.uint8))
    held = rx.recv()

    async def main() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(tx.send_async(np.full(4, 7, np.uint8)), 0.2)
        t0 = time.monotonic()
        with pytest.raises(cudalink.LinkTimeout):
            tx.send(np.full(4, 8, np.uint8), timeout=0)  # the lock is free: refused at once, not after seconds
        assert time.monotonic() - t0 < 0.5

    asyncio.run(main())
    held.release()
    time.sleep(0.2)
    assert tx.seq == 1  # the cancelled frame was never sent
    with pytest.raises(cudalink.LinkTimeout):
        rx.recv(timeout=0.2)
    rx.close()
    tx.close()


# -- frames: what the spec and the exports promise -------------------------------------------------------------------


def test_strides_count_toward_the_frame_limit() -> None:
    """Only the elements were counted: a stride of 2**70 passed, to fail later in struct.pack or ftruncate."""
    from cudalink.frames.spec import FrameSpec

    for strides in [(2**70,), (2**41,)]:
        with pytest.raises(cudalink.FormatError, match="frame limit"):
            FrameSpec((2,), "uint8", strides)
    with pytest.raises(cudalink.FormatError, match="frame limit"):
        cudalink.Sender("edge-huge-stride", shape=(2, 2), dtype="uint8", strides=(2**62, 1))
    assert FrameSpec((2,), "uint8", (2**20,)).nbytes == 2**20 + 1  # a large but possible pitch still passes


@pytest.mark.parametrize(
    ("fmt", "dtype", "ok"),
    [
        ("RGBA8", "uint8", True),
        ("RGBA32F", "float32", True),
        ("RGBA", "float32", True),
        ("rgba16f", "float16", True),
        ("RGBA32F", "uint8", False),
        ("BGRA8", "float32", False),
        ("RGBA16", "float16", False),
    ],
)
def test_a_pixel_formats_depth_must_match_the_dtype(fmt: str, dtype: str, ok: bool) -> None:
    """The suffix was dropped: RGBA32F on uint8 frames reached consumers as RGBA8."""
    from cudalink.frames.spec import FrameSpec

    if ok:
        assert FrameSpec((2, 2, 4), dtype, pixel_format=fmt).pixel_format is not None
    else:
        with pytest.raises(cudalink.FormatError, match=r"has the depth suffix .* but the frames are .*; use '"):
            FrameSpec((2, 2, 4), dtype, pixel_format=fmt)


def test_a_dlpack_0x_consumer_gets_a_legacy_capsule_from_every_cpu_frame(pair: PairFactory) -> None:
    """max_version=(0, x) is a consumer that knows no versioned capsule: the pure-Python path handed read-only
    frames to numpy, which refused them, where the compiled one gave a legacy capsule."""
    tx, rx = pair(shape=(2, 3), dtype="float32")
    tx.send(np.ones((2, 3), np.float32))
    ro = np.ones((2, 3), np.float32)
    ro.flags.writeable = False
    with rx.recv(timeout=1.0) as received:
        for frame in (received, cudalink.Frame.from_array(ro)):
            capsule = frame.__dlpack__(max_version=(0, 8))
            assert 'dltensor"' in repr(capsule) and "versioned" not in repr(capsule), repr(capsule)
            versioned = frame.__dlpack__(max_version=(1, 0))
            assert "dltensor_versioned" in repr(versioned)


def test_asarray_without_a_copy_cannot_change_the_dtype(pair: PairFactory) -> None:
    tx, rx = pair(shape=(2, 3), dtype="float32")
    tx.send(np.ones((2, 3), np.float32))
    with rx.recv(timeout=1.0) as frame:
        with pytest.raises(ValueError, match="without a copy"):
            np.asarray(frame, dtype=np.float64, copy=False)
        assert np.shares_memory(np.asarray(frame, copy=False), frame.numpy())
        assert np.asarray(frame, dtype=np.float64).dtype == np.float64


# -- close() and the ways a waiter can be parked ------------------------------------------------------------------


def test_close_wakes_a_recv_async_on_a_landing_attachment(name: str) -> None:
    """A Receiver that copies each frame into memory of its own (another GPU, copy="always") waits through a
    wrapping attachment: close() must reach the attachment inside it (the GPU is faked: FakeOps)."""
    from cudalink.cuda.landing import Landing
    from cudalink.transport import ring_source
    from cudalink.transport.landed import LandedAttachment

    from .test_landing import FakeOps

    with cudalink.Sender(name, shape=(4, 4), dtype="uint8") as tx:

        class Src:
            def __init__(self) -> None:
                self.inner = ring_source.RingSource(name, SharedMemoryTransport())
                self.name = name

            def attach(self, deadline: float, gen: int) -> LandedAttachment:
                pool = Landing(1, 1024, limit=3, ops=FakeOps())
                return LandedAttachment(self.inner.attach(deadline, gen), 0, 1, buffers=3, pool=pool)

            def close(self) -> None:
                self.inner.close()

        async def main() -> object:
            rx = cudalink.Receiver(name, source=Src(), timeout=1000.0)  # type: ignore[arg-type]
            rx.poll()
            task = asyncio.ensure_future(rx.recv_async())
            await asyncio.sleep(0.3)
            rx.close()
            done, _ = await asyncio.wait([task], timeout=3.0)
            assert done, "recv_async still waiting 3 s after close()"
            return task.exception()

        assert isinstance(asyncio.run(main()), cudalink.LinkClosed)
        deadline = time.monotonic() + 3.0
        while tx.stats()["consumers"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.stats()["consumers"] == 0


def test_close_leaves_at_once_when_the_waiting_task_s_loop_has_stopped(name: str) -> None:
    """A recv_async() task left pending on a loop that no longer runs reads nothing: close() leaves now (it
    waited for that task, and the producer's close then waited out its 2 s for this consumer)."""
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
        rx = cudalink.Receiver(name, timeout=30.0)
        loop = asyncio.new_event_loop()
        task = loop.create_task(rx.recv_async())
        loop.run_until_complete(asyncio.sleep(0.1))  # the loop stops; the task stays pending
        rx.close()
        deadline = time.monotonic() + 3.0
        while tx.stats()["consumers"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.stats()["consumers"] == 0
        task.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(task)
        loop.close()


def test_poll_after_the_producer_went_still_says_nothing_now(name: str) -> None:
    """poll() is "a frame now, or nothing": after a death with no new producer it raises LinkTimeout, as it
    always did (a Script TOP's retry backoff keys on it), while recv() ends the stream with ProducerGone."""
    rx = _gone_receiver(name)
    for _ in range(3):
        with pytest.raises(cudalink.LinkTimeout):
            rx.poll()
    with pytest.raises(cudalink.ProducerGone):
        rx.recv(timeout=0.1)
    rx.close()


def test_a_send_async_cancelled_while_it_waits_for_the_lock_sends_nothing(name: str) -> None:
    tx = cudalink.Sender(name, shape=(4,), dtype="uint8", slots=2, policy="block", timeout=5.0)
    rx = cudalink.Receiver(name, latest=False, timeout=2.0)
    held = []
    for v in range(2):
        tx.send(np.full(4, v, np.uint8))
        held.append(rx.recv())

    async def main() -> list[int]:
        a = asyncio.ensure_future(tx.send_async(np.full(4, 10, np.uint8)))  # waits for a slot
        await asyncio.sleep(0.2)
        b = asyncio.ensure_future(tx.send_async(np.full(4, 20, np.uint8)))  # waits for the Sender's lock
        await asyncio.sleep(0.2)
        b.cancel()
        a.cancel()
        await asyncio.gather(a, b, return_exceptions=True)
        for f in held:
            f.release()
        await asyncio.sleep(0.5)
        got = []
        while (f := rx.poll()) is not None:
            got.append(int(f.numpy()[0]))
            f.release()
        return got

    assert asyncio.run(main()) == []
    assert tx.seq == 2
    rx.close()
    tx.close()


@pytest.mark.parametrize("wait", ["block", "spin"])
@pytest.mark.parametrize("latest", [False, True])
def test_frames_published_right_before_a_clean_close_are_all_received(wait: str, latest: bool) -> None:
    """recv() found nothing, then the producer published its last frames and closed before recv() looked at
    the shutdown flag: those frames are still delivered (the flag comes after them), and only then does the
    stream end. ``latest=True`` gets the newest of them."""
    import threading

    name = f"edge-endrace-{os.getpid()}-{wait}-{latest}"
    tx = cudalink.Sender(name, shape=(4,), dtype="uint8", slots=8, device="cpu")
    rx = cudalink.Receiver(name, latest=latest, timeout=2.0, wait=wait)  # type: ignore[arg-type]
    att = rx._att
    assert att is not None
    real_closing, real_alive = att.closing, att.alive
    once: list[int] = []

    def between() -> None:  # runs where recv() has just found nothing
        if not once:
            once.append(1)
            for i in (1, 2, 3):
                tx.send(np.full(4, i, np.uint8))
            closer = threading.Thread(target=tx.close, daemon=True)
            closer.start()
            while not real_closing():
                time.sleep(0.001)

    def closing() -> bool:
        between()
        return real_closing()

    def alive() -> bool:
        between()
        return real_alive()

    att.closing, att.alive = closing, alive  # type: ignore[method-assign]
    got = []
    try:
        for f in rx:  # ends when the producer closes the link
            got.append(f.seq)
            f.release()
    finally:
        rx.close()
        tx.close()
    assert got == ([1, 2, 3] if not latest else [3]), got


def test_a_frame_published_as_close_ends_the_wait_is_not_handed_out() -> None:
    """close() on another thread makes the wait see the end (its interrupt reads as a hang-up); the one more
    take that follows a producer's end must not hand out a frame once close() has run."""
    import threading

    name = f"edge-final-close-{os.getpid()}"
    with cudalink.Sender(name, shape=(4,), dtype="uint8", device="cpu", slots=4) as tx:
        rx = cudalink.Receiver(name, timeout=2.0, wait="block")
        att = rx._att
        assert att is not None
        real_alive = att.alive
        calls: list[int] = []

        def alive() -> bool:
            calls.append(1)
            if len(calls) == 1:  # the frame lands and close() runs, between recv()'s checks
                tx.send(np.full(4, 9, np.uint8))
                closer = threading.Thread(target=rx.close)
                closer.start()
                closer.join()
            return real_alive()

        att.alive = alive  # type: ignore[method-assign]
        with pytest.raises(cudalink.LinkClosed):
            rx.recv()
        assert rx.closed


def test_close_ends_a_recv_that_waits_on_a_hung_producers_handshake(spawned: Spawned, name: str) -> None:
    """A producer that hangs (stopped) mid-admission: close() on another thread ends the waiting recv() at once
    with LinkClosed, not after the handshake's own 5 s."""
    import signal

    from . import _procs

    producer = spawned.ready(_procs.host_producer_forever, name, (16,), "uint8", forever=True)
    assert producer.pid is not None
    os.kill(producer.pid, signal.SIGSTOP)
    try:
        rx = cudalink.Receiver(name, timeout=None, connect=False)
        ended: list[float] = []
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                rx.recv()
            except BaseException as exc:  # what ended it is the point
                errors.append(exc)
            ended.append(time.monotonic())

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.3)  # in the handshake by now
        closed_at = time.monotonic()
        rx.close()
        t.join(10)
        assert errors and isinstance(errors[0], cudalink.LinkClosed), errors
        assert ended[0] - closed_at < 2.0, ended[0] - closed_at
    finally:
        os.kill(producer.pid, signal.SIGCONT)


def test_a_receiver_says_what_it_is_and_reserve_on_a_closed_sender_refuses_at_once(name: str) -> None:
    rx = cudalink.Receiver(name, connect=False, latest=False)
    assert repr(rx) == f"<cudalink.Receiver {name!r} in order not attached received=0>"
    with cudalink.Sender(name, shape=(2,), dtype="uint8", device="cpu") as tx, rx:
        tx.send(np.zeros(2, np.uint8))
        rx.recv(timeout=2).release()
        assert repr(rx) == f"<cudalink.Receiver {name!r} in order host cpu received=1>"
    assert "closed" in repr(rx)
    with pytest.raises(cudalink.LinkClosed):
        tx.reserve()  # it returned a block that refused only when entered
