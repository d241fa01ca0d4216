"""The typed frame every user touches: one class for host and CUDA memory, exported through DLPack.

A frame never copies and never blocks the CPU. Its memory stays valid until the frame *and every
array or tensor made from it* are gone: each export holds a reference to a small ``_Hold`` object,
and the owner's ``on_release`` callback runs when the last one dies. For CUDA frames the callback
learns which consumer streams the frame was exported to, so the owner can fence the memory on
the GPU instead of trusting the CPU-side release.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import numpy.typing as npt
from numpy.typing import DTypeLike

# downward only: the CUDA glue never imports frames (they describe themselves)
from ..cuda import arrays, devices, driver
from ..errors import ArgumentTypeError, ExportError, FormatError, LinkClosed, int_arg
from .spec import FrameSpec, PixelFormat, RowOrigin, check_meta_size

if TYPE_CHECKING:
    from typing_extensions import CapsuleType

    from .._native.dlpack import Exporter
    from ..cuda.objects import StridedView

__all__ = ["DLDeviceType", "Frame", "FrameSync", "HostViews"]


class DLDeviceType:
    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    CUDA_MANAGED = 13


class FrameSync(Protocol):
    """GPU-side ordering for a CUDA frame, supplied by whoever made the frame (a backend, the TD bridge)."""

    def wait(self, stream: int) -> None:
        """Make ``stream`` (a raw CUstream value; 1 = legacy default) wait until the frame may be touched."""

    def cai_stream(self) -> int | None:
        """A stream of this process on which the data is ready, for ``__cuda_array_interface__``."""


ReleaseCallback = Callable[[list[int]], None]
#: A host slot viewed as its spec, made once per (slot, spec) by whoever owns the memory: a writable view
#: and a read-only one, so an export only views one (~0.1 us) and never flips ``flags.writeable``.
HostViews = tuple["npt.NDArray[np.generic]", "npt.NDArray[np.generic]"]


class _Hold:
    """Keeps the memory's owner alive; every export references it. Its death is the frame's true release.

    The release runs from ``__del__``: the hold is never part of a reference cycle (it points only at
    the owner and a list of ints), so CPython frees it the moment the last frame, array or tensor lets
    go, with no ``weakref.finalize`` registry entry to create per frame.
    """

    __slots__ = ("on_release", "owner", "ptr", "streams")

    def __init__(self, owner: object, ptr: int, on_release: ReleaseCallback | None = None) -> None:
        self.owner = owner
        self.ptr = ptr
        self.streams: list[int] = []
        self.on_release = on_release

    def __del__(self) -> None:
        cb = self.on_release
        if cb is not None:
            self.on_release = None
            try:
                cb(self.streams)
            except Exception:  # a finalizer must never raise; the owner logs what matters
                pass


def _order(sync: FrameSync | None, s: int, device: int) -> None:
    """Make stream ``s`` wait (GPU-side) for the frame's producer, whoever asks: a DLPack export or a send of
    the frame on (a relay). ``s`` may be a default stream of the frame's GPU (see :func:`devices.on_stream`)."""
    if sync is not None:
        devices.on_stream(devices.primary_context(device), s, sync.wait, s)


_U64 = (1 << 64) - 1  # the largest seq and timestamp a link's frames carry
#: the DLPack version of every versioned capsule we make (the compiled exporter's too)
_DLPACK_V1 = (1, 0)


def _int_pair(value: object, arg: str, form: str) -> tuple[int, int]:
    """A consumer's ``max_version`` or ``dl_device``: DLPack's pair of ints (a sequence of numpy ints, say), else
    a clear error naming ``form``, the pair it takes."""
    try:
        first, second = (operator.index(v) for v in value)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"cudalink: __dlpack__({arg}=...) takes {form}, or None; got {value!r}") from None
    return first, second


def _versioned(max_version: object) -> bool:
    """Whether a consumer's ``max_version`` that could not be read as a pair takes a versioned capsule."""
    return _int_pair(max_version, "max_version", "a (major, minor) pair of ints such as (1, 0)")[0] >= 1


def _dl_device(dl_device: object) -> tuple[int, int]:
    """A consumer's ``dl_device`` as DLPack's ``(device_type, device_id)`` pair of ints."""
    return _int_pair(dl_device, "dl_device", "a (device_type, device_id) pair of ints such as (1, 0) for the CPU")


def _strides_at_fault(
    shape: tuple[int, ...], dtype: DTypeLike, pixel_format: PixelFormat | str | None, origin: RowOrigin | str
) -> bool:
    """Whether a spec refused with its strides is accepted without them (the strides were what it refused)."""
    try:
        FrameSpec(shape, dtype, None, pixel_format, origin)
    except FormatError:
        return False
    return True


def _copy_arg(copy: object) -> bool:
    """A consumer's ``copy`` that is not None, True or False: a numpy bool, else refused (a string is truthy)."""
    if isinstance(copy, np.bool_):
        return bool(copy)
    raise ArgumentTypeError(f"cudalink: __dlpack__(copy=...) takes True, False or None; got {copy!r}")


def _check_within(spec: FrameSpec, ptr: int, owner: npt.NDArray[np.generic]) -> None:
    """Refuse a frame whose spec reaches outside the numpy array that owns its memory: reading it would read
    whatever lies beyond (or crash)."""
    low, high = np.lib.array_utils.byte_bounds(owner)
    if not low <= ptr <= ptr + spec.nbytes <= high:
        raise FormatError(
            f"cudalink: the frame's {spec.shape} {spec.dtype.name} spans {spec.nbytes} bytes from address {ptr:#x}, "
            f"outside the {high - low} bytes of the array that owns its memory; use Frame.from_array(array), which "
            "reads shape, dtype and strides from the array, or a spec that fits it"
        )


class _HostArrayRef:
    """Array-interface shim so numpy arrays over a frame keep the frame's ``_Hold`` as their base."""

    __slots__ = ("__array_interface__", "hold")

    def __init__(self, hold: _Hold, spec: FrameSpec, readonly: bool) -> None:
        self.hold = hold
        self.__array_interface__ = {
            "version": 3,
            "shape": spec.shape,
            "typestr": _typestr(spec),
            "strides": spec.strides,
            "data": (hold.ptr, readonly),
        }


def _packaged(spec: FrameSpec) -> bool:
    """Whether the frames' dtype is one numpy has only through a package (ml_dtypes' bfloat16: kind "V")."""
    return spec.dtype.kind == "V"


def _uncompiled(spec: FrameSpec, exporter: str, instead: str) -> ExportError:
    """Only the compiled core exports bfloat16 through DLPack: numpy and cuda.core 1.x refuse it."""
    return ExportError(
        f"cudalink: {exporter} cannot export {spec.dtype.name} through DLPack, and this install lacks cudalink's "
        f"compiled core, which can; read the frame with {instead}, or reinstall cudalink where a C compiler "
        "exists (pip install --force-reinstall --no-binary cudalink cudalink)"
    )


def _typestr(spec: FrameSpec) -> str:
    """The array interfaces' type: ml_dtypes' bfloat16 has none (its ``str`` is raw bytes, ``<V2``), so its bits
    go as uint16 and the reader views them back (:meth:`Frame.numpy`)."""
    return spec.dtype.str if not _packaged(spec) else f"<u{spec.itemsize}"


class _HeldArray(np.ndarray):  # type: ignore[type-arg]  # a view type: numpy's own parameters apply
    """A host frame's DLPack export: a view of the slot that keeps the frame's ``_Hold`` alive.

    Viewing a slot array made once per (slot, spec) costs ~0.1 us; building an array from an
    ``__array_interface__`` dict, as :class:`_HostArrayRef` does, ~1.8 us. The DLPack capsule keeps this
    view alive, and the view keeps the hold. Consumers get a plain ndarray from ``np.from_dlpack``.
    """

    __slots__ = ("_cudalink_hold",)  # no instance dict per export

    _cudalink_hold: _Hold


class Frame:
    """One frame of a link: typed, zero-copy, and exportable to numpy, torch, cupy and jax.

    Use :meth:`from_array` to wrap memory you own; links hand out frames from ``recv()`` and ``reserve()``.
    """

    __slots__ = (
        "__weakref__",
        "_cai_exported",
        "_device_id",
        "_export",
        "_hold",
        "_host",
        "_is_cuda",
        "_meta",
        "_released",
        "_seq",
        "_spec",
        "_sync",
        "_timestamp_ns",
        "_view",
        "_writable",
        "generation",
    )

    def __init__(
        self,
        spec: FrameSpec,
        ptr: int,
        owner: object,
        *,
        device: str | int = "cpu",
        seq: int = 0,
        timestamp_ns: int = 0,
        meta: bytes = b"",
        writable: bool = False,
        sync: FrameSync | None = None,
        on_release: ReleaseCallback | None = None,
        generation: int = 0,
    ) -> None:
        if isinstance(owner, np.ndarray):
            _check_within(spec, int(ptr), owner)
        self._spec = spec
        self._is_cuda = device != "cpu"
        self._device_id = -1 if device == "cpu" else int(device)
        self._seq = int(seq)
        self._timestamp_ns = int(timestamp_ns)
        self._meta = bytes(meta)
        self._writable = writable
        self._sync = sync
        self._hold: _Hold | None = _Hold(owner, int(ptr), on_release)
        self._host: HostViews | None = None
        self._released = False
        self._cai_exported = False
        self._view: StridedView | None = None
        self._export: Exporter | None = None
        self.generation = generation

    @classmethod
    def _received(
        cls,
        spec: FrameSpec,
        hold: _Hold,
        device_id: int,
        seq: int,
        timestamp_ns: int,
        meta: bytes,
        sync: FrameSync | None,
        generation: int,
        host: HostViews | None = None,
        export: Exporter | None = None,
        writable: bool = False,
    ) -> Frame:
        """The per-frame constructor of the receive path (and ``reserve()``'s, ``writable``): trusted,
        already-converted values, no checks.

        ``export`` makes this slot's DLPack capsules in one C call (the compiled core), where it was built.
        The compiled receive sets these same slots in C (``_native.ring._FRAME_SLOTS``): a slot added
        here goes there too, or the compiled core falls back to calling this (a test says which).
        """
        self = object.__new__(cls)
        self._spec = spec
        self._is_cuda = device_id >= 0
        self._device_id = device_id
        self._seq = seq
        self._timestamp_ns = timestamp_ns
        self._meta = meta
        self._writable = writable
        self._sync = sync
        self._hold = hold
        self._host = host  # views of the slot for ``spec`` (host links), made once per slot
        self._released = False
        self._cai_exported = False
        self._view = None
        self._export = export
        self.generation = generation
        return self

    # -- construction from memory you own ---------------------------------------------------------

    @classmethod
    def from_array(
        cls,
        obj: object,
        *,
        pixel_format: PixelFormat | str | None = None,
        origin: RowOrigin | str = RowOrigin.TOP,
        seq: int = 0,
        timestamp_ns: int | None = None,
        meta: bytes | bytearray | memoryview | None = b"",
        sync: FrameSync | None = None,
    ) -> Frame:
        """Wrap any DLPack / array-interface object (numpy, torch, cupy, ...) as a Frame, without a copy.

        The frame keeps ``obj`` alive. CUDA objects are read through ``__cuda_array_interface__`` or DLPack.
        ``meta`` is bytes-like (or None); ``seq`` and ``timestamp_ns`` are u64 ints, as a link's frames carry.
        """
        seq = int_arg(seq, "seq", 0, _U64, "seq=0")
        ts = (
            time.time_ns()
            if timestamp_ns is None
            else int_arg(timestamp_ns, "timestamp_ns", 0, _U64, "timestamp_ns=time.time_ns()")
        )
        if not isinstance(meta, (bytes, bytearray, memoryview)) and meta is not None:  # bytes(5): five zero bytes
            raise ArgumentTypeError(
                f"cudalink: meta must be bytes, bytearray or memoryview (or None), got {type(meta).__name__}"
                + ("; encode it first, e.g. meta=text.encode()" if isinstance(meta, str) else "")
            )
        raw = b"" if meta is None else bytes(meta)  # its bytes: a memoryview's len() counts items, not bytes
        check_meta_size(len(raw))
        info = arrays.describe_array(obj)
        try:
            spec = FrameSpec(info.shape, info.dtype, info.strides, pixel_format, origin)
        except FormatError as exc:
            if not _strides_at_fault(info.shape, info.dtype, pixel_format, origin):
                raise
            # a frame's strides are what its memory is: a flip or a broadcast cannot be wrapped without a copy
            raise FormatError(
                f"{exc}; Frame.from_array wraps memory as it is: pass a copy (np.ascontiguousarray(x), "
                "torch: x.contiguous()). Sender.send() copies such arrays right by itself"
            ) from exc
        device: str | int = "cpu" if info.device_id < 0 else info.device_id
        return cls(
            spec,
            info.ptr,
            info.owner,
            device=device,
            seq=seq,
            timestamp_ns=ts,
            meta=raw,
            writable=not info.readonly,
            sync=sync,
        )

    # -- metadata -----------------------------------------------------------------------------------

    @property
    def spec(self) -> FrameSpec:
        return self._spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype[np.generic]:
        return self._spec.dtype

    @property
    def strides(self) -> tuple[int, ...]:
        """Numpy-style strides in bytes."""
        return self._spec.byte_strides

    @property
    def nbytes(self) -> int:
        return self._spec.nbytes

    @property
    def ndim(self) -> int:
        return self._spec.ndim

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return f"cuda:{self._device_id}" if self._is_cuda else "cpu"

    @property
    def is_cuda(self) -> bool:
        return self._is_cuda

    @property
    def seq(self) -> int:
        """Producer sequence number: 1, 2, 3... within one producer generation."""
        return self._seq

    @property
    def timestamp_ns(self) -> int:
        """``time.time_ns()`` on the producer when the frame was published."""
        return self._timestamp_ns

    @property
    def pixel_format(self) -> PixelFormat | None:
        return self._spec.pixel_format

    @property
    def origin(self) -> RowOrigin:
        return self._spec.origin

    @property
    def meta(self) -> bytes:
        """Small user bytes that travel with the frame."""
        return self._meta

    @property
    def released(self) -> bool:
        return self._released

    @property
    def ptr(self) -> int:
        """Address of element 0 (host or device). Valid while the frame is held."""
        return self._live().ptr

    def __repr__(self) -> str:
        state = "released" if self.released else self.device
        spec = self._spec  # its label names the shape only where there is no pixel format
        shape = "" if spec.pixel_format is None else f" {self.shape}"
        return f"<cudalink.Frame seq={self._seq} {spec.label}{shape} {state}>"

    def __reduce__(self) -> tuple[object, ...]:
        """Refused clearly: a frame lends memory mapped in this process only, and a copy must be asked for."""
        raise ArgumentTypeError(
            "cudalink: a Frame can't be pickled or passed to another process (its memory is lent to this one); "
            "pass a copy (np.array(frame), torch.from_dlpack(frame).clone()) or have that process make its own "
            "Receiver"
        )

    # -- lifetime ---------------------------------------------------------------------------------------

    def release(self) -> None:
        """Drop this frame's hold. Arrays/tensors made from it keep the memory until they die too."""
        self._released = True
        self._view = None
        if not self._cai_exported:
            self._hold = None

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _export_streams(self) -> list[int]:
        """Streams this frame was handed to through DLPack/CAI (for fences and commits)."""
        hold = self._hold
        return list(hold.streams) if hold is not None else []

    def _live(self) -> _Hold:
        hold = self._hold
        if hold is None or self._released:
            raise LinkClosed("cudalink: this frame was released; receive a new one (or keep it until you are done)")
        return hold

    def _cudalink_array_info(self, stream_ptr: int) -> arrays.ArrayInfo:
        """What ``arrays.describe_array`` needs of a frame sent on (a relay): no array-interface side effects,
        and the frame's own sync orders its producer before ``stream_ptr`` (-1: no ordering)."""
        if not self._is_cuda:
            return arrays.host_info(self.numpy())
        if stream_ptr != -1:
            _order(self._sync, stream_ptr, self._device_id)
        spec = self._spec
        return arrays.ArrayInfo(self.ptr, spec.shape, spec.dtype, spec.strides, self._device_id, False, self)

    # -- DLPack -----------------------------------------------------------------------------------------

    def __dlpack_device__(self) -> tuple[int, int]:
        return (DLDeviceType.CUDA, self._device_id) if self._is_cuda else (DLDeviceType.CPU, 0)

    def __dlpack__(
        self,
        *,
        stream: object = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType:
        if self._released:
            raise ExportError("cudalink: this frame was released; cannot export it")
        try:
            legacy = max_version is None or max_version[0] < 1  # a DLPack 0.x consumer: no versioned capsule
        except (TypeError, LookupError):
            legacy = not _versioned(max_version)  # not DLPack's (major, minor): says so
        if copy is not None and copy is not True and copy is not False:
            copy = _copy_arg(copy)
        if not self._is_cuda:
            if stream is not None:
                raise ExportError("cudalink: a CPU frame takes no stream (DLPack requires stream=None on CPU)")
            if dl_device is not None and _dl_device(dl_device) != (DLDeviceType.CPU, 0):
                raise ExportError(f"cudalink: a CPU frame cannot be exported to device {dl_device}")
            hold = self._hold
            if hold is None:
                raise ExportError("cudalink: this frame was released; cannot export it")
            export = self._export if self._export is not None else self._exporter()  # bfloat16: made once
            if export is not None and not copy:  # one C call; only a versioned capsule can say read-only
                return export.capsule(hold, not legacy and not self._writable, not legacy)
            host = self._host
            if host is not None and not copy and not _packaged(self._spec):
                # a legacy capsule cannot say read-only: exported writable, as below
                held = host[0 if legacy or self._writable else 1].view(_HeldArray)
                held._cudalink_hold = hold
                return held.__dlpack__() if legacy else held.__dlpack__(max_version=_DLPACK_V1, copy=False)
            if _packaged(self._spec):  # numpy's DLPack export takes no bfloat16
                if export is not None:
                    raise ExportError(
                        f"cudalink: numpy cannot copy {self._spec.dtype.name} through DLPack; take the frame without "
                        "copy= and copy it in your framework (torch.from_dlpack(frame).clone())"
                    )
                raise _uncompiled(self._spec, "numpy", "frame.numpy() (an ml_dtypes array)")
            if legacy:
                # Legacy capsules cannot say "read-only" (numpy refuses to export such arrays); like torch,
                # we export anyway: writing through it is the consumer's bug, as with any DLPack 0.x tensor.
                arr = np.asarray(_HostArrayRef(hold, self._spec, readonly=False))
                return (arr.copy() if copy else arr).__dlpack__()
            # numpy makes the copy itself and marks it IS_COPIED, so the consumer knows it owns the bytes
            arr = self.numpy()
            return cast("npt.NDArray[np.number]", arr).__dlpack__(max_version=_DLPACK_V1, copy=bool(copy))
        if dl_device is not None and _dl_device(dl_device) != self.__dlpack_device__():
            raise ExportError(
                f"cudalink: frame lives on {self.device}; it cannot be exported to DLPack device {tuple(dl_device)}"
                " without a copy. Use frame.to_numpy() for a host copy."
            )
        if copy:
            raise ExportError("cudalink: copy=True is not supported for CUDA frames; copy in your framework")
        s = driver.stream_handle(stream, dlpack=True)
        hold = self._live()
        if s != -1:
            _order(self._sync, s, self._device_id)
            if s not in hold.streams:
                hold.streams.append(s)
        export = self._export if self._export is not None else self._exporter()  # bfloat16: made once
        if export is not None:  # one C call, exported writable as the view below is
            return export.capsule(hold, False, not legacy)
        if _packaged(self._spec):
            raise _uncompiled(self._spec, "cuda.core", "frame.to_numpy() (a host copy)")
        return self._cuda_view().__dlpack__(stream=None, max_version=None if legacy else _DLPACK_V1)

    def _exporter(self) -> Exporter | None:
        """The frame's compiled capsule maker; for a bfloat16 frame that came with none (``Frame.from_array``) one
        is made here: the only exporter of bfloat16, where numpy's and cuda.core's refuse it."""
        if self._export is None and _packaged(self._spec):
            self._export = arrays.dlpack_exporter(self._live().ptr, self._spec, self._device_id)
        return self._export

    def _cuda_view(self) -> StridedView:
        view = self._view
        if view is None:
            hold = self._live()
            view = arrays.typed_view(hold.ptr, self._spec, self._device_id, hold, readonly=False)
            self._view = view
        return view

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        """CAI v3, for libraries that read it (cupy, numba). ``stream`` is one of ours on which data is ready.

        It says read-only unless the frame is writable (``reserve()``), and torch's ``as_tensor`` refuses a
        read-only CAI ("the read only flag is not supported"): torch takes received frames through DLPack
        (``torch.from_dlpack(frame)``)."""
        if not self._is_cuda:
            raise AttributeError("cudalink: __cuda_array_interface__ exists only on CUDA frames; use np.from_dlpack")
        if _packaged(self._spec):
            raise AttributeError(
                f"cudalink: the CUDA array interface has no {self._spec.dtype.name} (it would read as raw bytes); "
                "take the frame through DLPack (torch.from_dlpack(frame), jax.dlpack.from_dlpack(frame))"
            )
        ptr, stream = self._cai_ready()
        return {
            "version": 3,
            "shape": self._spec.shape,
            "typestr": self._spec.dtype.str,
            "strides": self._spec.strides,
            "data": (ptr, not self._writable),
            "stream": stream,
        }

    def _cai_ready(self) -> tuple[int, int | None]:
        """What reading the CUDA array interface does, whatever the dtype (a server sends bfloat16 frames' bytes):
        ``(ptr, stream)``, ``stream`` one of ours on which the data is ready (None: the producer's own)."""
        hold = self._live()
        # CAI consumers keep the *frame* alive, not our hold: so release() must not drop the hold now.
        self._cai_exported = True
        stream = self._sync.cai_stream() if self._sync is not None else None
        if stream is not None and stream not in hold.streams:
            hold.streams.append(stream)
        return hold.ptr, stream

    # -- host access ----------------------------------------------------------------------------------

    def numpy(self) -> npt.NDArray[np.generic]:
        """Zero-copy numpy view of a CPU frame (read-only unless the frame is writable, as in ``reserve``)."""
        if self._is_cuda:
            raise FormatError("cudalink: this frame is on the GPU; use frame.to_numpy() for a host copy")
        hold = self._live()
        out: npt.NDArray[np.generic] = np.asarray(_HostArrayRef(hold, self._spec, readonly=not self._writable))
        return out.view(self._spec.dtype) if out.dtype != self._spec.dtype else out

    def __array__(self, dtype: DTypeLike | None = None, copy: bool | None = None) -> npt.NDArray[np.generic]:
        if self._is_cuda:
            raise TypeError("cudalink: a CUDA frame is not host memory; use frame.to_numpy() or a GPU framework")
        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:  # numpy's own rule for np.asarray(x, dtype=..., copy=False)
                raise ValueError(
                    f"cudalink: a {arr.dtype} frame cannot be read as {np.dtype(dtype)} without a copy; "
                    "pass copy=None (or True)"
                )
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def to_numpy(self) -> npt.NDArray[np.generic]:
        """A host copy. For CUDA frames this waits (CPU-side) for the frame's data: avoid it on hot paths."""
        if not self._is_cuda:
            host: npt.NDArray[np.generic] = self.numpy().copy()
            return host

        hold = self._live()
        stream = self._sync.cai_stream() if self._sync is not None else None
        return arrays.copy_to_host(hold.ptr, self._spec, self._device_id, stream)
