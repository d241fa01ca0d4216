"""Slot memory: exported by the producer and mapped by consumers, through a cuda.core IPC pool (one fd per
pool) or legacy ``cuIpc`` handles (Windows, WSL)."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import LinkError
from . import devices, driver

if TYPE_CHECKING:
    from .objects import Closable, Device, Stream

# -- slot memory: cuda.core IPC pool, or legacy cuIpc handles ---------------------------------------------


@dataclass
class ExportedSlot:
    ptr: int
    handle: bytes  # 64 bytes
    size: int


class Exporter(Protocol):
    """The producer's slots, and what a consumer needs besides their handles (the pool's fd)."""

    kind: str
    slots: list[ExportedSlot]

    def fds(self) -> list[int]: ...

    def close(self, stream: Stream) -> None: ...


class Importer(Protocol):
    """A consumer's view of the producer's slots: open one by handle, close what it opened."""

    kind: str

    def open(self, handle: bytes, size: int, stream: Stream) -> tuple[int, object]: ...

    def close_one(self, keep: object, stream: Stream) -> None: ...

    def close(self) -> None: ...

    def allow(self, ordinal: int) -> bool:
        """Let GPU ``ordinal`` reach the producer's memory directly, where the handle kind needs it said."""
        ...


class PoolExporter:
    """Slots from one IPC-enabled DeviceMemoryResource: one fd per pool, 64 plain bytes per buffer."""

    kind = "pool"

    def __init__(self, dev: Device, nslots: int, size: int, stream: Stream) -> None:
        core = driver.core()
        devices.require_pool_ipc(dev)
        gran = 2 << 20
        per = (size + gran - 1) // gran * gran
        self.slots: list[ExportedSlot] = []
        self._bufs: list[Closable] = []
        self.mr: Any = None  # a cuda.core DeviceMemoryResource, once made
        try:
            opts = core.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=per * nslots + gran)
            self.mr = core.DeviceMemoryResource(dev, opts)
            for _ in range(nslots):
                buf = self.mr.allocate(size, stream=stream)
                payload, bsize = driver.descriptor_args(buf.ipc_descriptor)[:2]
                self.slots.append(ExportedSlot(int(buf.handle), bytes(payload), int(bsize)))
                self._bufs.append(buf)
                driver.register_local_slot(bytes(payload), int(buf.handle))
            stream.sync()
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.close(stream)
            raise no_room(dev, nslots, size, exc) from exc

    def fds(self) -> list[int]:
        return [int(self.mr.allocation_handle.handle)]

    def close(self, stream: Stream) -> None:
        for s in self.slots:
            driver.unregister_local_slot(s.handle)
        for buf in self._bufs:
            buf.close(stream)
        self.slots.clear()
        self._bufs.clear()
        stream.sync()
        if self.mr is not None:
            self.mr.close()


class LegacyExporter:
    """Slots from cuMemAlloc, shared with cuIpcGetMemHandle: no fds, works on Windows and WSL."""

    kind = "legacy"

    def __init__(self, dev: Device, nslots: int, size: int, stream: Stream) -> None:
        drv = driver.bindings()
        self.slots: list[ExportedSlot] = []
        self._ptrs: list[object] = []  # the CUdeviceptr objects, for cuMemFree
        try:
            for _ in range(nslots):
                ptr = driver.check(drv.cuMemAlloc(size), "cuMemAlloc")
                self._ptrs.append(ptr)
                h = driver.check(drv.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
                self.slots.append(ExportedSlot(int(ptr), bytes(h.reserved), size))
                driver.register_local_slot(bytes(h.reserved), int(ptr))
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.close(stream)
            raise no_room(dev, nslots, size, exc) from exc

    def fds(self) -> list[int]:
        return []

    def close(self, stream: Stream) -> None:
        stream.sync()
        for s in self.slots:
            driver.unregister_local_slot(s.handle)
        free_bounded(self._ptrs)
        self.slots.clear()
        self._ptrs = []


def mem_info() -> tuple[int, int] | None:
    """(free, total) bytes of the current device, or None where the driver cannot say."""
    try:
        drv = driver.bindings()
        free, total = driver.check(drv.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)
    except Exception:
        return None


def no_room(dev: Device, nslots: int, size: int, exc: BaseException) -> LinkError:
    """The error of a slot pool that could not be allocated: what was asked, where, what is free, the fix."""
    ordinal = getattr(dev, "device_id", "?")
    info = mem_info()
    room = f"{info[0]:,} of its {info[1]:,} bytes are free" if info is not None else "its free memory is unknown"
    return LinkError(
        f"cudalink: could not allocate the link's {nslots} slot(s) of {size:,} bytes ({nslots * size:,} bytes) on "
        f"cuda:{ordinal}, where {room} ({type(exc).__name__}: {exc}); use fewer slots, smaller frames or a "
        "smaller capacity, or free GPU memory"
    )


#: how long a producer's close waits for cuMemFree before it leaks the slots instead
FREE_TIMEOUT = 5.0


def free_bounded(ptrs: list[object], timeout: float = FREE_TIMEOUT) -> bool:
    """``cuMemFree`` each pointer, giving up after ``timeout`` seconds.

    On Windows ``cuMemFree`` can hang while a crashed peer still maps the allocation; a producer's
    ``close()`` must return anyway. The frees run on a daemon thread (bound to this thread's context);
    if it does not finish in time the memory is leaked until the process exits, with a warning.
    """
    if not ptrs:
        return True
    drv = driver.bindings()
    ctx = driver.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")

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

    def __init__(self, dev: Device, fds: list[int]) -> None:
        if not fds:
            raise LinkError("cudalink: the producer sent no pool descriptor")
        self.dev = dev
        self.fds = list(fds)
        self.mr: object = None

    def _pool(self) -> object:
        """Map the producer's pool on first use (never for a producer in this same process)."""
        if self.mr is None:
            core = driver.core()
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

    def open(self, handle: bytes, size: int, stream: Stream) -> tuple[int, object]:
        from cuda.core import Buffer

        mine = driver.local_slot(handle)
        if mine is not None:
            return mine, None
        mr = self._pool()
        try:
            buf = Buffer.from_ipc_descriptor(mr, driver.buffer_descriptor(handle, size), stream=stream)
        except Exception as exc:
            raise LinkError(f"cudalink: could not map the producer's slot: {exc}") from exc
        return int(buf.handle), buf

    def allow(self, ordinal: int) -> bool:
        """Let GPU ``ordinal`` reach the mapped pool's memory directly (a peer copy to a consumer's GPU).

        Peer access of pool memory is the pool's (``cuMemPoolSetAccess``), not the context's; an imported
        pool starts with its own GPU only. Best effort: False where the driver refuses, and the copy then
        runs the way the driver finds (staged, or pushed by the producer's GPU).
        """
        try:
            proxy = getattr(self._pool(), "peer_accessible_by", None)
            if proxy is None:
                return False
            proxy.add(ordinal)
        except Exception:
            return False
        return True

    def close_one(self, keep: object, stream: Stream) -> None:
        close = getattr(keep, "close", None)  # a cuda.core Buffer; None for our own slots
        if close is not None:
            close(stream)

    def close(self) -> None:
        self._close_fds()
        close = getattr(self.mr, "close", None)
        if close is not None:
            close()


class LegacyImporter:
    kind = "legacy"

    def __init__(self, dev: Device, fds: list[int]) -> None:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def open(self, handle: bytes, size: int, stream: Stream) -> tuple[int, object]:
        mine = driver.local_slot(handle)
        if mine is not None:
            return mine, None
        drv = driver.bindings()
        h = drv.CUipcMemHandle()
        h.reserved = handle
        ptr = driver.check(
            drv.cuIpcOpenMemHandle(h, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            "cuIpcOpenMemHandle",
        )
        return int(ptr), ptr

    def allow(self, ordinal: int) -> bool:
        """Legacy handles are opened with lazy peer access: contexts with peer access enabled reach them."""
        return True

    def close_one(self, keep: object, stream: Stream) -> None:
        if keep is None:
            return
        drv = driver.bindings()
        stream.sync()
        drv.cuIpcCloseMemHandle(keep)

    def close(self) -> None:
        pass


def allocation_bytes(ptr: int) -> int:
    """Bytes from ``ptr`` to the end of its allocation (cuMemGetAddressRange): how much a mapped slot can hold,
    so a producer's metadata that claims more is refused instead of copied past the end."""
    drv = driver.bindings()
    base, size = driver.check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    return int(base) + int(size) - int(ptr)
