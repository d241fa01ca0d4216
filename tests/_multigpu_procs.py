"""Child processes (spawned) for the multi-GPU tests: consumers that receive on a chosen GPU and verify there.

The producer is ``_gpu_procs``' (a torch producer on GPU 0 writing ``_content.pattern(seq)``). Each consumer
makes the expected pattern on the GPU it receives on, so a frame on the wrong GPU, a torn copy or a stale one
all count as mismatches.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cudalink

from ._content import pattern
from ._gpu_procs import wait_consumers


def mg_consumer(
    name: str,
    framework: str,
    device: int,
    result: Any,
    latest: bool = False,
    slow_cycles: int = 0,
    copy: str = "auto",
) -> None:
    """Receive on ``cuda:device`` until the producer leaves; report (framework, device, got, mismatches, path,
    frames on the wrong device, error)."""
    got = wrong = 0
    path = "?"
    where = f"cuda:{device}"
    try:
        with cudalink.Receiver(name, timeout=60.0, latest=latest, device=device, copy=copy) as rx:  # type: ignore[arg-type]
            if framework == "torch":
                import torch

                torch.cuda.set_device(device)
                s = torch.cuda.Stream(device=device)
                bad = torch.zeros((), dtype=torch.int64, device=where)
                with torch.cuda.stream(s):
                    while True:
                        try:
                            frame = rx.recv(timeout=20.0)
                        except cudalink.ProducerGone:
                            break
                        if got == 0:
                            path = str(rx.stats()["path"])
                        t = torch.from_dlpack(frame)
                        wrong += frame.device != where or t.device.index != device
                        if slow_cycles:
                            torch.cuda._sleep(slow_cycles)  # the frame must not change under this kernel
                        exp = pattern(frame.seq, tuple(t.shape), "uint8", torch)
                        bad += (t != exp).any().to(torch.int64)
                        del t, exp
                        frame.release()  # CPU-side, with our kernels still queued: the fence guards the buffer
                        got += 1
                    s.synchronize()
                mism = int(bad.item())
            elif framework == "cupy":
                import cupy as cp

                with cp.cuda.Device(device):
                    s = cp.cuda.Stream(non_blocking=True)
                    bad = cp.zeros((), dtype=cp.int64)
                    with s:
                        while True:
                            try:
                                frame = rx.recv(timeout=20.0)
                            except cudalink.ProducerGone:
                                break
                            if got == 0:
                                path = str(rx.stats()["path"])
                            a = cp.from_dlpack(frame)
                            wrong += frame.device != where or a.device.id != device
                            exp = pattern(frame.seq, a.shape, "uint8", cp)
                            bad += cp.any(a != exp).astype(cp.int64)
                            del a
                            frame.release()
                            got += 1
                        s.synchronize()
                    mism = int(bad.get())
            else:
                import jax
                import jax.numpy as jnp

                mism = 0
                while True:
                    try:
                        frame = rx.recv(timeout=20.0)
                    except cudalink.ProducerGone:
                        break
                    if got == 0:
                        path = str(rx.stats()["path"])
                    x = jax.dlpack.from_dlpack(frame)
                    dev = next(iter(x.devices()))
                    wrong += frame.device != where or dev.id != device
                    exp = jax.device_put(pattern(frame.seq, tuple(x.shape), "uint8"), dev)
                    if not bool(jnp.array_equal(x, exp)):
                        mism += 1
                    del x
                    frame.release()
                    got += 1
            result.put((framework, device, got, mism, path, wrong, ""))
    except Exception:
        import traceback

        result.put((framework, device, got, -1, path, wrong, traceback.format_exc()))


def mg_drop_producer(name: str, n: int, shape: tuple[int, ...], every: float, ready: Any, result: Any) -> None:
    """A producer on GPU 0 with ``policy="drop"``: reports how many sends found every slot held (drops), its
    slowest send, and how long its stream took to drain after the last send (a producer whose stream waited on
    a slow consumer's GPU work would drain late)."""
    import torch

    torch.cuda.init()
    with cudalink.Sender(name, shape=shape, dtype="uint8", slots=4, device=0, policy="drop") as tx:
        ready.set()
        wait_consumers(tx, 1)
        pats = [pattern(seq, shape, "uint8", torch) for seq in range(1, 9)]  # made up front: send() alone is timed
        torch.cuda.synchronize()
        drops = 0
        slowest = 0.0
        for _ in range(n):
            seq = tx.seq + 1
            src = pats[(seq - 1) % 8] if seq <= 8 else pattern(seq, shape, "uint8", torch)
            t0 = time.perf_counter()
            if tx.send(src) is None:
                drops += 1
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(every)
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        drain = time.perf_counter() - t0
        result.put(("producer", drops, slowest, drain, tx.seq))
        time.sleep(0.5)


def mg_visible_consumer(name: str, device: int | None, result: Any) -> None:
    """A consumer started with its own CUDA_VISIBLE_DEVICES (set by the parent before spawning): it verifies
    a few frames, or reports the error it got. Reports (ok, frame.device, path, mismatches, error type, message)."""
    import torch

    try:
        with cudalink.Receiver(name, timeout=30.0, device=device) as rx:
            mism = 0
            where = "?"
            for _ in range(50):
                frame = rx.recv(timeout=10.0)
                where = frame.device
                idx = int(where.split(":")[1])
                with torch.cuda.device(idx):
                    t = torch.from_dlpack(frame)
                    mism += int(not torch.equal(t, pattern(frame.seq, tuple(t.shape), "uint8", torch)))
                    del t
                frame.release()
            result.put((True, where, str(rx.stats()["path"]), mism, "", ""))
    except Exception as exc:
        result.put((False, "", "", -1, type(exc).__name__, str(exc)))


def mg_attach_cycle(name: str, n: int, device: int, result: Any) -> None:
    """Attach on ``cuda:device``, read a frame, detach, ``n`` times; report fds and free memory on GPUs 0 and 1
    before and after."""
    import torch

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def free() -> tuple[int, int]:
        return (torch.cuda.mem_get_info(0)[0], torch.cuda.mem_get_info(1)[0])

    try:
        torch.cuda.init()
        for i in range(n + 3):
            if i == 3:
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                f0, m0 = fds(), free()
            with cudalink.Receiver(name, timeout=10.0, device=device) as rx:
                frame = rx.recv(timeout=10.0)
                with torch.cuda.device(device):
                    t = torch.from_dlpack(frame)
                    _ = int(t.view(-1)[0].item())
                    del t
                frame.release()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        result.put((f0, fds(), m0, free(), ""))
    except Exception:
        import traceback

        result.put((0, 0, (0, 0), (0, 0), traceback.format_exc()))
