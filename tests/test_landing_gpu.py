"""The landing pool on real GPUs, in one process: copies ordered after the source's event, frames read
through torch on the landing GPU, fences that keep a buffer from being rewritten under a slow kernel, and
memory back after close. The cross-GPU cases need two GPUs and say so where there is one."""

from __future__ import annotations

from typing import Any

import pytest

from cudalink.cuda import devices, driver
from cudalink.cuda.landing import Landed, Landing
from cudalink.errors import CudaUnavailable
from cudalink.frames.frame import Frame
from cudalink.frames.spec import FrameSpec

from .conftest import need_gpus

pytestmark = pytest.mark.gpu

SHAPE = (256, 512, 4)
NBYTES = 256 * 512 * 4


def _torch() -> Any:
    return pytest.importorskip("torch")


def _raw_event() -> tuple[object, object]:
    """A plain driver event in the current context: (its owner, the raw handle the driver calls take)."""
    ev = driver.new_event()
    return ev, (int(ev) if driver.compiled() else ev)  # type: ignore[call-overload]


def _frame(landed: Landed) -> Frame:
    """A frame over a landed buffer, as a source builds one: its sync is the landed buffer, and its release
    gives the buffer back with the streams it went to."""
    return Frame(
        FrameSpec(SHAPE, "uint8"),
        landed.ptr,
        landed,
        device=landed.device,
        sync=landed,
        on_release=landed.give_back,
    )


def _pattern(torch: Any, k: int, device: int) -> Any:
    base = torch.arange(NBYTES, device=f"cuda:{device}", dtype=torch.int32)
    return ((base * 7 + k * 13) % 251).to(torch.uint8).view(SHAPE)


@pytest.mark.parametrize("dst", [0, 1])
def test_land_is_ordered_after_the_sources_event_and_reads_right_on_the_landing_gpu(dst: int) -> None:
    torch = need_gpus(dst + 1)
    src = torch.zeros(SHAPE, dtype=torch.uint8, device="cuda:0")
    s0 = torch.cuda.Stream(device=0)
    pool = Landing(dst, NBYTES, src_device=0)
    assert pool.path == (devices.PATH_SAME if dst == 0 else pool.path)
    if dst:
        assert pool.path == (devices.PATH_PEER if devices.can_access_peer(1, 0) else devices.PATH_STAGED)
    torch.cuda.synchronize(0)
    for k in range(1, 6):
        with torch.cuda.device(0), torch.cuda.stream(s0):
            torch.cuda._sleep(20_000_000)  # the source is still being written when land() is called
            src.copy_(_pattern(torch, k, 0))
            owner, ev = _raw_event()
            driver.record(ev, s0.cuda_stream)
        landed = pool.land(src.data_ptr(), NBYTES, after=ev)
        frame = _frame(landed)
        assert frame.device == f"cuda:{dst}"
        with torch.cuda.device(dst):
            got = torch.from_dlpack(frame).clone()
            want = _pattern(torch, k, dst)
            assert torch.equal(got, want), f"frame {k}: the copy ran before the source's event"
        del got
        frame.release()
        driver.destroy_event(owner)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(dst)
    pool.close()


def test_a_landed_buffer_is_never_rewritten_under_a_slow_kernel() -> None:
    torch = need_gpus(2)
    pool = Landing(1, NBYTES, src_device=0, limit=1)  # one buffer: the next copy must wait for the fence
    a_src, b_src = _pattern(torch, 1, 0), _pattern(torch, 2, 0)
    torch.cuda.synchronize(0)
    frame = _frame(pool.land(a_src.data_ptr(), NBYTES))
    slow = torch.cuda.Stream(device=1)
    with torch.cuda.device(1), torch.cuda.stream(slow):
        t = torch.from_dlpack(frame)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the read
        seen = t.clone()
    del t
    frame.release()  # the fence goes on ``slow``; the copy below must wait for it on the GPU
    b = _frame(pool.land(b_src.data_ptr(), NBYTES))
    assert pool.stats()["gpu_waits"] == 1
    with torch.cuda.device(1):
        torch.cuda.synchronize(1)
        assert torch.equal(seen, _pattern(torch, 1, 1)), "the buffer changed under the slow kernel"
        assert torch.equal(torch.from_dlpack(b), _pattern(torch, 2, 1))
    b.release()
    pool.close()


def test_a_pitched_source_lands_packed() -> None:
    torch = need_gpus(2)
    big = _pattern(torch, 3, 0)
    crop = big[:, 64:320]  # rows padded: pitch 2048, width 1024
    pool = Landing(1, NBYTES, src_device=0)
    torch.cuda.synchronize(0)
    landed = pool.land(crop.data_ptr(), 256 * 256 * 4, pitch=(512 * 4, 256 * 4, 256))
    f = Frame(FrameSpec((256, 256, 4), "uint8"), landed.ptr, landed, device=1, sync=landed, on_release=landed.give_back)
    with torch.cuda.device(1):
        assert torch.equal(torch.from_dlpack(f), crop.to("cuda:1"))
    f.release()
    pool.close()


def test_pools_give_their_memory_back() -> None:
    torch = need_gpus(2)
    torch.cuda.synchronize(1)
    free0 = torch.cuda.mem_get_info(1)[0]
    src = _pattern(torch, 4, 0)
    torch.cuda.synchronize(0)
    for _ in range(40):
        pool = Landing(1, 8 << 20, src_device=0, limit=4)
        held = [pool.land(src.data_ptr(), NBYTES) for _ in range(3)]
        pool.close()
        for x in held:
            x.give_back([])
    torch.cuda.synchronize(1)
    assert free0 - torch.cuda.mem_get_info(1)[0] < 64 << 20


def test_a_gpu_that_is_not_there_is_named() -> None:
    torch = _torch()
    n = torch.cuda.device_count()
    with pytest.raises(CudaUnavailable, match=rf"no cuda:{n} here.*cuda:0 GPU-"):
        Landing(n, 64)
