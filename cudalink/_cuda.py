"""All cuda.core / cuda.bindings glue, including every import of their private modules.

Nothing here runs at ``import cudalink``: CUDA is touched the first time a CUDA link, frame or
diagnosis needs it, so a machine with no driver imports cudalink fine and gets a clear
:class:`~cudalink.CudaUnavailable` only when it asks for the GPU.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import _native
from .errors import CudaError, CudaUnavailable, FormatError, LinkError

if TYPE_CHECKING:  # the CUDA glue imports nothing of cudalink's above errors and _native (no import cycle)
    from .frames.spec import FrameSpec

NO_GPU_HINT = "use device='cpu' for the host backend (same API, numpy frames)"


class ArrayInfo(NamedTuple):
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    strides: tuple[int, ...] | None  # bytes; None = C-contiguous
    device_id: int  # -1 = host
    readonly: bool
    owner: object


_driver_mod: Any = None
#: ``cudalink._native.driver`` where it was built and a driver is present: the per-frame driver calls go
#: straight to C, and raw event handles are plain ints. Decided with the first use of cuda.bindings.
_fast: Any = None
_core_mod: Any = None
_smv: Any = None


NO_CUDA_PACKAGES = (
    "cudalink: the CUDA packages are not installed here (cuda-core, cuda-bindings: pip installs them only "
    "where NVIDIA ships wheels, not on macOS); on a machine with an NVIDIA GPU run "
    "`pip install cuda-core cuda-bindings`, or " + NO_GPU_HINT
)


def _drv() -> Any:
    global _driver_mod
    if _driver_mod is None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise CudaUnavailable(NO_CUDA_PACKAGES) from exc
        _use_fast(_native.load_driver())
        _driver_mod = driver
    return _driver_mod


def _core() -> Any:
    global _core_mod
    if _core_mod is None:
        try:
            import cuda.core
        except ImportError as exc:
            raise CudaUnavailable(NO_CUDA_PACKAGES) from exc
        _drv()  # decides the handle representation before any event exists
        _core_mod = cuda.core
    return _core_mod


_ANY_UNSET: Any = object()
_any: Any = _ANY_UNSET


def _any_interface() -> Any:
    """``StridedMemoryView.from_any_interface`` where this cuda.core has it (its torch fast path), else None."""
    global _any
    if _any is _ANY_UNSET:
        _any = getattr(_view_cls(), "from_any_interface", None)
    return _any


def _view_cls() -> Any:
    global _smv
    if _smv is None:
        _core()  # a clear CudaUnavailable where the CUDA packages are missing
        from cuda.core.utils import StridedMemoryView

        _smv = StridedMemoryView
    return _smv


def check(ret: Any, what: str) -> Any:
    """Unwrap a cuda.bindings ``(CUresult, *values)`` tuple; a failure is a :class:`CudaError` naming the call."""
    err = ret[0]
    if err:
        raise cuda_error(int(err), what)
    return ret[1] if len(ret) == 2 else ret[1:]


def cuda_error(code: int, what: str) -> CudaError:
    """The one translation of a failed driver call (the compiled driver calls use it too)."""
    try:
        drv = _drv()
        name = drv.cuGetErrorName(drv.CUresult(code))[1].decode()
    except Exception:
        name = f"CUresult {code}"
    return CudaError(f"cudalink: {what} failed with {name}", code, name)


# -- arrays ----------------------------------------------------------------------------------------------


def describe_array(obj: Any, stream_ptr: int = -1) -> ArrayInfo:
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
        info = _torch_info(obj)
        if info is not None:
            return info
    if cls.__module__ == "torch" and getattr(obj, "is_cuda", False) and _any_interface() is not None:
        # cuda.core reads a torch tensor through its C ABI (no Python property) and orders ``stream_ptr``
        # after torch's current stream, as DLPack would: torch's own CAI is v2 and carries no stream,
        # and its DLPack export costs ~18 us of Python.
        try:
            return _device_info(obj, _any_interface()(obj, stream_ptr=stream_ptr))
        except Exception as exc:
            raise FormatError(f"cudalink: cannot read {cls.__name__} through cuda.core: {exc}") from exc
    has_cai = hasattr(cls, "__cuda_array_interface__")  # on the type: never evaluate a property here
    if cls is np.ndarray or (not has_cai and hasattr(cls, "__array_interface__")):
        return host_info(np.asarray(obj))
    dl_dev = getattr(obj, "__dlpack_device__", None)
    if dl_dev is not None:
        if int(dl_dev()[0]) in (1, 3):  # CPU or pinned host memory (a torch CPU tensor, say)
            return host_info(np.from_dlpack(obj))
    elif not has_cai:
        try:
            return host_info(np.asarray(obj))
        except Exception as exc:
            raise FormatError(f"cudalink: cannot read {cls.__name__} as an array: {exc}") from exc
    smv = _view_cls()
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


_torch_dtypes: dict[Any, np.dtype[Any] | None] = {}


def _torch_info(t: Any) -> ArrayInfo | None:
    """A contiguous torch CUDA tensor described through its own C methods: no view object, no properties.

    Only for callers that need no stream ordering (``stream_ptr=-1``); anything unusual (a dtype numpy
    lacks, non-contiguous memory) returns None and takes the general path.
    """
    dtype = _torch_dtypes.get(t.dtype, _ANY_UNSET)
    if dtype is _ANY_UNSET:  # once per torch dtype: numpy's dtype of the same name, or None (bfloat16, fp8)
        try:
            dtype = np.dtype(str(t.dtype).removeprefix("torch."))
        except TypeError:
            dtype = None
        _torch_dtypes[t.dtype] = dtype
    if dtype is None or not t.is_contiguous():
        return None
    return ArrayInfo(t.data_ptr(), tuple(t.shape), dtype, None, t.get_device(), False, t)


def current_stream_of(obj: Any) -> int | None:
    """The raw stream a framework queues an array's work on, where asking is cheap; else None.

    For a torch CUDA tensor that is torch's current stream on the tensor's device (one C call). A copy
    queued there is ordered after the tensor's producer with no event and no cross-stream wait, which
    is what DLPack's stream handshake would otherwise cost.
    """
    cls = type(obj)
    if cls.__module__ != "torch" or not getattr(obj, "is_cuda", False):
        return None
    try:
        raw = int(sys.modules["torch"]._C._cuda_getCurrentRawStream(obj.get_device()))
    except Exception:
        return None
    return raw or 1  # torch's default stream is the legacy NULL stream


def _device_info(obj: Any, view: Any) -> ArrayInfo:
    dtype = view.dtype
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
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


def host_info(arr: np.ndarray[Any, Any]) -> ArrayInfo:
    strides = None if arr.flags.c_contiguous else tuple(arr.strides)
    return ArrayInfo(int(arr.ctypes.data), tuple(arr.shape), arr.dtype, strides, -1, not arr.flags.writeable, arr)


def typed_view(ptr: int, spec: FrameSpec, device_id: int, owner: object, readonly: bool) -> Any:
    """A cuda.core StridedMemoryView over device memory: the object that speaks DLPack for CUDA frames."""
    buf = _core().Buffer.from_handle(ptr, spec.nbytes, owner=owner)
    strides = None if spec.strides is None else tuple(s // spec.itemsize for s in spec.strides)
    return _view_cls().from_buffer(buf, spec.shape, strides, dtype=spec.dtype, is_readonly=readonly)


def copy_to_host(ptr: int, spec: FrameSpec, device_id: int, stream: int | None) -> np.ndarray[Any, Any]:
    """Blocking device-to-host copy (for ``Frame.to_numpy``, tests and demos; not a hot path)."""
    drv = _drv()
    device(device_id)
    if stream is not None:
        check(drv.cuStreamSynchronize(drv.CUstream(stream)), "cuStreamSynchronize")
    out = np.empty(spec.nbytes, np.uint8)
    check(drv.cuMemcpyDtoH(out.ctypes.data, ptr, spec.nbytes), "cuMemcpyDtoH")
    view: np.ndarray[Any, Any] = np.lib.stride_tricks.as_strided(out.view(spec.dtype), spec.shape, spec.byte_strides)
    copied: np.ndarray[Any, Any] = view.copy()
    return copied


_streams: dict[int, Any] = {}


def cu_stream(stream: int) -> Any:
    """A cached ``CUstream`` wrapper for a raw handle (building one costs more than the call it feeds)."""
    cs = _streams.get(stream)
    if cs is None:
        if len(_streams) > 1024:
            _streams.clear()
        cs = _streams[stream] = _drv().CUstream(stream)
    return cs


def memcpy_dtod(dst: int, src: int, nbytes: int, stream: int) -> None:
    err = _drv().cuMemcpyDtoDAsync(dst, src, nbytes, cu_stream(stream))[0]
    if err:
        check((err,), "cuMemcpyDtoDAsync")


def memcpy_2d_dtod(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
    """One pitched device-to-device copy (a source with padded rows), still a single driver call."""
    drv = _drv()
    p = drv.CUDA_MEMCPY2D()
    p.srcMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice = src
    p.srcPitch = src_pitch
    p.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.dstDevice = dst
    p.dstPitch = dst_pitch
    p.WidthInBytes = width
    p.Height = height
    check(drv.cuMemcpy2DAsync(p, cu_stream(stream)), "cuMemcpy2DAsync")


def memcpy_htod(dst: int, src: int, nbytes: int, stream: int) -> None:
    drv = _drv()
    check(drv.cuMemcpyHtoDAsync(dst, src, nbytes, drv.CUstream(stream)), "cuMemcpyHtoDAsync")


# -- devices -----------------------------------------------------------------------------------------------


def parse_device(device: object) -> int:
    """``0``, ``"cuda"``, ``"cuda:1"`` -> ordinal; anything else is a clear error."""
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool) and int(device) >= 0:
        return int(device)
    if isinstance(device, str):
        text = device.strip().lower()
        if text == "cuda":
            return 0
        if text.startswith("cuda:") and text[5:].isdigit():
            return int(text[5:])
    raise LinkError(f"cudalink: device must be 'cpu', a CUDA ordinal like 0, or 'cuda:N'; got {device!r}")


def device(ordinal: int) -> Any:
    """The cuda.core Device, made current; CudaUnavailable (with the way out) when there is none."""
    core = _core()
    try:
        dev = core.Device(ordinal)
        dev.set_current()
    except RuntimeError as exc:  # includes cuda.pathfinder's DynamicLibNotFoundError (no driver)
        raise CudaUnavailable(f"cudalink: no usable CUDA driver ({exc}); {NO_GPU_HINT}") from exc
    except (ValueError, IndexError) as exc:
        raise CudaUnavailable(f"cudalink: no CUDA device {ordinal} ({exc}); {NO_GPU_HINT}") from exc
    return dev


def device_by_uuid(uuid: bytes, fallback: int) -> Any:
    """Open the producer's GPU by UUID, so differing CUDA_VISIBLE_DEVICES still meet on the same chip."""
    core = _core()
    try:
        count = int(core.system.get_num_devices())
    except Exception:
        count = 0
    if any(uuid):
        for i in range(count):
            dev = core.Device(i)
            if uuid_of(dev) == uuid:
                dev.set_current()
                return dev
        raise CudaUnavailable("cudalink: the producer's GPU is not visible here; check CUDA_VISIBLE_DEVICES")
    return device(fallback)


def uuid_of(dev: Any) -> bytes:
    """The GPU's 16-byte UUID (zeros where the driver gives none): how the header names the device."""
    import uuid as _uuid

    try:
        return _uuid.UUID(str(dev.uuid)).bytes
    except Exception:
        return b"\0" * 16


def ipc_support(dev: Any) -> dict[str, bool]:
    props = dev.properties
    out = {}
    for key in ("memory_pools_supported", "handle_type_posix_file_descriptor_supported"):
        try:
            out[key] = bool(getattr(props, key))
        except Exception:
            out[key] = False
    out["linux"] = sys.platform.startswith("linux")
    return out


def require_pool_ipc(dev: Any) -> None:
    sup = ipc_support(dev)
    missing = [k for k, v in sup.items() if not v]
    if missing:
        raise CudaUnavailable(
            f"cudalink: this GPU/OS cannot share cuda.core IPC memory pools (missing: {', '.join(missing)}); "
            f"pass handles='legacy' (cuIpc handles, also on Windows/WSL) or {NO_GPU_HINT}"
        )


def stream_handle(stream: Any, *, dlpack: bool = False) -> int:
    """Raw CUstream value of a cuda.core Stream, a torch/cupy stream, or an int: the one normalisation.

    ``dlpack=True`` applies DLPack's rules for the ``stream=`` argument of ``__dlpack__``: None is the
    legacy default stream (1), -1 (no synchronisation) passes through, 0 is refused, and errors are
    ``BufferError`` (what DLPack consumers expect). Otherwise a 0 from a framework means its default
    stream, which is the legacy one (1).
    """
    if type(stream) is int and stream > 0:  # what torch and cupy pass to __dlpack__: checked first
        return stream
    if stream is None:
        if dlpack:
            return 1
        raise LinkError("cudalink: no stream")
    if hasattr(stream, "handle") and not isinstance(stream, int):  # a cuda.core Stream
        value, framework = int(stream.handle), False
    elif hasattr(stream, "cuda_stream"):  # torch / cupy stream objects
        value, framework = int(stream.cuda_stream), True
    elif hasattr(stream, "__cuda_stream__"):
        value, framework = int(stream.__cuda_stream__()[1]), True
    elif isinstance(stream, (int, np.integer)):
        value, framework = int(stream), True
    elif dlpack:
        raise BufferError(f"cudalink: stream must be an int stream handle, got {stream!r}")
    else:
        raise LinkError(f"cudalink: {stream!r} is not a stream (pass a cuda.core/torch/cupy stream or an int handle)")
    if dlpack:
        if value == 0:
            raise BufferError("cudalink: DLPack forbids stream=0; pass 1 for the legacy default stream")
        if value < -1:
            raise BufferError(f"cudalink: invalid DLPack stream {value}")
        return value
    return (value or 1) if framework else value


# -- handles this process exported ------------------------------------------------------------------------
#
# CUDA refuses to open an IPC handle in the process that exported it, yet a Receiver may share a process
# with its Sender (notebooks, tests, a TD project with both). Everything we export is registered by its
# handle bytes, and "importing" one of our own handles returns the original object.

_local: dict[bytes, Any] = {}


def register_local(handle: bytes, obj: Any) -> None:
    _local[bytes(handle)] = obj


def unregister_local(handle: bytes) -> None:
    _local.pop(bytes(handle), None)


def local(handle: bytes) -> Any:
    return _local.get(bytes(handle))


# -- events ------------------------------------------------------------------------------------------------


def new_ipc_event(stream: Any) -> Any:
    core = _core()
    ev = stream.record(options=core.EventOptions(ipc_enabled=True))
    register_local(event_handle(ev)[0], ev)
    return ev


def close_ipc_event(ev: Any) -> None:
    unregister_local(event_handle(ev)[0])


def event_handle(ev: Any) -> tuple[bytes, int]:
    """The 64-byte CUipcEventHandle plus its flag, for the header."""
    args = ev.ipc_descriptor.__reduce__()[1]
    return bytes(args[0]), int(bool(args[1]))


def import_event(raw: bytes, flag: int) -> Any:
    from cuda.core import Event
    from cuda.core._event import IPCEventDescriptor

    mine = local(raw)
    if mine is not None:
        return mine
    try:
        return Event.from_ipc_descriptor(IPCEventDescriptor._init(raw, bool(flag)))
    except Exception as exc:
        raise LinkError(f"cudalink: could not open the producer's IPC event: {exc}") from exc


def raw(ev: Any) -> Any:
    """The driver handle of a cuda.core Event, to keep: cuda.core builds a new wrapper per ``.handle``.

    An int where the compiled driver calls are in use, else cuda.bindings' ``CUevent``. Hot paths pass
    only these to :func:`record`, :func:`wait` and :func:`event_done`.
    """
    return int(ev.handle) if _fast is not None else ev.handle


def event_done(h: Any) -> bool:
    """cuEventQuery of a :func:`raw` handle; an event whose owner died (an error) has nothing left to order."""
    return bool(_drv().cuEventQuery(h)[0] != _drv().CUresult.CUDA_ERROR_NOT_READY)


def record(h: Any, stream: int) -> None:
    """cuEventRecord of a :func:`raw` handle, directly: cuda.core refuses to re-record IPC events, and we
    reuse one per slot."""
    err = _drv().cuEventRecord(h, cu_stream(stream))[0]
    if err:
        check((err,), "cuEventRecord")


def wait(stream: int, h: Any) -> None:
    """cuStreamWaitEvent on a :func:`raw` handle: ``stream`` waits on the GPU, the CPU never does."""
    err = _drv().cuStreamWaitEvent(cu_stream(stream), h, 0)[0]
    if err:
        check((err,), "cuStreamWaitEvent")


def _use_fast(mod: Any) -> None:
    """Route the per-frame driver calls to the compiled module (same names, same errors)."""
    global _fast, record, wait, event_done, memcpy_dtod, memcpy_2d_dtod
    if mod is None:
        return
    _fast = mod
    record, wait, event_done = mod.record, mod.wait, mod.done
    memcpy_dtod, memcpy_2d_dtod = mod.memcpy_dtod, mod.memcpy_2d_dtod


def new_event() -> Any:
    """A plain (non-IPC, untimed) CUevent, for ordering streams inside this process."""
    drv = _drv()
    return check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")


def destroy_event(ev: Any) -> None:
    _drv().cuEventDestroy(ev)


def join_streams(target: int, others: list[int], ev: Any = None) -> None:
    """Make ``target`` wait for everything queued on ``others`` (GPU-side), through one reusable event.

    A wait captures the event's most recent record at the time of the call, so re-recording the same
    event for the next stream is safe: hot paths pass an event they keep, and nothing is created or
    destroyed per frame. Without one, a temporary event is made in the current context.
    """
    own = ev is None
    if own:
        ev = new_event()
    h = int(ev) if _fast is not None else ev
    try:
        for s in others:
            if s == target:
                continue
            record(h, s)
            wait(target, h)
    finally:
        if own:
            destroy_event(ev)


# -- slot memory: cuda.core IPC pool, or legacy cuIpc handles ---------------------------------------------


@dataclass
class ExportedSlot:
    ptr: int
    handle: bytes  # 64 bytes
    size: int
    keep: Any


class PoolExporter:
    """Slots from one IPC-enabled DeviceMemoryResource: one fd per pool, 64 plain bytes per buffer."""

    kind = "pool"

    def __init__(self, dev: Any, nslots: int, size: int, stream: Any) -> None:
        core = _core()
        require_pool_ipc(dev)
        gran = 2 << 20
        per = (size + gran - 1) // gran * gran
        opts = core.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=per * nslots + gran)
        self.mr = core.DeviceMemoryResource(dev, opts)
        self.slots: list[ExportedSlot] = []
        for _ in range(nslots):
            buf = self.mr.allocate(size, stream=stream)
            payload, bsize = buf.ipc_descriptor.__reduce__()[1][:2]
            self.slots.append(ExportedSlot(int(buf.handle), bytes(payload), int(bsize), buf))
            register_local(bytes(payload), (int(buf.handle), buf))
        stream.sync()

    def fds(self) -> list[int]:
        return [int(self.mr.allocation_handle.handle)]

    def close(self, stream: Any) -> None:
        for s in self.slots:
            unregister_local(s.handle)
            s.keep.close(stream)
        self.slots.clear()
        stream.sync()
        self.mr.close()


class LegacyExporter:
    """Slots from cuMemAlloc, shared with cuIpcGetMemHandle: no fds, works on Windows and WSL."""

    kind = "legacy"

    def __init__(self, dev: Any, nslots: int, size: int, stream: Any) -> None:
        drv = _drv()
        self.slots = []
        for _ in range(nslots):
            ptr = check(drv.cuMemAlloc(size), "cuMemAlloc")
            h = check(drv.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
            self.slots.append(ExportedSlot(int(ptr), bytes(h.reserved), size, ptr))
            register_local(bytes(h.reserved), (int(ptr), None))

    def fds(self) -> list[int]:
        return []

    def close(self, stream: Any) -> None:
        stream.sync()
        for s in self.slots:
            unregister_local(s.handle)
        free_bounded([s.keep for s in self.slots])
        self.slots.clear()


#: how long a producer's close waits for cuMemFree before it leaks the slots instead
FREE_TIMEOUT = 5.0


def free_bounded(ptrs: list[Any], timeout: float = FREE_TIMEOUT) -> bool:
    """``cuMemFree`` each pointer, giving up after ``timeout`` seconds.

    On Windows ``cuMemFree`` can hang while a crashed peer still maps the allocation; a producer's
    ``close()`` must return anyway. The frees run on a daemon thread (bound to this thread's context);
    if it does not finish in time the memory is leaked until the process exits, with a warning.
    """
    if not ptrs:
        return True
    drv = _drv()
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")

    def run() -> None:
        drv.cuCtxSetCurrent(ctx)
        for ptr in ptrs:
            drv.cuMemFree(ptr)

    worker = threading.Thread(target=run, name="cudalink-free", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        warnings.warn(
            f"cudalink: cuMemFree did not return within {timeout}s (a crashed consumer may still map the "
            f"slots); leaving {len(ptrs)} slot(s) to be freed when this process exits",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


class PoolImporter:
    kind = "pool"

    def __init__(self, dev: Any, fds: list[int]) -> None:
        if not fds:
            raise LinkError("cudalink: the producer sent no pool descriptor")
        self.dev = dev
        self.fds = list(fds)
        self.mr: Any = None

    def _pool(self) -> Any:
        """Map the producer's pool on first use (never for a producer in this same process)."""
        if self.mr is None:
            core = _core()
            try:
                self.mr = core.DeviceMemoryResource.from_allocation_handle(self.dev, self.fds[0])
            except Exception as exc:
                raise LinkError(f"cudalink: could not map the producer's memory pool: {exc}") from exc
            finally:
                self._close_fds()
        return self.mr

    def _close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    def open(self, handle: bytes, size: int, stream: Any) -> tuple[int, Any]:
        from cuda.core import Buffer
        from cuda.core._memory._ipc import IPCBufferDescriptor

        mine = local(handle)
        if mine is not None:
            return int(mine[0]), None
        mr = self._pool()
        try:
            buf = Buffer.from_ipc_descriptor(mr, IPCBufferDescriptor._init(handle, size), stream=stream)
        except Exception as exc:
            raise LinkError(f"cudalink: could not map the producer's slot: {exc}") from exc
        return int(buf.handle), buf

    def close_one(self, keep: Any, stream: Any) -> None:
        if keep is not None:
            keep.close(stream)

    def close(self) -> None:
        self._close_fds()
        if self.mr is not None:
            self.mr.close()


class LegacyImporter:
    kind = "legacy"

    def __init__(self, dev: Any, fds: list[int]) -> None:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def open(self, handle: bytes, size: int, stream: Any) -> tuple[int, Any]:
        mine = local(handle)
        if mine is not None:
            return int(mine[0]), None
        drv = _drv()
        h = drv.CUipcMemHandle()
        h.reserved = handle
        ptr = check(
            drv.cuIpcOpenMemHandle(h, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            "cuIpcOpenMemHandle",
        )
        return int(ptr), ptr

    def close_one(self, keep: Any, stream: Any) -> None:
        if keep is None:
            return
        drv = _drv()
        stream.sync()
        drv.cuIpcCloseMemHandle(keep)

    def close(self) -> None:
        pass
