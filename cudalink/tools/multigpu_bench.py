"""``python -m cudalink bench --multi-gpu``: a consumer on GPU 1 of a producer on GPU 0, in the same run as a
consumer on GPU 0 and a bare torch ``.to("cuda:1")`` of the same frame.

Rows (p50/p99, microseconds, wall clock ``time.time_ns`` on both sides, from the frame's publish stamp):

- handoff: publish -> ``recv()`` returns, on GPU 0 (zero copy) and on GPU 1 (the copy into the landing pool is
  queued, not waited for);
- ready: publish -> the frame's data is usable on the consumer's GPU (the consumer's stream waited on the
  frame's event and was synchronised), the figure that contains the copy;
- copy bandwidth: the landing pool's copy (what ``Receiver(device=1)`` runs per frame) of a slot the consumer
  mapped from the producer, against torch's ``.to("cuda:1")`` of the same slot, 20 copies back to back, best
  of 7; and the landing copy of a plain torch tensor of this process, to tell an IPC-memory effect from a
  copy-path one.

Goals (issue 36): landing bandwidth >= 80% of ``.to("cuda:1")``; GPU 1's ready p50 <= 1.5x (GPU 0's ready p50 +
the bare copy's time for one frame).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from ..errors import LinkError
from .measure import summarize
from .ui import print_then_json

BATCH = 20
REPS = 7


def _producer(name: str, shape: tuple[int, ...], dtype: str, cadence: float, ready: Any, stop: Any) -> None:
    import torch

    import cudalink

    with cudalink.Sender(name, shape=shape, dtype=dtype, slots=4, device=0) as tx:
        src = torch.rand(shape, device="cuda:0").to(getattr(torch, dtype))
        torch.cuda.synchronize()
        ready.set()
        while not stop.is_set():
            tx.send(src)
            time.sleep(cadence)


def _consumer(name: str, device: int, frames: int, warm: int, bandwidth: bool, out: Any) -> None:
    """Receive on ``cuda:device``: handoff and ready times per frame; with ``bandwidth``, the copy rows."""
    import torch

    import cudalink

    try:
        torch.cuda.set_device(device)
        handoff: list[int] = []
        ready: list[int] = []
        with cudalink.Receiver(name, device=device, wait="block", timeout=20.0) as rx:
            s = torch.cuda.Stream(device=device)
            with torch.cuda.stream(s):
                for i in range(warm + frames):
                    f = rx.recv(timeout=10.0)
                    t1 = time.time_ns()
                    x = torch.from_dlpack(f)  # s waits on the frame's ready event (the copy's, on GPU 1)
                    s.synchronize()
                    t2 = time.time_ns()
                    if i >= warm:
                        handoff.append(t1 - f.timestamp_ns)
                        ready.append(t2 - f.timestamp_ns)
                    del x
                    f.release()
            path = str(rx.stats()["path"])
            result: dict[str, Any] = {
                "device": device,
                "path": path,
                "handoff": summarize(handoff),
                "ready": summarize(ready),
            }
            if bandwidth:
                f = rx.recv(timeout=10.0)
                result.update(_bandwidth(f))
                f.release()
        out.put(result)
    except Exception:
        import traceback

        out.put({"device": device, "error": traceback.format_exc()})


def _bandwidth(frame: Any) -> dict[str, Any]:
    """The landing copy and torch's ``.to("cuda:1")`` of the same mapped slot (and of a local tensor)."""
    import torch

    from ..cuda.landing import Landing

    nbytes = frame.nbytes
    slot = torch.from_dlpack(frame)  # zero copy: the producer's slot, mapped here (GPU 0)
    local = slot.clone()
    torch.cuda.synchronize(0)
    pool = Landing(1, nbytes, src_device=0, limit=2)
    s = pool.ops.copy_stream()

    def sync() -> None:
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    def best(run: Any) -> float:
        times = []
        for _ in range(REPS):
            sync()
            t0 = time.perf_counter()
            for _ in range(BATCH):
                run()
            sync()
            times.append((time.perf_counter() - t0) / BATCH)
        return min(times)

    def land(ptr: int) -> Any:
        def run() -> None:
            pool.land(ptr, nbytes, stream=s).give_back([])

        return run

    def to() -> None:
        slot.to("cuda:1")

    to_s = best(to)
    land_s = best(land(int(slot.data_ptr())))
    local_s = best(land(int(local.data_ptr())))
    out = {
        "nbytes": nbytes,
        "copy_path": pool.path,
        "torch_to_us": to_s * 1e6,
        "torch_to_gbps": nbytes / to_s / 1e9,
        "landing_us": land_s * 1e6,
        "landing_gbps": nbytes / land_s / 1e9,
        "landing_local_gbps": nbytes / local_s / 1e9,
    }
    pool.close()
    return out


def run(
    *, frames: int = 400, shape: tuple[int, ...] = (1080, 1920, 4), dtype: str = "float32", cadence: float = 0.004
) -> dict[str, Any]:
    """Both consumers in turn against one producer; returns the report (rows, goals, machine)."""
    from ..cuda import devices

    n = devices.count()
    if n < 2:
        raise LinkError(
            f"cudalink: bench --multi-gpu needs two GPUs; this machine has {n} ({devices.describe_visible()})"
        )
    try:
        import torch  # noqa: F401  (the consumers use it, and the bare copy is torch's)
    except ImportError as exc:
        raise LinkError("cudalink: bench --multi-gpu needs torch (its .to('cuda:1') is the reference)") from exc
    ctx = mp.get_context("spawn")
    name = f"mgbench-{os.getpid()}"
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    prod = ctx.Process(target=_producer, args=(name, shape, dtype, cadence, ready, stop), daemon=True)
    prod.start()
    try:
        if not ready.wait(120):
            raise LinkError("cudalink: the bench producer did not start within 120 s")
        rows: dict[str, Any] = {}
        for label, device, bw in (("gpu0", 0, False), ("gpu1", 1, False), ("bandwidth", 0, True)):
            frames_here = frames if not bw else 10
            p = ctx.Process(target=_consumer, args=(name, device, frames_here, 20, bw, out), daemon=True)
            p.start()
            rows[label] = out.get(timeout=600)
            p.join(60)
            if "error" in rows[label]:
                raise LinkError(f"cudalink: the {label} consumer failed:\n{rows[label]['error']}")
    finally:
        stop.set()
        prod.join(30)
        if prod.is_alive():
            prod.kill()
    bw = rows["bandwidth"]
    copy_us = float(bw["torch_to_us"])
    ratio_bw = float(bw["landing_gbps"]) / float(bw["torch_to_gbps"])
    ready0 = float(rows["gpu0"]["ready"]["p50"])
    ready1 = float(rows["gpu1"]["ready"]["p50"])
    ratio_ready = ready1 / (ready0 + copy_us)
    peer = devices.peer_matrix(2)
    return {
        "shape": list(shape),
        "dtype": dtype,
        "nbytes": int(np.prod(shape)) * np.dtype(dtype).itemsize,
        "frames": frames,
        "cadence_s": cadence,
        "gpus": [f"cuda:{i} {devices.name_at(i)} {devices.format_uuid(devices.uuid_at(i))}" for i in range(n)],
        "peer_access": peer,
        "rows": rows,
        "goals": {
            "copy_bandwidth_vs_torch_to": {"value": ratio_bw, "goal": ">= 0.8", "met": ratio_bw >= 0.8},
            "gpu1_ready_vs_gpu0_ready_plus_copy": {
                "value": ratio_ready,
                "goal": "<= 1.5",
                "met": ratio_ready <= 1.5,
                "gpu1_ready_p50_us": ready1,
                "gpu0_ready_p50_us": ready0,
                "copy_us": copy_us,
            },
        },
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    from .ui import _console

    console = _console()
    rows = report["rows"]
    t = Table(
        title=f"cross-GPU: {report['shape']} {report['dtype']} ({report['nbytes'] / 2**20:.1f} MiB), p50 / p99 µs"
    )
    t.add_column("consumer")
    t.add_column("path")
    t.add_column("handoff (publish → recv returns)")
    t.add_column("ready (publish → data usable there)")
    for label in ("gpu0", "gpu1"):
        r = rows[label]
        t.add_row(
            f"cuda:{r['device']}",
            r["path"],
            f"{r['handoff']['p50']:.1f} / {r['handoff']['p99']:.1f}",
            f"{r['ready']['p50']:.1f} / {r['ready']['p99']:.1f}",
        )
    console.print(t)
    bw = rows["bandwidth"]
    b = Table(title=f"copy of one frame, GPU 0 → GPU 1 ({bw['copy_path']}), best of {REPS} x {BATCH}")
    b.add_column("copy")
    b.add_column("µs")
    b.add_column("GB/s")
    b.add_row('torch .to("cuda:1") of the mapped slot', f"{bw['torch_to_us']:.1f}", f"{bw['torch_to_gbps']:.1f}")
    b.add_row("cudalink landing copy of the mapped slot", f"{bw['landing_us']:.1f}", f"{bw['landing_gbps']:.1f}")
    b.add_row("cudalink landing copy of a local tensor", "", f"{bw['landing_local_gbps']:.1f}")
    console.print(b)
    g = Table(title="goals (issue 36)")
    g.add_column("goal")
    g.add_column("value")
    g.add_column("target")
    g.add_column("met")
    for key, v in report["goals"].items():
        g.add_row(key, f"{v['value']:.2f}x", v["goal"], "yes" if v["met"] else "NO")
    console.print(g)


def cmd_multi_gpu(args: Any) -> int:
    """The ``bench --multi-gpu`` entry: run, print, and write ``--json`` where given."""
    report = run(frames=args.frames or 400)
    print_then_json(print_report, report, args.json)
    return 0 if all(v["met"] for v in report["goals"].values()) else 1
