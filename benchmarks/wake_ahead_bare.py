"""A woken-ahead handoff with no cudalink code: where the OS runs the woken consumer, and what it waits for.

Two processes, 2 ms cadence. The producer copies 80% of a 1080p RGBA frame into shared memory, writes a
wake-up (a socketpair, an eventfd or a pipe), copies the rest and publishes (a counter in shared memory);
``--yield`` makes it call ``sched_yield`` right after. The consumer sleeps in ``poll()``, then spins on the
counter with a ``sched_yield`` every 64 reads (as ``Receiver`` does). Printed per kind, p50 µs: the
handoff (publish -> the consumer saw it), the wake-up write -> the consumer running, and how often the
consumer ran on the producer's core.

    python benchmarks/wake_ahead_bare.py [--frames 600] [--yield] [socket eventfd pipe]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import socket
import subprocess
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

NBYTES = 1080 * 1920 * 4
LEAD = 0.2  # the share of the copy left after the wake-up


def consumer(kind: str, fd: int, name: str) -> None:
    getcpu = ctypes.CDLL(None).sched_getcpu
    shm = shared_memory.SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the producer's to unlink
    word = np.ndarray((4,), np.int64, shm.buf)  # seq, published at, wake-up written at, producer's cpu
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    rows, last, mono = [], 0, time.monotonic_ns
    while True:
        poller.poll()
        woke, cpu = mono(), getcpu()
        os.eventfd_read(fd) if kind == "eventfd" else os.read(fd, 8)
        n = 0
        while word[0] == last:
            n += 1
            if n % 64 == 0:
                os.sched_yield()
        seen = mono()
        last = int(word[0])
        if last < 0:
            break
        rows.append((seen - int(word[1]), woke - int(word[2]), cpu == int(word[3])))
    if not rows:
        return
    a = np.array(rows[min(50, len(rows) // 2) :], dtype=float)  # past the warm-up
    print(
        f"{kind:8s} handoff p50 {np.median(a[:, 0]) / 1e3:6.1f} µs (p90 {np.percentile(a[:, 0], 90) / 1e3:6.1f}) | "
        f"write -> consumer running {np.median(a[:, 1]) / 1e3:6.1f} µs | on the producer's core {a[:, 2].mean():.0%}"
    )
    del word
    shm.close()


def producer(kind: str, frames: int, yields: bool) -> None:
    getcpu = ctypes.CDLL(None).sched_getcpu
    shm = shared_memory.SharedMemory(create=True, size=64)
    data = shared_memory.SharedMemory(create=True, size=3 * NBYTES)
    try:
        word = np.ndarray((4,), np.int64, shm.buf)
        word[:] = 0
        if kind == "eventfd":
            rfd = wfd = os.eventfd(0)
            closers = [rfd]
        elif kind == "pipe":
            rfd, wfd = os.pipe()
            closers = [rfd, wfd]
        else:
            a, b = socket.socketpair()
            rfd, wfd = b.detach(), a.detach()
            closers = [rfd, wfd]

        def wake() -> None:
            os.eventfd_write(wfd, 1) if kind == "eventfd" else os.write(wfd, b"\x01")

        child = subprocess.Popen([sys.executable, __file__, "--child", kind, str(rfd), shm.name], pass_fds=(rfd,))
        time.sleep(1.0)
        src = np.ones(NBYTES, np.uint8)
        slots = [np.ndarray((NBYTES,), np.uint8, data.buf, offset=k * NBYTES) for k in range(3)]
        cut, mono = int(NBYTES * (1 - LEAD)), time.monotonic_ns
        for i in range(1, frames + 1):
            dst = slots[i % 3]
            dst[:cut] = src[:cut]
            word[2], word[3] = mono(), getcpu()
            wake()
            dst[cut:] = src[cut:]
            word[1] = mono()
            word[0] = i
            if yields:
                os.sched_yield()
            time.sleep(0.002)
        word[1], word[0] = mono(), -1
        wake()
        child.wait(timeout=30)
        del word, dst, slots
        for fd in closers:
            os.close(fd)
    finally:
        for s in (shm, data):
            s.close()
            s.unlink()


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        consumer(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=600)
    ap.add_argument("--yield", dest="yields", action="store_true", help="the producer yields after the publish")
    ap.add_argument("kinds", nargs="*", default=["socket", "eventfd", "pipe"])
    args = ap.parse_args()
    for kind in args.kinds:
        producer(kind, args.frames, args.yields)


if __name__ == "__main__":
    main()
