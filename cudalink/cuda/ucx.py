"""The CUDA side of frames over UCX: wait for GPU work without blocking a loop, and stage through host memory.

UCXX reads GPU memory through ``__cuda_array_interface__`` and ignores its ``stream``, so a sender must
know a frame is complete first: it records a marker event on the stream that waits on the frame's ready
event and polls it (``cuEventQuery``) between its other work (:func:`drained`).

Across hosts without RDMA, UCX moves GPU memory over TCP through its own staging pipeline, which on an
H100 (2026-11-25, bare UCXX, 1080p RGBA, ``UCX_TLS=tcp,cuda_copy``) ran at 0.28 GB/s, while host memory
over the same TCP ran at 0.9 GB/s. So a server may copy each frame into page-locked host memory
(:class:`Pinned`, one ``cuMemcpyDtoHAsync``) and send that, and the consumer receives host bytes and
copies them into its GPU landing buffer (one ``cuMemcpyHtoDAsync``), never blocking either loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from typing import Any, SupportsInt, cast

import numpy as np

from . import devices, driver

#: a loop looks at a pending GPU marker at every turn (it never blocks on one) for up to ``SPIN_S``, then
#: every ``POLL_S``. asyncio cannot sleep less than epoll's millisecond: ``asyncio.sleep(0.0001)`` took
#: 1.1 ms (p50, Linux), longer than the GPU work a frame waits for here (a copy of it, or its staging), and
#: it was paid on every GPU frame a server sent and many a consumer landed. Those turns keep a core busy,
#: so a process whose waits have lately run longer than ``SPIN_S`` (a consumer whose own kernels hold
#: its landing buffers, a GPU shared with long work) sleeps from the start: a millisecond is then a small
#: share of the wait, and a spin a large one.
SPIN_S = 0.005
POLL_S = 0.001
_recent_s = 0.0  # how long this process's waits took lately (moving average, 1/8)


class DeviceBytes:
    """``nbytes`` of GPU memory at ``ptr`` as UCXX takes them (CAI v3 without a stream: the caller has
    ordered everything before posting)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "stream": None,
        }


def use_device(ordinal: int) -> None:
    """Make GPU ``ordinal`` current on this thread (the UCX loop's, before it touches CUDA)."""
    devices.device(ordinal)


def mark(stream: object) -> tuple[Any, Any]:
    """A fresh event recorded on ``stream`` (an int handle, or None for the legacy default stream)."""
    ev = driver.new_event()
    h = int(cast(SupportsInt, ev)) if driver.compiled() else ev  # the compiled calls take the handle as an int
    driver.record(h, 1 if stream is None else int(cast(SupportsInt, stream)))
    return ev, h


def done(marker: tuple[Any, Any]) -> bool:
    return driver.event_done(marker[1])


def forget(marker: tuple[Any, Any]) -> None:
    driver.destroy_event(marker[0])


async def passed(marker: tuple[Any, Any]) -> None:
    """Return once ``marker`` (from :func:`mark`) has passed, polling (the loop keeps running); then forget it."""
    global _recent_s
    try:
        if done(marker):
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        spin_until = start + SPIN_S if _recent_s < SPIN_S else start
        while not done(marker):
            # a turn of the loop (its other work runs), not a sleep, while the wait is as short as a copy
            await asyncio.sleep(0 if loop.time() < spin_until else POLL_S)
        _recent_s += (loop.time() - start - _recent_s) * 0.125
    finally:
        forget(marker)


async def drained(stream: object) -> None:
    """Return once everything queued on ``stream`` so far has run."""
    await passed(mark(stream))


def copy_on_gpu(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a device-to-device copy on ``stream`` (a relay's landed frame into its local link's slot)."""
    driver.memcpy_dtod(dst, src, nbytes, stream)


class Pinned:
    """``nbytes`` of page-locked host memory (``cuMemHostAlloc``) in GPU ``ordinal``'s context: copies to
    and from the GPU run asynchronously at the bus's speed, and UCX sends and receives it as host memory.
    ``array`` is a uint8 numpy view of it. Explicit :meth:`close`."""

    def __init__(self, ordinal: int, nbytes: int) -> None:
        self.ordinal = ordinal
        self.nbytes = nbytes
        drv = driver.bindings()
        with devices.keep_current():
            devices.device(ordinal)
            self.ptr = int(cast(SupportsInt, driver.check(drv.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc")))
        self.array: np.ndarray[Any, np.dtype[np.uint8]] = np.ctypeslib.as_array(
            (ctypes.c_uint8 * nbytes).from_address(self.ptr)
        )
        self._pending: tuple[Any, Any] | None = None  # a marker after the last copy out of this buffer

    async def to_host(self, src: int, nbytes: int, stream: object) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Copy ``nbytes`` of GPU memory at ``src`` in, on ``stream`` (already ordered after the data), and
        return the host bytes once they are there."""
        await self.idle()
        driver.memcpy_dtoh(self.ptr, src, nbytes, 1 if stream is None else int(cast(SupportsInt, stream)))
        await drained(stream)
        return self.array[:nbytes]

    def to_device(self, dst: int, nbytes: int, stream: int) -> None:
        """Queue the copy of the first ``nbytes`` out to GPU memory at ``dst`` on ``stream``; the buffer is
        not refilled (:meth:`idle`) until that copy has run."""
        driver.memcpy_htod(dst, self.ptr, nbytes, stream)
        self._pending = mark(stream)

    async def idle(self) -> None:
        """Wait (polling) until no queued copy still reads this buffer."""
        m = self._pending
        if m is not None:
            try:
                await passed(m)
            finally:
                self._pending = None

    def close(self) -> None:
        """Free the memory once no copy reads it (CPU-side wait: at teardown only)."""
        if self.ptr:
            m, self._pending = self._pending, None
            drv = driver.bindings()
            with devices.keep_current():
                devices.device(self.ordinal)
                if m is not None:
                    with contextlib.suppress(Exception):
                        drv.cuEventSynchronize(m[0])
                    forget(m)
                drv.cuMemFreeHost(self.ptr)
            self.ptr = 0
