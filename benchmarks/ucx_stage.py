"""Who stages GPU frames through host memory on a ``ucx://`` link without a GPU path: UCX or cudalink?

A GPU producer (``--producer 0``; ``cpu`` for host frames) serves a 1080p RGBA link; a consumer in this process
lands it on GPU 0. Per ``CUDALINK_UCX_STAGE`` mode given (``gpu``: UCX moves GPU memory and stages it itself
inside its progress calls; ``host``: cudalink copies into page-locked memory on its own streams; ``auto``: the
rule in ``ucx_engine.stage_on_host``), with and without another process keeping the GPU busy (8192² matmuls):

- fps flat out (``latest=False``, the producer reserving as fast as it can);
- latency p50/p99 at 100 fps offered (``latest=True``): the producer's stamp before ``reserve()`` -> the
  consumer's ``recv()`` returned, on the system-wide monotonic clock;
- the longest gap between two ``recv()`` returns, and ``stats()["reconnects"]``.

    UCX_TLS=tcp,cuda_copy python benchmarks/ucx_stage.py --modes gpu,host --rounds 2
    python benchmarks/ucx_stage.py --producer cpu --modes auto --rounds 1

Modes alternate order between rounds. Results: ``results/*ucx-stage*``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cudalink.tools import remote_bench as rb
from cudalink.transport import ucx_engine

BUSY = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda:0")
print("busy", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(4):
        b = a @ a
    torch.cuda.synchronize()
"""


def one(mode: str, period: float, seconds: float, producer: str) -> dict[str, Any]:
    port = ucx_engine.free_port()
    name = f"stage{os.getpid()}{time.monotonic_ns() % 10**6}"
    env = {"CUDALINK_UCX_STAGE": mode}
    p = rb._child("producer", name, "1080,1920,4", str(port), str(period), str(seconds + 30), producer, env=env)
    try:
        rb._wait_line(p, "ready")
        rx = rb.connect(port, name, device=0, latest=period != 0)
        lat: list[int] = []
        gaps: list[float] = []
        with rx:
            for _ in range(5):
                rx.recv(timeout=10).release()
            n = 0
            t0 = last = time.monotonic()
            while time.monotonic() - t0 < seconds:
                f = rx.recv(timeout=10)
                now = time.monotonic()
                lat.append(time.monotonic_ns() - rb.STAMP.unpack(f.meta)[1])
                f.release()
                gaps.append(now - last)
                last = now
                n += 1
            dt = time.monotonic() - t0
            stats = rx.stats()
        us = np.asarray(lat) / 1e3
        return {
            "fps": n / dt,
            "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)),
            "max_gap_ms": max(gaps) * 1e3,
            "reconnects": stats.get("reconnects"),
        }
    finally:
        p.terminate()
        p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--producer", default="0", help="the producer's device: a GPU ordinal, or cpu")
    ap.add_argument("--modes", default="gpu,host", help="CUDALINK_UCX_STAGE values, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("CUDALINK_KEY", secrets.token_hex(32))
    modes = args.modes.split(",")
    print(f"UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')} producer={args.producer}", flush=True)
    for busy in (False, True):
        hog = None
        if busy:
            hog = subprocess.Popen([sys.executable, "-c", BUSY, "600"], stdout=subprocess.PIPE, text=True)
            assert hog.stdout is not None and hog.stdout.readline().startswith("busy")
        try:
            for rnd in range(args.rounds):
                for mode in modes if rnd % 2 == 0 else modes[::-1]:
                    for period in (0.0, 0.01):
                        r = one(mode, period, args.seconds, args.producer)
                        cells = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
                        print(f"busy={busy} round={rnd} stage={mode} period={period}: {cells}", flush=True)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()


if __name__ == "__main__":
    main()
