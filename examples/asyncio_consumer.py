"""Receive frames inside an asyncio program with ``async for frame in rx``.

    python examples/asyncio_consumer.py --device cpu --frames 300

recv_async() waits on the link's control socket through the event loop (no thread, no polling), so
other coroutines keep running between frames. Here the receiving coroutine hands per-frame stats to a
queue; a reporter wakes on a timer and prints them, and a heartbeat measures how late the loop ever
ran a timer (its "lag"): it stays small because waiting for a frame never blocks the loop.
"""

from __future__ import annotations

import argparse
import asyncio

from _demo_producer import Tally, example_args, finish_args, frame_ok, other_side, require_device, spawn_producer

import cudalink

WHO = "asyncio_consumer"


async def receive(rx: cudalink.Receiver, tally: Tally, stats: asyncio.Queue) -> None:
    async for frame in rx:  # ends when the producer closes
        with frame:
            ok = frame_ok(frame)  # GPU frames: a short blocking host copy; heavy work belongs in a thread
        tally.add(frame, ok)
        stats.put_nowait((frame.seq, tally.ages_ms[-1]))
    stats.put_nowait(None)


async def report(stats: asyncio.Queue, every: float) -> None:
    """The slow, periodic I/O of a real service (a log, a socket, a dashboard), on a timer."""
    done = False
    while not done:
        await asyncio.sleep(every)
        batch = []
        while not stats.empty():
            item = stats.get_nowait()
            done = done or item is None
            if item is not None:
                batch.append(item)
        if batch:
            worst = max(age for _, age in batch)
            print(f"  +{len(batch)} frames up to seq {batch[-1][0]}, worst age {worst:.2f} ms", flush=True)


async def heartbeat(period: float, lag: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period)
        lag.append(loop.time() - t0 - period)


async def run(args: argparse.Namespace) -> int:
    tally = Tally(WHO, args.frames, args.device)
    stats: asyncio.Queue = asyncio.Queue()
    lag: list[float] = []
    beat = asyncio.create_task(heartbeat(0.005, lag))
    # connect=False: attaching then happens inside recv_async, in a thread, not on the loop.
    with cudalink.Receiver(args.name, timeout=args.wait, connect=False) as rx:
        await asyncio.gather(receive(rx, tally, stats), report(stats, 0.25))
    beat.cancel()
    return tally.finish(args.producer, f", event-loop max lag {1e3 * max(lag, default=0):.1f} ms")


def main() -> int:
    args = finish_args(example_args(WHO, __doc__).parse_args(), WHO)
    require_device(args.device, WHO)
    args.producer = spawn_producer(args)
    with other_side(args):
        return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
