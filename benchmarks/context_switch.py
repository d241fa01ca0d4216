"""No MPS: how long from the producer's kernel ending to the consumer's kernel starting, across two processes
on one GPU, by how the consumer waits (bare driver calls, no cudalink code).

- ``A``: ``cuStreamWaitEvent`` on the producer's IPC event (what cudalink and torch.multiprocessing do);
- ``C``: ``cuStreamWaitValue32`` on an IPC-mapped word the producer's stream writes after the event;
- ``B``: the consumer's CPU polls ``cuEventQuery`` and launches only once the event fired.

The producer queues a ``spin_ns`` spin kernel, a kernel that writes ``%globaltimer`` into the frame, the event
record and the word write, then tells the consumer through a pipe while that GPU work still runs (the
pipelined case of issue 35's GPU-clock rows). The consumer's kernel reads ``%globaltimer`` as it starts and the
frame's stamp; the difference is the figure. Modes alternate frame by frame; 2 ms between frames.

If all three read the same, the time is the GPU switching between the two processes' contexts (time slices),
which no way of waiting avoids; under MPS the two share one context.

    python benchmarks/context_switch.py [frames=300] [spin_ns=500000]
"""

import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import time

PTX = r"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 p_ns)
{
    .reg .pred %p; .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [p_ns];
    mov.u64 %rd2, %globaltimer;
L:  mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p, %rd4, %rd1;
    @%p bra L;
    ret;
}
.visible .entry wr(.param .u64 p_frame)
{
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [p_frame];
    mov.u64 %rd2, %globaltimer;
    st.global.u64 [%rd1], %rd2;
    ret;
}
.visible .entry rd(.param .u64 p_frame, .param .u64 p_out)
{
    .reg .b64 %rd<5>;
    mov.u64 %rd3, %globaltimer;
    ld.param.u64 %rd1, [p_frame];
    ld.param.u64 %rd2, [p_out];
    ld.volatile.global.u64 %rd4, [%rd1];
    st.global.u64 [%rd2], %rd3;
    st.global.u64 [%rd2+8], %rd4;
    ret;
}
"""


def setup():
    from cuda.bindings import driver as d

    d.cuInit(0)
    dev = d.cuDeviceGet(0)[1]
    ctx = d.cuDevicePrimaryCtxRetain(dev)[1]
    d.cuCtxSetCurrent(ctx)
    mod = d.cuModuleLoadData(PTX.encode() + b"\0")[1]
    fns = {n: d.cuModuleGetFunction(mod, n.encode())[1] for n in ("spin", "wr", "rd")}
    s = d.cuStreamCreate(1)[1]
    return d, fns, s


def launch(d, f, s, *args):
    a = (ctypes.c_uint64 * len(args))(*args)
    p = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) + 8 * i for i in range(len(args))])
    r = d.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, ctypes.addressof(p), 0)[0]
    assert int(r) == 0, r


def consumer(conn, n):
    d, fns, s = setup()
    mh, eh = conn.recv()
    h = d.CUipcMemHandle()
    h.reserved = mh
    frame = int(d.cuIpcOpenMemHandle(h, 1)[1])
    e = d.CUipcEventHandle()
    e.reserved = eh
    ev = d.cuIpcOpenEventHandle(e)[1]
    out = int(d.cuMemAlloc(16 * n)[1])
    modes = []
    conn.send("ready")
    for i in range(n):
        msg = conn.recv()
        mode, k = msg
        if mode == "A":
            d.cuStreamWaitEvent(s, ev, 0)
        elif mode == "C":
            r = d.cuStreamWaitValue32(s, frame + 8, k, d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)[0]
            assert int(r) == 0, r
        elif mode == "B":
            while d.cuEventQuery(ev)[0] == d.CUresult.CUDA_ERROR_NOT_READY:
                pass
        launch(d, fns["rd"], s, frame, out + 16 * i)
        modes.append(mode)
    d.cuStreamSynchronize(s)
    import numpy as np

    host = np.empty(2 * n, np.uint64)
    d.cuMemcpyDtoH(host.ctypes.data, out, 16 * n)
    conn.send((modes, host.tolist()))


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    spin_ns = int(sys.argv[2]) if len(sys.argv) > 2 else 500_000
    ctxm = mp.get_context("spawn")
    a, b = ctxm.Pipe()
    p = ctxm.Process(target=consumer, args=(b, n), daemon=True)
    p.start()
    d, fns, s = setup()
    frame = int(d.cuMemAlloc(1 << 20)[1])
    d.cuMemsetD8(frame, 0, 1 << 20)
    ev = d.cuEventCreate(int(d.CUevent_flags.CU_EVENT_INTERPROCESS) | int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING))[1]
    mh = bytes(d.cuIpcGetMemHandle(frame)[1].reserved)
    eh = bytes(d.cuIpcGetEventHandle(ev)[1].reserved)
    a.send((mh, eh))
    assert a.recv() == "ready"
    W = d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    order = "ACB"
    for i in range(n):
        mode = order[i % 3]
        launch(d, fns["spin"], s, spin_ns)
        launch(d, fns["wr"], s, frame)
        d.cuEventRecord(ev, s)
        d.cuStreamWriteValue32(s, frame + 8, i + 1, W)
        a.send((mode, i + 1))
        time.sleep(0.002 + spin_ns / 1e9)
        d.cuStreamSynchronize(s)
    modes, host = a.recv()
    p.join(10)
    res = {}
    for i, m in enumerate(modes):
        t, v = host[2 * i], host[2 * i + 1]
        if i < 6:
            continue
        res.setdefault(m, []).append((t - v) / 1e3)
    for m, v in sorted(res.items()):
        v.sort()
        bad = sum(1 for x in v if x < 0)
        p10, p90 = v[len(v) // 10], v[9 * len(v) // 10]
        print(f"{m}: n={len(v)} p50 {statistics.median(v):8.1f} us  p10 {p10:8.1f}  p90 {p90:8.1f}  negative {bad}")


if __name__ == "__main__":
    main()
    os._exit(0)
