"""``recv`` + ``torch.from_dlpack`` over the cuda-link path against a cudalink link, in one run (GPU).

The parent sends a torch frame every 2 ms (the bench's cadence) on each path in turn; a spawned torch
consumer waits until a frame is there (``select`` on ``Receiver.fileno()``: the link's wake-up socket, or the
cuda-link source's poller thread), then times ``poll()`` + ``torch.from_dlpack`` (the bench's ``recv_export``:
"consumer takes a waiting frame and exports it") and, separately, ``release()``. Paths:

- ``cudalink``: ``Sender(name, device=0)`` -> ``Receiver(name)`` (IPC pool, zero copy, release fences);
- ``cuda-link copy``: ``Sender(..., protocol="cuda-link")`` -> ``Receiver("cuda-link:NAME")`` (the default:
  each frame copied on the GPU into a Receiver-owned landing buffer);
- ``cuda-link zero copy``: the same with ``copy="never"``.

Compare within one run only (lent machines differ run to run)::

    PYTHONPATH=. python benchmarks/cuda_link.py [--frames 1000] [--shape 1080,1920,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import statistics
import sys
import time
import uuid
from typing import Any

try:
    import cudalink  # noqa: F401
except ImportError:  # run from a checkout as ``python benchmarks/cuda_link.py``: the package is one folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PATHS = [
    ("cudalink", "cudalink", "auto"),
    ("cuda-link copy", "cuda-link", "auto"),
    ("cuda-link zero copy", "cuda-link", "never"),
]


def consumer(address: str, copy: str, n: int, q: Any) -> None:
    import torch

    import cudalink

    torch.zeros(1, device="cuda")
    rx = cudalink.Receiver(address, timeout=60, copy=copy)  # type: ignore[arg-type]
    fd = rx.fileno()
    q.put("ready")
    take: list[int] = []
    release: list[int] = []
    clock = time.perf_counter_ns
    try:
        while len(take) < n + 50:
            select.select([fd], [], [], 1.0)
            t0 = clock()
            f = rx.poll()
            if f is None:
                continue
            t = torch.from_dlpack(f)
            t1 = clock()
            del t
            f.release()
            t2 = clock()
            take.append(t1 - t0)
            release.append(t2 - t1)
        stats = rx.stats()  # while attached: its "path" says how the frames came (after close it cannot)
    except cudalink.LinkError as exc:
        q.put(("error", str(exc)))
        return
    finally:
        rx.close()
    q.put((take[50:], release[50:], stats))  # the first 50: warm-up (imports, first exports)


def run_path(protocol: str, copy: str, n: int, shape: tuple[int, ...]) -> dict[str, Any]:
    import torch

    import cudalink

    name = f"bench_cl_{uuid.uuid4().hex[:8]}"
    kw: dict[str, Any] = {"protocol": "cuda-link", "slots": 3} if protocol == "cuda-link" else {}
    address = "cuda-link:" + name if protocol == "cuda-link" else name
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with cudalink.Sender(name, shape=shape, dtype="uint8", device=0, **kw) as tx:
        p = ctx.Process(target=consumer, args=(address, copy, n, q))
        p.start()
        assert q.get(timeout=180) == "ready"
        src = [torch.full(shape, v, dtype=torch.uint8, device="cuda") for v in range(4)]
        s = torch.cuda.Stream()
        got: Any = None
        i = 0
        with torch.cuda.stream(s):
            next_t = time.perf_counter()
            while got is None:
                tx.send(src[i % 4])
                i += 1
                next_t += 0.002
                while (left := next_t - time.perf_counter()) > 0:
                    time.sleep(min(left, 0.0005))
                if not q.empty():
                    got = q.get()
        p.join(30)
    if got[0] == "error":
        raise RuntimeError(got[1])
    take, release, stats = got
    return {"take_export_ns": take, "release_ns": release, "stats": stats, "sent": i}


def pct(xs: list[int], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--shape", default="1080,1920,4")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    import torch

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "shape": shape, "frames": args.frames, "paths": {}}
    for label, protocol, copy in PATHS:
        out["paths"][label] = run_path(protocol, copy, args.frames, shape)
    base = statistics.median(out["paths"]["cudalink"]["take_export_ns"]) / 1e3
    print(f"{out['device']} · {'x'.join(map(str, shape))} uint8 · {args.frames} frames at 2 ms · p50/p90/p99 us")
    print(f"{'path':22} {'poll+from_dlpack':>24} {'vs cudalink p50':>16} {'release':>22} {'skipped':>8}")
    for label, r in out["paths"].items():
        t, rel = r["take_export_ns"], r["release_ns"]
        print(
            f"{label:22} {pct(t, 0.5):7.1f} {pct(t, 0.9):7.1f} {pct(t, 0.99):8.1f} "
            f"{pct(t, 0.5) / base:15.2f}x {pct(rel, 0.5):6.1f} {pct(rel, 0.9):6.1f} {pct(rel, 0.99):7.1f} "
            f"{r['stats'].get('skipped', 0):8d}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
