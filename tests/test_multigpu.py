"""Consumers on another GPU of the same host (issue 36): frames copied into a pool on the consumer's GPU,
read through torch, cupy and jax; a slow consumer there never holds the producer; GPUs named by UUID whatever
CUDA_VISIBLE_DEVICES says; a killed producer; memory and fds flat over attach cycles.

Most tests need two GPUs and skip with the count where there are fewer; the one-GPU ones run anywhere a GPU
is. Run on a two-GPU machine with ``python -m pytest -m gpu tests/test_multigpu.py``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

import cudalink
from cudalink.cuda import devices

from . import _content
from . import _gpu_procs as gp
from . import _multigpu_procs as mp_
from .conftest import DEFAULT, SIGKILL, PairFactory, Spawned, need_gpus

pytestmark = pytest.mark.gpu

SMALL = (64, 64, 4)


def _torch() -> Any:
    return pytest.importorskip("torch")


def _cross_path() -> str:
    """The path a consumer on GPU 1 of a producer on GPU 0 must report on this machine."""
    both = devices.can_access_peer(0, 1) and devices.can_access_peer(1, 0)
    return devices.PATH_PEER if both else devices.PATH_STAGED


# -- one GPU is enough --------------------------------------------------------------------------------------------


def test_a_device_beyond_the_last_gpu_is_named_with_the_gpus_that_exist() -> None:
    torch = _torch()
    n = torch.cuda.device_count()
    with pytest.raises(cudalink.CudaUnavailable, match=rf"no cuda:{n} here; this process sees {n} GPU.*cuda:0 GPU-"):
        cudalink.Receiver("nobody", device=n, connect=False)
    if n == 1:  # the issue's own case: device=1 on a one-GPU machine
        with pytest.raises(cudalink.CudaUnavailable, match=r"no cuda:1 here.*cuda:0 GPU-"):
            cudalink.Receiver("nobody", device=1, connect=False)


def test_copy_always_on_the_producers_gpu_never_holds_the_producers_slots(pair: PairFactory) -> None:
    torch = _torch()
    tx, rx = pair(DEFAULT, shape=SMALL, dtype="uint8", slots=2, device=0, rx={"copy": "always", "timeout": 5.0})
    held = []
    for seq in range(1, 4):  # hold three frames of a two-slot link: zero copy would leave no slot to send into
        assert tx.send(_content.pattern(seq, SMALL, "uint8", torch)) == seq
        held.append(rx.recv(timeout=5.0))
    assert rx.stats()["path"] == devices.PATH_SAME and rx.device == "cuda:0"
    assert tx.stats()["dropped"] == 0
    for f in held:
        assert f.device == "cuda:0"
        assert torch.equal(torch.from_dlpack(f), _content.pattern(f.seq, SMALL, "uint8", torch))
        f.release()


def test_the_producers_gpu_named_explicitly_is_zero_copy(pair: PairFactory) -> None:
    torch = _torch()
    tx, rx = pair(DEFAULT, shape=SMALL, dtype="uint8", device=0, rx={"device": 0, "timeout": 5.0})
    tx.send(_content.pattern(1, SMALL, "uint8", torch))
    f = rx.recv(timeout=5.0)
    assert rx.stats()["path"] == devices.PATH_ZERO_COPY and f.device == "cuda:0"
    f.release()


# -- two GPUs -----------------------------------------------------------------------------------------------------


def test_copy_never_refuses_another_gpu_by_name(pair: PairFactory) -> None:
    need_gpus(2)
    with pytest.raises(cudalink.FormatError, match=r"cuda:0 \(GPU-.*cuda:1.*copy='never' refuses it"):
        pair(DEFAULT, shape=SMALL, dtype="uint8", device=0, rx={"device": 1, "copy": "never", "timeout": 5.0})


def test_in_process_frames_land_on_gpu_1(pair: PairFactory) -> None:
    torch = need_gpus(2)
    tx, rx = pair(DEFAULT, shape=SMALL, dtype="uint8", device=0, rx={"device": "cuda:1", "timeout": 5.0})
    assert rx.device == "cuda:1" and rx.stats()["path"] == _cross_path()
    torch.cuda.set_device(1)  # attaching, receiving and releasing never move the caller's current device
    again = cudalink.Receiver(tx.name, device=1, timeout=5.0)
    assert torch.cuda.current_device() == 1
    for seq in range(1, 51):
        with torch.cuda.device(0):  # the producer's side: its frames are made on the link's GPU
            tx.send(_content.pattern(seq, SMALL, "uint8", torch))
        with rx.recv(timeout=5.0) as f:
            assert f.device == "cuda:1" and f.__dlpack_device__() == (2, 1)
            cai = f.__cuda_array_interface__
            t = torch.from_dlpack(f)
            assert t.device == torch.device("cuda:1") and cai["data"][0] == t.data_ptr()
            with torch.cuda.device(1):
                assert torch.equal(t, _content.pattern(f.seq, SMALL, "uint8", torch)), f.seq
            del t
        assert torch.cuda.current_device() == 1
    again.close()
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(0)


def test_dlpacks_default_streams_are_the_frames_gpus_while_another_gpu_is_current(pair: PairFactory) -> None:
    """With GPU 1 current, frames of a link on GPU 0 still order GPU 0's default stream: torch's ``from_dlpack``
    passes 1 (DLPack: the frame's GPU's legacy stream) and switches no device. The producer's copy runs behind
    ~100 ms of GPU 0 work on its own stream, so a wait queued on GPU 1's stream instead lets the read see the
    slot before the copy; the consumer's read of the frame then runs behind ~100 ms more while the frame is
    released with GPU 1 current, so a fence on GPU 1's stream lets the next frames overwrite the slot first.
    A send() from torch's default stream with GPU 1 current copies after the tensor's writer on GPU 0."""
    torch = need_gpus(2)
    shape = (256, 256, 4)
    tx, rx = pair(DEFAULT, shape=shape, dtype="uint8", device=0, slots=2, rx={"device": 0, "timeout": 5.0})
    with torch.cuda.device(0):
        tx.send(torch.zeros(shape, dtype=torch.uint8, device="cuda:0"))  # a first frame, with GPU 0 current
        rx.recv(timeout=5.0).release()
        slow = torch.cuda.Stream(device=0)
        with torch.cuda.stream(slow):
            torch.cuda._sleep(200_000_000)  # ~100 ms of GPU 0 time before the copy
            src = _content.pattern(2, shape, "uint8", torch)
    torch.cuda.set_device(1)
    try:
        tx.send(src, stream=slow)
        f = rx.recv(timeout=5.0)
        t = torch.from_dlpack(f)
        assert torch.cuda.current_device() == 1
        with torch.cuda.device(0):
            first = t.clone()  # GPU 0's default stream: after the ready event, or it reads the zeros of seq 1
            torch.cuda._sleep(200_000_000)  # ~100 ms of GPU 0 time before the read the release fence covers
            later = t.clone()
        del t
        f.release()  # GPU 1 current: the fence still goes on GPU 0's default stream
        assert torch.cuda.current_device() == 1
        for seq in (3, 4):  # slot reuse: the copy into frame 2's slot waits for the fence
            with torch.cuda.device(0):
                want_seq = _content.pattern(seq, shape, "uint8", torch)
                nxt = torch.zeros(shape, dtype=torch.uint8, device="cuda:0")
                torch.cuda._sleep(20_000_000)  # the tensor's writer still runs when send() queues the copy
                nxt.copy_(want_seq)
            tx.send(nxt)  # torch's default stream with GPU 1 current: the copy must follow nxt's writer
            with rx.recv(timeout=5.0) as g:
                g_t = torch.from_dlpack(g)
                with torch.cuda.device(0):
                    assert torch.equal(g_t, want_seq), f"frame {seq} copied before its writer ran"
                del g_t
        torch.cuda.synchronize(0)
        with torch.cuda.device(0):
            want = _content.pattern(2, shape, "uint8", torch)
        assert torch.equal(first, want), "read before the producer's copy (the wait went to GPU 1's stream)"
        assert torch.equal(later, want), "overwritten under the read (the release fence went to GPU 1's stream)"
    finally:
        torch.cuda.set_device(0)


def test_a_producer_and_a_consumer_on_gpu_0_made_and_used_while_gpu_1_is_current(pair: PairFactory) -> None:
    """With GPU 1 current throughout: making a Sender and a Receiver of a GPU 0 link, sending (the copy runs behind
    ~100 ms of GPU 0 work on the source's stream), receiving, asking for ``__cuda_array_interface__`` (a stream
    of ours on GPU 0 where the data is ready), exporting and releasing it never move the caller's current GPU,
    and a read on GPU 0's default stream sees the producer's copy. (torch refuses the frame's read-only CAI.)"""
    torch = need_gpus(2)
    shape = (256, 256, 4)
    with torch.cuda.device(0):
        slow = torch.cuda.Stream(device=0)
        with torch.cuda.stream(slow):
            torch.cuda._sleep(200_000_000)  # ~100 ms of GPU 0 time before the copy
            src = _content.pattern(1, shape, "uint8", torch)
            want = src.clone()
    torch.cuda.set_device(1)
    try:
        tx, rx = pair(DEFAULT, shape=shape, dtype="uint8", device=0, slots=2, rx={"device": 0, "timeout": 5.0})
        assert torch.cuda.current_device() == 1
        tx.send(src, stream=slow)
        assert torch.cuda.current_device() == 1
        f = rx.recv(timeout=5.0)
        cai = f.__cuda_array_interface__
        assert torch.cuda.current_device() == 1
        assert cai["data"][0] and cai["stream"] not in (None, 1, 2)  # a stream of ours, on GPU 0
        t = torch.from_dlpack(f)  # GPU 1 current: torch passes GPU 0's default stream (1)
        with torch.cuda.device(0):
            got = t.clone()  # GPU 0's default stream, ordered after the copy
        del t
        f.release()
        assert torch.cuda.current_device() == 1
        torch.cuda.synchronize(0)
        assert torch.equal(got, want), "read before the producer's copy"
    finally:
        torch.cuda.set_device(0)


def test_fan_out_to_both_gpus_through_torch_cupy_and_jax(spawned: Spawned, name: str) -> None:
    """One producer on GPU 0, six consumers: torch, cupy and jax on GPU 0 (zero copy) and on GPU 1 (landed);
    12,000 distinct frames, each one a consumer takes verified on that consumer's GPU: 0 mismatches, and over
    10,000 frames verified on each GPU."""
    need_gpus(2)
    n = 12_000
    result = spawned.queue()
    consumers = [(fw, dev) for dev in (0, 1) for fw in ("torch", "cupy", "jax")]
    prod = spawned.ready(
        gp.gpu_producer, name, n, SMALL, "uint8", 4, "send", every=0.0008, policy="block", consumers=len(consumers)
    )
    for fw, dev in consumers:
        spawned(mp_.mg_consumer, name, fw, dev, result)
    outs = [result.get(timeout=300) for _ in consumers]
    prod.join(60)
    for fw, dev, got, mism, path, wrong, err in outs:
        assert not err and mism == 0 and wrong == 0, (fw, dev, got, mism, path, wrong, err)
        assert got > 0, (fw, dev, err)
        assert path == (devices.PATH_ZERO_COPY if dev == 0 else _cross_path()), (fw, dev, path)
    for dev in (0, 1):
        assert sum(o[2] for o in outs if o[1] == dev) >= 10_000, outs
    assert max(o[2] for o in outs if o[0] == "torch" and o[1] == 1) >= n // 2, outs  # GPU 1 keeps up too
    assert prod.exitcode == 0


def test_a_slow_consumer_on_gpu_1_never_stalls_the_producer(spawned: Spawned, name: str) -> None:
    """Each frame costs the consumer ~5 ms of GPU time before it reads it; the producer sends every 0.5 ms with
    policy='drop' on 4 slots. The slot goes back once the copy ran, so no send finds every slot held, the
    producer's stream never waits for the consumer's GPU, and the consumer never sees a frame change."""
    need_gpus(2)
    shape = (256, 256, 4)
    result = spawned.queue()
    prod_result = spawned.queue()
    spawned.ready(mp_.mg_drop_producer, name, 3000, shape, 0.0005, result=prod_result)
    spawned(mp_.mg_consumer, name, "torch", 1, result, True, 10_000_000)
    _, drops, slowest, drain, sent = prod_result.get(timeout=240)
    _fw, _dev, got, mism, path, wrong, err = result.get(timeout=240)
    assert not err and mism == 0 and wrong == 0, (got, mism, err)
    assert path == _cross_path()
    assert drops == 0, f"{drops} of {sent} sends found every slot held by the consumer on GPU 1"
    assert drain < 0.5, f"the producer's stream took {drain:.3f}s to drain: it waited on the consumer's GPU"
    assert 0 < got < sent  # it skipped frames (latest=True), as a slow consumer should
    print(f"slow consumer: got {got} of {sent}, slowest send {slowest * 1e3:.2f} ms, drain {drain * 1e3:.2f} ms")


def _visible_consumer(spawned: Spawned, name: str, visible: str, device: int | None, mp: pytest.MonkeyPatch) -> Any:
    result = spawned.queue()
    with mp.context() as m:
        m.setenv("CUDA_VISIBLE_DEVICES", visible)
        spawned(mp_.mg_visible_consumer, name, device, result)
    return result.get(timeout=120)


def test_cuda_visible_devices_that_renumber_or_hide_the_producers_gpu(
    spawned: Spawned, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_gpus(2)
    spawned.ready(gp.gpu_producer_forever, name, SMALL, forever=True)
    producer_uuid = devices.format_uuid(devices.uuid_at(0))
    # renumbered: the producer's GPU is cuda:1 there, the other one cuda:0
    ok, where, path, mism, kind, msg = _visible_consumer(spawned, name, "1,0", None, monkeypatch)
    assert ok and where == "cuda:1" and path == devices.PATH_ZERO_COPY and mism == 0, (where, path, mism, kind, msg)
    ok, where, path, mism, kind, msg = _visible_consumer(spawned, name, "1,0", 0, monkeypatch)
    assert ok and where == "cuda:0" and path == _cross_path() and mism == 0, (where, path, mism, kind, msg)
    # hidden: a clear error naming the GPU it needs and the ones it sees
    ok, where, path, mism, kind, msg = _visible_consumer(spawned, name, "1", None, monkeypatch)
    assert not ok and kind == "CudaUnavailable", (kind, msg)
    assert producer_uuid in msg and "CUDA_VISIBLE_DEVICES='1'" in msg and "cuda:0 GPU-" in msg, msg


def test_producer_sigkill_is_producer_gone_on_gpu_1_and_the_pool_is_freed(spawned: Spawned, name: str) -> None:
    torch = need_gpus(2)
    shape = (1080, 1920, 4)  # 8 MB frames: the landing pool is plain to see in the GPU's free memory
    prod = spawned.ready(gp.gpu_producer_forever, name, shape, forever=True)
    with torch.cuda.device(1):
        torch.ones(1, device="cuda:1")  # torch's context on GPU 1 exists before the baseline
        rx = cudalink.Receiver(name, timeout=20.0, device=1)  # attached: peer access, streams; no buffer yet
        torch.cuda.synchronize(1)
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info(1)[0]
        kept = rx.recv(timeout=5.0)
        att: Any = rx._att
        assert att.pool.stats()["buffers"] >= 1
        assert free0 - torch.cuda.mem_get_info(1)[0] >= 8 << 20  # the pool is on GPU 1
        os.kill(prod.pid, SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(cudalink.ProducerGone):
            while True:
                rx.recv(timeout=5.0).release()
        assert time.monotonic() - t0 < 1.0
        # the frame still held stays valid after the producer died: it lives in our pool, not in its slot
        head = torch.from_dlpack(kept)[:4].clone()
        assert torch.equal(head, _content.pattern(kept.seq, shape, "uint8", torch)[:4])
        kept.release()
        del kept, head
        assert att.pool.closed and att.pool.stats()["buffers"] == 0
        torch.cuda.synchronize(1)
        torch.cuda.empty_cache()
        assert abs(free0 - torch.cuda.mem_get_info(1)[0]) <= 4 << 20, "the landing pool was not freed"
        rx.close()


def test_gpu_memory_and_fds_flat_on_both_gpus_over_attach_cycles(spawned: Spawned, name: str) -> None:
    need_gpus(2)
    result = spawned.queue()
    spawned.ready(gp.gpu_producer_forever, name, (256, 256, 4), handles="auto", forever=True)
    spawned(mp_.mg_attach_cycle, name, 40, 1, result)
    f0, f1, m0, m1, err = result.get(timeout=300)
    assert not err, err
    assert f1 == f0, f"fd count grew {f0} -> {f1}"
    for gpu in (0, 1):
        assert abs(m1[gpu] - m0[gpu]) <= 4 << 20, f"free memory on GPU {gpu} moved {m0[gpu]} -> {m1[gpu]}"
