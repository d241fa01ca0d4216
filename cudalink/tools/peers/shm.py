"""The plain peer: a SharedMemory ring the producer copies into (D2H on a GPU run) plus a pipe message per frame."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from ..measure import GpuLib
from . import PEER_MSG, ConsumerJob, JobFields

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import BaseContext


class ShmSource:
    """The plain peer: a shared-memory ring the producer copies into, plus one pipe message per frame."""

    def __init__(self, job: ConsumerJob, conn: Connection) -> None:
        from ...transport.shm import _open_segment

        self.conn = conn
        self.seg = _open_segment(job.name)
        dt = np.dtype(job.dtype)
        self.views: list[npt.NDArray[np.generic]] = [
            np.ndarray(job.shape, dt, buffer=self.seg.buf, offset=i * job.stride) for i in range(job.nslots)
        ]
        self.lib = GpuLib(job.lib, job.device) if job.device >= 0 and job.lib else None
        if self.lib is not None:
            self.lib.context()
        # on a GPU run: the frame, copied to this process's GPU
        self.dev = self.lib.empty(job.shape, job.dtype) if self.lib is not None else None
        self.skipped = 0

    def _get(self, msg: bytes) -> tuple[int, object, int] | None:
        if not msg:
            return None
        seq, slot, pub = PEER_MSG.unpack(msg)
        view = self.views[slot]
        if self.lib is not None and (dev := self.dev) is not None:  # usable once on this process's GPU
            self.lib.copy(dev, view)
            self.lib.sync()
            return seq, dev, pub
        return seq, view, pub

    def _recv(self) -> tuple[int, object, int] | None:
        try:
            return self._get(self.conn.recv_bytes())  # on a GPU run: copied to this process's GPU, synced
        except EOFError:
            return None

    def take(self) -> tuple[int, object, int, int, int] | None:
        got = self._recv()
        t, wall = time.monotonic_ns(), time.time_ns()
        return None if got is None else (*got, t, wall)

    def ready(self, timeout: float) -> bool:
        return bool(self.conn.poll(timeout))

    def take_now(self) -> tuple[int, object, int] | Literal[False] | None:
        return self._recv()  # poll mode times this call itself: no clocks of our own inside it

    def export(self, obj: object) -> object:
        return obj if self.lib is not None else np.asarray(obj)

    def done(self, obj: object) -> None:
        pass

    def close(self) -> None:
        self.views = []
        self.dev = None
        with contextlib.suppress(Exception):
            self.seg.close()


class ShmProducer:
    peer = "shm"

    def __init__(
        self, ctx: BaseContext, name: str, shape: tuple[int, ...], dtype: str, k: int, nslots: int, lib: GpuLib | None
    ) -> None:
        from ..._backends import align
        from ...transport.shm import _open_segment

        self.name = name
        self.lib = lib
        dt = np.dtype(dtype)
        self.stride = align(int(math.prod(shape)) * dt.itemsize)
        self.nslots = nslots
        self.seg = _open_segment(name, create=True, size=self.stride * nslots)
        self.views: list[npt.NDArray[np.generic]] = [
            np.ndarray(shape, dt, buffer=self.seg.buf, offset=i * self.stride) for i in range(nslots)
        ]
        pipes = [ctx.Pipe(duplex=False) for _ in range(k)]
        self.readers = [r for r, _ in pipes]
        self.writers = [w for _, w in pipes]
        self.seq = 0

    def chan(self, i: int) -> Connection:
        return self.readers[i]

    def job_fields(self) -> JobFields:
        return {"nslots": self.nslots, "stride": self.stride}

    def wait_connected(self, k: int, timeout: float) -> None:
        pass

    def send(self, src: Any) -> int | None:  # numpy on the CPU backend, the array library's on a GPU
        self.seq += 1
        slot = self.seq % self.nslots
        if self.lib is not None:
            self.lib.to_host(self.views[slot], src)
        else:
            np.copyto(self.views[slot], src)
        msg = PEER_MSG.pack(self.seq, slot, time.time_ns())
        for w in self.writers:
            w.send_bytes(msg)
        return self.seq

    def finish(self) -> None:
        for w in self.writers:
            with contextlib.suppress(OSError):
                w.send_bytes(b"")

    def close(self) -> None:
        from ...transport.shm import _unlink_segment

        for c in (*self.readers, *self.writers):
            with contextlib.suppress(OSError):
                c.close()
        self.views = []
        with contextlib.suppress(Exception):
            self.seg.close()
        _unlink_segment(self.name)
