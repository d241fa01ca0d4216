"""Slot memory for each backend, behind one small interface the link uses.

The link (``cudalink.link``) runs the ring protocol; a backend only says where slot ``i`` lives,
how data gets in, and how readiness and release are ordered (nothing, for host memory; IPC events
on the GPU). Host and CUDA links therefore share every line of protocol code.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt

from . import _platform, _trace
from .cuda import arrays, devices, driver, memory
from .errors import ArgumentError, FormatError, LinkError, ProducerGone, ProtocolError
from .frames.frame import Frame, FrameSync, HostViews, _Hold
from .frames.spec import FrameSpec
from .transport import wire
from .transport.base import Client, Region

if TYPE_CHECKING:
    from ._native.dlpack import Exporter
    from .cuda.driver import RawEvent
    from .cuda.objects import Event, Stream

SLOT_ALIGN = 4096
#: what a consumer requires of a host slot's offset: the largest itemsize, so every dtype's view is aligned
HOST_SLOT_ALIGN = 16
#: a CUDA slot's memory may be rounded up (to the pool's granularity), never beyond this
MAX_SLOT_BYTES = 1 << 41

#: send()'s GPU work (the copy into the slot and its ready event) as one CUDA graph launch per frame
#: (:class:`cudalink.cuda.driver.CopyGraph`) instead of ``cuMemcpyDtoDAsync`` + ``cuEventRecord``. Off: an
#: experiment the bench compares in one run (``wait_block_graph``); read at each copy, so it can be flipped
#: at any time. ``CUDALINK_SEND_GRAPH=1`` turns it on at import. Pitched (padded-row) sources never use it.
SEND_GRAPH = os.environ.get("CUDALINK_SEND_GRAPH", "") == "1"


def align(n: int, a: int = SLOT_ALIGN) -> int:
    return (n + a - 1) // a * a


# ======================================================================================= the interface


class ProducerSlots(Protocol):
    """Where a producer's slots live and how a frame gets in: host memory or the GPU."""

    backend: int  #: wire.BACKEND_*
    device: int  #: CUDA ordinal, -1 for host
    device_uuid: bytes
    data_size: int  #: bytes of the transport's host data region this backend needs (0 on the GPU)
    stream_int: int
    #: a closing producer waits (up to its timeout) for consumers to unmap before it frees the slots: the
    #: driver's rule for GPU memory. A host consumer's mapping outlives the producer's, so none is waited for.
    unmap_first: bool

    @property
    def stream(self) -> Stream | None:
        """The link's own CUDA stream, None for host slots."""

    def bind(self, region: Region | None) -> None: ...
    def handles(self) -> list[wire.SlotHandle]: ...
    def fds(self) -> list[int]: ...
    def source(self, spec: FrameSpec, src: object, stream: object) -> object:
        """Refuse a source that cannot go into these slots (:class:`FormatError`), before any slot is claimed.

        What it returns is what ``copy_in`` reads: the checks are not repeated per slot.
        """
        ...

    def copy_in(
        self, slot: int, spec: FrameSpec, src: object, stream: object, fences: list[RawEvent], checked: object
    ) -> None: ...
    def writable_frame(self, slot: int, spec: FrameSpec, seq: int, ts: int, fences: list[RawEvent]) -> Frame: ...
    def commit(self, slot: int, streams: list[int], stream: object) -> None: ...
    def settle(self) -> None:
        """Wait (CPU-side) until every published frame's copy has run: what a closing producer does before
        it hangs up, so consumers may read its last frames without its events."""
        ...

    def close(self, timeout: float) -> None: ...


class SlotParts(NamedTuple):
    """One slot as a consumer's frames see it, made once per (slot, spec) instead of once per frame."""

    spec: FrameSpec
    ptr: int
    owner: object  # what a frame's hold keeps alive: the mapping
    sync: FrameSync | None  # CUDA: waits on the slot's ready event
    host: HostViews | None  # host: the slot viewed as ``spec``
    export: Exporter | None  # the slot's DLPack capsule maker (compiled core), else None


class ConsumerView(Protocol):
    """A consumer's side of one producer generation's slots: frames out, release fences back."""

    device: int

    def check(self, handles: list[wire.SlotHandle], capacity: int) -> None:
        """Refuse (:class:`ProtocolError`) slot handles whose memory could not hold ``capacity`` bytes each.

        Run once per attach (each producer generation), so a frame's spec, already checked against
        ``capacity``, always fits the memory it is viewed on."""
        ...

    def setup(self, header: memoryview, layout: wire.Layout, index: int) -> None: ...
    def slot(self, slot: int, handle: wire.SlotHandle, spec: FrameSpec) -> SlotParts:
        """What every frame of ``slot`` with ``spec`` shares; the caller keeps it per (slot, spec)."""
        ...

    def fence(self, slot: int, streams: list[int]) -> bool: ...
    def close(self) -> None: ...


# ======================================================================================= producer side


def host_stream() -> ArgumentError:
    """``stream=`` on a CPU link: it orders a CUDA copy, and a host copy is done when ``send()`` returns. Refused
    rather than ignored: a program passing one most likely meant to make a CUDA link."""
    return ArgumentError(
        "cudalink: stream= orders the copy on a CUDA link; this link carries CPU frames, copied before send() "
        "returns: drop stream=, or create the Sender with device=0 for CUDA frames"
    )


class HostSlots:
    """Slots in the transport's shared data region."""

    backend = wire.BACKEND_HOST
    unmap_first = False
    device = -1
    device_uuid = b"\0" * 16
    stream = None
    stream_int = 0

    def __init__(self, nslots: int, capacity: int) -> None:
        self.nslots = nslots
        self.stride = align(capacity)
        self.data_size = self.stride * nslots
        self._region: Region | None = None
        self._views: dict[tuple[int, int], tuple[FrameSpec, npt.NDArray[np.generic]]] = {}

    def bind(self, region: Region | None) -> None:
        self._region = region

    def _bound(self) -> Region:
        if self._region is None:
            raise LinkError("cudalink: host slots used before the transport gave them a data region")
        return self._region

    def handles(self) -> list[wire.SlotHandle]:
        return [wire.SlotHandle(b"", i * self.stride, b"", 0) for i in range(self.nslots)]

    def fds(self) -> list[int]:
        return []

    def _array(self, slot: int, spec: FrameSpec) -> npt.NDArray[np.generic]:
        """A numpy view of ``slot`` for ``spec``, built once per (slot, spec)."""
        key = (slot, id(spec))  # by identity (hashing a spec costs more than the lookup saves)
        got = self._views.get(key)
        if got is None or got[0] is not spec:
            if len(self._views) > 4 * self.nslots:
                self._views.clear()
            view: npt.NDArray[np.generic] = np.ndarray(
                spec.shape, spec.dtype, buffer=self._bound().buf, offset=slot * self.stride, strides=spec.strides
            )
            got = self._views[key] = (spec, view)
        return got[1]

    def source(self, spec: FrameSpec, src: object, stream: object) -> npt.NDArray[np.generic]:
        if stream is not None:
            raise host_stream()
        if type(src) is np.ndarray and src.shape == spec.shape and src.dtype == spec.dtype:
            arr: npt.NDArray[np.generic] = src  # the common case, without describing the array
        else:
            info = arrays.describe_array(src)
            if info.device_id >= 0:
                raise FormatError(
                    "cudalink: this link carries CPU frames but got a CUDA array; send x.cpu()/cupy.asnumpy(x), "
                    "or create the Sender with device=0"
                )
            spec.check_array(info.shape, info.dtype)
            arr = cast("npt.NDArray[np.generic]", info.owner)  # host_info's owner is the ndarray
        if _trace.ON:
            _trace.mark(_trace.SOURCE_READ)
        return arr

    def copy_in(
        self, slot: int, spec: FrameSpec, src: object, stream: object, fences: list[RawEvent], checked: object
    ) -> None:
        np.copyto(self._array(slot, spec), cast("npt.NDArray[np.generic]", checked), casting="no")
        if _trace.ON:
            _trace.mark(_trace.COPY_QUEUED)

    def copy_split(self, slot: int, spec: FrameSpec, src: object, cut: int, between: Callable[[], None]) -> None:
        """``copy_in`` in two parts, ``between()`` called after the first ``cut`` bytes (before all of them
        where ``cut`` <= 0, or where the arrays are not both compact)."""
        dst = self._array(slot, spec)
        arr = cast("npt.NDArray[np.generic]", src)
        if cut <= 0 or cut >= spec.nbytes or not (arr.flags.c_contiguous and dst.flags.c_contiguous):
            between()
            self.copy_in(slot, spec, arr, None, [], arr)
            return
        d = dst.reshape(-1).view(np.uint8)
        s = arr.reshape(-1).view(np.uint8)
        d[:cut] = s[:cut]
        between()
        d[cut:] = s[cut:]
        if _trace.ON:
            _trace.mark(_trace.COPY_QUEUED)

    def writable_frame(self, slot: int, spec: FrameSpec, seq: int, ts: int, fences: list[RawEvent]) -> Frame:
        region = self._bound()
        hold = _Hold(region, region.address + slot * self.stride)
        return Frame._received(spec, hold, -1, seq, ts, b"", None, 0, writable=True)

    def commit(self, slot: int, streams: list[int], stream: object) -> None:
        pass

    def settle(self) -> None:
        pass  # a host copy is done when send() returns

    def close(self, timeout: float) -> None:
        pass


class _ProducerSync:
    """A reserved slot's frame: whoever writes it must first wait on the consumers' release fences."""

    def __init__(self, fences: list[RawEvent]) -> None:
        self.fences = fences

    def wait(self, stream: int) -> None:
        for ev in self.fences:
            driver.wait(stream, ev)

    def cai_stream(self) -> int | None:
        return None


def _row_pitch(spec: FrameSpec, strides: tuple[int, ...] | None) -> int:
    """0 for a source laid out like the slot (one flat copy); else the source's row pitch for a 2-D copy.

    A source whose rows are padded (a crop, a pitched texture) but whose rows are themselves laid out
    like the slot's is copied with one ``cuMemcpy2DAsync``; anything else is refused by name.
    """
    if strides is None or strides == spec.byte_strides:
        return 0
    rows_like_slot = spec.strides is None and len(strides) >= 2 and strides[1:] == spec.byte_strides[1:]
    if rows_like_slot and strides[0] >= spec.byte_strides[0]:
        return strides[0]
    raise FormatError(
        f"cudalink: array strides {strides} cannot be copied into the link's {spec.shape} {spec.dtype.name} frames "
        "with one copy (only padded rows can); call .contiguous() (torch) or cupy.ascontiguousarray first"
    )


class _Source(NamedTuple):
    """A checked source of a CUDA send: its description, row pitch (0: one flat copy) and the stream its
    copy goes on (``own``: the framework's current stream, which a pending release fence changes)."""

    info: arrays.ArrayInfo
    pitch: int
    stream: int
    own: bool


class CudaSlots:
    """Slots on the GPU: a cuda.core IPC pool (or legacy cuIpc handles), one IPC ready-event per slot."""

    data_size = 0
    unmap_first = True

    def __init__(self, ordinal: int, nslots: int, capacity: int, handles: str) -> None:
        # made in this GPU's context; the caller's current GPU stays theirs (a thread with none keeps ours)
        with devices.keep_current():
            self.dev = devices.device(ordinal)
            self.device = ordinal
            self.ctx = devices.primary_context(ordinal)  # where DLPack's default streams (1, 2) are this GPU's
            self.device_uuid = devices.uuid_of(self.dev)
            self.stream = self.dev.create_stream()
            self.stream_int = driver.stream_handle(self.stream)
            self.nslots = nslots
            exporter = memory.LegacyExporter if handles == "legacy" else memory.PoolExporter
            self.mem = exporter(self.dev, nslots, capacity, self.stream)
            self.backend = wire.BACKEND_CUDA_LEGACY if handles == "legacy" else wire.BACKEND_CUDA_POOL
            self.ready = [driver.new_ipc_event(self.stream) for _ in range(nslots)]
            self._ready_raw = [driver.raw(ev) for ev in self.ready]
            # While the GPU is behind, ready events go on a stream of ours instead of the copy's: see _mark_ready
            self.ready_stream = self.dev.create_stream()
            self._ready_s = driver.stream_handle(self.ready_stream)
            self._last = -1  # the slot of the newest ready event
            self._copied = driver.new_event()
            self._ptrs = [s.ptr for s in self.mem.slots]
            self._want_spec: FrameSpec | None = None  # the spec ``_want`` was built for
            self._want: arrays.SourceWant | None = None
            self._sources: list[object] = [None] * nslots  # what each slot's pending copy reads from
            self._join: RawEvent | None = None
            self._tls = threading.local()
            self._graphs: list[driver.CopyGraph | None] = [None] * nslots  # SEND_GRAPH's, per slot, lazily
            #: why SEND_GRAPH fell back to the plain calls for good on this link (the driver refused a graph)
            self.graph_error = ""

    def bind(self, region: Region | None) -> None:
        pass

    def handles(self) -> list[wire.SlotHandle]:
        out = []
        for s, ev in zip(self.mem.slots, self.ready, strict=False):
            raw, flag = driver.event_handle(ev)
            out.append(wire.SlotHandle(s.handle, s.size, raw, flag))
        return out

    def fds(self) -> list[int]:
        return self.mem.fds()

    def _stream(self, stream: object) -> int:
        return self.stream_int if stream is None else driver.stream_handle(stream)

    def _current(self) -> None:
        """Give a thread with no CUDA context ours, once per thread (send_async and TD callbacks run on other
        threads); a user's current GPU is never moved (``copy_in`` runs in ours where another one is current)."""
        if getattr(self._tls, "ok", False) is False:
            if not devices.has_current():
                self.dev.set_current()
            self._tls.ok = True

    def source(self, spec: FrameSpec, src: object, stream: object) -> object:
        """Read and check ``src`` before a slot is claimed: a ``(pointer, stream)`` pair for the one-pass read
        (a compact array of the link's spec on its framework's current stream), else a :class:`_Source`.

        Reading it here orders it once: a source read with a stream (DLPack/CAI ``stream=``) is read with the
        stream its copy goes on, so ``copy_in`` reads it again only in the rare case a release fence moves a
        copy off the source's own stream.
        """
        if not getattr(self._tls, "ok", False):  # _current(), inlined: this runs once per frame
            self._current()
        own: int | None = None
        if stream is None:
            want = self._want
            if want is None or spec is not self._want_spec:  # built once per spec
                want = self._want = arrays.source_want(spec, self.device)
                self._want_spec = spec
            fast = arrays.fast_source(src, want)
            if fast is not None:
                if _trace.ON:
                    _trace.mark(_trace.SOURCE_READ)
                return fast
            own = arrays.current_stream_of(src)
            s = self.stream_int if own is None else own
            order = s if own is None else -1  # on the source's own stream there is nothing to order
        else:
            s = order = driver.stream_handle(stream)
        info = arrays.describe_array(src, stream_ptr=order)
        if _trace.ON:
            _trace.mark(_trace.SOURCE_READ)
        return _Source(info, self._checked_pitch(spec, info), s, own is not None)

    def _checked_pitch(self, spec: FrameSpec, info: arrays.ArrayInfo) -> int:
        if info.shape != spec.shape or info.dtype != spec.dtype:
            spec.check_array(info.shape, info.dtype)
        if info.device_id != self.device:
            if info.device_id < 0:
                raise FormatError(
                    f"cudalink: this link carries frames on cuda:{self.device} but got a host array; move it to "
                    f"the GPU first (torch: x.cuda(); cupy: cupy.asarray(x)), or use a device='cpu' link"
                )
            raise FormatError(f"cudalink: array is on cuda:{info.device_id}, the link on cuda:{self.device}")
        return _row_pitch(spec, info.strides)

    def copy_in(
        self, slot: int, spec: FrameSpec, src: object, stream: object, fences: list[RawEvent], checked: object
    ) -> None:
        """One copy into ``slot`` and the slot's ready event, queued without blocking the CPU.

        With no ``stream`` the copy goes on the source's own stream where the framework names it cheaply
        (torch's current stream): it is then ordered after the source's producer for free. Only when a
        consumer's release fence is still pending does it go on the link's stream instead, so that waiting
        for a slow consumer never stalls the caller's own stream. ``checked`` is what :meth:`source` made.
        """
        if driver.current_context() != self.ctx:
            # Another GPU is current (the user's): the driver queues a copy only on a stream of the current
            # context (else CUDA_ERROR_INVALID_VALUE), and reads a default stream (torch's, say: 1) as the
            # current context's, where the copy would not follow the source's producer on this GPU. So this
            # frame's calls run in this GPU's context, and the caller's comes back.
            devices.in_context(self.ctx, self.copy_in, slot, spec, src, stream, fences, checked)
            return
        got: _Source | None
        if type(checked) is _Source:
            got = None if fences and checked.own else checked
        else:  # the one-pass read's (pointer, stream) of a compact array on its own stream
            if not fences:
                if _trace.ON:
                    _trace.mark(_trace.FENCES_WAITED)
                fast = cast("tuple[int, int]", checked)
                self._copy(slot, spec, fast[0], 0, fast[1], src)
                return
            got = None
        if got is None:  # a fence moves the copy to the link's stream: read the source again, ordered there
            info = arrays.describe_array(src, stream_ptr=self.stream_int)
            got = _Source(info, self._checked_pitch(spec, info), self.stream_int, False)
        s = got.stream
        for ev in fences:
            driver.wait(s, ev)
        if _trace.ON:
            _trace.mark(_trace.FENCES_WAITED)
        self._copy(slot, spec, got.info.ptr, got.pitch, s, got.info.owner)

    def _copy(self, slot: int, spec: FrameSpec, src: int, pitch: int, s: int, owner: object) -> None:
        """The tail both paths share: one copy into the slot, its ready event, the source kept alive."""
        self._settle(slot)
        dst = self._ptrs[slot]
        if pitch == 0 and SEND_GRAPH and not self.graph_error and self._graph_copy(slot, dst, src, spec.nbytes, s):
            self._last = slot  # its record is on ``s``: the next _mark_ready asks whether it fired
            self._sources[slot] = owner
            return
        if pitch == 0:
            driver.memcpy_dtod(dst, src, spec.nbytes, s)
        else:
            row = spec.byte_strides[0]
            driver.memcpy_2d_dtod(dst, row, src, pitch, row, spec.shape[0], s)
        if _trace.ON:
            _trace.mark(_trace.COPY_QUEUED)
        self._mark_ready(slot, s)
        if _trace.ON:
            _trace.mark(_trace.EVENT_RECORDED)
        self._sources[slot] = owner  # keep the source alive until the copy has run

    def _mark_ready(self, slot: int, s: int) -> None:
        """Record ``slot``'s ready event after the work queued on ``s``: on ``s`` while the GPU keeps up,
        on our ready stream while it is behind.

        An IPC event's record costs ~2 us of GPU time on its stream, where a plain event's costs none. Where
        frames queue up (the previous ready event has not fired yet), that time delays every later frame:
        there a plain event on ``s``, a wait of our stream on it and the IPC record on our stream take it
        off ``s`` (H200, 2026-11-26, 1080p float32: 32 sends back to back took 18.2 us a frame, as bare
        copies did, against 20.3 with every record on ``s``). Where the GPU keeps up, that hop only adds
        latency: with every record off ``s``, a consumer's kernel started ~3 us later under MPS (the
        bench's GPU-clock rows, 20.8 against 18.1 us), so there the record stays on ``s``.
        """
        last = self._last
        self._last = slot
        ready = self._ready_raw
        if last < 0 or driver.event_done(ready[last]):
            driver.record(ready[slot], s)
            return
        copied = self._copied
        driver.record(copied, s)
        driver.wait(self._ready_s, copied)
        driver.record(ready[slot], self._ready_s)

    def _graph_copy(self, slot: int, dst: int, src: int, nbytes: int, s: int) -> bool:
        """SEND_GRAPH: the copy and the ready event as one graph launch; False (and plain calls from now on)
        where the driver refuses to build one."""
        graph = self._graphs[slot]
        if graph is None or graph.nbytes != nbytes:
            if graph is not None:
                graph.close()
                self._graphs[slot] = None
            try:
                graph = self._graphs[slot] = driver.CopyGraph(dst, src, nbytes, self._ready_raw[slot])
            except LinkError as exc:
                self.graph_error = str(exc)
                return False
        try:
            graph.launch(src, s)
        except LinkError as exc:  # nothing was queued: this frame and every later one take the plain calls
            self.graph_error = str(exc)
            return False
        if _trace.ON:
            _trace.mark(_trace.COPY_QUEUED)
            _trace.mark(_trace.EVENT_RECORDED)
        return True

    def _settle(self, slot: int) -> None:
        """Before re-arming a slot's event, the previous copy out of a user's array must have finished."""
        if self._sources[slot] is not None:
            if not driver.event_done(self._ready_raw[slot]):  # a compiled query, not cuda.core's property
                self.ready[slot].sync()
            self._sources[slot] = None

    def writable_frame(self, slot: int, spec: FrameSpec, seq: int, ts: int, fences: list[RawEvent]) -> Frame:
        self._settle(slot)
        hold = _Hold(self.mem, self.mem.slots[slot].ptr)  # the pool keeps the slots mapped until the Sender closes
        sync = _ProducerSync(fences) if fences else None  # no fence pending: nothing to order a writer after
        return Frame._received(spec, hold, self.device, seq, ts, b"", sync, 0, writable=True)

    def commit(self, slot: int, streams: list[int], stream: object) -> None:
        if driver.current_context() != self.ctx:
            devices.in_context(self.ctx, self.commit, slot, streams, stream)  # another GPU current: see copy_in
            return
        s = self._stream(stream)
        if any(x != s for x in streams):
            if self._join is None:
                self._join = driver.new_event()
            driver.join_streams(s, streams, self._join)
        self._mark_ready(slot, s)

    def settle(self) -> None:
        with devices.keep_current():
            self.dev.set_current()
            self.stream.sync()
            self.ready_stream.sync()
            for ev in self.ready:  # a slot's last copy may sit on the caller's stream: its ready event says when
                ev.sync()

    def close(self, timeout: float) -> None:
        self.settle()
        with devices.keep_current():  # the caller's current device stays theirs, as in settle()
            self.dev.set_current()
            self._sources = [None] * self.nslots
            for graph in self._graphs:
                if graph is not None:
                    graph.close()
            self._graphs = [None] * self.nslots
            for ev in self.ready:
                driver.close_ipc_event(ev)
            if self._join is not None:
                driver.destroy_event(self._join)
                self._join = None
            driver.destroy_event(self._copied)
            self.ready_stream.close()
            self.mem.close(self.stream)


# ======================================================================================= consumer side


class _Mapped:
    """A region as numpy's array interface, flagged writable whatever its mapping: see ``HostView``."""

    __slots__ = ("__array_interface__", "region")

    def __init__(self, region: Region) -> None:
        self.region = region  # the arrays' base: keeps the mapping
        size = len(region.buf)
        self.__array_interface__ = {"version": 3, "shape": (size,), "typestr": "|u1", "data": (region.address, False)}


class HostView:
    device = -1

    def __init__(self, fixed: wire.Fixed, client: Client, fds: list[int]) -> None:
        for fd in fds:  # a host link needs none: any a producer passed (a bug, or a lie) must not stay open
            os.close(fd)
        client.map_data(fixed.generation, fixed.data_size)
        region = client.data_segment
        if region is None:
            raise LinkError("cudalink: the transport mapped no data region for a host link")
        self.region: Region = region
        # the slots as numpy sees them, flagged writable although a consumer maps them PROT_READ (shm's
        # _ReadOnly): a legacy DLPack capsule cannot say read-only, and numpy refuses to export a read-only array
        # into one, so it is exported writable, as on a read-write mapping (a write through it faults)
        self._bytes: npt.NDArray[np.uint8] = np.asarray(_Mapped(region))

    def check(self, handles: list[wire.SlotHandle], capacity: int) -> None:
        size = len(self.region.buf)
        for i, h in enumerate(handles):
            off = h.size  # a host slot's handle carries its offset in the region
            if off % HOST_SLOT_ALIGN or off + capacity > size:
                raise ProtocolError(
                    f"cudalink: slot {i} of the host link says it lies at offset {off}, which does not hold "
                    f"{capacity}-byte slots {HOST_SLOT_ALIGN}-aligned in the {size}-byte data segment: the header is "
                    "corrupt; restart the producer"
                )

    def setup(self, header: memoryview, layout: wire.Layout, index: int) -> None:
        pass

    def slot(self, slot: int, handle: wire.SlotHandle, spec: FrameSpec) -> SlotParts:
        offset = handle.size  # a host slot's handle carries its offset in the region
        arr = np.ndarray(spec.shape, spec.dtype, self._bytes, offset, spec.strides)
        ro = arr.view()
        ro.flags.writeable = False
        ptr = self.region.address + offset
        return SlotParts(spec, ptr, self.region, None, (arr, ro), arrays.dlpack_exporter(ptr, spec, -1))

    def fence(self, slot: int, streams: list[int]) -> bool:
        return False

    def close(self) -> None:
        pass


class _ConsumerSync:
    """One per imported slot, made once: a frame's consumer stream waits on the slot's ready event."""

    __slots__ = ("raw", "ready", "view")

    def __init__(self, view: CudaView, ready: Event) -> None:
        self.view = view
        self.ready = ready
        self.raw = driver.raw(ready)

    def wait(self, stream: int) -> None:
        if self.view.producer_live():
            driver.wait(stream, self.raw)

    def cai_stream(self) -> int | None:
        if self.view.producer_live():
            driver.wait(self.view.stream_int, self.raw)
        return self.view.stream_int


def _dead_ready() -> ProducerGone:
    """A frame whose producer process died: its ready event went with it, so whether the producer's copy
    into the slot finished is unknown, and CUDA calls any use of an imported event after its exporter freed
    it undefined (cuIpcOpenEventHandle's documentation)."""
    return ProducerGone(
        "cudalink: the producer of this frame died before it was read, and its ready event went with it: the "
        "frame may be incomplete. Drop it and recv() again to wait for a new producer"
    )


class CudaView:
    """The consumer's imports: the pool (once), each slot buffer and ready event (once, lazily)."""

    def __init__(self, fixed: wire.Fixed, client: Client, fds: list[int]) -> None:
        self.dev = devices.device_by_uuid(fixed.device_uuid, fixed.device)
        self.device = int(self.dev.device_id)
        self.ctx = devices.primary_context(self.device)  # where DLPack's default streams (1, 2) are this GPU's
        self.stream = self.dev.create_stream()
        self.stream_int = driver.stream_handle(self.stream)
        importer = memory.LegacyImporter if fixed.backend == wire.BACKEND_CUDA_LEGACY else memory.PoolImporter
        self.mem = importer(self.dev, fds)
        self.client = client  # whether the producer's process is still there, before a wait on its events
        n = fixed.nslots
        #: per slot, once imported: (device pointer, owner tuple for the frames' holds, sync object)
        self._slots: list[tuple[int, tuple[CudaView, object], _ConsumerSync] | None] = [None] * n
        self._bufs: list[tuple[int, object] | None] = [None] * n
        self.release_events: list[Event] = []
        self._release_raw: list[RawEvent] = []
        self._join: RawEvent | None = None  # one plain event, re-recorded per joined stream
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._closed = False

    def producer_live(self) -> bool:
        """True while the producer's process holds its end (its events exist: wait on them). After it hung
        up: False if it closed cleanly (it settled every frame first: nothing left to wait for), else
        ProducerGone, since a killed producer's last copy may not have run."""
        if not self.client.hung_up():
            return True
        try:
            flags = wire.read_u32(self.client.header, wire.OFF_FLAGS)
        except (ValueError, TypeError):  # the header is unmapped: we left the link
            flags = 0
        if flags & wire.FLAG_SHUTDOWN:
            return False
        raise _dead_ready()

    def check(self, handles: list[wire.SlotHandle], capacity: int) -> None:
        for i, h in enumerate(handles):
            if h.size < capacity or h.size > MAX_SLOT_BYTES:
                raise ProtocolError(
                    f"cudalink: slot {i} of the CUDA link says it is {h.size} bytes, but slots hold {capacity}: "
                    "the header is corrupt; restart the producer"
                )

    def setup(self, header: memoryview, layout: wire.Layout, index: int) -> None:
        """Create this consumer's per-slot release events and publish their handles for the producer."""
        with devices.keep_current():  # in the producer GPU's context, where they are recorded
            self.dev.set_current()
            self.release_events = [driver.new_ipc_event(self.stream) for _ in range(layout.nslots)]
        self._release_raw = [driver.raw(ev) for ev in self.release_events]
        for slot, ev in enumerate(self.release_events):
            raw, flag = driver.event_handle(ev)
            wire.RELEASE.pack_into(header, layout.release_handle(index, slot), raw, flag)

    def _import(self, slot: int, handle: wire.SlotHandle) -> tuple[int, tuple[CudaView, object], _ConsumerSync]:
        with self._lock:
            got = self._slots[slot]
            if got is None:
                # opened in the producer GPU's context, whatever the caller's current device is: an IPC event
                # opened while another GPU was current (a consumer on GPU 1) crashed cuStreamWaitEvent later
                with devices.keep_current():
                    self.dev.set_current()
                    ptr, keep = self.mem.open(handle.memory, handle.size, self.stream)
                    ready = driver.import_event(handle.event, handle.event_flags)
                self._bufs[slot] = (ptr, keep)
                got = (ptr, (self, keep), _ConsumerSync(self, ready))
                self._slots[slot] = got
            return got

    def slot(self, slot: int, handle: wire.SlotHandle, spec: FrameSpec) -> SlotParts:
        got = self._slots[slot]
        if got is None:
            got = self._import(slot, handle)
        ptr, owner, sync = got
        return SlotParts(spec, ptr, owner, sync, None, arrays.dlpack_exporter(ptr, spec, self.device))

    def allow_peer(self, ordinal: int, probe: bytes) -> bool:
        """Let GPU ``ordinal`` of this process read the producer's slots directly (a consumer on another GPU).

        ``probe``: one slot's handle; a producer in this very process shares its own memory, nothing to map.
        """
        if driver.local_slot(probe) is not None:
            return True
        with devices.keep_current():
            return self.mem.allow(ordinal)

    def fence(self, slot: int, streams: list[int]) -> bool:
        """Record this slot's release event after the work the consumer queued on every stream it used."""
        if not streams or self._closed:
            return False
        if not getattr(self._tls, "current", False):  # releases run on whichever thread drops the frame
            if not devices.has_current():  # a thread with no context gets ours; never move a user's device
                self.dev.set_current()
            self._tls.current = True
        # a default stream among them is this GPU's, whatever the releasing thread has current; the release
        # event, made in this GPU's context, is recorded there
        devices.on_stream(self.ctx, min(streams), self._fence, slot, streams)
        return True

    def _fence(self, slot: int, streams: list[int]) -> None:
        target = streams[0]
        if len(streams) > 1:
            if self._join is None:
                with devices.keep_current():  # made in the producer GPU's context, where it is recorded
                    self.dev.set_current()
                    self._join = driver.new_event()
            driver.join_streams(target, streams[1:], self._join)
        driver.record(self._release_raw[slot], target)

    def close(self) -> None:
        """Unmap what we imported, before the producer frees it (the driver's rule).

        Frames are released CPU-side while the user's kernels may still read them; each slot's release
        event marks the end of those reads, so wait for all of them first. Only then is the mapping
        closed and the connection dropped, which is what lets a closing producer free the memory.
        """
        if self._closed:
            return
        self._closed = True
        try:
            with devices.keep_current():
                self._close()
        except Exception:
            pass

    def _close(self) -> None:
        self.dev.set_current()
        for ev in self.release_events:
            ev.sync()
        self.stream.sync()
        for got in self._bufs:
            if got is not None:
                self.mem.close_one(got[1], self.stream)
        self._bufs = [None] * len(self._bufs)
        self._slots = [None] * len(self._slots)
        if self._join is not None:
            driver.destroy_event(self._join)
            self._join = None
        for ev in self.release_events:
            driver.close_ipc_event(ev)
        self.mem.close()


def resolve_handles(handles: str, passes_fds: bool) -> str:
    """``auto`` -> pool on native Linux, legacy elsewhere (Windows, WSL) and over channels without fds."""
    if handles not in ("auto", "pool", "legacy"):
        raise ArgumentError(f"cudalink: handles must be 'auto', 'pool' or 'legacy', got {handles!r}")
    if handles == "auto":
        return _platform.default_handles() if passes_fds else "legacy"
    if handles == "pool" and not passes_fds:
        raise ArgumentError(
            "cudalink: handles='pool' needs a control channel that passes file descriptors (a Unix socket), "
            "and this transport's cannot (loopback TCP, as on Windows); use handles='legacy' or 'auto', or "
            + driver.NO_GPU_HINT
        )
    if handles == "pool" and _platform.default_handles() != "pool":
        raise ArgumentError(
            "cudalink: handles='pool' needs cuda.core IPC pools, which only native Linux's driver shares (WSL 2's "
            "refuses them); use handles='legacy' or 'auto', or " + driver.NO_GPU_HINT
        )
    return handles


def make_producer_slots(
    device: int | str, nslots: int, capacity: int, handles: str, passes_fds: bool = True
) -> ProducerSlots:
    if device == "cpu":
        return HostSlots(nslots, capacity)
    ordinal = devices.parse_device(device)  # a bad device is an argument error before any CUDA call
    handles = resolve_handles(handles, passes_fds)
    return CudaSlots(ordinal, nslots, capacity, handles)


def make_consumer_view(fixed: wire.Fixed, client: Client, fds: list[int]) -> ConsumerView:
    if fixed.backend == wire.BACKEND_HOST:
        return HostView(fixed, client, fds)
    return CudaView(fixed, client, fds)
