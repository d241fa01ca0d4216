"""Where ``send()``'s first two breakdown stages go on a GPU: claim + fence check, and reading the tensor.

A producer sends a 1080p uint8 torch tensor every 2 ms to a spawned torch consumer (so release fences
exist), with timers wrapped around the functions ``send()`` calls, and each torch call of
``arrays.fast_source`` timed on its own. The timers add a little to every figure; compare within a run.

    PYTHONPATH=. python benchmarks/send_split.py
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def consumer(name: str, q: Any) -> None:
    import torch

    import cudalink

    rx = cudalink.Receiver(name, wait="block", timeout=10)
    q.put("ready")
    n = 0
    try:
        while True:
            f = rx.recv()
            t = torch.from_dlpack(f)
            del t
            f.release()
            n += 1
    except cudalink.LinkError:
        q.put(n)


def main() -> None:
    import torch

    import cudalink
    from cudalink.cuda import arrays, driver

    name = f"split{int(time.time()) % 100000}"
    tx = cudalink.Sender(name, shape=(1080, 1920, 4), dtype="uint8", device=0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=consumer, args=(name, q))
    p.start()
    q.get(timeout=120)
    time.sleep(1)
    times: dict[str, list[int]] = {}
    mono = time.perf_counter_ns

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            t0 = mono()
            r = fn(*a, **k)
            times.setdefault(label, []).append(mono() - t0)
            return r

        return wrapped

    ring: Any = tx._ring
    sender: Any = tx
    driver.event_done = timed("cuEventQuery (driver.event_done)", driver.event_done)
    ring.take_fences = timed("ring.take_fences", ring.take_fences)
    ring.claim = timed("ring.claim", ring.claim)
    sender._fences = timed("Sender._fences, all of it", sender._fences)
    sender._claim = timed("Sender._claim, all of it", sender._claim)
    source = arrays.fast_source

    def fast_source(obj: Any, want: Any) -> Any:
        t = obj
        marks = [mono()]
        _ = type(obj).__module__
        marks.append(mono())
        dev = t.get_device()
        marks.append(mono())
        t.is_contiguous()
        marks.append(mono())
        _ = t.dtype
        marks.append(mono())
        torch._C._cuda_getCurrentRawStream(dev)
        marks.append(mono())
        t.data_ptr()
        marks.append(mono())
        tuple(t.shape)
        marks.append(mono())
        calls = ("type.__module__", "get_device()", "is_contiguous()", "dtype", "_cuda_getCurrentRawStream",
                 "data_ptr()", "tuple(shape)")  # fmt: skip
        for label, a, b in zip(calls, marks, marks[1:], strict=False):
            times.setdefault("  torch " + label, []).append(b - a)
        t0 = mono()
        r = source(obj, want)
        times.setdefault("arrays.fast_source, right after", []).append(mono() - t0)
        return r

    arrays.fast_source = fast_source  # type: ignore[assignment]
    src = torch.zeros((1080, 1920, 4), dtype=torch.uint8, device="cuda")
    sends: list[int] = []
    nxt = time.monotonic()
    for _ in range(2000):
        nxt += 0.002
        time.sleep(max(0.0, nxt - time.monotonic()))
        t0 = mono()
        tx.send(src)
        sends.append(mono() - t0)
    tx.close()
    print("consumer got", q.get(timeout=60), "frames")
    p.join(10)
    print(f"{'send(), with the timers inside':40s} p50 {statistics.median(sends[200:]) / 1000:7.1f} us")
    for label, v in times.items():
        v = v[len(v) // 10 :]
        p50, p90 = statistics.median(v) / 1000, float(np.percentile(v, 90)) / 1000
        print(f"{label:40s} p50 {p50:7.1f} us  p90 {p90:7.1f}  n={len(v)}")


if __name__ == "__main__":
    main()
