"""The remote handoff and its floor at the same time: is ``ucx://`` slower than bare UCXX, or was the machine?

``bench --remote`` times cudalink, then the bare UCXX floor, one after the other. On one lent H100 the bare
floor alone moved from 264 to 484 µs p50 within minutes (2026-11-25), more than most changes move the
handoff. Here every pipeline runs at once, each sending one frame per ``--period`` on one grid of the
system-wide monotonic clock, phase-shifted by a share of the period, so all see the same machine; frame k
of each is read against frame k of the others.

Pipelines (three processes each for cudalink: producer with ``serve=``, its server, the consumer; two for
the floor: a bare UCXX sender and receiver, the same bytes as one message, its receive posted ahead):

- ``this``: cudalink from this checkout;
- ``other`` (``--other PATH``): cudalink from another checkout, for a change's A/B;
- ``bare``: the floor, on UCXX's core API woken by its epoll fd, as cudalink drives it;
- ``asyncio``: the same on UCXX's asyncio API (its progress and notifier threads), read against ``bare``.

    python benchmarks/remote_paired.py [--frames 2000] [--shape 64x64x4] [--other /tmp/old] [--json out.json]
    python benchmarks/remote_paired.py --wait spin   # the cudalink consumers' wait mode (default block)
    CUDALINK_UCX_PROGRESS=thread-polling python benchmarks/remote_paired.py   # the asyncio floor's mode

``UCX_TLS`` is left to the caller, as in ``bench --remote``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = 20


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("x"))


def _sleep_to(t: float) -> None:
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)


def producer(name: str, port: int, shape: str, t0: float, off: str, period: float, n: int) -> None:
    import cudalink
    from cudalink.tools.remote_bench import STAMP

    offs = [float(x) for x in off.split("/")]  # frame k at the k-th of these phases, in turn (see run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped by its consumer: close the link on the way out
    src = np.zeros(_shape(shape), np.uint8)
    with cudalink.Sender(name, shape=src.shape, slots=4, device="cpu", serve=f"ucx://127.0.0.1:{port}") as tx:
        sys.stdout.write("ready\n")  # one write: a server we spawned shares this stdout
        sys.stdout.flush()
        for k in range(n):
            _sleep_to(t0 + offs[k % len(offs)] + k * period)
            tx.send(src, meta=STAMP.pack(k, time.monotonic_ns()))
        time.sleep(2.0)


def consumer(shape: str, t0: float, off: str, period: float, n: int, wait: str = "block") -> dict[int, float]:
    """Spawn a producer of this tree and receive its ``n`` frames remotely: latency (µs) per frame number.

    It runs against other checkouts too (``--other``), so it uses only what every one of them has:
    ``Receiver``, ``remote_bench.STAMP``/``HEAD_BYTES`` and ``ucx_engine``; hence its own connect loop."""
    import cudalink
    from cudalink.tools.remote_bench import STAMP
    from cudalink.transport import ucx_engine

    port = ucx_engine.free_port()
    name = f"paired{os.getpid()}"
    args = [name, str(port), shape, repr(t0), off, repr(period), str(n)]
    p = subprocess.Popen([sys.executable, __file__, "producer", *args], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        for line in p.stdout:  # its server's own lines may come first (it shares the producer's stdout)
            if line.startswith("ready"):
                break
        deadline = time.monotonic() + 30
        while True:
            try:
                rx = cudalink.Receiver(f"ucx://127.0.0.1:{port}/{name}", timeout=2.0, device="cpu", wait=wait)
                break
            except cudalink.LinkTimeout:
                if time.monotonic() > deadline:
                    raise
        lat: dict[int, float] = {}
        with rx:
            while True:
                try:
                    f = rx.recv(timeout=max(2.0, t0 - time.monotonic() + 2.0))
                except cudalink.LinkTimeout:
                    break
                now = time.monotonic_ns()
                k, stamp = STAMP.unpack(f.meta)
                f.release()
                lat[k] = (now - stamp) / 1e3
                if k >= n - 1:
                    break
        return lat
    finally:
        p.terminate()
        p.wait(10)


def bare_sender(port: int, nbytes: int, t0: float, off: float, period: float, n: int, api: str) -> None:
    from cudalink.tools.remote_bench import HEAD_BYTES, STAMP, _endpoint

    async def main() -> None:
        ep = await _endpoint(api, port)
        whole = bytearray(HEAD_BYTES + nbytes)
        for k in range(n):
            d = t0 + off + k * period - time.monotonic()
            if d > 0:
                await asyncio.sleep(d)
            STAMP.pack_into(whole, 0, k, time.monotonic_ns())
            await ep.send(whole)
        await ep.recv(bytearray(8))

    asyncio.run(main())


def bare(shape: str, t0: float, off: float, period: float, n: int, api: str = "core") -> dict[int, float]:
    """The floor: a bare UCXX receiver on cudalink's engine loop, its sender in another process; on UCXX's
    core API as cudalink drives it (``core``), or on its asyncio API (``asyncio``)."""
    from cudalink.tools.remote_bench import HEAD_BYTES, STAMP, _listener
    from cudalink.transport import ucx_engine

    eng = ucx_engine.engine()
    port = ucx_engine.free_port()
    nbytes = int(np.prod(_shape(shape)))
    lat: dict[int, float] = {}
    listening = threading.Event()

    async def serve() -> None:
        done = asyncio.get_running_loop().create_future()

        async def handler(ep: Any) -> None:
            whole = bytearray(HEAD_BYTES + nbytes)
            for _ in range(n):
                await ep.recv(whole)
                now = time.monotonic_ns()
                k, stamp = STAMP.unpack_from(whole)
                lat[k] = (now - stamp) / 1e3
            await ep.send(bytearray(8))
            done.set_result(None)

        listener = _listener(api, handler, port)
        listening.set()
        try:
            await done
        finally:
            del listener

    fut = eng.submit(serve())
    listening.wait(30)
    args = [str(port), str(nbytes), repr(t0), repr(off), repr(period), str(n), api]
    p = subprocess.Popen([sys.executable, __file__, "bare-sender", *args])
    try:
        fut.result(n * period + 120)
    finally:
        p.wait(30)
    return lat


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs)
    return {f"p{q}_us": float(np.percentile(a, q)) for q in (50, 90, 99)}


def run(
    frames: int, shape: str, period: float, other: str | None, lead: float = 15.0, wait: str = "block"
) -> dict[str, Any]:
    """``lead``: seconds from now to the grid's first frame, for every pipeline to connect; ``wait``: the
    cudalink consumers' wait mode."""
    os.environ.setdefault("CUDALINK_KEY", secrets.token_hex(32))  # this run's own key, for every child
    trees = {"this": HERE, **({"other": os.path.abspath(other)} if other else {})}
    names = [*trees, "bare", "asyncio"]
    n = frames + WARM
    t0 = time.monotonic() + lead
    procs = {}
    for i, name in enumerate(names):
        tree = trees.get(name, HERE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
        role = "consumer" if name in trees else "bare"
        if role == "consumer":  # the cudalink pipelines take their phases in turn, frame by frame: an A/A
            # run (one tree as both) read "this" 15% slower than "other" with fixed phases (2-vCPU VM, 2026-11-26)
            turns = [repr(period * ((i + k) % len(trees)) / len(names)) for k in range(len(trees))]
            off = "/".join(turns)
        else:
            off = repr(period * i / len(names))
        args = [role, shape, repr(t0), off, repr(period), str(n)]
        args += [wait] if role == "consumer" else ["core" if name == "bare" else "asyncio"]
        procs[name] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args], cwd=tree, env=env, stdout=subprocess.PIPE, text=True
        )
    got: dict[str, dict[int, float]] = {}
    for name, p in procs.items():
        text, _ = p.communicate(timeout=n * period + 240)
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"remote_paired: the {name!r} pipeline returned nothing (exit {p.returncode})")
        got[name] = {int(k): v for k, v in json.loads(lines[-1][7:]).items()}
    keys = [k for k in range(WARM, n) if all(k in g for g in got.values())]
    out: dict[str, Any] = {
        "shape": shape,
        "period_s": period,
        "frames": len(keys),
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX's choice)"),
        "progress": os.environ.get("CUDALINK_UCX_PROGRESS", "thread"),  # the asyncio floor's
        "wait": wait,
        "trees": trees,
        "pipelines": {name: _pct([g[k] for k in keys]) for name, g in got.items()},
        "quarters": [],
    }
    floor = out["pipelines"]["bare"]["p50_us"]
    out["ratio_p50"] = {name: out["pipelines"][name]["p50_us"] / floor for name in [*trees, "asyncio"]}
    q = max(1, len(keys) // 4)
    for i in range(4):
        part = keys[i * q : (i + 1) * q]
        if part:
            out["quarters"].append({name: float(np.percentile([g[k] for k in part], 50)) for name, g in got.items()})
    return out


def report(r: dict[str, Any]) -> None:
    print(
        f"remote handoff, paired · {r['shape']} every {r['period_s'] * 1e3:g} ms · {r['frames']} frames in every "
        f"pipeline · UCX_TLS={r['ucx_tls']} · progress={r['progress']} · wait={r.get('wait', 'block')}"
    )
    print(f"{'pipeline':<8} {'p50 µs':>8} {'p90 µs':>8} {'p99 µs':>8} {'p50 / bare':>11}")
    for name, s in r["pipelines"].items():
        ratio = r["ratio_p50"].get(name)
        cell = f"{ratio:.2f}x" if name != "bare" and ratio is not None else "floor"
        print(f"{name:<8} {s['p50_us']:>8.0f} {s['p90_us']:>8.0f} {s['p99_us']:>8.0f} {cell:>11}")
    print(
        "p50 by quarter of the run: "
        + " | ".join(" ".join(f"{k} {v:.0f}" for k, v in q.items()) for q in r["quarters"])
    )


def main() -> None:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    a = sys.argv[2:]
    if role == "producer":
        producer(a[0], int(a[1]), a[2], float(a[3]), a[4], float(a[5]), int(a[6]))
    elif role == "consumer":  # the sixth argument: its wait mode
        lat = consumer(a[0], float(a[1]), a[2], float(a[3]), int(a[4]), *a[5:6])
        print("RESULT " + json.dumps(lat), flush=True)
    elif role == "bare":  # the sixth argument: the floor's API
        lat = bare(a[0], float(a[1]), float(a[2]), float(a[3]), int(a[4]), *a[5:6])
        print("RESULT " + json.dumps(lat), flush=True)
    elif role == "bare-sender":
        bare_sender(int(a[0]), int(a[1]), float(a[2]), float(a[3]), float(a[4]), int(a[5]), a[6])
    else:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--frames", type=int, default=2000)
        ap.add_argument("--shape", default="64x64x4", help="HxWxC uint8 (default 64x64x4)")
        ap.add_argument("--period", type=float, default=0.005, help="seconds between frames (default 0.005)")
        ap.add_argument("--other", help="another cudalink checkout, run beside this one")
        ap.add_argument("--lead", type=float, default=15.0, help="seconds for the pipelines to connect (15)")
        ap.add_argument("--wait", default="block", choices=("block", "hybrid", "spin"), help="cudalink consumers'")
        ap.add_argument("--json", help="write the report here")
        ns = ap.parse_args()
        r = run(ns.frames, ns.shape, ns.period, ns.other, ns.lead, ns.wait)
        report(r)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(r, f, indent=2)
    sys.stdout.flush()
    os._exit(0)  # UCX's threads can keep an interpreter from exiting


if __name__ == "__main__":
    main()
