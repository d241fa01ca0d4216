"""Two trees of cudalink, one machine, interleaved: is a change faster or slower per frame?

Lent machines differ by more than most changes, so compare code only within one run. Build each tree
(``python setup.py build_ext --inplace``), then, for example::

    for i in 1 2 3; do
      PYTHONPATH=/tmp/old python benchmarks/ab.py old --device 0
      PYTHONPATH=.        python benchmarks/ab.py new --device 0
    done

In one process, 1080p uint8: ``send()``, then ``poll()`` + export (torch on a GPU, numpy on the CPU),
then ``release()``; p50 over the frames after a warm-up. Hot caches: this compares code, not the
cold-cache latency the bench's goals measure.

``--cold`` (CPU) is an in-process proxy for the bench's CPU goal: after each send it touches 16 MB to
evict the caches, then alternates cudalink's ``poll`` + ``np.from_dlpack`` + ``release`` with the bare
floor (a numpy view of the same slot, made and read), and prints both p50s and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import cudalink


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--device", default="cpu", help="'cpu' or a CUDA ordinal")
    ap.add_argument("--frames", type=int, default=4000)
    ap.add_argument("--cold", action="store_true", help="CPU: evict caches per frame, pair with the bare view")
    args = ap.parse_args()
    if args.cold:
        cold(args.label, args.frames)
        return
    shape = (1080, 1920, 4)
    device: str | int = "cpu" if args.device == "cpu" else int(args.device)
    if device == "cpu":
        src: object = np.zeros(shape, np.uint8)
        export = np.from_dlpack
        sync = None
    else:
        import torch

        src = torch.zeros(shape, dtype=torch.uint8, device=f"cuda:{device}")
        export = torch.from_dlpack
        sync = torch.cuda.synchronize
    name = f"ab{os.getpid()}"
    send, recv, rel = [], [], []
    with cudalink.Sender(name, shape=shape, dtype="uint8", device=device) as tx, cudalink.Receiver(name) as rx:
        for i in range(args.frames):
            t0 = time.perf_counter_ns()
            tx.send(src)
            t1 = time.perf_counter_ns()
            f = rx.poll()
            assert f is not None
            x = export(f)
            t2 = time.perf_counter_ns()
            del x
            f.release()
            t3 = time.perf_counter_ns()
            if i >= args.frames // 10:
                send.append(t1 - t0)
                recv.append(t2 - t1)
                rel.append(t3 - t2)
            if sync is not None and i % 64 == 0:
                sync()

    def p50(v: list[int]) -> float:
        return round(statistics.median(v) / 1000, 2)

    print(f"{args.label}: send {p50(send)}  poll+export {p50(recv)}  release {p50(rel)}  (us p50, in-process)")


def cold(label: str, frames: int) -> None:
    shape = (1080, 1920, 4)
    src = np.zeros(shape, np.uint8)
    big = np.ones(16 << 20, np.uint8)
    name = f"ab{os.getpid()}"
    ours: list[int] = []
    bare: list[int] = []
    mono = time.perf_counter_ns
    with cudalink.Sender(name, shape=shape, dtype="uint8", device="cpu") as tx, cudalink.Receiver(name) as rx:
        tx.send(src)
        first = rx.poll()
        assert first is not None
        first.release()
        att = rx._att  # the bench's floor reads the mapped region the frames point into; users never need it
        assert att is not None
        region = att.view.region  # type: ignore[attr-defined]  # a HostView: host links only
        offsets = [h.size for h in att.handles]  # a host slot's handle carries its offset in the region
        for i in range(frames):
            tx.send(src)
            big[::64] += 1
            if i % 2:
                t0 = mono()
                a = np.ndarray(shape, np.uint8, buffer=region.buf, offset=offsets[i % len(offsets)])
                _ = a[0, 0, 0]
                t1 = mono()
                del a
                bare.append(t1 - t0)
            else:
                t0 = mono()
                f = rx.poll()
                assert f is not None
                x = np.from_dlpack(f)
                t1 = mono()
                del x
                t2 = mono()
                f.release()
                del f
                t3 = mono()
                ours.append(t3 - t0 - (t2 - t1))  # the framework freeing its array is not cudalink's
    a50 = statistics.median(ours[len(ours) // 10 :]) / 1000
    b50 = statistics.median(bare[len(bare) // 10 :]) / 1000
    print(f"{label}: poll+export+release {a50:.2f}  bare view {b50:.2f}  ratio {a50 / b50:.2f}x  (us p50, cold)")


if __name__ == "__main__":
    main()
