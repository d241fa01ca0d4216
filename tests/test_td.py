"""TouchDesigner bridge on CPU: formats, lifetimes, conversions, and the td/ DATs run as TD runs them."""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import time
import weakref
from typing import Any

import numpy as np
import pytest

import cudalink
import cudalink.td as ctd
from cudalink import FormatError, LinkError, PixelFormat, RowOrigin
from cudalink.td.sink import _producer_closing
from cudalink.transport import MemoryTransport

try:
    from . import td_fakes as fakes
except ImportError:
    import td_fakes as fakes  # type: ignore[no-redef]

FakeCUDAMemory = fakes.FakeCUDAMemory
FakeCUDAMemoryShape = fakes.FakeCUDAMemoryShape
FakeScriptTOP = fakes.FakeScriptTOP
FakeTOP = fakes.FakeTOP
TDError = fakes.TDError

_names = itertools.count()


def link_name() -> str:
    return f"tdt{os.getpid()}-{next(_names)}"


def texture(h: int, w: int, c: int, dtype: Any, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((h, w, c)).astype(dtype)
    return rng.integers(0, np.iinfo(dtype).max, (h, w, c), endpoint=True).astype(dtype)


def td_frame(tex: np.ndarray[Any, Any]) -> tuple[cudalink.Frame, FakeCUDAMemory]:
    mem = FakeTOP(tex).cudaMemory()
    return ctd.frame_from_cuda_memory(mem, device="cpu"), mem


def host_frame(arr: np.ndarray[Any, Any], pixel_format: Any = None, origin: Any = "top") -> cudalink.Frame:
    return cudalink.Frame.from_array(arr, pixel_format=pixel_format, origin=origin)


def show(frame: cudalink.Frame, script_op: FakeScriptTOP | None = None, **kw: Any) -> tuple[FakeScriptTOP, Any]:
    op = script_op or FakeScriptTOP()
    op.modify_outside_cook = True
    kw.setdefault("shape_factory", FakeCUDAMemoryShape)
    upload = ctd.to_script_top(frame, op, **kw)
    return op, upload


@pytest.fixture
def live_mem() -> Any:
    """FakeCUDAMemory objects alive right now (after a collection)."""

    def count() -> int:
        gc.collect()
        return FakeCUDAMemory.live

    return count


# ============================================================================================ formats

TD_TYPES = [np.uint8, np.uint16, np.float32]
EXPECTED_FORMAT = {1: PixelFormat.GRAY, 2: PixelFormat.RG, 3: PixelFormat.RGB}


@pytest.mark.parametrize("comps", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", TD_TYPES, ids=lambda t: t.__name__)
def test_every_td_format_maps_to_shape_dtype_and_layout(dtype: Any, comps: int) -> None:
    tex = texture(5, 7, comps, dtype)
    mem = FakeTOP(tex).cudaMemory()
    frame = ctd.frame_from_cuda_memory(mem, device="cpu", seq=3)
    assert frame.shape == (5, 7, comps)  # (height, width, numComps)
    assert frame.dtype == np.dtype(dtype)
    assert frame.origin is RowOrigin.BOTTOM  # TD's rows run bottom-up
    if comps == 4:
        assert frame.pixel_format is (PixelFormat.BGRA if dtype is np.uint8 else PixelFormat.RGBA)
    else:
        assert frame.pixel_format is EXPECTED_FORMAT[comps]
    assert frame.ptr == mem.ptr  # zero-copy: the frame is TD's memory
    assert frame.seq == 3 and frame.device == "cpu"
    np.testing.assert_array_equal(frame.numpy(), tex)


def test_labels_and_helpers() -> None:
    frame, _ = td_frame(texture(2, 2, 4, np.uint8))
    assert frame.spec.label == "BGRA8 bottom-up"
    assert ctd.pixel_format_for(np.float32, 4) is PixelFormat.RGBA
    assert ctd.td_format_name(np.uint8, 4) == "rgba8fixed"
    assert ctd.td_format_name(np.float32, 1) == "mono32float"
    assert ctd.td_format_name(np.uint16, 2) == "rg16fixed"
    assert ctd.td_format_name(np.uint8, 3) is None
    for t in TD_TYPES:
        assert ctd.td_dtype(t) == np.dtype(t)


@pytest.mark.parametrize(
    ("data_type", "needle"),
    [
        (np.dtype("float32"), "use numpy.float32 (that is, dtype.type), not numpy.dtype('float32')"),
        (np.dtype("uint8"), "use numpy.uint8"),
        (np.float16, "set the TOP's Pixel Format to 32-bit float"),
        (np.float64, "not a TouchDesigner texture type; use numpy.uint8, numpy.uint16 or numpy.float32"),
        (np.int32, "not a TouchDesigner texture type"),
        ("float32", "must be a numpy scalar type"),
        (None, "must be a numpy scalar type"),
        (42, "must be a numpy scalar type"),
        (object(), "must be a numpy scalar type"),
        (float, "must be a numpy scalar type"),
    ],
    ids=[
        "dtype-instance",
        "dtype-uint8",
        "float16",
        "float64",
        "int32",
        "string",
        "none",
        "int",
        "object",
        "pyfloat",
    ],
)
def test_bad_data_type_is_refused_with_the_fix(data_type: Any, needle: str) -> None:
    mem = FakeCUDAMemory(64, FakeCUDAMemoryShape(2, 2, 4, data_type))
    with pytest.raises(FormatError) as err:
        ctd.frame_from_cuda_memory(mem, device="cpu")
    assert needle in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, LinkError)


@pytest.mark.parametrize(
    ("shape", "size", "needle"),
    [
        (FakeCUDAMemoryShape(2, 2, 0, np.uint8), 16, "numComps must be 1 to 4"),
        (FakeCUDAMemoryShape(2, 2, 5, np.uint8), 20, "numComps must be 1 to 4"),
        (FakeCUDAMemoryShape(0, 2, 4, np.uint8), 16, "nothing to export"),
        (FakeCUDAMemoryShape(2, 2, 4, np.uint8), 15, "needs 16"),
        (FakeCUDAMemoryShape(2.0, 2, 4, np.uint8), 16, "width must be an int"),  # type: ignore[arg-type]
    ],
)
def test_bad_shapes_are_refused(shape: Any, size: int, needle: str) -> None:
    with pytest.raises(FormatError, match=needle):
        ctd.frame_from_cuda_memory(FakeCUDAMemory(size, shape), device="cpu")


def test_3d_and_cube_textures_are_refused() -> None:
    for attr, value in (("depth", 6), ("is3D", True), ("isCube", True)):
        shape = FakeCUDAMemoryShape(2, 2, 4, np.uint8)
        setattr(shape, attr, value)
        with pytest.raises(FormatError, match="3D, cube and 2D-array"):
            ctd.frame_from_cuda_memory(FakeCUDAMemory(16 * 6, shape), device="cpu")


# ============================================================================================ lifetime


def test_frame_keeps_td_memory_alive_after_td_reference_dies(live_mem: Any) -> None:
    tex = texture(16, 16, 4, np.float32)
    top = FakeTOP(tex)
    base = live_mem()
    mem = top.cudaMemory()
    frame = ctd.frame_from_cuda_memory(mem, device="cpu")
    view = np.from_dlpack(frame)  # a DLPack consumer
    del mem
    assert live_mem() == base + 1  # TD's CUDAMemory is still alive: the frame owns it
    np.testing.assert_array_equal(frame.numpy(), tex)
    del frame
    assert live_mem() == base + 1  # ... and the DLPack view keeps it past the frame
    np.testing.assert_array_equal(view, tex)
    del view
    assert live_mem() == base  # nothing holds it: TD frees it


def test_control_the_fake_really_poisons_freed_memory(live_mem: Any) -> None:
    """Without an owner (TopArray's bug: keeping only .ptr) the data is gone, so the test above means it."""
    tex = texture(16, 16, 4, np.uint8)
    base = live_mem()
    mem = FakeTOP(tex).cudaMemory()
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * mem.size).from_address(mem.ptr))  # holds no reference
    np.testing.assert_array_equal(raw, tex.reshape(-1))
    ptr_only = cudalink.Frame(ctd.spec_from_cuda_memory(mem), mem.ptr, None)
    del mem
    assert live_mem() == base
    assert (raw == fakes.POISON).all()
    assert not np.array_equal(ptr_only.numpy(), tex)


def test_each_cuda_memory_call_is_new_memory() -> None:
    top = FakeTOP(texture(4, 4, 4, np.uint8))
    a, b = top.cudaMemory(), top.cudaMemory()
    assert a.ptr != b.ptr


# ============================================================================================ TD -> link


def test_tdsender_cpu_publishes_td_layout_and_follows_format_changes(live_mem: Any) -> None:
    name = link_name()
    tex = texture(6, 8, 4, np.uint8, seed=1)
    top = FakeTOP(tex)
    base = live_mem()
    with ctd.TDSender(name, device="cpu", slots=2) as tx, cudalink.Receiver(name, connect=False) as rx:
        assert tx.stream is None and tx.sender is None
        assert tx.send_top(top) == 1
        assert top.calls == [None]  # host fake: no stream argument
        assert live_mem() == base  # the host ring copied synchronously; TD's memory may go
        frame = rx.recv(timeout=2)
        assert frame.pixel_format is PixelFormat.BGRA and frame.origin is RowOrigin.BOTTOM
        np.testing.assert_array_equal(frame.numpy(), tex)
        frame.release()
        # smaller, other dtype: same link, reconfigured
        small = texture(3, 4, 1, np.float32, seed=2)
        top.texture = small
        tx.send_top(top)
        frame = rx.recv(timeout=2)
        assert frame.shape == (3, 4, 1) and frame.pixel_format is PixelFormat.GRAY
        np.testing.assert_array_equal(frame.numpy(), small)
        frame.release()
        first = tx.sender
        # larger than the slots: a new link that the receiver re-attaches to. The old link closes on a thread of
        # its own: a GPU link's close waits for the receiver (here on TD's thread, as a Script TOP's is) to
        # unmap, which it does only once TD runs again. Frames sent meanwhile are dropped, and counted (a CPU
        # link's close waits for nobody: this one may be sent at once).
        big = texture(32, 32, 4, np.uint16, seed=3)
        top.texture = big
        t0 = time.monotonic()
        got = tx.send_top(top)
        assert time.monotonic() - t0 < 0.5, "growing the TOP froze TD's thread"
        assert tx.sender is not first and tx.dropped == (1 if got is None else 0)
        frame = None
        for _ in range(200):  # TD's frames go on: each one sends
            tx.send_top(top)
            try:
                frame = rx.recv(timeout=0.05)
                if frame.shape == big.shape:
                    break
            except (cudalink.ProducerGone, cudalink.LinkTimeout):
                pass
        assert frame is not None and frame.shape == big.shape
        np.testing.assert_array_equal(frame.numpy(), big)
        assert tx.sender is not None and tx.sender is not first
        frame.release()
    with pytest.raises(LinkError, match="closed"):
        tx.send_top(top)


def test_tdsender_names_what_is_not_a_top() -> None:
    class Chop:
        path = "/project1/noise1"

    class Empty(FakeTOP):
        def cudaMemory(self, stream: int | None = None) -> Any:
            return None

    with ctd.TDSender(link_name(), device="cpu") as tx:
        with pytest.raises(FormatError, match=r"'/project1/noise1' is not a TOP.*point the sender at a TOP"):
            tx.send_top(Chop())  # type: ignore[arg-type]
        with pytest.raises(FormatError, match="has no image yet"):
            tx.send_top(Empty(texture(2, 2, 4, np.uint8)))
        assert tx.sent == 0


def test_tdsender_refuses_float16_tops_via_td() -> None:
    top = FakeTOP(texture(2, 2, 4, np.float16))
    with ctd.TDSender(link_name(), device="cpu") as tx, pytest.raises(TDError, match="16-bit float"):
        tx.send_top(top)


# ============================================================================================ link -> TD


@pytest.mark.parametrize("comps", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", TD_TYPES, ids=lambda t: t.__name__)
def test_td_layout_frames_go_back_by_pointer(dtype: Any, comps: int) -> None:
    tex = texture(5, 3, comps, dtype, seed=comps)
    frame, _ = td_frame(tex)
    op, upload = show(frame, method="cuda", flip="auto", swap_rb="auto")
    call = op.copies[-1]
    assert upload.zero_copy and call["address"] == frame.ptr  # the frame's own memory, no copy
    assert call["dataType"] is dtype  # the numpy scalar type, never a np.dtype
    assert (call["width"], call["height"], call["numComps"]) == (3, 5, comps)
    assert call["size"] == tex.nbytes
    np.testing.assert_array_equal(op.texture, tex)


def test_float16_is_converted_to_float32() -> None:
    src = (np.arange(4 * 6 * 4, dtype=np.float32).reshape(4, 6, 4) / 7 - 3).astype(np.float16)
    op, upload = show(host_frame(src, "RGBA", "bottom"), method="cuda")
    assert op.copies[-1]["dataType"] is np.float32
    assert not upload.zero_copy and upload.steps == ["float16->float32"]
    assert op.texture.dtype == np.float32
    np.testing.assert_array_equal(op.texture, src.astype(np.float32))


def test_bfloat16_is_converted_to_float32_and_cupy_which_has_none_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's bfloat16 output shown in TD: converted to float32 like float16 (every bfloat16 is a float32)."""
    import ml_dtypes

    from cudalink.td import convert

    src = (np.arange(4 * 6 * 4, dtype=np.float32).reshape(4, 6, 4) / 7 - 3).astype(ml_dtypes.bfloat16)
    op, upload = show(host_frame(src, "RGBA", "bottom"), method="cuda")
    assert op.copies[-1]["dataType"] is np.float32 and upload.steps == ["bfloat16->float32"]
    np.testing.assert_array_equal(op.texture, src.astype(np.float32))
    # on the GPU the conversion runs in torch, never cupy (cupy has no bfloat16)
    asked: list[str | None] = []

    def module(preferred: str | None) -> tuple[str, Any]:
        asked.append(preferred)
        return (preferred or "cupy", object())

    monkeypatch.setattr(convert, "_array_module", module)
    frame = host_frame(src, "RGBA", "bottom")
    plan = convert._Plan(frame, "auto", "auto", "cuda")
    with pytest.raises(FormatError, match=r"^cudalink: cupy has no bfloat16.*array_backend='torch'"):
        convert._convert_cuda(frame, plan, 0, "cupy")

    def no_lib(*args: object) -> None:
        raise RuntimeError("torch asked")

    monkeypatch.setattr(convert, "ArrayLib", no_lib)
    monkeypatch.setattr(convert.devices, "device", lambda d: None)
    with pytest.raises(RuntimeError, match="torch asked"):
        convert._convert_cuda(frame, plan, 0, None)
    assert asked == ["cupy", "torch"]


def test_float64_and_2d_frames() -> None:
    src = np.linspace(0, 1, 12).reshape(3, 4)
    op, _ = show(host_frame(src, None, "bottom"), method="cuda")
    assert op.copies[-1]["numComps"] == 1 and op.copies[-1]["dataType"] is np.float32
    np.testing.assert_array_equal(op.texture[..., 0], src.astype(np.float32))


def test_flip_and_swap_on_request() -> None:
    src = texture(4, 5, 4, np.uint8, seed=9)
    op, upload = show(host_frame(src, "RGBA"), method="cuda", flip=True, swap_rb=True)
    np.testing.assert_array_equal(op.texture, src[::-1][..., [2, 1, 0, 3]])
    assert upload.steps == ["row flip", "red/blue swap"]
    rgb = texture(4, 5, 3, np.uint16, seed=10)
    op, _ = show(host_frame(rgb), method="cuda", swap_rb="on")
    np.testing.assert_array_equal(op.texture, rgb[..., ::-1])
    half = texture(4, 5, 4, np.float16, seed=11)
    op, _ = show(host_frame(half), method="cuda", flip=True, swap_rb=True)
    np.testing.assert_array_equal(op.texture, half[::-1][..., [2, 1, 0, 3]].astype(np.float32))


def test_auto_follows_frame_metadata() -> None:
    src = texture(4, 5, 4, np.uint8, seed=3)
    # python-style RGBA8, top-down -> TD's CUDA layout wants BGRA bottom-up: flip and swap
    op, up = show(host_frame(src, "RGBA", "top"), method="cuda", flip="auto", swap_rb="auto")
    assert up.steps == ["row flip", "red/blue swap"]
    np.testing.assert_array_equal(op.texture, src[::-1][..., [2, 1, 0, 3]])
    # already TD's layout: nothing to do, pointer pass
    op, up = show(host_frame(src, "BGRA", "bottom"), method="cuda", flip="auto", swap_rb="auto")
    assert up.zero_copy and up.steps == []
    # float RGBA is TD's order already; BGRA float is not
    f32 = texture(4, 5, 4, np.float32, seed=4)
    _, up = show(host_frame(f32, "RGBA", "bottom"), method="cuda", flip="auto", swap_rb="auto")
    assert up.steps == []
    _, up = show(host_frame(f32, "BGRA", "bottom"), method="cuda", flip="auto", swap_rb="auto")
    assert up.steps == ["red/blue swap"]
    # unknown channel order: never guessed
    _, up = show(host_frame(src, None, "bottom"), method="cuda", flip="auto", swap_rb="auto")
    assert up.steps == []


def test_host_frames_use_copy_numpy_array_by_default() -> None:
    src = texture(4, 5, 4, np.uint16, seed=5)
    op, up = show(host_frame(src, "RGBA", "bottom"), flip="auto", swap_rb="auto")
    assert op.copies[-1]["method"] == "numpy" and up.zero_copy
    np.testing.assert_array_equal(op.texture, src)
    mono = texture(4, 5, 1, np.uint8, seed=6)[..., 0]
    op, _ = show(host_frame(mono, None, "top"), flip="auto")
    np.testing.assert_array_equal(op.texture[..., 0], mono[::-1])


@pytest.mark.parametrize(
    ("arr", "kw", "needle"),
    [
        (np.zeros((2, 2, 4), np.int32), {}, "uint8, uint16 or float32"),
        (np.zeros((2, 2, 5), np.uint8), {}, r"\(height, width, 1..4\)"),
        (np.zeros((2, 2, 2, 4), np.uint8), {}, r"\(height, width, 1..4\)"),
        (np.zeros((2, 2, 2), np.uint8), {"swap_rb": True}, "3 or 4 channels"),
        (np.zeros((2, 2, 4), np.uint8), {"flip": "sideways"}, "True, False or 'auto'"),
    ],
)
def test_frames_td_cannot_take_are_refused(arr: Any, kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(FormatError, match=needle):
        show(host_frame(arr), method="cuda", **kw)


def test_default_shape_factory_needs_touchdesigner() -> None:
    op = FakeScriptTOP()
    op.modify_outside_cook = True
    frame, _ = td_frame(texture(2, 2, 4, np.uint8))
    with pytest.raises(LinkError, match="shape_factory"):
        ctd.to_script_top(frame, op, method="cuda")


def test_fake_script_top_copies_only_in_cook() -> None:
    frame, _ = td_frame(texture(2, 2, 4, np.uint8))
    with pytest.raises(TDError, match="onCook"):
        ctd.to_script_top(frame, FakeScriptTOP(), method="cuda", shape_factory=FakeCUDAMemoryShape)


def test_sink_keeps_the_source_until_the_next_upload(live_mem: Any) -> None:
    op = FakeScriptTOP()
    op.modify_outside_cook = True
    sink = ctd.ScriptTopSink(shape_factory=FakeCUDAMemoryShape, method="cuda")
    a, b = texture(8, 8, 4, np.uint8, seed=1), texture(8, 8, 4, np.uint8, seed=2)
    base = live_mem()
    frame, mem = td_frame(a)
    sink.show(frame, op)
    del frame, mem
    assert live_mem() == base + 1  # TD may still be reading: the sink holds the source
    op.texture = None
    assert sink.resubmit(op)
    np.testing.assert_array_equal(op.texture, a)  # not poisoned
    frame, mem = td_frame(b)
    sink.show(frame, op)
    del frame, mem
    assert live_mem() == base + 1  # the first source went once the second was handed over
    np.testing.assert_array_equal(op.texture, b)
    # a converted upload keeps the converted buffer, not the frame
    frame = host_frame(texture(8, 8, 4, np.float16), "RGBA", "bottom")
    ref = weakref.ref(frame)
    up = sink.show(frame, op)
    del frame
    gc.collect()
    assert ref() is None and up.keep is not None and not up.zero_copy
    assert live_mem() == base
    sink.release()
    assert sink.last is None and not sink.resubmit(op)


def test_detach_swaps_a_zero_copy_source_for_our_copy(live_mem: Any) -> None:
    op = FakeScriptTOP()
    op.modify_outside_cook = True
    sink = ctd.ScriptTopSink(shape_factory=FakeCUDAMemoryShape, method="cuda")
    tex = texture(8, 8, 4, np.uint16, seed=4)
    base = live_mem()
    frame, mem = td_frame(tex)
    up = sink.show(frame, op)
    del frame, mem
    old_ptr = up.ptr
    sink.detach()
    assert live_mem() == base and not up.zero_copy and up.ptr != old_ptr
    op.texture = None
    sink.resubmit(op)
    np.testing.assert_array_equal(op.texture, tex)


# ============================================================================================ the fakes


def test_fake_copy_cuda_memory_validates_like_td() -> None:
    op = FakeScriptTOP()
    op.modify_outside_cook = True
    buf = np.zeros(2 * 2 * 4 * 4, np.uint8)
    ptr = int(buf.ctypes.data)
    good = FakeCUDAMemoryShape(2, 2, 4, np.float32)
    op.copyCUDAMemory(ptr, 64, good)
    for bad, needle in (
        (FakeCUDAMemoryShape(2, 2, 4, np.dtype("float32")), "not the dtype object"),
        (FakeCUDAMemoryShape(2, 2, 4, np.float16), "unsupported dataType float16"),
        (FakeCUDAMemoryShape(2, 2, 5, np.uint8), "numComps"),
        (FakeCUDAMemoryShape(2, 2, 4, np.uint8), "does not match"),
    ):
        with pytest.raises(TDError, match=needle):
            op.copyCUDAMemory(ptr, 64, bad)
    with pytest.raises(TDError, match="stream"):
        op.copyCUDAMemory(ptr, 64, good, stream="fast")
    with pytest.raises(TDError, match="null"):
        op.copyCUDAMemory(0, 64, good)
    with pytest.raises(TDError, match="unsupported"):
        op.copyNumpyArray(np.zeros((2, 2, 4)))
    with pytest.raises(TDError, match="only valid while the operator cooks"):
        op.addError("x")
    with pytest.raises(TDError, match="invalid custom parameter name"):
        op.appendCustomPage("P").appendStr("linkName")


# ============================================================================================ the td/ DATs


@pytest.fixture
def receiver_dat() -> Any:
    callbacks = fakes.load_td_script(fakes.TD_DIR / "receiver_script_top.py")
    callbacks.RETRY_S = 0.0
    yield callbacks
    for rx in list(callbacks._receivers.values()):
        rx.close()


def script_top(callbacks: Any, link: str) -> FakeScriptTOP:
    op = FakeScriptTOP()
    fakes.setup_parameters(callbacks, op)
    op.par.Linkname.val = link
    return op


def test_setup_parameters_makes_td_style_pars_and_keeps_values(receiver_dat: Any) -> None:
    op = FakeScriptTOP()
    fakes.setup_parameters(receiver_dat, op)
    names = [p.name for p in op.customPars]
    assert names == ["Linkname", "Active", "Flip", "Swaprb", "Matchformat", "Reconnect"]
    assert op.par.Linkname.eval() == "td_in" and op.par.Active.eval() is True
    assert op.par.Flip.menuNames == ["auto", "on", "off"] and op.par.Flip.eval() == "auto"
    assert op.par.Reconnect.isPulse
    op.par.Linkname.val = "cam7"
    op.par.Flip.val = "off"
    fakes.setup_parameters(receiver_dat, op)  # pressing the button again keeps what the user typed
    assert op.par.Linkname.eval() == "cam7" and op.par.Flip.eval() == "off"
    assert len(op.customPages) == 1


def test_cook_before_setup_parameters_waits_on_the_default_link(receiver_dat: Any) -> None:
    op = FakeScriptTOP()
    op.cook(receiver_dat)
    assert op.warnings == ["cudalink: waiting for a producer on 'td_in'"] and op.errors == []


def test_a_producer_that_leaves_before_any_frame_is_not_said_to_leave_one_shown(receiver_dat: Any) -> None:
    name = link_name()
    op = script_top(receiver_dat, name)
    tx = cudalink.Sender(name, shape=(6, 4, 4), dtype="uint8", pixel_format="RGBA", origin="bottom")
    op.cook(receiver_dat)
    assert op.warnings == [f"cudalink: connected to {name!r}; no frame yet"]
    tx.close(timeout=0.2)
    op.cook(receiver_dat)
    assert op.warnings == [f"cudalink: the producer of {name!r} left before a frame; waiting till a new one starts"]
    assert op.texture is None


def test_script_top_shows_new_frames_and_keeps_the_last_one(receiver_dat: Any) -> None:
    name = link_name()
    op = script_top(receiver_dat, name)
    op.cook(receiver_dat)
    assert op.warnings == [f"cudalink: waiting for a producer on {name!r}"] and op.texture is None

    a, b, c = (texture(6, 4, 4, np.uint8, seed=s) for s in (1, 2, 3))
    tx = cudalink.Sender(name, shape=a.shape, dtype="uint8", pixel_format="RGBA", origin="bottom")
    op.cook(receiver_dat)
    assert op.warnings == [f"cudalink: connected to {name!r}; no frame yet"]
    tx.send(a)
    op.cook(receiver_dat)
    assert op.errors == [] and op.warnings == []
    np.testing.assert_array_equal(op.texture, a)  # host frames: copyNumpyArray, RGBA as TD's numpy path wants
    assert op.fetch("cudalink")["frames"] == 1

    copies = len(op.copies)
    for _ in range(3):  # no new frame: the cook never blocks and the image stays
        t0 = time.perf_counter()
        op.cook(receiver_dat)
        assert time.perf_counter() - t0 < 0.5
    assert len(op.copies) == copies + 3 and op.warnings == [] and op.errors == []
    np.testing.assert_array_equal(op.texture, a)
    assert "no new frame" in op.fetch("cudalink")["status"]

    tx.send(b)
    op.cook(receiver_dat)
    np.testing.assert_array_equal(op.texture, b)

    tx.close(timeout=0.2)
    op.cook(receiver_dat)
    assert op.warnings == [f"cudalink: the producer of {name!r} left; showing its last frame until a new one starts"]
    np.testing.assert_array_equal(op.texture, b)
    op.cook(receiver_dat)
    np.testing.assert_array_equal(op.texture, b)

    with cudalink.Sender(name, shape=c.shape, dtype="uint8", pixel_format="RGBA", origin="bottom") as tx2:
        tx2.send(c)
        fakes.cook_until(receiver_dat, op, lambda: np.array_equal(op.texture, c))
        assert op.errors == []
        assert receiver_dat._receivers[op.id].frames == 3
        receiver_dat._receivers[op.id].close()


def test_script_top_applies_flip_and_swap_menus(receiver_dat: Any) -> None:
    name = link_name()
    op = script_top(receiver_dat, name)
    src = texture(5, 3, 4, np.float32, seed=7)
    with cudalink.Sender(name, shape=src.shape, dtype="float32", pixel_format="BGRA", origin="top") as tx:
        tx.send(src)
        fakes.cook_until(receiver_dat, op, lambda: op.texture is not None)
        np.testing.assert_array_equal(op.texture, src[::-1][..., [2, 1, 0, 3]])  # auto: both
        op.par.Flip.val = "off"
        op.par.Swaprb.val = "off"
        tx.send(src)
        fakes.cook_until(receiver_dat, op, lambda: np.array_equal(op.texture, src))
        assert op.par.format.eval() == "rgba32float"  # Match Resolution/Format
        assert (op.par.outputresolution.eval(), op.par.resolutionw.eval(), op.par.resolutionh.eval()) == (
            "custom",
            3,
            5,
        )
        receiver_dat._receivers[op.id].close()


def test_script_top_shows_errors_and_keeps_the_image(receiver_dat: Any) -> None:
    name = link_name()
    op = script_top(receiver_dat, name)
    good = texture(4, 4, 4, np.float32, seed=1)
    with cudalink.Sender(name, shape=good.shape, dtype="float32", capacity=1024, origin="bottom") as tx:
        tx.send(good)
        fakes.cook_until(receiver_dat, op, lambda: op.texture is not None)
        tx.reconfigure(dtype="int32")
        tx.send(good.astype(np.int32))
        op.cook(receiver_dat)
        assert len(op.errors) == 1 and "uint8, uint16 or float32" in op.errors[0]
        np.testing.assert_array_equal(op.texture, good)
        # no new frame: the newest one is still that int32 one, so the error stays (it showed for one cook and
        # then read "no new frame": with a producer slower than TD's cooks it only flickered)
        for _ in range(2):
            op.cook(receiver_dat)
            assert len(op.errors) == 1 and "uint8, uint16 or float32" in op.errors[0]
            np.testing.assert_array_equal(op.texture, good)
        tx.reconfigure(dtype="float32")
        tx.send(good)
        op.cook(receiver_dat)  # a frame TD takes clears it
        assert op.errors == [] and op.warnings == []
        np.testing.assert_array_equal(op.texture, good)
        receiver_dat._receivers[op.id].close()


@pytest.mark.parametrize(
    ("dtype", "fmt"), [(np.uint8, "mono8fixed"), (np.uint16, "mono16fixed"), (np.float32, "mono32float")]
)
def test_match_format_sets_tds_own_mono_formats(receiver_dat: Any, dtype: Any, fmt: str) -> None:
    """TD's Pixel Format menu names one channel "mono" (``mono8fixed``); "r8fixed" is no entry of it, so
    Match Resolution/Format never matched a mono TOP's frames and warned instead."""
    name = link_name()
    op = script_top(receiver_dat, name)
    src = texture(4, 5, 1, dtype, seed=1)
    with cudalink.Sender(name, shape=src.shape, dtype=src.dtype, origin="bottom") as tx:
        tx.send(src)
        fakes.cook_until(receiver_dat, op, lambda: op.texture is not None)
        assert op.warnings == [] and op.errors == []
        assert op.par.format.eval() == fmt
        np.testing.assert_array_equal(op.texture, src)
        receiver_dat._receivers[op.id].close()


def test_script_top_says_when_td_has_no_format_for_the_frames_channels(receiver_dat: Any) -> None:
    """Match Resolution/Format kept the last format without a word for 3-channel frames (TD has none)."""
    name = link_name()
    op = script_top(receiver_dat, name)
    src = texture(4, 4, 3, np.uint16, seed=1)
    with cudalink.Sender(name, shape=src.shape, dtype="uint16", origin="bottom") as tx:
        tx.send(src)
        fakes.cook_until(receiver_dat, op, lambda: op.texture is not None)
        assert op.warnings == [
            "cudalink: could not match the Script TOP's format: format (TD has no 3-channel uint16 format; it "
            "stays as it is)"
        ], op.warnings
        receiver_dat._receivers[op.id].close()


def test_to_script_top_names_what_is_not_a_frame_or_not_a_script_top() -> None:
    """A numpy array, or ``op('script1')`` returning None, raised bare AttributeErrors from inside."""
    frame = cudalink.Frame.from_array(texture(2, 2, 4, np.uint8))
    with pytest.raises(cudalink.ArgumentTypeError, match=r"shown a cudalink Frame.*Frame\.from_array"):
        ctd.to_script_top(np.zeros((2, 2, 4), np.uint8), FakeScriptTOP())  # type: ignore[arg-type]
    with pytest.raises(cudalink.ArgumentTypeError, match=r"None is not a Script TOP.*op\('script1'\)"):
        ctd.to_script_top(frame, None)  # type: ignore[arg-type]


def test_script_top_bad_link_name_is_an_error_not_an_exception(receiver_dat: Any) -> None:
    op = script_top(receiver_dat, "../etc")
    op.cook(receiver_dat)
    assert len(op.errors) == 1 and "invalid link name" in op.errors[0]


def test_script_top_active_link_change_and_reconnect(receiver_dat: Any) -> None:
    n1, n2 = link_name(), link_name()
    op = script_top(receiver_dat, n1)
    a, b = texture(3, 3, 4, np.uint8, seed=1), texture(3, 3, 4, np.uint8, seed=2)
    kw: dict[str, Any] = {"shape": a.shape, "dtype": "uint8", "pixel_format": "RGBA", "origin": "bottom"}
    with cudalink.Sender(n1, **kw) as t1, cudalink.Sender(n2, **kw) as t2:
        t1.send(a)
        t2.send(b)
        fakes.cook_until(receiver_dat, op, lambda: np.array_equal(op.texture, a))
        rx = receiver_dat._receivers[op.id]
        op.par.Active.val = False
        op.cook(receiver_dat)
        assert rx.receiver is None and rx.status == "inactive"
        np.testing.assert_array_equal(op.texture, a)  # still shown, now from our own copy
        op.par.Active.val = True
        op.par.Linkname.val = n2
        fakes.cook_until(receiver_dat, op, lambda: np.array_equal(op.texture, b))
        first = rx.receiver
        fakes.pulse(receiver_dat, op, "Reconnect")
        assert rx.receiver is None
        t2.send(a)
        fakes.cook_until(receiver_dat, op, lambda: np.array_equal(op.texture, a))
        assert rx.receiver is not first
        rx.close()


def test_script_top_receiver_over_memory_transport() -> None:
    transport = MemoryTransport()
    name = link_name()
    rx = ctd.ScriptTopReceiver(name, transport=transport, retry_s=0, shape_factory=FakeCUDAMemoryShape)
    op = FakeScriptTOP()
    op.cooking = True
    assert "waiting" in rx.cook(op)
    src = texture(4, 4, 4, np.uint8, seed=5)
    with cudalink.Sender(name, shape=src.shape, transport=transport, pixel_format="BGRA", origin="bottom") as tx:
        tx.send(src)
        assert rx.cook(op).startswith("frame 1")
        assert rx.cook(op) == "showing frame 1 (no new frame)"
        np.testing.assert_array_equal(op.texture, src[..., [2, 1, 0, 3]])  # numpy path is RGBA
        rx.close()


@pytest.fixture
def sender_dat() -> Any:
    top = FakeTOP(texture(6, 5, 4, np.uint8, seed=11), name="null_out")
    me = fakes.FakeDAT(ops={"null_out": top})
    dat = fakes.load_td_script(fakes.TD_DIR / "sender_execute_dat.py", me=me)
    dat.LINK_NAME = link_name()
    dat.DEVICE = "cpu"
    dat.top, dat.dat_op = top, me
    yield dat
    dat.onExit()


def test_execute_dat_exports_the_top_each_frame_end(sender_dat: Any, live_mem: Any) -> None:
    base = live_mem()
    sender_dat.onStart()
    sender_dat.onFrameEnd(1)
    assert live_mem() == base
    with cudalink.Receiver(sender_dat.LINK_NAME, timeout=2) as rx:
        frame = rx.recv()
        assert (frame.pixel_format, frame.origin) == (PixelFormat.BGRA, RowOrigin.BOTTOM)
        np.testing.assert_array_equal(frame.numpy(), sender_dat.top.texture)
        frame.release()
        sender_dat.top.texture = texture(6, 5, 4, np.uint8, seed=12)
        sender_dat.onFrameEnd(2)
        np.testing.assert_array_equal(rx.recv().numpy(), sender_dat.top.texture)
        assert sender_dat.dat_op.script_errors == []
        sender_dat.onExit()
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=2)


def test_execute_dat_reports_a_missing_top_once(sender_dat: Any) -> None:
    me = sender_dat.dat_op
    top = me.ops.pop("null_out")
    sender_dat.onFrameEnd(1)
    sender_dat.onFrameEnd(2)
    assert len(me.script_errors) == 1 and "no TOP named 'null_out'" in me.script_errors[0]
    me.ops["null_out"] = top
    sender_dat.onFrameEnd(3)
    assert me.script_errors == []


def test_editing_the_execute_dat_hands_its_link_to_the_new_load(live_mem: Any) -> None:
    """TD recompiles an edited DAT into a new module; the old one, with the TDSender that still publishes
    LINK_NAME, is garbage that only Python's cycle collector frees, maybe minutes later. The new load's export
    must take the name over at its first frame, not fail (and stall TD's thread a quarter second) every frame."""
    name = link_name()
    top = FakeTOP(texture(6, 5, 4, np.uint8, seed=21), name="null_out")
    me = fakes.FakeDAT(ops={"null_out": top})
    enabled = gc.isenabled()
    gc.disable()  # as in a TD process whose old objects are rarely collected: no collection by chance here
    try:
        first = fakes.load_td_script(fakes.TD_DIR / "sender_execute_dat.py", me=me)
        first.LINK_NAME, first.DEVICE = name, "cpu"
        first.onFrameEnd(1)
        old = weakref.ref(first._state["sender"])
        del first  # TD lets go of the old module: only its cycles keep it
        again = fakes.load_td_script(fakes.TD_DIR / "sender_execute_dat.py", me=me)
        again.LINK_NAME, again.DEVICE = name, "cpu"
        with cudalink.Receiver(name, connect=False) as rx:
            t0 = time.monotonic()
            again.onFrameEnd(2)
            assert me.script_errors == [] and again._state["sender"].sent == 1
            assert time.monotonic() - t0 < 1.0
            assert old() is None
            top.texture = texture(6, 5, 4, np.uint8, seed=22)
            again.onFrameEnd(3)
            np.testing.assert_array_equal(rx.recv(timeout=2).numpy(), top.texture)
        again.onExit()
    finally:
        if enabled:
            gc.enable()


def test_two_exports_of_one_name_in_one_process_say_so() -> None:
    top = FakeTOP(texture(4, 4, 4, np.uint8, seed=24))
    name = link_name()
    with ctd.TDSender(name, device="cpu") as first, ctd.TDSender(name, device="cpu") as second:
        assert first.send_top(top) == 1
        t0 = time.monotonic()
        with pytest.raises(LinkError, match="another TDSender of this process publishes"):
            second.send_top(top)
        assert time.monotonic() - t0 < 0.2
        assert first.send_top(top) == 2  # the first keeps its link


def test_a_name_taken_by_another_process_fails_fast_and_recovers(spawned: Any) -> None:
    """Each attempt to publish a taken name looks for its holder a quarter second, on TD's thread: an
    Execute DAT that retried every frame ran TD at 4 fps. Attempts come at most once a second meanwhile, and
    the export starts by itself once the other producer is gone."""
    try:
        from ._procs import host_producer_forever
    except ImportError:
        from _procs import host_producer_forever  # type: ignore[no-redef]

    name = link_name()
    holder = spawned.ready(host_producer_forever, name, (4, 4, 4), "uint8", forever=True)
    top = FakeTOP(texture(4, 4, 4, np.uint8, seed=23))
    with ctd.TDSender(name, device="cpu") as tx:
        with pytest.raises(LinkError, match="already published"):
            tx.send_top(top)
        slow = 0
        t_end = time.monotonic() + 0.8
        while time.monotonic() < t_end:  # TD's next frames, while the other producer is still there
            t0 = time.monotonic()
            with pytest.raises(LinkError, match="already published"):
                tx.send_top(top)
            slow += time.monotonic() - t0 > 0.1
            time.sleep(0.016)
        assert slow == 0, f"{slow} frames waited for the name's holder"
        spawned.kill(holder)
        sent = None
        t_end = time.monotonic() + 5
        while sent is None and time.monotonic() < t_end:
            try:
                sent = tx.send_top(top)
            except LinkError:
                time.sleep(0.016)
        assert sent == 1


def test_td_to_td_through_both_dats(sender_dat: Any, receiver_dat: Any) -> None:
    op = script_top(receiver_dat, sender_dat.LINK_NAME)
    sender_dat.onFrameEnd(1)
    fakes.cook_until(receiver_dat, op, lambda: op.texture is not None)
    # TD's 8-bit CUDA layout is BGRA; the host Script TOP path (copyNumpyArray) takes RGBA: auto swaps
    np.testing.assert_array_equal(op.texture, sender_dat.top.texture[..., [2, 1, 0, 3]])
    receiver_dat._receivers[op.id].close()


def test_zero_copy_image_is_copied_before_a_closing_producer_frees_it() -> None:
    """The producer waits for consumers to leave before freeing; we copy the shown frame first, then leave."""
    import threading

    name = link_name()
    rx = ctd.ScriptTopReceiver(name, retry_s=0, method="cuda", shape_factory=FakeCUDAMemoryShape)
    op = FakeScriptTOP()
    op.cooking = True
    src = texture(4, 4, 4, np.uint8, seed=8)
    tx = cudalink.Sender(name, shape=src.shape, pixel_format="BGRA", origin="bottom")
    tx.send(src)
    for _ in range(100):
        if rx.cook(op).startswith("frame"):
            break
        time.sleep(0.01)
    assert rx.sink.last is not None and rx.sink.last.zero_copy
    closer = threading.Thread(target=tx.close, kwargs={"timeout": 10})
    closer.start()
    for _ in range(200):
        if _producer_closing(rx.receiver):  # type: ignore[arg-type]
            break
        time.sleep(0.005)
    t0 = time.monotonic()
    status = rx.cook(op)
    assert "closing" in status or "left" in status
    assert not rx.sink.last.zero_copy  # our own copy now, before we leave
    while "left" not in status and time.monotonic() - t0 < 5:
        status = rx.cook(op)
    closer.join(5)
    assert not closer.is_alive() and time.monotonic() - t0 < 5
    op.texture = None
    rx.cook(op)
    np.testing.assert_array_equal(op.texture, src)
    rx.close()


def test_status_outside_a_cook_falls_back_to_a_script_error() -> None:
    op = FakeScriptTOP()
    op.modify_outside_cook = True  # TD 2025's "Modify Outside of Cook": copies work, addWarning does not
    rx = ctd.ScriptTopReceiver(link_name(), shape_factory=FakeCUDAMemoryShape)
    assert "waiting" in rx.cook(op)
    assert op.warnings == [] and len(op.script_errors) == 1 and "waiting" in op.script_errors[0]
    op.addScriptError("someone else's error")
    rx.cook(op)  # replaces its own message, leaves others alone
    assert op.script_errors[0] == "someone else's error" and len(op.script_errors) == 2
    rx.close()


def test_cupy_streams_come_from_from_external_where_cupy_has_it() -> None:
    """cupy 14 deprecates ``ExternalStream``: the raw stream goes through ``Stream.from_external`` there."""
    from types import ModuleType, SimpleNamespace

    from cudalink.td.arraylib import cupy_stream

    seen: list[tuple[str, int]] = []

    class NewStream:
        @staticmethod
        def from_external(obj: Any) -> str:
            seen.append(("from_external", obj.__cuda_stream__()[1]))
            return "wrapped"

    def external(ptr: int) -> str:
        seen.append(("ExternalStream", ptr))
        return "legacy"

    new, old = ModuleType("cupy"), ModuleType("cupy")
    new.cuda = SimpleNamespace(Stream=NewStream, ExternalStream=external)  # type: ignore[attr-defined]
    old.cuda = SimpleNamespace(Stream=object, ExternalStream=external)  # type: ignore[attr-defined]
    assert cupy_stream(new, 0x1234) == "wrapped"
    assert cupy_stream(old, 0x5678) == "legacy"
    assert seen == [("from_external", 0x1234), ("ExternalStream", 0x5678)]


def test_a_script_top_refused_by_its_producer_tries_again_every_retry_s_not_every_cook() -> None:
    """A producer whose consumer places are all taken refuses the TOP: that error shows on the TOP, and the TOP
    asks again every ``retry_s`` (as while no producer is there), not on every cook of TD's thread."""
    name = link_name()
    src = texture(4, 4, 4, np.uint8, seed=3)
    with cudalink.Sender(name, shape=src.shape, device="cpu", max_consumers=1) as tx, cudalink.Receiver(name) as first:
        tx.send(src)
        first.recv(timeout=5).release()
        rx = ctd.ScriptTopReceiver(name, retry_s=60.0, shape_factory=FakeCUDAMemoryShape)
        op = FakeScriptTOP()
        op.cooking = True
        tries = 0
        attach = cudalink.Receiver._attach

        def counted(self: Any, *a: Any, **kw: Any) -> Any:
            nonlocal tries
            tries += 1
            return attach(self, *a, **kw)

        cudalink.Receiver._attach = counted  # type: ignore[method-assign]
        try:
            statuses = [rx.cook(op) for _ in range(20)]
        finally:
            cudalink.Receiver._attach = attach  # type: ignore[method-assign]
            rx.close()
        assert tries == 1, f"{tries} attaches in 20 cooks"
        assert all("max_consumers" in s or "consumer" in s for s in statuses), statuses
        assert len(set(statuses)) == 1, statuses  # the same cause shown on every cook


def test_a_deleted_script_tops_receiver_is_closed_at_the_next_cook_of_another(receiver_dat: Any) -> None:
    """TD calls nothing when a Script TOP is deleted: its receiver held a producer's slot (and made the
    producer's close() wait out its timeout) for as long as the callbacks DAT lived. Once ``OP.valid`` is False,
    the next cook of another TOP of that DAT closes it."""
    name = link_name()
    src = texture(4, 4, 4, np.uint8, seed=4)
    gone, kept = script_top(receiver_dat, name), script_top(receiver_dat, name)
    with cudalink.Sender(name, shape=src.shape, origin="bottom") as tx:
        tx.send(src)
        fakes.cook_until(receiver_dat, gone, lambda: np.array_equal(gone.texture, src))
        fakes.cook_until(receiver_dat, kept, lambda: np.array_equal(kept.texture, src))
        old = receiver_dat._receivers[gone.id]
        assert old.receiver is not None and tx.stats()["consumers"] == 2
        kept.cook(receiver_dat)
        assert receiver_dat._receivers[gone.id] is old  # alive: kept
        gone.valid = False  # deleted in TD
        kept.cook(receiver_dat)
        assert gone.id not in receiver_dat._receivers and old.receiver is None
        end = time.monotonic() + 10.0  # the producer hears of the hang-up on its own time
        while tx.stats()["consumers"] != 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert tx.stats()["consumers"] == 1
        np.testing.assert_array_equal(kept.texture, src)
