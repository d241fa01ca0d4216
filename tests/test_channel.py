"""The portable control channel (issue 9): the loopback TCP channel Windows uses, run here on Linux.

The whole cross-process suite (test_multiprocess, test_async, the chaos tests) also runs over both
channels through the ``control`` fixture; this file covers what only the TCP channel has: the
rendezvous file, the key challenge, per-generation header names, and asyncio without add_reader.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time
from typing import Any

import numpy as np
import pytest

import cudalink
from cudalink import _backends, _platform
from cudalink.transport import wire
from cudalink.transport.channel import LoopbackChannel, find
from cudalink.transport.shm import SharedMemoryTransport, header_segment

from . import _async_procs as ap
from . import _procs
from .conftest import DEFAULT, SIGKILL, PairFactory, Spawned


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDALINK_CONTROL", "tcp")


def _record(name: str) -> wire.Rendezvous:
    with open(LoopbackChannel.record_path(name), "rb") as f:
        return wire.unpack_rendezvous(f.read())


def _admit(port: int, key: bytes, hello: bytes) -> bytes:
    """Speak the loopback admission by hand: read the challenge, answer with a proof made from ``key``."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        challenge = b""
        while len(challenge) < wire.CHALLENGE_SIZE:
            challenge += s.recv(wire.CHALLENGE_SIZE - len(challenge))
        s.sendall(wire.proof(key, challenge) + hello)
        return s.recv(4096)


@pytest.mark.usefixtures("tcp")
def test_rendezvous_file_is_private_and_names_this_generation(name: str) -> None:
    with cudalink.Sender(name, shape=(8,)) as tx:
        path = LoopbackChannel.record_path(name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        rec = _record(name)
        assert (rec.pid, rec.generation) == (os.getpid(), tx.generation)
        header = _platform.segment_name(name, f"-h{tx.generation:016x}")
        assert header_segment(name) == header
        assert stat.S_IMODE(os.stat(f"/dev/shm/{header}").st_mode) == 0o600
        assert not os.path.exists(_platform.socket_path(name))
        with cudalink.Receiver(name, timeout=2) as rx:
            tx.send(np.arange(8, dtype=np.uint8))
            assert np.from_dlpack(rx.recv(1)).tolist() == list(range(8))
    assert not os.path.exists(path)
    assert not os.path.exists(f"/dev/shm/{header}")


@pytest.mark.usefixtures("tcp")
def test_a_wrong_key_is_refused_and_the_right_one_admitted(name: str) -> None:
    with cudalink.Sender(name, shape=(4,)) as tx:
        rec = _record(name)
        hello = wire.pack_hello(wire.Hello(tx.generation, 7, os.getpid()))
        refused = _admit(rec.port, bytes(32), hello)
        with pytest.raises(cudalink.ProtocolError, match=r"rendezvous key") as info:
            wire.unpack_reply(refused, 16)
        assert info.value.reason is cudalink.ProtocolReason.STALE_KEY and info.value.reason.retryable
        welcome = wire.unpack_reply(_admit(rec.port, rec.key, hello), 16)
        assert welcome.generation == tx.generation
        with cudalink.Receiver(name, timeout=2) as rx:  # the producer is unharmed
            tx.send(np.ones(4, np.uint8))
            assert rx.recv(1).seq == 1


@pytest.mark.usefixtures("tcp")
def test_garbage_before_admission_does_not_hurt_the_producer(name: str) -> None:
    with cudalink.Sender(name, shape=(4,)) as tx:
        port = _record(name).port
        for junk in (b"", b"x", os.urandom(wire.PROOF_SIZE), os.urandom(60), os.urandom(5000)):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(junk)
                s.settimeout(0.5)
                try:
                    s.recv(4096)
                except (TimeoutError, ConnectionResetError):
                    pass
        assert tx.stats()["consumers"] == 0
        with cudalink.Receiver(name, timeout=2) as rx:
            tx.send(np.full(4, 3, np.uint8))
            assert np.from_dlpack(rx.recv(1)).tolist() == [3, 3, 3, 3]


def test_consumers_find_either_channel_without_configuration(
    spawned: Spawned, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TCP producer (as on Windows) and a consumer whose own default would be the Unix socket."""
    monkeypatch.setenv("CUDALINK_CONTROL", "tcp")
    go, result = spawned.event(), spawned.queue()
    spawned.ready(_procs.host_producer, name, 200, (16,), "int32", 4, go=go, every=0.0005)
    monkeypatch.setenv("CUDALINK_CONTROL", "unix")
    found = find(name)
    assert found is not None and found.kind == "tcp"
    spawned(_procs.host_consumer, name, 200, result, 0.0, False)
    time.sleep(0.5)
    go.set()
    _pid, got, mismatches, tail, _skipped, ordered = result.get(timeout=60)
    assert got > 0 and mismatches == 0 and ordered, (got, mismatches, tail)


@pytest.mark.usefixtures("tcp")
def test_a_restart_gets_fresh_segment_names_while_an_old_consumer_still_maps_the_old_ones(
    name: str, pair: PairFactory
) -> None:
    """Windows keeps a mapped segment alive after the producer goes, so a restart must not reuse its name."""
    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8")
    tx.send(np.zeros(4, np.uint8))
    held = rx.recv(1)
    old = header_segment(name)
    tx.close()
    tx2 = cudalink.Sender(name, shape=(4,))
    try:
        assert header_segment(name) != old
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(1)
        tx2.send(np.ones(4, np.uint8))
        f = rx.recv(2)
        assert f.seq == 1 and rx.generation == tx2.generation
        assert np.from_dlpack(held).tolist() == [0, 0, 0, 0]  # the old frame stays readable
    finally:
        held.release()
        rx.close()
        tx2.close()


@pytest.mark.usefixtures("tcp")
def test_a_dead_producers_rendezvous_is_not_served_and_is_replaced(
    spawned: Spawned, name: str, pair: PairFactory
) -> None:
    spawned.kill(spawned.ready(_procs.host_producer_forever, name, (4,), "int32", forever=True))
    assert os.path.exists(LoopbackChannel.record_path(name))  # leftovers...
    assert find(name) is None  # ...that no consumer attaches to
    with pytest.raises(cudalink.ProducerGone, match="died"):  # at once, not after its timeout (issue 32)
        cudalink.Receiver(name, timeout=30)
    tx, rx = pair(DEFAULT, shape=(4,), dtype="int32")
    with tx, rx:
        assert rx.generation == tx.generation
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(_platform.segment_name(name))]


def test_second_live_producer_is_refused_across_channels(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDALINK_CONTROL", "unix")
    with cudalink.Sender(name, shape=(8,)):
        monkeypatch.setenv("CUDALINK_CONTROL", "tcp")
        with pytest.raises(cudalink.LinkError, match="already published"):
            cudalink.Sender(name, shape=(8,))


def test_transport_can_pin_its_channel(name: str) -> None:
    t = SharedMemoryTransport(control="tcp")
    assert not t.passes_fds
    with cudalink.Sender(name, shape=(2,), transport=t):
        found = find(name)
        assert found is not None and found.kind == "tcp"
    with pytest.raises(cudalink.LinkError, match="CUDALINK_CONTROL"):
        SharedMemoryTransport(control="pipe")


def test_handle_kind_follows_what_the_channel_can_carry() -> None:
    assert _backends.resolve_handles("auto", passes_fds=False) == "legacy"
    assert _backends.resolve_handles("legacy", passes_fds=False) == "legacy"
    assert _backends.resolve_handles("auto", passes_fds=True) == _platform.default_handles()
    with pytest.raises(cudalink.LinkError, match="handles='legacy'"):
        _backends.resolve_handles("pool", passes_fds=False)
    with pytest.raises(cudalink.LinkError, match="'auto', 'pool' or 'legacy'"):
        _backends.resolve_handles("cuda", passes_fds=True)


@pytest.mark.skipif(not _platform.IS_LINUX, reason="WSL is a Linux kernel")
def test_pools_asked_for_on_wsl_are_refused_naming_legacy_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    """WSL 2's driver refuses IPC pools (README: legacy handles only there), yet handles='pool' went on to it
    (``devices.require_pool_ipc`` looks at sys.platform only), and ``PoolExporter`` reports any failure to make
    the pool as "could not allocate the link's slots ... use fewer slots ... or free GPU memory"."""
    monkeypatch.setattr(_platform, "is_wsl", lambda release=None: True)
    assert _backends.resolve_handles("auto", passes_fds=True) == "legacy"
    with pytest.raises(cudalink.ArgumentError, match=r"^cudalink: handles='pool' .*WSL.*use handles='legacy'"):
        _backends.resolve_handles("pool", passes_fds=True)
    monkeypatch.setattr(_platform, "is_wsl", lambda release=None: False)
    assert _backends.resolve_handles("pool", passes_fds=True) == "pool"


def test_pools_refused_name_both_ways_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 4: where IPC pools cannot be had (WSL, a channel without fds as on Windows), the error names legacy
    handles and the CPU backend."""
    monkeypatch.setattr(_platform, "default_handles", lambda linux=True, wsl=None: "legacy")  # WSL, or not Linux
    for passes_fds in (True, False):
        with pytest.raises(cudalink.ArgumentError, match=r"^cudalink: .*handles='legacy'.*device='cpu'"):
            _backends.resolve_handles("pool", passes_fds=passes_fds)


def test_a_pool_sender_over_tcp_fails_before_touching_the_gpu(name: str) -> None:
    with pytest.raises(cudalink.LinkError, match="handles='legacy'"):
        cudalink.Sender(name, shape=(4,), device=0, handles="pool", transport=SharedMemoryTransport("tcp"))


# -- asyncio where the loop has no add_reader (Windows' default proactor loop) ------------------------------


class ReaderlessLoop(asyncio.SelectorEventLoop):
    """Behaves like ``ProactorEventLoop`` for our purposes: ``add_reader`` is not implemented."""

    def add_reader(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError


def _run(coro: Any) -> Any:
    loop = ReaderlessLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.mark.usefixtures("tcp")
def test_async_without_add_reader_gets_every_frame_across_processes(spawned: Spawned, name: str) -> None:
    start = spawned.event()
    spawned.ready(ap.paced_producer, name, 100, 0.002, start=start)

    async def consume() -> list[int]:
        seqs: list[int] = []
        rx = cudalink.Receiver(name, timeout=5, latest=False)
        start.set()
        async for frame in rx:
            seqs.append(frame.seq)
            frame.release()
        rx.close()
        return seqs

    seqs = _run(consume())
    assert seqs == list(range(1, 101))


@pytest.mark.usefixtures("tcp")
def test_async_without_add_reader_cancels_cleanly_and_sees_producer_death(pair: PairFactory) -> None:
    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8", rx={"timeout": 5})  # recv_async() waits up to 5 s

    async def go() -> None:
        task = asyncio.ensure_future(rx.recv_async())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        tx.send(np.arange(4, dtype=np.uint8))
        frame = await asyncio.wait_for(rx.recv_async(), 2)  # nothing was lost to the cancelled wait
        assert np.from_dlpack(frame).tolist() == [0, 1, 2, 3]
        frame.release()
        waiter = asyncio.ensure_future(rx.recv_async())
        await asyncio.sleep(0.05)
        tx.close()
        with pytest.raises(cudalink.ProducerGone):
            await asyncio.wait_for(waiter, 2)

    _run(go())


class OneLoopPerSocket(ReaderlessLoop):
    """Windows' rule besides: a socket read through one proactor loop is bound to its completion port for
    good, and another loop's read fails with WinError 87 (EINVAL)."""

    owner: dict[int, int] = {}

    async def sock_recv(self, sock: Any, n: int) -> bytes:
        if self.owner.setdefault(sock.fileno(), id(self)) != id(self):
            raise OSError(22, "[WinError 87] The parameter is incorrect")
        return await super().sock_recv(sock, n)


@pytest.mark.usefixtures("tcp")
def test_a_receiver_awaited_on_a_second_proactor_loop_keeps_its_live_producer(pair: PairFactory) -> None:
    """Two asyncio.run() calls with one Receiver: the second loop cannot read the socket the first bound, and
    that is not the producer's end (it said ProducerGone)."""
    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8", rx={"timeout": 5})
    for value in (1, 2):
        threading.Timer(0.2, tx.send, (np.full(4, value, np.uint8),)).start()
        loop = OneLoopPerSocket()
        try:
            frame = loop.run_until_complete(rx.recv_async(timeout=5))
        finally:
            loop.close()
        assert np.from_dlpack(frame).tolist() == [value] * 4
        frame.release()
    tx.close()
    loop = OneLoopPerSocket()
    try:
        with pytest.raises(cudalink.ProducerGone):
            loop.run_until_complete(rx.recv_async(timeout=5))
    finally:
        loop.close()


@pytest.mark.usefixtures("tcp")
def test_async_without_add_reader_sees_a_killed_producer_at_once(spawned: Spawned, name: str) -> None:
    prod = spawned.ready(ap.idle_producer, name, stop=spawned.event(), forever=True)  # killed below
    rx = cudalink.Receiver(name, timeout=30)

    async def go() -> float:
        first = await rx.recv_async()
        first.release()
        waiter = asyncio.ensure_future(rx.recv_async())
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        os.kill(prod.pid, SIGKILL)
        with pytest.raises(cudalink.ProducerGone):
            await asyncio.wait_for(waiter, 10)
        return time.monotonic() - t0

    try:
        assert _run(go()) < 2.0  # EOF, not the 30 s receive timeout
    finally:
        rx.close()


@pytest.mark.usefixtures("tcp")
def test_a_stale_key_makes_the_consumer_retry_not_fail(name: str) -> None:
    """A consumer that read the rendezvous file just before a restart holds the old key: it must re-read."""
    with cudalink.Sender(name, shape=(4,)) as tx:
        path = LoopbackChannel.record_path(name)
        good = _record(name)
        _platform.write_private(
            path, wire.pack_rendezvous(wire.Rendezvous(good.port, good.pid, good.generation, bytes(32)))
        )
        timer = threading.Timer(0.3, _platform.write_private, (path, wire.pack_rendezvous(good)))
        timer.start()
        t0 = time.monotonic()
        with cudalink.Receiver(name, timeout=5) as rx:
            assert time.monotonic() - t0 >= 0.25  # it kept retrying with the wrong key until the file was right
            tx.send(np.arange(4, dtype=np.uint8))
            assert rx.recv(1).seq == 1
        timer.join()


def test_a_producer_out_of_fds_rests_its_listener_instead_of_spinning(caplog: pytest.LogCaptureFixture) -> None:
    """accept() failing with EMFILE leaves the connection waiting, so the listener stays readable: the control
    thread must stop listening for a moment (and say why once), not call accept() in a loop."""
    import errno

    from cudalink.transport.control import ControlLoop, SameProcessGate

    calls = []

    class Full(socket.socket):
        def accept(self) -> tuple[socket.socket, Any]:  # type: ignore[override]
            calls.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")

    listener = Full(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    client = socket.create_connection(listener.getsockname())  # waits in the backlog: readable for good
    loop = ControlLoop(listener, SameProcessGate())
    try:
        with caplog.at_level("WARNING", logger="cudalink"):
            loop.start(None)  # type: ignore[arg-type]
            time.sleep(0.5)
        assert 2 <= len(calls) <= 12, len(calls)  # about one try per 0.1 s, not thousands
        assert sum("out of file descriptors" in r.getMessage() for r in caplog.records) == 1
    finally:
        loop.close()
        client.close()
        listener.close()
