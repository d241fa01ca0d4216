"""GPU child processes (spawned) for the cuda-link tests: cudalink's cuda-link writer, and readers that verify
every frame on the device through torch, cupy or jax."""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cudalink

from ._content import pattern
from ._gpu_procs import INT_VIEW


def cl_producer(
    name: str,
    n: int,
    shape: tuple[int, ...],
    dtype: str,
    go: Any,
    every: float = 0.002,
    base: int = 0,
    slots: int = 3,
) -> None:
    """Once ``go`` is set: create the cuda-link Sender, publish ``n`` frames (pattern of ``seq + base``) every
    ``every`` s, then close (shutdown flag, grace, unlink)."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    go.wait(120)
    with cudalink.Sender(name, shape=shape, dtype=dtype, slots=slots, device=0, protocol="cuda-link") as tx:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for seq in range(1, n + 1):
                tx.send(pattern(seq + base, shape, dtype, torch))
                time.sleep(every)
        s.synchronize()


def cl_producer_forever(name: str, shape: tuple[int, ...], ready: Any) -> None:
    import torch

    torch.cuda.init()
    with cudalink.Sender(name, shape=shape, dtype="uint8", slots=3, device=0, protocol="cuda-link") as tx:
        ready.set()
        seq = 0
        while True:
            seq += 1
            tx.send(pattern(seq, shape, "uint8", torch))
            time.sleep(0.005)


def cl_consumer(
    name: str,
    framework: str,
    result: Any,
    started: Any,
    hold_s: float = 0.0,
    copy: str = "auto",
    bases: dict[tuple[int, ...], int] | None = None,
) -> None:
    """Load the framework, set ``started``, attach (waiting for the segment), then verify each frame against
    the pattern of its seq (plus the base its shape names) on the GPU, holding
    each ``hold_s`` seconds before reading it; report (framework, frames, mismatches, stale frames,
    generations, stats, how it ended, error).

    ProducerGone once ends the run unless ``bases`` names several producers (a restart test): then the run ends
    at the second ProducerGone or a timeout, and frames of a shape not seen last are counted as stale."""
    got = mism = stale = 0
    gens: list[int] = []
    shapes_seen: list[tuple[int, ...]] = []
    gone = 0
    ended = ""
    try:
        if framework == "torch":
            import torch

            s = torch.cuda.Stream()
            bad = torch.zeros((), dtype=torch.int64, device="cuda")
        elif framework == "cupy":
            import cupy as cp

            s = cp.cuda.Stream(non_blocking=True)
            bad = cp.zeros((), dtype=cp.int64)
        else:
            import jax
            import jax.numpy as jnp

            jnp.zeros(1).block_until_ready()
        started.set()  # frameworks loaded: the producer may start (the Receiver waits for its segment)
        with cudalink.Receiver("cuda-link:" + name, timeout=60.0, copy=copy) as rx:  # type: ignore[arg-type]
            while True:
                try:
                    frame = rx.recv(timeout=10.0)
                except cudalink.ProducerGone:
                    gone += 1
                    if bases is None or gone >= 2:
                        ended = "gone"
                        break
                    continue
                except cudalink.LinkTimeout:
                    ended = "timeout"
                    break
                shape = frame.shape
                if rx.generation not in gens:
                    gens.append(rx.generation)
                    shapes_seen.append(shape)
                elif shape != shapes_seen[-1]:
                    stale += 1
                base = (bases or {}).get(shape, 0)
                dt = frame.dtype.name
                if framework == "torch":
                    with torch.cuda.stream(s):
                        t = torch.from_dlpack(frame)
                        if hold_s:
                            s.synchronize()
                            time.sleep(hold_s)  # the producer sends meanwhile: a held frame must not change
                        exp = pattern(frame.seq + base, tuple(t.shape), dt, torch)
                        iv = getattr(torch, INT_VIEW[dt])
                        bad += (t.view(iv) != exp.view(iv)).any().to(torch.int64)
                        del t, exp
                elif framework == "cupy":
                    with s:
                        a = cp.from_dlpack(frame)
                        if hold_s:
                            s.synchronize()
                            time.sleep(hold_s)
                        exp = pattern(frame.seq + base, a.shape, dt, cp)
                        iv = INT_VIEW[dt]
                        bad += cp.any(a.view(iv) != exp.view(iv)).astype(cp.int64)
                        del a
                else:
                    x = jax.dlpack.from_dlpack(frame)
                    if hold_s:
                        x.block_until_ready()
                        time.sleep(hold_s)
                    exp = pattern(frame.seq + base, tuple(x.shape), dt)
                    if not bool(jnp.array_equal(x, jnp.asarray(exp))):
                        mism += 1
                    del x
                frame.release()
                got += 1
            if framework == "torch":
                s.synchronize()
                mism = int(bad.item())
            elif framework == "cupy":
                s.synchronize()
                mism = int(bad.get())
        result.put((framework, got, mism, stale, len(gens), rx.stats(), ended, ""))
    except Exception:
        import traceback

        result.put((framework, got, -1, stale, len(gens), {}, ended, traceback.format_exc()))
