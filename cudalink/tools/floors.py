"""Floors: what this machine allows with no cudalink code in the path, measured in the bench's own run.

Every cudalink speed figure is reported as a ratio to one of these, so a number means the same on a
fast or a slow machine. Each floor is measured the way its cudalink figure is: a spawned child woken
at the bench's cadence (a consumer that slept has cold caches, and that is what real consumers see),
or the parent at the same cadence for producer-side costs.

- ``wake``: two bare Python processes, one 8-byte write on a socketpair, the reader blocked in read.
- ``spin``: a bare Python loop spinning on a shared-memory word the parent stamps.
- ``view_read`` (CPU): a numpy view of a SharedMemory slot, made and read right after a wake.

On the CPU backend the parent copies one frame into shared memory before each wake, as a CPU
producer does: the consumer's caches then start as cold as they do under cudalink.
- ``wait_event`` + ``dlpack_cached`` (GPU): ``cuStreamWaitEvent`` on an IPC event imported from the
  parent, then ``torch.from_dlpack`` (or cupy's) of a view built once; right after a wake.
- ``record_ipc_event`` (GPU): ``cuEventRecord`` of the child's own IPC event, right after a wake.
- ``memcpy`` + ``record`` (GPU, parent): ``cuMemcpyDtoDAsync`` of one bench frame and ``cuEventRecord``
  of an IPC event, at the cadence, in a loop of their own (:class:`CopyRecordFloor`). The bench's
  handoff run also times the same pair *between* its sends (``send_floor``): the same process, the
  same sleep before each, so both start from the same cache state.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..cuda import devices, driver
from ..errors import LinkError

if TYPE_CHECKING:
    import multiprocessing.queues as mpq
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext

    #: what a floor child tells the parent: it is ready (its pid), its samples, or why it failed
    FloorMsg = (
        tuple[Literal["ready"], int] | tuple[Literal["result"], dict[str, list[int]]] | tuple[Literal["error"], str]
    )

_T = struct.Struct("<q")
_T2 = struct.Struct("<qq")  # the spin floor's word and its complement: a torn read never passes as a stamp
STOP = -1


def _pace(interval: float, n: int, send: Callable[[int], object], work: Callable[[], None] | None = None) -> None:
    """Every ``interval``: do what the producer does before publishing (``work``), then stamp and send."""
    for _ in range(n):
        if work is not None:
            work()
        send(time.monotonic_ns())
        time.sleep(interval)
    send(STOP)


def floor_child(
    conn: Connection,
    seg_name: str,
    kind: str,
    shape: tuple[int, ...],
    device: int,
    lib: str,
    ev: tuple[bytes, int] | None,
    out: mpq.Queue[FloorMsg],
) -> None:
    """One floor, in a spawned child: wait the way a consumer waits, then time the bare operation."""
    from ..transport.shm import _open_segment

    fd = conn.fileno()

    seg = _open_segment(seg_name)
    buf = seg.buf
    assert buf is not None
    samples: dict[str, list[int]] = {}
    mono = time.monotonic_ns
    try:
        if kind == "spin":
            get = _T2.unpack_from
            last = get(buf, 0)[0]
            lat: list[int] = []
            out.put(("ready", os.getpid()))
            while True:
                v, check = get(buf, 0)
                if v != last:
                    t = mono()
                    if check != ~v:  # a memcpy can be seen half done: the word and its complement disagree
                        continue
                    if v == STOP:
                        break
                    lat.append(t - v)
                    last = v
            samples["spin"] = lat
        else:
            op = _gpu_ops(shape, device, lib, ev) if kind == "gpu" else None
            wake: list[int] = []
            out.put(("ready", os.getpid()))
            while True:
                data = os.read(fd, 8)
                t = mono()
                (sent,) = _T.unpack(data)
                if sent == STOP:
                    break
                wake.append(t - sent)
                if op is None:  # CPU: a numpy view of a shared-memory slot, made and read
                    t0 = mono()
                    a = np.ndarray(shape, np.uint8, buffer=buf, offset=16)
                    _ = a[0, 0, 0]
                    t1 = mono()
                    del a
                    samples.setdefault("view_read", []).append(t1 - t0)
                else:
                    for k, v in op().items():
                        samples.setdefault(k, []).append(v)
            samples["wake"] = wake
        out.put(("result", samples))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        buf = None
        with contextlib.suppress(Exception):
            seg.close()


def _gpu_ops(
    shape: tuple[int, ...], device: int, lib: str, ev_handle: tuple[bytes, int] | None
) -> Callable[[], dict[str, int]]:
    """The consumer-side driver floors, built once: an imported IPC event, a cached view, an own IPC event."""
    from .measure import GpuLib

    if ev_handle is None:
        raise LinkError("cudalink: the GPU floors need the parent's IPC event")

    g = GpuLib(lib, device)
    g.context()
    dev = devices.device(device)
    drv = driver.bindings()
    imported = driver.import_event(*ev_handle)
    own = driver.new_ipc_event(dev.create_stream())
    n = int(math.prod(shape))
    backing = g.empty((n,), "uint8")
    core = driver.core()
    buf = core.Buffer.from_handle(g.ptr(backing), n, owner=backing)
    view = driver.view_class().from_buffer(buf, shape, dtype=np.dtype("uint8"))
    if lib == "torch":
        import torch

        cs = torch.cuda.current_stream(device).cuda_stream or 1
    else:
        import cupy

        cs = cupy.cuda.get_current_stream().ptr or 1
    stream = driver.cu_stream(cs)
    mono = time.monotonic_ns
    from_dlpack = g.mod.from_dlpack

    def op() -> dict[str, int]:
        t0 = mono()
        drv.cuStreamWaitEvent(stream, imported.handle, 0)
        t1 = mono()
        x = from_dlpack(view)
        t2 = mono()
        del x
        t3 = mono()
        drv.cuEventRecord(own.handle, stream)
        t4 = mono()
        return {"wait_event": t1 - t0, "dlpack_cached": t2 - t1, "wait_dlpack": t2 - t0, "record_ipc_event": t4 - t3}

    return op


def measure(
    backend_device: int, lib: str, shape: tuple[int, ...], frames: int, interval: float, warm: int
) -> dict[str, list[int]]:
    """All floors for this backend, in ns per sample (warm-up samples dropped)."""
    from ..transport.shm import _open_segment, _unlink_segment

    ctx = mp.get_context("spawn")
    size = 16 + int(math.prod(shape))
    name = f"cudalink-floor-{os.getpid()}-{time.monotonic_ns() & 0xFFFFFF:x}"
    seg = _open_segment(name, create=True, size=size)
    assert seg.buf is not None
    out: dict[str, list[int]] = {}
    ev_handle: tuple[bytes, int] | None = None
    keep: list[object] = []
    try:
        if backend_device >= 0:
            dev = devices.device(backend_device)
            s = dev.create_stream()
            ev = driver.new_ipc_event(s)
            keep += [s, ev]
            ev_handle = driver.event_handle(ev)
            out.update({k: v[warm:] for k, v in _producer_ops(backend_device, lib, shape, frames, interval).items()})
        for kind in ("wake", "spin"):
            kind_run = ("gpu" if backend_device >= 0 else "cpu") if kind == "wake" else "spin"
            got = _run_child(ctx, seg, name, kind_run, shape, backend_device, lib, ev_handle, frames, interval)
            for k, v in got.items():
                out[k] = v[warm:]
    finally:
        with contextlib.suppress(Exception):
            seg.close()
        _unlink_segment(name)
    return out


def _run_child(
    ctx: SpawnContext,
    seg: Any,  # an open SharedMemory: its buf, read per frame in the stamp below, is never None here
    name: str,
    kind: str,
    shape: tuple[int, ...],
    device: int,
    lib: str,
    ev_handle: tuple[bytes, int] | None,
    frames: int,
    interval: float,
    k: int = 1,
) -> dict[str, list[int]]:
    """Run ``k`` floor children of ``kind`` side by side, each woken at every beat; their samples pooled."""
    import queue as queue_mod

    q: mpq.Queue[FloorMsg] = ctx.Queue()
    ours: list[Connection] = []
    procs = []
    try:
        for _ in range(k if kind != "spin" else 1):
            mine, theirs = ctx.Pipe(duplex=True)  # a socketpair on POSIX
            p = ctx.Process(
                target=floor_child, args=(theirs, name, kind, shape, device, lib, ev_handle, q), daemon=True
            )
            p.start()
            theirs.close()
            ours.append(mine)
            procs.append(p)
        _T2.pack_into(seg.buf, 0, 0, ~0)
        for _ in procs:
            msg = q.get(timeout=120)
            if msg[0] == "error":
                raise RuntimeError(msg[1])
        time.sleep(0.05)
        work = None
        if device < 0:  # a CPU producer copies each frame into shared memory: the floor pays that too
            frame = np.full(shape, 7, np.uint8)
            slot = np.ndarray(shape, np.uint8, buffer=seg.buf, offset=16)

            def work() -> None:
                np.copyto(slot, frame)

        fds = [c.fileno() for c in ours]

        def wake_all(t: int) -> None:  # as a producer wakes its consumers: one write each, in turn
            data = _T.pack(t)
            for fd in fds:
                os.write(fd, data)

        if kind == "spin":
            _pace(interval, frames, lambda t: _T2.pack_into(seg.buf, 0, t, ~t), work)
        else:
            _pace(interval, frames, wake_all, work)
        del work
        pooled: dict[str, list[int]] = {}
        for _ in procs:
            try:
                msg = q.get(timeout=60)
            except queue_mod.Empty as exc:
                raise RuntimeError(f"floor child '{kind}' sent no result") from exc
            if msg[0] != "result":  # an error ("ready" came first, above)
                raise RuntimeError(f"floor child '{kind}': {msg[1]}")
            for key, v in dict(msg[1]).items():
                pooled.setdefault(key, []).extend(v)
        return pooled
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        for c in ours:
            c.close()


def fanout_wake(k: int, shape: tuple[int, ...], frames: int, interval: float, warm: int, device: int = -1) -> list[int]:
    """The OS's share of a fan-out: ``k`` bare Python processes woken at each beat by one write each on
    their own socketpair (what cudalink's producer does for ``k`` sleeping consumers), the frame copied
    into shared memory first where the bench runs the CPU backend (``device`` < 0); each child's wake
    latencies, warm-up dropped, pooled."""
    from ..transport.shm import _open_segment, _unlink_segment

    ctx = mp.get_context("spawn")
    name = f"cudalink-fanfloor-{os.getpid()}-{time.monotonic_ns() & 0xFFFFFF:x}"
    if device >= 0:  # no host copy per beat on the GPU backend: the children read a few bytes
        shape = (1, 1, 4)
    seg = _open_segment(name, create=True, size=16 + int(math.prod(shape)))
    try:
        # warm-up per child: the first ``warm`` beats of each are dropped, as in the bench's own runs
        got = _run_child(ctx, seg, name, "cpu", shape, device, "numpy", None, frames + warm, interval, k)
        wakes = got.get("wake", [])
        per = frames + warm
        return [w for i in range(0, len(wakes), per) for w in wakes[i + warm : i + per]]
    finally:
        with contextlib.suppress(Exception):
            seg.close()
        _unlink_segment(name)


class CopyRecordFloor:
    """One frame's bare ``cuMemcpyDtoDAsync`` and ``cuEventRecord`` of an IPC event, through cuda.bindings.

    Built once; each call queues one pair on its own stream and returns the time the two calls took.
    The bench also calls it *paired* with its sends, between them: a send and its floor then start
    from the same cache state (the process's own other work, the same sleep before each).
    """

    def __init__(self, device: int, lib: str, shape: tuple[int, ...]) -> None:
        from .measure import GpuLib

        g = GpuLib(lib, device)
        self.stream = devices.device(device).create_stream()
        self.event = driver.new_ipc_event(self.stream)
        self.n = int(math.prod(shape))
        self._bufs = (g.empty((self.n,), "uint8"), g.empty((self.n,), "uint8"))  # kept alive while we copy
        g.sync()
        self._drv = driver.bindings()
        self._s = driver.cu_stream(driver.stream_handle(self.stream))
        self._src, self._dst = g.ptr(self._bufs[0]), g.ptr(self._bufs[1])

    def __call__(self) -> tuple[int, int]:
        """(ns in the copy call, ns in the record call)."""
        drv, mono = self._drv, time.monotonic_ns
        t0 = mono()
        drv.cuMemcpyDtoDAsync(self._dst, self._src, self.n, self._s)
        t1 = mono()
        drv.cuEventRecord(self.event.handle, self._s)
        return t1 - t0, mono() - t1

    def close(self) -> None:
        self.stream.sync()


def _producer_ops(device: int, lib: str, shape: tuple[int, ...], frames: int, interval: float) -> dict[str, list[int]]:
    """The producer's driver floor, at the cadence, in a loop of its own."""
    op = CopyRecordFloor(device, lib, shape)
    copy: list[int] = []
    rec: list[int] = []
    for _ in range(frames):
        a, b = op()
        copy.append(a)
        rec.append(b)
        time.sleep(interval)
    op.close()
    return {"memcpy": copy, "record": rec, "memcpy_record": [a + b for a, b in zip(copy, rec, strict=True)]}
