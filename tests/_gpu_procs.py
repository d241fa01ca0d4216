"""GPU child processes (spawned): a torch producer and torch/cupy/jax consumers that verify on the device.

The frames are ``_content``'s, the same the CPU tests send: torch and cupy make them on the device.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cudalink

from ._content import CHAOS_SHAPE, checksum, content, pattern
from ._procs import taker

INT_VIEW = {"float32": "int32", "float16": "int16", "uint8": "uint8", "uint16": "int16", "bfloat16": "int16"}


def wait_consumers(tx: cudalink.Sender, want: int, timeout: float = 120.0) -> None:
    """Start only once ``want`` consumers joined, so slow-starting (torch/jax) consumers miss nothing."""
    end = time.monotonic() + timeout
    while tx.stats()["consumers"] < want and time.monotonic() < end:
        time.sleep(0.01)


def gpu_producer(
    name: str,
    n: int,
    shape: tuple[int, ...],
    dtype: str,
    slots: int,
    mode: str,
    ready: Any,
    handles: str = "auto",
    every: float = 0.0,
    policy: str = "block",
    consumers: int = 1,
) -> None:
    import torch

    torch.cuda.init()
    with cudalink.Sender(
        name, shape=shape, dtype=dtype, slots=slots, device=0, handles=handles, policy=policy, timeout=20.0
    ) as tx:  # type: ignore[arg-type]
        s = torch.cuda.Stream()
        ready.set()
        wait_consumers(tx, consumers)
        with torch.cuda.stream(s):
            for seq in range(1, n + 1):
                pat = pattern(seq, shape, dtype, torch)
                if mode == "send":
                    tx.send(pat)
                else:
                    with tx.reserve(stream=s.cuda_stream) as f:
                        torch.from_dlpack(f).copy_(pat)
                if every:
                    time.sleep(every)
        torch.cuda.synchronize()
        ready.clear()
        time.sleep(0.5)


def gpu_producer_forever(name: str, shape: tuple[int, ...], ready: Any, handles: str = "auto") -> None:
    import torch

    with cudalink.Sender(name, shape=shape, dtype="uint8", slots=4, device=0, handles=handles) as tx:
        ready.set()
        seq = 0
        while True:
            seq += 1
            tx.send(pattern(seq, shape, "uint8", torch))
            time.sleep(0.0005)


def gpu_consumer(
    name: str, framework: str, result: Any, slow: bool = False, latest: bool = False, max_s: float = 120.0
) -> None:
    """Verify each frame against the seq's pattern on the GPU; accumulate mismatches on the device.
    ``framework``: torch, cupy or jax; ``torch-async`` takes each frame with ``recv_async`` on an event loop."""
    got = 0
    try:
        # the framework loads before we join: a producer that waits for its consumers then finds us ready, and
        # a consumer with latest=False misses none of its first frames while torch imports
        importlib.import_module(framework.split("-")[0])
        with (
            cudalink.Receiver(name, timeout=30.0, latest=latest) as rx,
            taker(rx, framework.endswith("-async"), 10.0) as recv,
        ):
            runs: list[list[int]] = []  # [first, last] seq of each run of consecutive frames taken

            def take() -> cudalink.Frame:
                f = recv()
                if runs and f.seq == runs[-1][1] + 1:
                    runs[-1][1] = f.seq
                else:
                    runs.append([f.seq, f.seq])
                return f

            if framework.startswith("torch"):
                import torch

                s = torch.cuda.Stream()
                bad = torch.zeros((), dtype=torch.int64, device="cuda")
                end = time.monotonic() + max_s
                with torch.cuda.stream(s):
                    while time.monotonic() < end:
                        try:
                            frame = take()
                        except cudalink.ProducerGone:
                            break
                        t = torch.from_dlpack(frame)
                        if slow:
                            torch.cuda._sleep(400_000)  # ~0.2 ms of GPU time before we read the slot
                        exp = pattern(frame.seq, tuple(t.shape), frame.dtype.name, torch)
                        iv = getattr(torch, INT_VIEW[frame.dtype.name])
                        bad += (t.view(iv) != exp.view(iv)).any().to(torch.int64)
                        del t, exp
                        frame.release()  # CPU-side release while our kernels may still run: the fence guards it
                        got += 1
                    s.synchronize()
                mism = int(bad.item())
            elif framework == "cupy":
                import cupy as cp

                mism = 0
                s = cp.cuda.Stream(non_blocking=True)
                bad = cp.zeros((), dtype=cp.int64)
                with s:
                    while True:
                        try:
                            frame = take()
                        except cudalink.ProducerGone:
                            break
                        a = cp.from_dlpack(frame)
                        # the expected pattern is made on `s` too: a torch tensor from torch's stream, read
                        # here on `s`, could be freed and reused by torch before our comparison ran
                        exp = pattern(frame.seq, a.shape, frame.dtype.name, cp)
                        iv = INT_VIEW[frame.dtype.name]
                        bad += cp.any(a.view(iv) != exp.view(iv)).astype(cp.int64)
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
                        frame = take()
                    except cudalink.ProducerGone:
                        break
                    x = jax.dlpack.from_dlpack(frame)
                    exp = pattern(frame.seq, tuple(x.shape), frame.dtype.name)  # numpy, moved over by jax
                    if not bool(jnp.array_equal(x, jnp.asarray(exp))):
                        mism += 1
                    del x
                    frame.release()
                    got += 1
            result.put((framework, got, mism, f"skipped {rx.skipped} runs {runs[-20:]}"))
    except Exception:
        import traceback

        result.put((framework, got, -1, traceback.format_exc()))


def gpu_hold_forever(name: str, ready: Any) -> None:
    import torch

    with cudalink.Receiver(name, timeout=20.0) as rx:
        frame = rx.recv(timeout=20.0)
        t = torch.from_dlpack(frame)
        ready.set()
        time.sleep(600)
        del t


def gpu_attach_cycle(name: str, n: int, result: Any) -> None:
    """Attach, read a frame, detach, n times; report fd count and GPU memory before/after."""
    import torch

    from cudalink.cuda import driver

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def free() -> int:
        drv = driver.bindings()
        return int(driver.check(drv.cuMemGetInfo(), "cuMemGetInfo")[0])

    try:
        for i in range(n + 3):
            if i == 3:
                torch.cuda.synchronize()
                f0, m0 = fds(), free()
            with cudalink.Receiver(name, timeout=10.0) as rx:
                frame = rx.recv(timeout=10.0)
                t = torch.from_dlpack(frame)
                _ = int(t.view(-1)[0].item())
                del t
                frame.release()
        torch.cuda.synchronize()
        result.put((f0, fds(), m0, free(), ""))
    except Exception:
        import traceback

        result.put((0, 0, 0, 0, traceback.format_exc()))


def gpu_chaos_producer(name: str, ready: Any) -> None:
    """A light GPU producer (no torch: fast restarts): host content copied into reserved slots."""
    from cudalink.cuda import driver

    with cudalink.Sender(name, shape=CHAOS_SHAPE, dtype="uint8", slots=4, device=0) as tx:
        ready.set()
        while True:
            arr = content(tx.generation, tx.seq + 1)
            with tx.reserve(meta=checksum(arr)) as f:
                driver.memcpy_htod(f.ptr, arr.ctypes.data, arr.nbytes, driver.stream_handle(tx.stream))


def gpu_producer_then_close(name: str, shape: tuple[int, ...], handles: str, ready: Any, taken: Any) -> None:
    """Publish one frame, then close the moment the consumer has taken it (and freed its slot CPU-side)."""
    import torch

    torch.cuda.init()
    tx = cudalink.Sender(name, shape=shape, dtype="uint8", slots=2, device=0, handles=handles)
    ready.set()
    wait_consumers(tx, 1)
    tx.send(pattern(1, shape, "uint8", torch))
    torch.cuda.synchronize()
    taken.wait(60)
    tx.close()
    # reuse the freed memory at once, so a consumer still reading the old slot would see this
    junk = [torch.full(shape, 7, dtype=torch.uint8, device="cuda") for _ in range(64)]
    torch.cuda.synchronize()
    del junk


def gpu_read_after_kill(name: str, device: int, got: Any, go: Any, result: Any) -> None:
    """Take frames (none read yet), tell the parent, and once it has SIGKILLed the producer try to read each
    one through torch, then recv() until ProducerGone. Reports (frames read, reads refused with ProducerGone,
    what recv raised); the parent checks that this process did not die."""
    import torch

    try:
        with cudalink.Receiver(name, timeout=30.0, device=device) as rx:
            frames = [rx.recv(timeout=10.0) for _ in range(3)]
            got.set()
            go.wait(30)
            read = refused = 0
            for f in frames:
                try:
                    t = torch.from_dlpack(f)  # its stream would wait on the frame's ready event
                    int(t[:4].sum().item())
                    del t
                    read += 1
                except cudalink.ProducerGone:
                    refused += 1
                f.release()
            torch.cuda.synchronize()
            raised = ""
            try:
                for _ in range(50):
                    rx.recv(timeout=5.0).release()
            except cudalink.LinkError as exc:
                raised = type(exc).__name__
            result.put((read, refused, raised))
    except Exception as exc:
        result.put((-1, -1, f"{type(exc).__name__}: {exc}"))


def gpu_send_one_and_stay(name: str, shape: tuple[int, ...], ready: Any, left: Any) -> None:
    """Send frame 1 once a consumer joined, then stay (sending nothing) until it has left: ``left`` is set."""
    import torch

    with cudalink.Sender(name, shape=shape, dtype="float32", slots=2, device=0) as tx:
        ready.set()
        wait_consumers(tx, 1)
        tx.send(pattern(1, shape, "float32", torch))
        end = time.monotonic() + 60.0
        while tx.stats()["consumers"] and time.monotonic() < end:
            time.sleep(0.01)
        left.set()
