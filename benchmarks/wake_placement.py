"""Where does a woken host-backend consumer run, and what does it wait for? Linux, CPU backend, 2 ms cadence.

A ``Sender(device="cpu")`` sends 1080p RGBA frames to a spawned ``Receiver(wait="block", wake_ahead=False)``
(``--ahead``: ``wake_ahead=True``), both with ``cudalink._trace`` on. Per frame the producer notes the CPU it
ran on (``sched_getcpu``) and when it entered its sleep after ``send()``; the consumer notes its CPU and when
``recv()`` returned. A beat after each frame the producer also copies a frame into scratch memory and writes a
bare socketpair wake-up, which the consumer times in a bare ``read`` (the bench's paired floor).

It prints, p50 in µs: how often the consumer ran on the producer's core, the publish -> wake-up write,
the write itself, the producer's tail from the write to its sleep, its sleep -> the consumer running,
and the consumer's running -> ``recv()`` returned; then the handoff against the bare wake.

With ``--ahead`` the wake-up is written during the copy (ahead of the publish) and the woken consumer spins
for the frame; it prints how often that consumer ran on the producer's core, the wake-up ahead -> the
consumer running, running -> published, publish -> the producer asleep, and the handoff. Where the OS puts
the woken consumer on the producer's core (a VM whose idle vCPU the guest sees as preempted, say), the
spinning consumer gets the core only once the producer sleeps: the handoff is then a context switch plus
our code on both sides, not the few µs of a spin.

    python benchmarks/wake_placement.py [--frames 1500] [--ahead]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

SHAPE = (1080, 1920, 4)


def _getcpu() -> Any:
    return ctypes.CDLL(None).sched_getcpu


def consumer(name: str, q: Any, beats: Any, ahead: bool) -> None:
    import cudalink
    from cudalink import _trace

    getcpu, fd, mono = _getcpu(), beats.fileno(), time.monotonic_ns
    rx = cudalink.Receiver(name, wait="block", wake_ahead=ahead, timeout=10)
    _trace.enable(True)
    frames, bare = [], []
    q.put("ready")
    try:
        while True:
            f = rx.recv()
            t = mono()
            cpu = getcpu()
            woken = dict(_trace.take()).get(_trace.WOKEN, 0)
            frames.append((f.seq, woken, t, cpu))
            f.release()
            data = os.read(fd, 8)
            bare.append(mono() - int.from_bytes(data, "little"))
    except cudalink.ProducerGone:
        pass
    q.put((frames, bare))


def main() -> None:
    import cudalink
    from cudalink import _trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=1500)
    ap.add_argument("--ahead", action="store_true", help="the consumer asks to be woken ahead (Receiver's default)")
    args = ap.parse_args()
    n, ahead = args.frames, args.ahead
    warm = 50
    ctx = mp.get_context("spawn")
    name = f"placement{os.getpid()}"
    tx = cudalink.Sender(name, shape=SHAPE, dtype="uint8", device="cpu")
    ours, theirs = ctx.Pipe(duplex=True)
    q = ctx.Queue()
    p = ctx.Process(target=consumer, args=(name, q, theirs, ahead))
    p.start()
    q.get(timeout=60)
    getcpu, fd, mono = _getcpu(), ours.fileno(), time.monotonic_ns
    src, scratch = np.full(SHAPE, 3, np.uint8), np.empty(SHAPE, np.uint8)
    _trace.enable(True)
    prod = {}
    time.sleep(0.2)
    for _ in range(n):
        seq = tx.send(src)
        cpu = getcpu()
        slept = mono()
        time.sleep(0.002)
        marks = dict(_trace.take())
        keys = (_trace.WAKING_AHEAD, _trace.AHEAD_SENT) if ahead else (_trace.WAKING, _trace.WAKE_SENT)
        stamps = [marks.get(k, 0) for k in (_trace.PUBLISHED, *keys)]
        prod[seq] = (*stamps, slept, cpu)
        np.copyto(scratch, src)  # the bare beat starts from the same cache state as a host send
        os.write(fd, mono().to_bytes(8, "little"))
        time.sleep(0.002)
    tx.close()
    frames, bare = q.get(timeout=60)
    p.join(timeout=10)
    b = float(np.median(bare[warm:])) / 1e3
    rows = []
    for seq, woken, t, ccpu in frames:
        if seq not in prod or seq <= warm or not woken:
            continue
        pub, waking, sent, slept, pcpu = prod[seq]
        if waking and ahead:  # woken during the copy: when it ran, and what it waited for after the publish
            rows.append((ccpu == pcpu, woken - sent, pub - woken, slept - pub, t - pub))
        elif waking:
            rows.append((ccpu == pcpu, waking - pub, sent - waking, slept - sent, woken - slept, t - woken, t - pub))
    if not rows:
        raise SystemExit(f"no frame was woken {'ahead' if ahead else 'after its publish'}")
    a = np.array(rows, dtype=float)
    us = np.median(a[:, 1:], axis=0) / 1e3
    print(f"{len(a)} frames; the consumer ran on the producer's core for {a[:, 0].mean() * 100:.0f}% of them")
    if ahead:
        print(
            f"p50 us: wake-up ahead written -> consumer running {us[0]:.1f} | running -> published {us[1]:.1f} | "
            f"publish -> producer asleep {us[2]:.1f}"
        )
    else:
        print(
            f"p50 us: publish -> write {us[0]:.1f} | write {us[1]:.1f} | write -> producer asleep {us[2]:.1f} | "
            f"asleep -> consumer running {us[3]:.1f} | running -> recv() returned {us[4]:.1f}"
        )
    print(f"handoff (publish -> recv() returned) {us[-1]:.1f}, a bare wake a beat later {b:.1f}: {us[-1] / b:.2f}x")


if __name__ == "__main__":
    main()
