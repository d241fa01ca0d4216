"""Reading any array (numpy, torch, cupy, jax, DLPack, CUDA array interface) as a pointer and a layout,
with no copy, and building the typed views CUDA frames export."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from .. import _native
from ..errors import FormatError
from . import devices, driver

T = TypeVar("T")

if TYPE_CHECKING:  # the CUDA glue imports nothing of cudalink's above errors and _native (no import cycle)
    from .._native.dlpack import Exporter
    from ..frames.spec import FrameSpec
    from .objects import StridedView


class ArrayInfo(NamedTuple):
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]
    strides: tuple[int, ...] | None  # bytes; None = C-contiguous
    device_id: int  # -1 = host
    readonly: bool
    owner: object


def describe_array(obj: object, stream_ptr: int = -1) -> ArrayInfo:
    """Pointer, layout and device of any numpy / DLPack / CUDA-array-interface object, with no copy.

    ``stream_ptr`` is handed to the exporter (DLPack ``stream=``), so its pending work is ordered before
    ours on that stream; -1 means no ordering.
    """
    cls = type(obj)
    own = getattr(cls, "_cudalink_array_info", None)
    if own is not None:  # our own frames describe themselves (no CAI side effects, their own sync), so this
        described: ArrayInfo = own(obj, stream_ptr)  # module never imports cudalink.frames.frame: no cycle
        return described
    if stream_ptr == -1 and cls.__module__ == "torch" and getattr(obj, "is_cuda", False):
        info = _torch_info(cast(TorchTensor, obj))
        if info is not None:
            return info
    from_any = driver.any_interface() if cls.__module__ == "torch" and getattr(obj, "is_cuda", False) else None
    if from_any is not None:
        # cuda.core reads a torch tensor through its C ABI (no Python property) and orders ``stream_ptr``
        # after torch's current stream, as DLPack would: torch's own CAI is v2 and carries no stream,
        # and its DLPack export costs ~18 us of Python.
        try:
            return _device_info(obj, from_any(obj, stream_ptr=stream_ptr))
        except Exception as exc:
            raise FormatError(f"cudalink: cannot read {cls.__name__} through cuda.core: {exc}") from exc
    has_cai = hasattr(cls, "__cuda_array_interface__")  # on the type: never evaluate a property here
    if cls is np.ndarray:
        return host_info(_pixels(cast("npt.NDArray[np.generic]", obj), cls))
    if not has_cai and hasattr(cls, "__array_interface__"):
        return host_info(_pixels(_host_read(lambda: np.asarray(obj), cls.__name__, "the array interface"), cls))
    dl_dev = getattr(obj, "__dlpack_device__", None)
    if dl_dev is not None:
        if int(_host_read(dl_dev, cls.__name__, "DLPack")[0]) in (1, 3):  # CPU or pinned host memory (torch CPU)
            return host_info(_host_read(lambda: _host_dlpack(obj), cls.__name__, "DLPack"))
    elif not has_cai:
        try:
            arr = np.asarray(obj)
        except Exception as exc:
            raise FormatError(f"cudalink: cannot read {cls.__name__} as an array: {exc}") from exc
        return host_info(_pixels(arr, cls))
    smv = driver.view_class()
    try:
        if has_cai:
            # CAI v3 carries the producer's stream; cuda.core orders ``stream_ptr`` after it. It is also
            # ~10x cheaper than a DLPack exchange through torch (1.8 vs 18 us on the H100).
            view = smv.from_cuda_array_interface(obj, stream_ptr=stream_ptr)
        else:
            view = smv.from_dlpack(obj, stream_ptr=stream_ptr)
    except Exception as exc:
        raise FormatError(f"cudalink: cannot read {type(obj).__name__} through DLPack/CAI: {exc}") from exc
    return _device_info(obj, view)


def bfloat16() -> np.dtype[np.generic] | None:
    """numpy's bfloat16 (ml_dtypes', as cuda.core and jax read it), or None where ml_dtypes is missing."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    dt: np.dtype[np.generic] = np.dtype(ml_dtypes.bfloat16)
    return dt


def _host_dlpack(obj: object) -> npt.NDArray[np.generic]:
    """A host array's numpy view through DLPack; numpy takes no bfloat16 there (DLPack's code 4: a RuntimeError,
    "Unsupported dtype in DLTensor"), so a torch bfloat16 tensor is read as its int16 bits and viewed back as
    ml_dtypes' bfloat16, still with no copy."""
    if type(obj).__module__ == "torch" and str(getattr(obj, "dtype", "")) == "torch.bfloat16":
        bf16 = bfloat16()
        if bf16 is not None:
            bits = getattr(obj, "view")(sys.modules["torch"].int16)  # noqa: B009
            return np.from_dlpack(bits).view(bf16)
    return np.from_dlpack(obj)  # type: ignore[arg-type]


def _host_read(read: Callable[[], T], name: str, how: str) -> T:
    """``read()``: a host array's own export failing (a torch tensor that requires grad, a dtype DLPack has no
    code for) is a FormatError naming the array, as a GPU array's is."""
    try:
        return read()
    except Exception as exc:
        raise FormatError(
            f"cudalink: cannot read {name} through {how}: {str(exc).rstrip('.')}; pass a plain array of numbers "
            "(torch: x.detach(), and x.float() for a dtype cudalink does not carry, as float8; "
            "numpy: np.ascontiguousarray(x))"
        ) from exc


def _pixels(arr: npt.NDArray[np.generic], cls: type) -> npt.NDArray[np.generic]:
    """``arr``, unless it holds no pixels: None, bytes, a str or another object (which numpy wraps in an array
    of objects, strings or void), or an array of those; "call reconfigure" could never fix them."""
    dt = arr.dtype
    if dt.isbuiltin != 2 and dt.kind not in "OSUVT":  # numbers (T: numpy's StringDType): no message built per send
        return arr
    if dt.isbuiltin == 2 and dt.name == "bfloat16":  # ml_dtypes' bfloat16: numpy says "V", DLPack has a code
        return arr
    what = cls.__name__ if cls is not np.ndarray else f"a numpy array of {dt.name}"
    if dt.isbuiltin == 2:  # numbers of a dtype a package adds (ml_dtypes' float8_*, int4): numpy says "V"
        raise FormatError(
            f"cudalink: {what} has a dtype cudalink does not carry (numpy, torch, cupy and jax do not all read it); "
            f"convert it first, e.g. x.astype(np.float32), or send its bits: x.view(np.uint{8 * arr.itemsize})"
        )
    raise FormatError(
        f"cudalink: {what} is not an array of pixels; pass a numpy, torch, cupy or jax array of numbers, or "
        "any object with DLPack or the CUDA array interface (raw bytes: np.frombuffer(data, np.uint8).reshape(...))"
    )


class TorchTensor(Protocol):
    """The C methods of a torch CUDA tensor that :func:`_torch_info` reads (no Python properties)."""

    @property
    def dtype(self) -> object: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def is_contiguous(self) -> bool: ...

    def data_ptr(self) -> int: ...

    def get_device(self) -> int: ...


_torch_dtypes: dict[object, np.dtype[np.generic] | None] = {}
_UNSET = np.dtype("V1")  # a sentinel no torch dtype maps to


def _numpy_dtype(torch_dtype: object) -> np.dtype[np.generic] | None:
    """numpy's dtype of a torch dtype's name (bfloat16: ml_dtypes'), or None where numpy has none (fp8); learnt
    once."""
    dtype: np.dtype[np.generic] | None = _torch_dtypes.get(torch_dtype, _UNSET)
    if dtype is _UNSET:
        name = str(torch_dtype).removeprefix("torch.")
        try:
            dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
        except TypeError:
            dtype = None
        _torch_dtypes[torch_dtype] = dtype
    return dtype


def _torch_info(t: TorchTensor) -> ArrayInfo | None:
    """A contiguous torch CUDA tensor described through its own C methods: no view object, no properties.

    Only for callers that need no stream ordering (``stream_ptr=-1``); anything unusual (a dtype numpy
    lacks, non-contiguous memory) returns None and takes the general path.
    """
    dtype = _numpy_dtype(t.dtype)
    if dtype is None or not t.is_contiguous():
        return None
    return ArrayInfo(t.data_ptr(), tuple(t.shape), dtype, None, t.get_device(), False, t)


_KDLCPU = 1
_KDLCUDA = 2
_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # numpy kind -> DLPack type code
_DL_BFLOAT = 4  # kDLBfloat: ml_dtypes' bfloat16 is numpy kind "V"
_dl_dtypes: dict[np.dtype[np.generic], tuple[int, int]] = {}


def _dl_dtype(dtype: np.dtype[np.generic]) -> tuple[int, int]:
    """DLPack's (code, bits) of a numpy dtype; (-1, 0), which nothing matches, where DLPack has none."""
    got = _dl_dtypes.get(dtype)
    if got is None:
        code = _DL_BFLOAT if dtype.name == "bfloat16" else _DL_CODES.get(dtype.kind, -1)
        got = _dl_dtypes[dtype] = (code, dtype.itemsize * 8) if code >= 0 else (-1, 0)
    return got


def dlpack_exporter(ptr: int, spec: FrameSpec, device_id: int) -> Exporter | None:
    """The compiled capsule maker for memory at ``ptr`` viewed as ``spec`` (host for ``device_id`` < 0),
    made once per slot and spec; None without the compiled core or for a dtype DLPack cannot name."""
    mod = _native.dlpack
    code, bits = _dl_dtype(spec.dtype)
    if mod is None or code < 0:
        return None
    strides = tuple(s // spec.itemsize for s in spec.byte_strides)
    where = (_KDLCUDA, device_id) if device_id >= 0 else (_KDLCPU, 0)
    exporter: Exporter = mod.Exporter(ptr, *where, spec.shape, strides, code, bits)
    return exporter


class SourceWant(NamedTuple):
    """What a send's source must be for the one-pass read, built once per frame spec and device."""

    shape: tuple[int, ...]
    dl_code: int
    dl_bits: int
    dl_device_type: int
    device_id: int
    dtype: np.dtype[np.generic]


def source_want(spec: FrameSpec, device_id: int) -> SourceWant:
    return SourceWant(spec.shape, *_dl_dtype(spec.dtype), _KDLCUDA, device_id, spec.dtype)


def fast_source(obj: object, want: SourceWant) -> tuple[int, int] | None:
    """``(pointer, stream)`` of a compact CUDA array of exactly ``want``, read in one pass.

    The stream is the one the array's framework queues work on now (1: the legacy default stream): a
    copy queued there runs after the array's producer with nothing to order. Through DLPack's C exchange
    API where the array's type publishes one (torch 2.10+, with the compiled core), else through torch's
    own C methods. Anything else returns None: the general path reads it, orders it and words errors.
    """
    ex = _native.exchange
    if ex is not None:
        got: tuple[int, int] | None = ex.source(obj, want)
        if got is not None:
            return got if got[1] else (got[0], 1)
    if type(obj).__module__ != "torch":
        return None
    t = cast(TorchTensor, obj)
    dev = want[4]
    try:  # each call parses its arguments in C++: the fewest that decide it
        if t.get_device() != dev or not t.is_contiguous() or _numpy_dtype(t.dtype) != want[5]:
            return None
        if tuple(t.shape) != want[0]:
            return None
        raw = int(sys.modules["torch"]._C._cuda_getCurrentRawStream(dev))
        return (t.data_ptr(), raw or 1)
    except Exception:
        return None


def current_stream_of(obj: object) -> int | None:
    """The raw stream a framework queues an array's work on, where asking is cheap; else None.

    For a torch CUDA tensor that is torch's current stream on the tensor's device (one C call). A copy
    queued there is ordered after the tensor's producer with no event and no cross-stream wait, which
    is what DLPack's stream handshake would otherwise cost.
    """
    cls = type(obj)
    if cls.__module__ != "torch" or not getattr(obj, "is_cuda", False):
        return None
    try:
        raw = int(sys.modules["torch"]._C._cuda_getCurrentRawStream(getattr(obj, "get_device")()))  # noqa: B009
    except Exception:
        return None
    return raw or 1  # torch's default stream is the legacy NULL stream


def _device_info(obj: object, view: StridedView) -> ArrayInfo:
    dtype = view.dtype if isinstance(view.dtype, np.dtype) else np.dtype(view.dtype)
    shape = tuple(view.shape)
    strides = view.strides
    if strides is not None:
        isz = dtype.itemsize
        strides = tuple(int(s) * isz for s in strides)
        if _is_c_contiguous(shape, strides, isz):
            strides = None  # CAI views report explicit strides even when contiguous; DLPack ones do not
    if not view.is_device_accessible:
        raise FormatError("cudalink: array is neither host nor device memory")
    return ArrayInfo(int(view.ptr), shape, dtype, strides, int(view.device_id), bool(view.readonly), (obj, view))


def _is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    acc = itemsize
    for d, st in zip(reversed(shape), reversed(strides), strict=True):
        if d > 1 and st != acc:
            return False
        acc *= d
    return True


def host_info(arr: npt.NDArray[np.generic]) -> ArrayInfo:
    strides = None if arr.flags.c_contiguous else tuple(arr.strides)
    return ArrayInfo(int(arr.ctypes.data), tuple(arr.shape), arr.dtype, strides, -1, not arr.flags.writeable, arr)


def typed_view(ptr: int, spec: FrameSpec, device_id: int, owner: object, readonly: bool) -> StridedView:
    """A cuda.core StridedMemoryView over device memory: the object that speaks DLPack for CUDA frames."""
    buf = driver.core().Buffer.from_handle(ptr, spec.nbytes, owner=owner)
    strides = None if spec.strides is None else tuple(s // spec.itemsize for s in spec.strides)
    return driver.view_class().from_buffer(buf, spec.shape, strides, dtype=spec.dtype, is_readonly=readonly)


def copy_to_host(ptr: int, spec: FrameSpec, device_id: int, stream: int | None) -> npt.NDArray[np.generic]:
    """Blocking device-to-host copy (for ``Frame.to_numpy``, tests and demos; not a hot path)."""
    drv = driver.bindings()
    out = np.empty(spec.nbytes, np.uint8)
    with devices.keep_current():  # the caller's current device stays theirs
        devices.device(device_id)
        if stream is not None:
            driver.check(drv.cuStreamSynchronize(drv.CUstream(stream)), "cuStreamSynchronize")
        driver.check(drv.cuMemcpyDtoH(out.ctypes.data, ptr, spec.nbytes), "cuMemcpyDtoH")
    view: npt.NDArray[np.generic] = np.lib.stride_tricks.as_strided(out.view(spec.dtype), spec.shape, spec.byte_strides)
    copied: npt.NDArray[np.generic] = view.copy()
    return copied
