"""The CUDA driver and cuda.core entry points, events and streams: the one place that loads the CUDA
packages and decides whether the per-frame calls go through the compiled ``cudalink._native.driver``.

Nothing here runs at ``import cudalink``: CUDA is touched the first time a CUDA link, frame or
diagnosis needs it, so a machine with no driver imports cudalink fine and gets a clear
:class:`~cudalink.CudaUnavailable` only when it asks for the GPU.

Callers use module attributes (``driver.record(...)``), never ``from driver import record``: loading the
compiled core rebinds the per-frame functions.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, SupportsInt, cast

import numpy as np

from .. import _native
from ..errors import ArgumentError, CudaError, CudaUnavailable, ExportError, LinkError

if TYPE_CHECKING:
    from .objects import Event, Stream, StridedView, ViewFactory

#: a driver event handle as the per-frame calls take it: an int with the compiled core, else a ``CUevent``
RawEvent = object

NO_GPU_HINT = "use device='cpu' for the host backend (same API, numpy frames)"

_driver_mod: ModuleType | None = None
#: ``cudalink._native.driver`` where it was built and a driver is present: the per-frame driver calls go
#: straight to C, and raw event handles are plain ints. Decided with the first use of cuda.bindings.
_fast: ModuleType | None = None
_core_mod: ModuleType | None = None
_smv: ViewFactory | None = None


NO_CUDA_PACKAGES_DETAIL = (
    "cudalink: the CUDA packages are not installed here (cuda-core, cuda-bindings: pip installs them only "
    "where NVIDIA ships wheels, not on macOS); on a machine with an NVIDIA GPU run "
    "`pip install cuda-core cuda-bindings`"
)


def no_gpu(detail: str, joiner: str = "; ") -> CudaUnavailable:
    """CudaUnavailable for no usable GPU here (no CUDA packages, driver or device), where the way out is the
    host backend: ``detail``, then :data:`NO_GPU_HINT`. What refuses the host backend (cuda-link) swaps that
    advice for its own through ``before_cpu_advice`` (``devices.gpu_only``), never by reading the message."""
    exc = CudaUnavailable(f"{detail}{joiner}{NO_GPU_HINT}")
    exc.before_cpu_advice = detail + joiner
    return exc


def bindings() -> ModuleType:
    """``cuda.bindings.driver``, loaded on first use (a clear error where it is not installed)."""
    global _driver_mod
    if _driver_mod is None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise no_gpu(NO_CUDA_PACKAGES_DETAIL, ", or ") from exc
        _use_fast(_native.load_driver())
        _driver_mod = driver
    return _driver_mod


def core() -> ModuleType:
    """``cuda.core``, loaded on first use."""
    global _core_mod
    if _core_mod is None:
        try:
            import cuda.core
        except ImportError as exc:
            raise no_gpu(NO_CUDA_PACKAGES_DETAIL, ", or ") from exc
        bindings()  # decides the handle representation before any event exists
        _core_mod = cuda.core
    return _core_mod


_UNSET = object()
_any: object = _UNSET


def any_interface() -> Callable[..., StridedView] | None:
    """``StridedMemoryView.from_any_interface`` where this cuda.core has it (its torch fast path), else None."""
    global _any
    if _any is _UNSET:
        _any = getattr(view_class(), "from_any_interface", None)
    return _any if callable(_any) else None


def view_class() -> ViewFactory:
    """cuda.core's ``StridedMemoryView``: the object that speaks DLPack for CUDA frames."""
    global _smv
    if _smv is None:
        core()  # a clear CudaUnavailable where the CUDA packages are missing
        from cuda.core.utils import StridedMemoryView

        _smv = StridedMemoryView
    assert _smv is not None
    return _smv


def check(ret: tuple[Any, ...], what: str) -> Any:
    """Unwrap a cuda.bindings ``(CUresult, *values)`` tuple; a failure is a :class:`CudaError` naming the call."""
    err = ret[0]
    if err:
        raise cuda_error(int(err), what)
    return ret[1] if len(ret) == 2 else ret[1:]


def cuda_error(code: int, what: str) -> CudaError:
    """The one translation of a failed driver call (the compiled driver calls use it too)."""
    try:
        drv = bindings()
        name = drv.cuGetErrorName(drv.CUresult(code))[1].decode()
    except Exception:
        name = f"CUresult {code}"
    return CudaError(f"cudalink: {what} failed with {name}", code, name)


_streams: dict[int, object] = {}


def cu_stream(stream: int) -> object:
    """A cached ``CUstream`` wrapper for a raw handle (building one costs more than the call it feeds)."""
    cs = _streams.get(stream)
    if cs is None:
        if len(_streams) > 1024:
            _streams.clear()
        cs = _streams[stream] = bindings().CUstream(stream)
    return cs


def memcpy_dtod(dst: int, src: int, nbytes: int, stream: int) -> None:
    err = bindings().cuMemcpyDtoDAsync(dst, src, nbytes, cu_stream(stream))[0]
    if err:
        check((err,), "cuMemcpyDtoDAsync")


def memcpy_2d_dtod(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
    """One pitched device-to-device copy (a source with padded rows), still a single driver call."""
    drv = bindings()
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
    drv = bindings()
    check(drv.cuMemcpyHtoDAsync(dst, src, nbytes, drv.CUstream(stream)), "cuMemcpyHtoDAsync")


def memcpy_dtoh(dst: int, src: int, nbytes: int, stream: int) -> None:
    drv = bindings()
    check(drv.cuMemcpyDtoHAsync(dst, src, nbytes, cu_stream(stream)), "cuMemcpyDtoHAsync")


#: the largest stream handle there is: a CUstream is a pointer
_MAX_HANDLE = (1 << 64) - 1


def stream_handle(stream: object, *, dlpack: bool = False) -> int:
    """Raw CUstream value of a cuda.core Stream, a torch/cupy stream, or an int: the one normalisation.

    ``dlpack=True`` applies DLPack's rules for the ``stream=`` argument of ``__dlpack__``: None is the
    legacy default stream (1), -1 (no synchronisation) passes through, 0 is refused, and errors are
    :class:`ExportError`, a ``BufferError`` (what DLPack consumers expect). Otherwise a 0 from a framework
    means its default stream, which is the legacy one (1).
    """
    if type(stream) is int and 0 < stream <= _MAX_HANDLE:  # what torch and cupy pass to __dlpack__: checked first
        return stream
    if stream is None:
        if dlpack:
            return 1
        raise LinkError("cudalink: no stream")
    handle: SupportsInt | None = getattr(stream, "handle", None)
    if handle is not None and not isinstance(stream, int):  # a cuda.core Stream
        value, framework = int(handle), False
    elif hasattr(stream, "cuda_stream"):  # torch / cupy stream objects
        value, framework = int(getattr(stream, "cuda_stream")), True  # noqa: B009 - any stream class
    elif hasattr(stream, "__cuda_stream__"):
        value, framework = int(getattr(stream, "__cuda_stream__")()[1]), True  # noqa: B009
    elif isinstance(stream, (int, np.integer)):
        value, framework = int(stream), True
    elif dlpack:
        raise ExportError(f"cudalink: stream must be an int stream handle, got {stream!r}")
    else:
        raise LinkError(f"cudalink: {stream!r} is not a stream (pass a cuda.core/torch/cupy stream or an int handle)")
    if dlpack:
        if value == 0:
            raise ExportError("cudalink: DLPack forbids stream=0; pass 1 for the legacy default stream")
        if value < -1 or value > _MAX_HANDLE:
            raise ExportError(
                f"cudalink: invalid DLPack stream {value}: pass a stream handle (a 64-bit pointer), 1 or 2 for a "
                "default stream, -1 for no synchronisation, or None"
            )
        return value
    if not 0 <= value <= _MAX_HANDLE:  # the driver's CUstream would raise a bare OverflowError at first use
        raise ArgumentError(
            f"cudalink: {value} is not a CUDA stream handle (a 64-bit pointer); pass a cuda.core/torch/cupy stream, "
            "its int handle, or None"
        )
    return (value or 1) if framework else value


# -- handles this process exported ------------------------------------------------------------------------
#
# CUDA refuses to open an IPC handle in the process that exported it, yet a Receiver may share a process
# with its Sender (notebooks, tests, a TD project with both). Everything we export is registered by its
# handle bytes, and "importing" one of our own handles returns the original object.

_local_events: dict[bytes, Event] = {}
_local_slots: dict[bytes, int] = {}


def register_local_slot(handle: bytes, ptr: int) -> None:
    _local_slots[bytes(handle)] = ptr


def unregister_local_slot(handle: bytes) -> None:
    _local_slots.pop(bytes(handle), None)


def local_slot(handle: bytes) -> int | None:
    """The pointer of a slot this process exported under ``handle``, else None."""
    return _local_slots.get(bytes(handle))


# -- events ------------------------------------------------------------------------------------------------


def new_ipc_event(stream: Stream) -> Event:
    ev = stream.record(options=core().EventOptions(ipc_enabled=True))
    _local_events[event_handle(ev)[0]] = ev
    return ev


def close_ipc_event(ev: Event) -> None:
    _local_events.pop(event_handle(ev)[0], None)


def descriptor_args(desc: object) -> tuple[Any, ...]:
    """The constructor arguments of a cuda.core IPC descriptor: its raw handle bytes and flags.

    Private path: cuda.core 1.x has no public accessor for a descriptor's bytes (it pickles them), so
    ``__reduce__`` is read here and only here; ``tests/test_cuda_contract.py`` fails if that changes.
    """
    reduced = desc.__reduce__()
    assert isinstance(reduced, tuple)
    args: tuple[Any, ...] = reduced[1]
    return args


def event_handle(ev: Event) -> tuple[bytes, int]:
    """The 64-byte CUipcEventHandle plus its flag, for the header."""
    args = descriptor_args(ev.ipc_descriptor)
    return bytes(args[0]), int(bool(args[1]))


def buffer_descriptor(handle: bytes, size: int) -> object:
    """A cuda.core IPC buffer descriptor for a slot's 64-byte handle, as the header carries it.

    Private path, as :func:`descriptor_args`: cuda.core 1.x builds descriptors only by unpickling them. Every
    import from cuda.core's private modules sits in this module (the event's below).
    """
    from cuda.core._memory._ipc import IPCBufferDescriptor

    return IPCBufferDescriptor._init(handle, size)


def import_event(raw: bytes, flag: int) -> Event:
    """Open a producer's IPC event (or return our own, where this process exported it)."""
    from cuda.core import Event as CoreEvent
    from cuda.core._event import IPCEventDescriptor

    mine = _local_events.get(bytes(raw))
    if mine is not None:
        return mine
    try:
        ev: Event = CoreEvent.from_ipc_descriptor(IPCEventDescriptor._init(raw, bool(flag)))
    except Exception as exc:
        raise LinkError(f"cudalink: could not open the producer's IPC event: {exc}") from exc
    return ev


def raw(ev: Event) -> RawEvent:
    """The driver handle of a cuda.core Event, to keep: cuda.core builds a new wrapper per ``.handle``.

    An int where the compiled driver calls are in use, else cuda.bindings' ``CUevent``. Hot paths pass
    only these to :func:`record`, :func:`wait` and :func:`event_done`.
    """
    return int(ev.handle) if _fast is not None else ev.handle


def event_done(h: RawEvent) -> bool:
    """cuEventQuery of a :func:`raw` handle; an event whose owner died (an error) has nothing left to order."""
    drv = bindings()
    return bool(drv.cuEventQuery(h)[0] != drv.CUresult.CUDA_ERROR_NOT_READY)


def record(h: RawEvent, stream: int) -> None:
    """cuEventRecord of a :func:`raw` handle, directly: cuda.core refuses to re-record IPC events, and we
    reuse one per slot."""
    err = bindings().cuEventRecord(h, cu_stream(stream))[0]
    if err:
        check((err,), "cuEventRecord")


def wait(stream: int, h: RawEvent) -> None:
    """cuStreamWaitEvent on a :func:`raw` handle: ``stream`` waits on the GPU, the CPU never does."""
    err = bindings().cuStreamWaitEvent(cu_stream(stream), h, 0)[0]
    if err:
        check((err,), "cuStreamWaitEvent")


def current_context() -> int:
    """cuCtxGetCurrent: the calling thread's current context as an int (0: none)."""
    return int(check(bindings().cuCtxGetCurrent(), "cuCtxGetCurrent"))


def set_context(ctx: int) -> None:
    """cuCtxSetCurrent of a context given as an int (:func:`current_context`)."""
    drv = bindings()
    check(drv.cuCtxSetCurrent(drv.CUcontext(ctx)), "cuCtxSetCurrent")


def _use_fast(mod: ModuleType | None) -> None:
    """Route the per-frame driver calls to the compiled module (same names, same errors)."""
    global _fast, record, wait, event_done, memcpy_dtod, memcpy_2d_dtod, current_context, set_context
    if mod is None:
        return
    _fast = mod
    record, wait, event_done = mod.record, mod.wait, mod.done
    current_context, set_context = mod.current_context, mod.set_context
    memcpy_dtod, memcpy_2d_dtod = mod.memcpy_dtod, mod.memcpy_2d_dtod


def compiled() -> bool:
    """Whether the per-frame driver calls are the compiled ones (decided when cuda.bindings loads)."""
    return _fast is not None


def new_event() -> RawEvent:
    """A plain (non-IPC, untimed) CUevent, for ordering streams inside this process."""
    drv = bindings()
    return check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")


def destroy_event(ev: RawEvent) -> None:
    bindings().cuEventDestroy(ev)


def join_streams(target: int, others: list[int], ev: RawEvent | None = None) -> None:
    """Make ``target`` wait for everything queued on ``others`` (GPU-side), through one reusable event.

    A wait captures the event's most recent record at the time of the call, so re-recording the same
    event for the next stream is safe: hot paths pass an event they keep, and nothing is created or
    destroyed per frame. Without one, a temporary event is made in the current context.
    """
    own = ev is None
    if own:
        ev = new_event()
    h = int(cast(SupportsInt, ev)) if _fast is not None else ev
    try:
        for s in others:
            if s == target:
                continue
            record(h, s)
            wait(target, h)
    finally:
        if own:
            destroy_event(ev)


class CopyGraph:
    """One slot's copy and ready-event record as one CUDA graph (``Sender(send_graph=...)``'s path, off by
    default): per frame, one ``cuGraphLaunch``, and one ``cuGraphExecMemcpyNodeSetParams`` first only when
    the source pointer changed since the last launch. Two driver calls at most, as ``cuMemcpyDtoDAsync`` +
    ``cuEventRecord`` are; one where a producer renders into the same buffer every frame.

    Built lazily per (slot, frame size) in the current context; raises :class:`CudaError` where the driver
    refuses any step (the caller then keeps the plain calls).
    """

    def __init__(self, dst: int, src: int, nbytes: int, event: RawEvent) -> None:
        drv = self._drv = bindings()
        self.nbytes = nbytes
        self._ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        p = self._params = drv.CUDA_MEMCPY3D()
        p.srcMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.srcDevice = src  # the first frame's source; a launch from another source sets it first
        p.dstDevice = dst
        p.srcPitch = p.dstPitch = nbytes
        p.srcHeight = p.dstHeight = 1
        p.WidthInBytes = nbytes
        p.Height = 1
        p.Depth = 1
        self._graph = check(drv.cuGraphCreate(0), "cuGraphCreate")
        self._exec: Any = None
        try:
            self._copy = check(drv.cuGraphAddMemcpyNode(self._graph, None, 0, p, self._ctx), "cuGraphAddMemcpyNode")
            ev = event if isinstance(event, drv.CUevent) else drv.CUevent(int(cast(SupportsInt, event)))
            check(drv.cuGraphAddEventRecordNode(self._graph, [self._copy], 1, ev), "cuGraphAddEventRecordNode")
            self._exec = check(drv.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        except BaseException:
            self.close()
            raise
        self._src = src

    def launch(self, src: int, stream: int) -> None:
        drv = self._drv
        if src != self._src:
            self._params.srcDevice = src
            err = drv.cuGraphExecMemcpyNodeSetParams(self._exec, self._copy, self._params, self._ctx)[0]
            if err:
                check((err,), "cuGraphExecMemcpyNodeSetParams")
            self._src = src
        err = drv.cuGraphLaunch(self._exec, cu_stream(stream))[0]
        if err:
            check((err,), "cuGraphLaunch")

    def close(self) -> None:
        drv = self._drv
        if self._exec is not None:
            drv.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            drv.cuGraphDestroy(self._graph)
            self._graph = None
