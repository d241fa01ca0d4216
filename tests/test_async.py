"""asyncio consumers (issue 5): ``async for``, cancellation, ProducerGone, and idle CPU near zero."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import cudalink
from cudalink.tools.monitor import read_snapshot
from cudalink.transport import MemoryTransport

from . import _async_procs as ap


def test_async_for_gets_every_frame_in_order_across_processes(ctx: Any, name: str, control: str) -> None:
    ready, start, result = ctx.Event(), ctx.Event(), ctx.Queue()
    prod = ctx.Process(target=ap.paced_producer, args=(name, 200, 0.002, ready, start))
    prod.start()
    assert ready.wait(30)
    cons = [ctx.Process(target=ap.async_consumer, args=(name, result, 3)) for _ in range(2)]
    for c in cons:
        c.start()
    end = time.monotonic() + 30
    while time.monotonic() < end:  # all 6 async consumers joined, as a monitor sees it (read-only)
        if len(read_snapshot(name).consumers) >= 6:
            break
        time.sleep(0.02)
    start.set()
    outs = [result.get(timeout=60) for _ in cons]
    prod.join(30)
    for _pid, lists in outs:
        assert len(lists) == 3
        for got in lists:
            assert got == list(range(1, 201)), got[:10]


def test_cancelled_wait_loses_nothing_and_leaks_no_lease(name: str) -> None:
    tr = MemoryTransport()

    async def main() -> None:
        with (
            cudalink.Sender(name, shape=(2,), dtype="int32", slots=2, transport=tr) as tx,
            cudalink.Receiver(name, transport=tr, latest=False) as rx,
        ):
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


def test_cancel_races_with_a_publish(name: str) -> None:
    """Cancel at the moment a frame lands: the frame is delivered by the next call, never lost."""
    tr = MemoryTransport()

    async def main() -> None:
        with (
            cudalink.Sender(name, shape=(1,), dtype="int64", slots=4, transport=tr) as tx,
            cudalink.Receiver(name, transport=tr, latest=False) as rx,
        ):
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


def test_producer_gone_surfaces_inside_the_loop(ctx: Any, name: str, control: str) -> None:
    ready, stop = ctx.Event(), ctx.Event()
    prod = ctx.Process(target=ap.idle_producer, args=(name, ready, stop))
    prod.start()
    assert ready.wait(30)

    async def main() -> float:
        with cudalink.Receiver(name, timeout=5) as rx:
            (await rx.recv_async(timeout=5)).release()
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, os.kill, prod.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(cudalink.ProducerGone):
                await rx.recv_async(timeout=10)
            return time.monotonic() - t0

    took = asyncio.run(main())
    prod.join(10)
    assert took < 1.0


def test_async_for_ends_when_the_producer_closes(name: str) -> None:
    tr = MemoryTransport()

    async def main() -> list[int]:
        tx = cudalink.Sender(name, shape=(1,), dtype="int8", transport=tr)
        rx = cudalink.Receiver(name, transport=tr, latest=False)
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
        rx.close()
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_idle_async_consumer_uses_almost_no_cpu(
    ctx: Any, name: str, control: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # numpy's OpenBLAS starts a worker thread at import that spins (yielding) for a while before it
    # sleeps: 0.02-0.06 s of this process's CPU in the window, none of it ours (0.0006 s without it)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ready, stop, result = ctx.Event(), ctx.Event(), ctx.Queue()
    prod = ctx.Process(target=ap.idle_producer, args=(name, ready, stop))
    prod.start()
    assert ready.wait(30)
    cons = ctx.Process(target=ap.idle_cpu, args=(name, result, 2.0))
    cons.start()
    cpu = result.get(timeout=30)
    stop.set()
    cons.join(10)
    prod.join(10)
    assert cpu < 0.05, f"an idle async consumer burned {cpu:.3f} s of CPU in 2 s"


def test_blocking_recv_is_a_kernel_wait_too(name: str) -> None:
    import resource

    tr = MemoryTransport()
    with (
        cudalink.Sender(name, shape=(1,), transport=tr),
        cudalink.Receiver(name, transport=tr, wait="hybrid") as rx,
    ):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=1.0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    assert cpu < 0.05, f"recv(wait='hybrid') burned {cpu:.3f} s of CPU waiting 1 s"


@pytest.mark.parametrize("mode", ["spin", "block", "hybrid"])
def test_every_wait_mode_delivers(name: str, mode: str) -> None:
    tr = MemoryTransport()
    with (
        cudalink.Sender(name, shape=(1,), transport=tr) as tx,
        cudalink.Receiver(name, transport=tr, wait=mode) as rx,
    ):  # type: ignore[arg-type]
        import threading

        threading.Timer(0.05, lambda: tx.send(np.array([9], np.uint8))).start()
        assert int(np.from_dlpack(rx.recv(timeout=2))[0]) == 9
    with pytest.raises(cudalink.LinkError, match="wait must be"):
        cudalink.Receiver(name, wait="poll", connect=False)  # type: ignore[arg-type]


def test_uvloop_if_available(name: str) -> None:
    uvloop = pytest.importorskip("uvloop")
    tr = MemoryTransport()

    async def main() -> int:
        with (
            cudalink.Sender(name, shape=(1,), dtype="int16", transport=tr) as tx,
            cudalink.Receiver(name, transport=tr) as rx,
        ):
            asyncio.get_running_loop().call_later(0.02, tx.send, np.array([7], np.int16))
            return int(np.from_dlpack(await rx.recv_async(timeout=2))[0])

    assert uvloop.run(main()) == 7


def test_send_async_waits_without_blocking_the_loop(name: str) -> None:
    tr = MemoryTransport()

    async def main() -> None:
        with (
            cudalink.Sender(name, shape=(1,), slots=1, policy="block", timeout=2, transport=tr) as tx,
            cudalink.Receiver(name, transport=tr) as rx,
        ):
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


def test_fileno_users_are_woken_for_every_frame(name: str) -> None:
    """An external event loop selecting on fileno() must be woken, though it never blocks inside recv."""
    import select
    import threading

    tr = MemoryTransport()
    with cudalink.Sender(name, shape=(1,), dtype="int32", transport=tr) as tx, \
            cudalink.Receiver(name, transport=tr) as rx:  # fmt: skip
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
