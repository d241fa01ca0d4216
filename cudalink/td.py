"""TouchDesigner bridge: ``TOP.cudaMemory()`` out through a link, received frames into a Script TOP.

Import it inside TouchDesigner (Python 3.11, 2023.10000+) once cudalink is installed into TD's Python;
``td/`` in the repository holds the callbacks DATs that use it. Nothing here imports TD's ``td``
module at import time, so the module also loads (and is tested) outside TouchDesigner with fakes.

What TD documents, and what this module does about it:

* ``TOP.cudaMemory(stream=)`` returns a ``CUDAMemory`` whose memory is freed when that object dies. A
  frame made by :func:`frame_from_cuda_memory` owns the ``CUDAMemory`` object (not just ``.ptr``), so
  the memory lives as long as the frame or any DLPack/CAI view of it.
* ``CUDAMemoryShape.dataType`` is a numpy *scalar type* (``numpy.float32``), never a ``numpy.dtype``;
  TD takes uint8, uint16 and float32, and refuses float16. 8-bit RGBA textures are BGRA in memory
  and rows run bottom-up, which the frame's pixel format and row origin record.
* ``scriptTOP.copyCUDAMemory`` does not say when it has finished reading, so :class:`ScriptTopSink`
  keeps the source of each copy alive until the next one.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

import numpy as np

from . import _cuda
from .errors import FormatError, LinkError, LinkTimeout, ProducerGone
from .frames.frame import Frame
from .frames.spec import FrameSpec, PixelFormat, RowOrigin
from .link import Receiver, Sender
from .transport import wire
from .transport.base import Transport

__all__ = [
    "TD_DTYPES",
    "CUDAMemoryLike",
    "CUDAMemoryShapeLike",
    "ScriptTopReceiver",
    "ScriptTopSink",
    "TDSender",
    "TopUpload",
    "frame_from_cuda_memory",
    "pixel_format_for",
    "spec_from_cuda_memory",
    "td_dtype",
    "td_format_name",
    "to_script_top",
]

#: The numpy scalar types TouchDesigner's CUDA calls accept (8-bit fixed, 16-bit fixed, 32-bit float).
TD_DTYPES: tuple[type[np.generic], ...] = (np.uint8, np.uint16, np.float32)

#: Element types we convert to float32 before TD sees them (TD refuses float16; float64 is no texture).
_TO_FLOAT32 = ("float16", "float64")

Switch = bool | str  # True/False, or "auto"/"on"/"off" (TD menus give strings)
Method = Literal["auto", "cuda", "numpy"]
ShapeFactory = Callable[[], Any]


class CUDAMemoryShapeLike(Protocol):
    """TD's ``CUDAMemoryShape`` (TD 2025 adds ``depth``, ``isCube`` and ``is3D``)."""

    width: int
    height: int
    numComps: int
    dataType: Any


class CUDAMemoryLike(Protocol):
    """TD's ``CUDAMemory``: read-only, no methods; its memory is freed when the object is destroyed."""

    @property
    def ptr(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def shape(self) -> Any: ...


# =============================================================================================== formats


def td_dtype(data_type: object, *, what: str = "CUDAMemoryShape.dataType") -> np.dtype[Any]:
    """The numpy dtype of a TD ``dataType``; refuses what TD refuses, with the fix in the message."""
    if isinstance(data_type, np.dtype):
        raise FormatError(
            f"cudalink: {what} is the numpy.dtype instance {data_type!r}, but TouchDesigner uses "
            f"numpy scalar types: use numpy.{data_type.name} (that is, dtype.type), "
            f"not numpy.dtype('{data_type.name}')"
        )
    if not (isinstance(data_type, type) and issubclass(data_type, np.generic)):
        raise FormatError(
            f"cudalink: {what} must be a numpy scalar type (numpy.uint8, numpy.uint16 or numpy.float32), "
            f"got {data_type!r}"
        )
    if data_type is np.float16:
        raise FormatError(
            f"cudalink: {what} is numpy.float16, which TouchDesigner refuses for CUDA memory; set the "
            "TOP's Pixel Format to 32-bit float (Common page, e.g. on a Null TOP before the export), or "
            "8/16-bit fixed"
        )
    if data_type not in TD_DTYPES:
        raise FormatError(
            f"cudalink: {what} numpy.{data_type.__name__} is not a TouchDesigner texture type; "
            "use numpy.uint8, numpy.uint16 or numpy.float32 (8-bit fixed, 16-bit fixed, 32-bit float)"
        )
    return np.dtype(data_type)


def pixel_format_for(dtype: Any, comps: int) -> PixelFormat:
    """TD's channel order: BGRA for 8-bit 4-channel textures, RGBA (or fewer channels) otherwise."""
    if comps == 4:
        return PixelFormat.BGRA if np.dtype(dtype) == np.uint8 else PixelFormat.RGBA
    return {1: PixelFormat.GRAY, 2: PixelFormat.RG, 3: PixelFormat.RGB}[comps]


def td_format_name(dtype: Any, comps: int) -> str | None:
    """The Script TOP ``format`` menu entry (``rgba8fixed``, ``r32float``...); None where TD has none."""
    depth = {"uint8": "8fixed", "uint16": "16fixed", "float32": "32float"}.get(np.dtype(dtype).name)
    channels = {1: "r", 2: "rg", 4: "rgba"}.get(comps)
    return None if depth is None or channels is None else channels + depth


def _int_field(obj: Any, name: str, owner: str) -> int:
    value = getattr(obj, name, None)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise FormatError(f"cudalink: {owner}.{name} must be an int, got {value!r}")
    return int(value)


def spec_from_cuda_memory(mem: CUDAMemoryLike) -> FrameSpec:
    """The frame description of a ``CUDAMemory``: (height, width, numComps), TD's channel order, bottom-up."""
    shape = getattr(mem, "shape", None)
    if shape is None:
        raise FormatError(f"cudalink: {type(mem).__name__} has no .shape; pass TOP.cudaMemory()'s result")
    width = _int_field(shape, "width", "CUDAMemoryShape")
    height = _int_field(shape, "height", "CUDAMemoryShape")
    comps = _int_field(shape, "numComps", "CUDAMemoryShape")
    depth = getattr(shape, "depth", 1)
    if getattr(shape, "is3D", False) or getattr(shape, "isCube", False) or depth not in (None, 0, 1):
        raise FormatError(
            "cudalink: 3D, cube and 2D-array textures are not supported; export one 2D slice "
            "(e.g. a Null TOP after a Texture 3D TOP's output slice)"
        )
    if width < 1 or height < 1:
        raise FormatError(f"cudalink: TOP is {width}x{height}; nothing to export")
    if not 1 <= comps <= 4:
        raise FormatError(f"cudalink: CUDAMemoryShape.numComps must be 1 to 4, got {comps}")
    dtype = td_dtype(getattr(shape, "dataType", None))
    return FrameSpec((height, width, comps), dtype, None, pixel_format_for(dtype, comps), RowOrigin.BOTTOM)


# =============================================================================================== TD -> link


class _StreamReady:
    """TD fills ``CUDAMemory`` in order on the stream given to ``cudaMemory``: consumers wait on it."""

    __slots__ = ("stream",)

    def __init__(self, stream: int) -> None:
        self.stream = stream

    def wait(self, stream: int) -> None:
        if stream != self.stream:
            _cuda.join_streams(stream, [self.stream])

    def cai_stream(self) -> int | None:
        return self.stream


def frame_from_cuda_memory(
    mem: CUDAMemoryLike,
    *,
    stream: Any = None,
    seq: int = 0,
    device: int | str = 0,
    timestamp_ns: int | None = None,
) -> Frame:
    """Wrap TD's ``CUDAMemory`` as a :class:`~cudalink.Frame` without a copy.

    The frame owns ``mem``: TD frees the memory when the ``CUDAMemory`` object dies, so holding only
    ``mem.ptr`` would be a use-after-free. ``stream`` is the one given to ``TOP.cudaMemory(stream=)``
    (None: TD's default stream); consumers are ordered after it. ``device="cpu"`` is for host fakes.
    """
    spec = spec_from_cuda_memory(mem)
    ptr = getattr(mem, "ptr", None)
    size = getattr(mem, "size", None)
    if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)) or not ptr:
        raise FormatError(f"cudalink: CUDAMemory.ptr must be a non-null int address, got {ptr!r}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < spec.nbytes:
        raise FormatError(
            f"cudalink: CUDAMemory.size is {size!r} bytes but {spec.shape} {spec.dtype.name} needs {spec.nbytes}"
        )
    ts = time.time_ns() if timestamp_ns is None else timestamp_ns
    if device == "cpu":
        return Frame(spec, int(ptr), mem, device="cpu", seq=seq, timestamp_ns=ts)
    ordinal = _cuda.parse_device(device)
    ready = _StreamReady(1 if stream is None else _cuda.stream_handle(stream))
    return Frame(spec, int(ptr), mem, device=ordinal, seq=seq, timestamp_ns=ts, sync=ready)


class TDSender:
    """Exports a TOP each frame through a :class:`~cudalink.Sender`, never blocking TD's CPU.

    ``send_top`` asks TD for ``cudaMemory()`` on this object's own non-default stream, then queues one
    D2D copy into the link's IPC ring on that same stream; the ring keeps the ``CUDAMemory`` alive until
    the copy has run. The link is created on the first frame and follows size/format changes
    (consumers re-attach by themselves when it has to be re-created). Call it from an Execute DAT's
    ``onFrameEnd``: ``cudaMemory()`` inside a cook stalls TD.
    """

    def __init__(
        self,
        name: str,
        *,
        device: int | str = 0,
        slots: int = 3,
        capacity: int | None = None,
        policy: Literal["drop", "block"] = "drop",
        max_consumers: int = 16,
        handles: str = "auto",
        transport: Transport | None = None,
    ) -> None:
        self.name = name
        self.device: int | str = "cpu" if device == "cpu" else _cuda.parse_device(device)
        self.slots = slots
        self.capacity = capacity
        self.policy: Literal["drop", "block"] = policy
        self.max_consumers = max_consumers
        self.handles = handles
        self.transport = transport
        self.sent = 0
        self.dropped = 0
        self._sender: Sender | None = None
        self._stream: Any = None
        self._stream_int: int | None = None
        self._closed = False

    @property
    def stream(self) -> int | None:
        """Raw stream handle to pass to ``TOP.cudaMemory(stream=...)`` (None on host links)."""
        if self.device == "cpu":
            return None
        if self._stream_int is None:
            assert isinstance(self.device, int)
            self._stream = _cuda.device(self.device).create_stream()
            self._stream_int = _cuda.stream_handle(self._stream)
        return self._stream_int

    @property
    def sender(self) -> Sender | None:
        """The underlying link, once the first frame has created it."""
        return self._sender

    def send_top(self, top: Any, *, meta: bytes = b"") -> int | None:
        """``top.cudaMemory()`` on our stream, then :meth:`send`; returns the seq, or None if dropped."""
        stream = self.stream
        mem = top.cudaMemory() if stream is None else top.cudaMemory(stream=stream)
        return self.send(mem, meta=meta)

    def send(self, mem: CUDAMemoryLike, *, meta: bytes = b"") -> int | None:
        """Publish one ``CUDAMemory`` (filled on :attr:`stream`); returns the seq, or None if dropped."""
        if self._closed:
            raise LinkError(f"cudalink: TDSender {self.name!r} is closed; create a new one")
        stream = self.stream
        frame = frame_from_cuda_memory(mem, stream=stream, device=self.device)
        sender = self._sender_for(frame.spec)
        seq = sender.send(frame, stream=stream, meta=meta)
        if seq is None:
            self.dropped += 1
        else:
            self.sent += 1
        return seq

    def _sender_for(self, spec: FrameSpec) -> Sender:
        current = self._sender
        if current is not None:
            if current.spec == spec:
                return current
            try:
                current.reconfigure(spec.shape, spec.dtype, pixel_format=spec.pixel_format, origin=spec.origin)
                return current
            except FormatError:  # larger than the slots: a new link, which consumers re-attach to
                self._sender = None
                current.close()
        self._sender = Sender(
            self.name,
            shape=spec.shape,
            dtype=spec.dtype,
            slots=self.slots,
            device=self.device,
            pixel_format=spec.pixel_format,
            origin=spec.origin,
            capacity=max(self.capacity or 0, spec.nbytes),
            policy=self.policy,
            max_consumers=self.max_consumers,
            handles=self.handles,
            transport=self.transport,
        )
        return self._sender

    def close(self) -> None:
        """Close the link (consumers get ProducerGone); the stream goes with this object."""
        self._closed = True
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def __enter__(self) -> TDSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<cudalink.td.TDSender {self.name!r} {self.device} sent={self.sent} dropped={self.dropped}>"


# =============================================================================================== link -> TD


def _switch(value: Switch | None, name: str) -> bool | None:
    """True/False, or None for "auto" (TD menus give strings, toggles bools or 0/1)."""
    if value is None:
        return False
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0", ""):
        return False
    raise FormatError(f"cudalink: {name} must be True, False or 'auto', got {value!r}")


def _td_default_shape() -> Any:
    td: Any = None
    try:
        import td  # TouchDesigner's own module; only exists inside TD
    except ImportError:
        pass
    factory = getattr(td, "CUDAMemoryShape", None)
    if factory is None:
        raise LinkError(
            "cudalink: td.CUDAMemoryShape is not available (not running inside TouchDesigner); "
            "pass shape_factory= (e.g. a fake) to use the Script TOP helpers elsewhere"
        )
    return factory()


class _Plan:
    """What a frame needs before TD can take it: its TD shape and the GPU/CPU steps to get there."""

    __slots__ = ("comps", "dtype", "flip", "height", "swap", "width")

    def __init__(self, frame: Frame, flip: Switch, swap_rb: Switch, method: str) -> None:
        shape = frame.shape
        if frame.ndim == 2:
            self.height, self.width, self.comps = shape[0], shape[1], 1
        elif frame.ndim == 3 and 1 <= shape[2] <= 4:
            self.height, self.width, self.comps = shape
        else:
            raise FormatError(
                f"cudalink: a Script TOP takes (height, width) or (height, width, 1..4) frames, got {shape}"
            )
        name = frame.dtype.name
        if name in _TO_FLOAT32:
            self.dtype: np.dtype[Any] = np.dtype(np.float32)
        elif name in ("uint8", "uint16", "float32"):
            self.dtype = frame.dtype
        else:
            raise FormatError(
                f"cudalink: TouchDesigner textures are uint8, uint16 or float32 (float16/float64 are "
                f"converted to float32); a {name} frame needs converting by its producer"
            )
        want_bgr = self.comps == 4 and self.dtype == np.uint8 and method == "cuda"
        do_flip = _switch(flip, "flip")
        self.flip = frame.origin is RowOrigin.TOP if do_flip is None else do_flip
        do_swap = _switch(swap_rb, "swap_rb")
        if do_swap is None:
            pf = frame.pixel_format
            has_rb = pf is not None and pf.channels >= 3
            do_swap = has_rb and (pf in (PixelFormat.BGR, PixelFormat.BGRA)) != want_bgr
        if do_swap and self.comps < 3:
            raise FormatError(f"cudalink: swap_rb needs 3 or 4 channels; this frame has {self.comps}")
        self.swap = do_swap

    def steps(self, frame: Frame) -> list[str]:
        out = []
        if self.flip:
            out.append("row flip")
        if self.swap:
            out.append("red/blue swap")
        if self.dtype != frame.dtype:
            out.append(f"{frame.dtype.name}->float32")
        if not frame.spec.is_contiguous:
            out.append("contiguous copy")
        return out

    @property
    def swap_index(self) -> list[int]:
        return [2, 1, 0, 3] if self.comps == 4 else [2, 1, 0]


def _apply_plan(xp: Any, arr: Any, plan: _Plan) -> Any:
    """The plan's steps with a numpy-like module: numpy on the host, cupy on the GPU (torch differs)."""
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if plan.flip:
        arr = arr[::-1]
    if plan.swap:
        arr = arr[..., plan.swap_index]
    if arr.dtype != plan.dtype:
        arr = arr.astype(plan.dtype)
    return xp.ascontiguousarray(arr)


def _convert_host(arr: np.ndarray[Any, Any], plan: _Plan) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = _apply_plan(np, arr, plan)
    return out


_BACKENDS = ("cupy", "torch")
_backend_cache: dict[str, Any] = {}


def _array_module(preferred: str | None) -> tuple[str, Any]:
    """cupy or torch, whichever imports (TD users usually have one); None of them is a clear error."""
    names = (preferred,) if preferred else _BACKENDS
    for name in names:
        if name not in _BACKENDS:
            raise LinkError(f"cudalink: array_backend must be 'cupy' or 'torch', got {name!r}")
        if name not in _backend_cache:
            try:
                _backend_cache[name] = importlib.import_module(name)
            except Exception:  # not installed, or built for another CUDA: treat as absent
                _backend_cache[name] = None
        mod = _backend_cache[name]
        if mod is not None:
            return name, mod
    raise LinkError("cudalink: no GPU array library; " + ("/".join(names)) + " could not be imported")


def _convert_cuda(frame: Frame, plan: _Plan, stream: int, backend: str | None) -> tuple[Any, int, int]:
    """Run the plan's steps on ``stream`` with cupy or torch; returns (array to keep, ptr, nbytes)."""
    try:
        name, mod = _array_module(backend)
    except LinkError as exc:
        raise FormatError(
            f"{exc}. This {frame.spec.label} frame needs {', '.join(plan.steps(frame))} before "
            "TouchDesigner can take it, which runs on the GPU: install cupy or torch into TD's Python "
            "(td/README.md), or pass method='numpy' for a slow host round trip, or have the producer "
            "send what TD takes as-is "
            "(uint8/uint16/float32, origin='bottom', BGRA for 8-bit RGBA)"
        ) from exc
    dev = frame._device_id
    _cuda.device(dev)
    if name == "cupy":
        cp = mod
        with cp.cuda.Device(dev), cp.cuda.ExternalStream(stream):
            out = _apply_plan(cp, cp.from_dlpack(frame), plan)
        return out, int(out.data.ptr), int(out.nbytes)
    torch = mod
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=f"cuda:{dev}")):
        t = torch.from_dlpack(frame)
        if t.dim() == 2:
            t = t.unsqueeze(-1)
        if t.dtype == torch.uint16:  # few torch kernels take uint16; flips and gathers only move bits
            t = t.view(torch.int16)
        if plan.flip:
            t = t.flip(0)
        if plan.swap:
            t = t[..., plan.swap_index]
        if plan.dtype == np.float32 and t.dtype != torch.float32:
            t = t.to(torch.float32)
        out = t.contiguous()
    return out, int(out.data_ptr()), int(out.numel() * out.element_size())


class _DeviceBuffer:
    """Plain cuMemAlloc memory for snapshots: no cupy/torch needed to keep an image past its link."""

    def __init__(self, nbytes: int, device: int) -> None:
        _cuda.device(device)
        self.ptr = int(_cuda.check(_cuda._drv().cuMemAlloc(nbytes), "cuMemAlloc"))

    def __del__(self) -> None:
        try:
            _cuda._drv().cuMemFree(self.ptr)
        except Exception:
            pass


def _sync(stream: int) -> None:
    drv = _cuda._drv()
    _cuda.check(drv.cuStreamSynchronize(drv.CUstream(stream)), "cuStreamSynchronize")


class TopUpload:
    """One copy into a Script TOP: what it reads, and the objects that keep that memory alive.

    TD's docs do not say when ``copyCUDAMemory`` has finished reading, so keep this object until the
    next upload (:class:`ScriptTopSink` does). ``zero_copy`` means TD reads the frame's own memory.
    """

    __slots__ = (
        "comps",
        "device",
        "dtype",
        "height",
        "keep",
        "method",
        "nbytes",
        "ptr",
        "seq",
        "shape_factory",
        "steps",
        "stream",
        "submits",
        "width",
        "zero_copy",
    )

    def __init__(
        self,
        *,
        method: str,
        ptr: int,
        nbytes: int,
        plan: _Plan,
        stream: int | None,
        keep: Any,
        zero_copy: bool,
        steps: list[str],
        shape_factory: ShapeFactory | None,
        device: int,
        seq: int,
    ) -> None:
        self.method = method
        self.ptr = ptr
        self.nbytes = nbytes
        self.width, self.height, self.comps, self.dtype = plan.width, plan.height, plan.comps, plan.dtype
        self.stream = stream
        self.keep = keep
        self.zero_copy = zero_copy
        self.steps = steps
        self.shape_factory = shape_factory
        self.device = device
        self.seq = seq
        self.submits = 0

    def td_shape(self) -> Any:
        """A ``CUDAMemoryShape`` for this upload; ``dataType`` is the numpy scalar type TD insists on."""
        shape = (self.shape_factory or _td_default_shape)()
        shape.width = self.width
        shape.height = self.height
        shape.numComps = self.comps
        shape.dataType = self.dtype.type
        return shape

    def submit(self, script_op: Any) -> None:
        """Copy into ``script_op`` (again): TD first waits for work queued on our stream."""
        if self.keep is None:
            raise LinkError("cudalink: this upload was released; show a new frame")
        if self.method == "numpy":
            script_op.copyNumpyArray(self.keep[-1])
        elif self.stream is None:
            script_op.copyCUDAMemory(self.ptr, self.nbytes, self.td_shape())
        else:
            script_op.copyCUDAMemory(self.ptr, self.nbytes, self.td_shape(), stream=self.stream)
        self.submits += 1

    def detach(self) -> None:
        """Swap a zero-copy source for our own copy, so the producer's memory can go (it is leaving)."""
        if not self.zero_copy or self.keep is None:
            return
        if self.device < 0:
            arr = np.array(self.keep[-1], copy=True)
            self.keep = (arr,)
            self.ptr = int(arr.ctypes.data)
        else:
            stream = self.stream if self.stream is not None else 1
            buf = _DeviceBuffer(self.nbytes, self.device)
            _cuda.memcpy_dtod(buf.ptr, self.ptr, self.nbytes, stream)
            _sync(stream)  # the producer frees its slots once we let go: our copy must be done by then
            self.keep = (buf,)
            self.ptr = buf.ptr
        self.zero_copy = False

    def release(self) -> None:
        self.keep = None

    def __repr__(self) -> str:
        how = "zero-copy" if self.zero_copy else (", ".join(self.steps) or "copy")
        size = f"{self.width}x{self.height}x{self.comps} {self.dtype.name}"
        return f"<cudalink.td.TopUpload {size} {self.method} {how}>"


_default_streams: dict[int, Any] = {}


def _stream_in(cache: dict[int, Any], device: int) -> int:
    """Our own non-default stream on ``device``, made once per ``cache`` (module-wide, or a sink's)."""
    stream = cache.get(device)
    if stream is None:
        stream = cache[device] = _cuda.device(device).create_stream()
    return _cuda.stream_handle(stream)


def _default_stream(device: int) -> int:
    return _stream_in(_default_streams, device)


def _prepare(
    frame: Frame,
    script_op: Any,
    *,
    stream: Callable[[int], int],
    flip: Switch,
    swap_rb: Switch,
    shape_factory: ShapeFactory | None,
    array_backend: str | None,
    method: Method,
) -> TopUpload:
    if method == "auto":
        method = "cuda" if frame.is_cuda or not hasattr(script_op, "copyNumpyArray") else "numpy"
    if method not in ("cuda", "numpy"):
        raise LinkError(f"cudalink: method must be 'auto', 'cuda' or 'numpy', got {method!r}")
    plan = _Plan(frame, flip, swap_rb, method)
    steps = plan.steps(frame)

    def upload(ptr: int, nbytes: int, stream: int | None, keep: Any, zero: bool, device: int) -> TopUpload:
        return TopUpload(
            method=method,
            ptr=ptr,
            nbytes=nbytes,
            plan=plan,
            stream=stream,
            keep=keep,
            zero_copy=zero,
            steps=steps,
            shape_factory=shape_factory,
            device=device,
            seq=frame.seq,
        )

    if method == "numpy" or not frame.is_cuda:
        # copyNumpyArray, or host memory through copyCUDAMemory (fakes; UVA-aware builds)
        host = frame.to_numpy() if frame.is_cuda else frame.numpy()
        arr = _convert_host(host, plan)
        zero = not frame.is_cuda and not steps
        return upload(int(arr.ctypes.data), int(arr.nbytes), None, (frame, arr) if zero else (arr,), zero, -1)
    dev = frame._device_id
    s = stream(dev)
    if not steps:
        info = _cuda.describe_array(frame, stream_ptr=s)  # orders s after the frame's producer
        return upload(info.ptr, frame.nbytes, s, (frame, info.owner), True, dev)
    out, ptr, nbytes = _convert_cuda(frame, plan, s, array_backend)
    return upload(ptr, nbytes, s, (out,), False, dev)


def to_script_top(
    frame: Frame,
    script_op: Any,
    *,
    stream: Any = None,
    flip: Switch = False,
    swap_rb: Switch = False,
    shape_factory: ShapeFactory | None = None,
    array_backend: str | None = None,
    method: Method = "auto",
) -> TopUpload:
    """Copy ``frame`` into a Script TOP (call it in ``onCook``); keep the result until the next call.

    A frame TD takes as-is (uint8/uint16/float32, contiguous, no flip or swap asked) is passed by
    pointer: zero-copy. Otherwise the conversion (float16->float32, ``flip`` of rows, ``swap_rb``)
    runs on the GPU with cupy or torch (``array_backend`` picks), or with numpy for host frames.
    ``flip``/``swap_rb`` may be ``"auto"``: flip top-down frames, and swap when the frame's channel
    order is not TD's (BGRA for 8-bit RGBA through CUDA). ``method="auto"`` uses ``copyCUDAMemory``
    for CUDA frames and ``copyNumpyArray`` for host ones. ``shape_factory`` makes the
    ``CUDAMemoryShape`` (default ``td.CUDAMemoryShape``). ``stream`` None uses one per-device
    stream of ours, not TD's slow default stream.
    """

    def pick(dev: int) -> int:
        return _default_stream(dev) if stream is None else _cuda.stream_handle(stream)

    upload = _prepare(
        frame,
        script_op,
        stream=pick,
        flip=flip,
        swap_rb=swap_rb,
        shape_factory=shape_factory,
        array_backend=array_backend,
        method=method,
    )
    upload.submit(script_op)
    return upload


class ScriptTopSink:
    """Feeds one Script TOP and keeps the memory of the last copy alive until the next one.

    ``show`` uploads a new frame; ``resubmit`` copies the last one again (for cooks without a new
    frame); ``detach`` replaces a zero-copy source by our own copy so its link can be let go.
    """

    def __init__(
        self,
        *,
        stream: Any = None,
        shape_factory: ShapeFactory | None = None,
        array_backend: str | None = None,
        method: Method = "auto",
    ) -> None:
        self.shape_factory = shape_factory
        self.array_backend = array_backend
        self.method: Method = method
        self._user_stream = stream
        self._streams: dict[int, Any] = {}
        self._last: TopUpload | None = None

    @property
    def last(self) -> TopUpload | None:
        return self._last

    def stream_for(self, device: int) -> int:
        """The stream copies for ``device`` are ordered on: the one given, or our own non-default one."""
        if self._user_stream is not None:
            return _cuda.stream_handle(self._user_stream)
        return _stream_in(self._streams, device)

    def show(self, frame: Frame, script_op: Any, *, flip: Switch = False, swap_rb: Switch = False) -> TopUpload:
        """Upload ``frame``; the previous upload is let go only once this one has been handed to TD."""
        upload = _prepare(
            frame,
            script_op,
            stream=self.stream_for,
            flip=flip,
            swap_rb=swap_rb,
            shape_factory=self.shape_factory,
            array_backend=self.array_backend,
            method=self.method,
        )
        upload.submit(script_op)
        previous, self._last = self._last, upload
        if previous is not None:
            previous.release()
        return upload

    def resubmit(self, script_op: Any) -> bool:
        """Copy the last upload again; False when there is none."""
        if self._last is None:
            return False
        self._last.submit(script_op)
        return True

    def detach(self) -> None:
        if self._last is not None:
            try:
                self._last.detach()
            except Exception:
                self.release()  # no copy possible: let go rather than outlive the producer's memory
                raise

    def release(self) -> None:
        previous, self._last = self._last, None
        if previous is not None:
            previous.release()


def _producer_closing(rx: Receiver) -> bool:
    """The producer announced shutdown: frames we hold must go before it frees its slots."""
    att = rx._att
    if att is None:
        return False
    try:
        return bool(att.ring.flags() & wire.FLAG_SHUTDOWN)
    except Exception:
        return False


def _report(script_op: Any, level: str, message: str) -> bool:
    """Show ``message`` on the operator: addError/addWarning are TD's in-cook status, else a script error.

    Returns True when it became a script error (those stay until cleared).
    """
    for name in ("addError" if level == "error" else "addWarning", "addScriptError"):
        fn = getattr(script_op, name, None)
        if fn is None:
            continue
        try:
            fn(message)
            return name == "addScriptError"
        except Exception:  # addError/addWarning are refused outside a cook: fall back to a script error
            continue
    return False


def sync_top_format(script_op: Any, width: int, height: int, comps: int, dtype: Any) -> list[str]:
    """Best effort: set a Script TOP's resolution and pixel format to match the texture it gets.

    TD allocates the Script TOP's texture from those parameters. Only existing parameters that differ
    are touched; the return value lists what could not be set.
    """
    wanted: list[tuple[str, Any]] = [
        ("outputresolution", "custom"),
        ("resolutionw", width),
        ("resolutionh", height),
    ]
    fmt = td_format_name(dtype, comps)
    if fmt is not None:
        wanted.append(("format", fmt))
    failed = []
    pars = getattr(script_op, "par", None)
    for name, value in wanted:
        par = getattr(pars, name, None)
        if par is None:
            continue
        try:
            if par.eval() != value:
                par.val = value
        except Exception as exc:
            failed.append(f"{name}={value!r} ({exc})")
    return failed


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if text.startswith("cudalink") else f"cudalink: {type(exc).__name__}: {text}"


class ScriptTopReceiver:
    """All a Script TOP's ``onCook`` needs to show a link: never blocks, keeps the last frame, reports status.

    Each :meth:`cook` takes the newest frame if one arrived (``Receiver.poll``), else copies the last
    one again, so the TOP keeps its image while the producer pauses, restarts or is not there yet.
    Problems become warnings/errors on the operator instead of exceptions in TD's cook.
    """

    def __init__(
        self,
        link: str,
        *,
        flip: Switch = "auto",
        swap_rb: Switch = "auto",
        match_format: bool = False,
        resubmit: bool = True,
        retry_s: float = 0.5,
        stream: Any = None,
        shape_factory: ShapeFactory | None = None,
        array_backend: str | None = None,
        method: Method = "auto",
        transport: Transport | None = None,
    ) -> None:
        self.link = link
        self.flip: Switch = flip
        self.swap_rb: Switch = swap_rb
        self.match_format = match_format
        self.resubmit = resubmit
        self.retry_s = retry_s
        self.transport = transport
        self.sink = ScriptTopSink(
            stream=stream, shape_factory=shape_factory, array_backend=array_backend, method=method
        )
        self.status = "not cooked yet"
        self.frames = 0
        self._rx: Receiver | None = None
        self._next_try = 0.0
        self._format: tuple[int, int, int, str] | None = None
        self._script_error = False

    @property
    def receiver(self) -> Receiver | None:
        return self._rx

    def set_link(self, link: str) -> None:
        """Follow a new link name; the old link is let go (the last image stays)."""
        if link != self.link:
            self._drop_receiver()
            self.link = link

    def reconnect(self) -> None:
        self._drop_receiver()

    def close(self) -> None:
        self._drop_receiver()
        self.sink.release()

    def _drop_receiver(self) -> None:
        rx, self._rx = self._rx, None
        self._next_try = 0.0
        try:
            self.sink.detach()
        finally:
            if rx is not None:
                rx.close()

    def _again(self, script_op: Any) -> None:
        if self.resubmit:
            self.sink.resubmit(script_op)

    def cook(self, script_op: Any, *, active: bool = True) -> str:
        """Run one cook of ``script_op``; returns the status also shown on it."""
        if self._script_error:  # our fallback messages from the last call; TD clears cook errors itself
            self._script_error = False
            try:
                script_op.clearScriptErrors(error="cudalink*")
            except Exception:
                pass
        try:
            status, level = self._cook(script_op, active)
        except Exception as exc:  # a cook must not raise into TD: show it, keep the last image
            status, level = _message(exc), "error"
            try:
                self._again(script_op)
            except Exception:
                pass
        if level is not None:
            self._script_error = _report(script_op, level, status)
        self.status = status
        return status

    def _cook(self, script_op: Any, active: bool) -> tuple[str, str | None]:
        if not active:
            self._drop_receiver()
            self._again(script_op)
            return "inactive", None
        if not self.link:
            self._again(script_op)
            return "cudalink: no link name set", "warning"
        rx = self._rx
        if rx is None:
            rx = self._rx = Receiver(self.link, connect=False, transport=self.transport)
        closing = _producer_closing(rx)
        if closing:  # it frees its slots once we leave: the image we show must be our own copy by then
            self.sink.detach()
        now = time.monotonic()
        if not rx.connected and now < self._next_try:
            self._again(script_op)
            return f"cudalink: waiting for a producer on {self.link!r}", "warning"
        try:
            frame = rx.poll()
        except LinkTimeout:
            self._next_try = now + self.retry_s
            self._again(script_op)
            return f"cudalink: waiting for a producer on {self.link!r}", "warning"
        except ProducerGone:
            self.sink.detach()
            self._again(script_op)
            gone = f"cudalink: the producer of {self.link!r} left; showing its last frame until a new one starts"
            return gone, "warning"
        if frame is None:
            self._again(script_op)
            if closing:
                return (
                    f"cudalink: the producer of {self.link!r} is closing; showing its last frame",
                    "warning",
                )
            if self.sink.last is None:
                return f"cudalink: connected to {self.link!r}; no frame yet", "warning"
            return f"showing frame {self.sink.last.seq} (no new frame)", None
        warning = None
        if self.match_format:
            warning = self._match_format(script_op, frame)
        upload = self.sink.show(frame, script_op, flip=self.flip, swap_rb=self.swap_rb)
        del frame  # a zero-copy upload holds it; a converted one lets the producer have its slot back now
        if closing:
            self.sink.detach()
        self.frames += 1
        if warning:
            return warning, "warning"
        return f"frame {upload.seq}: {upload!r}", None

    def _match_format(self, script_op: Any, frame: Frame) -> str | None:
        plan = _Plan(frame, self.flip, self.swap_rb, "cuda")
        key = (plan.width, plan.height, plan.comps, plan.dtype.name)
        if key == self._format:
            return None
        self._format = key
        failed = sync_top_format(script_op, plan.width, plan.height, plan.comps, plan.dtype)
        if failed:
            return "cudalink: could not match the Script TOP's format: " + "; ".join(failed)
        return None

    def __repr__(self) -> str:
        return f"<cudalink.td.ScriptTopReceiver {self.link!r} frames={self.frames} status={self.status!r}>"
