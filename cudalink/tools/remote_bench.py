"""``python -m cudalink bench --remote``: ucx:// links against the engine's floor, on loopback, in one run.

Rows (each against its floor taken in the same run, between two processes on this host):

- handoff p50/p99, 64x64x4 and 1080p RGBA uint8: the producer's ``send()`` entered -> the remote
  consumer's ``recv()`` returned (producer, ``cudalink serve`` and consumer: three processes), against
  the engine's floor: a bare UCXX send of the same bytes (the 320-byte header and the pixels) as one
  message -> its ``recv``, posted before it came, completed (two processes). Beside it, the same bytes
  as two messages, the pixels received once the header has arrived (what a UCXX user who sends a
  header first writes, and what cudalink does for frames over ``ucx_wire.INLINE_MAX``). Clocks: the
  system-wide monotonic clock, read in both processes.
- throughput, 1080p and 4K RGBA uint8, ``latest=False``, the producer sending as fast as the consumer
  takes: fps and GB/s, against the bare UCXX stream of the same bytes and a plain TCP socket
  (``sendall``/``recv_into``).
- on a GPU host also GPU producer -> GPU consumer fps and GB/s, 1080p and 4K, against the GPU's own
  device-to-device copy of the same bytes (``cuMemcpyDtoDAsync``), reported as is; and the same with the
  server staging GPU frames through host memory (``CUDALINK_UCX_STAGE=host``: what a consumer on another
  host without RDMA gets), against the bare UCXX host stream above.

``UCX_TLS`` is left to the user (``tcp`` forces TCP; on a GPU host ``tcp,cuda_copy[,cuda_ipc]``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..transport import ucx_engine
from ..transport.ucx_source import CREDITS
from .ui import print_then_json

SIZES = {"64x64x4": (64, 64, 4), "1080p": (1080, 1920, 4), "4K": (2160, 3840, 4)}
STAMP = struct.Struct("<Qq")  # seq, monotonic ns at send


def _child(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cudalink.tools.remote_bench", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _wait_line(p: subprocess.Popen[str], prefix: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"cudalink bench --remote: a child exited before {prefix!r}")
        if line.startswith(prefix):
            return line.strip()
    raise RuntimeError(f"cudalink bench --remote: no {prefix!r} within {timeout}s")


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs)
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)), "n": len(xs)}


# -- cudalink: producer process (with serve=), consumer here ----------------------------------------------------


def connect(port: int, name: str, within: float = 30.0, **kw: Any) -> Any:
    """A Receiver of the producer's link on ``port`` once its server answers (it starts with the producer),
    trying for up to ``within`` seconds (then the last LinkTimeout)."""
    import cudalink

    deadline = time.monotonic() + within
    while True:
        try:
            return cudalink.Receiver(f"ucx://127.0.0.1:{port}/{name}", timeout=2.0, **kw)
        except cudalink.LinkTimeout:
            if time.monotonic() > deadline:
                raise


#: how often the stream rows' host producer offers a frame (2,000 fps, above any host stream here). Flat out it
#: wrote frames as fast as a core could (most of them never taken), and on a 2-vCPU VM that core was one the
#: stream's two ends needed: the server ran at 30% of a core, not 94% (2026-11-27: 166 fps flat out against 224
#: paced, the bare stream 216)
STREAM_PERIOD_S = 0.0005
#: slots of the rows' producer: its server sends from each in turn, and the stream floor sends from as many
#: buffers in turn (see :func:`bare_stream`)
PRODUCER_SLOTS = 4


def _producer(
    name: str, shape: str, port: int, period: float, seconds: float, device: str = "cpu", write: str = "copy"
) -> None:
    """A ``serve=`` Sender offering a frame each ``period`` (0: flat out) for ``seconds``: ``write="copy"`` sends
    a host array (``send()``, as an application does), ``"as-is"`` commits the slot as it stands (``reserve()``:
    the bytes on the wire are what is measured; a GPU producer always does)."""
    import cudalink

    shp = tuple(int(x) for x in shape.split(","))
    src = np.zeros(shp, np.uint8)
    dev: str | int = device if device == "cpu" else int(device)
    with cudalink.Sender(name, shape=shp, slots=PRODUCER_SLOTS, device=dev, serve=f"ucx://127.0.0.1:{port}") as tx:
        sys.stdout.write("ready\n")  # one write: a server we spawned shares this stdout
        sys.stdout.flush()
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        while time.monotonic() < end:
            meta = STAMP.pack(tx.seq + 1, time.monotonic_ns())
            if dev == "cpu" and write == "copy":
                tx.send(src, meta=meta)
            else:  # the frame as it stands in the slot: the bytes on the wire are what is measured
                try:
                    with tx.reserve(meta=meta):
                        pass
                except cudalink.LinkTimeout:  # every slot on the wire: the server holds them
                    time.sleep(0.0005)
            if period:
                nxt += period
                time.sleep(max(0.0, nxt - time.monotonic()))


def _start_producer(
    shape: tuple[int, ...], period: float, seconds: float, device: str, write: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int, str]:
    """A :func:`_producer` child serving a link of its own on a free port: (the process, the port, the name)."""
    port = ucx_engine.free_port()
    name = f"rbench{os.getpid()}{time.monotonic_ns() % 10**6}"
    shp = ",".join(map(str, shape))
    p = _child("producer", name, shp, str(port), str(period), str(seconds), device, write, env=env)
    return p, port, name


def cudalink_handoff(shape: tuple[int, ...], frames: int, period: float, write: str = "copy") -> dict[str, float]:
    """Latency per frame, from the producer's stamp to ``recv()`` returned here (``wait="block"``).
    ``write``: as for :func:`_producer` (``"copy"``: ``send()`` of a host array, whose copy into the slot is
    inside the span; ``"as-is"``: the slot committed as it stands, the bytes in place as the floor's are)."""
    p, port, name = _start_producer(shape, period, frames * period + 30, "cpu", write)
    try:
        _wait_line(p, "ready")
        rx = connect(port, name, device="cpu", wait="block")
        lat = []
        with rx:
            for _ in range(20):  # warm-up
                rx.recv(timeout=10).release()
            for _ in range(frames):
                f = rx.recv(timeout=10)
                now = time.monotonic_ns()
                lat.append((now - STAMP.unpack(f.meta)[1]) / 1e3)
                f.release()
        return _pct(lat)
    finally:
        p.terminate()
        p.wait(10)


#: rounds of the host stream rows (cudalink, then the bare stream, then TCP, in turn): on one lent H100 the share
#: of a single pair moved from 76% to 121% between runs of one session (2026-11-26), a slower drift of the
#: machine than any change measured; the row gives the median share of its rounds, and each round's share
STREAM_ROUNDS = 3
STREAM_ROUNDS_QUICK = 2


def stream_rounds(shape: tuple[int, ...], secs: float, rounds: int) -> dict[str, Any]:
    """The host stream row: ``rounds`` of cudalink, the bare UCXX stream (from and into as many buffers in
    turn as cudalink's producer slots and landing buffers: the goal reads this one), the bare stream with one
    buffer at each end, and plain TCP, in turn, each pair read against itself; fps and GB/s are the medians,
    ``share_of_bare`` the median of the rounds' shares (``share_of_one``: against the one-buffer stream)."""
    nbytes = int(np.prod(shape))
    got: list[dict[str, dict[str, float]]] = []
    for _ in range(rounds):
        c = cudalink_stream(shape, secs)
        count = max(20, int(c["fps"] * secs))
        got.append(
            {
                "cudalink": c,
                "bare_ucxx": bare_stream(nbytes, count, PRODUCER_SLOTS, CREDITS),
                "bare_ucxx_one": bare_stream(nbytes, count),
                "tcp": tcp_stream(nbytes, count),
            }
        )
    shares = [g["cudalink"]["fps"] / g["bare_ucxx"]["fps"] for g in got]

    def median(side: str) -> dict[str, float]:
        return {k: float(np.median([g[side][k] for g in got])) for k in ("fps", "GBps")}

    row: dict[str, Any] = {side: median(side) for side in ("cudalink", "bare_ucxx", "bare_ucxx_one", "tcp")}
    row["buffers"] = {"sender": PRODUCER_SLOTS, "receiver": CREDITS}
    row["share_of_bare"] = float(np.median(shares))
    row["shares"] = shares
    row["share_of_one"] = float(np.median([g["cudalink"]["fps"] / g["bare_ucxx_one"]["fps"] for g in got]))
    return row


def cudalink_stream(
    shape: tuple[int, ...], seconds: float, device: str = "cpu", env: dict[str, str] | None = None
) -> dict[str, float]:
    """Frames per second and GB/s, ``latest=False``; ``device``: where both the producer's link and the
    consumer's landing buffers live ("cpu", or a GPU ordinal: GPU to GPU through UCX's CUDA transports).
    ``env``: for the producer and its server (``CUDALINK_UCX_STAGE``)."""
    period = STREAM_PERIOD_S if device == "cpu" else 0.0
    p, port, name = _start_producer(shape, period, seconds + 30, device, "as-is", env)
    where: str | int = device if device == "cpu" else int(device)
    try:
        _wait_line(p, "ready")
        rx = connect(port, name, device=where, latest=False)
        with rx:
            for _ in range(5):
                rx.recv(timeout=10).release()
            n = 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                rx.recv(timeout=10).release()
                n += 1
            dt = time.monotonic() - t0
        nbytes = int(np.prod(shape))
        return {"fps": n / dt, "GBps": n * nbytes / dt / 1e9}
    finally:
        p.terminate()
        p.wait(10)


# -- the bare engine: a UCXX sender process, a receiver here --------------------------------------------------


HEAD_BYTES = 320  # ucx_wire.MSG_SIZE: the header cudalink sends with each frame


def touched(n: int) -> bytearray:
    """``n`` bytes of memory of their own for a floor to send. A large ``bytearray(n)`` or ``np.zeros`` maps the
    kernel's one zero page until written, and a sender then reads every frame from the cache: the bare UCXX
    stream sent 3-28% more 1080p frames from it than from written memory (three rounds, 2-vCPU VM, 2026-11-27),
    where cudalink's server sends from the producer's slot, which is written."""
    buf = bytearray(n)
    np.frombuffer(buf, np.uint8)[:] = 1
    return buf


def _endpoint(api: str, port: int) -> Any:
    """A connection to the floor's receiver: on UCXX's core API as cudalink drives it (``core``), or on
    UCXX's asyncio API (``asyncio``, its progress thread: what a UCXX user writes first)."""
    if api == "asyncio":
        return ucx_engine.init_asyncio().create_endpoint("127.0.0.1", port)
    return ucx_engine.core_here().connect("127.0.0.1", port, 30.0)


def _listener(api: str, handler: Any, port: int) -> Any:
    """The floor's receiving side, on the running loop (the API as in :func:`_endpoint`); keep it alive."""
    if api == "asyncio":
        return ucx_engine.init_asyncio().create_listener(handler, port=port)
    return ucx_engine.core_here().listen(handler, port)


def _bare_sender(
    port: int, nbytes: int, period: float, count: int, one: bool = False, api: str = "core", buffers: int = 1
) -> None:
    """The floor's sending process: a header and ``nbytes`` (``one``: as one message) ``count`` times, the
    payload from ``buffers`` buffers in turn."""

    async def main() -> None:
        ep = await _endpoint(api, port)
        head = bytearray(HEAD_BYTES)
        payloads = [np.frombuffer(touched(nbytes), np.uint8) for _ in range(buffers)]
        whole = touched(HEAD_BYTES + nbytes) if one else bytearray(0)
        ack = bytearray(8)
        nxt = time.monotonic()
        for i in range(count):
            if not period and i >= CREDITS:  # a window of CREDITS frames, one back per frame: cudalink's credits
                await ep.recv(ack)
            if one:
                STAMP.pack_into(whole, 0, i, time.monotonic_ns())
                await ep.send(whole)
            else:
                STAMP.pack_into(head, 0, i, time.monotonic_ns())
                await ep.send(head)
                await ep.send(payloads[i % buffers])
            if period:
                nxt += period
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        for _ in range(0 if period else min(count, CREDITS)):  # the window's last credits
            await ep.recv(ack)
        await ep.recv(ack)

    asyncio.run(main())


async def _bare_receive(
    ep: Any, nbytes: int, count: int, period: float, one: bool, landings: int = 1
) -> tuple[list[float], float]:
    """The floor's receiving side on one connection: ``count`` header+payload pairs, the payloads into
    ``landings`` buffers in turn; streaming, a credit back for each (the sender's window), and one at the end."""
    head = bytearray(HEAD_BYTES)
    bufs = [np.empty(nbytes, np.uint8) for _ in range(landings)]
    whole = bytearray(HEAD_BYTES + nbytes) if one else head
    lat: list[float] = []
    t0 = 0.0
    for i in range(count):
        await ep.recv(whole)
        if not one:
            await ep.recv(bufs[i % landings])
        now = time.monotonic_ns()
        if i == 0:
            t0 = time.monotonic()
        lat.append((now - STAMP.unpack_from(whole)[1]) / 1e3)
        if not period:
            await ep.send(bytearray(8))
    took = time.monotonic() - t0
    await ep.send(bytearray(8))
    return lat, took


def _bare(
    nbytes: int, count: int, period: float, one: bool = False, api: str = "core", buffers: int = 1, landings: int = 1
) -> tuple[list[float], float]:
    """Receive ``count`` header+payload pairs (``one``: as one message each, its receive posted ahead) from
    a bare sender process; latencies (µs) and seconds taken. ``api``: see :func:`_endpoint`; ``buffers`` /
    ``landings``: how many buffers the payloads come from / go to, in turn."""
    eng = ucx_engine.engine()
    port = ucx_engine.free_port()
    done: asyncio.Future[tuple[list[float], float]] | None = None

    async def serve() -> tuple[list[float], float]:
        nonlocal done
        done = asyncio.get_running_loop().create_future()

        async def handler(ep: Any) -> None:
            got = await _bare_receive(ep, nbytes, count, period, one, landings)
            assert done is not None
            done.set_result(got)

        listener = _listener(api, handler, port)
        print_ready.set()
        try:
            return await asyncio.wait_for(done, 600)
        finally:
            del listener

    import threading

    print_ready = threading.Event()
    fut = eng.submit(serve())
    print_ready.wait(30)
    p = _child("bare", str(port), str(nbytes), str(period), str(count), str(int(one)), api, str(buffers))
    try:
        return fut.result(600)
    finally:
        p.wait(30)


def bare_handoff(nbytes: int, frames: int, period: float, one: bool = True, api: str = "core") -> dict[str, float]:
    lat, _ = _bare(nbytes, frames + 20, period, one, api)
    return _pct(lat[20:])


def bare_stream(nbytes: int, count: int, buffers: int = 1, landings: int = 1) -> dict[str, float]:
    """The engine's own stream of ``count`` frames, flat out with a window of ``CREDITS`` frames, a credit back
    for each (until 2026-11-27 the sender stopped for an ack after each third: no frame moved meanwhile, where
    cudalink's server always had credits left at 4K and beat that floor by 15%). ``buffers`` / ``landings``:
    the buffers it sends from / receives into, in turn. cudalink's server sends from each slot of the
    producer's ring and its consumer lands into its own few buffers: a floor that reused one buffer at each
    end sent 15-18% more 1080p frames than one rotating four (2-vCPU VM, 2026-11-27), memory that a real
    producer's frames never share, so the goal reads the stream with as many buffers as cudalink has."""
    _, took = _bare(nbytes, count, 0.0, buffers=buffers, landings=landings)
    return {"fps": (count - 1) / took, "GBps": (count - 1) * nbytes / took / 1e9}


def bare_d2d(nbytes: int, count: int = 50, device: int = 0) -> dict[str, float]:
    """The GPU's own device-to-device copy of the same bytes (cuMemcpyDtoDAsync, one stream): the floor the
    GPU rows are read against."""
    from ..cuda import devices, driver

    with devices.keep_current():
        dev = devices.device(device)
        drv = driver.bindings()
        a = driver.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
        b = driver.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
        stream = dev.create_stream()
        cs = driver.cu_stream(driver.stream_handle(stream))
        try:
            for _ in range(5):
                driver.check(drv.cuMemcpyDtoDAsync(b, a, nbytes, cs), "cuMemcpyDtoDAsync")
            stream.sync()
            t0 = time.perf_counter()
            for _ in range(count):
                driver.check(drv.cuMemcpyDtoDAsync(b, a, nbytes, cs), "cuMemcpyDtoDAsync")
            stream.sync()
            took = time.perf_counter() - t0
        finally:
            drv.cuMemFree(a)
            drv.cuMemFree(b)
            del stream
    return {"fps": count / took, "GBps": count * nbytes / took / 1e9}


def _gpu_here() -> bool:
    try:
        from ..cuda import devices

        devices.device(0)
    except Exception:
        return False
    return True


# -- a plain TCP socket ------------------------------------------------------------------------------------------


def _tcp_sender(port: int, nbytes: int, count: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = touched(nbytes)
    for _ in range(count):
        s.sendall(payload)
    s.recv(1)
    s.close()


def tcp_stream(nbytes: int, count: int) -> dict[str, float]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    p = _child("tcp", str(ls.getsockname()[1]), str(nbytes), str(count))
    c, _ = ls.accept()
    buf = memoryview(bytearray(nbytes))
    t0 = 0.0
    for i in range(count):
        got = 0
        while got < nbytes:
            got += c.recv_into(buf[got:])
        if i == 0:
            t0 = time.monotonic()
    took = time.monotonic() - t0
    c.send(b"x")
    c.close()
    ls.close()
    p.wait(30)
    return {"fps": (count - 1) / took, "GBps": (count - 1) * nbytes / took / 1e9}


# -- the run ---------------------------------------------------------------------------------------------------


def run(quick: bool = False, gpu: bool | None = None, device: int = 0) -> dict[str, Any]:
    """The remote rows. ``gpu``: also the GPU rows (None: where a GPU is here and the run is not quick; a quick
    run says it left them out); ``device``: the GPU they run on."""
    import secrets

    os.environ.setdefault("CUDALINK_KEY", secrets.token_hex(32))  # this run's own key, for its children too
    frames = 100 if quick else 500
    secs = 2.0 if quick else 5.0
    out: dict[str, Any] = {
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX's choice)"),
        "progress": "core API, woken by its epoll fd",
        "asyncio_progress": os.environ.get("CUDALINK_UCX_PROGRESS", ucx_engine.PROGRESS),
        "handoff": {},
        "stream": {},
    }
    for label in ("64x64x4", "1080p"):
        shape = SIZES[label]
        nbytes = int(np.prod(shape))
        period = 0.005 if label == "64x64x4" else 0.02
        # the goal's row: the frame written in its slot (reserve()) and committed, as the floor sends bytes
        # already in memory; send() copies the host array in first, inside the span (1080p: 0.4-1 ms on the
        # 2-vCPU VM, 2026-11-27), reported beside it
        c = cudalink_handoff(shape, frames, period, write="as-is")
        cs = cudalink_handoff(shape, frames, period, write="copy")
        b = bare_handoff(nbytes, frames, period, one=True)
        b2 = bare_handoff(nbytes, frames, period, one=False)
        ba = bare_handoff(nbytes, frames, period, one=True, api="asyncio")
        out["handoff"][label] = {
            "cudalink": c,
            "cudalink_send": cs,
            "bare_ucxx": b,  # the floor the goal reads: the same bytes as one message, UCXX's core API
            "bare_ucxx_two": b2,
            "bare_ucxx_asyncio": ba,  # the same one message on UCXX's asyncio API (the floor until 2026-11-26)
            "ratio_p50": c["p50_us"] / b["p50_us"],
            "ratio_p50_send": cs["p50_us"] / b["p50_us"],
            "ratio_p50_two": c["p50_us"] / b2["p50_us"],
            "ratio_p50_asyncio": c["p50_us"] / ba["p50_us"],
        }
    for label in ("1080p", "4K"):
        out["stream"][label] = stream_rounds(SIZES[label], secs, STREAM_ROUNDS_QUICK if quick else STREAM_ROUNDS)
    if gpu is None:
        gpu = not quick and _gpu_here()
        if quick and _gpu_here():
            out["gpu_skipped"] = "--quick leaves the GPU rows out (run without it for them)"
    if gpu:  # GPU producer -> GPU consumer through UCX's CUDA transports, against the GPU's own D2D copy
        out["gpu_stream"] = {}
        for label in ("1080p", "4K"):
            shape = SIZES[label]
            try:
                c = cudalink_stream(shape, secs, device=str(device))
                d = bare_d2d(int(np.prod(shape)), device=device)
            except Exception as exc:  # the host rows above still stand
                out["gpu_stream_error"] = f"{label}: {type(exc).__name__}: {exc}"
                break
            out["gpu_stream"][label] = {"cudalink": c, "d2d": d, "share_of_d2d": c["GBps"] / d["GBps"]}
        out["gpu_staged"] = {}
        for label in ("1080p", "4K"):
            shape = SIZES[label]
            try:
                c = cudalink_stream(shape, secs, device=str(device), env={"CUDALINK_UCX_STAGE": "host"})
            except Exception as exc:
                out["gpu_staged_error"] = f"{label}: {type(exc).__name__}: {exc}"
                break
            b = out["stream"][label]["bare_ucxx"]
            out["gpu_staged"][label] = {"cudalink": c, "bare_ucxx_host": b, "share_of_bare": c["fps"] / b["fps"]}
    return out


def print_report(r: dict[str, Any]) -> None:
    print(
        f"cudalink bench --remote · UCX_TLS={r['ucx_tls']} · cudalink and the floor: UCXX core API"
        f" · asyncio floor: progress={r.get('asyncio_progress', r['progress'])}"
    )
    print(
        f"{'handoff':<10} {'cudalink p50/p99 µs':>22} {'bare, 1 msg p50/p99':>22} {'ratio p50':>10} (goal <= 1.3x)"
        f" {'send() p50/p99':>22} {'ratio p50':>10}"
        f" {'bare, 2 msgs p50/p99':>22} {'ratio p50':>10} {'asyncio, 1 msg':>22} {'ratio p50':>10}"
    )
    nan = {"p50_us": float("nan"), "p99_us": float("nan")}
    for label, row in r["handoff"].items():
        c, b = row["cudalink"], row["bare_ucxx"]
        cs = row.get("cudalink_send") or nan
        b2 = row.get("bare_ucxx_two") or nan
        ba = row.get("bare_ucxx_asyncio") or nan
        print(
            f"{label:<10} {c['p50_us']:>10.0f} / {c['p99_us']:<9.0f} {b['p50_us']:>10.0f} / {b['p99_us']:<9.0f}"
            f" {row['ratio_p50']:>9.2f}x {'':13} {cs['p50_us']:>10.0f} / {cs['p99_us']:<9.0f}"
            f" {row.get('ratio_p50_send', float('nan')):>9.2f}x {b2['p50_us']:>10.0f} / {b2['p99_us']:<9.0f}"
            f" {row.get('ratio_p50_two', float('nan')):>9.2f}x"
            f" {ba['p50_us']:>10.0f} / {ba['p99_us']:<9.0f} {row.get('ratio_p50_asyncio', float('nan')):>9.2f}x"
        )
    if any("cudalink_send" in row for row in r["handoff"].values()):
        print(
            f"{'':<10} cudalink: the frame written in its slot and committed (reserve()), as the floor sends bytes"
            " in place; send(): a host array sent, its copy into the slot inside the span (as is)"
        )
    print(
        f"{'stream':<10} {'cudalink fps (GB/s)':>22} {'bare UCXX fps (GB/s)':>22} {'1 buffer fps':>13}"
        f" {'TCP fps (GB/s)':>18} share (>= 90%)"
    )
    for label, row in r["stream"].items():
        c, b, t = row["cudalink"], row["bare_ucxx"], row["tcp"]
        one = row.get("bare_ucxx_one") or {"fps": float("nan")}
        print(
            f"{label:<10} {c['fps']:>12.1f} ({c['GBps']:.2f}) {b['fps']:>12.1f} ({b['GBps']:.2f}) {one['fps']:>13.1f}"
            f" {t['fps']:>10.1f} ({t['GBps']:.2f}) {row['share_of_bare']:>6.0%}{_rounds_cell(row)}"
        )
    first: dict[str, Any] = next(iter(r["stream"].values()), {})
    bufs = first.get("buffers")
    if bufs:
        print(
            f"{'':<10} bare UCXX: from {bufs['sender']} buffers in turn into {bufs['receiver']}, as cudalink's producer"
            " slots and landing buffers; 1 buffer: one at each end (as is); TCP: one at each end (as is)"
        )
    parts: tuple[tuple[str, str, str, str, Callable[[dict[str, Any]], str], str], ...] = (
        ("gpu_stream", "GPU->GPU", "bare D2D copy GB/s", "share of D2D (as is)", _d2d_cell, "share_of_d2d"),
        ("gpu_staged", "staged", "bare UCXX host", "share (as across hosts on TCP)", _host_cell, "share_of_bare"),
    )
    if r.get("gpu_skipped"):
        print(f"GPU rows: {r['gpu_skipped']}")
    for key, title, ref, share, ref_cell, share_key in parts:
        if r.get(f"{key}_error"):
            print(f"{title} rows failed: {r[f'{key}_error']}")
        for i, (label, row) in enumerate((r.get(key) or {}).items()):
            if i == 0:
                print(f"{title:<10} {'cudalink fps (GB/s)':>22} {ref:>22} {share}")
            print(f"{label:<10} {_rate(row['cudalink'])} {ref_cell(row)} {row[share_key]:>8.1%}")


def _rounds_cell(row: dict[str, Any]) -> str:
    shares = row.get("shares") or []
    return f" (median of {len(shares)} rounds: {', '.join(f'{x:.0%}' for x in shares)})" if len(shares) > 1 else ""


def _rate(x: dict[str, float]) -> str:
    return f"{x['fps']:>12.1f} ({x['GBps']:.2f})"


def _d2d_cell(row: dict[str, Any]) -> str:
    return f"{row['d2d']['GBps']:>22.1f}"


def _host_cell(row: dict[str, Any]) -> str:
    return _rate(row["bare_ucxx_host"])


def cmd_remote_bench(args: argparse.Namespace) -> int:
    ucx_engine.load()  # no UCXX: one line naming the extra, before any child is started
    device = str(getattr(args, "device", None) or "auto")
    if device in ("cpu", "auto"):
        r = run(quick=bool(getattr(args, "quick", False)), gpu=False if device == "cpu" else None)
    else:  # a GPU named outright: its rows run, on that GPU, quick or not
        from ..cuda import devices

        ordinal = int(device) if device.isdigit() else devices.parse_device(device)  # "0" as the help says
        r = run(quick=bool(getattr(args, "quick", False)), gpu=True, device=ordinal)
    print_then_json(print_report, r, getattr(args, "json", None))
    return 0


def _main() -> None:
    role, *rest = sys.argv[1:]
    if role == "producer":
        from .ui import Stopped, sigterm_stops

        name, shape, port, period, seconds, *device_and_write = rest
        # the bench ends its producer with SIGTERM: its Sender then closes (and its server stops), where a
        # kill left each run's link behind in /dev/shm (130 MB at 4K) until a `cudalink clean`
        with contextlib.suppress(Stopped), sigterm_stops():
            _producer(name, shape, int(port), float(period), float(seconds), *device_and_write)
    elif role == "bare":
        port, nbytes, period, count, one, api, buffers = rest
        _bare_sender(int(port), int(nbytes), float(period), int(count), bool(int(one)), api, int(buffers))
    elif role == "tcp":
        port, nbytes, count = rest
        _tcp_sender(int(port), int(nbytes), int(count))
    sys.stdout.flush()
    os._exit(0)  # UCX's progress thread can keep an interpreter from exiting


if __name__ == "__main__":
    _main()
