"""Which kernel wait wakes a sleeping Python process fastest? Bare, no cudalink code, at a 2 ms cadence.

Issue 14 asks whether a futex on the waiting word would beat the socket wake-up a blocking ``recv()``
uses. Each round spawns a reader that blocks in one primitive while the parent wakes it every 2 ms, and
reports wake latency (parent's timestamp before waking -> reader running), p50 and p90:

- ``read``: ``os.read`` on a socketpair (the bench's ``wake`` floor);
- ``poll``: ``select.poll`` on it, then the read (how a cudalink ``Receiver`` sleeps);
- ``futex``: ``FUTEX_WAIT`` on a shared-memory word, woken by ``FUTEX_WAKE`` (Linux, x86-64/arm64);
- ``eventfd``: ``select.poll`` on an eventfd, woken by ``eventfd_write`` (Linux).

``--busy-us N`` asks the question of a wake-up sent *ahead* (while the waker still has work to do): after
every other wake-up the waker copies memory for about N µs, and on the frames between it copies with no
wake-up at all; ``--reader-spin-us S`` makes the woken reader spin S µs before it sleeps again, as a
consumer woken ahead does. The report adds the waker's copy time after a wake-up against its copy time
alone: a socket write wakes its reader *synchronously* (the kernel may run the reader on the writer's
CPU, which then waits), an eventfd or a futex does not.

    python benchmarks/wake_primitives.py [--frames 1500] [--rounds 3] [--busy-us 1000 --reader-spin-us 50]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import platform
import select
import socket
import statistics
import struct
import time
from multiprocessing import shared_memory
from typing import Any

_T = struct.Struct("<q")
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


def _futex() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL for the call, as a real waiter would
    libc.syscall.restype = ctypes.c_long
    return libc.syscall


def reader(mode: str, sock: socket.socket, shm_name: str, q: Any, spin_us: float = 0.0) -> None:
    lat: list[int] = []
    efd = socket.recv_fds(sock, 1, 1)[1][0] if mode == "eventfd" else -1
    shm = shared_memory.SharedMemory(shm_name)
    word = ctypes.c_uint32.from_buffer(shm.buf)  # the futex word; the stamp sits at offset 8
    addr = ctypes.addressof(word)
    syscall = _futex()
    fd = efd if mode == "eventfd" else sock.fileno()
    p = select.poll()
    p.register(fd, select.POLLIN)
    seen = word.value
    q.put("ready")
    while True:
        if mode == "futex":
            while word.value == seen:
                syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, seen, None, None, 0)
            t = time.monotonic_ns()
            seen = word.value
            (sent,) = _T.unpack_from(shm.buf, 8)
        elif mode == "eventfd":
            p.poll(5000)
            os.eventfd_read(fd)
            t = time.monotonic_ns()
            (sent,) = _T.unpack_from(shm.buf, 8)
        else:
            if mode == "poll":
                p.poll(5000)
            data = os.read(fd, 8)
            t = time.monotonic_ns()
            (sent,) = _T.unpack(data)
        if sent < 0:
            break
        lat.append(t - sent)
        if spin_us:  # a consumer woken ahead spins for its frame
            end = time.perf_counter_ns() + int(spin_us * 1000)
            while time.perf_counter_ns() < end:
                pass
    del word
    shm.close()
    q.put(lat)


def _copier(busy_us: float) -> tuple[Any, Any]:
    """Two buffers whose copy takes about ``busy_us`` on this machine (sized once, warm)."""
    import numpy as np

    n = 1 << 20
    src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
    t0 = time.perf_counter_ns()
    for _ in range(20):
        np.copyto(dst, src)
    per_byte = (time.perf_counter_ns() - t0) / 20 / n
    n = max(4096, int(busy_us * 1000 / per_byte))
    return np.ones(n, np.uint8), np.empty(n, np.uint8)


def one(mode: str, frames: int, busy_us: float = 0.0, spin_us: float = 0.0) -> dict[str, float]:
    import numpy as np

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    a, b = socket.socketpair()
    shm = shared_memory.SharedMemory(create=True, size=64)
    cell = [ctypes.c_uint32.from_buffer(shm.buf)]  # dropped before shm.close(): it exports the buffer
    addr = ctypes.addressof(cell[0])
    syscall = _futex()
    efd = os.eventfd(0) if mode == "eventfd" else -1
    proc = ctx.Process(target=reader, args=(mode, b, shm.name, q, spin_us))
    proc.start()
    if mode == "eventfd":
        socket.send_fds(a, [b"e"], [efd])
    q.get(timeout=60)
    src, dst = _copier(busy_us) if busy_us else (None, None)
    time.sleep(0.5)

    def wake(stamp: int) -> None:
        if mode == "futex":
            _T.pack_into(shm.buf, 8, stamp)
            cell[0].value += 1
            syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 1, None, None, 0)
        elif mode == "eventfd":
            _T.pack_into(shm.buf, 8, stamp)
            os.eventfd_write(efd, 1)
        else:
            a.send(_T.pack(stamp))

    after: list[int] = []  # the waker's copy right after a wake-up
    alone: list[int] = []  # the same copy on a frame with no wake-up
    nxt = time.monotonic()
    for i in range(2 * frames if busy_us else frames):
        nxt += 0.002
        time.sleep(max(0.0, nxt - time.monotonic()))
        woke = not busy_us or i % 2 == 0
        if woke:
            wake(time.monotonic_ns())
        if busy_us:
            t0 = time.perf_counter_ns()
            np.copyto(dst, src)
            (after if woke else alone).append(time.perf_counter_ns() - t0)
    wake(-1)
    lat = sorted(q.get(timeout=60)[frames // 10 :])
    proc.join(10)
    cell.clear()
    shm.close()
    shm.unlink()
    a.close()
    b.close()
    if efd >= 0:
        os.close(efd)
    out = {"p50": statistics.median(lat) / 1000, "p90": lat[int(len(lat) * 0.9)] / 1000}
    if busy_us:
        out["copy_after_wake"] = statistics.median(after[frames // 10 :]) / 1000
        out["copy_alone"] = statistics.median(alone[frames // 10 :]) / 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-us", type=float, default=0.0, help="the waker copies this long after a wake-up")
    ap.add_argument("--reader-spin-us", type=float, default=0.0, help="the woken reader spins this long")
    args = ap.parse_args()
    modes = ["read", "poll"] + (["futex"] if _SYS_FUTEX is not None and os.name == "posix" else [])
    modes += ["eventfd"] if hasattr(os, "eventfd") else []
    for r in range(args.rounds):
        cells = []
        for m in modes:
            res = one(m, args.frames, args.busy_us, args.reader_spin_us)
            cell = f"{m} p50 {res['p50']:5.1f} p90 {res['p90']:5.1f}"
            if args.busy_us:
                cell += f" copy {res['copy_after_wake']:6.1f} vs {res['copy_alone']:6.1f} alone"
            cells.append(cell)
        print(f"round {r + 1}: " + "   ".join(cells) + "  (us)", flush=True)


if __name__ == "__main__":
    main()
