"""A cuda-link producer written here with struct and numpy over real SharedMemory, and a host stand-in for
CUDA slot memory, so the cuda-link source's polling, seqs, skips, restarts and shutdown are tested on CPU.

The fake's memory "handle" of slot i is ``b"HOST" + the name of a SharedMemory segment`` holding the slot's
bytes; :class:`HostSlotMemory` maps those instead of calling cuIpcOpenMemHandle.
"""

from __future__ import annotations

import struct
import time
from multiprocessing import shared_memory

import numpy as np

from cudalink.frames.frame import Frame
from cudalink.frames.spec import FrameSpec
from cudalink.transport import cuda_link_wire as cw
from cudalink.transport.shm import _open_segment, _unlink_segment


def _handle(name: str) -> bytes:
    raw = b"HOST" + name.encode()
    assert len(raw) <= 64
    return raw.ljust(64, b"\0")


class FakeProducer:
    """Writes cuda-link's layout in the order its producers do: the version last at init, write_idx last per frame."""

    def __init__(
        self, name: str, shape: tuple[int, int, int] = (4, 6, 4), dtype: str = "uint8", slots: int = 3, flags: int = 0
    ) -> None:
        self.name = name
        self.n = slots
        self.shm = _open_segment(name, create=True, size=cw.segment_size(slots))
        assert self.shm.buf is not None
        self.buf = self.shm.buf
        self.cap = 1 << 16
        self.data = [_open_segment(f"{name}_d{i}".replace(">", "_"), create=True, size=self.cap) for i in range(slots)]
        self.version = 0
        self.idx = 0
        self.init(shape, dtype, flags)

    def init(self, shape: tuple[int, int, int], dtype: str, flags: int = 0) -> None:
        """(Re)initialise: magic, N, write_idx = 0, handles, shutdown = 0, metadata, then version + 1 last."""
        buf = self.buf
        cw.write_header_start(buf, cw.MAGIC, self.n)
        for i, d in enumerate(self.data):
            cw.write_handles(buf, i, _handle(d.name.lstrip("/")), bytes(64))
        cw.write_shutdown(buf, self.n, False)
        self.set_format(shape, dtype, flags)
        self.idx = 0
        self.version += 1
        cw.write_version(buf, self.version)

    def set_format(self, shape: tuple[int, int, int], dtype: str, flags: int = 0) -> None:
        meta = cw.meta_from_spec(FrameSpec(shape, dtype))
        meta = cw.Metadata(meta.width, meta.height, meta.num_comps, meta.format_kind, meta.bits, flags, meta.data_size)
        cw.write_metadata(self.buf, self.n, meta)
        self.shape, self.dtype = shape, np.dtype(dtype)

    def publish(self, value: int) -> int:
        """One frame filled with ``value``: data into slot write_idx mod N, timestamp, shutdown 0, write_idx + 1."""
        slot = self.idx % self.n
        if int(np.prod(self.shape)) * self.dtype.itemsize <= self.cap:  # else: a producer whose metadata lies
            arr = np.ndarray(self.shape, self.dtype, buffer=self.data[slot].buf)
            arr[...] = value
        cw.write_timestamp(self.buf, self.n, time.perf_counter())
        cw.write_shutdown(self.buf, self.n, False)
        self.idx += 1
        cw.write_write_idx(self.buf, self.idx)
        return self.idx

    def shutdown(self) -> None:
        cw.write_shutdown(self.buf, self.n, True)
        for i in range(self.n):
            cw.write_handles(self.buf, i, bytes(64), bytes(64))

    def close(self) -> None:
        self.buf = memoryview(b"")
        for seg in (self.shm, *self.data):
            _unlink_segment(seg.name.lstrip("/"))
            seg.close()


class HostSlotMemory:
    """The tests' stand-in for CUDA slot memory: slots are SharedMemory segments; frames are copies."""

    device = -1

    def __init__(self) -> None:
        self.segs: dict[int, shared_memory.SharedMemory] = {}
        self.closed = False
        self.frames = 0

    def open(self, slot: int, memory: bytes, event: bytes) -> int:
        assert memory.startswith(b"HOST"), memory
        seg = _open_segment(memory[4:].rstrip(b"\0").decode())
        self.segs[slot] = seg
        return int(seg.size)

    def frame(self, slot: int, spec: FrameSpec, seq: int, ts_ns: int, generation: int) -> Frame:
        buf = self.segs[slot].buf
        assert buf is not None
        arr = np.ndarray(spec.shape, spec.dtype, buffer=buf).copy()
        self.frames += 1
        f = Frame.from_array(arr, pixel_format=spec.pixel_format, origin=spec.origin, seq=seq, timestamp_ns=ts_ns)
        f.generation = generation
        return f

    def held(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True
        for seg in self.segs.values():
            seg.close()
        self.segs.clear()


def run_producer(name: str, count: int, period: float, start: float) -> None:
    """Spawned: publish ``count`` frames (value = seq % 256) every ``period`` s, then shut down."""
    p = FakeProducer(name)
    try:
        while time.time() < start:
            time.sleep(0.001)
        for i in range(count):
            p.publish((i + 1) % 256)
            time.sleep(period)
        p.shutdown()
        time.sleep(0.2)
    finally:
        p.close()


def write_struct(name: str, offset: int, fmt: str, *values: object) -> None:
    seg = _open_segment(name)
    assert seg.buf is not None
    struct.pack_into(fmt, seg.buf, offset, *values)
    seg.close()
