"""link -> TD: received frames into a Script TOP through ``copyCUDAMemory`` (or ``copyNumpyArray``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from ..cuda import arrays, devices, driver
from ..errors import ArgumentTypeError, LinkError, LinkTimeout, ProducerGone
from ..frames.frame import Frame
from ..link import Receiver
from ..transport.base import Transport
from .convert import _convert_cuda, _convert_host, _DeviceBuffer, _Plan, _sync, _td_default_shape
from .formats import CUDAMemoryShapeLike, Method, ScriptTOPLike, ShapeFactory, Switch, td_format_name

if TYPE_CHECKING:
    from ..cuda.objects import Stream


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
        keep: tuple[object, ...],
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
        self.keep: tuple[object, ...] | None = keep
        self.zero_copy = zero_copy
        self.steps = steps
        self.shape_factory = shape_factory
        self.device = device
        self.seq = seq
        self.submits = 0

    def td_shape(self) -> CUDAMemoryShapeLike:
        """A ``CUDAMemoryShape`` for this upload; ``dataType`` is the numpy scalar type TD insists on."""
        shape = (self.shape_factory or _td_default_shape)()
        shape.width = self.width
        shape.height = self.height
        shape.numComps = self.comps
        shape.dataType = self.dtype.type
        return shape

    def submit(self, script_op: ScriptTOPLike) -> None:
        """Copy into ``script_op`` (again): TD first waits for work queued on our stream."""
        if self.keep is None:
            raise LinkError("cudalink: this upload was released; show a new frame")
        if self.method == "numpy":
            script_op.copyNumpyArray(cast("npt.NDArray[np.generic]", self.keep[-1]))  # the host array is last
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
            driver.memcpy_dtod(buf.ptr, self.ptr, self.nbytes, stream)
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


_default_streams: dict[int, Stream] = {}


def _stream_in(cache: dict[int, Stream], device: int) -> int:
    """Our own non-default stream on ``device``, made once per ``cache`` (module-wide, or a sink's)."""
    stream = cache.get(device)
    if stream is None:
        stream = cache[device] = devices.device(device).create_stream()
    return driver.stream_handle(stream)


def _default_stream(device: int) -> int:
    return _stream_in(_default_streams, device)


def _prepare(
    frame: Frame,
    script_op: ScriptTOPLike,
    *,
    stream: Callable[[int], int],
    flip: Switch,
    swap_rb: Switch,
    shape_factory: ShapeFactory | None,
    array_backend: str | None,
    method: Method,
) -> TopUpload:
    if not isinstance(frame, Frame):
        raise ArgumentTypeError(
            f"cudalink: a Script TOP is shown a cudalink Frame (rx.recv()'s), got {type(frame).__name__}; "
            "wrap an array with cudalink.Frame.from_array(x)"
        )
    if not (hasattr(script_op, "copyCUDAMemory") or hasattr(script_op, "copyNumpyArray")):
        raise ArgumentTypeError(
            f"cudalink: {script_op!r} is not a Script TOP (it has no copyCUDAMemory); pass onCook's scriptOp, "
            "or op('script1') of a Script TOP that exists"
        )
    if method == "auto":
        method = "cuda" if frame.is_cuda or not hasattr(script_op, "copyNumpyArray") else "numpy"
    if method not in ("cuda", "numpy"):
        raise LinkError(f"cudalink: method must be 'auto', 'cuda' or 'numpy', got {method!r}")
    plan = _Plan(frame, flip, swap_rb, method)
    steps = plan.steps(frame)

    def upload(
        ptr: int, nbytes: int, stream: int | None, keep: tuple[object, ...], zero: bool, device: int
    ) -> TopUpload:
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
        info = arrays.describe_array(frame, stream_ptr=s)  # orders s after the frame's producer
        return upload(info.ptr, frame.nbytes, s, (frame, info.owner), True, dev)
    out, ptr, nbytes = _convert_cuda(frame, plan, s, array_backend)
    return upload(ptr, nbytes, s, (out,), False, dev)


def to_script_top(
    frame: Frame,
    script_op: ScriptTOPLike,
    *,
    stream: object = None,
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
        return _default_stream(dev) if stream is None else driver.stream_handle(stream)

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
        stream: object = None,
        shape_factory: ShapeFactory | None = None,
        array_backend: str | None = None,
        method: Method = "auto",
    ) -> None:
        self.shape_factory = shape_factory
        self.array_backend = array_backend
        self.method: Method = method
        self._user_stream = stream
        self._streams: dict[int, Stream] = {}
        self._last: TopUpload | None = None

    @property
    def last(self) -> TopUpload | None:
        return self._last

    def stream_for(self, device: int) -> int:
        """The stream copies for ``device`` are ordered on: the one given, or our own non-default one."""
        if self._user_stream is not None:
            return driver.stream_handle(self._user_stream)
        return _stream_in(self._streams, device)

    def show(
        self, frame: Frame, script_op: ScriptTOPLike, *, flip: Switch = False, swap_rb: Switch = False
    ) -> TopUpload:
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

    def resubmit(self, script_op: ScriptTOPLike) -> bool:
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
        return att.closing()
    except Exception:
        return False


def _report(script_op: ScriptTOPLike, level: str, message: str) -> bool:
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


def sync_top_format(script_op: ScriptTOPLike, width: int, height: int, comps: int, dtype: npt.DTypeLike) -> list[str]:
    """Best effort: set a Script TOP's resolution and pixel format to match the texture it gets.

    TD allocates the Script TOP's texture from those parameters. Only existing parameters that differ
    are touched; the return value lists what could not be set.
    """
    wanted: list[tuple[str, str | int]] = [
        ("outputresolution", "custom"),
        ("resolutionw", width),
        ("resolutionh", height),
    ]
    fmt = td_format_name(dtype, comps)
    failed = []
    pars = getattr(script_op, "par", None)
    if fmt is not None:
        wanted.append(("format", fmt))
    elif getattr(pars, "format", None) is not None:  # said, not silently kept: 3 channels, say
        failed.append(f"format (TD has no {comps}-channel {np.dtype(dtype).name} format; it stays as it is)")
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
        stream: object = None,
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
        #: why the producer refused us (all its consumer places taken, say): shown until the next try
        self._refused: str | None = None
        self._format: tuple[int, int, int, str] | None = None
        self._script_error = False
        #: why the newest frame could not be shown (a dtype TD has no texture for): said on every cook until
        #: a frame is shown, not only on the cook that took it
        self._bad: str | None = None

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
        self._refused = None
        self._bad = None
        try:
            self.sink.detach()
        finally:
            if rx is not None:
                rx.close()

    def _again(self, script_op: ScriptTOPLike) -> None:
        if self.resubmit:
            self.sink.resubmit(script_op)

    def cook(self, script_op: ScriptTOPLike, *, active: bool = True) -> str:
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

    def _cook(self, script_op: ScriptTOPLike, active: bool) -> tuple[str, str | None]:
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
            if self._refused is not None:
                return self._refused, "error"
            return f"cudalink: waiting for a producer on {self.link!r}", "warning"
        try:
            frame = rx.poll()
        except LinkTimeout:
            self._next_try = now + self.retry_s
            self._refused = None
            self._again(script_op)
            return f"cudalink: waiting for a producer on {self.link!r}", "warning"
        except ProducerGone:
            self.sink.detach()
            self._again(script_op)
            shown = "; showing its last frame until" if self.sink.last is not None else " before a frame; waiting till"
            return f"cudalink: the producer of {self.link!r} left{shown} a new one starts", "warning"
        except LinkError as exc:
            if rx.connected:
                raise
            # refused as it attached (its consumer places all taken, say): that costs TD's thread an attach,
            # so it is asked again every retry_s, as while no producer is there, not on every cook
            self._next_try = now + self.retry_s
            self._refused = _message(exc)
            raise
        self._refused = None
        if frame is None:
            self._again(script_op)
            if self._bad is not None:  # the newest frame is one TD cannot take: said until one it can comes
                return self._bad, "error"
            if closing:
                shown = "showing its last frame" if self.sink.last is not None else "it sent no frame"
                return f"cudalink: the producer of {self.link!r} is closing; {shown}", "warning"
            if self.sink.last is None:
                return f"cudalink: connected to {self.link!r}; no frame yet", "warning"
            return f"showing frame {self.sink.last.seq} (no new frame)", None
        warning = None
        try:
            if self.match_format:
                warning = self._match_format(script_op, frame)
            upload = self.sink.show(frame, script_op, flip=self.flip, swap_rb=self.swap_rb)
        except LinkError as exc:
            self._bad = _message(exc)
            raise
        self._bad = None
        del frame  # a zero-copy upload holds it; a converted one lets the producer have its slot back now
        if closing:
            self.sink.detach()
        self.frames += 1
        if warning:
            return warning, "warning"
        return f"frame {upload.seq}: {upload!r}", None

    def _match_format(self, script_op: ScriptTOPLike, frame: Frame) -> str | None:
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
