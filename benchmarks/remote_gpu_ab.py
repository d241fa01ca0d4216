"""GPU -> GPU over ``ucx://`` on one host (``cuda_ipc``): this checkout against another, rounds alternating.

Each run is ``cudalink.tools.remote_bench.cudalink_stream`` (a GPU producer with ``serve=``, its server, and a
``latest=False`` consumer on the same GPU, flat out) in a fresh process with the tree named on its
``PYTHONPATH``, so both trees see the same machine in turn.

    python benchmarks/remote_gpu_ab.py --other /tmp/old [--rounds 2] [--seconds 3] [--device 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"1080p": (1080, 1920, 4), "4K": (2160, 3840, 4)}
RUN = (
    "import json, sys; from cudalink.tools import remote_bench as rb; "
    "print(json.dumps(rb.cudalink_stream(tuple(json.loads(sys.argv[1])), float(sys.argv[2]), sys.argv[3])))"
)


def one(tree: str, shape: tuple[int, ...], seconds: float, device: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(shape), str(seconds), device],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="another checkout of cudalink (the tree before a change)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--device", default="0")
    a = ap.parse_args()
    for r in range(a.rounds):
        for label, tree in (("other", os.path.abspath(a.other)), ("this", HERE)):
            for name, shape in SHAPES.items():
                got = one(tree, shape, a.seconds, a.device)
                print(f"round {r + 1} {label:5s} {name:5s} {got['fps']:8.1f} fps {got['GBps']:6.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
