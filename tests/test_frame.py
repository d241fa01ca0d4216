"""FrameSpec validation and host Frame export (issue 2), with hypothesis properties."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cudalink
from cudalink.frames import SUPPORTED_DTYPES, Frame, FrameSpec, PixelFormat, RowOrigin

from .conftest import DEFAULT, PairFactory

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)


def _array(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 255, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(shape)
    if np.dtype(dtype).kind in "fc":
        arr = np.nan_to_num(arr)  # NaN != NaN would make equality checks meaningless
    if dtype == "bool":
        arr = arr.astype(bool)
    return arr


@settings(max_examples=150, deadline=None)
# numpy's from_dlpack takes no bfloat16 (DLPack's kDLBfloat): test_bfloat16.py reads those frames
@given(
    shape=shapes,
    dtype=st.sampled_from([d for d in SUPPORTED_DTYPES if d != "bfloat16"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_host_frame_roundtrips_through_numpy_dlpack(shape: tuple[int, ...], dtype: str, seed: int) -> None:
    arr = _array(shape, dtype, seed)
    frame = Frame.from_array(arr)
    out = np.from_dlpack(frame)
    assert out.shape == shape and out.dtype == np.dtype(dtype)
    assert np.array_equal(out, arr)
    assert out.ctypes.data == arr.ctypes.data  # zero copy
    assert frame.nbytes == arr.nbytes and frame.strides == arr.strides


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(4, 7), min_size=2, max_size=4).map(tuple),
    step=st.integers(2, 3),
    dtype=st.sampled_from(["uint8", "float32", "int64", "float16"]),
)
def test_strides_are_kept(shape: tuple[int, ...], step: int, dtype: str) -> None:
    base = _array(shape, dtype, 1)
    view = base[::step, ...]
    frame = Frame.from_array(view)
    assert frame.strides == view.strides
    out = np.from_dlpack(frame)
    assert out.strides == view.strides and np.array_equal(out, view)


@given(
    st.one_of(
        st.integers(-5, 0).map(lambda d: (3, d)),
        st.just(()),
        st.just((1,) * 9),
        st.just((1 << 30, 1 << 30, 4)),
        st.just((2.5, 3)),
        st.just("abc"),
    )
)
def test_invalid_shapes_are_refused(shape: object) -> None:
    with pytest.raises(cudalink.FormatError, match="cudalink"):
        FrameSpec(shape, "float32")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float128", ">f4", "U3", object, "datetime64[s]", "nonsense", 3.5])
def test_unsupported_dtypes_are_refused(dtype: object) -> None:
    with pytest.raises(cudalink.FormatError, match=r"dtype|not a dtype"):
        FrameSpec((2, 2), dtype)


def test_spec_validation_messages() -> None:
    with pytest.raises(cudalink.FormatError, match="4 channel"):
        FrameSpec((4, 4, 3), "uint8", pixel_format="RGBA8")
    with pytest.raises(cudalink.FormatError, match="unknown pixel format"):
        FrameSpec((4, 4, 4), "uint8", pixel_format="XYZW")
    with pytest.raises(cudalink.FormatError, match="multiples of the itemsize"):
        FrameSpec((4, 4), "float32", strides=(16, 3))
    with pytest.raises(cudalink.FormatError, match="overlap"):
        FrameSpec((4, 4), "float32", strides=(4, 4))
    with pytest.raises(cudalink.FormatError, match="strides must be a tuple"):
        FrameSpec((4,), "uint8", strides=4)  # type: ignore[arg-type]
    with pytest.raises(cudalink.FormatError, match="frame limit"):
        FrameSpec((1, 2), "uint8", strides=(2**63, 1))  # spans nothing, but numpy refuses such a view
    with pytest.raises(cudalink.FormatError, match="origin"):
        FrameSpec((4, 4), "float32", origin="left")
    spec = FrameSpec((2, 3, 4), np.float32, pixel_format="BGRA", origin="bottom")
    assert spec.pixel_format is PixelFormat.BGRA and spec.origin is RowOrigin.BOTTOM
    assert spec.label == "BGRA32F bottom-up" and spec.nbytes == 96
    assert FrameSpec((2, 3), "float32", strides=(12, 4)).strides is None  # contiguous strides normalise away


def test_a_spec_takes_shape_dtype_and_pixel_format_in_that_order() -> None:
    """Issue 2's FrameSpec is (shape, dtype, pixel format): a name third is the pixel format, never strides."""
    spec = FrameSpec((4, 4, 4), "uint8", "RGBA8")
    assert spec.pixel_format is PixelFormat.RGBA and spec.strides is None and spec.label == "RGBA8"
    assert FrameSpec((2, 2, 4), "float32", PixelFormat.BGRA, "bottom").label == "BGRA32F bottom-up"
    assert FrameSpec((2, 2, 4), "float32", "BGRA", origin="bottom").label == "BGRA32F bottom-up"
    assert spec == FrameSpec(shape=(4, 4, 4), dtype="uint8", pixel_format="RGBA8")
    with pytest.raises(cudalink.FormatError, match="two pixel formats"):
        FrameSpec((4, 4, 4), "uint8", "RGBA", "BGRA")
    with pytest.raises(cudalink.FormatError, match="depth suffix"):
        FrameSpec((4, 4, 4), "float32", "RGBA8")
    with pytest.raises(cudalink.FormatError, match="strides must be a tuple"):  # a name of nothing stays an error
        FrameSpec((4, 4), "uint8", "abc")  # type: ignore[arg-type]


def test_pixel_format_and_origin_compare_equal_to_their_names(pair: PairFactory) -> None:
    """Issue 2 spells pixel formats and row origins as names ("RGBA", "top"/"bottom"): a frame's compare equal to
    them, as well as being the enum members."""
    frame = Frame.from_array(np.zeros((2, 2, 4), np.uint8), pixel_format="RGBA8", origin="bottom")
    assert frame.pixel_format == "RGBA" and frame.pixel_format is PixelFormat.RGBA
    assert frame.origin == "bottom" and frame.origin is RowOrigin.BOTTOM and frame.origin != "top"
    tx, rx = pair(shape=(2, 2, 4), dtype="float32", pixel_format="BGRA32F", origin="bottom", transport=DEFAULT)
    tx.send(np.ones((2, 2, 4), np.float32))
    with rx.recv(timeout=2.0) as got:
        assert (got.pixel_format, got.origin) == ("BGRA", "bottom")
        assert got.spec.label == "BGRA32F bottom-up"
    # read as the name on every Python (a str mixin's format() differs between 3.10 and 3.11+)
    assert (str(PixelFormat.RGBA), f"{PixelFormat.RGBA}", f"{RowOrigin.TOP:>4}") == ("RGBA", "RGBA", " top")


def test_mismatched_nbytes_are_refused() -> None:
    """A size that does not match the spec is a clear error: given to FrameSpec, or as the array a Frame wraps."""
    assert FrameSpec((4, 4), "uint16", nbytes=32).nbytes == 32
    assert FrameSpec((2, 3), "uint8", strides=(4, 1), nbytes=7).nbytes == 7  # the span the strides reach
    with pytest.raises(cudalink.FormatError, match=r"^cudalink: nbytes=30 .* spans 32 bytes.*nbytes=32"):
        FrameSpec((4, 4), "uint16", nbytes=30)
    with pytest.raises(cudalink.FormatError, match="nbytes must be an integer"):
        FrameSpec((4, 4), "uint16", nbytes="32")  # type: ignore[arg-type]
    arr = np.zeros(8, np.uint8)
    with pytest.raises(cudalink.FormatError, match=r"^cudalink: .*16 bytes.*outside the 8 bytes.*from_array"):
        Frame(FrameSpec((4, 4), "uint8"), arr.ctypes.data, arr)
    with pytest.raises(cudalink.FormatError, match="outside the 8 bytes"):
        Frame(FrameSpec((8,), "uint8"), arr.ctypes.data + 1, arr)
    assert np.from_dlpack(Frame(FrameSpec((4,), "uint8"), arr.ctypes.data + 4, arr)).shape == (4,)


def test_frame_metadata() -> None:
    arr = np.zeros((4, 5, 4), np.uint8)
    frame = Frame.from_array(arr, pixel_format="BGRA8", origin="bottom", seq=9, timestamp_ns=123, meta=b"hi")
    assert (frame.seq, frame.timestamp_ns, frame.meta) == (9, 123, b"hi")
    assert frame.device == "cpu" and not frame.is_cuda and frame.__dlpack_device__() == (1, 0)
    assert frame.pixel_format is PixelFormat.BGRA and frame.origin is RowOrigin.BOTTOM
    assert repr(frame) == "<cudalink.Frame seq=9 BGRA8 bottom-up (4, 5, 4) cpu>"
    plain = Frame.from_array(np.zeros((4, 5), np.float32), seq=2)  # its label is its shape: said once
    assert repr(plain) == "<cudalink.Frame seq=2 4x5 float32 cpu>"
    plain.release()
    assert repr(plain) == "<cudalink.Frame seq=2 4x5 float32 released>"


@pytest.mark.parametrize(
    "view",
    [np.arange(48, dtype=np.uint8).reshape(4, 4, 3)[::-1], np.broadcast_to(np.uint8(1), (4, 4))],
    ids=["flip", "broadcast"],
)
def test_from_array_says_how_to_wrap_what_it_cannot_wrap_as_is(view: np.ndarray) -> None:
    """A flip or a broadcast has strides no frame can have (send() copies them right); the error named none
    of the ways out."""
    with pytest.raises(cudalink.FormatError, match=r"np\.ascontiguousarray\(x\).*send\(\) copies"):
        Frame.from_array(view)
    assert Frame.from_array(np.ascontiguousarray(view)).shape == view.shape


@pytest.mark.parametrize(
    ("kw", "kind", "words"),
    [
        ({"meta": 5}, TypeError, "meta must be bytes"),  # was five zero bytes
        ({"meta": [1, 2]}, TypeError, "meta must be bytes"),  # was b"\x01\x02"
        ({"meta": "tag"}, TypeError, r"meta=text.encode\(\)"),  # was "string argument without an encoding"
        ({"seq": 1.7}, TypeError, "seq must be an integer"),  # was seq 1
        ({"seq": "3"}, TypeError, "seq must be an integer"),  # was seq 3
        ({"seq": -3}, ValueError, "seq must be 0.."),  # was seq -3
        ({"timestamp_ns": 1.5}, TypeError, "timestamp_ns must be an integer"),  # was 1
        ({"timestamp_ns": -1}, ValueError, "timestamp_ns must be 0.."),  # was -1
        ({"meta": b"x" * 65}, ValueError, "at most 64 travel with a frame"),  # was kept whole: send() refuses it
        ({"meta": memoryview(np.zeros(40, np.int16))}, ValueError, "meta is 80 bytes"),  # len() counted 40 items
    ],
)
def test_from_array_refuses_what_a_frame_cannot_carry(kw: dict[str, object], kind: type, words: str) -> None:
    """``Frame.from_array``'s meta, seq and timestamp went through ``bytes()`` and ``int()``: a wrong kind was
    silently turned into something else, or a bare TypeError/ValueError from inside it."""
    with pytest.raises(kind, match=rf"^cudalink: .*{words}") as info:
        Frame.from_array(np.zeros(3, np.uint8), **kw)  # type: ignore[arg-type]
    assert isinstance(info.value, cudalink.LinkError)
    frame = Frame.from_array(np.zeros(3), meta=memoryview(b"ab"), seq=np.uint64(7), timestamp_ns=2**64 - 1)
    assert (frame.meta, frame.seq, frame.timestamp_ns) == (b"ab", 7, 2**64 - 1)
    assert Frame.from_array(np.zeros(3), meta=None).meta == b""


def test_dlpack_arguments_follow_the_rules() -> None:
    arr = np.arange(6, dtype=np.float32)
    frame = Frame.from_array(arr)
    for kw, words in (({"stream": 5}, "stream"), ({"dl_device": (2, 0)}, "device")):
        with pytest.raises(BufferError, match=words) as info:  # DLPack's kind, and one of ours
            frame.__dlpack__(**kw)  # type: ignore[arg-type]
        assert isinstance(info.value, cudalink.ExportError) and isinstance(info.value, cudalink.LinkError)
    copied = np.from_dlpack(frame, copy=True)
    assert copied.ctypes.data != arr.ctypes.data and np.array_equal(copied, arr)
    assert np.from_dlpack(frame, device="cpu").ctypes.data == arr.ctypes.data
    legacy = frame.__dlpack__()  # no max_version: the legacy capsule
    assert "dltensor" in repr(legacy)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_version": 1},
        {"max_version": "1.0"},
        {"max_version": ("1", "0")},
        {"dl_device": 1},
        {"dl_device": "cpu"},
        {"dl_device": (1,)},
        {"copy": "no"},  # truthy: it made a copy
        {"copy": 0},
    ],
)
def test_dlpack_arguments_of_the_wrong_kind_say_what_dlpack_takes(pair: PairFactory, kw: dict[str, object]) -> None:
    """A consumer's malformed ``__dlpack__`` argument was a bare TypeError from inside cudalink ("'int' object is
    not subscriptable", "'int' object is not iterable"), or, for ``copy``, taken for its truth value."""
    tx, rx = pair(shape=(3,), dtype="int32")
    with tx, rx:
        tx.send(np.array([4, 5, 6], np.int32))
        for frame in (rx.recv(1), Frame.from_array(np.arange(3, dtype=np.int32))):
            name = next(iter(kw))
            with pytest.raises(cudalink.ArgumentTypeError, match=rf"^cudalink: __dlpack__\({name}=\.\.\.\) takes "):
                frame.__dlpack__(**kw)  # type: ignore[arg-type]
            # what DLPack allows still works, in any spelling of its pairs
            assert "dltensor_versioned" in repr(frame.__dlpack__(max_version=[np.int64(1), 0]))  # type: ignore[arg-type]
            assert "dltensor" in repr(frame.__dlpack__(dl_device=[np.int32(1), 0], copy=np.bool_(False)))  # type: ignore[arg-type]


def _versioned_flags(capsule: object) -> int:
    """The ``flags`` word of a DLManagedTensorVersioned (after version, manager_ctx and deleter)."""
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, b"dltensor_versioned")
    return int(ctypes.c_uint64.from_address(ptr + 24).value)


def test_a_copied_export_says_so_and_a_received_view_says_read_only(pair: PairFactory) -> None:
    read_only, is_copied = 1, 2  # DLPACK_FLAG_BITMASK_READ_ONLY, DLPACK_FLAG_BITMASK_IS_COPIED
    tx, rx = pair(shape=(3,), dtype="int32")
    with tx, rx:
        tx.send(np.array([4, 5, 6], np.int32))
        with rx.recv(1) as frame:
            copied = frame.__dlpack__(max_version=(1, 0), copy=True)
            assert _versioned_flags(copied) & is_copied and not _versioned_flags(copied) & read_only
            view = frame.__dlpack__(max_version=(1, 0))
            assert _versioned_flags(view) == read_only
            del copied, view
            assert np.from_dlpack(frame, copy=True).tolist() == [4, 5, 6]


def test_received_host_frames_are_read_only_and_reserved_ones_writable(pair: PairFactory) -> None:
    tx, rx = pair(shape=(3,), dtype="int32")
    with tx, rx:
        with tx.reserve() as w:
            np.from_dlpack(w)[...] = [1, 2, 3]
        frame = rx.recv(1)
        out = np.from_dlpack(frame)
        assert out.tolist() == [1, 2, 3]
        with pytest.raises(ValueError):
            out[0] = 5


def test_release_waits_for_every_view() -> None:
    """The owner's release runs only once the frame *and* every array made from it are gone."""
    released: list[list[int]] = []
    arr = np.arange(8, dtype=np.int16)
    frame = Frame(FrameSpec((8,), "int16"), arr.ctypes.data, arr, on_release=released.append)
    view = np.from_dlpack(frame)
    frame.release()
    gc.collect()
    assert released == [] and view.sum() == 28  # the view still holds the memory
    with pytest.raises(cudalink.LinkClosed):
        frame.numpy()
    with pytest.raises(cudalink.ExportError, match="released"):  # a BufferError too, as DLPack callers expect
        np.from_dlpack(frame)
    del view
    gc.collect()
    assert released == [[]]


def test_context_manager_releases() -> None:
    released: list[list[int]] = []
    arr = np.arange(4, dtype=np.int8)
    with Frame(FrameSpec((4,), "int8"), arr.ctypes.data, arr, on_release=released.append) as f:
        assert f.numpy().tolist() == [0, 1, 2, 3]
    gc.collect()
    assert f.released and released == [[]]


def test_cuda_frame_apis_refuse_cleanly_on_host() -> None:
    frame = Frame.from_array(np.zeros(3))
    assert not hasattr(frame, "__cuda_array_interface__")  # an AttributeError: CAI probes must see none
    with pytest.raises(AttributeError, match=r"^cudalink: .* only on CUDA frames; use np.from_dlpack"):
        frame.__cuda_array_interface__  # noqa: B018
    assert np.array_equal(frame.to_numpy(), np.zeros(3))
    assert np.asarray(frame).shape == (3,)


def test_no_gpu_gives_a_clear_error_naming_the_cpu_backend() -> None:
    from tests.conftest import gpu_reason

    if gpu_reason() is None:
        pytest.skip("a GPU is present")
    with pytest.raises(cudalink.CudaUnavailable, match="device='cpu'"):
        cudalink.Sender("nogpu", shape=(4,), device=0)
    # a Receiver asked for a GPU says why there is none, not "pass one of these ordinals: none"
    why = r"no cuda:0 here: .*(driver|no GPU).*device='cpu'"
    with cudalink.Sender("nogpu-rx", shape=(4,), device="cpu"), pytest.raises(cudalink.CudaUnavailable, match=why):
        cudalink.Receiver("nogpu-rx", device=0, timeout=1.0)


class _TorchLikeStream:
    def __init__(self, value: int) -> None:
        self.cuda_stream = value


class _CoreLikeStream:
    def __init__(self, value: int) -> None:
        self.handle = value


def test_one_stream_normalisation_with_dlpacks_rules_on_request() -> None:
    """``driver.stream_handle`` serves both the API (``stream=`` of send/reserve) and ``__dlpack__``."""
    from cudalink.cuda import driver

    for dlpack in (False, True):
        assert driver.stream_handle(7, dlpack=dlpack) == 7
        assert driver.stream_handle(_TorchLikeStream(9), dlpack=dlpack) == 9
        assert driver.stream_handle(_CoreLikeStream(11), dlpack=dlpack) == 11
    # the API: a framework's 0 is its default stream, the legacy one
    assert driver.stream_handle(0) == 1 and driver.stream_handle(_TorchLikeStream(0)) == 1
    with pytest.raises(cudalink.LinkError, match="no stream"):
        driver.stream_handle(None)
    with pytest.raises(cudalink.LinkError, match="is not a stream"):
        driver.stream_handle("s")
    # DLPack: None is the legacy default, -1 means no sync, 0 and other negatives are refused
    assert driver.stream_handle(None, dlpack=True) == 1 and driver.stream_handle(-1, dlpack=True) == -1
    for bad, text in ((0, "forbids stream=0"), (-2, "invalid DLPack stream"), ("s", "must be an int")):
        with pytest.raises(BufferError, match=text):
            driver.stream_handle(bad, dlpack=True)


# -- DLPack's default streams (1: legacy, 2: per-thread) name the frame's GPU's, whatever is current ----------


class _Contexts:
    """The driver's current-context calls, faked: ``now`` is the calling thread's context (0: none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: int) -> None:
        from cudalink.cuda import devices, driver

        self.now = now
        self.log: list[tuple[str, int, int]] = []
        monkeypatch.setattr(driver, "current_context", lambda: self.now)
        monkeypatch.setattr(driver, "set_context", self._set)
        monkeypatch.setitem(devices._primaries, 0, OURS)  # GPU 0's primary context, as devices.context made it

    def _set(self, ctx: int) -> None:
        self.now = ctx


OURS, OTHER = 111, 222


class _Sync:
    def __init__(self, ctx: _Contexts) -> None:
        self.ctx = ctx

    def wait(self, stream: int) -> None:
        self.ctx.log.append(("wait", stream, self.ctx.now))

    def cai_stream(self) -> int | None:
        return None


class _Export:
    def capsule(self, hold: object, writable: bool, versioned: bool) -> str:
        return "capsule"


def _cuda_frame(ctx: _Contexts) -> Frame:
    from cudalink.frames.frame import _Hold

    spec = FrameSpec((4, 4), "uint8")
    return Frame._received(spec, _Hold(None, 0x1000), 0, 1, 0, b"", _Sync(ctx), 1, None, _Export())  # type: ignore[arg-type]


@pytest.mark.parametrize("current", [OTHER, 0, OURS], ids=["another-gpu-current", "none-current", "ours-current"])
@pytest.mark.parametrize("stream", [None, 1, 2])
def test_dlpacks_default_streams_are_waited_on_in_the_frames_gpu_context(
    monkeypatch: pytest.MonkeyPatch, current: int, stream: int | None
) -> None:
    """torch's from_dlpack passes 1 for a frame on GPU 0 while GPU 1 is current, and switches nothing: the wait
    on the frame's ready event must go to GPU 0's stream (its context current for the call, the caller's put
    back after); the release fence goes on that same default stream (recorded in the frame's GPU context too)."""
    ctx = _Contexts(monkeypatch, current)
    frame = _cuda_frame(ctx)
    assert frame.__dlpack__(stream=stream) == "capsule"
    assert ctx.log == [("wait", 1 if stream is None else stream, OURS)]
    assert ctx.now == (current or OURS)  # the caller's context back; a thread that had none keeps ours
    assert frame._export_streams() == [1 if stream is None else stream]


@pytest.mark.parametrize("stream", [1, 0x7F00])
def test_a_frame_sent_on_orders_the_senders_stream_as_an_export_does(
    monkeypatch: pytest.MonkeyPatch, stream: int
) -> None:
    """A relay sends a received frame on: the send's stream waits for the frame's producer by the same rule as a
    DLPack export (a default stream in the frame's GPU context, a real one as it is), and -1 orders nothing."""
    ctx = _Contexts(monkeypatch, OTHER)
    frame = _cuda_frame(ctx)
    frame._cudalink_array_info(stream)
    frame._cudalink_array_info(-1)
    assert ctx.log == [("wait", stream, OURS if stream <= 2 else OTHER)] and ctx.now == OTHER


def test_a_stream_of_its_own_is_waited_on_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real stream handle carries its context: no switch, and the fence goes on that very stream."""
    ctx = _Contexts(monkeypatch, OTHER)
    frame = _cuda_frame(ctx)
    frame.__dlpack__(stream=0x7F00)
    assert ctx.log == [("wait", 0x7F00, OTHER)] and ctx.now == OTHER
    assert frame._export_streams() == [0x7F00]


def test_a_stream_handle_that_is_no_pointer_is_refused_before_the_driver_sees_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream handle is a 64-bit pointer: a larger int (or a negative one, outside DLPack's -1) went through
    ``stream_handle`` unchanged, and the driver's ``CUstream`` raised a bare OverflowError ("Python int too
    large to convert to C unsigned long"), not DLPack's BufferError nor a cudalink error."""
    from cudalink.cuda import driver

    huge = 1 << 64
    for bad in (huge, 1 << 70, _TorchLikeStream(huge), _CoreLikeStream(huge)):
        with pytest.raises(cudalink.ExportError, match=r"^cudalink: invalid DLPack stream .*-1 for no synchron"):
            driver.stream_handle(bad, dlpack=True)
    for bad in (huge, -5, _TorchLikeStream(-5), _CoreLikeStream(huge)):
        with pytest.raises(cudalink.ArgumentError, match=r"^cudalink: -?\d+ is not a CUDA stream handle"):
            driver.stream_handle(bad)
    assert driver.stream_handle((1 << 64) - 1, dlpack=True) == (1 << 64) - 1  # the largest pointer still is one
    ctx = _Contexts(monkeypatch, OURS)
    frame = _cuda_frame(ctx)
    with pytest.raises(BufferError, match=r"^cudalink: invalid DLPack stream"):
        frame.__dlpack__(stream=huge)
    assert ctx.log == [] and frame._export_streams() == []  # nothing waited on, no fence owed


def test_release_fences_on_default_streams_are_recorded_in_the_frames_gpu_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer's release runs on whichever thread drops the frame, with whatever GPU it has current: the
    slot's release event (made in the slot GPU's context) goes on that GPU's default stream, and a landing
    buffer's fence on the landing GPU's; real streams are recorded on as they are."""
    import threading

    from cudalink import _backends
    from cudalink.cuda import devices, driver, landing

    ctx = _Contexts(monkeypatch, OTHER)
    recorded: list[tuple[object, int, int]] = []
    monkeypatch.setattr(driver, "record", lambda ev, s: recorded.append((ev, s, ctx.now)))
    monkeypatch.setattr(devices, "has_current", lambda: ctx.now != 0)

    view = object.__new__(_backends.CudaView)
    view.ctx, view._closed, view._tls, view._join = OURS, False, threading.local(), None
    view._release_raw = ["release-0"]
    assert view.fence(0, [1])
    assert view.fence(0, [0x7F00])
    assert recorded == [("release-0", 1, OURS), ("release-0", 0x7F00, OTHER)] and ctx.now == OTHER

    recorded.clear()
    ops = object.__new__(landing.CudaOps)
    ops.dst_ctx = OURS
    assert ops.context_of(1) == OURS and ops.context_of(2) == OURS  # where the fence event must be made
    ops.record("fence", 1)
    ops.record("fence", 0x7F00)
    assert recorded == [("fence", 1, OURS), ("fence", 0x7F00, OTHER)] and ctx.now == OTHER


def test_a_send_with_another_gpu_current_queues_its_copy_in_the_links_gpu_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer thread whose user switched GPUs after its first send: the driver queues a copy only on a
    stream of the current context (CUDA_ERROR_INVALID_VALUE on two H200s), and reads torch's default stream (1)
    as the current GPU's. The copy and the ready event go in the link GPU's context; the caller's comes back."""
    from cudalink import _backends
    from cudalink.cuda import driver

    ctx = _Contexts(monkeypatch, OTHER)
    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(driver, "memcpy_dtod", lambda dst, src, n, s: calls.append(("copy", s, ctx.now)))
    monkeypatch.setattr(driver, "record", lambda ev, s: calls.append(("record", s, ctx.now)))
    monkeypatch.setattr(driver, "event_done", lambda ev: True)  # the slot's last copy has run
    slots = object.__new__(_backends.CudaSlots)
    slots.ctx, slots.graph_error, slots._last = OURS, "", -1
    slots._sources, slots._ptrs, slots._ready_raw = [None], [0x100], ["ready-0"]
    spec = FrameSpec((4, 4), "uint8")
    slots.copy_in(0, spec, object(), None, [], (0x200, 1))  # torch's default stream, read in one pass
    assert calls == [("copy", 1, OURS), ("record", 1, OURS)] and ctx.now == OTHER
    calls.clear()
    ctx.now = OURS  # the usual case: no switch
    slots.copy_in(0, spec, object(), None, [], (0x200, 0x7F00))
    assert calls == [("copy", 0x7F00, OURS), ("record", 0x7F00, OURS)]


def test_a_producer_gives_its_gpu_only_to_a_thread_with_none_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first send() on a thread used to make the link's GPU current for good, moving the user's current GPU
    (torch's next tensor then landed on it). Now only a thread with no context gets ours."""
    import threading

    from cudalink import _backends
    from cudalink.cuda import devices

    made: list[str] = []

    class Dev:
        def set_current(self) -> None:
            made.append("ours")

    for current, want in ((True, []), (False, ["ours"])):
        made.clear()
        monkeypatch.setattr(devices, "has_current", lambda current=current: current)
        slots = object.__new__(_backends.CudaSlots)
        slots.dev, slots._tls = Dev(), threading.local()
        slots._current()
        slots._current()  # once per thread
        assert made == want
