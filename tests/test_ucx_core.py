"""``ucx_engine.Core``: UCXX's core API progressed by an asyncio loop, woken by the worker's epoll fd.

Two Cores in one process (each on its own loop: the engine's daemon thread, and a loop of the test's
own), or a Core against a peer on UCXX's asyncio API, over TCP on 127.0.0.1. Each test takes a fresh port.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("ucxx", reason='ucxx is not installed: pip install "cudalink[ucx]" (Linux, Python 3.11+)')

os.environ.setdefault("UCX_TLS", "tcp")
os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"

from cudalink.tools import remote_bench  # noqa: E402
from cudalink.transport import ucx_engine, ucx_wire  # noqa: E402

Handler = Callable[[ucx_engine.Endpoint], Awaitable[Any]]


def _serve(handler: Handler, asyncio_api: bool = False) -> tuple[int, Any]:
    """Listen on the engine's loop (its Core, or UCXX's asyncio API there); the handler's result comes back
    through the returned concurrent future."""
    eng = ucx_engine.engine()
    port = ucx_engine.free_port()
    listening = threading.Event()

    async def main() -> Any:
        done = asyncio.get_running_loop().create_future()

        async def on_ep(ep: Any) -> None:
            try:
                done.set_result(await handler(ep))
            except Exception as exc:
                done.set_exception(exc)

        listener = remote_bench._listener("asyncio" if asyncio_api else "core", on_ep, port)
        listening.set()
        try:
            return await asyncio.wait_for(done, 60)
        finally:
            del listener

    fut = eng.submit(main())
    assert listening.wait(30)
    return port, fut


def _client(port: int, body: Callable[[ucx_engine.Endpoint], Awaitable[Any]]) -> Any:
    """Connect from a Core on a loop of this thread's own, run ``body``."""

    async def main() -> Any:
        core = ucx_engine.core_here()
        ep = await core.connect("127.0.0.1", port, 10.0)
        try:
            return await body(ep)
        finally:
            await asyncio.sleep(0.05)  # let what we sent leave before the endpoint goes
            ep.abort()

    return asyncio.run(main())


SIZES = [1, ucx_wire.MSG_SIZE, ucx_engine.EAGER_MAX, ucx_engine.EAGER_MAX + 1, 3 << 20]


def test_messages_of_every_protocol_arrive_whole_and_in_order() -> None:
    """Eager sizes, the threshold on both sides, and a rendezvous one: each lands intact, in the order sent."""

    async def server(ep: ucx_engine.Endpoint) -> list[bytes]:
        got = []
        for n in SIZES:
            buf = bytearray(n)
            await ep.recv(buf)
            got.append(bytes(buf))
        await ep.send(b"done")
        return got

    port, fut = _serve(server)
    rng = np.random.default_rng(7)
    sent = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES]

    async def body(ep: ucx_engine.Endpoint) -> bytes:
        await asyncio.gather(*(ep.send(m) for m in sent))  # all posted at once: UCX keeps their order
        ack = bytearray(4)
        await ep.recv(ack)
        return bytes(ack)

    assert _client(port, body) == b"done"
    assert fut.result(30) == sent


def test_a_longer_message_than_the_buffer_is_a_protocol_error() -> None:
    async def server(ep: ucx_engine.Endpoint) -> str:
        buf = bytearray(ucx_wire.MSG_SIZE)
        try:
            await ucx_engine.recv_msg(ep, buf, 10.0)
        except Exception as exc:
            return type(exc).__name__
        return "received"

    port, fut = _serve(server)
    _client(port, lambda ep: ep.send(bytes(ucx_wire.MSG_SIZE + 1)))
    assert fut.result(30) == "ProtocolError"


def test_a_message_sent_just_before_the_peer_went_is_still_received() -> None:
    """The peer sends and aborts at once: its message waits on our worker, and our receive posted after the
    endpoint failed still gets it (then the next receive fails)."""

    async def server(ep: ucx_engine.Endpoint) -> tuple[bytes, str]:
        await asyncio.sleep(0.5)  # the peer is gone by now
        buf = bytearray(5)
        await ep.recv(buf)
        try:
            await asyncio.wait_for(ep.recv(bytearray(5)), 5.0)
        except Exception as exc:
            return bytes(buf), type(exc).__name__
        return bytes(buf), "received a second message"

    port, fut = _serve(server)

    async def body(ep: ucx_engine.Endpoint) -> None:
        await ep.send(b"hello")

    _client(port, body)
    got, second = fut.result(30)
    assert got == b"hello"
    assert second != "TimeoutError", "a receive on a dead endpoint waited for its timeout instead of failing"


def test_a_receive_pending_when_the_peer_dies_fails_within_a_second() -> None:
    """The peer process is killed (no goodbye): UCX's endpoint error fails the receive we had posted."""

    async def server(ep: ucx_engine.Endpoint) -> float:
        await ep.recv(bytearray(2))
        try:
            await ep.recv(bytearray(2))
        except Exception:
            return time.monotonic()
        return float("nan")

    port, fut = _serve(server)
    code = (
        "import asyncio, os, sys, time\n"
        "from cudalink.transport import ucx_engine\n"
        "async def main():\n"
        f"    ep = await ucx_engine.core_here().connect('127.0.0.1', {port}, 10.0)\n"
        "    await ep.send(b'hi')\n"
        "    print('sent', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().startswith("sent")
        time.sleep(0.2)
        killed = time.monotonic()
        p.kill()
        failed = fut.result(30)
    finally:
        p.kill()
        p.wait(10)
    assert failed - killed < 1.0, f"the pending receive failed {failed - killed:.2f}s after the peer died"


def test_a_peer_on_ucxx_asyncio_api_talks_to_a_core() -> None:
    """The endpoint wire-up is UCXX's own, so either side may be UCXX's asyncio API (a UCXX user's code)."""

    async def server(ep: Any) -> bytes:
        buf = bytearray(6)
        await ep.recv(buf)
        await ep.send(bytes(buf[::-1]))
        return bytes(buf)

    port, fut = _serve(server, asyncio_api=True)

    async def body(ep: ucx_engine.Endpoint) -> bytes:
        await ep.send(b"abcdef")
        back = bytearray(6)
        await ep.recv(back)
        return bytes(back)

    assert _client(port, body) == b"fedcba"
    assert fut.result(30) == b"abcdef"


def test_an_idle_connection_sleeps() -> None:
    """A receive posted and nothing coming: the loops sleep in epoll, no polling (a second of CPU time is
    measured across both Cores in this process)."""

    async def server(ep: ucx_engine.Endpoint) -> None:
        await ep.recv(bytearray(1))

    port, fut = _serve(server)

    async def body(ep: ucx_engine.Endpoint) -> float:
        before = time.process_time()
        await asyncio.sleep(1.5)
        used = time.process_time() - before
        await ep.send(b"x")
        return used

    used = _client(port, body)
    fut.result(30)
    assert used < 0.1, f"{used:.3f}s of CPU in 1.5s idle"


def test_the_eager_threshold_covers_a_header_with_inline_pixels_unless_the_user_set_one() -> None:
    assert int(ucx_engine.config()["RNDV_THRESH"]) > ucx_wire.MSG_SIZE + ucx_wire.INLINE_MAX
    code = "from cudalink.transport import ucx_engine as e; e.load(); print(e.config())"
    env = {**os.environ, "UCX_RNDV_THRESH": "4096"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "RNDV_THRESH" not in out.stdout and "TCP_TX_SEG_SIZE" in out.stdout, out.stderr[-500:]


def test_a_loop_that_is_dropped_takes_its_worker_with_it() -> None:
    """Each ``asyncio.run`` that touched UCX made a Core; once its loop is gone, so is the worker (and its fds)."""
    import gc
    import weakref

    async def make() -> weakref.ref[ucx_engine.Core]:
        core = ucx_engine.core_here()
        assert ucx_engine.core_here() is core  # one per loop
        return weakref.ref(core)

    refs = [asyncio.run(make()) for _ in range(3)]
    gc.collect()
    assert all(r() is None for r in refs), "a closed loop's UCX worker stayed alive"


def test_an_engine_stops_its_thread_so_nothing_progresses_ucx_at_exit() -> None:
    """``Engine.stop`` (registered with atexit) ends the loop thread: at interpreter exit no UCX progress may
    run into CUDA's teardown (a message landing in a GPU buffer then aborted the process)."""
    import atexit

    eng = ucx_engine.Engine()
    try:
        assert eng.run(asyncio.sleep(0, result=7), 5.0) == 7
        assert eng.thread.is_alive()
        eng.stop()
        assert not eng.thread.is_alive()
        eng.stop()  # twice is harmless
    finally:
        atexit.unregister(eng.stop)


def test_an_engine_at_exit_lets_go_of_its_worker_on_its_own_thread_and_aborts_open_endpoints() -> None:
    """UCX frees its CUDA events in the calling thread's current context: freed by the interpreter's teardown
    on the main thread (none current there), a GPU consumer printed a UCX warning per event as it exited.
    ``Engine.stop`` frees the worker on the engine's thread, aborting a connection still open (a Receiver
    never closed), so nothing in the process holds the worker after it."""
    import atexit
    import gc

    port, served = _serve(lambda ep: ep.recv(bytearray(8)))  # the engine's listener: waits for 8 bytes
    eng = ucx_engine.Engine()
    try:

        async def connect() -> ucx_engine.Endpoint:
            return await eng.core.connect("127.0.0.1", port, 10.0)

        ep = eng.run(connect(), 10.0)  # kept open, as by a Receiver nobody closed
        core = eng.core
        worker = core.worker  # (UCXX's objects take no weak references)
        where: list[str] = []
        shutdown = core.shutdown

        def spy() -> None:
            where.append(threading.current_thread().name)
            shutdown()

        core.shutdown = spy  # type: ignore[method-assign]
        eng.stop()
        assert where == [eng.thread.name], where
        assert core.worker is None and ep._ep is None
        gc.collect()
        assert sys.getrefcount(worker) == 2, gc.get_referrers(worker)  # held by `worker` alone
        shutdown()  # twice is harmless
        with pytest.raises(ConnectionResetError):
            ep._live()
    finally:
        atexit.unregister(eng.stop)
        served.cancel()


def test_connects_at_once_to_a_port_nobody_listens_on_all_fail_at_once_and_leave_nothing_polled() -> None:
    """Two at once (two Receivers of one process before their server is up): one failed at once, the other
    often waited its whole timeout although its endpoint was already in error, and its request stayed
    polled every millisecond for the life of the process."""
    port = ucx_engine.free_port()
    eng = ucx_engine.engine()

    async def one() -> float:
        t0 = time.monotonic()
        try:
            await eng.core.connect("127.0.0.1", port, 3.0)
        except Exception:  # UCX's own error types, whatever this UCX calls them
            return time.monotonic() - t0
        raise AssertionError("a connection to a port nobody listens on was made")

    async def three() -> list[float]:
        return list(await asyncio.gather(one(), one(), one()))

    for _ in range(5):
        took = eng.run(three(), 20)
        assert max(took) < 1.0, took

    async def polled() -> int:
        return sum(not p.req.completed for p in eng.core._pending)

    assert eng.run(polled(), 5) == 0
