"""The mp.Queue peers: a torch.multiprocessing CUDA tensor, or a pickled cuda.core IPC Buffer."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from ...cuda import devices, driver
from ..measure import GpuLib
from . import ConsumerJob, JobFields

if TYPE_CHECKING:
    import multiprocessing.queues as mpq
    from multiprocessing.context import BaseContext

    from ...cuda.objects import Closable, Stream
    from . import QueueItem


class QueueSource:
    """torch.multiprocessing CUDA tensors, or cuda.core Buffers, unpickled from an mp.Queue."""

    def __init__(self, job: ConsumerJob, q: mpq.Queue[QueueItem]) -> None:
        self.q = q
        self.peer = job.peer
        self.timeout = job.timeout
        if job.peer == "torch-mp":
            import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reducers)

            GpuLib("torch", job.device).context()
        else:
            devices.device(job.device)
        self.skipped = 0

    def _get(self) -> tuple[int, object, int] | None:
        item = self.q.get(timeout=self.timeout)
        return None if item is None else (int(item[0]), item[1], int(item[2]))

    def take(self) -> tuple[int, object, int, int, int] | None:
        got = self._get()
        t, wall = time.monotonic_ns(), time.time_ns()
        return None if got is None else (*got, t, wall)

    def ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.q.empty():
            if time.monotonic() > deadline:
                return False
            time.sleep(20e-6)
        return True

    def take_now(self) -> tuple[int, object, int] | Literal[False] | None:
        return self._get()  # poll mode times this call itself: no clocks of our own inside it

    def export(self, obj: object) -> object:
        return obj  # already a tensor / a Buffer

    def done(self, obj: object) -> None:
        if self.peer == "core-pickle":  # a cuda.core Buffer
            with contextlib.suppress(Exception):
                cast("Closable", obj).close()

    def close(self) -> None:
        pass


class QueueProducer:
    """torch-mp: a CUDA tensor per frame through mp.Queue; core-pickle: a cuda.core IPC-pool Buffer."""

    def __init__(
        self,
        ctx: BaseContext,
        peer: str,
        name: str,
        shape: tuple[int, ...],
        dtype: str,
        k: int,
        nslots: int,
        lib: GpuLib,
        ordinal: int,
    ) -> None:
        self.peer = peer
        self.name = name
        self.lib = lib
        self.nslots = nslots
        self.seq = 0
        self.nbytes = int(math.prod(shape)) * np.dtype(dtype).itemsize
        self.pool: list[Any] = []  # torch tensors or cuda.core Buffers: neither library ships types
        self.mr: object = None
        if peer == "torch-mp":
            import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reducers)

            self.pool = [lib.empty(shape, dtype) for _ in range(nslots)]
        else:
            from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

            dev = devices.device(ordinal)
            self.stream: Stream = dev.create_stream()  # core-pickle only
            gran = 2 << 20
            per = (self.nbytes + gran - 1) // gran * gran
            self.mr = mr = DeviceMemoryResource(
                dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=per * nslots + gran)
            )
            self.pool = [mr.allocate(self.nbytes, stream=self.stream) for _ in range(nslots)]
            self.stream.sync()
        self.queues: list[mpq.Queue[QueueItem]] = [ctx.Queue() for _ in range(k)]

    def chan(self, i: int) -> mpq.Queue[QueueItem]:
        return self.queues[i]

    def job_fields(self) -> JobFields:
        return {}

    def wait_connected(self, k: int, timeout: float) -> None:
        pass

    def send(self, src: Any) -> int | None:  # a GPU array of the producer's library
        self.seq += 1
        item = self.pool[self.seq % self.nslots]
        if self.peer == "torch-mp":
            item.copy_(src)
        else:  # no IPC event travels with a pickled Buffer: the producer must wait for its copy
            stream = driver.stream_handle(self.stream)
            driver.memcpy_dtod(int(item.handle), self.lib.ptr(src), self.nbytes, stream)
            self.stream.sync()
        pub = time.time_ns()
        for q in self.queues:
            q.put((self.seq, item, pub))
        return self.seq

    def finish(self) -> None:
        for q in self.queues:
            q.put(None)

    def close(self) -> None:
        for q in self.queues:
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                q.close()
        # Freeing the peers' shared objects (CUDA tensors sent by torch.multiprocessing, cuda.core Buffers
        # pickled through mp.Queue) segfaulted inside torch / cuda.core on an H200, even with every
        # importer joined. They are the peers', not cudalink's: keep them until the process exits
        # (the CLI leaves with os._exit once the report is written).
        with contextlib.suppress(Exception):
            if self.peer == "core-pickle":
                self.stream.sync()
        KEEP_UNTIL_EXIT.append((self.pool, getattr(self, "mr", None), getattr(self, "stream", None)))
        self.pool = []


KEEP_UNTIL_EXIT: list[object] = []
