"""What a cross-process "frame ready" signal costs on the stream of the copy it follows (GPU, one process).

Issue 35 asks copy-send, one 1080p float32 frame at a time, to reach 95% of a bare ``cuMemcpyDtoDAsync``.
``send()`` queues the copy and then records the slot's IPC ready event on the same stream (where the GPU keeps
up; ``CudaSlots._mark_ready``). This measures, on one stream and timed by the bench's gated CUDA-event pair
(``copysend.make_timer``: GPU time alone), each signal after a copy of the same bytes, against the copy alone:

- ``plain`` / ``timing`` / ``ipc``: ``cuEventRecord`` of an event made with DISABLE_TIMING / timing on /
  INTERPROCESS + DISABLE_TIMING (a slot's ready event; its handle exported, as a link's is);
- ``ipc+blocking``: the same with BLOCKING_SYNC; ``ipc x2``: two IPC records in a row;
- ``write32 dev`` / ``write32 host``: ``cuStreamWriteValue32`` (with its memory barrier) to device memory /
  to page-locked host memory: a signal other than an event, for comparison;
- ``kernel`` / ``kernel+ipc``: the copy as a 16-byte-vector PTX kernel instead of the copy engine.

If every signal another process can see costs about the same after the copy, and a kernel copy pays it
too, then the gap between copy-send one at a time and the bare copy is that signal, not cudalink's code.

    python benchmarks/ready_signal.py [--iters 200] [--device 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: a grid of 256-thread blocks, one 16-byte load and store per thread
PTX = r"""
.version 7.8
.target sm_80
.address_size 64
.visible .entry copy16(.param .u64 p_dst, .param .u64 p_src, .param .u64 p_n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<12>;
    ld.param.u64 %rd1, [p_dst];
    ld.param.u64 %rd2, [p_src];
    ld.param.u64 %rd3, [p_n];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.s64 %rd4, %rd4, %rd5;
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra DONE;
    shl.b64 %rd6, %rd4, 4;
    add.s64 %rd7, %rd2, %rd6;
    add.s64 %rd8, %rd1, %rd6;
    ld.global.nc.v4.u32 {%r4, %r5, %r6, %r7}, [%rd7];
    st.global.v4.u32 [%rd8], {%r4, %r5, %r6, %r7};
DONE:
    ret;
}
"""

SIZES = {"1080p_u8": 1920 * 1080 * 4, "1080p_f32": 1920 * 1080 * 16, "4k_f32": 3840 * 2160 * 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import numpy as np
    from cuda.bindings import driver as drv

    from cudalink.cuda import devices, driver
    from cudalink.tools.copysend import make_timer

    ck = driver.check
    dev = devices.device(args.device)
    dev.set_current()
    stream = dev.create_stream()
    s = driver.stream_handle(stream)
    cs = driver.cu_stream(s)
    flags = drv.CUevent_flags

    def event(*fl: object) -> object:
        return ck(drv.cuEventCreate(sum(int(f) for f in fl)), "cuEventCreate")  # type: ignore[call-overload]

    ipc_flags = (flags.CU_EVENT_INTERPROCESS, flags.CU_EVENT_DISABLE_TIMING)
    ev = {
        "plain": event(flags.CU_EVENT_DISABLE_TIMING),
        "timing": event(flags.CU_EVENT_DEFAULT),
        "ipc": event(*ipc_flags),
        "ipc+blocking": event(*ipc_flags, flags.CU_EVENT_BLOCKING_SYNC),
    }
    second = event(*ipc_flags)
    for name in ("ipc", "ipc+blocking"):
        ck(drv.cuIpcGetEventHandle(ev[name]), "cuIpcGetEventHandle")  # exported, as a slot's ready event is
    word = ck(drv.cuMemAlloc(4), "cuMemAlloc")
    host_word = ck(drv.cuMemHostAlloc(4, 0), "cuMemHostAlloc")
    host_dev = ck(drv.cuMemHostGetDevicePointer(host_word, 0), "cuMemHostGetDevicePointer")
    module = ck(drv.cuModuleLoadData(PTX.encode() + b"\0"), "cuModuleLoadData")
    kernel = ck(drv.cuModuleGetFunction(module, b"copy16"), "cuModuleGetFunction")
    barrier = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    timer = make_timer()
    results: dict[str, dict[str, list[int]]] = {}
    try:
        for size, nbytes in SIZES.items():
            src = ck(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            dst = ck(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
            ck(drv.cuMemcpyHtoD(src, data.ctypes.data, nbytes), "cuMemcpyHtoD")
            n16 = nbytes // 16
            params = (ctypes.c_uint64 * 3)(int(dst), int(src), n16)
            ptrs = (ctypes.c_void_p * 3)(*[ctypes.addressof(params) + 8 * i for i in range(3)])
            grid = (n16 + 255) // 256

            def copy() -> None:
                ck(drv.cuMemcpyDtoDAsync(dst, src, nbytes, cs), "cuMemcpyDtoDAsync")  # noqa: B023

            def kcopy() -> None:
                ck(drv.cuLaunchKernel(kernel, grid, 1, 1, 256, 1, 1, 0, cs, ctypes.addressof(ptrs), 0), "launch")  # noqa: B023

            def then(first: Callable[[], None], *more: Callable[[], None]) -> Callable[[], None]:
                def run() -> None:
                    first()
                    for fn in more:
                        fn()

                return run

            def rec(e: object) -> Callable[[], None]:
                return lambda: driver.record(e, s)  # type: ignore[arg-type]

            def write(ptr: object) -> Callable[[], None]:
                return lambda: ck(drv.cuStreamWriteValue32(cs, ptr, 1, barrier), "cuStreamWriteValue32")

            sides: dict[str, Callable[[], None]] = {"copy": copy}
            sides.update({f"copy+{k}": then(copy, rec(e)) for k, e in ev.items()})
            sides["copy+ipc x2"] = then(copy, rec(ev["ipc"]), rec(second))
            sides["copy+write32 dev"] = then(copy, write(word))
            sides["copy+write32 host"] = then(copy, write(host_dev))
            sides["kernel"] = kcopy
            sides["kernel+ipc"] = then(kcopy, rec(ev["ipc"]))
            kcopy()  # the kernel copies right, or its rows mean nothing
            ck(drv.cuStreamSynchronize(cs), "cuStreamSynchronize")
            back = np.empty(nbytes, np.uint8)
            ck(drv.cuMemcpyDtoH(back.ctypes.data, dst, nbytes), "cuMemcpyDtoH")
            assert np.array_equal(back, data), "the PTX copy kernel copied wrong bytes"
            out: dict[str, list[int]] = {k: [] for k in sides}
            keys = list(sides)
            for i in range(args.iters + 5):  # alternate the order, so no side always follows the same one
                for k in keys if i % 2 == 0 else keys[::-1]:
                    timer.start(s)
                    try:
                        sides[k]()
                    finally:
                        ns = timer.stop(s)  # opens the gate even on an error, or the process hangs at exit
                    if i >= 5:
                        out[k].append(ns)
            results[size] = out
            base = statistics.median(out["copy"])
            print(f"== {size}: {nbytes} B, {args.iters} samples a side; GPU time on the stream, µs")
            print(f"  {'side':20s} {'p50':>8s} {'p10':>8s} {'p90':>8s} {'+p50':>7s} {'copy/side':>9s}")
            for k, v in out.items():
                v = sorted(v)
                med = statistics.median(v)
                p10, p90 = v[len(v) // 10] / 1e3, v[9 * len(v) // 10] / 1e3
                print(f"  {k:20s} {med / 1e3:8.2f} {p10:8.2f} {p90:8.2f} {(med - base) / 1e3:+7.2f} {base / med:9.1%}")
            drv.cuMemFree(src)
            drv.cuMemFree(dst)
    finally:
        stream.sync()
        timer.close()
    if args.json:
        meta = {"device": dev.name, "timing": type(timer).__name__, "iters": args.iters}
        args.json.write_text(json.dumps({"meta": meta, "ns": results}))


if __name__ == "__main__":
    main()
