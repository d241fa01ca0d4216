"""TouchDesigner bridge on the GPU: fakes over real CUDA memory, TD->Python and Python->TD across processes.

"TD" here is a spawned process (or this one) using ``td_fakes``: ``FakeTOP.cudaMemory()`` allocates and
fills real device memory (cuMemAlloc) that is poisoned and freed when the ``CUDAMemory`` dies, and
``FakeScriptTOP.copyCUDAMemory`` waits for the given stream and copies the device bytes into its
texture. Run with ``python -m pytest -m gpu tests/test_td_gpu.py`` on a GPU machine (torch needed;
cupy for the cupy conversion cases).
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import cudalink
import cudalink.td as ctd
import cudalink.td.convert as td_convert
from cudalink import PixelFormat, RowOrigin
from cudalink.cuda import devices, driver

try:
    from . import td_fakes as fakes
except ImportError:
    import td_fakes as fakes  # type: ignore[no-redef]

pytestmark = pytest.mark.gpu

_names = itertools.count()


def require_gpu() -> None:
    """Skip unless cudalink can open CUDA device 0 here."""
    try:
        devices.device(0)
    except cudalink.CudaUnavailable as exc:
        pytest.skip(f"no usable CUDA GPU: {exc}")


@pytest.fixture(autouse=True)
def _gpu() -> None:
    require_gpu()


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


def link_name() -> str:
    return f"tdg{os.getpid()}-{next(_names)}"


def pattern(torch: Any, shape: tuple[int, int, int], dtype: str, k: int = 0) -> Any:
    """A frame both processes can compute: distinct per element and per ``k``; exact in every dtype."""
    h, w, c = shape
    n = torch.arange(h * w * c, device="cuda", dtype=torch.int64) * 7 + k * 13
    if dtype == "uint8":
        v = (n % 251).to(torch.uint8)
    elif dtype == "uint16":
        v = (n % 30011).to(torch.int16).view(torch.uint16)
    else:
        v = ((n % 1000).to(torch.float32) / 8 - 60).to(getattr(torch, dtype))  # multiples of 1/8: exact in fp16
    return v.view(h, w, c)


def to_host(torch: Any, t: Any) -> np.ndarray[Any, Any]:
    if t.dtype == torch.uint16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)  # type: ignore[no-any-return]
    return t.cpu().numpy()  # type: ignore[no-any-return]


def same(torch: Any, a: Any, b: Any) -> bool:
    if a.dtype == torch.uint16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return bool(torch.equal(a, b))


def new_stream() -> int:
    stream = devices.device(0).create_stream()
    _streams.append(stream)
    return driver.stream_handle(stream)


_streams: list[Any] = []


def script_top() -> fakes.FakeScriptTOP:
    op = fakes.FakeScriptTOP(device=0)
    op.modify_outside_cook = True
    return op


# ========================================================================================== child processes


def td_producer(
    name: str, shape: tuple[int, int, int], dtype: str, via_dat: bool, out: Any, cmd: Any, handles: str = "auto"
) -> None:
    """A TD process: a TOP over real device memory, exported by TDSender or by the Execute DAT's text."""
    try:
        import torch

        torch.cuda.init()
        top = fakes.FakeTOP(pattern(torch, shape, dtype, 0), device=0, name="null_out")
        torch.cuda.synchronize()
        if via_dat:
            me = fakes.FakeDAT(ops={"null_out": top})
            dat = fakes.load_td_script(fakes.TD_DIR / "sender_execute_dat.py", me=me)
            dat.LINK_NAME, dat.DEVICE = name, 0

            def export() -> int | None:
                dat.onFrameEnd(0)
                if me.script_errors:
                    raise RuntimeError(me.script_errors)
                return dat._state["sender"].stream  # type: ignore[no-any-return]

            close = dat.onExit
        else:
            tx = ctd.TDSender(name, device=0, handles=handles)

            def export() -> int | None:
                tx.send_top(top)
                return tx.stream

            close = tx.close
        stream = export()
        out.put(("sent", (stream, top.calls[-1])))
        while True:
            msg, k = cmd.get(timeout=120)
            if msg == "stop":
                break
            top.texture = pattern(torch, shape, dtype, k)
            torch.cuda.synchronize()
            export()
            out.put(("sent", (stream, top.calls[-1])))
        close()
        gc.collect()
        out.put(("done", fakes.FakeCUDAMemory.live))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def py_producer(
    name: str, shape: tuple[int, int, int], dtype: str, pixel_format: str, origin: str, out: Any, cmd: Any
) -> None:
    """A Python process publishing torch frames with cudalink.Sender(device=0)."""
    try:
        import torch

        torch.cuda.init()
        kw: dict[str, Any] = {"pixel_format": pixel_format, "origin": origin, "slots": 3}
        with cudalink.Sender(name, shape=shape, dtype=dtype, device=0, **kw) as tx:
            tx.send(pattern(torch, shape, dtype, 0))
            out.put(("sent", 0))
            while True:
                msg, k = cmd.get(timeout=120)
                if msg == "stop":
                    break
                tx.send(pattern(torch, shape, dtype, k))
                out.put(("sent", k))
        out.put(("done", 0))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def td_producer_legacy(name: str, shape: tuple[int, int, int], dtype: str, out: Any, cmd: Any) -> None:
    td_producer(name, shape, dtype, False, out, cmd, handles="legacy")


class Child:
    """A spawned process (never forked after CUDA init) and its two queues."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.out, self.cmd = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(*args, self.out, self.cmd))
        self.proc.start()

    def expect(self, what: str, timeout: float = 120) -> Any:
        kind, value = self.out.get(timeout=timeout)
        if kind == "error":
            raise AssertionError(f"child failed:\n{value}")
        assert kind == what, (kind, value)
        return value

    def send(self, k: int) -> Any:
        self.cmd.put(("frame", k))
        return self.expect("sent")

    def stop(self) -> None:
        self.cmd.put(("stop", 0))

    def join(self) -> None:
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        assert self.proc.exitcode == 0


# ========================================================================================== in one process


def test_frame_keeps_td_device_memory_alive_and_the_fake_frees_for_real(torch: Any) -> None:
    tex = pattern(torch, (64, 32, 4), "float32")
    torch.cuda.synchronize()
    top = fakes.FakeTOP(tex, device=0)
    s = new_stream()
    mem = top.cudaMemory(stream=s)
    ptr = mem.ptr
    frame = ctd.frame_from_cuda_memory(mem, stream=s, device=0)
    assert frame.is_cuda and frame.device == "cuda:0" and frame.ptr == ptr
    assert frame.pixel_format is PixelFormat.RGBA and frame.origin is RowOrigin.BOTTOM
    del mem
    gc.collect()
    assert fakes.device_allocated(ptr)  # the frame owns TD's CUDAMemory
    t = torch.from_dlpack(frame)  # ordered after the fill on `s`
    assert same(torch, t, tex)
    del frame
    gc.collect()
    assert fakes.device_allocated(ptr)  # the tensor keeps it past the frame
    assert same(torch, t, tex)
    del t
    gc.collect()
    torch.cuda.synchronize()
    assert not fakes.device_allocated(ptr)  # control: nothing holds it, and the fake really freed it


def test_a_growing_top_never_blocks_tds_thread_on_a_gpu_link(torch: Any) -> None:
    """A TOP that grows past the link's slots: the old CUDA link closes on a thread of its own while a receiver
    on TD's thread (as a Script TOP's is) still holds it; TD's send returns at once, and the next ones deliver."""
    import time

    name = link_name()
    small = pattern(torch, (8, 8, 4), "uint8", 1)
    big = pattern(torch, (64, 64, 4), "uint8", 2)
    torch.cuda.synchronize()
    top = fakes.FakeTOP(small, device=0)
    with ctd.TDSender(name, device=0, slots=2) as tx, cudalink.Receiver(name, timeout=5.0, connect=False) as rx:
        assert tx.send_top(top) == 1
        held = rx.recv(timeout=5.0)  # the Script TOP's frame: kept until TD runs again
        assert same(torch, torch.from_dlpack(held), small)
        top.texture = big
        t0 = time.monotonic()
        assert tx.send_top(top) is None
        assert time.monotonic() - t0 < 0.5, "growing the TOP froze TD's thread"
        held.release()
        del held
        frame = None
        for _ in range(400):
            tx.send_top(top)
            try:
                frame = rx.recv(timeout=0.05)
            except (cudalink.ProducerGone, cudalink.LinkTimeout):
                continue
            if frame.shape == (64, 64, 4):
                break
        assert frame is not None and frame.shape == (64, 64, 4)
        assert same(torch, torch.from_dlpack(frame), big)
        frame.release()


@pytest.mark.parametrize(("dtype", "comps"), [("uint8", 4), ("uint16", 1), ("float32", 2), ("float32", 4)])
def test_td_memory_back_into_a_script_top_by_pointer(torch: Any, dtype: str, comps: int) -> None:
    tex = pattern(torch, (24, 40, comps), dtype, 3)
    torch.cuda.synchronize()
    s = new_stream()
    frame = ctd.frame_from_cuda_memory(fakes.FakeTOP(tex, device=0).cudaMemory(stream=s), stream=s, device=0)
    op = script_top()
    up = ctd.to_script_top(frame, op, stream=s, flip="auto", swap_rb="auto", shape_factory=fakes.FakeCUDAMemoryShape)
    call = op.copies[-1]
    assert up.zero_copy and call["address"] == frame.ptr and call["stream"] == s
    assert call["dataType"] is np.dtype(dtype).type
    np.testing.assert_array_equal(op.texture, to_host(torch, tex))


@pytest.mark.filterwarnings("error:ExternalStream is deprecated:DeprecationWarning")  # cupy 14 names a successor
@pytest.mark.parametrize("backend", ["cupy", "torch"])
def test_gpu_conversions_in_process(torch: Any, backend: str) -> None:
    pytest.importorskip(backend)
    half = pattern(torch, (20, 30, 4), "float16", 1)
    u8 = pattern(torch, (20, 30, 4), "uint8", 2)
    u16 = pattern(torch, (20, 30, 3), "uint16", 3)
    torch.cuda.synchronize()
    sink = ctd.ScriptTopSink(shape_factory=fakes.FakeCUDAMemoryShape, array_backend=backend)
    op = script_top()
    up = sink.show(cudalink.Frame.from_array(half, pixel_format="RGBA", origin="top"), op, flip="auto", swap_rb="auto")
    assert up.steps == ["row flip", "float16->float32"] and op.copies[-1]["dataType"] is np.float32
    np.testing.assert_array_equal(op.texture, to_host(torch, half.flip(0).float()))
    up = sink.show(cudalink.Frame.from_array(u8, pixel_format="RGBA", origin="top"), op, flip="auto", swap_rb="auto")
    assert up.steps == ["row flip", "red/blue swap"]
    np.testing.assert_array_equal(op.texture, to_host(torch, u8.flip(0)[..., [2, 1, 0, 3]]))
    sink.show(cudalink.Frame.from_array(u16, pixel_format="RGB", origin="bottom"), op, swap_rb=True)
    np.testing.assert_array_equal(op.texture, to_host(torch, u16)[..., ::-1])
    sink.release()


def test_a_bfloat16_frame_is_converted_in_torch_whichever_library_comes_first(torch: Any) -> None:
    """A model's bfloat16 output shown in TD: converted to float32 in torch, never handed to cupy (which has no
    bfloat16), unless cupy is asked for by name, which is refused saying so."""
    bf = pattern(torch, (20, 30, 4), "bfloat16", 4)
    torch.cuda.synchronize()
    sink = ctd.ScriptTopSink(shape_factory=fakes.FakeCUDAMemoryShape)
    op = script_top()
    frame = cudalink.Frame.from_array(bf, pixel_format="RGBA", origin="top")
    up = sink.show(frame, op, flip="auto", swap_rb="auto")
    assert up.steps == ["row flip", "bfloat16->float32"] and op.copies[-1]["dataType"] is np.float32
    np.testing.assert_array_equal(op.texture, to_host(torch, bf.flip(0).float()))
    sink.release()
    if importlib.util.find_spec("cupy") is not None:
        cupy_sink = ctd.ScriptTopSink(shape_factory=fakes.FakeCUDAMemoryShape, array_backend="cupy")
        with pytest.raises(cudalink.FormatError, match="cupy has no bfloat16"):
            cupy_sink.show(frame, script_top(), flip="auto", swap_rb="auto")
        cupy_sink.release()


def test_no_gpu_array_library_is_a_clear_error(torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(td_convert, "_backend_cache", {"cupy": None, "torch": None})
    half = pattern(torch, (4, 4, 4), "float16")
    torch.cuda.synchronize()
    frame = cudalink.Frame.from_array(half, pixel_format="RGBA", origin="bottom")
    with pytest.raises(cudalink.FormatError, match="install cupy or torch"):
        ctd.to_script_top(frame, script_top(), shape_factory=fakes.FakeCUDAMemoryShape)
    op = fakes.FakeScriptTOP(device=0)
    op.modify_outside_cook = True
    up = ctd.to_script_top(frame, op, method="numpy")  # the slow host fallback still works
    assert op.copies[-1]["method"] == "numpy" and not up.zero_copy
    np.testing.assert_array_equal(op.texture, to_host(torch, half.float()))


# ========================================================================================== across processes


def receive_td_frames(
    torch: Any,
    child: Child,
    name: str,
    shape: tuple[int, int, int],
    dtype: str,
    ks: tuple[int, ...],
    check: Callable[[cudalink.Receiver, cudalink.Frame], None],
) -> None:
    """Take TD's frame k for each k (asking the child for every one after the first), ``check`` it, and
    compare its pixels with pattern k on the GPU; then stop the child, which must have freed every
    CUDAMemory TD handed out once the ring let go."""
    with cudalink.Receiver(name, timeout=60) as rx:
        for k in ks:
            if k:
                child.send(k)
            frame = rx.recv(timeout=60)
            check(rx, frame)
            t = torch.from_dlpack(frame)
            assert same(torch, t, pattern(torch, shape, dtype, k)), k
            del t
            frame.release()
    child.stop()
    assert child.expect("done") == 0


@pytest.mark.parametrize("via_dat", [False, True], ids=["TDSender", "execute-dat"])
@pytest.mark.parametrize(("dtype", "comps"), [("uint8", 4), ("float32", 4), ("uint16", 1), ("float32", 2)])
def test_td_to_python_across_processes(torch: Any, via_dat: bool, dtype: str, comps: int) -> None:
    name, shape = link_name(), (48, 64, comps)
    child = Child(td_producer, name, shape, dtype, via_dat)
    try:
        stream, used = child.expect("sent")
        assert isinstance(stream, int) and stream > 2 and used == stream  # cudaMemory on our own stream

        def check(rx: cudalink.Receiver, frame: cudalink.Frame) -> None:
            assert frame.is_cuda and frame.shape == shape and frame.dtype == np.dtype(dtype)
            assert frame.origin is RowOrigin.BOTTOM
            assert frame.pixel_format is ctd.pixel_format_for(dtype, comps)

        receive_td_frames(torch, child, name, shape, dtype, (0, 1, 2), check)
    finally:
        child.join()


@pytest.mark.parametrize(("dtype", "comps"), [("uint8", 4), ("float32", 4)])
def test_td_to_python_over_legacy_handles(torch: Any, dtype: str, comps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows has only cuIpc (legacy) handles and the loopback TCP channel: the bridge must work over both
    (run here on Linux)."""
    monkeypatch.setenv("CUDALINK_CONTROL", "tcp")  # the TD child inherits it
    name, shape = link_name(), (48, 64, comps)
    child = Child(td_producer_legacy, name, shape, dtype)
    try:
        child.expect("sent")

        def check(rx: cudalink.Receiver, frame: cudalink.Frame) -> None:
            assert rx.backend == "cuda-legacy"  # from the header: BACKEND_CUDA_LEGACY

        receive_td_frames(torch, child, name, shape, dtype, (0, 1), check)
    finally:
        child.join()


@pytest.mark.parametrize(
    ("dtype", "comps", "pixel_format"), [("uint8", 4, "BGRA"), ("float32", 4, "RGBA"), ("uint16", 1, "GRAY")]
)
def test_python_to_td_exact_bytes_by_pointer(torch: Any, dtype: str, comps: int, pixel_format: str) -> None:
    name, shape = link_name(), (36, 52, comps)
    child = Child(py_producer, name, shape, dtype, pixel_format, "bottom")
    sink = ctd.ScriptTopSink(shape_factory=fakes.FakeCUDAMemoryShape)
    op = script_top()
    try:
        child.expect("sent")
        with cudalink.Receiver(name, timeout=60) as rx:
            for k in (0, 1):
                if k:
                    child.send(k)
                frame = rx.recv(timeout=60)
                up = sink.show(frame, op, flip="auto", swap_rb="auto")
                call = op.copies[-1]
                assert up.zero_copy and call["address"] == frame.ptr
                assert call["dataType"] is np.dtype(dtype).type and call["size"] == frame.nbytes
                del frame
                np.testing.assert_array_equal(op.texture, to_host(torch, pattern(torch, shape, dtype, k)))
                op.texture = None
                sink.resubmit(op)  # the held frame is still valid
                np.testing.assert_array_equal(op.texture, to_host(torch, pattern(torch, shape, dtype, k)))
            sink.release()
        child.stop()
        child.expect("done")
    finally:
        child.join()


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize(("dtype", "pixel_format"), [("float16", "RGBA"), ("uint8", "RGBA")])
def test_python_to_td_converted_on_the_gpu(torch: Any, backend: str, dtype: str, pixel_format: str) -> None:
    pytest.importorskip(backend)
    name, shape = link_name(), (30, 44, 4)
    child = Child(py_producer, name, shape, dtype, pixel_format, "top")
    sink = ctd.ScriptTopSink(shape_factory=fakes.FakeCUDAMemoryShape, array_backend=backend)
    op = script_top()
    try:
        child.expect("sent")
        with cudalink.Receiver(name, timeout=60) as rx:
            for k in (0, 1):
                if k:
                    child.send(k)
                frame = rx.recv(timeout=60)
                up = sink.show(frame, op, flip="auto", swap_rb="auto")
                del frame
                want = pattern(torch, shape, dtype, k).flip(0)
                if dtype == "float16":
                    assert up.steps == ["row flip", "float16->float32"]
                    assert op.copies[-1]["dataType"] is np.float32
                    want = want.float()
                else:
                    assert up.steps == ["row flip", "red/blue swap"]  # RGBA8 -> TD's BGRA8
                    want = want[..., [2, 1, 0, 3]]
                assert not up.zero_copy
                np.testing.assert_array_equal(op.texture, to_host(torch, want))
            sink.release()
        child.stop()
        child.expect("done")
    finally:
        child.join()


def test_script_top_dat_on_gpu_keeps_the_image_past_its_producer(torch: Any) -> None:
    name, shape = link_name(), (32, 48, 4)
    child = Child(py_producer, name, shape, "uint8", "BGRA", "bottom")
    callbacks = fakes.load_td_script(fakes.TD_DIR / "receiver_script_top.py")
    callbacks.RETRY_S = 0.0
    op = fakes.FakeScriptTOP(device=0)
    fakes.setup_parameters(callbacks, op)
    op.par.Linkname.val = name
    want = [to_host(torch, pattern(torch, shape, "uint8", k)) for k in (0, 1)]
    try:
        child.expect("sent")
        fakes.cook_until(callbacks, op, lambda: op.texture is not None and np.array_equal(op.texture, want[0]))
        rx = callbacks._receivers[op.id]
        assert rx.sink.last is not None and rx.sink.last.zero_copy
        child.send(1)
        fakes.cook_until(callbacks, op, lambda: np.array_equal(op.texture, want[1]))
        assert op.errors == [] and op.warnings == []
        op.cook(callbacks)  # no new frame: same image, no complaint
        np.testing.assert_array_equal(op.texture, want[1])
        assert op.errors == [] and op.warnings == []
        child.stop()
        fakes.cook_until(callbacks, op, lambda: "left" in rx.status)
        child.expect("done")  # the producer could close: we let go of its memory
        assert not rx.sink.last.zero_copy  # ... after copying the image into memory of our own
        op.texture = None
        op.cook(callbacks)
        np.testing.assert_array_equal(op.texture, want[1])
        assert op.errors == []
    finally:
        for r in list(callbacks._receivers.values()):
            r.close()
        child.join()
