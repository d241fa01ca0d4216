"""Which kernel wait wakes a sleeping Python process fastest? Bare, no cudalink code, at a 2 ms cadence.

Issue 14 asks whether a futex on the waiting word would beat the socket wake-up a blocking ``recv()``
uses. Each round spawns a reader that blocks in one primitive while the parent wakes it every 2 ms, and
reports wake latency (parent's timestamp before waking -> reader running), p50 and p90:

- ``read``: ``os.read`` on a socketpair (the bench's ``wake`` floor);
- ``poll``: ``select.poll`` on it, then the read (how a cudalink ``Receiver`` sleeps);
- ``futex``: ``FUTEX_WAIT`` on a shared-memory word, woken by ``FUTEX_WAKE`` (Linux, x86-64/arm64).

    python benchmarks/wake_primitives.py [--frames 1500] [--rounds 3]
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


def reader(mode: str, sock: socket.socket, shm_name: str, q: Any) -> None:
    lat: list[int] = []
    shm = shared_memory.SharedMemory(shm_name)
    word = ctypes.c_uint32.from_buffer(shm.buf)  # the futex word; the stamp sits at offset 8
    addr = ctypes.addressof(word)
    syscall = _futex()
    fd = sock.fileno()
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
        else:
            if mode == "poll":
                p.poll(5000)
            data = os.read(fd, 8)
            t = time.monotonic_ns()
            (sent,) = _T.unpack(data)
        if sent < 0:
            break
        lat.append(t - sent)
    del word
    shm.close()
    q.put(lat)


def one(mode: str, frames: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    a, b = socket.socketpair()
    shm = shared_memory.SharedMemory(create=True, size=64)
    cell = [ctypes.c_uint32.from_buffer(shm.buf)]  # dropped before shm.close(): it exports the buffer
    addr = ctypes.addressof(cell[0])
    syscall = _futex()
    proc = ctx.Process(target=reader, args=(mode, b, shm.name, q))
    proc.start()
    q.get(timeout=60)
    time.sleep(0.5)

    def wake(stamp: int) -> None:
        if mode == "futex":
            _T.pack_into(shm.buf, 8, stamp)
            cell[0].value += 1
            syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 1, None, None, 0)
        else:
            a.send(_T.pack(stamp))

    nxt = time.monotonic()
    for _ in range(frames):
        nxt += 0.002
        time.sleep(max(0.0, nxt - time.monotonic()))
        wake(time.monotonic_ns())
    wake(-1)
    lat = sorted(q.get(timeout=60)[frames // 10 :])
    proc.join(10)
    cell.clear()
    shm.close()
    shm.unlink()
    a.close()
    b.close()
    return statistics.median(lat) / 1000, lat[int(len(lat) * 0.9)] / 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    modes = ["read", "poll"] + (["futex"] if _SYS_FUTEX is not None and os.name == "posix" else [])
    for r in range(args.rounds):
        cells = []
        for m in modes:
            p50, p90 = one(m, args.frames)
            cells.append(f"{m} p50 {p50:5.1f} p90 {p90:5.1f}")
        print(f"round {r + 1}: " + "   ".join(cells) + "  (us)", flush=True)


if __name__ == "__main__":
    main()
