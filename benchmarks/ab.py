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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
