"""ucx:// edges between real processes over TCP on 127.0.0.1: no time limit, a consumer that holds every frame
when its producer dies, a port already taken, a close right before exit, and a relay whose upstream restarts
with larger frames."""

from __future__ import annotations

import contextlib
import gc
import glob
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import cudalink
from cudalink import _platform
from cudalink.transport import ucx_engine, ucx_source

from ._ucx_procs import check, pattern
from .test_ucx import ROOT, Proc, free_port, producer, served, server, unique

pytestmark = pytest.mark.timeout(120)


def _joined(srv: Proc) -> int:
    return sum("a consumer joined" in ln for ln in srv.log)


def test_no_time_limit_attaches_once_and_waits() -> None:
    """``timeout=None`` is no limit: it once raised OverflowError inside each connect attempt, which was
    retried for ever while every abandoned attempt kept a consumer place of the producer's link."""
    with served("n", "--frames", "1000000", "--fps", "50") as (_, srv, url):
        with cudalink.Receiver(url, timeout=None) as rx:
            with rx.recv() as f:
                check(f)
            with rx.recv(timeout=math.inf) as f:
                check(f)
        time.sleep(0.3)
        assert _joined(srv) == 1, "".join(srv.log)


def test_a_consumer_holding_every_frame_hears_its_producer_die_within_a_second() -> None:
    """With every landing buffer held, the server sends it nothing: it must still say when the producer goes
    (it once did only when a frame was given back: the consumer saw LinkTimeout, not ProducerGone)."""
    with (
        served("h", "--frames", "1000000", "--fps", "100") as (prod, _, url),
        cudalink.Receiver(url, latest=False, timeout=10.0) as rx,
    ):
        held = [rx.recv(timeout=5.0) for _ in range(ucx_source.CREDITS)]
        for f in held:
            check(f)
        time.sleep(0.3)  # the server has nothing it may send
        killed = time.monotonic()
        prod.kill()
        with pytest.raises(cudalink.ProducerGone, match="closed or died"):
            while True:
                rx.recv(timeout=5.0).release()
        assert time.monotonic() - killed <= 1.0
        for f in held:  # still whole: their memory is ours
            check(f)
            f.release()


def test_serving_on_a_port_in_use_is_refused_at_once(name: str) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(cudalink.LinkError, match=rf"^cudalink: port {port} is in use.*pick another port"):
            cudalink.Sender(name, shape=(4,), dtype="uint8", serve=f"ucx://127.0.0.1:{port}")
        assert time.monotonic() - t0 < ucx_engine.PORT_WAIT_S + 1.0
    with cudalink.Sender(name, shape=(4,), dtype="uint8"):  # nothing was left behind under the name
        pass


@pytest.mark.parametrize(
    ("ephemeral", "advice"),
    [
        ((32768, 60999), "(below 32768 or above 60999)"),
        ((49152, 65535), "(below 49152)"),
        ((1024, 65535), "(none is left: narrow the range"),
    ],
)
def test_a_port_that_stays_busy_is_explained_by_where_it_lies(
    ephemeral: tuple[int, int], advice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cudalink import ucx_server

    monkeypatch.setattr(_platform, "ephemeral_ports", lambda: ephemeral)
    low, high = ephemeral
    exc = RuntimeError("UCXXBusyError")
    inside = ucx_server.busy_message(low, exc)
    assert f"ephemeral range ({low}-{high})" in inside and advice in inside, inside
    if low > 1024:
        outside = ucx_server.busy_message(low - 1, exc)
        assert "another server holds it; pick another port" in outside and "ephemeral" not in outside


def test_a_port_let_go_of_a_moment_later_is_taken() -> None:
    """A producer restarted right after a crash finds its old server still on the port for a moment (it sees
    its parent gone within 0.2 s): the new one waits for the port rather than fail."""
    taken = socket.socket()
    taken.bind(("", free_port()))  # outside the ephemeral range, which the server's own UCX sockets draw on
    taken.listen(1)
    port = taken.getsockname()[1]
    threading.Timer(0.5, taken.close).start()
    name = unique("w")
    with cudalink.Sender(name, shape=(4,), dtype="uint8", serve=f"ucx://127.0.0.1:{port}") as tx:
        assert tx._remote is not None


def test_a_receiver_closed_right_before_exit_says_goodbye_and_leaves_nothing_pending() -> None:
    with served("x", "--frames", "1000000", "--fps", "100") as (_, srv, url):
        script = (
            "import cudalink\n"
            f"with cudalink.Receiver({url!r}, timeout=10.0) as rx:\n"
            "    rx.recv().release()\n"
            "print('closed', flush=True)\n"
        )
        child = Proc(["-c", script])
        child.expect("closed", 30.0)
        assert child.p.wait(20) == 0, "".join(child.log)
        out = "".join(child.log)
        assert "Task was destroyed" not in out and "Traceback" not in out and "RuntimeError" not in out, out
        srv.expect("cudalink serve: a consumer said goodbye", 10.0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's fds in /proc")
def test_closing_gives_the_file_descriptors_back_without_the_garbage_collector() -> None:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with served("f", "--frames", "1000000", "--fps", "200") as (_, _, url):
        gc.collect()
        gc.disable()
        try:
            with cudalink.Receiver(url, timeout=10.0) as rx:  # the engine and its first connection
                rx.recv().release()
            time.sleep(0.5)
            before = fds()
            for _ in range(6):
                rx = cudalink.Receiver(url, timeout=10.0)
                rx.recv().release()
                rx.close()
            deadline = time.monotonic() + 5.0
            while fds() > before + 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert fds() <= before + 2, (before, fds())
        finally:
            gc.enable()


def test_relay_follows_an_upstream_restart_with_larger_frames() -> None:
    name = unique("r")
    local = unique("rl")
    prod = producer(name, "--frames", "1000000", "--fps", "100", "--shape", "8,8,4")
    srv, url = server(name)
    relay = Proc(["-m", "cudalink", "relay", url, "--as", local])
    try:
        relay.expect("cudalink: relaying", 20.0)
        with cudalink.Receiver(local, timeout=10.0) as rx:
            with rx.recv(timeout=5.0) as f:
                assert f.shape == (8, 8, 4)
                check(f, relayed=True)
            prod.kill()
            prod = producer(name, "--frames", "1000000", "--fps", "100", "--shape", "64,64,4")
            deadline = time.monotonic() + 20.0
            while True:
                assert time.monotonic() < deadline, "".join(relay.log)
                try:
                    f = rx.recv(timeout=1.0)
                except (cudalink.ProducerGone, cudalink.LinkTimeout):
                    continue
                with f:
                    if f.shape == (64, 64, 4):
                        check(f, relayed=True)
                        assert f.timestamp_ns > 0
                        break
        assert relay.p.poll() is None, "".join(relay.log)
    finally:
        relay.stop()
        srv.stop()
        prod.stop()


def test_an_in_order_relay_loses_no_frame_while_it_makes_its_local_link_again() -> None:
    """An upstream restart with larger frames: the relay's thread makes the local link again, and the frames that
    came meanwhile (the lander lends no slot then) landed in its Receiver's buffers, where that thread dropped them:
    published nowhere and counted nowhere, upstream frames 2 and 3 of the restarted producer never reached an
    in-order local consumer. That thread now sends them, and no slot is lent until it has: the local link keeps
    the upstream's order."""
    name, local = unique("g"), unique("gl")
    srv, url = server(name)
    relay = Proc(["-m", "cudalink", "relay", url, "--as", local, "--in-order", "--slots", "16"])
    try:
        with cudalink.Sender(name, shape=(8, 8, 4), slots=16) as tx:
            deadline = time.monotonic() + 30.0
            while not any("cudalink: relaying" in ln for ln in relay.log):  # the relay starts at a first frame
                assert time.monotonic() < deadline, "".join(relay.log)
                tx.send(pattern((8, 8, 4), tx.seq + 1), meta=struct.pack("<Q", tx.seq + 1))
                time.sleep(0.02)
        with cudalink.Receiver(local, latest=False, timeout=10.0) as rx:
            for big in [(32, 32, 4), (64, 64, 4), (128, 128, 4)]:  # each over the last: a new local link each time
                with cudalink.Sender(name, shape=big, slots=16) as tx:

                    def feed() -> None:  # the first 8 back to back: they come as the relay makes the local link
                        for seq in range(1, 31):
                            tx.send(pattern(big, seq), meta=struct.pack("<Q", seq))  # noqa: B023
                            time.sleep(0 if seq < 8 else 0.01)

                    feeder = threading.Thread(target=feed, daemon=True)
                    feeder.start()
                    got: list[int] = []
                    deadline = time.monotonic() + 20.0
                    while 30 not in got and time.monotonic() < deadline:
                        try:
                            f = rx.recv(timeout=1.0)
                        except (cudalink.ProducerGone, cudalink.LinkTimeout):
                            continue
                        with f:
                            if f.shape == big:
                                check(f, relayed=True)
                                got.append(struct.unpack("<Q", f.meta)[0])
                    feeder.join(10)
                assert got == list(range(1, 31)), (big, got, "".join(relay.log))
    finally:
        relay.stop()
        srv.stop()


def _take_relayed(rx: cudalink.Receiver, stamps: dict[int, int], timeout: float) -> tuple[int, int] | None:
    """One frame off a relay's local link, checked whole and stamped as its producer stamped it: (its local seq,
    its producer's seq from the meta), or None where none came within ``timeout``."""
    try:
        f = rx.recv(timeout=timeout)
    except (cudalink.LinkTimeout, cudalink.ProducerGone):
        return None
    with f:
        check(f, relayed=True)
        sent: int = struct.unpack("<Q", f.meta)[0]
        assert f.timestamp_ns == stamps[sent]
        return f.seq, sent


def test_the_relay_keeps_each_frames_timestamp_and_meta() -> None:
    name = unique("t")
    local = unique("tl")
    port = free_port()
    with cudalink.Sender(name, shape=(4, 4, 4), serve=f"ucx://127.0.0.1:{port}") as tx:
        relay = Proc(["-m", "cudalink", "relay", f"ucx://127.0.0.1:{port}/{name}", "--as", local, "--in-order"])
        try:
            stamps: dict[int, int] = {}
            deadline = time.monotonic() + 30.0
            with cudalink.Receiver(local, latest=False, timeout=0.2, connect=False) as rx:
                while time.monotonic() < deadline:
                    seq = tx.seq + 1
                    stamps[seq] = 1_000_000_000 * seq + 7
                    tx.send(pattern((4, 4, 4), seq), meta=struct.pack("<Q", seq), timestamp_ns=stamps[seq])
                    if _take_relayed(rx, stamps, 0.05) is not None:
                        break
                else:
                    raise AssertionError("no relayed frame within 30 s:\n" + "".join(relay.log))
        finally:
            relay.stop()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_relay_says_when_its_upstream_goes_and_comes_back(how: str) -> None:
    """A relay whose server went away said nothing at all while its local consumers waited, nor when it was back:
    its log showed only the first 'relaying' line. A stopped server (SIGTERM) still took consumers in while it
    said goodbye: the relay, told "server closing", connected again at once, took a frame and said its
    upstream "is back" 10 ms before the server exited."""
    import signal

    name = unique("w")
    local = unique("wl")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    port = free_port()
    srv, url = server(name, port)
    relay = Proc(["-m", "cudalink", "relay", url, "--as", local])
    try:
        relay.expect("cudalink: relaying", 20.0)
        if how == "killed":
            srv.kill()
        else:
            srv.p.send_signal(signal.SIGTERM)
            assert srv.p.wait(10) == 0, "".join(srv.log)
        line = relay.expect("cudalink: lost", 10.0)
        assert url in line and f"{local!r} stays up" in line and "recv() again" not in line, line
        if how == "stopped":
            assert "server closing" in line, line
            time.sleep(1.0)  # the false "back" came within the server's goodbye (GOODBYE_S)
            assert not any("is back" in ln for ln in relay.log), "".join(relay.log)
        srv, _ = server(name, port)
        assert "(32x32x4 uint8)" in relay.expect(f"cudalink: {url} is back", 30.0)
        assert sum("cudalink: lost" in ln for ln in relay.log) == 1, "".join(relay.log)
    finally:
        relay.stop()
        srv.stop()
        prod.stop()


def test_a_relay_stopped_with_sigterm_closes_its_local_link_like_ctrl_c() -> None:
    """SIGTERM (a service manager, ``timeout``) killed the relay where it stood: its local consumers heard
    "closed or died" and its segments, socket and lock stayed in /dev/shm for ``clean``."""
    import signal

    from cudalink.transport.shm import leftovers

    local = unique("tl")
    with served("tt", "--frames", "1000000", "--fps", "100") as (_, _, url):
        relay = Proc(["-m", "cudalink", "relay", url, "--as", local])
        try:
            relay.expect("cudalink: relaying", 20.0)
            with cudalink.Receiver(local, timeout=10.0) as rx:
                for _ in range(3):
                    with rx.recv(timeout=5.0) as f:
                        check(f, relayed=True)
                relay.p.send_signal(signal.SIGTERM)
                with pytest.raises(cudalink.ProducerGone, match="closed the link;"):
                    while True:
                        rx.recv(timeout=5.0).release()
            assert relay.p.wait(10) == 0, "".join(relay.log)
            assert leftovers(local, unrecorded=True) == ([], []), "".join(relay.log)
        finally:
            relay.stop()


def test_the_serve_command_says_it_listens_on_every_interface() -> None:
    with served("i", "--frames", "1000000", "--fps", "10") as (_, srv, _):
        line = srv.expect("cudalink: UCXX listens on port", 10.0)
        assert "every IPv4 interface" in line and "key" in line


def test_an_engine_wait_that_gives_up_hands_what_is_made_anyway_to_orphan() -> None:
    """``Engine.run`` cancels what it stops waiting for; a result made all the same (a connection finished as
    the caller gave up) goes to ``orphan``, so it is closed rather than leaked."""
    import asyncio

    eng = ucx_engine.engine()
    got: list[object] = []

    async def heeds() -> str:
        await asyncio.sleep(0.3)
        return "made"

    async def stubborn() -> str:
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
        return "made anyway"

    with pytest.raises(TimeoutError):
        eng.run(heeds(), 0.05, got.append)
    with pytest.raises(TimeoutError):
        eng.run(stubborn(), 0.05, got.append)
    deadline = time.monotonic() + 3.0
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.4)
    assert got == ["made anyway"]
    assert eng.run(heeds(), 5.0, got.append) == "made"  # a wait that ends in time hands it to the caller
    assert got == ["made anyway"]


def test_waiting_for_a_server_that_is_down_is_quiet_and_says_what_to_check() -> None:
    """UCXX logged an ERROR line for every failed attempt (about 20 a second), and the reason given was UCX's
    "length mismatch"; cudalink now says what to check, and UCXX's lines are off unless asked for."""
    port = free_port()
    script = (
        "import cudalink\n"
        "try:\n"
        f"    cudalink.Receiver('ucx://127.0.0.1:{port}/x', timeout=1.5)\n"
        "except cudalink.LinkTimeout as exc:\n"
        "    print('timeout:', exc, flush=True)\n"
    )
    child = Proc(["-c", script])
    line = child.expect("timeout:", 30.0)
    assert child.p.wait(20) == 0
    # in plain words, not only UCX's ("UCXXMessageTruncatedError: length mismatch: 0 (got) != 16 (expected)")
    assert f"no cudalink server answered at 127.0.0.1:{port}" in line and "cudalink serve" in line, line
    assert "length mismatch" not in line or "the connection was refused or closed" in line, line
    noise = [ln for ln in child.log if "UCXX ERROR" in ln]
    assert not noise, "".join(child.log)
    loud = Proc(["-c", script], UCXX_LOG_LEVEL="ERROR")  # the user's setting wins
    loud.expect("timeout:", 30.0)
    assert loud.p.wait(20) == 0
    assert any("UCXX ERROR" in ln for ln in loud.log), "".join(loud.log)


@pytest.mark.parametrize("host", ["no.such.host.invalid", "999.1.1.1", "user@127.0.0.1"])
def test_a_host_that_never_resolves_is_refused_at_once_naming_it(host: str) -> None:
    """UCX said "Invalid IP address or hostname" on every attempt, and the Receiver waited out its timeout
    and ended in LinkTimeout; the host is resolved once, up front."""
    try:
        socket.getaddrinfo(host, None, socket.AF_INET)
    except socket.gaierror as exc:
        if exc.errno not in ucx_engine._NO_SUCH_HOST:
            pytest.skip(f"this machine's resolver does not answer for {host!r} ({exc.strerror})")
    else:
        pytest.skip(f"{host!r} resolves here")
    ucx_engine.engine()  # started: its start is not what is timed
    t0 = time.monotonic()
    with pytest.raises(cudalink.ProtocolError, match=rf"^cudalink: the host {host!r} .*does not resolve to an IPv4"):
        cudalink.Receiver(f"ucx://{host}:{free_port()}/x", timeout=10.0, device="cpu")
    assert time.monotonic() - t0 < 3.0


def test_a_host_the_resolver_cannot_answer_for_now_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DNS server that does not answer (EAI_AGAIN) is no proof the host is wrong: the Receiver tries again
    within its timeout, as it does for a server not up yet, and says why it gave up."""
    asked: list[str] = []

    def no_answer(host: str, *args: object, **kwargs: object) -> object:
        asked.append(host)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    ucx_engine.engine()
    monkeypatch.setattr(socket, "getaddrinfo", no_answer)
    t0 = time.monotonic()
    with pytest.raises(cudalink.LinkTimeout, match=r"cannot resolve the host 'cam.lan' now \(Temporary"):
        cudalink.Receiver(f"ucx://cam.lan:{free_port()}/x", timeout=1.0, device="cpu")
    assert time.monotonic() - t0 >= 1.0 and len(asked) > 1


def test_a_host_is_looked_up_again_after_a_failed_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first answer was kept for the Receiver's life: a server that moved to another address was never
    followed. Here no server listens, so every connection fails and each try looks the host up anew."""
    asked: list[str] = []
    real = ucx_engine.resolve

    def counted(host: str) -> str:
        asked.append(host)
        return real("127.0.0.1")

    ucx_engine.engine()
    monkeypatch.setattr(ucx_engine, "resolve", counted)
    with pytest.raises(cudalink.LinkTimeout, match="no cudalink server answered"):
        cudalink.Receiver(f"ucx://camhost:{free_port()}/x", timeout=1.5, device="cpu")
    assert len(asked) > 1 and set(asked) == {"camhost"}, asked


def test_a_resolver_slower_than_the_timeout_is_named_not_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that outlasted the Receiver's timeout was reported as "no answer from HOST:PORT", a server
    that never answered."""

    def slow(host: str) -> str:
        time.sleep(3.0)
        return "127.0.0.1"

    ucx_engine.engine()
    monkeypatch.setattr(ucx_engine, "resolve", slow)
    with pytest.raises(cudalink.LinkTimeout, match=r"the host 'slowhost' did not resolve within") as info:
        cudalink.Receiver(f"ucx://slowhost:{free_port()}/x", timeout=1.0, device="cpu")
    assert "no answer from" not in str(info.value), info.value


def test_the_serve_command_refuses_a_listen_host_that_never_resolves() -> None:
    """It printed "serving 'NAME' at ucx://nosuch.invalid:PORT" and ran."""
    srv = Proc(["-m", "cudalink", "serve", unique("r"), "--listen", f"ucx://nosuch.invalid:{free_port()}"])
    try:
        assert srv.p.wait(20) == 1, "".join(srv.log)
    finally:
        srv.stop()
    time.sleep(0.1)  # the reader thread's last lines
    out = "".join(srv.log)
    assert "'nosuch.invalid'" in out and "does not resolve" in out and "serving" not in out, out


def test_serving_a_name_no_producer_publishes_says_so_and_serves_on() -> None:
    """Consumers are refused (they try again within their timeout) until a producer starts: the server says
    so once, instead of serving without a word. A producer already there gets no such line."""
    name = unique("none")
    srv, url = server(name)
    try:
        line = srv.expect("cudalink: no producer publishes", 10.0)
        assert f"{name!r} on this host yet" in line and "refused" in line, line
        with pytest.raises(cudalink.LinkTimeout, match="no producer publishes"):
            cudalink.Receiver(url, timeout=1.0, device="cpu")
        assert srv.p.poll() is None
    finally:
        srv.stop()
    with served("some", "--frames", "1000000", "--fps", "10") as (_, srv, url):
        srv.expect("cudalink: UCXX listens on port", 10.0)
        with cudalink.Receiver(url, timeout=10.0, device="cpu") as rx:  # the server has said its lines by now
            rx.recv(timeout=5.0).release()
        assert not any("no producer publishes" in ln for ln in srv.log), "".join(srv.log)


def test_the_serve_command_on_a_port_in_use_is_refused_at_once() -> None:
    """It retried inside UCX for 15 s, printing UCX's bind errors, before it said so."""
    name = unique("b")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        srv = Proc(["-m", "cudalink", "serve", name, "--listen", f"ucx://127.0.0.1:{port}"])
        assert srv.p.wait(10) == 1, "".join(srv.log)
        assert time.monotonic() - t0 < 8.0
        out = "".join(srv.log)
        assert f"port {port} is in use" in out and "UCX ERROR" not in out, out


@pytest.mark.parametrize("lie", ["credits", "capacity", "seq", "short"])
def test_a_server_that_lies_is_refused_before_anything_is_allocated(lie: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A WELCOME taking more credits than granted, or frames too large for this machine, is refused before a
    landing buffer is made (one of 64 x 16 GiB made a 1 TiB process); a seq that goes back, or a pixel message
    shorter than its header says, ends the connection instead of passing an old frame's bytes off as new."""
    from cudalink import _platform

    monkeypatch.setattr(_platform, "physical_memory", lambda: 8 << 30)
    port = free_port()
    srv = Proc(["-m", "tests._ucx_procs", "lying-server", str(port), lie])
    try:
        srv.expect("listening")
        url = f"ucx://127.0.0.1:{port}/liar"
        if lie in ("seq", "short"):
            first, words = (5, "seq 3 after seq 5") if lie == "seq" else (1, "sent 8 bytes where 64 were due")
            with cudalink.Receiver(url, device="cpu", timeout=5.0, latest=False) as rx:
                assert rx.recv(timeout=5.0).seq == first
                with pytest.raises(cudalink.ProducerGone, match=words):
                    rx.recv(timeout=5.0)  # not a frame whose last 56 bytes are frame 1's
            return
        words = "took 4 credits; we granted 3" if lie == "credits" else "more than this machine's"
        t0 = time.monotonic()
        with pytest.raises(cudalink.LinkError, match=words):  # at once: waiting would not change it
            cudalink.Receiver(url, device="cpu", timeout=5.0)
        assert time.monotonic() - t0 < 4.0
    finally:
        srv.stop()


def test_a_close_landing_while_recv_drains_the_wakeup_pipe_is_not_lost() -> None:
    """``alive()`` drains the attachment's wake-up pipe before recv sleeps on it: a ``close()`` (on another
    thread) landing between the two lost its wake-up byte, and the recv slept to its timeout (forever with
    none). Here the close lands exactly there."""
    with served("closerace", "--frames", "1", "--linger", "30") as (_prod, _srv, url):
        rx = cudalink.Receiver(url, device="cpu", timeout=10.0, latest=True)
        rx.recv(timeout=10).release()
        att = rx._att
        assert att is not None
        drain = att.alive

        def alive_then_closed() -> bool:
            rx.close()  # interrupt() writes its byte now...
            return drain()  # ...and this drains it

        att.alive = alive_then_closed  # type: ignore[method-assign]
        t0 = time.monotonic()
        with pytest.raises(cudalink.LinkClosed):
            rx.recv(timeout=5.0)
        assert time.monotonic() - t0 < 1.0


def test_serve_returns_once_its_server_listens_and_a_second_on_that_port_is_refused() -> None:
    """``Sender(serve=)`` returned before its server listened: a second one on the same port passed the port
    check too, and its server then gave up alone, 15 s later, while that Sender carried on unserved."""
    port = free_port()
    name = unique("twice")
    with cudalink.Sender(name, shape=(4,), dtype="uint8", device="cpu", serve=f"ucx://127.0.0.1:{port}") as tx:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            pass  # listening already
        t0 = time.monotonic()
        with pytest.raises(cudalink.LinkError, match=f"port {port}"):
            cudalink.Sender(name + "b", shape=(4,), dtype="uint8", device="cpu", serve=f"ucx://127.0.0.1:{port}")
        assert time.monotonic() - t0 < 10.0
        # the refused Sender closed what it had made
        assert not glob.glob(f"/dev/shm/{_platform.segment_name(name + 'b')}*")
        with cudalink.Receiver(f"ucx://127.0.0.1:{port}/{name}", device="cpu", timeout=10.0) as rx:
            tx.send(np.arange(4, dtype=np.uint8))
            assert rx.recv(timeout=10.0).numpy().tolist() == [0, 1, 2, 3]


_SAYS_READY = """
import sys, cudalink
tx = cudalink.Sender(sys.argv[1], shape=(4,), dtype="uint8", device="cpu", serve=sys.argv[2])
print("ready")
tx.close()
"""


def test_a_server_says_where_it_serves_before_it_lets_its_sender_go_on(capsys: pytest.CaptureFixture[str]) -> None:
    """The server a Sender spawns shares the producer's stdout. It said its lines after telling the Sender,
    so a producer's "ready" (two writes under PYTHONUNBUFFERED) landed inside one of them: the bench's
    children were waited for in vain, in half the runs on a 2-vCPU VM."""
    from cudalink import ucx_server

    seen: list[str] = []
    ucx_server.listening("lnk", "127.0.0.1", 4242, lambda word: seen.append(word + "|" + capsys.readouterr().out))
    assert seen == [
        "ok|cudalink: serving 'lnk' at ucx://127.0.0.1:4242/lnk\n"
        "cudalink: UCXX listens on port 4242 of every IPv4 interface; only the key keeps others out "
        "(a firewall rule for the port helps)\n"
    ]


def test_a_server_with_nowhere_to_say_its_lines_still_tells_its_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer started with its stdout closed (or a broken pipe) must still get its server: the lines
    inform, the ready word is what the Sender waits on."""
    import io
    import sys

    from cudalink import ucx_server

    told: list[str] = []
    closed = io.StringIO()
    closed.close()  # writes raise ValueError
    monkeypatch.setattr(sys, "stdout", closed)
    ucx_server.listening("lnk", "127.0.0.1", 4242, told.append)
    monkeypatch.setattr(sys, "stdout", None)
    ucx_server.listening("lnk", "127.0.0.1", 4242, told.append)
    assert told == ["ok", "ok"]


def test_a_new_keys_announcement_is_one_line_written_once_and_never_fatal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first serve of a host makes a key and says how to copy it, before its server listens: with the
    producer's stdout closed or gone it must serve all the same (print raised there), and the lines go out
    in one write, as the server's others do, so a producer's own output cannot land inside them."""
    import io
    import sys

    from cudalink.transport import ucx_engine

    ucx_engine.announce_key("/tmp/k")
    out = capsys.readouterr().out
    assert out.startswith("cudalink: made a new key in /tmp/k. On each consumer's host run:\n"), out
    assert out.endswith("or set CUDALINK_KEY to its contents there.\n") and out.count("scp ") == 1, out
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stdout", Recorder())
    ucx_engine.announce_key("/tmp/k")
    assert len(writes) == 1, writes
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdout", closed)
    ucx_engine.announce_key("/tmp/k")  # no ValueError
    monkeypatch.setattr(sys, "stdout", None)
    ucx_engine.announce_key("/tmp/k")  # no AttributeError
    ucx_engine.announce_key(None)  # nothing made: nothing said


def test_a_serving_senders_own_output_follows_its_servers_lines_whole() -> None:
    """End to end: a producer printing right after ``Sender(serve=)`` returns."""
    name, url = unique("say"), f"ucx://127.0.0.1:{free_port()}"
    proc = Proc(["-c", _SAYS_READY, name, url], PYTHONUNBUFFERED="1")
    assert proc.p.wait(60) == 0, "".join(proc.log)
    time.sleep(0.2)  # the reader thread's last lines
    lines = [ln.rstrip("\n") for ln in proc.log if ln.startswith(("cudalink: serving", "cudalink: UCXX", "ready"))]
    assert lines == [
        f"cudalink: serving {name!r} at {url}/{name}",
        lines[1],
        "ready",
    ] and lines[1].startswith("cudalink: UCXX listens on port"), proc.log


def test_a_server_that_cannot_start_is_an_error_of_its_sender() -> None:
    """The server's own failure (here: the port a live listener holds) reaches ``spawn_server`` through the
    ready pipe, with its words."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(cudalink.LinkError, match=r"did not start.*in use"):
            ucx_engine.spawn_server(unique("nostart"), f"ucx://127.0.0.1:{port}")


def _read_until_gone(rx: cudalink.Receiver) -> str:
    """Take frames until the end: the ProducerGone's text, which must say why, not blame a lost connection."""
    with pytest.raises(cudalink.ProducerGone) as gone:
        while True:
            rx.recv(timeout=5.0).release()
    said = str(gone.value)
    assert "connection lost" not in said, said
    return said


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stopped_server_says_goodbye_to_its_consumers(sig: str) -> None:
    """``serve`` stopped (a service manager's SIGTERM, Ctrl-C) tells each remote consumer why before it goes:
    they read "server closing", not "connection lost (UCXXCanceledError ...)", which blamed the producer."""
    import signal

    with served("bye", "--frames", "1000000", "--fps", "100") as (_, srv, url):
        srv.expect("cudalink: UCXX listens on port", 20.0)
        with cudalink.Receiver(url, timeout=10.0) as rx:
            rx.recv(timeout=5.0).release()
            srv.p.send_signal(getattr(signal, sig))
            said = _read_until_gone(rx)
        assert "server closing" in said and "stopped" in said, said
        assert srv.p.wait(10) == 0, "".join(srv.log)


def test_a_serving_sender_that_closes_tells_remote_consumers_its_producer_closed() -> None:
    """``Sender(serve=).close()`` stops its server first: its remote consumers hear that the producer closed,
    not that the connection was lost."""
    name = unique("bc")
    port = free_port()
    tx = cudalink.Sender(name, shape=(8, 8, 4), serve=f"ucx://127.0.0.1:{port}")
    try:
        stop = threading.Event()

        def feed() -> None:
            while not stop.is_set():
                with contextlib.suppress(cudalink.LinkError):
                    tx.send(pattern((8, 8, 4), tx.seq + 1), meta=struct.pack("<Q", tx.seq + 1))
                time.sleep(0.01)

        t = threading.Thread(target=feed, daemon=True)
        t.start()
        from cudalink.tools import remote_bench

        with remote_bench.connect(port, name, within=20) as rx:
            rx.recv(timeout=5.0).release()
            stop.set()
            t.join(5)
            tx.close()
            said = _read_until_gone(rx)
        assert "producer closed" in said and "closed the link" in said and "died" not in said, said
    finally:
        tx.close()


def test_a_relay_whose_output_reader_went_away_keeps_relaying() -> None:
    """``relay ... | head -1``, or a log reader that died: the relay's next line (its upstream lost, say) hit a
    broken pipe and ended the relay, taking its local link down with it. It now goes on, saying nothing."""
    import signal
    import subprocess

    name = unique("rp")
    local = unique("rpl")
    prod = producer(name, "--frames", "1000000", "--fps", "100")
    port = free_port()
    srv, url = server(name, port)
    relay = subprocess.Popen(
        [sys.executable, "-m", "cudalink", "relay", url, "--as", local],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert relay.stdout is not None and relay.stderr is not None
        assert relay.stdout.readline().startswith(b"cudalink: relaying")
        relay.stdout.close()  # the reader goes away
        srv.kill()  # the relay has something to say: its upstream is lost
        srv, _ = server(name, port)
        with cudalink.Receiver(local, timeout=30.0) as rx:  # and it is still there, relaying once the server is back
            rx.recv(timeout=30.0).release()
        assert relay.poll() is None, relay.stderr.read()
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(10) == 0
        assert relay.stderr.read() == b""
    finally:
        if relay.poll() is None:
            relay.kill()
        srv.stop()
        prod.stop()


def test_a_relay_whose_server_is_down_stops_within_its_seconds_and_says_why() -> None:
    """``relay ... --seconds 2`` against no server ran 6 s: its first connection was given 5 s whatever
    --seconds said. It now stops within them, with the same advice."""
    url = f"ucx://127.0.0.1:{free_port()}/{unique('sd')}"
    relay = Proc(["-m", "cudalink", "relay", url, "--as", unique("sdl"), "--seconds", "1"])
    started = time.monotonic()
    assert relay.p.wait(30) == 1, "".join(relay.log)
    took = time.monotonic() - started
    said = "".join(relay.log)
    assert "within 1s" in said and "no cudalink server answered" in said and "start it, then the relay" in said, said
    assert took < 4.5, f"{took:.1f}s for --seconds 1 (the first connection took 5 s):\n{said}"


def test_the_server_of_a_killed_producer_run_by_a_parent_that_has_not_reaped_it_stops() -> None:
    """``subprocess.run(capture_output=True)`` of a serving producer that was SIGKILLed never returned: its
    server inherited the output pipe, and took the killed producer (a zombie until ``run`` reaps it, which it
    does only once the pipe closes) for alive. The server now sees it was handed to another parent."""
    code = (
        "import os, signal, sys, time, cudalink\n"
        "tx = cudalink.Sender(sys.argv[1], shape=(4,), device='cpu', serve=sys.argv[2])\n"
        "print('serving', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    from cudalink.transport.shm import clean

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    name = unique("zp")
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code, name, f"ucx://127.0.0.1:{free_port()}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == -9 and "serving" in out.stdout, out.stdout + out.stderr
    assert time.monotonic() - started < 20, "the server held the killed producer's output pipe"
    clean(only=[name])  # what the killed producer left


@pytest.mark.parametrize("shape", [(8, 8, 4), (160, 160, 4)], ids=["inline", "rendezvous"])
def test_a_relay_lands_each_frame_in_a_slot_of_its_local_link_without_a_copy(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: the receiving side lands frames "straight into a relay's slot through reserve()". The relay
    landed each in a buffer of its own and copied it into the local link with ``send()``. Frames of both sizes
    (pixels inline in the header, and sent on their own) arrive whole, in order, with their timestamp and meta."""
    from cudalink.tools import relay as relay_tool

    name, local = unique("y"), unique("yl")
    copied: list[str] = []
    send = cudalink.Sender.send

    def counted(self: cudalink.Sender, *args: object, **kw: object) -> int | None:
        copied.append(self.name)
        return send(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cudalink.Sender, "send", counted)
    port = free_port()
    stamps: dict[int, int] = {}
    with cudalink.Sender(name, shape=shape, slots=8, serve=f"ucx://127.0.0.1:{port}") as tx:
        done = threading.Event()
        relayed: list[int] = []

        def run() -> None:
            # slots to spare: a local consumer more than two frames behind (one slot it reads, one landing) lost
            # one to the drop policy (3 runs in 7 on a 2-core VM, 160x160), which is no fault of the landing
            relayed.append(
                relay_tool.relay(
                    f"ucx://127.0.0.1:{port}/{name}", local, slots=16, latest=False, seconds=8.0, quiet=True
                )
            )

        def feed() -> None:
            while not done.is_set():
                seq = tx.seq + 1
                stamps[seq] = 1_000_000_000 * seq + 11
                tx.send(pattern(shape, seq), meta=struct.pack("<Q", seq), timestamp_ns=stamps[seq])
                time.sleep(0.005)

        relay_thread = threading.Thread(target=run, daemon=True)
        feeder = threading.Thread(target=feed, daemon=True)
        relay_thread.start()
        feeder.start()
        try:
            got: list[tuple[int, int]] = []  # (local seq, upstream seq)
            deadline = time.monotonic() + 7.0
            with cudalink.Receiver(local, latest=False, timeout=0.2, connect=False) as rx:
                while len(got) < 30:
                    assert time.monotonic() < deadline, got
                    taken = _take_relayed(rx, stamps, 0.2)
                    if taken is not None:
                        got.append(taken)
        finally:
            done.set()
            feeder.join(5)
            relay_thread.join(15)
    assert not relay_thread.is_alive()
    assert [s for s, _ in got] == list(range(got[0][0], got[0][0] + len(got))), got  # every frame, in order
    ups = [u for _, u in got]
    assert ups == sorted(ups) and len(set(ups)) == len(ups)
    assert relayed and relayed[0] >= len(got)
    assert local not in copied, "the relay copied frames into its local link with send()"


def test_a_relay_whose_local_slots_are_all_held_drops_frames_and_relays_again_once_one_is_free() -> None:
    """A frame that finds every slot of the relay's local link held by its consumers is dropped there, as a
    local producer's ``send()`` drops it; the relay goes on, and relays again as soon as a slot is free."""
    local = unique("hl")
    with served("hh", "--frames", "1000000", "--fps", "200") as (_, _, url):
        relay = Proc(["-m", "cudalink", "relay", url, "--as", local, "--slots", "2"])
        try:
            relay.expect("cudalink: relaying", 20.0)
            with cudalink.Receiver(local, latest=False, timeout=10.0) as rx:
                held = [rx.recv(timeout=5.0), rx.recv(timeout=5.0)]  # every slot of the local link
                last = max(struct.unpack("<Q", f.meta)[0] for f in held)
                time.sleep(0.5)  # ~100 frames come meanwhile, and find no slot
                for f in held:
                    check(f, relayed=True)  # still whole: nothing was landed over them
                    f.release()
                seen = 0
                deadline = time.monotonic() + 10.0
                while seen < 10:
                    assert time.monotonic() < deadline, "".join(relay.log)
                    with rx.recv(timeout=5.0) as f:
                        check(f, relayed=True)
                        assert struct.unpack("<Q", f.meta)[0] > last
                        seen += 1
            assert relay.p.poll() is None, "".join(relay.log)
        finally:
            relay.stop()


def test_a_relay_whose_local_name_is_taken_says_so_and_exits() -> None:
    """The local link is made on the UCX thread as the first frame's header arrives; a failure there (the
    name published by a live producer) must end the relay with that error, not read as a lost connection
    retried for ever."""
    local = unique("tk")
    with (
        cudalink.Sender(local, shape=(4, 4, 4)),
        served("tk", "--frames", "1000000", "--fps", "100") as (_, _, url),
    ):
        relay = Proc(["-m", "cudalink", "relay", url, "--as", local])
        try:
            assert relay.p.wait(20) != 0, "".join(relay.log)
            relay.reader.join(5)
            said = "".join(relay.log)
            assert f"cudalink: link {local!r} is already published by a live producer" in said, said
            assert "Traceback" not in said, said
        finally:
            relay.stop()


def test_a_relay_follows_a_reconfigure_upstream_in_its_slots() -> None:
    """A format change upstream that fits the local link's slots reconfigures it (on the UCX thread, where the
    frames now land): local consumers get the new shape, whole, from the same link."""
    name, local = unique("rc"), unique("rcl")
    port = free_port()
    with cudalink.Sender(name, shape=(16, 16, 4), serve=f"ucx://127.0.0.1:{port}") as tx:
        relay = Proc(["-m", "cudalink", "relay", f"ucx://127.0.0.1:{port}/{name}", "--as", local])
        try:
            shapes: list[tuple[int, ...]] = []
            generations: set[int] = set()  # one: the local link was reconfigured, not made again
            deadline = time.monotonic() + 30.0
            with cudalink.Receiver(local, timeout=0.2, connect=False) as rx:
                while len(set(shapes)) < 2:
                    assert time.monotonic() < deadline, (shapes, "".join(relay.log))
                    shape = (16, 16, 4) if len(shapes) < 3 else (6, 10, 4)
                    if shape != tx.shape:
                        tx.reconfigure(shape=shape)
                    seq = tx.seq + 1
                    tx.send(pattern(shape, seq), meta=struct.pack("<Q", seq))
                    try:
                        f = rx.recv(timeout=0.05)
                    except (cudalink.LinkTimeout, cudalink.ProducerGone):
                        continue
                    with f:
                        check(f, relayed=True)
                        shapes.append(f.shape)
                        generations.add(rx.generation)
            assert shapes[-1] == (6, 10, 4) and len(generations) == 1, (shapes, generations)
            assert relay.p.poll() is None and "started again" not in "".join(relay.log), "".join(relay.log)
        finally:
            relay.stop()


def test_a_relay_follows_a_pixel_format_cleared_upstream() -> None:
    """An upstream that clears its pixel format (same shape) reconfigured the local link with
    ``pixel_format=None``, which keeps the old one: local frames still said RGBA, and every frame reconfigured
    the link again (the specs never matched)."""
    from cudalink.frames.spec import FrameSpec
    from cudalink.tools import relay as relay_tool

    out = relay_tool._Local("ucx://127.0.0.1:1/up", unique("pf"), "cpu", 2, True)
    try:
        tx = out.ready_for(FrameSpec((8, 8, 4), "uint8", pixel_format="RGBA8"), 256)
        assert tx.spec.pixel_format is not None
        bare = FrameSpec((8, 8, 4), "uint8")
        assert out.ready_for(bare, 256) is tx and tx.spec == bare, tx.spec
    finally:
        out.close()


def test_a_relay_that_cannot_publish_a_landed_frame_ends_with_that_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish that fails on the UCX thread (a CUDA error recording the slot's event, say) read there as a lost
    connection, which the relay's Receiver took up again and again; the relay now stops lending slots and its
    own thread raises the error, as for a local link it could not make."""
    import types

    from cudalink.frames.spec import FrameSpec
    from cudalink.tools import relay as relay_tool
    from cudalink.transport import ucx_wire

    out = relay_tool._Local("ucx://127.0.0.1:1/up", unique("pc"), "cpu", 2, True)
    lander = relay_tool._Lander(out)
    spec = FrameSpec((4, 4, 4), "uint8")
    head = ucx_wire.FrameHeader(1, 0, 1, 123, spec, b"")
    att = types.SimpleNamespace(capacity=spec.nbytes)
    try:
        slot = lander.take(head, att)  # type: ignore[arg-type]
        assert slot is not None and slot.host is not None and lander.busy
        broken = cudalink.LinkError("cudalink: the slot's event could not be recorded")

        def fail(*args: object) -> None:
            raise broken

        assert out.tx is not None
        monkeypatch.setattr(out.tx, "_commit", fail)
        slot.commit()  # not raised on the UCX thread
        assert lander.failed is broken and lander.closed and not lander.busy
        assert lander.take(head, att) is None  # type: ignore[arg-type]
        monkeypatch.undo()
        assert out.tx.stats()["published"] == 0
        with out.tx.reserve() as w:  # the slot and the Sender's lock were given back
            np.from_dlpack(w)[...] = 1
    finally:
        out.close()


class _BrokenGpu:
    """Memory a lander lends whose every write fails as a dead GPU's would: a CUDA error of this process's own."""

    def _fail(self, *args: object) -> None:
        raise cudalink.CudaError(
            "cudalink: cuMemcpyHtoDAsync failed with CUDA_ERROR_ILLEGAL_ADDRESS", 700, "CUDA_ERROR_ILLEGAL_ADDRESS"
        )

    __getitem__ = __setitem__ = _fail


def test_a_gpu_error_while_landing_a_remote_frame_is_raised_as_itself_not_as_a_lost_producer() -> None:
    """A CUDA error while a remote frame landed (the page-locked -> GPU copy, say) read as "connection lost": the
    Receiver raised ProducerGone, and a relay, which waits for a producer to come back, reconnected for ever into
    the same error. The Receiver now raises the CudaError, naming the link; nothing lent is published; the
    producer and its server were never at fault, and the next recv() connects anew."""
    from cudalink.link import default_transport
    from cudalink.transport.sources import open_source

    class Target:
        host = _BrokenGpu()
        ptr = stream = 0
        aborted = committed = 0

        def commit(self) -> None:
            Target.committed += 1

        def abort(self) -> None:
            Target.aborted += 1

    class Lander:
        def take(self, head: object, att: object) -> Target:
            return Target()

    with served("ge", "--frames", "1000000", "--fps", "200") as (prod, srv, url):
        source = open_source(url, transport=default_transport(), device="cpu", copy="auto", latest=True)
        assert isinstance(source, ucx_source.UcxSource)
        source.lander = Lander()  # type: ignore[assignment]
        with cudalink.Receiver(url, source=source, timeout=10.0) as rx:
            with pytest.raises(cudalink.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as got:
                rx.recv(timeout=10.0)
            said = str(got.value)
            assert got.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS" and got.value.result == 700
            assert said.startswith(f"cudalink: {url!r}") and "could not be landed here" in said, said
            assert "recv() again" in said and not isinstance(got.value, cudalink.ProducerGone), said
            assert Target.aborted >= 1 and Target.committed == 0
            source.lander = None  # the GPU is well again: the same Receiver connects anew and receives
            with rx.recv(timeout=10.0) as f:
                check(f)
        assert prod.p.poll() is None and srv.p.poll() is None, "".join(srv.log)


def test_a_relay_whose_landing_hits_a_gpu_error_exits_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay waits for a lost producer to come back; a CUDA error of its own while landing read as that, so
    it reconnected into the same error for ever. It now ends with the error, at once."""
    from cudalink.tools import relay as relay_tool

    class Target:
        host = _BrokenGpu()
        ptr = stream = 0

        def commit(self) -> None:
            raise AssertionError("a landing that failed was committed")

        def abort(self) -> None:
            pass

    monkeypatch.setattr(relay_tool._Lander, "take", lambda self, head, att: Target())
    with served("rg", "--frames", "1000000", "--fps", "200") as (_, _, url):
        t0 = time.monotonic()
        with pytest.raises(cudalink.CudaError, match="could not be landed here"):
            relay_tool.relay(url, unique("rgl"), seconds=20.0, quiet=True)
        assert time.monotonic() - t0 < 10.0


def test_a_relay_makes_its_local_link_again_on_its_own_thread_not_the_ucx_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An upstream restarted with larger frames needs a new local link, and the old one's close waits for its
    consumers (a GPU link's up to 2 s). Done on the UCX thread, as the frame's header arrived, that silence got
    the relay dropped by its server (0.9 s) and reconnected. The relay's own thread now makes the link again;
    a close that takes 1.5 s here costs no reconnect, and the new frames reach the local consumer whole."""
    relay_remakes_its_link("cpu", monkeypatch, caplog)


def relay_remakes_its_link(
    device: str | int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The test above, on the host or (``device=0``, ``test_ucx_gpu.py``) with GPU links at both ends."""
    import logging

    from cudalink.tools import relay as relay_tool

    name, local = unique("rm"), unique("rml")
    closes: list[str] = []
    plain_close = cudalink.Sender.close

    def slow_close(self: cudalink.Sender, *args: object, **kwargs: object) -> None:
        if self.name == local and not closes:  # the first close of the local link: the remake
            closes.append(threading.current_thread().name)
            time.sleep(1.5)
        plain_close(self, *args, **kwargs)  # type: ignore[arg-type]

    def frame_of(shape: tuple[int, ...], seq: int) -> object:
        if device == "cpu":
            return pattern(shape, seq)
        import torch

        return torch.from_numpy(pattern(shape, seq)).to(f"cuda:{device}")

    monkeypatch.setattr(cudalink.Sender, "close", slow_close)
    done = threading.Event()
    monkeypatch.setattr(relay_tool, "stop_requested", done.is_set)  # ends the relay as SIGTERM would
    caplog.set_level(logging.WARNING, logger="cudalink.ucx")
    tx = cudalink.Sender(name, shape=(8, 8, 4), device=device)
    srv, url = server(name)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            relay_tool.relay(url, local, device=device, seconds=25.0, quiet=True)
        except BaseException as exc:
            errors.append(exc)

    relayer = threading.Thread(target=run, name="the-relay")
    relayer.start()
    try:
        shapes: list[tuple[int, ...]] = []
        deadline = time.monotonic() + 20.0
        rx = None
        while not shapes or shapes[-1] != (32, 32, 4) or len(shapes) < 5:
            assert time.monotonic() < deadline and not errors, (shapes, errors, "".join(srv.log))
            if shapes and tx.shape == (8, 8, 4):  # the upstream restarts with larger frames
                tx.close()
                tx = cudalink.Sender(name, shape=(32, 32, 4), device=device)
            seq = tx.seq + 1
            tx.send(frame_of(tx.shape, seq), meta=struct.pack("<Q", seq))
            time.sleep(0.01)
            try:
                rx = rx or cudalink.Receiver(local, timeout=0.05, connect=False)
                with rx.recv(timeout=0.05) as f:
                    got = f.numpy() if f.device == "cpu" else f.to_numpy()
                    assert f.device == tx.device
                    assert np.array_equal(got, pattern(f.shape, struct.unpack("<Q", f.meta)[0]))
                    shapes.append(f.shape)
            except (cudalink.LinkTimeout, cudalink.ProducerGone):
                continue
            except cudalink.LinkError:  # the local link is not there yet
                rx = None
        if rx is not None:
            rx.close()
        assert closes == ["the-relay"], closes
        said = [r.getMessage() for r in caplog.records]
        assert not any("connecting again" in m for m in said), said
    finally:
        done.set()
        tx.close()
        relayer.join(30)
        srv.stop()
    assert not relayer.is_alive() and not errors, errors


def test_remote_consumers_stuck_mid_send_never_take_the_producers_last_slots(tmp_path: Path) -> None:
    """Host frames go out straight from their slot, held while the bytes are on the wire. Two consumers that
    stopped in the middle of a send (a rendezvous waits for them) held two slots: a producer with two had none
    left and dropped frames, which its local consumers lost too. The server now keeps two slots free and sends
    a copy past that."""
    name = unique("sp")
    go = tmp_path / "go"  # the 250 frames start once both readers read: a loaded machine starts them late
    prod = producer(
        name, "--frames", "250", "--fps", "100", "--shape", "512,512,4", "--slots", "2", "--go-file", str(go)
    )
    srv, url = server(name)
    readers = [Proc(["-m", "tests._ucx_procs", "reader", url]) for _ in range(2)]
    try:
        for r in readers:
            r.expect("reading", 20.0)
        go.touch()
        time.sleep(0.3)
        for r in readers:  # stopped one after the other: each mid-send of another frame
            r.p.send_signal(signal.SIGSTOP)
            time.sleep(0.05)
        time.sleep(0.6)  # under the 0.9 s after which the server drops a silent consumer (leases back)
        for r in readers:
            r.p.send_signal(signal.SIGCONT)
        done = prod.expect("done", 30.0)
        assert done.endswith("dropped=0"), done
    finally:
        for r in readers:
            with contextlib.suppress(ProcessLookupError):
                r.p.send_signal(signal.SIGCONT)
            r.stop()
        srv.stop()
        prod.stop()
