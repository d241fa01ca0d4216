"""Frames delivered on another GPU than the producer's: any CUDA attachment, wrapped so that each frame it
takes is copied into a landing pool on the consumer's GPU (``cudalink.cuda.landing``) and handed out from
there.

Per frame, with no CPU wait: the copy stream (on the producer's GPU) waits on the slot's ready event, the
copy runs (a peer copy over NVLink/PCIe, or one the driver stages), and the slot's frame is released at once
with the copy stream as its only export, so the slot's release fence passes as soon as the copy has run. A
slow consumer on the other GPU therefore holds only its own landing buffers, never the producer's ring: when
its GPU falls so far behind that every landing buffer is still fenced, it waits for its own GPU before taking
the next frame (CPU-side, in its own ``recv``), so the copy never waits on the GPU for it with a slot held.
The landed frame's consumers wait on the landed buffer's ready event; its release fences the buffer.

``copy="always"`` on a host link (:class:`HostCopyAttachment`) is the same idea on the CPU: each frame is copied
into an array this Receiver owns and its slot given back at once, so a consumer that keeps frames long never
holds the producer's slots.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..cuda import arrays
from ..cuda.landing import Landing
from ..frames.frame import Frame, _Hold
from ..frames.spec import FrameSpec

if TYPE_CHECKING:
    from .._native.dlpack import Exporter
    from .source import Attachment, Counters

__all__ = ["HostCopyAttachment", "LandedAttachment"]


def landed_receive(rx: Counters, att: LandedAttachment) -> Frame | None:
    """The wrapped attachment's take, then the frame landed on our GPU (None: nothing to take, or every
    landing buffer still fenced by our own GPU work: the slot is not taken until one is free)."""
    pool = att.pool
    if not pool.available():
        return None
    pool.check_room()  # every buffer held: say so before taking a frame we would have to drop
    frame = att.inner_receive(rx, att.inner)
    return None if frame is None else att.land(frame)


def landed_sleep_receive(rx: Counters, att: LandedAttachment, timeout: float, waiting: int, after: int) -> Frame | None:
    """While our GPU is behind (every landing buffer fenced), wait for it here, holding nothing of the
    producer's; then the wrapped attachment's sleeping take for what is left of ``timeout``."""
    if not att.pool.available():
        start = time.monotonic()
        if not att.pool.wait_available(timeout):
            return None
        timeout = max(0.0, timeout - (time.monotonic() - start))
    att.pool.check_room()
    frame = att.inner_sleep(rx, att.inner, timeout, waiting, after)
    return None if frame is None else att.land(frame)


class _Wrapped:
    """An attachment that delivers the wrapped one's frames elsewhere: everything but the per-frame take and
    where the frames land is the wrapped attachment's."""

    def __init__(self, inner: Attachment) -> None:
        self.inner = inner
        kind = type(inner)
        self.inner_receive = kind.receive
        self.inner_sleep = kind.sleep_receive
        self.generation = inner.generation
        self.backend = inner.backend
        self.capacity = inner.capacity
        self.floor = inner.floor

    # -- the rest is the wrapped attachment's -------------------------------------------------------------------

    def closing(self) -> bool:
        return self.inner.closing()

    def alive(self) -> bool:
        return self.inner.alive()

    @property
    def reason(self) -> str:
        return str(getattr(self.inner, "reason", ""))

    @property
    def last_published(self) -> int:
        return int(getattr(self.inner, "last_published", 0))

    def set_waiting(self, state: int) -> None:
        self.inner.set_waiting(state)

    def count(self, received: int, skipped: int) -> None:
        self.inner.count(received, skipped)

    def fileno(self) -> int:
        return self.inner.fileno()

    async def wait_async(self, timeout: float | None) -> None:
        await self.inner.wait_async(timeout)

    def interrupt(self) -> bool:
        """Wake a waiter on the wrapped attachment; False where it has no way to (see ``Receiver.close``)."""
        wake = getattr(self.inner, "interrupt", None)
        if wake is None:
            return False
        wake()
        return True

    def detach(self) -> None:
        self.inner.detach()


class LandedAttachment(_Wrapped):
    """An attachment whose frames live on ``src_device`` (the producer's GPU), delivered on ``device``.

    Everything but the per-frame take is the wrapped attachment's. ``path`` says how the copy runs
    (``peer``, ``staged``, or ``same-device`` for ``copy="always"`` on the producer's GPU).
    """

    receive = staticmethod(landed_receive)
    sleep_receive = staticmethod(landed_sleep_receive)

    def __init__(
        self, inner: Attachment, src_device: int, device: int, *, buffers: int, pool: Landing | None = None
    ) -> None:
        super().__init__(inner)
        self.device_id = device
        self.src_device = src_device
        self.pool = pool or Landing(device, inner.capacity, src_device=src_device, limit=buffers)
        self.path = self.pool.path
        self.copy_stream = self.pool.ops.copy_stream()
        self._exporters: dict[tuple[int, int], tuple[FrameSpec, Exporter | None]] = {}

    @property
    def device(self) -> str:
        return f"cuda:{self.device_id}"

    def land(self, frame: Frame) -> Frame:
        """Copy ``frame`` into a landing buffer, give its slot back (fenced after the copy), and return the
        frame on our GPU with the same seq, timestamp, meta and spec."""
        hold = cast("Any", frame._hold)  # the slot's lease: link's _Lease or its compiled twin
        spec = frame._spec
        s = self.copy_stream
        try:
            sync = frame._sync
            if sync is not None:
                sync.wait(s)  # after the producer's copy into the slot: GPU-side
            landed = self.pool.land(hold.ptr, spec.nbytes, stream=s)
        except BaseException:
            frame.release()
            hold.end()  # nothing was queued that reads the slot
            raise
        hold.streams.append(s)  # the copy is the slot's only reader: its release fence goes after it
        frame.release()
        hold.end()
        key = (landed.ptr, id(spec))
        got = self._exporters.get(key)
        if got is None or got[0] is not spec:
            if len(self._exporters) > 64:
                self._exporters.clear()
            got = self._exporters[key] = (spec, arrays.dlpack_exporter(landed.ptr, spec, self.device_id))
        return Frame._received(
            spec,
            _Hold(landed, landed.ptr, landed.give_back),
            self.device_id,
            frame._seq,
            frame._timestamp_ns,
            frame._meta,
            landed,
            frame.generation,
            None,
            got[1],
        )

    def detach(self) -> None:
        """Leave the producer now (no slot is held past its copy) and free the landing buffers no frame
        holds; each one still held is freed when its frame and exports are gone."""
        try:
            self.inner.detach()
        finally:
            self.pool.close()

    def stats(self) -> dict[str, int | str]:
        return self.pool.stats()


def host_copy_receive(rx: Counters, att: HostCopyAttachment) -> Frame | None:
    frame = att.inner_receive(rx, att.inner)
    return None if frame is None else att.land(frame)


def host_copy_sleep_receive(
    rx: Counters, att: HostCopyAttachment, timeout: float, waiting: int, after: int
) -> Frame | None:
    frame = att.inner_sleep(rx, att.inner, timeout, waiting, after)
    return None if frame is None else att.land(frame)


class HostCopyAttachment(_Wrapped):
    """A host link's frames, each copied into a compact array of ours and its slot given back at once
    (``copy="always"``): ``path`` is ``"copy"``."""

    receive = staticmethod(host_copy_receive)
    sleep_receive = staticmethod(host_copy_sleep_receive)
    path = "copy"
    device = "cpu"
    device_id = -1

    def __init__(self, inner: Attachment) -> None:
        super().__init__(inner)
        self._specs: dict[int, tuple[FrameSpec, FrameSpec]] = {}  # a strided spec -> its compact twin

    def land(self, frame: Frame) -> Frame:
        spec = frame._spec
        try:
            arr = np.array(frame.numpy(), order="C", copy=True)
        finally:
            frame.release()
        if spec.strides is not None:
            got = self._specs.get(id(spec))
            if got is None or got[0] is not spec:
                if len(self._specs) > 64:
                    self._specs.clear()
                got = self._specs[id(spec)] = (spec, spec.with_shape(spec.shape))  # the same, compact
            spec = got[1]
        ro = arr.view()
        ro.flags.writeable = False
        return Frame._received(
            spec,
            _Hold(arr, int(arr.ctypes.data)),
            -1,
            frame._seq,
            frame._timestamp_ns,
            frame._meta,
            None,
            frame.generation,
            (arr, ro),
        )

    def stats(self) -> dict[str, int | str]:
        return {}
