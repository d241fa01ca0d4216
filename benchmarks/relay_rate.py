"""A relay's rate, two ways side by side: each remote frame landed in a slot of the local link (``relay``'s
default, issue 33's "straight into a relay's slot through reserve()") or landed in the Receiver's own buffers
and copied into the local link with ``send()`` (``land=False``: what the relay did before, and what it still
does for sources other than ``ucx://``).

One producer process (``Sender(serve=)``, host frames unless ``--producer``, flat out) serves all rounds. Each
round starts a relay process of one kind, for ``--seconds``, and a local consumer (``latest=True``) in this
process that counts the frames it gets once the first has come. The kinds alternate round by round, so both
see the same machine.
Reported per kind: the consumer's frames per second and the relay process's CPU time per relayed frame (all its
threads: ``time.process_time``), as medians over the rounds.

    python benchmarks/relay_rate.py [--shape 1080x1920x4] [--seconds 4] [--rounds 3] [--device cpu|0]

``--device 0``: the relay lands on GPU 0 (host bytes from the network go through its page-locked buffer), and
the consumer reads the GPU link. ``--producer 0``: the producer's frames are on GPU 0, so with ``--device 0`` and
``cuda_ipc`` in ``UCX_TLS`` (or UCX's choice) UCX writes them into the relay's slots itself.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("x"))


def producer(name: str, port: int, shape: tuple[int, ...], device: str, ready: mp.Event, stop: mp.Event) -> None:  # type: ignore[valid-type]
    import cudalink

    frames: list[object] = [np.full(shape, v, np.uint8) for v in (1, 2)]
    dev: int | str = int(device) if device.isdigit() else device
    if dev != "cpu":  # a GPU link takes GPU arrays: torch's, else cupy's
        try:
            import torch

            frames = [torch.from_numpy(f).to(f"cuda:{dev}") for f in frames]  # type: ignore[arg-type]
        except ImportError:
            import cupy

            with cupy.cuda.Device(dev):
                frames = [cupy.asarray(f) for f in frames]
    with cudalink.Sender(name, shape=shape, slots=8, device=dev, serve=f"ucx://127.0.0.1:{port}") as tx:
        ready.set()  # type: ignore[attr-defined]
        while not stop.is_set():  # type: ignore[attr-defined]
            seq = tx.seq + 1
            tx.send(frames[seq & 1], meta=struct.pack("<Q", seq))


def relay_proc(url: str, local: str, device: str, seconds: float, land: bool, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from cudalink.tools.relay import relay

    dev: int | str = int(device) if device.isdigit() else device
    t0 = time.process_time()
    n = relay(url, local, device=dev, seconds=seconds, quiet=True, land=land)
    out.put({"relayed": n, "cpu_s": time.process_time() - t0})


def one_round(url: str, local: str, args: argparse.Namespace, land: bool) -> dict[str, float]:
    import cudalink

    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    p = ctx.Process(target=relay_proc, args=(url, local, args.device, args.seconds, land, q))
    p.start()
    got = 0
    first = last = 0.0
    bad = 0
    end = time.monotonic() + args.seconds + 10.0
    with cudalink.Receiver(local, latest=True, timeout=0.2, connect=False) as rx:
        while time.monotonic() < end:
            try:
                f = rx.recv(timeout=0.5)
            except (cudalink.LinkTimeout, cudalink.ProducerGone):
                if got:
                    break  # the relay's seconds are over
                continue
            with f:
                seq = struct.unpack("<Q", f.meta)[0]
                if f.device == "cpu" or got % 16 == 0:  # a GPU frame's read-back would be the consumer's limit
                    v = int(np.asarray(f.to_numpy() if f.device != "cpu" else f.numpy()).reshape(-1)[-1])
                    bad += int(v != (2 if seq & 1 else 1))  # the producer sends frames[seq & 1]
                now = time.monotonic()
                if not got:
                    first = now
                got += 1
                last = now
    p.join(30)
    res = q.get(timeout=5)
    fps = (got - 1) / (last - first) if got > 1 and last > first else 0.0
    return {"fps": fps, "cpu_us": 1e6 * res["cpu_s"] / max(1, res["relayed"]), "relayed": res["relayed"], "bad": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1080x1920x4")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--producer", default="cpu", help="the producer device: 0 sends GPU frames")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    from cudalink.transport import ucx_engine

    shape = _shape(args.shape)
    name = f"relayrate{os.getpid()}"
    port = ucx_engine.free_port()
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    prod = ctx.Process(target=producer, args=(name, port, shape, args.producer, ready, stop))
    prod.start()
    if not ready.wait(60):
        raise SystemExit("the producer did not start")
    url = f"ucx://127.0.0.1:{port}/{name}"
    rows: dict[str, list[dict[str, float]]] = {"slot": [], "copy": []}
    try:
        for r in range(args.rounds):
            for kind in ("slot", "copy") if r % 2 == 0 else ("copy", "slot"):
                row = one_round(url, f"{name}{kind}{r}", args, land=kind == "slot")
                rows[kind].append(row)
                print(f"round {r + 1} {kind:4}: {row['fps']:7.1f} fps, relay CPU {row['cpu_us']:7.0f} us/frame, "
                      f"relayed {row['relayed']}, bad {row['bad']}", flush=True)  # fmt: skip
    finally:
        stop.set()
        prod.join(30)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("fps", "cpu_us")} for k, v in rows.items()}
    tls = os.environ.get("UCX_TLS", "(UCX's choice)")
    print(
        f"\nrelay of {args.shape} uint8 frames from {args.producer} to {args.device}, UCX_TLS={tls}, "
        f"medians of {args.rounds}:"
    )
    for k, label in (("slot", "landed in the local link's slots"), ("copy", "landed, then copied with send()")):
        print(f"  {label:34} {med[k]['fps']:7.1f} fps   relay CPU {med[k]['cpu_us']:7.0f} us/frame")
    if med["copy"]["fps"]:
        print(f"  slots/copy: {med['slot']['fps'] / med['copy']['fps']:.2f}x the frames, "
              f"{med['slot']['cpu_us'] / med['copy']['cpu_us']:.2f}x the CPU per frame")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows, "medians": med}, fh, indent=1)


if __name__ == "__main__":
    main()
