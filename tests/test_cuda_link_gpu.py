"""GPU acceptance of the cuda-link path: cudalink's cuda-link writer -> cudalink's cuda-link reader in separate
spawned processes, every frame verified on the device through torch, cupy and jax; restarts, close, held frames,
and attach cycles. Run with ``python -m pytest -m gpu tests/test_cuda_link_gpu.py``."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from . import _cuda_link_gpu_procs as clp
from . import _gpu_procs as gp
from .conftest import Spawned

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

SHAPE = (48, 64, 4)


@pytest.fixture
def name() -> str:
    return f"cudalink_ipc_Python>>TD_{uuid.uuid4().hex[:8]}"


def _run(spawned: Spawned, name: str, framework: str, dtype: str = "uint8", **consumer: Any) -> tuple[Any, ...]:
    ctx = spawned.ctx
    q, started, go, attached = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    spawned(clp.cl_consumer, name, framework, q, started, attached=attached, warm=SHAPE, **consumer)
    # 3 s of frames: a consumer's first frames pay for its framework compiling its kernels (cupy, jax)
    prod = spawned(clp.cl_producer, name, 1500, SHAPE, dtype, go, attached=attached)
    assert started.wait(180), "consumer did not start"
    go.set()
    res = q.get(timeout=240)
    prod.join(60)
    assert res[-1] == "", res[-1]
    return tuple(res)


@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32"])
@pytest.mark.parametrize("framework", ["torch", "cupy", "jax"])
def test_writer_to_reader_every_frame_verified(spawned: Spawned, name: str, framework: str, dtype: str) -> None:
    pytest.importorskip(framework)
    _, got, mism, stale, gens, stats, ended, _ = _run(spawned, name, framework, dtype)
    assert got > 10 and mism == 0 and stale == 0 and gens == 1, (got, mism, stale, gens, stats)
    assert ended == "gone"
    assert stats["received"] == got


def test_held_frames_never_change_with_the_default_copy(spawned: Spawned, name: str) -> None:
    """The producer rewrites its 3 slots every 2 ms; each frame is held 50 ms before it is read."""
    pytest.importorskip("torch")
    _, got, mism, *_ = _run(spawned, name, "torch", hold_s=0.05)
    assert got >= 5 and mism == 0, (got, mism)


def test_zero_copy_frames_held_too_long_do_change(spawned: Spawned, name: str) -> None:
    """The risk copy='never' documents, shown: the same hold with zero copy sees the slot rewritten (this is
    also the proof that the held-frames test above can fail)."""
    pytest.importorskip("torch")
    # 8 frames, then leave while the producer still sends: a zero-copy frame must not outlive its slot's memory
    _, got, mism, *_ = _run(spawned, name, "torch", hold_s=0.05, copy="never", max_frames=8)
    assert got == 8 and mism > 0, (got, mism)


def test_writer_restart_is_followed_with_no_stale_frame(spawned: Spawned, name: str) -> None:
    pytest.importorskip("torch")
    ctx = spawned.ctx
    q, started, go_a, go_b = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    shape_b = (32, 16, 4)
    spawned(clp.cl_consumer, name, "torch", q, started, bases={SHAPE: 0, shape_b: 5000})
    a = spawned(clp.cl_producer, name, 200, SHAPE, "uint8", go_a)
    spawned(clp.cl_producer, name, 200, shape_b, "uint8", go_b, base=5000)
    assert started.wait(180)
    go_a.set()
    a.join(120)
    go_b.set()  # a new producer under the same name, after the first closed
    _, got, mism, stale, gens, stats, ended, err = q.get(timeout=240)
    assert err == "", err
    assert ended == "gone"
    assert gens == 2 and stale == 0 and mism == 0 and got > 20, (got, mism, stale, gens, stats)
    assert stats["reattached"] == 1


def test_writer_close_is_producer_gone(spawned: Spawned, name: str) -> None:
    """The consumer's run ends on ProducerGone, not on a timeout, once the writer closes."""
    pytest.importorskip("torch")
    _, got, mism, _, gens, stats, ended, _ = _run(spawned, name, "torch")
    assert ended == "gone" and got > 10 and mism == 0 and gens == 1 and stats["reattached"] == 0


def test_memory_and_fds_flat_over_40_attach_cycles(spawned: Spawned, name: str) -> None:
    pytest.importorskip("torch")
    spawned.ready(clp.cl_producer_forever, name, SHAPE, forever=True)
    q = spawned.ctx.Queue()
    spawned(gp.gpu_attach_cycle, "cuda-link:" + name, 40, q)
    try:
        f0, f1, m0, m1, err = q.get(timeout=300)
    finally:
        from cudalink.transport.shm import _unlink_segment

        _unlink_segment(name)  # the producer runs until killed: it never unlinks its segment itself
    assert err == "", err
    assert f1 - f0 <= 2, (f0, f1)
    assert abs(m1 - m0) <= 8 << 20, (m0, m1)  # allocator granularity, not per-cycle growth


def test_same_process_writer_and_reader() -> None:
    """A notebook with both ends: our own handles are recognised (CUDA refuses to open them in-process)."""
    torch = pytest.importorskip("torch")
    import cudalink

    n = f"cudalink_same_{uuid.uuid4().hex[:8]}"
    with cudalink.Sender(n, shape=SHAPE, protocol="cuda-link") as tx, cudalink.Receiver("cuda-link:" + n) as rx:
        for v in (1, 2, 3):
            src = torch.full(SHAPE, v, dtype=torch.uint8, device="cuda")
            tx.send(src)
            f = rx.recv(timeout=2.0)
            assert f.seq == v and bool((torch.from_dlpack(f) == v).all())
            assert rx.backend == "cuda-link" and f.device == "cuda:0"
