"""TD -> link: a TOP's ``cudaMemory()`` as a Frame, and a Sender fed from TOPs."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref
from typing import TYPE_CHECKING, Literal

import numpy as np

from ..cuda import devices, driver
from ..errors import FormatError, LinkError
from ..frames.frame import Frame
from ..frames.spec import FrameSpec
from ..link import Sender
from ..transport.base import Transport
from .formats import CUDAMemoryLike, TOPLike, spec_from_cuda_memory

if TYPE_CHECKING:
    from ..cuda.objects import Stream


class _StreamReady:
    """TD fills ``CUDAMemory`` in order on the stream given to ``cudaMemory``: consumers wait on it."""

    __slots__ = ("stream",)

    def __init__(self, stream: int) -> None:
        self.stream = stream

    def wait(self, stream: int) -> None:
        if stream != self.stream:
            driver.join_streams(stream, [self.stream])

    def cai_stream(self) -> int | None:
        return self.stream


def frame_from_cuda_memory(
    mem: CUDAMemoryLike,
    *,
    stream: object = None,
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
    ordinal = devices.parse_device(device)
    ready = _StreamReady(1 if stream is None else driver.stream_handle(stream))
    return Frame(spec, int(ptr), mem, device=ordinal, seq=seq, timestamp_ns=ts, sync=ready)


def _op_name(op: object) -> str:
    """What TD calls an operator in its messages: its path, else its type."""
    return str(getattr(op, "path", type(op).__name__))


#: how long a send waits, on TD's thread, for a link too small for the TOP to close before it drops the frame
_RETIRE_WAIT_S = 0.005
#: after the link could not be made (its name taken, say), sends fail at once with that error for this long: each
#: attempt waits up to a quarter second on TD's thread for the name's holder to let go
_CREATE_RETRY_S = 1.0

#: every TDSender of this process, to tell a name taken by one of them (a reloaded DAT's) from another process's
_tdsenders: weakref.WeakSet[TDSender] = weakref.WeakSet()


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
        self.device: int | str = "cpu" if device == "cpu" else devices.parse_device(device)
        self.slots = slots
        self.capacity = capacity
        self.policy: Literal["drop", "block"] = policy
        self.max_consumers = max_consumers
        self.handles = handles
        self.transport = transport
        self.sent = 0
        self.dropped = 0
        self._sender: Sender | None = None
        self._stream: Stream | None = None
        self._stream_int: int | None = None
        self._closed = False
        #: a link too small for the TOP, closing on a thread of its own: a consumer in this very process (a
        #: Script TOP) lets its frame go only once TD's thread runs again, so a close here would freeze TD
        self._retiring: threading.Thread | None = None
        #: the last failure to make the link, and when to try again
        self._failed: tuple[float, LinkError] | None = None
        _tdsenders.add(self)

    @property
    def stream(self) -> int | None:
        """Raw stream handle to pass to ``TOP.cudaMemory(stream=...)`` (None on host links)."""
        if self.device == "cpu":
            return None
        if self._stream_int is None:
            assert isinstance(self.device, int)
            self._stream = devices.device(self.device).create_stream()
            self._stream_int = driver.stream_handle(self._stream)
        return self._stream_int

    @property
    def sender(self) -> Sender | None:
        """The underlying link, once the first frame has created it."""
        return self._sender

    def send_top(self, top: TOPLike, *, meta: bytes = b"") -> int | None:
        """``top.cudaMemory()`` on our stream, then :meth:`send`; returns the seq, or None if dropped."""
        stream = self.stream
        read = getattr(top, "cudaMemory", None)
        if read is None:
            raise FormatError(
                f"cudalink: {_op_name(top)!r} is not a TOP (it has no cudaMemory()); point the sender at a TOP"
            )
        mem = read() if stream is None else read(stream=stream)
        if mem is None:
            raise FormatError(
                f"cudalink: {_op_name(top)!r}.cudaMemory() gave nothing: the TOP has no image yet; give it an "
                "input (or send from the next frame on)"
            )
        return self.send(mem, meta=meta)

    def send(self, mem: CUDAMemoryLike, *, meta: bytes = b"") -> int | None:
        """Publish one ``CUDAMemory`` (filled on :attr:`stream`); returns the seq, or None if dropped."""
        if self._closed:
            raise LinkError(f"cudalink: TDSender {self.name!r} is closed; create a new one")
        stream = self.stream
        frame = frame_from_cuda_memory(mem, stream=stream, device=self.device)
        sender = self._sender_for(frame.spec)
        if sender is None:  # the old link is still closing: this frame is dropped, TD goes on
            self.dropped += 1
            return None
        seq = sender.send(frame, stream=stream, meta=meta)
        if seq is None:
            self.dropped += 1
        else:
            self.sent += 1
        return seq

    def _sender_for(self, spec: FrameSpec) -> Sender | None:
        """The link for ``spec``: the current one (reconfigured if need be), or a new one once a link too small
        for it has closed; None while that close is under way (it never blocks TD's thread)."""
        current = self._sender
        if current is not None:
            if current.spec == spec:
                return current
            try:
                current.reconfigure(spec.shape, spec.dtype, pixel_format=spec.pixel_format, origin=spec.origin)
                return current
            except FormatError:  # larger than the slots: a new link, which consumers re-attach to
                self._sender = None
                self._retiring = threading.Thread(target=current.close, name="cudalink-td-retire", daemon=True)
                self._retiring.start()
        retiring = self._retiring
        if retiring is not None:
            retiring.join(_RETIRE_WAIT_S)  # consumers in other processes usually let go at once
            if retiring.is_alive():
                return None
            self._retiring = None
        failed = self._failed
        if failed is not None and time.monotonic() < failed[0]:
            raise copy.copy(failed[1])  # the same cause, without another wait on TD's thread
        try:
            self._sender = self._new_sender(spec)
        except LinkError as exc:
            self._failed = (time.monotonic() + _CREATE_RETRY_S, copy.copy(exc))  # no traceback: it holds TD's memory
            raise
        self._failed = None
        return self._sender

    def _new_sender(self, spec: FrameSpec) -> Sender:
        # TD recompiles an edited DAT into a new module: the old one's TDSender, garbage that only the cycle
        # collector frees (maybe minutes later), still publishes the name. Collect it, then take the name.
        others = [
            weakref.ref(tx) for tx in _tdsenders if tx is not self and tx.name == self.name and tx._sender is not None
        ]
        if others:
            gc.collect()
            if any(ref() is not None for ref in others):
                raise LinkError(
                    f"cudalink: another TDSender of this process publishes {self.name!r} (two Execute DATs with one "
                    "LINK_NAME?); give each export its own link name, or close the other"
                )
        return Sender(
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

    def close(self) -> None:
        """Close the link (consumers get ProducerGone); the stream goes with this object."""
        self._closed = True
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()
        retiring, self._retiring = self._retiring, None
        if retiring is not None:
            retiring.join()

    def __enter__(self) -> TDSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<cudalink.td.TDSender {self.name!r} {self.device} sent={self.sent} dropped={self.dropped}>"
