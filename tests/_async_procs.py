"""Child processes for the asyncio tests."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np

import cudalink


def paced_producer(name: str, n: int, every: float, ready: Any, start: Any) -> None:
    with cudalink.Sender(name, shape=(4,), dtype="int64", slots=8) as tx:
        ready.set()
        start.wait(30)
        for i in range(1, n + 1):
            tx.send(np.full(4, i, np.int64))
            time.sleep(every)
        time.sleep(0.2)


def idle_producer(name: str, ready: Any, stop: Any) -> None:
    with cudalink.Sender(name, shape=(4,), dtype="int64") as tx:
        tx.send(np.zeros(4, np.int64))
        ready.set()
        stop.wait(60)


def async_consumer(name: str, result: Any, n_tasks: int) -> None:
    """Several async consumers in one process; each must see every frame, in order."""

    async def one() -> list[int]:
        got = []
        with cudalink.Receiver(name, timeout=10, latest=False) as rx:
            async for frame in rx:
                got.append(int(np.from_dlpack(frame)[0]))
                frame.release()
        return got

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(one() for _ in range(n_tasks))))

    result.put((os.getpid(), asyncio.run(main())))


def idle_cpu(name: str, result: Any, seconds: float) -> None:
    """CPU seconds this process burns while awaiting a frame that never comes."""

    async def main() -> float:
        rx = cudalink.Receiver(name, timeout=10)
        rx.recv(timeout=5).release()  # the one frame there is
        t0 = os.times()  # user + system CPU of this process, on every OS (resource is POSIX only)
        try:
            await rx.recv_async(timeout=seconds)
        except cudalink.LinkTimeout:
            pass
        t1 = os.times()
        rx.close()
        return (t1.user - t0.user) + (t1.system - t0.system)

    result.put(asyncio.run(main()))
