"""The handoff a GPU pipeline feels, on the GPU's own clock: from the producer's last kernel on a frame to
the consumer's first kernel after ``from_dlpack``.

Two one-thread kernels, loaded from PTX by the driver's JIT (no NVRTC, no cupy, the same in torch and
cupy processes), launched with ``cuLaunchKernel``:

- ``write(frame, log, spin_ns)``, the producer's last kernel on a frame: it spins ``spin_ns`` on
  ``%globaltimer`` (the producer's work), then writes ``%globaltimer`` into the frame's first 8 bytes
  and into the producer's log at the frame's index.
- ``read(frame, out)``, the consumer's first kernel, queued on its stream right after ``from_dlpack``:
  it reads ``%globaltimer`` as it starts, then the frame's first 8 bytes, and stores both.

A frame's handoff is the consumer's start minus the producer's stamp it read. A frame whose consumer read
another stamp than the producer's log holds for it ran before that frame was in place: it is counted as
**unordered** and left out (for cudalink that would be a bug; the stamps check the ordering too). In the
"ahead" cases a frame whose consumer queued its kernel (CPU clock) after the producer's kernel could have
ended is counted as **late**: that frame was not pipelined after all (it is still timed).
``%globaltimer`` is one nanosecond clock for the whole GPU (its resolution is about 1 µs on some cards).

Cases, each at a cadence:

- **ahead** (the pipelined case): the write kernel spins 500 µs (at 60 fps an eighth of the period,
  2.1 ms: :func:`ahead_spin_ns`) and ``send()`` is called at once, before it finished; the consumer is
  woken, receives and queues its kernel while the producer's still runs, so the figure is the GPU's own
  handoff: the copy, the ready event, the consumer's stream wait.
- **behind**: the write kernel spins 0 µs and the producer waits for it (``cuStreamSynchronize``) before
  ``send()``: the figure then holds the CPU's whole path, send to ``recv()`` to the consumer's launch.

Peers and floors, the same kernels:

- ``floor``: one process, two streams, the read kernel's stream waits on one event recorded after the
  write kernel (``floor_copy``: with the same D2D copy of the frame between, which ``send()`` queues);
- cudalink: ``Sender.send(src)`` after the write kernel on P, the producer's current stream (torch copies
  on it; cupy arrays go on the link's stream, ordered after P); a spawned consumer with the default
  ``Receiver`` receives, ``from_dlpack`` (torch or cupy) on its own stream, queues the read kernel;
- ``torch.multiprocessing``: CUDA tensors from a pool of 8 through its ``Queue``; the write kernel on
  torch's default stream (the stream torch's queue thread records its IPC event on), the read kernel
  queued on the consumer's stream right after ``get()``.

Everything runs in a spawned process tree of its own (the bench's parent has a CUDA context), so that it
can also run under MPS: with ``mps=True`` the MPS control daemon is started for a second pass and stopped
again right after it (``echo quit | nvidia-cuda-mps-control``), with its pipe and log directories in a
private temporary directory. Without MPS two processes on one GPU take turns on it (time slices); the
in-process floor has one context and does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from ..cuda import devices, driver
from ..errors import LinkError, ProducerGone

if TYPE_CHECKING:
    import multiprocessing.queues as mpq

    from .measure import GpuLib

#: one-thread stamp kernels; PTX ISA 7.0 / sm_70 JIT-compiles for any card since Volta
PTX = r"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry cudalink_stamp_write(
    .param .u64 p_frame,
    .param .u64 p_log,
    .param .u64 p_spin
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [p_frame];
    ld.param.u64 %rd2, [p_log];
    ld.param.u64 %rd3, [p_spin];
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    mov.u64 %rd6, %globaltimer;
$L_spin:
    mov.u64 %rd7, %globaltimer;
    sub.u64 %rd8, %rd7, %rd6;
    setp.lt.u64 %p1, %rd8, %rd3;
    @%p1 bra $L_spin;
    mov.u64 %rd9, %globaltimer;
    st.global.u64 [%rd4], %rd9;
    st.global.u64 [%rd5], %rd9;
    ret;
}

.visible .entry cudalink_stamp_read(
    .param .u64 p_frame,
    .param .u64 p_out
)
{
    .reg .b64 %rd<7>;

    ld.param.u64 %rd1, [p_frame];
    ld.param.u64 %rd2, [p_out];
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mov.u64 %rd5, %globaltimer;
    ld.volatile.global.u64 %rd6, [%rd3];
    st.global.u64 [%rd4], %rd5;
    st.global.u64 [%rd4+8], %rd6;
    ret;
}
"""

#: the producer's work before its stamp in the "ahead" cases: longer than send() + wake + recv + export
AHEAD_SPIN_NS = 500_000


def ahead_spin_ns(interval: float) -> int:
    """The write kernel's spin in an "ahead" case at a cadence of ``interval`` seconds: AHEAD_SPIN_NS (a
    quarter of the 2 ms period), or an eighth of a longer period. At 60 fps a consumer that slept 16 ms
    takes longer than 500 µs from ``send()`` to its launch (the H100 run of 2026-11-25 counted 97 of 120
    frames late, with MPS): its frames were not pipelined, and the figure held CPU time the case is
    defined without. The late count still says whether the spin was long enough."""
    return max(AHEAD_SPIN_NS, int(interval * 1e9) // 8)


#: torch.multiprocessing's pool of shared tensors, sent round robin
POOL = 8

#: the series, in the order they are printed: (key, what it is)
CASES: tuple[tuple[str, str], ...] = (
    ("floor_ahead", "in-process floor: two streams, one event wait, CPU ahead"),
    ("floor_behind", "in-process floor: two streams, one event wait, CPU behind"),
    ("floor_copy_ahead", "in-process floor + the frame's D2D copy, CPU ahead"),
    ("floor_60fps_ahead", "in-process floor, 60 fps (its kernel's longer spin), CPU ahead"),
    ("send_2ms_ahead", "cudalink send(), 2 ms cadence, CPU ahead (pipelined)"),
    ("send_2ms_behind", "cudalink send(), 2 ms cadence, CPU behind"),
    ("send_60fps_ahead", "cudalink send(), 60 fps, CPU ahead (pipelined)"),
    ("send_60fps_behind", "cudalink send(), 60 fps, CPU behind"),
    ("send_graph_2ms_ahead", "cudalink send() as one CUDA graph (experiment), 2 ms, CPU ahead"),
    ("torchmp_2ms_ahead", "torch.multiprocessing Queue, 2 ms cadence, CPU ahead"),
    ("torchmp_2ms_behind", "torch.multiprocessing Queue, 2 ms cadence, CPU behind"),
)


class Series(TypedDict):
    """One case: its handoffs (ns, ordered frames after the warm-up) and the frames that were not ordered."""

    ns: list[int]
    unordered: int
    frames: int
    #: "ahead" cases across processes: frames whose consumer queued its read kernel (CPU clock) later than
    #: the producer's write kernel could have ended (its launch + its spin): not pipelined after all
    late: int


class Setup(TypedDict):
    """One pass (with or without MPS): its series by key, or why a part could not run."""

    status: str  # "ok" | "skipped" | "error"
    reason: str
    series: dict[str, Series]
    notes: dict[str, str]  # a part that could not run (torch.mp without torch, ...): why


class Plan(TypedDict):
    frame_shape: tuple[int, ...]
    frames_2ms: int
    frames_60fps: int
    warm: int


def plan(quick: bool, frame_shape: tuple[int, ...]) -> Plan:
    if quick:
        return {"frame_shape": frame_shape, "frames_2ms": 150, "frames_60fps": 40, "warm": 10}
    return {"frame_shape": frame_shape, "frames_2ms": 400, "frames_60fps": 120, "warm": 20}


# ============================================================================================= the kernels


class Kernels:
    """The two stamp kernels in the current context, and the device buffers they write."""

    def __init__(self) -> None:
        drv = self._drv = driver.bindings()
        self._image = ctypes.create_string_buffer(PTX.encode())  # NUL-terminated, kept alive
        self._mod = driver.check(drv.cuModuleLoadData(ctypes.addressof(self._image)), "cuModuleLoadData (PTX)")
        self._write = driver.check(drv.cuModuleGetFunction(self._mod, b"cudalink_stamp_write"), "cuModuleGetFunction")
        self._read = driver.check(drv.cuModuleGetFunction(self._mod, b"cudalink_stamp_read"), "cuModuleGetFunction")
        # one void*[3] of pointers to three u64 values: cuLaunchKernel copies them at the launch
        self._vals = (ctypes.c_uint64 * 3)()
        base = ctypes.addressof(self._vals)
        self._ptrs = (ctypes.c_void_p * 3)(base, base + 8, base + 16)
        self._allocs: list[Any] = []

    def write(self, stream: int, frame: int, log: int, spin_ns: int) -> None:
        """Spin ``spin_ns`` on the GPU clock, then stamp the frame's first 8 bytes and ``log`` (8 bytes)."""
        self._launch(self._write, stream, frame, log, spin_ns)

    def read(self, stream: int, frame: int, out: int) -> None:
        """``out[0]``: the GPU clock as the kernel starts; ``out[1]``: the frame's first 8 bytes."""
        self._launch(self._read, stream, frame, out, 0)

    def _launch(self, fn: Any, stream: int, a: int, b: int, c: int) -> None:
        vals = self._vals
        vals[0], vals[1], vals[2] = a, b, c
        params = ctypes.addressof(self._ptrs)
        err = self._drv.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, driver.cu_stream(stream), params, 0)
        driver.check(err, "cuLaunchKernel")

    def alloc(self, nbytes: int) -> int:
        """Zeroed device memory, freed by :meth:`close`."""
        drv = self._drv
        ptr = driver.check(drv.cuMemAlloc(max(nbytes, 16)), "cuMemAlloc")
        self._allocs.append(ptr)
        driver.check(drv.cuMemsetD8(ptr, 0, max(nbytes, 16)), "cuMemsetD8")
        return int(ptr)

    def fetch(self, ptr: int, count: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """``count`` u64 values from device memory (synchronous)."""
        host = np.zeros(max(count, 1), np.uint64)
        if count:
            driver.check(self._drv.cuMemcpyDtoH(host.ctypes.data, ptr, 8 * count), "cuMemcpyDtoH")
        return host[:count]

    def close(self) -> None:
        drv = self._drv
        with contextlib.suppress(Exception):
            drv.cuCtxSynchronize()
        for ptr in self._allocs:
            drv.cuMemFree(ptr)
        self._allocs = []
        drv.cuModuleUnload(self._mod)


def _sync(stream: int) -> None:
    driver.check(driver.bindings().cuStreamSynchronize(driver.cu_stream(stream)), "cuStreamSynchronize")


def _handoffs(
    got: np.ndarray[Any, np.dtype[np.uint64]], index: list[int], log: np.ndarray[Any, np.dtype[np.uint64]]
) -> tuple[list[int], int]:
    """Per consumer sample (start, stamp read) and the producer's frame index: handoffs (ns) and unordered."""
    ns: list[int] = []
    bad = 0
    for k, i in enumerate(index):
        start, stamp = int(got[2 * k]), int(got[2 * k + 1])
        if stamp != int(log[i]) or stamp == 0:
            bad += 1
        else:
            ns.append(start - stamp)
    return ns, bad


# ============================================================================================ the floors


def _floor(k: Kernels, device: int, pl: Plan, interval: float, copy_nbytes: int) -> dict[str, Series]:
    """The same two kernels in this process on two streams, ordered by one event (and, with ``copy``, the copy)."""
    drv = driver.bindings()
    dev = devices.device(device)
    a_obj, b_obj = dev.create_stream(), dev.create_stream()
    a, b = driver.stream_handle(a_obj), driver.stream_handle(b_obj)
    ca, cb = driver.cu_stream(a), driver.cu_stream(b)
    ev = driver.check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    warm = pl["warm"]
    src, dst = k.alloc(copy_nbytes), k.alloc(copy_nbytes)
    out: dict[str, Series] = {}
    try:
        # each cadence its own floor: the 60 fps case's kernel spins longer (ahead_spin_ns), its GPU idles longer
        for key, behind, copy, period, n in (
            ("floor_ahead", False, False, interval, pl["frames_2ms"]),
            ("floor_behind", True, False, interval, pl["frames_2ms"]),
            ("floor_copy_ahead", False, True, interval, pl["frames_2ms"]),
            ("floor_60fps_ahead", False, False, 1 / 60, pl["frames_60fps"]),
        ):
            log, got = k.alloc(8 * n), k.alloc(16 * n)
            for i in range(n):
                k.write(a, src, log + 8 * i, 0 if behind else ahead_spin_ns(period))
                if behind:
                    _sync(a)
                if copy:
                    driver.check(drv.cuMemcpyDtoDAsync(dst, src, copy_nbytes, ca), "cuMemcpyDtoDAsync")
                driver.check(drv.cuEventRecord(ev, ca), "cuEventRecord")
                driver.check(drv.cuStreamWaitEvent(cb, ev, 0), "cuStreamWaitEvent")
                k.read(b, dst if copy else src, got + 16 * i)
                time.sleep(period)
            _sync(a)
            _sync(b)
            ns, bad = _handoffs(k.fetch(got, 2 * n), list(range(n)), k.fetch(log, n))
            out[key] = {"ns": ns[warm:], "unordered": bad, "frames": n, "late": 0}  # queued in order, here
    finally:
        _sync(a)
        _sync(b)
        drv.cuEventDestroy(ev)
    return out


# ============================================================================================ consumers


def _own_stream(g: GpuLib) -> int:
    """A new non-blocking stream of the process's array library, made its current stream. A consumer's
    ``from_dlpack`` orders on it and its read kernel is queued on it; a torch producer's ``send()`` with no
    ``stream=`` copies on it, after its write kernel."""
    if g.is_torch:
        torch = g.mod
        s = torch.cuda.Stream(device=g.ordinal)
        torch.cuda.set_stream(s)
        return int(s.cuda_stream)
    cp = g.mod
    cs = cp.cuda.Stream(non_blocking=True)
    cs.use()
    return int(cs.ptr)


def link_consumer(name: str, device: int, lib: str, nmax: int, out: mpq.Queue[Any]) -> None:
    """cudalink's consumer: recv, ``from_dlpack`` on its stream, the read kernel, release; stamps at the end."""
    from ..link import Receiver
    from .measure import GpuLib, _child_init, _one_line

    _child_init()
    try:
        g = GpuLib(lib, device)
        g.context()
        devices.device(device).set_current()
        k = Kernels()
        s = _own_stream(g)
        buf = k.alloc(16 * nmax)
        seqs: list[int] = []
        launched: list[int] = []  # CLOCK_MONOTONIC once the read kernel is queued
        with Receiver(name, timeout=60.0) as rx:
            out.put(("ready", os.getpid()))
            while True:
                try:
                    f = rx.recv(timeout=60.0)
                except ProducerGone:
                    break
                if len(seqs) >= nmax:
                    f.release()
                    continue
                x = g.from_dlpack(f)  # the consumer's stream waits on the frame's ready event
                k.read(s, g.ptr(x), buf + 16 * len(seqs))
                launched.append(time.monotonic_ns())
                seqs.append(f.seq)
                del x
                f.release()
            _sync(s)
        got = k.fetch(buf, 2 * len(seqs)).tolist()
        k.close()
        out.put(("result", (seqs, got, launched)))
    except BaseException as exc:
        out.put(("error", _one_line(exc)))


def queue_consumer(q: mpq.Queue[Any], device: int, nmax: int, out: mpq.Queue[Any]) -> None:
    """torch.multiprocessing's consumer: ``get()`` a CUDA tensor, the read kernel on its stream right after."""
    from .measure import GpuLib, _child_init, _one_line

    _child_init()
    try:
        import torch.multiprocessing  # noqa: F401  (the CUDA tensor reducers)

        g = GpuLib("torch", device)
        g.context()
        devices.device(device).set_current()
        k = Kernels()
        s = _own_stream(g)
        buf = k.alloc(16 * nmax)
        index: list[int] = []
        launched: list[int] = []
        out.put(("ready", os.getpid()))
        while True:
            item = q.get(timeout=60.0)
            if item is None:
                break
            i, t = item
            if len(index) < nmax:
                k.read(s, g.ptr(t), buf + 16 * len(index))
                launched.append(time.monotonic_ns())
                index.append(int(i))
            del t, item
        _sync(s)
        got = k.fetch(buf, 2 * len(index)).tolist()
        out.put(("result", (index, got, launched)))
        # torch's shared CUDA tensors can crash on teardown (see peers/mpqueue.py): leave without it
        out.close()
        out.join_thread()
        os._exit(0)
    except BaseException as exc:
        out.put(("error", _one_line(exc)))


def _wait(out: mpq.Queue[Any], kind: str, proc: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = out.get(timeout=0.5)
        except queue_mod.Empty:
            if not proc.is_alive():
                raise LinkError(f"cudalink: gpu-clock consumer died (exit code {proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise LinkError(f"cudalink: gpu-clock consumer sent no '{kind}' in {timeout:.0f}s") from None
            continue
        if msg[0] == "error":
            raise LinkError(f"cudalink: gpu-clock consumer failed: {msg[1]}")
        if msg[0] == kind:
            return msg[1]


def _stop(proc: Any) -> None:
    proc.join(timeout=10)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=2)


# ============================================================================================ producers


#: (key, interval s, behind, send()'s GPU work as one CUDA graph: ``_backends.SEND_GRAPH``)
_LINK_PHASES: tuple[tuple[str, float, bool, bool], ...] = (
    ("send_2ms_ahead", 0.002, False, False),
    ("send_2ms_behind", 0.002, True, False),
    ("send_60fps_ahead", 1 / 60, False, False),
    ("send_60fps_behind", 1 / 60, True, False),
    ("send_graph_2ms_ahead", 0.002, False, True),
)


def _link(k: Kernels, g: GpuLib, device: int, lib: str, pl: Plan) -> tuple[dict[str, Series], str]:
    """cudalink across processes: the write kernel on P, then ``send(src)`` with P current; and why the
    CUDA-graph phase fell back to the plain calls, if it did."""
    from .. import _backends
    from ..link import Sender

    ctx = mp.get_context("spawn")
    shape = pl["frame_shape"]
    src = g.empty(shape, "uint8")
    g.sync()
    src_ptr = g.ptr(src)
    p = _own_stream(g)  # the producer's stream, current: send() with no stream= orders after its kernels
    counts = {key: pl["frames_60fps"] if "60fps" in key else pl["frames_2ms"] for key, _, _, _ in _LINK_PHASES}
    total = sum(counts.values())
    log = k.alloc(8 * total)
    of_seq: dict[int, tuple[str, int, int]] = {}  # seq -> (case, frame index in the log, index in its case)
    wrote = [0] * total  # CLOCK_MONOTONIC as each write kernel is queued
    out: mpq.Queue[Any] = ctx.Queue()
    name = f"gpuclock-{os.getpid()}-{time.monotonic_ns() & 0xFFFFFF:x}"
    with Sender(name, shape=shape, dtype="uint8", slots=4, device=device) as tx:
        proc = ctx.Process(target=link_consumer, args=(name, device, lib, total, out), daemon=True)
        proc.start()
        try:
            _wait(out, "ready", proc, 120.0)
            deadline = time.monotonic() + 30
            while tx.stats()["consumers"] < 1:
                if time.monotonic() > deadline:
                    raise LinkError("cudalink: gpu-clock consumer never attached")
                time.sleep(0.002)
            gi = 0
            for key, interval, behind, graph in _LINK_PHASES:
                _backends.SEND_GRAPH = graph
                for j in range(counts[key]):
                    wrote[gi] = time.monotonic_ns()
                    k.write(p, src_ptr, log + 8 * gi, 0 if behind else ahead_spin_ns(interval))
                    if behind:
                        _sync(p)  # the kernel is done before send() is called
                    seq = tx.send(src)  # as a user calls it: torch copies on its current stream, P
                    if seq is not None:
                        of_seq[seq] = (key, gi, j)
                    gi += 1
                    time.sleep(interval)
                _sync(p)
                time.sleep(0.05)
        finally:
            _backends.SEND_GRAPH = False
            graph_error = str(getattr(tx._slots, "graph_error", ""))  # the driver refused the graph: plain calls
            tx.close(timeout=15.0)
        seqs, got, launched = _wait(out, "result", proc, 60.0)
        _stop(proc)
    logged = k.fetch(log, total)
    stamps = np.asarray(got, np.uint64)
    res: dict[str, Series] = {key: {"ns": [], "unordered": 0, "frames": 0, "late": 0} for key, _, _, _ in _LINK_PHASES}
    spin = {key: ahead_spin_ns(interval) for key, interval, _, _ in _LINK_PHASES}
    for n, seq in enumerate(seqs):
        where = of_seq.get(seq)
        if where is None:
            continue
        key, gi, j = where
        ns, bad = _handoffs(stamps[2 * n : 2 * n + 2], [gi], logged)
        series = res[key]
        series["frames"] += 1
        series["unordered"] += bad
        if key.endswith("_ahead") and launched[n] > wrote[gi] + spin[key]:
            series["late"] += 1
        if j >= pl["warm"]:
            series["ns"] += ns
    return res, graph_error


def _torch_mp(k: Kernels, device: int, pl: Plan) -> dict[str, Series]:
    """torch.multiprocessing: the write kernel on torch's default stream, then ``Queue.put(tensor)``."""
    import torch
    import torch.multiprocessing  # the CUDA tensor reducers

    ctx = mp.get_context("spawn")
    n, warm = pl["frames_2ms"], pl["warm"]
    q: mpq.Queue[Any] = ctx.Queue()
    out: mpq.Queue[Any] = ctx.Queue()
    torch.cuda.set_stream(torch.cuda.default_stream(device))  # the stream torch's queue thread records on
    pool = [torch.zeros(pl["frame_shape"], dtype=torch.uint8, device=f"cuda:{device}") for _ in range(POOL)]
    torch.cuda.synchronize(device)
    default = int(torch.cuda.default_stream(device).cuda_stream)  # 0: the legacy default stream
    phases = (("torchmp_2ms_ahead", False), ("torchmp_2ms_behind", True))
    log = k.alloc(8 * n * len(phases))
    wrote = [0] * (n * len(phases))
    proc = ctx.Process(target=queue_consumer, args=(q, device, n * len(phases), out), daemon=True)
    proc.start()
    try:
        _wait(out, "ready", proc, 120.0)
        gi = 0
        for _, behind in phases:
            for _ in range(n):
                t = pool[gi % POOL]
                wrote[gi] = time.monotonic_ns()
                k.write(default, int(t.data_ptr()), log + 8 * gi, 0 if behind else AHEAD_SPIN_NS)
                if behind:
                    _sync(default)
                q.put((gi, t))
                gi += 1
                time.sleep(0.002)
            time.sleep(0.05)
        q.put(None)
        index, got, launched = _wait(out, "result", proc, 120.0)
    finally:
        _stop(proc)
    logged = k.fetch(log, n * len(phases))
    stamps = np.asarray(got, np.uint64)
    res: dict[str, Series] = {}
    for p_i, (key, _) in enumerate(phases):
        pick = [m for m, i in enumerate(index) if p_i * n <= i < (p_i + 1) * n]
        ns: list[int] = []
        bad = late = 0
        for m in pick:
            one, b = _handoffs(stamps[2 * m : 2 * m + 2], [index[m]], logged)
            bad += b
            late += int(key.endswith("_ahead") and launched[m] > wrote[index[m]] + AHEAD_SPIN_NS)
            if index[m] - p_i * n >= warm:
                ns += one
        res[key] = {"ns": ns, "unordered": bad, "frames": len(pick), "late": late}
    return res


# ============================================================================================ one pass


def experiment(device: int, lib: str, pl: Plan, out: mpq.Queue[Any]) -> None:
    """One pass, in a spawned process of its own (not a daemon: it spawns the consumers)."""
    import importlib.util
    import math

    from .measure import GpuLib, _child_init, _one_line

    _child_init()
    try:
        g = GpuLib(lib, device)
        g.context()
        devices.device(device).set_current()
        k = Kernels()
        series: dict[str, Series] = {}
        notes: dict[str, str] = {}
        nbytes = int(math.prod(pl["frame_shape"]))
        series.update(_floor(k, device, pl, 0.002, nbytes))
        link, graph_error = _link(k, g, device, lib, pl)
        series.update(link)
        if graph_error:
            notes["send_graph"] = f"fell back to the plain calls: {graph_error}"
        if importlib.util.find_spec("torch") is None:
            notes["torchmp"] = "torch is not installed"
        else:
            try:
                series.update(_torch_mp(k, device, pl))
            except Exception as exc:
                notes["torchmp"] = f"error: {_one_line(exc)}"
        out.put(("result", (series, notes)))
    except BaseException as exc:
        out.put(("error", _one_line(exc)))
    finally:
        # torch's shared CUDA tensors can crash on teardown (see peers/mpqueue.py): leave without it
        out.close()
        out.join_thread()
        os._exit(0)


def _one_pass(device: int, lib: str, pl: Plan, timeout: float = 180.0) -> Setup:
    ctx = mp.get_context("spawn")
    out: mpq.Queue[Any] = ctx.Queue()
    proc = ctx.Process(target=experiment, args=(device, lib, pl, out), daemon=False)
    proc.start()
    deadline = time.monotonic() + timeout
    msg: tuple[str, Any] = ("error", f"no result in {timeout:.0f}s")
    try:
        while time.monotonic() < deadline:
            try:
                msg = out.get(timeout=0.5)
                break
            except queue_mod.Empty:
                if not proc.is_alive():  # it may have put its message just before it left
                    try:
                        msg = out.get(timeout=2.0)
                    except queue_mod.Empty:
                        msg = ("error", f"the gpu-clock process died (exit code {proc.exitcode})")
                    break
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2)
    if msg[0] != "result":
        return {"status": "error", "reason": str(msg[1]), "series": {}, "notes": {}}
    series, notes = msg[1]
    return {"status": "ok", "reason": "", "series": series, "notes": notes}


@contextlib.contextmanager
def mps_daemon() -> Iterator[str | None]:
    """The MPS control daemon for the block, in a private pipe/log directory; yields None, or why not.

    Its clients find it through ``CUDA_MPS_PIPE_DIRECTORY``, set in this process's environment for the
    block (spawned children inherit it). It is stopped again (``quit``) however the block ends.
    """
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        yield "nvidia-cuda-mps-control is not on PATH"
        return
    tmp = tempfile.mkdtemp(prefix="cudalink-mps-")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": tmp, "CUDA_MPS_LOG_DIRECTORY": tmp}
    saved = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    try:
        started = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        yield f"nvidia-cuda-mps-control -d failed: {exc}"
        return
    if started.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        yield f"nvidia-cuda-mps-control -d exited {started.returncode}: {(started.stderr or started.stdout).strip()}"
        return
    os.environ.update({"CUDA_MPS_PIPE_DIRECTORY": tmp, "CUDA_MPS_LOG_DIRECTORY": tmp})
    try:
        yield None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([exe], input="quit\n", env=env, capture_output=True, text=True, timeout=20)
        time.sleep(1.0)  # the server leaves once its clients have
        shutil.rmtree(tmp, ignore_errors=True)


class GpuClock(TypedDict):
    """The bench report's ``gpu_clock``: each pass by name ("no MPS", "MPS")."""

    status: str
    reason: str
    labels: dict[str, str]
    setups: dict[str, Setup]


def run(device: int, lib: str, frame_shape: tuple[int, ...], quick: bool, mps: bool) -> GpuClock:
    """Every case without MPS, and with it where ``mps`` asks and the daemon starts."""
    pl = plan(quick, frame_shape)
    setups: dict[str, Setup] = {"no MPS": _one_pass(device, lib, pl)}
    if mps:
        with mps_daemon() as why:
            if why is None:
                setups["MPS"] = _one_pass(device, lib, pl)
            else:
                setups["MPS"] = {"status": "skipped", "reason": why, "series": {}, "notes": {}}
    return {"status": "ok", "reason": "", "labels": dict(CASES), "setups": setups}
