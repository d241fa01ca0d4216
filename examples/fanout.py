"""One producer, several consumer processes, all reading the same slots.

    python examples/fanout.py --device 0 --consumers 4

Each consumer maps the producer's memory once and leases the frame it reads; the producer reuses a slot
only when no consumer still holds it, so a slow consumer skips frames (it always gets the newest)
without slowing the others. Consumers report what they saw through a queue; the result line sums up.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from _demo_producer import Tally, device_label, example_args, finish_args, frame_ok, other_side, produce, require_device

import cudalink

WHO = "fanout"


def consume(name: str, index: int, frames: int, device: str | int, results: Any, wait: float = 30.0) -> None:
    """One consumer process: check every frame it gets against the checksum in its meta."""
    tally = Tally(f"{WHO}[{index}]", frames, device)
    with cudalink.Receiver(name, timeout=wait) as rx:
        for frame in rx:
            with frame:
                tally.add(frame, frame_ok(frame))
    results.put((index, tally.received, tally.bad, tally.last))


def main() -> int:
    p = example_args(WHO, __doc__)
    p.add_argument(
        "--consumers",
        type=int,
        help="consumer processes (default 3); with --role producer, how many it waits for (default 1)",
    )
    args = p.parse_args()
    if args.consumers is None:  # --role producer: the one consumer of the README's two terminals
        args.consumers = 3 if args.role == "both" else 1
    args = finish_args(args, WHO)
    require_device(args.device, WHO)
    if args.role == "consumer":  # one consumer here; start more in other terminals
        mine = mp.SimpleQueue()
        with other_side(args):
            consume(args.name, 0, args.frames, args.device, mine, args.wait)
        print(f"{WHO}: consumer got {mine.get()[1]} frames")
        return 0

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = []
    if args.role == "both":
        for i in range(args.consumers):
            consumer = (args.name, i, args.frames, args.device, results, args.wait)
            procs.append(ctx.Process(target=consume, args=consumer))
            procs[-1].start()
    # This process is the producer: it waits until all consumers attached, then publishes.
    with other_side(args):
        wait = 60.0 if procs else args.wait
        produce(args.name, args.device, args.frames, args.fps, args.shape, consumers=args.consumers, wait=wait)
    if not procs:
        print(f"{WHO}: producer sent {args.frames} frames to {args.consumers} consumers")
        return 0
    for proc in procs:
        proc.join(30)
    seen = sorted(results.get() for _ in procs if not results.empty())
    bad = sum(r[2] for r in seen)
    complete = all(r[3] == args.frames for r in seen)  # each one saw the last frame
    ok = len(seen) == args.consumers and bad == 0 and complete and all(p.exitcode == 0 for p in procs)
    got = "/".join(str(r[1]) for r in seen)
    status = "OK" if ok else "FAIL"
    where = device_label(args.device)
    print(
        f"{WHO}: {status} {args.consumers} consumers x {args.frames} frames on {where}: "
        f"received {got}, {bad} checksum mismatches",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
