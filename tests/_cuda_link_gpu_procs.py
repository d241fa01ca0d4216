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
    attached: Any = None,
) -> None:
    """Once ``go`` is set: create the cuda-link Sender, publish ``n`` frames (pattern of ``seq + base``) every
    ``every`` s, then close (shutdown flag, grace, unlink). With ``attached``, the frames start once the
    consumer says it attached (cuda-link has no consumer registration: a 0.6 s stream could end before a
    consumer that is still importing its framework looks)."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    go.wait(120)
    with cudalink.Sender(name, shape=shape, dtype=dtype, slots=slots, device=0, protocol="cuda-link") as tx:
        if attached is not None:
            attached.wait(120)
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
    max_frames: int = 1 << 30,
    attached: Any = None,
    warm: tuple[int, ...] = (4, 4, 4),
) -> None:
    """Load the framework and compile its kernels for frames of shape ``warm`` (on a fresh machine cupy's
    first compile of a reduction took longer than the whole stream), set ``started``, attach (waiting for
    the segment), then verify each frame against
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
            with torch.cuda.stream(s):  # as for cupy: the first frames must not pay torch's first-use costs
                for dt in INT_VIEW:
                    w = pattern(1, warm, dt, torch)
                    iv = getattr(torch, INT_VIEW[dt])
                    bad += (w.view(iv) != w.view(iv)).any().to(torch.int64)
                s.synchronize()
        elif framework == "cupy":
            import cupy as cp

            s = cp.cuda.Stream(non_blocking=True)
            bad = cp.zeros((), dtype=cp.int64)
            with s:  # compile the pattern and compare kernels of every dtype now, not on the first frames
                for dt in INT_VIEW:
                    w = pattern(1, warm, dt, cp)
                    bad += cp.any(w.view(INT_VIEW[dt]) != w.view(INT_VIEW[dt])).astype(cp.int64)
                s.synchronize()
        else:
            import jax
            import jax.numpy as jnp

            for dt in INT_VIEW:  # XLA compiles per shape and dtype
                w = jnp.asarray(pattern(1, warm, dt))
                bool(jnp.array_equal(w, jnp.asarray(pattern(1, warm, dt))))
        started.set()  # frameworks loaded: the producer may start (the Receiver waits for its segment)
        with cudalink.Receiver("cuda-link:" + name, timeout=60.0, copy=copy) as rx:  # type: ignore[arg-type]
            if attached is not None:
                attached.set()
            while True:
                if got >= max_frames:  # done while the producer still runs (its slots still allocated)
                    ended = "count"
                    break
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


# -- the incumbent (forkni/cuda-link) on Linux: its Python exporter and importer, if it can be imported ---------


def incumbent(src: str | None) -> Any:
    """cuda-link's package (from ``src``, its checkout's ``src`` folder, or installed), with its CUDA runtime
    loaded from Linux's libcudart: it looks only for Windows DLLs by name. Raises ImportError when absent."""
    import ctypes
    import glob
    import sys

    if src:
        sys.path.insert(0, src)
    import cuda_link
    from cuda_link import cuda_ipc_wrapper

    def load(self: object) -> ctypes.CDLL:
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        try:
            import torch

            root = os.path.dirname(os.path.dirname(torch.__file__))
            names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so*")))
        except ImportError:
            pass
        for n in names:
            try:
                return ctypes.CDLL(n)
            except OSError:
                continue
        raise RuntimeError(f"no libcudart found (tried {names})")

    cuda_ipc_wrapper.CUDARuntimeAPI._load_cuda_runtime = load  # type: ignore[attr-defined]
    # Its cudaPointerAttributes has CUDA 12's four fields; the CUDA 13 runtime writes more (its exporter then
    # crashed in export_frame's pointer check on the H100). Room for them, read the same way:
    base = cuda_ipc_wrapper.cudaPointerAttributes

    class Padded(base):  # type: ignore[misc, valid-type]
        _fields_ = [("_reserved", ctypes.c_byte * 256)]

    cuda_ipc_wrapper.cudaPointerAttributes = Padded
    return cuda_link


def incumbent_exporter(name: str, n: int, shape: tuple[int, ...], go: Any, src: str | None, result: Any) -> None:
    """cuda-link's CUDAIPCExporter publishing ``pattern(seq)`` uint8 frames every 2 ms, then cleaning up."""
    try:
        import torch

        cl = incumbent(src)
        torch.zeros(1, device="cuda")
        exp = cl.CUDAIPCExporter(name, shape[0], shape[1], shape[2], "uint8", num_slots=3)
        if not exp.initialize():
            raise RuntimeError("CUDAIPCExporter.initialize() failed")
        go.wait(120)
        for seq in range(1, n + 1):
            t = pattern(seq, shape, "uint8", torch)
            torch.cuda.synchronize()  # their copy runs on their own stream: the frame must be there first
            if not exp.export_frame(t.data_ptr(), t.numel()):
                raise RuntimeError(f"export_frame failed at frame {seq}")
            time.sleep(0.002)
        exp.cleanup()
        result.put("")
    except Exception:
        import traceback

        result.put(traceback.format_exc())


def cl_uniform_producer(name: str, n: int, shape: tuple[int, ...], go: Any) -> None:
    """cudalink's cuda-link writer sending frames whose every byte is ``seq % 251`` (a reader that cannot see
    seqs checks that each frame is whole and that they change)."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    go.wait(120)
    with cudalink.Sender(name, shape=shape, dtype="uint8", slots=3, device=0, protocol="cuda-link") as tx:
        for seq in range(1, n + 1):
            tx.send(torch.full(shape, seq % 251, dtype=torch.uint8, device="cuda"))
            time.sleep(0.004)
        torch.cuda.synchronize()


def incumbent_importer(name: str, started: Any, src: str | None, result: Any) -> None:
    """cuda-link's CUDAIPCImporter reading cudalink's writer: every frame whole (one value), values changing."""
    try:
        import torch

        cl = incumbent(src)
        torch.zeros(1, device="cuda")
        started.set()
        end = time.monotonic() + 120
        imp = None
        while imp is None or not imp.is_ready():
            if time.monotonic() > end:
                raise RuntimeError("the importer never attached")
            time.sleep(0.05)
            imp = cl.CUDAIPCImporter(shm_name=name)
        got, torn, values = 0, 0, set()
        s = torch.cuda.Stream()
        while time.monotonic() < end and imp.is_ready():
            t = imp.get_frame(stream=s)  # a view of the writer's slot: copied at once, as its users must (the
            if t is None:  # cuda-link protocol has no lease: a slot is rewritten three frames later)
                time.sleep(0.0005)
                continue
            with torch.cuda.stream(s):
                t = t.clone()
            s.synchronize()
            lo, hi = int(t.min()), int(t.max())
            torn += lo != hi
            values.add(lo)
            got += 1
        result.put((got, torn, len(values), tuple(imp.shape), str(imp.dtype), ""))
    except Exception:
        import traceback

        result.put((0, 0, 0, (), "", traceback.format_exc()))
