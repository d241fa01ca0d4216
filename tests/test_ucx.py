"""ucx:// links between real processes over TCP on 127.0.0.1: a producer process, ``python -m cudalink serve``
in another, consumers here or in a third. Every frame's content is checked (``_ucx_procs.pattern``).

Each test takes fresh ports (a listener re-bound to a port just used can fail with UCXXBusyError).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import cudalink
from cudalink.tools import remote_bench
from cudalink.transport import ucx_engine, ucx_wire

from ._ucx_procs import check, hold_the_gil, pattern

ROOT = Path(__file__).resolve().parent.parent
KEY = "5a" * 32
pytestmark = pytest.mark.timeout(120)

ucxx = pytest.importorskip("ucxx", reason='ucxx is not installed: pip install "cudalink[ucx]" (Linux, Python 3.11+)')

# the engine of this process reads these when it starts; TCP only, as across hosts
os.environ.setdefault("UCX_TLS", "tcp")
os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"
os.environ["CUDALINK_KEY"] = KEY


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def free_port() -> int:
    return ucx_engine.free_port()


class Proc:
    """A child process whose stdout lines are read by a thread, so a test can wait for one."""

    def __init__(self, args: list[str], **env: str) -> None:
        netns = env.pop("_NETNS", None)  # run inside that network namespace
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.p = subprocess.Popen(
            [*prefix, sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_env(**env),
            cwd=ROOT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.log.append(line)
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} line within {timeout}s; output:\n{''.join(self.log)}")
            try:
                line = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.p.poll() is not None and self.lines.empty():
                    time.sleep(0.1)  # the reader thread may still be queueing the last lines
                    if self.lines.empty():
                        raise AssertionError(
                            f"exited ({self.p.returncode}) before {prefix!r}:\n{''.join(self.log)}"
                        ) from None
                continue
            if line.startswith(prefix):
                return line

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def producer(name: str, *args: str) -> Proc:
    p = Proc(["-m", "tests._ucx_procs", "producer", name, *args])
    p.expect("ready")
    return p


def server(name: str, port: int | None = None) -> tuple[Proc, str]:
    port = port or free_port()
    p = Proc(["-m", "cudalink", "serve", name, "--listen", f"ucx://127.0.0.1:{port}", "-v"])
    p.expect("cudalink: serving")
    return p, f"ucx://127.0.0.1:{port}/{name}"


@contextlib.contextmanager
def served(tag: str, *producer_args: str) -> Iterator[tuple[Proc, Proc, str]]:
    """A producer (``producer_args``) of a fresh name and its server: (producer, server, url); both stopped after."""
    name = unique(tag)
    prod = producer(name, *producer_args)
    srv, url = server(name)
    try:
        yield prod, srv, url
    finally:
        srv.stop()
        prod.stop()


def unique(tag: str) -> str:
    return f"ucx{tag}{os.getpid()}{time.monotonic_ns() % 10**7}"


@pytest.fixture(scope="module")
def stream() -> Iterator[tuple[Proc, Proc, str]]:
    """One long stream (200 fps, 32x32x4, 16 slots) served for the tests that only read it."""
    name = unique("s")
    prod = producer(name, "--frames", "1000000", "--fps", "200", "--slots", "16")
    srv, url = server(name)
    yield prod, srv, url
    srv.stop()
    prod.stop()


# -- content, order, flow -----------------------------------------------------------------------------------


def test_every_frame_arrives_in_order_with_its_content(stream: tuple[Proc, Proc, str]) -> None:
    _, _, url = stream
    with cudalink.Receiver(url, latest=False, timeout=10.0) as rx:
        assert rx.backend == "ucx" and rx.device == "cpu"
        seqs = []
        for _ in range(120):
            with rx.recv(timeout=5.0) as f:
                check(f)
                seqs.append(f.seq)
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        gaps = seqs[-1] - seqs[0] + 1 - len(seqs)
        # frames the server could not send in time are counted (those before the join point are not skips)
        assert rx.stats()["skipped"] <= gaps
        assert gaps <= 12, f"{gaps} frames of {len(seqs)} lost at 200 fps with 16 slots"


@pytest.mark.parametrize("wait", ["spin", "hybrid"])
def test_a_spinning_consumer_sleeps_on_the_connection(stream: tuple[Proc, Proc, str], wait: str) -> None:
    """Our UCX thread lands the frames, so a recv() that spun with the GIL would starve it (on an H100 a
    spinning consumer got 64x64 frames 2-18x later (p50) than a sleeping one, and skipped some): every wait mode
    sleeps on the connection, so waiting for a frame 5 ms away costs the caller's thread next to no CPU."""
    _, _, url = stream
    with cudalink.Receiver(url, latest=False, wait=wait, timeout=10.0) as rx:  # type: ignore[arg-type]
        rx.recv(timeout=5.0).release()
        seqs = []
        wall, cpu = time.monotonic(), time.thread_time()
        for _ in range(60):
            with rx.recv(timeout=5.0) as f:
                check(f)
                seqs.append(f.seq)
        wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert cpu < 0.5 * wall, f"recv(wait={wait!r}) spun: {cpu:.3f} s of CPU in {wall:.3f} s at 200 fps"


def test_latest_wins_for_a_slow_consumer(stream: tuple[Proc, Proc, str]) -> None:
    _, _, url = stream
    with cudalink.Receiver(url, latest=True, timeout=10.0) as rx:
        last = 0
        for _ in range(6):
            with rx.recv(timeout=5.0) as f:
                check(f)
                assert f.seq > last
                last = f.seq
            time.sleep(0.1)  # 20 frames published meanwhile
        assert rx.stats()["skipped"] >= 5 * 10


def test_a_latest_consumer_that_pauses_is_handed_the_newest_frame_not_one_as_old_as_its_pause(
    stream: tuple[Proc, Proc, str],
) -> None:
    """Its landing buffers held the three frames that came as it paused: the first recv() after a 1 s pause
    returned a frame 1 s old (a local one returns the newest). The oldest unread one now goes back as each
    newer one lands."""
    _, _, url = stream
    with cudalink.Receiver(url, latest=True, timeout=10.0) as rx:
        for _ in range(5):
            rx.recv(timeout=5.0).release()
        time.sleep(1.0)
        with rx.recv(timeout=5.0) as f:
            check(f)
            age = (time.time_ns() - f.timestamp_ns) / 1e9
        assert age < 0.5, f"the first frame after a 1 s pause was {age:.2f} s old"
        assert rx.stats()["skipped"] > 0


def test_fileno_poll_and_asyncio(stream: tuple[Proc, Proc, str]) -> None:
    import selectors

    _, _, url = stream
    with cudalink.Receiver(url, timeout=10.0) as rx:
        rx.recv(timeout=5.0).release()
        sel = selectors.DefaultSelector()
        sel.register(rx.fileno(), selectors.EVENT_READ)
        assert sel.select(5.0)
        deadline = time.monotonic() + 5
        while (f := rx.poll()) is None:
            assert time.monotonic() < deadline
            sel.select(0.1)
        check(f)
        f.release()

        async def two() -> list[int]:
            out = []
            async for frame in rx:
                check(frame)
                out.append(frame.seq)
                frame.release()
                if len(out) == 2:
                    break
            got = await rx.recv_async(timeout=5.0)
            out.append(got.seq)
            return out

        seqs = asyncio.run(two())
        assert seqs == sorted(seqs)


def test_poll_never_waits_on_the_network() -> None:
    """A render loop polls once per frame: against a server that answers nothing (stopped), poll() says "no
    producer" at once while it connects in the background, and hands out frames once the server answers."""
    with (
        served("p", "--frames", "1000000", "--fps", "100") as (_, srv, url),
        cudalink.Receiver(url, connect=False, timeout=10.0) as rx,
    ):
        ucx_engine.engine()  # started once per process, before the clock
        os.kill(srv.p.pid, signal.SIGSTOP)
        try:
            slowest = 0.0
            for _ in range(20):
                t0 = time.monotonic()
                with contextlib.suppress(cudalink.LinkTimeout):
                    assert rx.poll() is None
                slowest = max(slowest, time.monotonic() - t0)
                time.sleep(0.02)
            # one attempt to connect takes at least 0.2 s (and up to 1.2 s) where a poll waits for it
            assert slowest < 0.15, f"poll() waited {slowest:.3f} s on a server that does not answer"
        finally:
            os.kill(srv.p.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        frame = None
        while frame is None:
            assert time.monotonic() < deadline, "no frame by poll() after the server came back"
            with contextlib.suppress(cudalink.LinkTimeout):
                frame = rx.poll()
            time.sleep(0.01)
        check(frame)
        frame.release()


def test_a_close_ends_an_async_for_still_connecting_to_a_server_that_answers_nothing_at_once() -> None:
    """``close()`` from another task while ``async for`` waits for its first connection (a server that accepts
    and answers nothing: a stopped one, a host behind a firewall) ended the loop only when that attempt to
    connect gave up, about 3 s later: close() woke a task only once it had an attachment."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"ucx://127.0.0.1:{silent.getsockname()[1]}/quiet"
        ucx_engine.engine()  # started once per process, before the clock

        async def main() -> float:
            rx = cudalink.Receiver(url, connect=False, timeout=None)

            async def close_soon() -> None:
                await asyncio.sleep(0.3)
                rx.close()

            closer = asyncio.create_task(close_soon())
            t0 = time.monotonic()
            async for frame in rx:
                frame.release()
            await closer
            return time.monotonic() - t0

        took = asyncio.run(main())
    assert took < 1.0, f"async for ended {took:.2f} s after it began; close() came at 0.3 s"


def test_a_recv_after_a_poll_and_a_timeout_zero_receiver_both_connect(stream: tuple[Proc, Proc, str]) -> None:
    """poll()'s background connection is taken by a recv() with no time limit (it raised OverflowError), and
    timeout=0 anywhere but poll() still makes one attempt now (it was taken for poll's 'no time at all')."""
    _, _, url = stream
    with cudalink.Receiver(url, timeout=10.0):  # the server answers by now
        pass
    with cudalink.Receiver(url, connect=False, timeout=None) as rx:
        with contextlib.suppress(cudalink.LinkTimeout):
            assert rx.poll() is None
        for _ in range(3):
            with rx.recv() as f:
                check(f)
    for _ in range(3):
        with cudalink.Receiver(url, timeout=0) as rx:
            assert rx.connected


def test_back_pressure_stops_at_the_server() -> None:
    """A consumer that holds every frame it gets: the producer (policy="block"!) never waits on it."""
    name = unique("b")
    prod = producer(name, "--frames", "900", "--fps", "300", "--slots", "4", "--policy", "block", "--linger", "5")
    srv, url = server(name)
    try:
        with cudalink.Receiver(url, latest=False, timeout=10.0) as rx:
            held = [rx.recv(timeout=5.0) for _ in range(3)]  # every landing buffer, never released
            for f in held:
                check(f)
            done = prod.expect("done", 30.0)
            worst = float(done.split("worst_send=")[1].split()[0])
            assert worst < 0.5, done  # a blocked send would wait its 5 s timeout
            assert rx.poll() is None  # no credit, nothing sent
            del f
            held.clear()  # credits go back; the stream resumes from what the ring still holds
            f = rx.recv(timeout=5.0)
            check(f)
            assert rx.stats()["skipped"] > 100
            f.release()
    finally:
        srv.stop()
        prod.stop()


def test_reconfigure_reaches_the_remote_consumer() -> None:
    name = unique("r")
    prod = producer(name, "--frames", "1000000", "--fps", "200", "--reshape", "16,24,4", "--every", "40")
    srv, url = server(name)
    try:
        shapes = set()
        with cudalink.Receiver(url, latest=False, timeout=10.0) as rx:
            while len(shapes) < 2:
                with rx.recv(timeout=5.0) as f:
                    check(f)
                    shapes.add(f.shape)
        assert shapes == {(32, 32, 4), (16, 24, 4)}
    finally:
        srv.stop()
        prod.stop()


def test_frames_either_side_of_the_inline_limit_arrive_whole() -> None:
    """A host consumer gets frames up to INLINE_MAX as one message (header and pixels), larger ones as a
    header and a second message; a stream that switches between the two loses and mixes nothing."""
    big = (160, 160, 4)  # 102400 bytes: over the inline limit
    assert int(np.prod(big)) > ucx_wire.INLINE_MAX >= 32 * 32 * 4
    name = unique("i")
    prod = producer(name, "--frames", "1000000", "--fps", "300", "--shape", "160,160,4", "--reshape", "32,32,4")
    srv, url = server(name)
    try:
        shapes: dict[tuple[int, ...], int] = {}
        last = 0
        with cudalink.Receiver(url, latest=False, timeout=10.0, device="cpu") as rx:
            while min(shapes.values(), default=0) < 30 or len(shapes) < 2:
                with rx.recv(timeout=5.0) as f:
                    check(f)
                    assert f.seq > last
                    last = f.seq
                    shapes[f.shape] = shapes.get(f.shape, 0) + 1
        assert set(shapes) == {big, (32, 32, 4)}
    finally:
        srv.stop()
        prod.stop()


async def _raw_frames(url: str, inline: int, n: int) -> list[tuple[bool, int, tuple[int, ...], bytes]]:
    """Speak the protocol by hand, asking for ``inline`` pixel bytes in FRAME messages: each frame's inline
    flag, seq, shape and pixels as they came off the wire."""
    addr = ucx_wire.parse_address(url, need_name=True)
    ep = await ucx_engine.engine().core.connect(addr.host, addr.port, 5.0)
    buf = bytearray(ucx_wire.MSG_SIZE + inline)
    head = memoryview(buf)[: ucx_wire.MSG_SIZE]
    try:
        await ucx_engine.recv_msg(ep, buf, None)
        nonce = ucx_wire.unpack_challenge(head)
        hello = ucx_wire.Hello(
            ucx_wire.proof(bytes.fromhex(KEY), nonce), False, False, 2, addr.name or "", inline=inline
        )
        await ep.send(ucx_wire.pack_hello(hello))
        await ucx_engine.recv_msg(ep, buf, None)
        ucx_wire.unpack_welcome(head)
        got = []
        while len(got) < n:
            await asyncio.wait_for(ucx_engine.recv_msg(ep, buf, None), 5.0)
            if ucx_wire.kind_of(head) != ucx_wire.FRAME:
                continue
            h = ucx_wire.unpack_frame(head, 1 << 20, inline)
            if h.inline:
                pixels = bytes(buf[ucx_wire.MSG_SIZE : ucx_wire.MSG_SIZE + h.nbytes])
            else:
                data = bytearray(h.nbytes)
                await ep.recv(data)
                pixels = bytes(data)
            got.append((h.inline, h.seq, h.spec.shape, pixels))
            await ep.send(ucx_wire.pack_credit(1))
        return got
    finally:
        ep.abort()


@pytest.mark.parametrize("inline", [0, ucx_wire.INLINE_MAX])
def test_a_client_gets_pixels_inline_only_if_it_asked(stream: tuple[Proc, Proc, str], inline: int) -> None:
    _, _, url = stream
    frames = ucx_engine.engine().run(_raw_frames(url, inline, 5), 30.0)
    for flag, seq, shape, pixels in frames:
        assert flag is bool(inline)
        assert pixels == pattern(shape, seq).tobytes(), f"frame {seq}: content differs"


# -- faults -------------------------------------------------------------------------------------------------


def test_producer_death_and_restart_are_visible_and_followed() -> None:
    name = unique("p")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    srv, url = server(name)
    try:
        with cudalink.Receiver(url, latest=False, timeout=10.0) as rx:
            f = rx.recv(timeout=5.0)
            gen1 = rx.generation
            check(f)
            f.release()
            killed = time.monotonic()
            prod.kill()
            with pytest.raises(cudalink.ProducerGone):
                while True:
                    rx.recv(timeout=5.0).release()
            assert time.monotonic() - killed <= 1.0
            prod = producer(name, "--frames", "1000000", "--fps", "100")
            f = rx.recv(timeout=10.0)
            check(f)
            assert rx.generation != gen1
            assert rx.stats()["reattached"] == 1
            f.release()
    finally:
        srv.stop()
        prod.stop()


def test_a_remote_producer_gone_says_what_to_do_once() -> None:
    """The server's goodbye quoted its own Receiver's ProducerGone whole: "... closed or died (producer gone:
    cudalink: producer of 'x' closed or died; recv() again to wait for a new one); recv() again to ..."."""
    with (
        served("g", "--frames", "1000000", "--fps", "100") as (prod, _, url),
        cudalink.Receiver(url, timeout=10.0, device="cpu") as rx,
    ):
        rx.recv(timeout=5.0).release()
        prod.kill()
        with pytest.raises(cudalink.ProducerGone) as gone:
            while True:
                rx.recv(timeout=5.0).release()
    said = str(gone.value)
    assert said.count("cudalink:") == 1 and said.count("recv() again to wait for a new one") == 1, said
    assert said.startswith(f"cudalink: producer of {url!r} ") and "(producer gone: " in said, said


def test_server_sigkill_gives_producer_gone_within_a_second() -> None:
    name = unique("k")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    srv, url = server(name)
    try:
        with cudalink.Receiver(url, timeout=10.0) as rx:
            rx.recv(timeout=5.0).release()
            errors: list[float] = []

            def consume() -> None:
                try:
                    while True:
                        rx.recv(timeout=10.0).release()
                except cudalink.ProducerGone:
                    errors.append(time.monotonic())

            t = threading.Thread(target=consume)
            t.start()
            time.sleep(0.2)
            killed = time.monotonic()
            srv.p.send_signal(signal.SIGKILL)
            t.join(5.0)
            assert errors, "recv() never raised ProducerGone"
            assert errors[0] - killed <= 1.0, f"ProducerGone after {errors[0] - killed:.2f}s"
    finally:
        srv.kill()
        prod.stop()


def test_a_server_that_goes_silent_is_gone_after_the_dead_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped server (as behind a pulled cable: no reset ever comes) is noticed by the PING watchdog."""
    from cudalink.transport import ucx_engine

    monkeypatch.setattr(ucx_engine, "DEAD_AFTER_S", 1.0)
    monkeypatch.setattr(ucx_engine, "PING_S", 0.25)
    name = unique("s")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    srv, url = server(name)
    try:
        with cudalink.Receiver(url, timeout=10.0) as rx:
            rx.recv(timeout=5.0).release()
            srv.p.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(cudalink.ProducerGone, match="went silent"):
                while True:
                    rx.recv(timeout=10.0).release()
            waited = time.monotonic() - stopped
            assert 0.7 <= waited <= 3.0, f"ProducerGone {waited:.2f}s after the server stopped"
    finally:
        srv.p.send_signal(signal.SIGCONT)
        srv.kill()
        prod.stop()


def test_a_consumer_that_holds_the_gil_is_dropped_and_carries_on_without_an_error() -> None:
    """A consumer process that keeps the GIL for 2 s (a framework's first CUDA call, ``import torch``) sends no
    PING: the server gives its leases back within a second and says why; the consumer, running again, connects
    anew and its recv() goes on (no ProducerGone: the producer never went). The frames that went by meanwhile
    count as skipped, as for a stalled local consumer."""
    name = unique("g")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    srv, url = server(name)
    try:
        with cudalink.Receiver(url, timeout=10.0) as rx:
            rx.recv(timeout=5.0).release()
            hold_the_gil(2.0)
            first = None
            for _ in range(20):
                with rx.recv(timeout=5.0) as f:
                    check(f)
                    first = f.seq if first is None else first
            srv.expect("cudalink serve: a consumer went silent", 5.0)
            srv.expect("cudalink serve: a consumer joined", 5.0)
            stats = rx.stats()
            assert stats["reattached"] == 0, stats
            assert stats["skipped"] >= 50, stats  # ~200 frames went by at 100 fps; a few were queued here
            assert stats["reconnects"] == 1, stats
            assert rx._att is not None and rx._att.resumes == 1
    finally:
        srv.stop()
        prod.stop()


def test_a_consumer_stalled_during_a_rendezvous_never_gets_a_frame_its_slot_no_longer_holds() -> None:
    """Frames of 1 MiB go by rendezvous: the server's pixel send waits for the consumer's UCX worker. A
    consumer that holds the GIL for 2 s stalls that send; the server closes that connection and gives the
    frame's lease back within a second, and the producer reuses the slot. When the consumer runs again it
    connects anew and gets frames again, every one with the bytes written for its seq, and no error."""
    name = unique("r")
    prod = producer(name, "--frames", "1000000", "--fps", "100", "--shape", "512,512,4")
    srv, url = server(name)
    try:
        with cudalink.Receiver(url, timeout=10.0) as rx:
            for _ in range(3):
                with rx.recv(timeout=5.0) as f:
                    check(f)
            hold_the_gil(2.0)
            for _ in range(20):
                with rx.recv(timeout=5.0) as f:
                    check(f)  # the bytes its producer wrote for its seq, or nothing at all
            assert rx.stats()["reattached"] == 0, rx.stats()
            assert srv.p.poll() is None  # the server serves on
    finally:
        srv.stop()
        prod.stop()


def test_a_stalled_consumer_that_holds_every_frame_connects_again_once_it_gives_one_back() -> None:
    """Dropped for silence while it holds all its landing buffers, a consumer has no credit to grant: it
    connects again once it releases a frame, and frames flow again."""
    name = unique("h")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    srv, url = server(name)
    try:
        with cudalink.Receiver(url, timeout=10.0, latest=False) as rx:
            held = [rx.recv(timeout=5.0) for _ in range(3)]  # every landing buffer (ucx_source.CREDITS)
            hold_the_gil(2.0)
            srv.expect("cudalink serve: a consumer went silent", 5.0)
            time.sleep(0.5)
            att = rx._att
            assert att is not None and att.resuming and not att.free  # waits for a buffer to grant
            for f in held:
                check(f)
                f.release()
            for _ in range(10):
                with rx.recv(timeout=5.0) as f:
                    check(f)
            assert att.resumes == 1 and rx.stats()["reattached"] == 0 and rx.stats()["reconnects"] == 1
    finally:
        srv.stop()
        prod.stop()


def test_a_consumer_stalled_while_its_producer_restarted_hears_it_once_then_gets_the_new_one() -> None:
    """Dropped for silence, then its producer restarts before it runs again: connecting again finds another
    generation, so recv() raises ProducerGone once (saying so), and the next one gets the new producer's frames."""
    name = unique("n")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    srv, url = server(name)
    restart = (
        "import os, signal, sys, time\n"
        f"time.sleep(2.0); os.kill({prod.p.pid}, signal.SIGKILL); time.sleep(0.2)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'tests._ucx_procs', 'producer', "
        f"'{name}', '--frames', '1000000', '--fps', '100'])"
    )
    try:
        with cudalink.Receiver(url, timeout=10.0) as rx:
            rx.recv(timeout=5.0).release()
            gen = rx.generation
            prod2 = Proc(["-c", restart])  # kills the producer 2 s from now (the server has dropped us by then)
            hold_the_gil(4.0)
            with pytest.raises(cudalink.ProducerGone, match="the producer restarted meanwhile"):
                while True:
                    rx.recv(timeout=5.0).release()
            f = rx.recv(timeout=10.0)
            check(f)
            f.release()
            assert rx.generation != gen
            stats = rx.stats()
            assert stats["reattached"] == 1 and stats["reconnects"] == 0, stats  # a new producer, not a reconnect
    finally:
        srv.stop()
        prod.kill()
        with contextlib.suppress(NameError):
            prod2.stop()


def test_receiver_reconnects_when_the_server_comes_back() -> None:
    name = unique("c")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    port = free_port()
    srv, url = server(name, port)
    try:
        with cudalink.Receiver(url, timeout=10.0) as rx:
            rx.recv(timeout=5.0).release()
            srv.kill()
            with pytest.raises(cudalink.ProducerGone):
                while True:
                    rx.recv(timeout=5.0).release()
            # the same port: the new server retries while the dead one's port is still busy
            srv = Proc(["-m", "cudalink", "serve", name, "--listen", f"ucx://127.0.0.1:{port}", "-v"])
            srv.expect("cudalink: serving", 20.0)
            f = rx.recv(timeout=10.0)
            check(f)
            f.release()
    finally:
        srv.stop()
        prod.stop()


def test_consumer_sigkill_gives_its_leases_back_within_a_second() -> None:
    name = unique("d")
    prod = producer(name, "--frames", "1000000", "--fps", "200", "--report")
    srv, url = server(name)
    cons = Proc(["-m", "tests._ucx_procs", "consumer", url])
    try:
        cons.expect("holding", 30.0)
        prod.expect("consumers 1", 10.0)
        killed = time.monotonic()
        cons.p.send_signal(signal.SIGKILL)
        try:
            prod.expect("consumers 0", 5.0)
        except AssertionError:
            raise AssertionError("".join(srv.log)) from None
        assert time.monotonic() - killed <= 1.0 + 0.1  # the producer reports every 50 ms
    finally:
        cons.kill()
        srv.stop()
        prod.stop()


class UCXXConnectionResetError(Exception):  # named as UCXX names its own
    pass


class UCXXEndpointTimeoutError(Exception):
    pass


class UCXXNoMemoryError(Exception):
    pass


def test_errors_that_say_the_peer_went_away_are_told_from_our_own() -> None:
    for gone in (UCXXConnectionResetError("reset"), UCXXEndpointTimeoutError("timeout"), ConnectionResetError()):
        assert ucx_engine.peer_gone(gone)
    for ours in (UCXXNoMemoryError("oom"), ValueError("x"), RuntimeError("Connection reset")):
        assert not ucx_engine.peer_gone(ours)


@pytest.mark.parametrize("exc", [UCXXConnectionResetError("reset"), UCXXNoMemoryError("oom")])
def test_a_send_that_fails_because_the_consumer_went_away_is_no_fault_of_the_server(
    exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """Every bench --remote run printed a WARNING and a traceback for each consumer that closed while a
    frame was on its way to it; a failure of the server's own still says so, and tells the consumer why."""
    from cudalink import ucx_server

    byes: list[tuple[int, str]] = []

    class Consumer(ucx_server._Consumer):
        def __init__(self) -> None:
            self.why = ""

        async def _bye(self, reason: int, text: str, wait: float = 0.5) -> None:
            byes.append((reason, text))

    c = Consumer()
    with caplog.at_level("INFO", logger="cudalink"):
        asyncio.run(c._failed("sending frame 7 failed", exc))
    if isinstance(exc, UCXXConnectionResetError):
        assert c.why == "went away (sending frame 7 failed: UCXXConnectionResetError: reset)"
        assert not byes and "Traceback" not in caplog.text and not caplog.records
    else:
        assert c.why.startswith("was dropped (sending frame 7 failed: UCXXNoMemoryError: oom")
        assert byes and byes[0][1] == "sending frame 7 failed: UCXXNoMemoryError: oom"
        assert "cudalink serve: sending frame 7 failed" in caplog.text


# -- security and hostile peers --------------------------------------------------------------------------------


def test_a_wrong_key_is_refused_and_says_so(stream: tuple[Proc, Proc, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, srv, url = stream
    monkeypatch.setenv("CUDALINK_KEY", "77" * 32)
    t0 = time.monotonic()
    with pytest.raises(cudalink.ProtocolError, match=r"refused our key.*CUDALINK_KEY"):
        cudalink.Receiver(url, timeout=10.0)
    assert time.monotonic() - t0 < 5.0
    srv.expect("cudalink serve: refused a connection with the wrong key", 5.0)


def test_a_server_refusing_a_name_is_quoted_without_its_own_prefix(stream: tuple[Proc, Proc, str]) -> None:
    """A name this Receiver would refuse itself, sent by hand: the server's refusal read "cudalink: the ucx
    server refused (invalid name): cudalink: invalid link name ..."."""
    _, _, url = stream
    addr = ucx_wire.parse_address(url, need_name=True)

    async def hello(name: str) -> None:
        ep = await ucx_engine.engine().core.connect(addr.host, addr.port, 5.0)
        buf = bytearray(ucx_wire.MSG_SIZE)
        try:
            nonce = ucx_wire.unpack_challenge(await ucx_engine.recv_msg(ep, buf, 5.0))
            proof = ucx_wire.proof(bytes.fromhex(KEY), nonce)
            await ep.send(ucx_wire.pack_hello(ucx_wire.Hello(proof, True, False, 1, name)))
            ucx_wire.unpack_welcome(await ucx_engine.recv_msg(ep, buf, 5.0))
        finally:
            ep.abort()

    with pytest.raises(ucx_wire.Refused) as refused:
        ucx_engine.engine().run(hello("bad name"), 15.0)
    said = str(refused.value)
    assert said.startswith("cudalink: the ucx server refused (invalid name): invalid link name 'bad name'"), said
    assert said.count("cudalink:") == 1, said


def test_a_missing_key_names_the_way_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDALINK_KEY")
    monkeypatch.setenv("CUDALINK_KEY_FILE", str(tmp_path / "none"))
    with pytest.raises(cudalink.LinkError, match="CUDALINK_KEY"):
        cudalink.Receiver("ucx://127.0.0.1:9/x", timeout=0.1)


def test_the_first_serve_on_a_host_has_made_its_key_when_the_sender_returns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No key on this host yet: Sender(serve=) makes it before it returns (its server process would, a moment
    later), so a Receiver made right after, on this host, finds it; and it says how to copy it."""
    monkeypatch.delenv("CUDALINK_KEY")
    key_file = tmp_path / "cudalink" / "ucx.key"
    monkeypatch.setenv("CUDALINK_KEY_FILE", str(key_file))
    name = unique("k")
    with cudalink.Sender(name, shape=(8, 8, 4), serve=f"ucx://127.0.0.1:{free_port()}") as tx:
        assert key_file.exists() and oct(key_file.stat().st_mode & 0o777) == "0o600"
        assert "made a new key" in capsys.readouterr().out
        assert tx._remote is not None
        key, created = ucx_engine.load_key(create=True)  # the server's own look finds the same one
        assert created is None and key.hex() == key_file.read_text().strip()


def test_a_key_made_meanwhile_by_another_process_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A Sender and its server (or two servers) making the first key at the same moment agree on one, and
    neither fails nor leaves a half-written file for the other to read."""
    monkeypatch.delenv("CUDALINK_KEY")
    path = tmp_path / "cudalink" / "ucx.key"
    monkeypatch.setenv("CUDALINK_KEY_FILE", str(path))
    theirs = "ab" * 32
    real_link = os.link

    def link_after_them(src: str, dst: str) -> None:
        Path(dst).write_text(theirs + "\n")  # the other process got there first (0600, as load_key makes it)
        os.chmod(dst, 0o600)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link_after_them)
    key, created = ucx_engine.load_key(create=True)
    assert key.hex() == theirs and created is None
    assert os.listdir(path.parent) == ["ucx.key"]  # our private file is gone


def test_the_key_is_made_where_the_filesystem_has_no_hard_links(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("CUDALINK_KEY")
    path = tmp_path / "cudalink" / "ucx.key"
    monkeypatch.setenv("CUDALINK_KEY_FILE", str(path))

    def no_links(src: str, dst: str) -> None:
        raise PermissionError(1, "Operation not permitted")  # vfat, many SMB/FUSE mounts

    monkeypatch.setattr(os, "link", no_links)
    key, created = ucx_engine.load_key(create=True)
    assert created == str(path) and key.hex() == path.read_text().strip()
    assert os.listdir(path.parent) == ["ucx.key"] and oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_key_file_open_to_other_users_or_unreadable_is_refused_saying_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("CUDALINK_KEY", raising=False)
    path = tmp_path / "ucx.key"
    monkeypatch.setenv("CUDALINK_KEY_FILE", str(path))
    key, _ = ucx_engine.load_key(create=True)
    os.chmod(path, 0o644)  # others may read the key that lets anyone in
    with pytest.raises(cudalink.LinkError, match=f"chmod 600 {path}"):
        ucx_engine.load_key(create=True)
    os.chmod(path, 0o600)
    assert ucx_engine.load_key() == (key, None)
    path.unlink()
    path.mkdir()  # a path that is no file: said as a LinkError, not a raw IsADirectoryError
    with pytest.raises(cudalink.LinkError, match=f"key path {path} is no regular file"):
        ucx_engine.load_key()
    path.rmdir()
    os.mkfifo(path)  # a FIFO: open() of it waited for a writer for ever
    said: list[BaseException] = []

    def load() -> None:
        try:
            ucx_engine.load_key(create=True)
        except BaseException as exc:
            said.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "load_key waited on a FIFO"
    assert len(said) == 1 and isinstance(said[0], cudalink.LinkError) and "no regular file" in str(said[0])


def test_a_wrong_key_from_the_environment_is_not_told_to_copy_the_key_file(
    stream: tuple[Proc, Proc, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, url = stream
    monkeypatch.setenv("CUDALINK_KEY", "77" * 32)  # CUDALINK_KEY wins over any key file: copying one changes nothing
    with pytest.raises(cudalink.ProtocolError, match="refused our key") as refused:
        cudalink.Receiver(url, timeout=10.0)
    assert "key file to" not in str(refused.value) and "set CUDALINK_KEY to the server's key" in str(refused.value)


async def _raw_client(url: str, send: list[bytes], proof: bool) -> str:
    """Connect as a hostile peer: answer the challenge (or not), then send ``send``; say how it ended."""
    addr = ucx_wire.parse_address(url, need_name=True)
    eng = ucx_engine.engine()
    ep = await eng.core.connect(addr.host, addr.port, 5.0)
    buf = bytearray(ucx_wire.MSG_SIZE)
    nonce = ucx_wire.unpack_challenge(await ucx_engine.recv_msg(ep, buf, None))
    if proof:
        key = bytes.fromhex(KEY)
        hello = ucx_wire.Hello(ucx_wire.proof(key, nonce), True, False, 2, addr.name or "")
        await ep.send(ucx_wire.pack_hello(hello))
        ucx_wire.unpack_welcome(await ucx_engine.recv_msg(ep, buf, None))
    for msg in send:
        await ep.send(msg)
    try:
        while True:
            msg = await asyncio.wait_for(ucx_engine.recv_msg(ep, buf, None), 5.0)
            if ucx_wire.kind_of(msg) == ucx_wire.BYE:
                return ucx_wire.unpack_text(msg)[1]
            if ucx_wire.kind_of(msg) == ucx_wire.FRAME:  # its payload follows
                await ep.recv(bytearray(ucx_wire.unpack_frame(msg, 1 << 30).nbytes))
    except asyncio.TimeoutError:
        return "still open"
    except Exception as exc:
        return f"closed ({type(exc).__name__})"
    finally:
        ep.abort()


@pytest.mark.parametrize(
    ("case", "proof"),
    [
        ("garbage hello", False),
        ("oversized hello", False),
        ("garbage after welcome", True),
        ("credit lie", True),
    ],
)
def test_malformed_messages_close_that_connection_and_the_server_serves_on(
    stream: tuple[Proc, Proc, str], case: str, proof: bool
) -> None:
    _, srv, url = stream
    junk = bytes(range(256)) + bytes(ucx_wire.MSG_SIZE - 256)
    send = {
        "garbage hello": [junk],
        "oversized hello": [bytes(ucx_wire.MSG_SIZE * 3)],
        "garbage after welcome": [junk],
        "credit lie": [ucx_wire.pack_credit(1)[:8] + struct.pack("<I", 10**6) + ucx_wire.pack_credit(1)[12:]],
    }[case]
    with cudalink.Receiver(url, timeout=10.0) as rx:
        rx.recv(timeout=5.0).release()
        ended = ucx_engine.engine().run(_raw_client(url, send, proof), 20.0)
        assert ended != "still open", case
        said = srv.expect("cudalink serve: closing a connection", 5.0)
        # the issue: such a connection is closed "with a logged ProtocolError"; no second "cudalink: " in it
        assert "ProtocolError" in said and said.count("cudalink:") == 0, said
        for _ in range(3):  # the honest consumer is still served
            with rx.recv(timeout=5.0) as f:
                check(f)


# -- the commands and Sender(serve=) --------------------------------------------------------------------------


def test_relay_republishes_a_remote_stream_as_a_local_link(stream: tuple[Proc, Proc, str]) -> None:
    _, _, url = stream
    local = unique("l")
    relay = Proc(["-m", "cudalink", "relay", url, "--as", local, "--in-order"])
    try:
        relay.expect("cudalink: relaying", 20.0)
        with cudalink.Receiver(local, latest=False, timeout=10.0) as rx:
            for _ in range(20):
                with rx.recv(timeout=5.0) as f:
                    check(f, relayed=True)
    finally:
        relay.stop()


def _feed(tx: cudalink.Sender, every: float) -> threading.Thread:
    """A thread that sends ``tx`` a checkable frame every ``every`` seconds until it closes."""

    def feed() -> None:
        while not tx.closed:
            try:
                tx.send(pattern(tx.shape, tx.seq + 1), meta=struct.pack("<Q", tx.seq + 1))
            except cudalink.LinkError:
                return
            time.sleep(every)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return t


def test_sender_serve_starts_and_stops_its_server() -> None:
    name = unique("v")
    port = free_port()
    with cudalink.Sender(name, shape=(8, 8, 4), serve=f"ucx://127.0.0.1:{port}") as tx:
        proc = tx._remote
        assert proc is not None

        t = _feed(tx, 0.01)
        rx = remote_bench.connect(port, name, within=20)
        with rx, rx.recv(timeout=5.0) as f:
            check(f)
    t.join(5)
    assert proc.poll() is not None  # close() stopped it


@pytest.mark.parametrize("shape", [(8, 8, 4), (256, 160, 4)], ids=["inline", "two-messages"])
def test_bfloat16_frames_cross_the_network_bit_for_bit(shape: tuple[int, ...]) -> None:
    """bfloat16 (ml_dtypes' to numpy) travels as its dtype code; a remote consumer's frames keep every bit."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    n = int(np.prod(shape))

    def bits(seq: int) -> np.ndarray:
        return ((np.arange(n, dtype=np.uint32) * 2654435761 + seq * 40503) & 0xFFFF).astype(np.uint16).reshape(shape)

    name, port = unique("b"), free_port()
    with cudalink.Sender(name, shape=shape, dtype="bfloat16", serve=f"ucx://127.0.0.1:{port}") as tx:

        def feed() -> None:
            while not tx.closed:
                try:
                    tx.send(bits(tx.seq + 1).view(bf16))
                except cudalink.LinkError:
                    return
                time.sleep(0.01)

        t = threading.Thread(target=feed, daemon=True)
        t.start()
        with remote_bench.connect(port, name, within=20, device="cpu") as rx:
            for _ in range(5):
                with rx.recv(timeout=5.0) as f:
                    assert f.dtype == bf16 and f.shape == shape
                    assert np.array_equal(f.numpy().view(np.uint16), bits(f.seq))
    t.join(5)


def _behind_at_a_clean_close(behind_s: float) -> tuple[list[int], dict[str, object], cudalink.ProducerGone]:
    """A remote consumer holds every frame it may (3: no credit left) while its producer publishes 4 more and
    closes; ``behind_s`` later it gives them back and reads on. The seqs it got after those, its stats, its end."""
    name = unique("d")
    port = free_port()
    shape = (8, 8, 4)
    tx = cudalink.Sender(name, shape=shape, slots=4, serve=f"ucx://127.0.0.1:{port}")
    closer = threading.Thread(target=tx.close, daemon=True)
    try:
        with remote_bench.connect(port, name, within=20, latest=False) as rx:
            held = []
            for seq in range(1, 4):  # every landing buffer it has (ucx_source.CREDITS): the server holds back now
                tx.send(pattern(shape, seq), meta=struct.pack("<Q", seq))
                held.append(rx.recv(timeout=5.0))
            for seq in range(4, 8):
                tx.send(pattern(shape, seq), meta=struct.pack("<Q", seq))
            closer.start()
            time.sleep(behind_s)
            for f in held:
                check(f)
                f.release()
            got = []
            with pytest.raises(cudalink.ProducerGone, match="closed the link") as info:
                while True:
                    with rx.recv(timeout=5.0) as f:
                        check(f)
                        got.append(f.seq)
            stats = rx.stats()
    finally:
        closer.join(10) if closer.is_alive() else tx.close()
    assert not closer.is_alive() and tx.closed and tx._remote is not None and tx._remote.poll() is not None
    return got, stats, info.value


def test_a_remote_consumer_behind_at_a_clean_close_still_gets_what_was_published_then_hears_it_closed() -> None:
    """A consumer holding every frame it may (no credit left) as its producer closed: the server left at once,
    so the frames published before the close never came (and were not counted as skipped), ProducerGone said
    "closed or died", and ``producer_closing`` was never True. As a local consumer still reads the ring, the
    server now waits for its credit (``ucx_engine.DRAIN_S``), the Sender's close() for its server."""
    got, stats, end = _behind_at_a_clean_close(0.3)  # the server has seen the close by now (it looks every PING_S)
    assert got == [4, 5, 6, 7] and stats["skipped"] == 0, (got, stats)
    assert end.closed and "died" not in str(end), end


def test_frames_a_remote_consumer_never_got_before_a_clean_close_count_as_skipped() -> None:
    """Still holding every frame it may ``DRAIN_S`` after the close: the server gives up on the frames published
    meanwhile, as it must, but the consumer never counted them (the goodbye said no last seq), so its
    ``stats()`` read as if nothing had been lost. The goodbye now carries the producer's last seq."""
    got, stats, end = _behind_at_a_clean_close(ucx_engine.DRAIN_S + 1.0)
    assert end.closed
    assert stats["skipped"] > 0, (got, stats)  # the server did give up on some: the goodbye's count was used
    assert stats["received"] == 3 + len(got) and stats["received"] + stats["skipped"] == 7, (got, stats)


@pytest.mark.parametrize("shape", [(16, 16, 4), (160, 160, 4)], ids=["inline", "two-messages"])
def test_a_padded_crop_arrives_compact_and_whole(shape: tuple[int, int, int]) -> None:
    """A link whose frames have padded rows (``strides=``) is served compact: copied behind the header for
    a small frame, into one contiguous host copy for a large one; either way every byte is the crop's."""
    _, w, c = shape
    strides = (w * c + 64, c, 1)  # 64 bytes of padding after each row
    name = unique("c")
    port = free_port()
    with cudalink.Sender(name, shape=shape, strides=strides, serve=f"ucx://127.0.0.1:{port}") as tx:
        t = _feed(tx, 0.005)
        rx = remote_bench.connect(port, name, within=20, device="cpu", latest=False)
        with rx:
            for _ in range(10):
                with rx.recv(timeout=5.0) as f:
                    assert f.strides is None or f.strides == (w * c, c, 1)
                    check(f)
    t.join(5)


# -- two "hosts" ----------------------------------------------------------------------------------------------


def _netns_reason() -> str | None:
    import shutil

    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux to make network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"cltest{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"`ip netns add` failed here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def test_two_network_namespaces_joined_by_a_veth_pair() -> None:
    """The producer and its server in one network namespace, the consumer in another: two hosts, as far as
    the network goes (they share /dev/shm, which only the producer and server use)."""
    reason = _netns_reason()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    a, b = f"cla{tag}", f"clb{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    sub = 10 + os.getpid() % 200
    ip_a, ip_b = f"10.{sub}.77.1", f"10.{sub}.77.2"

    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    made: list[str] = []
    prod = srv = cons = None
    try:
        for ns in (a, b):
            run("ip", "netns", "add", ns)
            made.append(ns)
        run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        run("ip", "link", "set", va, "netns", a)
        run("ip", "link", "set", vb, "netns", b)
        for ns, dev, ip in ((a, va, ip_a), (b, vb, ip_b)):
            run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        name = unique("n")
        prod = Proc(["-m", "tests._ucx_procs", "producer", name, "--frames", "1000000", "--fps", "100", "--report"])
        prod.expect("ready")
        port = free_port()
        srv = Proc(["-m", "cudalink", "serve", name, "--listen", f"ucx://0.0.0.0:{port}", "-v"], _NETNS=a)
        srv.expect("cudalink: serving", 30.0)
        cons = Proc(
            [
                "-m",
                "tests._ucx_procs",
                "gpu-consumer",
                f"ucx://{ip_a}:{port}/{name}",
                "--device",
                "cpu",
                "--lib",
                "numpy",
                "--frames",
                "30",
                "--until-gone",
            ],
            _NETNS=b,
        )
        line = cons.expect("checked", 60.0)
        assert " bad 0 " in line, line
        # the cable is pulled: no RST reaches either side, only silence
        prod.expect("consumers 1", 10.0)
        pulled = time.monotonic()
        run("ip", "-n", a, "link", "set", va, "down")
        gone = float(cons.expect("gone", 10.0).split()[1])
        assert gone - pulled <= 1.0 + 0.2, f"the consumer saw the server vanish after {gone - pulled:.2f}s"
        prod.expect("consumers 0", 10.0)
        assert time.monotonic() - pulled <= 1.0 + 0.3, "the server kept the vanished consumer's lease"
    finally:
        for p in (cons, srv, prod):
            if p is not None:
                p.stop()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# -- bench --remote ---------------------------------------------------------------------------------------------


def test_remote_bench_runs_the_gpu_rows_on_the_gpu_asked_for_and_says_when_quick_leaves_them_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device 1`` measured GPU 0 (the rows were pinned to it), and ``--quick`` dropped them without a word."""
    calls: list[tuple[str, object]] = []
    lat = {"n": 1, "p50_us": 10.0, "p99_us": 20.0}
    rate = {"fps": 100.0, "GBps": 1.0}

    def stream(shape: object, secs: float, device: str = "cpu", env: object = None) -> dict[str, float]:
        calls.append(("stream", device))
        return rate

    def d2d(nbytes: int, count: int = 50, device: int = 0) -> dict[str, float]:
        calls.append(("d2d", device))
        return rate

    monkeypatch.setattr(remote_bench, "cudalink_handoff", lambda *a, **k: lat)
    monkeypatch.setattr(remote_bench, "bare_handoff", lambda *a, **k: lat)
    monkeypatch.setattr(remote_bench, "bare_stream", lambda *a, **k: rate)
    monkeypatch.setattr(remote_bench, "tcp_stream", lambda *a, **k: rate)
    monkeypatch.setattr(remote_bench, "cudalink_stream", stream)
    monkeypatch.setattr(remote_bench, "bare_d2d", d2d)
    monkeypatch.setattr(remote_bench, "_gpu_here", lambda: True)
    quick = remote_bench.run(quick=True)
    assert "gpu_stream" not in quick and "--quick" in quick["gpu_skipped"]
    remote_bench.print_report(quick)
    assert "GPU rows: --quick leaves" in capsys.readouterr().out
    asked: list[dict[str, object]] = []
    monkeypatch.setattr(remote_bench, "run", lambda **kw: asked.append(kw) or quick)
    for given in ("1", "cuda:1", "auto", "cpu"):  # the command line's forms (--device 1 as its help says)
        remote_bench.cmd_remote_bench(argparse.Namespace(device=given, quick=True, json=None))
    assert [a.get("device") for a in asked] == [1, 1, None, None], asked
    assert [a["gpu"] for a in asked] == [True, True, None, False], asked
    monkeypatch.undo()
    for name, fake in (("cudalink_handoff", lambda *a, **k: lat), ("bare_handoff", lambda *a, **k: lat)):
        monkeypatch.setattr(remote_bench, name, fake)
    for name, fake in (("bare_stream", lambda *a, **k: rate), ("tcp_stream", lambda *a, **k: rate)):
        monkeypatch.setattr(remote_bench, name, fake)
    monkeypatch.setattr(remote_bench, "cudalink_stream", stream)
    monkeypatch.setattr(remote_bench, "bare_d2d", d2d)
    calls.clear()
    on_1 = remote_bench.run(quick=True, gpu=True, device=1)
    assert set(on_1["gpu_stream"]) == {"1080p", "4K"}
    gpu_calls = [c for c in calls if c != ("stream", "cpu")]
    assert gpu_calls and all(dev in ("1", 1) for _, dev in gpu_calls), gpu_calls


def test_the_remote_benchs_producer_leaves_nothing_behind_when_the_bench_stops_it() -> None:
    """The bench stops its producer with SIGTERM, which killed it where it stood: each run left its link in
    /dev/shm (130 MB at 4K) until a ``cudalink clean``. Its Sender now closes."""
    from cudalink.transport.shm import leftovers

    p, _port, name = remote_bench._start_producer((8, 8, 4), 0.01, 60.0, "cpu", "copy")
    try:
        remote_bench._wait_line(p, "ready")
    finally:
        p.terminate()
        rc = p.wait(20)
    assert rc == 0 and leftovers(name, unrecorded=True) == ([], []), (rc, leftovers(name, unrecorded=True))


def test_remote_bench_times_cudalink_and_both_bare_floors(capsys: pytest.CaptureFixture[str]) -> None:
    """Its parts measure what they say (a latency per frame, from stamps the sender wrote), and the report
    shows the goal's floor (one message, UCXX's core API) beside the two-message one and the asyncio API's."""
    c = remote_bench.cudalink_handoff((8, 8, 4), 20, 0.002)
    one = remote_bench.bare_handoff(8 * 8 * 4, 20, 0.002, one=True)
    two = remote_bench.bare_handoff(8 * 8 * 4, 20, 0.002, one=False)
    aio = remote_bench.bare_handoff(8 * 8 * 4, 20, 0.002, one=True, api="asyncio")
    for row in (c, one, two, aio):
        assert row["n"] == 20 and 0 < row["p50_us"] <= row["p99_us"] < 1e6
    remote_bench.print_report(
        {
            "ucx_tls": "tcp",
            "progress": "thread",
            "handoff": {
                "8x8x4": {
                    "cudalink": c,
                    "bare_ucxx": one,
                    "bare_ucxx_two": two,
                    "bare_ucxx_asyncio": aio,
                    "ratio_p50": c["p50_us"] / one["p50_us"],
                    "ratio_p50_two": c["p50_us"] / two["p50_us"],
                    "ratio_p50_asyncio": c["p50_us"] / aio["p50_us"],
                }
            },
            "stream": {},
        }
    )
    out = capsys.readouterr().out
    assert "bare, 1 msg" in out and "bare, 2 msgs" in out and "asyncio, 1 msg" in out and "8x8x4" in out


def test_paired_remote_bench_runs_every_pipeline_on_one_grid(tmp_path: Path) -> None:
    """benchmarks/remote_paired.py: this checkout and another (here the same one), and both bare floors, at once;
    frame k of each is read against frame k of the others, so every pipeline reports the same frames."""
    out = tmp_path / "paired.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "remote_paired.py"
    root = str(script.parents[1])
    cmd = [sys.executable, str(script), "--frames", "30", "--period", "0.004", "--shape", "8x8x4", "--lead", "8"]
    cmd += ["--wait", "spin"]
    done = subprocess.run([*cmd, "--other", root, "--json", str(out)], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["pipelines"]) == {"this", "other", "bare", "asyncio"} and r["wait"] == "spin"
    assert 20 <= r["frames"] <= 30  # a pipeline late to connect loses its first frames, from every pipeline
    for name, s in r["pipelines"].items():
        assert 0 < s["p50_us"] <= s["p90_us"] <= s["p99_us"] < 1e6, name
    assert r["ratio_p50"]["this"] == pytest.approx(r["pipelines"]["this"]["p50_us"] / r["pipelines"]["bare"]["p50_us"])
    assert "p50 / bare" in done.stdout and "floor" in done.stdout


def test_an_in_order_remote_consumer_counts_every_frame_it_never_got() -> None:
    """A latest=False remote consumer first takes frames from before it joined (still in the producer's slots);
    frames the server then skipped for it while it held its credits were counted from the producer's count at
    its join, not from the last frame it took: one or more went neither received nor skipped."""
    name = unique("io")
    port = free_port()
    shape = (8, 8, 4)
    with cudalink.Sender(name, shape=shape, slots=8, serve=f"ucx://127.0.0.1:{port}") as tx:
        t = _feed(tx, 0.01)
        while tx.seq < 12:  # older frames in the slots as it joins
            time.sleep(0.01)
        rx = remote_bench.connect(port, name, within=20, device="cpu", latest=False)
        with rx:
            held = [rx.recv(timeout=5.0)]
            first, before = held[0].seq, rx.stats()["skipped"]  # what went by before its first frame
            held.append(rx.recv(timeout=5.0))
            time.sleep(0.5)  # every credit held: the server skips ~50 frames for us
            seqs = [f.seq for f in held]
            for f in held:
                f.release()
            for _ in range(5):
                with rx.recv(timeout=5.0) as f:
                    check(f)
                    seqs.append(f.seq)
            got = rx.stats()
    t.join(5)
    assert seqs == sorted(seqs) and seqs[-1] - seqs[1] > 5, seqs  # frames were skipped in between
    assert got["received"] == len(seqs) and got["received"] + got["skipped"] - before == seqs[-1] - first + 1, (
        seqs,
        got,
    )
