"""Processes for the ucx:// tests: a producer, and a consumer to kill. Run as ``python -m tests._ucx_procs``.

Frames carry their own checksum: every byte of frame ``seq`` is a function of its index and ``seq``
(:func:`pattern`), and ``meta`` is ``seq`` as 8 bytes, so a consumer verifies every frame on its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import struct
import sys
import time
from typing import Any

import numpy as np


def pattern(shape: tuple[int, ...], seq: int) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n, dtype=np.uint32) * 7 + seq * 13) % 251).astype(np.uint8).reshape(shape)


def check(frame: object, relayed: bool = False) -> None:
    """Raise AssertionError unless ``frame``'s bytes and meta are those its producer wrote for its seq
    (``relayed``: a relay republished it, with seqs of its own; the meta still names the producer's)."""
    import cudalink

    assert isinstance(frame, cudalink.Frame)
    seq = struct.unpack("<Q", frame.meta)[0]
    assert relayed or seq == frame.seq, (seq, frame.seq)
    got = frame.numpy()
    want = pattern(frame.shape, seq)
    assert np.array_equal(got, want), f"frame {seq}: content differs"


def producer(args: argparse.Namespace) -> None:
    import cudalink

    shape = tuple(int(x) for x in args.shape.split(","))
    shape2 = tuple(int(x) for x in args.reshape.split(",")) if args.reshape else None
    cap = max(int(np.prod(shape)), int(np.prod(shape2)) if shape2 else 0)
    device = "cpu" if args.device == "cpu" else int(args.device)
    tx = cudalink.Sender(
        args.name,
        shape=shape,
        dtype="uint8",
        slots=args.slots,
        capacity=cap,
        policy=args.policy,
        timeout=5.0,
        device=device,
    )
    if device != "cpu":
        import torch
    index: dict[int, Any] = {}
    sys.stdout.write("ready\n")  # one write (PYTHONUNBUFFERED splits a print in two)
    sys.stdout.flush()
    worst = 0.0
    period = 1.0 / args.fps
    nxt = time.monotonic()
    while args.go_file and not os.path.exists(args.go_file):  # frames until the test says go, then --frames more
        tx.send(pattern(tx.shape, tx.seq + 1), meta=struct.pack("<Q", tx.seq + 1))
        nxt += period
        time.sleep(max(0.0, nxt - time.monotonic()))
    for i in range(1, args.frames + 1):
        if shape2 is not None and i % args.every == 0:  # toggle between the two shapes
            tx.reconfigure(shape2 if tx.shape == shape else shape)
        if device != "cpu":  # pattern() made on the GPU: 30 ms of numpy a 1080p frame would pace a flat-out run
            n = int(np.prod(tx.shape))
            if n not in index:
                index[n] = torch.arange(n, dtype=torch.int64, device=f"cuda:{device}") * 7
            frame = ((index[n] + (tx.seq + 1) * 13) % 251).to(torch.uint8).reshape(tx.shape)
        else:
            frame = pattern(tx.shape, tx.seq + 1)
        t0 = time.monotonic()
        tx.send(frame, meta=struct.pack("<Q", tx.seq + 1))
        worst = max(worst, time.monotonic() - t0)
        if args.report and i % 10 == 0:
            print(f"consumers {tx.stats()['consumers']}", flush=True)
        nxt += period
        time.sleep(max(0.0, nxt - time.monotonic()))
    print(f"done worst_send={worst:.6f} dropped={tx.stats()['dropped']}", flush=True)
    if args.linger:
        time.sleep(args.linger)
    tx.close()


def consumer(args: argparse.Namespace) -> None:
    """Receive and keep every frame (never release): a consumer that holds what it can, then is killed."""
    import cudalink

    rx = cudalink.Receiver(args.url, timeout=10.0, latest=False, device="cpu")
    held = [rx.recv(timeout=10.0) for _ in range(2)]
    print(f"holding {len(held)}", flush=True)
    time.sleep(60)


def reader(args: argparse.Namespace) -> None:
    """Receive and release frames for ever (newest wins): a consumer that keeps up, until a test stops it."""
    import cudalink

    rx = cudalink.Receiver(args.url, timeout=10.0, device="cpu")
    with rx.recv(timeout=10.0):
        print("reading", flush=True)
    while True:
        with rx.recv(timeout=10.0):
            pass


def hold_the_gil(seconds: float) -> None:
    """Keep the GIL for ``seconds``, as a long C call or an import would: no other thread of ours runs."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(old)


def gpu_consumer(args: argparse.Namespace) -> None:
    """Receive ``--frames`` frames on ``--device`` and check each through ``--lib`` (torch, cupy or numpy)."""
    import cudalink

    device = "cpu" if args.device == "cpu" else int(args.device)
    if args.lib in ("torch", "cupy"):  # as an application does: its framework first, then the connection
        import importlib

        importlib.import_module(args.lib)
    rx = cudalink.Receiver(args.url, timeout=20.0, latest=False, device=device)
    bad = 0
    for i in range(args.frames):
        if i == 1 and args.stall:  # keep the GIL (a long C call): the server drops us, we connect again
            hold_the_gil(args.stall)
        with rx.recv(timeout=10.0) as f:
            seq = struct.unpack("<Q", f.meta)[0]
            want = pattern(f.shape, seq)
            if args.lib == "torch":
                import torch

                got = torch.from_dlpack(f).cpu().numpy()
            elif args.lib == "cupy":
                import cupy

                got = cupy.from_dlpack(f).get()
            else:
                got = f.to_numpy()
            bad += int(not np.array_equal(got, want))
    resumes = getattr(rx._att, "resumes", 0)
    print(f"checked {args.frames} bad {bad} device {rx.device} resumes {resumes} stats {rx.stats()}", flush=True)
    if args.close:  # leave: the landing memory goes back now, not when the process exits
        att = rx._att
        f = None  # the last frame: a frame we still hold keeps its buffer, by design
        rx.close()
        pool = getattr(att, "pool", None)
        end = time.monotonic() + 5.0
        while pool is not None and pool.stats()["buffers"] and time.monotonic() < end:
            time.sleep(0.01)
        left = pool.stats()["buffers"] if pool is not None else 0
        print(f"closed landing buffers left {left} pinned {getattr(att, 'pinned', None) is not None}", flush=True)
        return
    if args.until_gone:  # keep taking frames until the server vanishes, then say how it ended
        try:
            while True:
                rx.recv(timeout=30.0).release()
        except cudalink.ProducerGone:
            print(f"gone {time.monotonic():.3f}", flush=True)


def lying_server(args: argparse.Namespace) -> None:
    """A ucx:// server that knows the key and lies in ``args.lie``: ``credits`` (takes more than granted),
    ``capacity`` (frames of 16 GiB), ``seq`` (a seq that goes back), ``short`` (fewer pixel bytes than its
    header says). Prints ``listening``."""
    import asyncio
    import os

    from cudalink.frames.spec import FrameSpec
    from cudalink.transport import ucx_engine, ucx_wire, wire

    gen = 0x1234
    spec = FrameSpec((4, 4, 4), "uint8")

    def welcome(capacity: int, credits: int) -> bytes:
        return ucx_wire.pack_welcome(ucx_wire.Welcome(gen, capacity, credits, wire.BACKEND_HOST, 0, False))

    async def handler(ep: ucx_engine.Endpoint) -> None:
        await ep.send(ucx_wire.pack_challenge(os.urandom(ucx_wire.NONCE_SIZE)))
        hello = ucx_wire.unpack_hello(await ucx_engine.recv_msg(ep, bytearray(ucx_wire.MSG_SIZE), 5.0))
        if args.lie == "credits":
            await ep.send(welcome(64, hello.credits + 1))
        elif args.lie == "capacity":
            await ep.send(welcome(ucx_wire.CAPACITY_MAX, hello.credits))
        elif args.lie == "short":
            await ep.send(welcome(64, hello.credits))
            for seq, n in ((1, 64), (2, 8)):  # frame 2's pixel message is 8 bytes where its header says 64
                await ep.send(ucx_wire.pack_frame(gen, 0, seq, seq, spec, b"", inline=False))
                await ep.send(bytes([seq]) * n)
        else:
            await ep.send(welcome(64, hello.credits))
            for seq in (5, 3):
                await ep.send(ucx_wire.pack_frame(gen, 0, seq, seq, spec, b"", inline=True) + bytes([seq]) * 64)
        while True:
            await ep.send(ucx_wire.pack_ping())
            await asyncio.sleep(0.1)

    async def serve() -> None:
        listener = ucx_engine.core_here().listen(handler, args.port)
        print("listening", flush=True)
        await asyncio.sleep(60)
        del listener

    asyncio.run(serve())


def main() -> None:
    # a test's stop() terminates: leave through the Senders' close (at exit), not with their segments left in
    # /dev/shm for `clean` (a killed producer's, which some tests make on purpose, still are)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("producer")
    q.add_argument("name")
    q.add_argument("--frames", type=int, default=100)
    q.add_argument("--fps", type=float, default=200.0)
    q.add_argument("--shape", default="32,32,4")
    q.add_argument("--reshape", default="")
    q.add_argument("--every", type=int, default=100, help="frames between toggling --reshape")
    q.add_argument("--slots", type=int, default=8)
    q.add_argument("--policy", default="drop")
    q.add_argument("--report", action="store_true")
    q.add_argument("--linger", type=float, default=0.0)
    q.add_argument("--device", default="cpu")
    q.add_argument("--go-file", default="", help="send until this file exists, then --frames more (host only)")
    q = sub.add_parser("consumer")
    q.add_argument("url")
    q = sub.add_parser("reader")
    q.add_argument("url")
    q = sub.add_parser("gpu-consumer")
    q.add_argument("url")
    q.add_argument("--device", default="0")
    q.add_argument("--lib", default="torch")
    q.add_argument("--frames", type=int, default=100)
    q.add_argument("--until-gone", action="store_true")
    q.add_argument("--close", action="store_true", help="close the Receiver, then report its landing memory")
    q.add_argument("--stall", type=float, default=0.0, help="seconds to hold the GIL after the first frame")
    q = sub.add_parser("lying-server")
    q.add_argument("port", type=int)
    q.add_argument("lie", choices=["credits", "capacity", "seq", "short"])
    args = p.parse_args()
    run = {
        "producer": producer,
        "consumer": consumer,
        "reader": reader,
        "gpu-consumer": gpu_consumer,
        "lying-server": lying_server,
    }
    run[args.cmd](args)
    sys.exit(0)


if __name__ == "__main__":
    main()
