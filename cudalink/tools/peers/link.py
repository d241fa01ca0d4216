"""cudalink itself, as the bench drives it: a Sender in the parent, a Receiver per consumer."""

from __future__ import annotations

import select
import time
from typing import TYPE_CHECKING, Literal

import numpy as np

from ...errors import LinkTimeout, ProducerGone
from ...transport.ring_source import RingAttachment
from ..measure import Backend, GpuLib
from . import ConsumerJob, JobFields

if TYPE_CHECKING:
    from ...frames.frame import Frame
    from ...link import WaitMode


class LinkSource:
    def __init__(self, job: ConsumerJob) -> None:
        from ...link import Receiver

        self.lib = GpuLib(job.lib, job.device) if job.device >= 0 and job.lib else None
        if self.lib is not None:
            self.lib.context()
        wait: WaitMode = "hybrid" if job.mode == "async" else job.wait
        self.rx = Receiver(job.name, wait=wait, wake_ahead=job.ahead, latest=job.latest, timeout=job.timeout)

    @property
    def skipped(self) -> int:
        return self.rx.skipped

    def take(self) -> tuple[int, Frame, int, int, int] | None:
        try:
            f = self.rx.recv()
        except ProducerGone:
            return None
        t, wall = time.monotonic_ns(), time.time_ns()
        return f.seq, f, f.timestamp_ns, t, wall

    def ready(self, timeout: float) -> bool:
        return bool(select.select([self.rx.fileno()], [], [], timeout)[0])

    def take_now(self) -> tuple[int, Frame, int] | Literal[False] | None:
        try:
            f = self.rx.poll()
        except ProducerGone:
            return None
        return False if f is None else (f.seq, f, f.timestamp_ns)

    def export(self, obj: Frame) -> object:
        return self.lib.from_dlpack(obj) if self.lib is not None else np.from_dlpack(obj)

    def done(self, obj: Frame) -> None:
        obj.release()

    _next = 0

    def bare_view_ns(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> int | None:
        """The ``view_read`` floor, paired: in this consumer, right after a wake, a numpy view of a slot
        (the slots in turn, as the producer fills them), made and read. No cudalink code runs in it."""
        att = self.rx._att  # the bench reads the mapped region the frames point into; users never need it
        if not isinstance(att, RingAttachment) or self.lib is not None:
            return None
        region = att.view.region  # type: ignore[attr-defined]  # a HostView: host links only
        self._next = (self._next + 1) % len(att.handles)
        off = att.handles[self._next].size  # a host slot's handle carries its offset in the region
        first = (0,) * len(shape)
        t0 = time.monotonic_ns()
        a = np.ndarray(shape, dtype, buffer=region.buf, offset=off)
        _ = a[first]
        t1 = time.monotonic_ns()
        del a
        return t1 - t0

    def close(self) -> None:
        self.rx.close()


class LinkProducer:
    peer = "cudalink"

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, k: int, nslots: int, backend: Backend) -> None:
        from ...link import Sender

        self.name = name
        self.tx = Sender(
            name,
            shape=shape,
            dtype=dtype,
            slots=nslots,
            device=backend.sender_device,
            max_consumers=max(16, k),
        )

    def chan(self, i: int) -> None:
        return None

    def job_fields(self) -> JobFields:
        return {}

    def wait_connected(self, k: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.tx.stats()["consumers"] < k:
            if time.monotonic() > deadline:
                raise LinkTimeout(f"cudalink: only {self.tx.stats()['consumers']} of {k} consumers attached")
            time.sleep(0.002)

    def send(self, src: object) -> int | None:
        return self.tx.send(src)

    def finish(self) -> None:
        self.tx.close(timeout=15.0)

    def close(self) -> None:
        self.tx.close(timeout=1.0)
