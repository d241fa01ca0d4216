"""asyncio consumers (issue 5): ``async for``, cancellation, ProducerGone, and idle CPU near zero."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from multiprocessing.process import BaseProcess

import numpy as np
import pytest

import cudalink
from cudalink.tools.monitor import read_snapshot

from . import _async_procs as ap
from .conftest import SIGKILL, PairFactory, Spawned


def test_async_for_gets_every_frame_in_order_across_processes(spawned: Spawned, name: str, control: str) -> None:
    start, result = spawned.event(), spawned.queue()
    spawned.ready(ap.paced_producer, name, 200, 0.002, start=start)
    cons = [spawned(ap.async_consumer, name, result, 3) for _ in range(2)]
    end = time.monotonic() + 30
    while time.monotonic() < end:  # all 6 async consumers joined, as a monitor sees it (read-only)
        if len(read_snapshot(name).consumers) >= 6:
            break
        time.sleep(0.02)
    start.set()
    outs = [result.get(timeout=60) for _ in cons]
    for _pid, lists in outs:
        assert len(lists) == 3
        for got in lists:
            assert got == list(range(1, 201)), got[:10]


def test_cancelled_wait_loses_nothing_and_leaks_no_lease(pair: PairFactory) -> None:
    tx, rx = pair(shape=(2,), dtype="int32", slots=2, rx={"latest": False})

    async def main() -> None:
        with tx, rx:
            for _ in range(20):
                task = asyncio.create_task(rx.recv_async(timeout=5))
                await asyncio.sleep(0.001)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            tx.send(np.array([1, 1], np.int32))
            tx.send(np.array([2, 2], np.int32))
            a = await rx.recv_async(timeout=1)
            b = await rx.recv_async(timeout=1)
            assert [int(np.from_dlpack(a)[0]), int(np.from_dlpack(b)[0])] == [1, 2]
            a.release()
            b.release()
            gc.collect()
            # both slots must be free again: no lease was leaked by the cancelled waits
            assert tx.send(np.array([3, 3], np.int32)) is not None
            assert tx.send(np.array([4, 4], np.int32)) is not None

    asyncio.run(main())


def test_cancel_races_with_a_publish(pair: PairFactory) -> None:
    """Cancel at the moment a frame lands: the frame is delivered by the next call, never lost."""
    tx, rx = pair(shape=(1,), dtype="int64", slots=4, rx={"latest": False})

    async def main() -> None:
        with tx, rx:
            seen = []
            for i in range(1, 51):
                task = asyncio.create_task(rx.recv_async(timeout=5))
                await asyncio.sleep(0)
                tx.send(np.array([i], np.int64))
                task.cancel()
                try:
                    f = await task
                    seen.append(int(np.from_dlpack(f)[0]))
                    f.release()
                except asyncio.CancelledError:
                    f = await rx.recv_async(timeout=1)
                    seen.append(int(np.from_dlpack(f)[0]))
                    f.release()
            assert seen == list(range(1, 51))

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["async for", "for"])
def test_a_killed_producer_raises_out_of_the_loop_and_a_closed_one_ends_it(
    spawned: Spawned, name: str, loop: str
) -> None:
    """``for``/``async for`` end quietly at the producer's clean close; its death is an error, not the stream's
    end: both loops ended as quietly, so a consumer could not tell a crash from a finished stream."""

    def run(rx: cudalink.Receiver, kill: BaseProcess | None) -> int:
        got = 0

        async def take() -> None:
            nonlocal got
            async for frame in rx:
                frame.release()
                got += 1
                if kill is not None:
                    os.kill(kill.pid, SIGKILL)

        if loop == "async for":
            asyncio.run(take())
        else:
            for frame in rx:
                frame.release()
                got += 1
                if kill is not None:
                    os.kill(kill.pid, SIGKILL)
        return got

    stop = spawned.event()
    prod = spawned.ready(ap.idle_producer, name, stop=stop)
    with cudalink.Receiver(name, timeout=5) as rx:
        stop.set()  # it closes the link after its one frame
        assert run(rx, None) == 1
        prod.join(10)
    prod = spawned.ready(ap.idle_producer, name, stop=spawned.event(), forever=True)  # killed in the loop
    with cudalink.Receiver(name, timeout=5) as rx, pytest.raises(cudalink.ProducerGone) as gone:
        run(rx, prod)
    assert not gone.value.closed


def test_producer_gone_surfaces_inside_the_loop(spawned: Spawned, name: str, control: str) -> None:
    prod = spawned.ready(ap.idle_producer, name, stop=spawned.event(), forever=True)  # killed below

    async def main() -> float:
        with cudalink.Receiver(name, timeout=5) as rx:
            (await rx.recv_async(timeout=5)).release()
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, os.kill, prod.pid, SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(cudalink.ProducerGone):
                await rx.recv_async(timeout=10)
            return time.monotonic() - t0

    took = asyncio.run(main())
    prod.join(10)
    assert took < 1.0


def test_async_for_ends_when_the_producer_closes(pair: PairFactory) -> None:
    tx, rx = pair(shape=(1,), dtype="int8", rx={"latest": False, "timeout": 5.0})  # `async for` waits up to rx.timeout

    async def main() -> list[int]:
        got = []

        async def produce() -> None:
            for i in range(5):
                tx.send(np.array([i], np.int8))
                await asyncio.sleep(0.01)
            tx.close()

        prod = asyncio.create_task(produce())
        async for frame in rx:
            got.append(int(np.from_dlpack(frame)[0]))
            frame.release()
        await prod
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_idle_async_consumer_uses_almost_no_cpu(
    spawned: Spawned, name: str, control: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # numpy's OpenBLAS starts a worker thread at import that spins (yielding) for a while before it
    # sleeps: 0.02-0.06 s of this process's CPU in the window, none of it ours (0.0006 s without it)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stop, result = spawned.event(), spawned.queue()
    spawned.ready(ap.idle_producer, name, stop=stop)
    spawned(ap.idle_cpu, name, result, 2.0)
    cpu = result.get(timeout=30)
    stop.set()
    assert cpu < 0.05, f"an idle async consumer burned {cpu:.3f} s of CPU in 2 s"


def test_blocking_recv_is_a_kernel_wait_too(pair: PairFactory) -> None:
    tx, rx = pair(shape=(1,), dtype="uint8", rx={"wait": "hybrid"})
    with tx, rx:
        t0 = os.times()  # resource is POSIX only
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=1.0)
        t1 = os.times()
    cpu = (t1.user - t0.user) + (t1.system - t0.system)
    assert cpu < 0.05, f"recv(wait='hybrid') burned {cpu:.3f} s of CPU waiting 1 s"


@pytest.mark.parametrize("mode", ["spin", "block", "hybrid"])
def test_every_wait_mode_delivers(name: str, pair: PairFactory, mode: str) -> None:
    tx, rx = pair(shape=(1,), dtype="uint8", rx={"wait": mode})
    with tx, rx:
        import threading

        threading.Timer(0.05, lambda: tx.send(np.array([9], np.uint8))).start()
        assert int(np.from_dlpack(rx.recv(timeout=2))[0]) == 9
    with pytest.raises(cudalink.LinkError, match="wait must be"):
        cudalink.Receiver(name, wait="poll", connect=False)  # type: ignore[arg-type]


def test_recv_takes_a_wait_strategy_per_call(
    spawned: Spawned, name: str, control: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 5: "the sync recv() gets a wait strategy": ``recv(wait="block")`` on a spinning Receiver waits in
    the kernel (no CPU), ``recv(wait="spin")`` still delivers, a bad one is a cudalink ArgumentError. Before,
    ``recv(wait=...)`` was a TypeError: only ``Receiver(wait=...)`` chose it."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # see test_idle_async_consumer_uses_almost_no_cpu
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stop = spawned.event()
    spawned.ready(ap.idle_producer, name, stop=stop)
    try:
        with cudalink.Receiver(name, timeout=10.0, wait="spin") as rx:
            rx.recv(timeout=5.0, wait="spin").release()  # the producer's one frame
            t0 = os.times()
            with pytest.raises(cudalink.LinkTimeout):
                rx.recv(timeout=1.0, wait="block")
            t1 = os.times()
            cpu = (t1.user - t0.user) + (t1.system - t0.system)
            assert cpu < 0.05, f"recv(wait='block') on a Receiver(wait='spin') burned {cpu:.3f} s of CPU in 1 s"
            assert rx.wait_mode == "spin"  # the call's choice is the call's only
            with pytest.raises(cudalink.ArgumentError, match=r"^cudalink: wait must be one of"):
                rx.recv(timeout=0.1, wait="poll")  # type: ignore[arg-type]
    finally:
        stop.set()


def test_uvloop_if_available(pair: PairFactory) -> None:
    uvloop = pytest.importorskip("uvloop")
    tx, rx = pair(shape=(1,), dtype="int16")

    async def main() -> int:
        with tx, rx:
            asyncio.get_running_loop().call_later(0.02, tx.send, np.array([7], np.int16))
            return int(np.from_dlpack(await rx.recv_async(timeout=2))[0])

    assert uvloop.run(main()) == 7


def test_send_async_waits_without_blocking_the_loop(pair: PairFactory) -> None:
    tx, rx = pair(shape=(1,), dtype="uint8", slots=1, policy="block", timeout=2)

    async def main() -> None:
        with tx, rx:
            await tx.send_async(np.array([1], np.uint8))
            held = await rx.recv_async(timeout=1)
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.005)

            t = asyncio.create_task(ticker())
            asyncio.get_running_loop().call_later(0.2, held.release)
            seq = await tx.send_async(np.array([2], np.uint8))  # blocks in a thread until the release
            t.cancel()
            assert seq == 2 and ticks >= 10

    asyncio.run(main())


def test_fileno_users_are_woken_for_every_frame(pair: PairFactory) -> None:
    """An external event loop selecting on fileno() must be woken, though it never blocks inside recv."""
    import select
    import threading

    tx, rx = pair(shape=(1,), dtype="int32")
    with tx, rx:
        fd = rx.fileno()
        got = []
        for i in range(1, 6):
            threading.Timer(0.02, tx.send, (np.array([i], np.int32),)).start()
            while True:
                assert select.select([fd], [], [], 2.0)[0], f"no wake-up for frame {i}"
                f = rx.poll()
                if f is not None:
                    got.append(int(np.from_dlpack(f)[0]))
                    f.release()
                    break
        assert got == [1, 2, 3, 4, 5]


def test_a_wait_cancelled_while_attaching_stops_trying_and_replaces_nothing(name: str) -> None:
    """``connect=False`` and no producer yet: each cancelled ``recv_async`` left a thread in the loop's default
    executor trying to attach until the Receiver's deadline: ``asyncio.run`` then waited for it at exit
    (forever with ``timeout=None``), and each such thread, attaching later, replaced the attachment a newer
    call was reading (``latest=False`` got frames twice and out of order)."""
    import contextlib
    import threading

    rx = cudalink.Receiver(name, timeout=None, connect=False, latest=False)

    async def cancel_five() -> None:
        for _ in range(5):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rx.recv_async(), 0.03)

    runner = threading.Thread(target=asyncio.run, args=(cancel_five(),), daemon=True)
    runner.start()
    runner.join(5.0)
    assert not runner.is_alive(), "asyncio.run did not return: a cancelled wait's attach kept it waiting"
    end = time.monotonic() + 2.0
    while any(t.name.startswith("cudalink-attach") for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.01)
    assert not any(t.name.startswith("cudalink-attach") for t in threading.enumerate())

    async def read(tx: cudalink.Sender) -> list[int]:
        seqs: list[int] = []
        for i in range(1, 41):
            tx.send(np.full(2, i, np.int32))
            with await rx.recv_async(timeout=2) as frame:
                seqs.append(int(np.from_dlpack(frame)[0]))
        return seqs

    with cudalink.Sender(name, shape=(2,), dtype="int32", slots=4, device="cpu") as tx, rx:
        assert asyncio.run(read(tx)) == list(range(1, 41))


def test_a_timeout_says_its_duration_readably(name: str) -> None:
    """``await recv_async(timeout=0.3)`` with no producer said "within 0.2999986300001183s" (what was left of
    its deadline when the attach began); ``recv(timeout=0.1 + 0.2)`` said "within 0.30000000000000004s"."""
    with cudalink.Receiver(name, connect=False) as rx:
        with pytest.raises(cudalink.LinkTimeout) as err:
            asyncio.run(rx.recv_async(timeout=0.3))
        assert f"no producer published {name!r} within 0.3s (" in str(err.value), err.value
        with pytest.raises(cudalink.LinkTimeout) as err:
            rx.recv(timeout=0.1 + 0.2)
        assert "within 0.3s (" in str(err.value), err.value
    with cudalink.Sender(name, shape=(2,), dtype="uint8", device="cpu") as tx, cudalink.Receiver(name) as rx:
        tx.send(np.zeros(2, np.uint8))
        rx.recv(timeout=5).release()
        with pytest.raises(cudalink.LinkTimeout) as err:
            asyncio.run(rx.recv_async(timeout=0.1 + 0.2))
        assert str(err.value).endswith("within 0.3s"), err.value
        with pytest.raises(cudalink.LinkTimeout) as err:
            rx.recv(timeout=0.1 + 0.2)
        assert str(err.value).endswith("within 0.3s"), err.value
    blocking = cudalink.Sender(name, shape=(2,), dtype="uint8", device="cpu", slots=1, policy="block")
    with blocking as tx, cudalink.Receiver(name) as rx:
        tx.send(np.zeros(2, np.uint8))
        with rx.recv(timeout=5), pytest.raises(cudalink.LinkTimeout) as err:  # its slot held: send waits
            tx.send(np.zeros(2, np.uint8), timeout=0.1 + 0.2)
    assert "stayed held by consumers for 0.3s (" in str(err.value), err.value


def test_a_wait_left_on_a_closed_loop_does_not_lock_the_receiver_out(pair: PairFactory) -> None:
    """A ``recv_async`` left pending on a loop that was then closed (never cancelled) will never run again: the
    next waiter takes over instead of being told one is already waiting; the old one's end, when the
    collector finally closes it, leaves the new waiter's claim alone."""
    import threading

    tx, rx = pair(shape=(2,), dtype="int32", slots=2)
    with tx, rx:
        loop = asyncio.new_event_loop()
        stale = loop.create_task(rx.recv_async(timeout=None))
        loop.run_until_complete(asyncio.sleep(0.05))
        loop.close()
        got: list[tuple[int, float]] = []

        def wait() -> None:
            frame = rx.recv(timeout=30)
            got.append((int(np.from_dlpack(frame)[0]), time.monotonic()))

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.1)
        del stale
        gc.collect()  # the stale coroutine's finally runs now: it must not turn the new waiter's wake-up off
        with pytest.raises(cudalink.LinkError, match="already waiting"):
            rx.recv(timeout=0.1)  # the thread's recv() still holds the Receiver
        sent = time.monotonic()
        tx.send(np.array([7, 7], np.int32))
        waiter.join(30.0)
        assert got and got[0][0] == 7
        assert got[0][1] - sent < 2.0, f"woken {got[0][1] - sent:.2f}s after the frame (its wake-up was off)"


def test_a_wait_with_a_limit_after_a_cancelled_one_without_ends_on_time(name: str) -> None:
    """A cancelled ``recv_async()`` with no limit left its attach running; a later ``recv_async(timeout=0.3)``
    waited on that attach, then raised a bare ``TimeoutError('')`` after 1.3 s instead of LinkTimeout (or,
    once a producer had gone, ProducerGone) after 0.3 s."""
    import contextlib

    async def cancel_then_wait(rx: cudalink.Receiver) -> float:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(rx.recv_async(timeout=None), 0.05)
        t0 = time.monotonic()
        await rx.recv_async(timeout=0.3)
        return time.monotonic() - t0

    t0 = time.monotonic()
    with cudalink.Receiver(name, connect=False) as rx, pytest.raises(cudalink.LinkTimeout) as err:
        asyncio.run(cancel_then_wait(rx))
    assert f"no producer published {name!r} within 0.3s (" in str(err.value), err.value
    assert time.monotonic() - t0 < 1.0

    with cudalink.Sender(name, shape=(2,), dtype="uint8", device="cpu") as tx, cudalink.Receiver(name) as rx:
        tx.send(np.zeros(2, np.uint8))
        rx.recv(timeout=5).release()
        tx.close()
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(cudalink.ProducerGone) as gone:
            asyncio.run(cancel_then_wait(rx))
        assert "no new one appeared within 0.3s" in str(gone.value), gone.value
        assert time.monotonic() - t0 < 1.0


def test_a_cancel_that_comes_as_the_attach_ends_is_not_lost(name: str) -> None:
    """``recv_async()`` waited for its attach with ``wait_for(shield(...))``: before Python 3.12 a cancel that
    came in the loop turns between the attach's end and the task's wake-up was swallowed (wait_for returned the
    attach's result), so ``asyncio.timeout`` or ``task.cancel()`` there left the call waiting for a frame:
    forever under ``timeout=None`` with a producer that sends none (cancels 1 to 3 turns after ``connected``)."""
    hung: list[int] = []

    async def cancel_after(rx: cudalink.Receiver, turns: int) -> None:
        task = asyncio.create_task(rx.recv_async(timeout=None))
        while not rx.connected:  # set by the attach's thread just before it ends
            await asyncio.sleep(0)
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1.0)
        if not done:
            hung.append(turns)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with cudalink.Sender(name, shape=(2,), dtype="uint8", device="cpu"):  # sends nothing
        for turns in range(6):
            with cudalink.Receiver(name, timeout=None, connect=False) as rx:
                asyncio.run(cancel_after(rx, turns))
    assert not hung, f"recv_async() went on waiting after a cancel {hung} loop turns after it attached"


def test_a_close_while_a_task_awaits_says_so_as_recv_does(pair: PairFactory) -> None:
    """``close()`` from another task ends an awaiting ``recv_async`` with the LinkClosed ``recv()`` raises in
    that case ('was closed while it waited'), not the one for a call made after the close."""
    tx, rx = pair(shape=(2,), dtype="int32", slots=2)

    async def main() -> str:
        with tx:
            task = asyncio.create_task(rx.recv_async(timeout=5))
            await asyncio.sleep(0.05)
            rx.close()
            with pytest.raises(cudalink.LinkClosed) as got:
                await asyncio.wait_for(task, 2)
            return str(got.value)

    assert "was closed while it waited" in asyncio.run(main())


def test_a_cancel_right_after_a_close_that_woke_an_attaching_task_still_ends_that_task(name: str) -> None:
    """close() wakes a task still attaching by cancelling it (the LinkClosed of a close during a wait); a cancel
    of the caller's own a loop turn later (a shutdown that closes, then cancels) was taken for that wake-up:
    ``async for`` ended quietly and the task went on, its cancel lost."""
    steps: list[str] = []

    async def main() -> None:
        rx = cudalink.Receiver(name, timeout=None, connect=False)  # no producer: it attaches until closed

        async def consume() -> None:
            async for frame in rx:
                frame.release()
            steps.append("ended")
            await asyncio.sleep(2.0)
            steps.append("went on")

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        rx.close()
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)

    asyncio.run(main())
    assert steps == [], f"the cancelled task went on: {steps}"


def test_a_recv_async_driven_without_a_running_loop_says_so_and_leaves_the_receiver_usable(
    spawned: Spawned, name: str
) -> None:
    """A ``recv_async()`` run where no asyncio loop runs (driven by hand, another async library, a thread with
    no loop) raised asyncio's bare ``RuntimeError('no running event loop')`` and left the Receiver marked as
    waiting: every later ``recv()``/``recv_async()`` was refused with 'already waiting', for good."""
    import threading

    spawned.ready(ap.idle_producer, name, stop=spawned.event(), forever=True)
    with cudalink.Receiver(name, timeout=10) as rx:
        coro = rx.recv_async(timeout=1)
        with pytest.raises(cudalink.LinkError, match=r"^cudalink: recv_async\(\) .*running asyncio") as err:
            coro.send(None)
        assert "recv()" in str(err.value), err.value
        coro.close()
        errors: list[BaseException] = []

        def in_a_thread() -> None:
            try:
                rx.recv_async(timeout=1).send(None)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=in_a_thread)
        t.start()
        t.join(10)
        assert len(errors) == 1 and isinstance(errors[0], cudalink.LinkError), errors
        rx.recv(timeout=5).release()  # the one frame there is: the Receiver is not locked out
        with pytest.raises(cudalink.LinkTimeout):
            asyncio.run(rx.recv_async(timeout=0.1))


def test_async_for_iterator_survives_a_cancelled_next(spawned: Spawned, name: str) -> None:
    """``asyncio.wait_for(anext(it), t)`` over ``it = aiter(rx)`` (a heartbeat between frames): the iterator
    was an async generator, which the first timeout's CancelledError finished, so the next ``anext`` said
    StopAsyncIteration (the stream's end) while the producer still sent. Each frame must come, in order, and
    the iterator end only when the producer closes."""
    start = spawned.event()
    spawned.ready(ap.paced_producer, name, 20, 0.03, start=start)

    async def main() -> tuple[list[int], int]:
        got: list[int] = []
        timeouts = 0
        with cudalink.Receiver(name, timeout=10, latest=False) as rx:
            it = aiter(rx)
            start.set()
            while True:
                try:
                    frame = await asyncio.wait_for(anext(it), 0.01)
                except asyncio.TimeoutError:
                    timeouts += 1
                    continue
                except StopAsyncIteration:
                    break
                got.append(int(np.from_dlpack(frame)[0]))
                frame.release()
            with pytest.raises(StopAsyncIteration):  # ended stays ended
                await anext(it)
        return got, timeouts

    got, timeouts = asyncio.run(main())
    assert got == list(range(1, 21)), got
    assert timeouts > 0


def test_waits_cancelled_while_attaching_log_no_unretrieved_error(
    spawned: Spawned, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``asyncio.wait_for(rx.recv_async(), t)`` cancelled before any producer came: the attach it waited on
    (in a thread, through ``asyncio.shield``) ended later with its 'cancelled' LinkTimeout, which nothing read,
    and asyncio logged 'Future exception was never retrieved' with a traceback, once per cancelled wait. Then a
    producer comes and every frame arrives."""
    import contextlib
    import logging

    start = spawned.event()

    async def main() -> list[int]:
        got: list[int] = []
        with cudalink.Receiver(name, connect=False, timeout=None, latest=False) as rx:
            for _ in range(3):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(rx.recv_async(), 0.02)
                await asyncio.sleep(0.15)  # its attach thread stops at its next try
            spawned.ready(ap.paced_producer, name, 5, 0.01, start=start)
            start.set()
            async for frame in rx:
                got.append(int(np.from_dlpack(frame)[0]))
                frame.release()
        return got

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        got = asyncio.run(main())
        gc.collect()
    assert got == [1, 2, 3, 4, 5]
    unread = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not unread, unread


def test_a_close_between_pumps_of_a_host_s_loop_ends_the_waiting_task(spawned: Spawned, name: str) -> None:
    """A host application (TouchDesigner, Blender, a GUI) runs its asyncio loop a moment per frame
    (``call_soon(loop.stop); run_forever()``), so between frames it is not running. ``close()`` there left the
    link at once (right) but the task awaiting ``recv_async()`` then waited, once the loop ran again, on a
    socket closed under it: forever, as did ``async for`` and whoever awaited that task. It must end with the
    LinkClosed a close() during a wait raises (``async for``: the loop ends), and the producer see it gone."""
    spawned.ready(ap.idle_producer, name, stop=spawned.event(), forever=True)
    loop = asyncio.new_event_loop()

    def pump() -> None:
        loop.call_soon(loop.stop)
        loop.run_forever()

    async def loop_over(rx: cudalink.Receiver) -> str:
        async for frame in rx:
            frame.release()
        return "ended"

    try:
        for how in ("recv_async", "async for"):
            rx = cudalink.Receiver(name, timeout=None)
            rx.recv(timeout=5).release()  # the one frame there is
            task = loop.create_task(rx.recv_async() if how == "recv_async" else loop_over(rx))
            for _ in range(5):  # waiting now
                pump()
                time.sleep(0.01)
            assert not task.done()
            rx.close()  # between two pumps
            end = time.monotonic() + 3.0
            while read_snapshot(name).consumers and time.monotonic() < end:
                time.sleep(0.01)
            assert not read_snapshot(name).consumers, "close() left the link only once the loop ran again"
            end = time.monotonic() + 3.0
            while not task.done() and time.monotonic() < end:
                pump()
                time.sleep(0.01)
            assert task.done(), f"{how}: the task still waits 3 s after close()"
            if how == "recv_async":
                with pytest.raises(cudalink.LinkClosed, match="was closed while it waited"):
                    task.result()
            else:
                assert task.result() == "ended"
            assert not task.cancelled()
    finally:
        for t in asyncio.all_tasks(loop):
            t.cancel()
        pump()
        loop.close()


def test_a_send_async_driven_without_a_running_loop_says_so(spawned: Spawned, name: str) -> None:
    """``send_async()`` where no asyncio loop runs raised asyncio's bare ``RuntimeError('no running event
    loop')``; like recv_async it says what to do, sends nothing, and the Sender goes on."""
    result = spawned.queue()
    with cudalink.Sender(name, shape=(4,), dtype="int64", slots=8) as tx:
        consumer = spawned(ap.async_consumer, name, result, 1)
        end = time.monotonic() + 30
        while tx.stats()["consumers"] < 1 and time.monotonic() < end:
            time.sleep(0.01)
        coro = tx.send_async(np.full(4, 1, np.int64))
        with pytest.raises(cudalink.LinkError, match=r"^cudalink: send_async\(\) .*running asyncio.*send\(\)"):
            coro.send(None)
        coro.close()
        assert tx.stats()["published"] == 0
        for i in (1, 2):
            tx.send(np.full(4, i, np.int64))
            time.sleep(0.05)
    _pid, lists = result.get(timeout=30)
    consumer.join(10)
    assert lists == [[1, 2]]
