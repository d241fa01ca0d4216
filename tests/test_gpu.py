"""GPU acceptance: CUDA frames into torch/cupy/jax, and the IPC link across spawned processes.

Run on a GPU machine with ``python -m pytest -m gpu``; skipped everywhere else.
"""

from __future__ import annotations

import gc
import os
import re
import time
from typing import Any

import numpy as np
import pytest

import cudalink
from cudalink import _native
from cudalink.frames.frame import Frame

from . import _content
from . import _gpu_procs as gp
from .conftest import DEFAULT, SIGKILL, PairFactory, Spawned, close_while_waiting

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

DTYPES = ["uint8", "uint16", "float16", "float32", "int32", "float64"]
SHAPES = [(7,), (5, 3), (17, 9, 4), (2, 3, 4, 5)]


class _EventSync:
    """A FrameSync over a plain torch event: what a backend does, minus IPC."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self, stream: int) -> None:
        import torch

        torch.cuda.ExternalStream(stream).wait_event(self.event) if stream > 2 else self.event.wait(
            torch.cuda.default_stream()
        )

    def cai_stream(self) -> int | None:
        return None


def _torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_frame_into_torch_cupy_jax(dtype: str, shape: tuple[int, ...]) -> None:
    torch = _torch()
    cp = pytest.importorskip("cupy")
    src = torch.arange(int(np.prod(shape)), device="cuda").remainder(113).to(getattr(torch, dtype)).view(shape)
    frame = Frame.from_array(src)
    assert frame.is_cuda and frame.shape == shape and frame.dtype == np.dtype(dtype)
    ref = src.cpu().numpy()
    assert np.array_equal(torch.from_dlpack(frame).cpu().numpy(), ref)
    assert np.array_equal(cp.asnumpy(cp.from_dlpack(frame)), ref)
    assert np.array_equal(torch.as_tensor(frame, device="cuda").cpu().numpy(), ref)  # CAI fast path
    assert np.array_equal(frame.to_numpy(), ref)
    if dtype != "float64":
        jax = pytest.importorskip("jax")
        assert np.array_equal(np.asarray(jax.dlpack.from_dlpack(frame)), ref)


def test_cuda_frame_keeps_strides() -> None:
    torch = _torch()
    base = torch.arange(64 * 3, device="cuda", dtype=torch.float32).view(64, 3)
    view = base[::2]  # non-contiguous rows
    frame = Frame.from_array(view)
    assert frame.strides == (24, 4)
    assert torch.equal(torch.from_dlpack(frame), view)


def test_consumer_stream_waits_for_ready_event_without_cpu_sync() -> None:
    """Producer writes after a long GPU sleep; a consumer on another stream must still see the new data."""
    torch = _torch()
    prod, cons = torch.cuda.Stream(), torch.cuda.Stream()
    buf = torch.zeros(1 << 20, device="cuda", dtype=torch.int32)
    torch.from_dlpack(Frame.from_array(buf)).sum()  # warm up imports and lazy init outside the measured part
    torch.cuda.synchronize()
    ev = torch.cuda.Event()
    with torch.cuda.stream(prod):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time: far longer than the consumer's launch
        buf.fill_(7)
        ev.record(prod)
    frame = Frame.from_array(buf, sync=_EventSync(ev))
    with torch.cuda.stream(cons):
        t = torch.from_dlpack(frame)  # torch passes cons as the stream: it must wait on ev
        total = t.sum()
    # had the handshake blocked the CPU until the data was ready, the event would be complete by now
    assert not ev.query(), "the CPU blocked in the DLPack handshake (or the GPU sleep was too short)"
    cons.synchronize()  # .item() reads on the default stream, which does not order after `cons`
    assert int(total.item()) == 7 * (1 << 20)


def test_no_gpu_message_names_cpu_backend() -> None:
    with pytest.raises(cudalink.LinkError, match=r"cuda:|device"):
        cudalink.Sender("bad-device", shape=(4,), device="gpu7")


# ============================================================================== across processes

# pool and legacy handles over the Unix socket, and what Windows runs: "auto" handles over loopback TCP (legacy)
HANDLES_AND_CONTROL = [("pool", "unix"), ("legacy", "unix"), ("auto", "tcp")]


@pytest.mark.parametrize(("handles", "control"), HANDLES_AND_CONTROL)
def test_ipc_every_consumer_framework_and_a_slow_consumer(
    spawned: Spawned, name: str, handles: str, control: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20,000 distinct frames; torch, cupy, jax and a slow torch consumer verify what they get on the device."""
    monkeypatch.setenv("CUDALINK_CONTROL", control)
    result = spawned.queue()
    prod = spawned.ready(
        gp.gpu_producer,
        name,
        20_000,
        (64, 48, 4),
        "uint8",
        4,
        "send",
        handles=handles,
        every=0.0008,
        policy="block",
        consumers=4,
    )
    consumers = [
        spawned(gp.gpu_consumer, name, "torch", result, False, False),
        spawned(gp.gpu_consumer, name, "cupy", result, False, False),
        spawned(gp.gpu_consumer, name, "jax", result, False, True),
        spawned(gp.gpu_consumer, name, "torch", result, True, False),
    ]
    outs = [result.get(timeout=240) for _ in consumers]
    prod.join(60)
    for fw, got, mism, err in outs:
        assert mism == 0, (fw, got, mism, err)
        assert got > 0, (fw, err)
    torch_fast = [o for o in outs if o[0] == "torch"]
    assert max(o[1] for o in torch_fast) >= 10_000, outs  # a consumer that keeps up verifies >= 10,000 frames
    assert sum(o[1] for o in outs) >= 25_000, outs
    assert prod.exitcode == 0


def test_asyncio_consumers_woken_ahead_verify_every_gpu_frame(spawned: Spawned, name: str) -> None:
    """Two consumers awaiting ``recv_async`` (one reads each frame behind ~0.2 ms of its own GPU work) sleep
    between frames 2 ms apart, are woken as each send starts and take the frame as it is published: every
    frame after a warm-up arrives, in order, and intact on the GPU."""
    result = spawned.queue()
    n = 1500
    prod = spawned.ready(
        gp.gpu_producer, name, n, (256, 256, 4), "uint8", 4, "send", every=0.002, policy="block", consumers=2
    )
    consumers = [spawned(gp.gpu_consumer, name, "torch-async", result, slow, False) for slow in (False, True)]
    outs = [result.get(timeout=120) for _ in consumers]
    prod.join(60)
    for fw, got, mism, said in outs:
        last = re.search(r"\[(\d+), (\d+)\]\]$", said)  # the last run of consecutive frames taken
        assert mism == 0 and last, (fw, got, mism, said)
        # every frame after a warm-up, to the last one sent: a consumer's first CUDA calls (its first frame's
        # IPC import, torch's first kernels) may let some of the producer's first frames go by
        assert int(last[1]) <= 500 and int(last[2]) == n, (fw, got, said)
    assert prod.exitcode == 0


@pytest.mark.parametrize("mode", ["send", "reserve"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8", "uint16"])
@pytest.mark.parametrize("shape", [(1080, 1920, 4), (2160, 3840, 4)])
def test_ipc_modes_dtypes_and_sizes(spawned: Spawned, name: str, mode: str, dtype: str, shape: tuple[int, ...]) -> None:
    result = spawned.queue()
    spawned.ready(gp.gpu_producer, name, 40, shape, dtype, 3, mode, handles="auto", every=0.002, policy="block")
    spawned(gp.gpu_consumer, name, "torch", result, False, False)
    _fw, got, mism, err = result.get(timeout=120)
    assert mism == 0 and got > 0, (got, mism, err)


@pytest.mark.parametrize(("handles", "control"), HANDLES_AND_CONTROL)
def test_producer_kill_restart_and_consumer_kill(
    spawned: Spawned, name: str, handles: str, control: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDALINK_CONTROL", control)
    prod = spawned.ready(gp.gpu_producer_forever, name, (32, 32, 4), handles=handles, forever=True)
    # a consumer that dies holding a lease (and a torch tensor) must not stall the producer
    spawned.kill(spawned.ready(gp.gpu_hold_forever, name, forever=True))
    with cudalink.Receiver(name, timeout=20.0) as rx:
        assert rx.backend == ("cuda-pool" if handles == "pool" else "cuda-legacy")
        first = rx.recv(timeout=5.0).seq
        time.sleep(0.3)
        assert rx.recv(timeout=5.0).seq > first + 10  # still publishing
        os.kill(prod.pid, SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(cudalink.ProducerGone):
            while True:
                rx.recv(timeout=5.0).release()
        assert time.monotonic() - t0 < 1.0
    prod.join(10)
    spawned.ready(gp.gpu_producer_forever, name, (32, 32, 4), handles=handles, forever=True)
    with cudalink.Receiver(name, timeout=20.0) as rx2:
        f = rx2.recv(timeout=5.0)
        assert f.seq >= 1 and f.generation == rx2.generation
        torch = _torch()
        exp = _content.pattern(f.seq, (32, 32, 4), "uint8", torch)
        assert torch.equal(torch.from_dlpack(f), exp)


@pytest.mark.parametrize("handles", ["pool", "legacy"])
def test_frames_taken_before_the_producer_was_killed_are_read_without_a_crash(
    spawned: Spawned, name: str, handles: str
) -> None:
    """A consumer holds frames it has not read yet when its producer is SIGKILLed; it then reads them (its
    stream waits on each frame's IPC ready event) and calls recv(). Its process must survive: a wait on the
    ready event of a process that is gone must never be made."""
    prod = spawned.ready(gp.gpu_producer_forever, name, (64, 64, 4), handles=handles, forever=True)
    got, go, result = spawned.event(), spawned.event(), spawned.queue()
    cons = spawned(gp.gpu_read_after_kill, name, 0, got, go, result)
    assert got.wait(60), "the consumer took no frames"
    spawned.kill(prod)
    go.set()
    cons.join(60)
    assert cons.exitcode == 0, f"the consumer died with exit code {cons.exitcode} reading frames of a dead producer"
    read, refused, raised = result.get(timeout=5)
    assert read >= 0 and read + refused == 3 and raised == "ProducerGone", (read, refused, raised)


@pytest.mark.parametrize("handles", ["pool", "legacy"])
def test_a_closing_producer_never_frees_a_slot_the_consumer_still_reads(
    spawned: Spawned, name: str, handles: str
) -> None:
    """The consumer releases a frame CPU-side with ~100 ms of GPU reads still queued; the producer closes at once.

    The consumer's reads must still see the frame: it unmaps (and lets the producer free) only after its
    release events complete.
    """
    torch = _torch()
    shape = (256, 256, 4)
    taken = spawned.event()
    prod = spawned.ready(gp.gpu_producer_then_close, name, shape, handles, taken=taken)
    with cudalink.Receiver(name, timeout=30.0) as rx:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            frame = rx.recv(timeout=30.0)
            t = torch.from_dlpack(frame)
            torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time before the slot is read
            copy = t.clone()
            del t
            frame.release()
            taken.set()
            with pytest.raises(cudalink.ProducerGone):
                rx.recv(timeout=30.0)
        s.synchronize()
    assert torch.equal(copy, _content.pattern(1, shape, "uint8", torch))
    prod.join(60)
    assert prod.exitcode == 0


def test_gpu_memory_and_fds_flat_over_attach_cycles(spawned: Spawned, name: str) -> None:
    result = spawned.queue()
    spawned.ready(gp.gpu_producer_forever, name, (256, 256, 4), handles="auto", forever=True)
    spawned(gp.gpu_attach_cycle, name, 40, result)
    f0, f1, m0, m1, err = result.get(timeout=240)
    assert not err, err
    assert f1 == f0, f"fd count grew {f0} -> {f1}"
    assert abs(m1 - m0) <= 4 << 20, f"free GPU memory moved {m0} -> {m1}"


def test_in_process_cuda_link_roundtrip(pair: PairFactory) -> None:
    torch = _torch()
    tx, rx = pair(DEFAULT, shape=(8, 8), dtype="float32", device=0, rx={"timeout": 5.0})
    with tx, rx:
        x = torch.randn(8, 8, device="cuda")
        tx.send(x)
        with rx.recv(timeout=5) as f:
            assert f.device == "cuda:0"
            assert torch.equal(torch.from_dlpack(f), x)
        with pytest.raises(cudalink.FormatError, match="host array"):
            tx.send(np.zeros((8, 8), np.float32))
        with pytest.raises(cudalink.FormatError):
            tx.send(torch.zeros(4, 4, device="cuda"))
        tx.send(x * 2)  # the link is still usable after bad input
        assert torch.equal(torch.from_dlpack(rx.recv(timeout=5)), x * 2)


def test_received_cuda_frames_export_through_the_compiled_core_and_hold_the_slot(pair: PairFactory) -> None:
    """torch and cupy get the slot itself through the slot's exporter (the compiled core, where built);
    an export keeps the frame's lease after release() until it dies."""
    torch = _torch()
    cp = pytest.importorskip("cupy")
    tx, rx = pair(DEFAULT, shape=(6, 10), dtype="float32", device=0, slots=1, rx={"timeout": 5.0})
    with tx, rx:
        x = torch.arange(60, dtype=torch.float32, device="cuda").reshape(6, 10)
        tx.send(x)
        f = rx.recv(timeout=5)
        assert (f._export is not None) is (_native.dlpack is not None)
        t = torch.from_dlpack(f)
        c = cp.from_dlpack(f)
        assert t.data_ptr() == f.ptr == c.data.ptr and t.is_cuda and t.device.index == 0
        assert torch.equal(t, x) and bool(cp.all(c == cp.arange(60, dtype=cp.float32).reshape(6, 10)))
        f.release()
        gc.collect()
        assert tx.send(x + 1) is None  # the exports hold the only slot
        del t, c
        gc.collect()
        assert tx.send(x + 2) is not None
        with rx.recv(timeout=5) as g:
            assert torch.equal(torch.from_dlpack(g), x + 2)


def _gpu_chaos(spawned: Spawned, name: str, cycles: int) -> dict[str, float]:
    rx = cudalink.Receiver(name, connect=False, timeout=60)
    gone: list[float] = []
    gens: set[int] = set()
    frames = 0
    try:
        for i in range(cycles):
            prod = spawned.ready(gp.gpu_chaos_producer, name, forever=True)
            f = rx.recv(timeout=60)
            assert rx.generation not in gens
            gens.add(rx.generation)
            stop_at = time.monotonic() + (i % 7) * 0.005  # kill at varied points of the producer's loop
            while True:
                # the CPU suite's check, on a host copy (to_numpy waits on the frame's ready event)
                problem = _content.verify(f, rx.generation)
                assert problem is None, problem
                f.release()
                frames += 1
                if time.monotonic() >= stop_at:
                    break
                f = rx.recv(timeout=10)
            os.kill(prod.pid, SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(cudalink.ProducerGone):
                while True:
                    rx.recv(timeout=10).release()
            gone.append(time.monotonic() - t0)
            prod.join(10)
    finally:
        rx.close()
    return {"cycles": cycles, "frames": frames, "max_gone_s": max(gone)}


def test_gpu_kill_restart_chaos(spawned: Spawned, name: str) -> None:
    stats = _gpu_chaos(spawned, name, 5)
    assert stats["max_gone_s"] < 0.1, stats


@pytest.mark.slow
def test_gpu_kill_restart_chaos_200(spawned: Spawned, name: str) -> None:
    stats = _gpu_chaos(spawned, name, 200)
    print("gpu chaos:", stats)
    assert stats["max_gone_s"] < 0.1, stats


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 260 s on an H200: past the default 300 s limit on a slower GPU
def test_gpu_torn_read_soak_one_million(spawned: Spawned, name: str) -> None:
    """1,000,000 frames; a fast and a slow torch consumer verify each frame they get on the device."""
    result = spawned.queue()
    prod = spawned.ready(
        gp.gpu_producer, name, 1_000_000, (16, 16, 4), "uint8", 4, "send", handles="auto", policy="drop", consumers=2
    )
    cons = [
        spawned(gp.gpu_consumer, name, "torch", result, False, True, 3600.0),
        spawned(gp.gpu_consumer, name, "torch", result, True, True, 3600.0),
    ]
    outs = [result.get(timeout=3600) for _ in cons]
    prod.join(120)
    print("gpu soak:", outs)
    assert all(o[2] == 0 for o in outs), outs
    assert all(o[1] > 0 for o in outs), outs


def test_send_without_stream_is_ordered_after_torchs_current_stream(pair: PairFactory) -> None:
    """The source is written on a busy side stream; ``send()`` gets no stream and must not block the CPU,
    yet the consumer must see the finished write (the copy runs after it on the GPU)."""
    torch = _torch()
    tx, rx = pair(DEFAULT, shape=(256, 256), dtype="float32", device=0, rx={"timeout": 5.0})
    with tx, rx:
        x = torch.zeros(256, 256, device="cuda")
        side = torch.cuda.Stream()
        for k in (1.0, 2.0, 3.0):
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time before the write
                x.fill_(k)
                done = torch.cuda.Event()
                done.record(side)
                t0 = time.monotonic()
                tx.send(x)
                assert time.monotonic() - t0 < 0.05, "send() waited for the GPU"
                assert not done.query(), "the side stream finished before send returned: the test proves nothing"
            with rx.recv(timeout=5) as f:
                got = torch.from_dlpack(f)  # on torch's default stream, which waits on the frame's event
                assert float(got.min()) == k and float(got.max()) == k


def test_padded_rows_go_in_one_pitched_copy_and_other_strides_are_refused(pair: PairFactory) -> None:
    torch = _torch()
    tx, rx = pair(DEFAULT, shape=(64, 48, 4), dtype="uint8", device=0, rx={"timeout": 5.0})
    with tx, rx:
        wide = torch.arange(64 * 80 * 4, device="cuda").remainder(251).to(torch.uint8).reshape(64, 80, 4)
        crop = wide[:, 16:64]  # rows of 48 pixels inside rows of 80: a pitch of 320 bytes
        assert not crop.is_contiguous()
        tx.send(crop)
        with rx.recv(timeout=5) as f:
            assert torch.equal(torch.from_dlpack(f), crop)
        with pytest.raises(cudalink.FormatError, match="contiguous"):
            tx.send(wide.permute(1, 0, 2)[:64, :48])  # columns for rows: no single copy does that
        tx.send(crop.contiguous() + 1)  # the link is still usable after bad input
        with rx.recv(timeout=5) as f:
            assert torch.equal(torch.from_dlpack(f), crop + 1)


def test_close_waits_for_a_copy_queued_on_the_callers_stream(name: str) -> None:
    """send() with no stream copies on torch's current stream; close() must not free the slots under it."""
    torch = _torch()
    x = torch.ones(1024, device="cuda")
    tx = cudalink.Sender(name, shape=(1024,), dtype="float32", device=0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time queued before the copy
        tx.send(x)
        copied = torch.cuda.Event()
        copied.record(side)
    assert not copied.query(), "the side stream finished before close(): the test proves nothing"
    tx.close()
    assert copied.query(), "close() returned while the copy into its slot was still queued"


def test_close_from_another_thread_wakes_a_recv_on_a_cuda_link_and_held_frames_stay_valid(
    spawned: Spawned, name: str
) -> None:
    """Over real CUDA IPC: close() from another thread ends the waiting recv (LinkClosed); the frame and the
    tensor made from it stay readable until dropped, and only then does the producer see the consumer go."""
    torch = _torch()
    shape = (256, 64)
    left = spawned.ctx.Event()
    spawned.ready(gp.gpu_send_one_and_stay, name, shape, left=left)
    rx = cudalink.Receiver(name, timeout=30.0)
    frame = rx.recv(timeout=30.0)
    held = torch.from_dlpack(frame)
    got = close_while_waiting(rx)
    assert not got["stuck"], "recv() still waiting after close()"
    assert isinstance(got.get("error"), cudalink.LinkClosed), got
    assert torch.equal(held, _content.pattern(1, shape, "float32", torch))
    assert not left.wait(0.3), "the producer saw us go while we still held a frame"
    del held
    frame.release()
    del frame
    gc.collect()
    assert left.wait(10.0), "the producer never saw the closed Receiver go"


def test_bench_breakdown_gpu_reports_driver_floors_and_event_stages(tmp_path: Any) -> None:
    """The GPU floors (driver calls, cached-view export) and the CUDA-only stages are measured, not skipped."""
    import json

    from cudalink import _trace

    from .test_cli import run_cli

    out = tmp_path / "bd.json"
    proc = run_cli("bench", "--breakdown", "--device", "0", "--frames", "80", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    floors = report["floors"]
    for key in ("wake", "spin", "wait_event", "dlpack_cached", "wait_dlpack", "record_ipc_event", "memcpy_record"):
        assert floors[key]["p50"] > 0 and floors[key]["n"] > 0, key
    stages = {s["mark"]: s["us"] for s in report["breakdown"]["stages"]}
    for mark in (_trace.COPY_QUEUED, _trace.EVENT_RECORDED, _trace.WOKEN, _trace.EXPORTED, _trace.RELEASED):
        assert stages[mark] is not None and stages[mark]["p50"] > 0, mark
    # a GPU send queues its copy in well under wire.AHEAD_MAX_NS: the sleeping consumer is woken ahead.
    # Not every frame: the producer stops waking ahead while its sends run slow (their moving average
    # over wire.AHEAD_MAX_NS), as they did for 17 of 50 frames in one H100 lease whose sends ran 2x slow
    assert report["breakdown"]["wake_ahead"] is True
    for mark in (_trace.WAKING_AHEAD, _trace.AHEAD_SENT):
        assert stages[mark] is not None and stages[mark]["n"] >= 20, (mark, stages[mark])
    totals = {t["span"]: t["us"] for t in report["breakdown"]["totals"]}
    assert totals["end to end: send() entered -> recv() returns"]["p50"] > 0


def test_bench_times_the_send_floor_between_the_sends() -> None:
    """The handoff run's paired floor: one bare memcpy + record halfway between every two sends."""
    from cudalink.tools.bench import Bench
    from cudalink.tools.measure import Backend

    bench = Bench(quick=True, backend=Backend(0, "torch"))
    warm = bench.plan.warm
    run = bench._run("cudalink", shape=(256, 256, 4), n=warm + 30, interval=0.002, send_floor=True)
    assert len(run.send_floor) == 30 and all(t > 0 for t in run.send_floor)
    assert len(run.send_costs()) == 30
    plain = bench._run("cudalink", shape=(256, 256, 4), n=warm + 5, interval=0.002)
    assert plain.send_floor == []  # asked for by the handoff run only


def test_copy_send_is_timed_on_its_own_stream_and_never_beats_the_bare_copy() -> None:
    """Copy-send's sides, CUDA events on the one stream both copies run on: a send copies the same bytes
    as the bare cuMemcpyDtoDAsync, so its share can reach 100% (plus the events' noise), never 150%; its
    frame is ready no sooner than its copy is done; and back to back it never beats as many bare copies."""
    from cudalink.tools import copysend

    got = copysend.measure(0, "torch", (1080, 1920, 4), iters=30)
    med = {k: float(np.median(got[k])) for k in ("send", "bare", "bare_event", "send_ready")}  # type: ignore[literal-required]
    ours, bare, evented, ready = med["send"], med["bare"], med["bare_event"], med["send_ready"]
    assert len(got["send"]) == len(got["bare"]) == len(got["bare_event"]) == len(got["send_ready"]) == 30
    assert 0.5 < bare / ours <= 1.03, (ours, bare)
    assert bare <= evented * 1.03, (bare, evented)  # the IPC record is GPU work on top of the copy
    # send() leaves its copy and a plain event on the stream; the IPC ready event goes on the link's own
    assert ours <= evented * 1.03, (ours, evented)
    assert ready * 1.03 >= ours, (ours, ready)  # the frame is ready for others after its copy, never before
    burst_send, burst_bare = float(np.median(got["burst_send"])), float(np.median(got["burst_bare"]))
    assert got["burst_send"] and got["burst_bare"]
    assert 0.5 < burst_bare / burst_send <= 1.03, (burst_send, burst_bare)
    assert got["peak_gbps"] is not None and got["peak_gbps"] > 100, got["peak_gbps"]  # GB/s of bytes copied


@pytest.mark.parametrize("graph_first", [False, True])
def test_ready_events_leave_the_copys_stream_only_while_the_gpu_is_behind(
    pair: PairFactory, monkeypatch: pytest.MonkeyPatch, graph_first: bool
) -> None:
    """While the previous frame's ready event has not fired (frames queue up behind 100 ms of work), the
    next one is recorded on the link's ready stream (it waits for the copy there); while the GPU keeps up,
    on the copy's own stream, with nothing put on the ready stream. Consumers get every frame whole.
    ``graph_first``: the first frame goes as one CUDA graph (SEND_GRAPH), whose event the next send asks about."""
    from cudalink import _backends
    from cudalink.cuda import driver

    torch = _torch()
    tx, rx = pair(DEFAULT, shape=(256, 256), dtype="float32", device=0, rx={"timeout": 5.0, "latest": False})
    with tx, rx:
        ready_s = driver.stream_handle(tx._slots.ready_stream)
        probe = driver.new_event()
        x = torch.zeros(256, 256, device="cuda")
        s = torch.cuda.Stream()

        def ready_stream_idle() -> bool:
            driver.record(probe, ready_s)
            return bool(driver.event_done(probe))

        try:
            torch.cuda.synchronize()
            for k in (1.0, 2.0, 3.0):
                with torch.cuda.stream(s):
                    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time before the write and the copy
                    x.fill_(k)
                monkeypatch.setattr(_backends, "SEND_GRAPH", graph_first and k == 1.0)
                tx.send(x, stream=s)
                assert not tx._slots.graph_error, tx._slots.graph_error
                queued = torch.cuda.Event()
                queued.record(s)
                assert not queued.query(), "s finished early: the test proves nothing"
                if k == 1.0:  # the previous frame (none) is done: the record went on s
                    assert ready_stream_idle()
                else:  # frame k-1's copy still waits behind the sleep: this one's record went on ours
                    assert not ready_stream_idle()
            for k in (1.0, 2.0, 3.0):
                with rx.recv(timeout=5) as f:
                    cons = torch.cuda.Stream()
                    with torch.cuda.stream(cons):
                        got = torch.from_dlpack(f).clone()  # cons waits on the frame's ready event
                    cons.synchronize()
                    assert float(got.min()) == k and float(got.max()) == k
        finally:
            torch.cuda.synchronize()
            driver.destroy_event(probe)


def test_gpu_clock_kernel_to_kernel_every_case_ordered() -> None:
    """The GPU-clock pass (quick): every case measured; no cudalink or floor consumer kernel read a stamp
    other than its frame's (that would be an ordering bug); the pipelined handoff is positive."""
    from cudalink.tools import gpuclock

    clock = gpuclock.run(0, "torch", (1080, 1920, 4), quick=True, mps=False)
    setup = clock["setups"]["no MPS"]
    assert setup["status"] == "ok", setup["reason"]
    for key, _ in gpuclock.CASES:
        if key.startswith("torchmp") and "torchmp" in setup["notes"]:
            continue
        series = setup["series"][key]
        assert len(series["ns"]) >= 20, (key, series["frames"], series["unordered"])
        if not key.startswith("torchmp"):  # torch.mp's ordering is its own; cudalink's and the floor's are ours
            assert series["unordered"] == 0, (key, series["unordered"])
        assert float(np.median(series["ns"])) > 0, key


def test_bench_only_copy_send_and_gpu_clock_on_the_gpu(tmp_path: Any) -> None:
    """``bench --only copy-send,gpu-clock``: the rows the integrator runs first, end to end through the CLI."""
    import json

    from .test_cli import run_cli

    out = tmp_path / "only.json"
    proc = run_cli(
        "bench", "--device", "0", "--quick", "--only", "copy-send,gpu-clock", "--json", str(out), timeout=400
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["id"]: r for r in report["rows"] if r["peer_name"] == "d2d"}
    for key in ("copy_bw_1080p_f32", "copy_bw_4k_f32"):
        assert rows[key]["status"] == "ok" and "GB/s" in rows[key]["note"], rows[key]
    for key in ("copy_burst_1080p_f32", "copy_burst_4k_f32"):
        assert rows[key]["status"] == "ok" and "GB/s" in rows[key]["note"], rows[key]
    share = [g for g in report["goals"] if g["goal"].startswith("copy-send")]
    assert len(share) == 4 and all(g["cudalink"] <= 1.03 for g in share), share
    clock = [g for g in report["goals"] if g["goal"].startswith("GPU handoff")]
    assert clock and all(g["cudalink"] is not None and g["reference"] is not None for g in clock), clock


def test_send_graph_delivers_every_frame_in_order_and_reuses_the_graph(
    pair: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_backends.SEND_GRAPH`` (off by default): the copy and the ready event as one graph launch. Each frame
    arrives whole and after its copy, from a changing source and from the same source rewritten; a
    consumer stream that waits on the ready event sees the graph's record."""
    from cudalink import _backends

    torch = _torch()
    monkeypatch.setattr(_backends, "SEND_GRAPH", True)
    shape = (540, 960, 4)
    tx, rx = pair(DEFAULT, shape=shape, dtype="uint8", device=0, rx={"timeout": 5.0, "latest": False})
    with tx, rx:
        same = torch.empty(shape, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        for i in range(12):
            if i % 2:
                src = torch.full(shape, i, dtype=torch.uint8, device="cuda")
            else:
                same.fill_(i)
                src = same
            with torch.cuda.stream(side):
                torch.cuda._sleep(2_000_000)  # the copy waits behind ~1 ms of work: a missed wait reads stale bytes
                side.wait_stream(torch.cuda.default_stream())
                tx.send(src)
            with rx.recv(timeout=5) as f:
                got = torch.from_dlpack(f)
                assert int(got.min()) == i == int(got.max()), (i, int(got.min()), int(got.max()))
                del got
        slots = tx._slots
        assert slots.graph_error == "", slots.graph_error  # type: ignore[attr-defined]
        assert any(g is not None for g in slots._graphs)  # type: ignore[attr-defined]
