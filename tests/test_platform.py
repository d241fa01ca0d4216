"""``cudalink._platform`` and the bounded cuMemFree: the Windows branches run here against stubbed OS calls.

What cannot run here (no Windows machine): the real kernel32/msvcrt calls, Windows' SharedMemory
semantics and Windows' CUDA driver. Each stub records the calls so a test fails if a branch calls the
OS the wrong way.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import stat
import sys
import threading
import time
import types
from typing import Any

import pytest

import cudalink
from cudalink import _platform
from cudalink.cuda import driver, memory

from .conftest import Spawned

# -- names and defaults ---------------------------------------------------------------------------------


def test_windows_user_tag_is_a_stable_name_safe_digest() -> None:
    tag = _platform.user_tag("Alice")
    assert tag == _platform.user_tag("alice")  # Windows account names are case-insensitive
    assert tag != _platform.user_tag("bob")
    assert tag.isalnum() and len(tag) == 13
    assert _platform.user_tag() == str(os.getuid())


def test_wsl_is_detected_from_the_kernel_release() -> None:
    assert _platform.is_wsl("5.15.153.1-microsoft-standard-WSL2") is _platform.IS_LINUX
    assert not _platform.is_wsl("6.8.0-45-generic")


def test_auto_handles_pick_pools_only_on_native_linux() -> None:
    assert _platform.default_handles(linux=True, wsl=False) == "pool"
    assert _platform.default_handles(linux=True, wsl=True) == "legacy"
    assert _platform.default_handles(linux=False, wsl=False) == "legacy"  # Windows


def test_a_segments_inode_is_told_only_where_segments_are_files(monkeypatch: pytest.MonkeyPatch) -> None:
    if _platform.IS_LINUX:
        seg = _platform.segment_name(f"inode-{os.getpid()}")
        fd = os.open(f"/dev/shm/{seg}", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            assert _platform.shm_inode(seg) == os.fstat(fd).st_ino == _platform.shm_inode("/" + seg)
        finally:
            os.close(fd)
            os.unlink(f"/dev/shm/{seg}")
        assert _platform.shm_inode(seg) == 0  # gone
    monkeypatch.setattr(_platform, "IS_LINUX", False)  # macOS, Windows: no files to look at
    assert _platform.shm_inode("anything") is None


def test_control_channel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _platform.default_control("tcp") == "tcp"
    assert _platform.default_control("unix") == "unix"
    assert _platform.default_control("auto") == ("unix" if _platform.HAS_FD_PASSING else "tcp")
    monkeypatch.setattr(_platform, "HAS_FD_PASSING", False)  # as on Windows
    assert _platform.default_control("") == "tcp"
    with pytest.raises(cudalink.LinkError, match="CUDALINK_CONTROL must be"):
        _platform.default_control("pipe")
    monkeypatch.delattr(socket, "AF_UNIX")
    with pytest.raises(cudalink.LinkError, match="CUDALINK_CONTROL=tcp"):
        _platform.default_control("unix")


# -- process liveness -------------------------------------------------------------------------------------


class FakeKernel32:
    """OpenProcess / GetExitCodeProcess / CloseHandle with a scripted outcome."""

    def __init__(self, handle: int, exit_code: int = 259, query_ok: bool = True) -> None:
        self.handle, self.exit_code, self.query_ok = handle, exit_code, query_ok
        self.calls: list[tuple[Any, ...]] = []

    def OpenProcess(self, access: int, inherit: bool, pid: int) -> int:
        self.calls.append(("OpenProcess", access, inherit, pid))
        return self.handle

    def GetExitCodeProcess(self, handle: int, code: Any) -> int:
        self.calls.append(("GetExitCodeProcess", handle))
        ctypes.cast(code, ctypes.POINTER(ctypes.c_ulong))[0] = self.exit_code
        return 1 if self.query_ok else 0

    def CloseHandle(self, handle: int) -> int:
        self.calls.append(("CloseHandle", handle))
        return 1


@pytest.mark.parametrize(
    ("handle", "exit_code", "last_error", "alive"),
    [
        (42, 259, 0, True),  # STILL_ACTIVE
        (42, 0, 0, False),  # exited with 0
        (42, 1, 0, False),  # exited with 1
        (0, 0, 5, True),  # ERROR_ACCESS_DENIED: exists, another user's
        (0, 0, 87, False),  # ERROR_INVALID_PARAMETER: no such pid
    ],
)
def test_windows_pid_alive_never_signals_and_closes_its_handle(
    handle: int, exit_code: int, last_error: int, alive: bool
) -> None:
    k = FakeKernel32(handle, exit_code)
    assert _platform._pid_alive_windows(1234, k, lambda: last_error) is alive
    assert k.calls[0] == ("OpenProcess", 0x1000, False, 1234)  # PROCESS_QUERY_LIMITED_INFORMATION only
    if handle:
        assert k.calls[-1] == ("CloseHandle", handle)


def test_posix_pid_alive() -> None:
    assert _platform.pid_alive(os.getpid())
    assert not _platform.pid_alive(0)
    assert not _platform.pid_alive(2**22 + 12345)


# -- the producer lock ---------------------------------------------------------------------------------------


def test_process_lock_excludes_a_second_holder_even_in_one_process(tmp_path: Any) -> None:
    path = str(tmp_path / "x.lock")
    a, b = _platform.ProcessLock(path), _platform.ProcessLock(path)
    assert a.acquire() and a.held
    assert not b.acquire() and not b.held
    a.release()
    assert b.acquire()
    b.release()
    assert os.path.exists(path)  # release() keeps the file; only remove_and_release() removes it


def test_a_lock_removed_under_a_process_that_had_opened_it_is_not_counted_as_held(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race that makes removing lock files unsafe: B opens the file, A (holding it) removes it and lets
    go, B's flock then succeeds on an inode no path names, and C makes a new file and locks that too. B must
    see that the path names another file now, and try again there."""
    path = str(tmp_path / "r.lock")
    a, b, c = _platform.ProcessLock(path), _platform.ProcessLock(path), _platform.ProcessLock(path)
    assert a.acquire()
    real_open = os.open
    raced = []

    def open_then_race(p: str, flags: int, mode: int = 0o777) -> int:
        fd = real_open(p, flags, mode)
        if not raced:
            raced.append(True)
            a.remove_and_release()  # between B's open and B's flock
        return fd

    monkeypatch.setattr(_platform.os, "open", open_then_race)
    assert not b.acquire()  # flock got the removed inode: not the lock
    monkeypatch.setattr(_platform.os, "open", real_open)
    assert b.acquire(wait=0.1) and b.held  # the file the path names now
    assert not c.acquire()  # one holder, as ever
    b.remove_and_release()
    assert not os.path.exists(path)
    assert c.acquire()
    c.release()


def _hold_lock(path: str, ready: Any) -> None:
    lock = _platform.ProcessLock(path)
    assert lock.acquire()
    ready.set()
    time.sleep(60)


def test_process_lock_is_dropped_when_its_holder_is_killed(spawned: Spawned, tmp_path: Any) -> None:
    path = str(tmp_path / "y.lock")
    holder = spawned.ready(_hold_lock, path, forever=True)
    assert not _platform.ProcessLock(path).acquire()
    spawned.kill(holder)
    mine = _platform.ProcessLock(path)
    assert mine.acquire()
    mine.release()


def test_windows_process_lock_uses_msvcrt_byte_zero(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    taken: set[str] = set()

    def locking(fd: int, mode: int, nbytes: int) -> None:
        calls.append((os.lseek(fd, 0, os.SEEK_CUR), mode, nbytes))
        key = os.readlink(f"/proc/self/fd/{fd}")
        if mode == fake.LK_NBLCK:
            if key in taken:
                raise PermissionError(13, "locked")  # what msvcrt raises for a held range
            taken.add(key)
        elif mode == fake.LK_UNLCK:
            taken.discard(key)

    fake = types.SimpleNamespace(LK_NBLCK=2, LK_UNLCK=0, locking=locking)
    monkeypatch.setitem(sys.modules, "msvcrt", fake)
    path = str(tmp_path / "w.lock")
    a, b = _platform.ProcessLock(path, windows=True), _platform.ProcessLock(path, windows=True)
    assert a.acquire()
    assert not b.acquire()
    a.release()
    assert b.acquire()
    b.release()
    assert calls == [(0, 2, 1), (0, 2, 1), (0, 0, 1), (0, 2, 1), (0, 0, 1)]


# -- files and sockets --------------------------------------------------------------------------------------


def test_write_private_is_0600_and_atomic(tmp_path: Any) -> None:
    path = str(tmp_path / "r.tcp")
    _platform.write_private(path, b"one")
    _platform.write_private(path, b"two")
    with open(path, "rb") as f:
        assert f.read() == b"two"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["r.tcp"]


def test_write_private_retries_while_a_windows_reader_holds_the_file(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.replace
    fails = [2]

    def replace(src: str, dst: str) -> None:
        if fails[0]:
            fails[0] -= 1
            raise PermissionError(13, "sharing violation")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(_platform, "IS_WINDOWS", True)
    path = str(tmp_path / "r.tcp")
    _platform.write_private(path, b"x")
    with open(path, "rb") as f:
        assert f.read() == b"x"
    monkeypatch.setattr(_platform, "IS_WINDOWS", False)  # POSIX never retries: an error is an error
    fails[0] = 1
    with pytest.raises(PermissionError):
        _platform.write_private(path, b"y")
    assert os.listdir(tmp_path) == ["r.tcp"]


class RecordingSocket:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def setsockopt(self, *args: Any) -> None:
        self.calls.append(("setsockopt", *args))

    def bind(self, addr: Any) -> None:
        self.calls.append(("bind", addr))

    def listen(self, n: int) -> None:
        self.calls.append(("listen", n))

    def close(self) -> None:
        self.calls.append(("close",))


def test_loopback_listener_is_exclusive_on_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "SO_EXCLUSIVEADDRUSE", -5, raising=False)
    s = RecordingSocket()
    assert _platform.loopback_listener(s) is s  # type: ignore[arg-type]
    assert s.calls == [("setsockopt", socket.SOL_SOCKET, -5, 1), ("bind", ("127.0.0.1", 0)), ("listen", 64)]


def test_loopback_listener_binds_loopback_only() -> None:
    s = _platform.loopback_listener()
    try:
        host, port = s.getsockname()
        assert host == "127.0.0.1" and port > 0
    finally:
        s.close()


# -- bounded cuMemFree -------------------------------------------------------------------------------------


class FakeDriver:
    """cuCtxGetCurrent / cuCtxSetCurrent / cuMemFree, with a cuMemFree that can hang."""

    def __init__(self, hang: threading.Event | None = None) -> None:
        self.hang = hang
        self.freed: list[int] = []
        self.ctx_in_worker: list[Any] = []

    def cuCtxGetCurrent(self) -> tuple[int, str]:
        return 0, "ctx0"

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[int]:
        self.ctx_in_worker.append(ctx)
        return (0,)

    def cuMemFree(self, ptr: int) -> tuple[int]:
        if self.hang is not None:
            self.hang.wait(30)
        self.freed.append(ptr)
        return (0,)


def test_free_bounded_frees_on_the_callers_context(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = FakeDriver()
    monkeypatch.setattr(driver, "bindings", lambda: drv)
    assert memory.free_bounded([1, 2, 3], timeout=5)
    assert drv.freed == [1, 2, 3] and drv.ctx_in_worker == ["ctx0"]


def test_free_bounded_gives_up_on_a_hung_cumemfree(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    drv = FakeDriver(hang=release)
    monkeypatch.setattr(driver, "bindings", lambda: drv)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="cuMemFree did not return"):
        assert not memory.free_bounded([7], timeout=0.2)
    assert time.monotonic() - t0 < 2
    release.set()


def test_kernel32_prototypes_use_pointer_sized_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    from ctypes import wintypes

    fns = {n: types.SimpleNamespace() for n in ("OpenProcess", "GetExitCodeProcess", "CloseHandle")}
    opened: list[tuple[str, bool]] = []

    def windll(name: str, use_last_error: bool = False) -> Any:
        opened.append((name, use_last_error))
        return types.SimpleNamespace(**fns)

    monkeypatch.setattr(ctypes, "WinDLL", windll, raising=False)
    _platform._kernel32.cache_clear()  # made once per process (it is asked at each GPU frame's wait there)
    try:
        _platform._kernel32()
        _platform._kernel32()
    finally:
        _platform._kernel32.cache_clear()
    assert opened == [("kernel32", True)]  # so ctypes.get_last_error() sees OpenProcess's error
    assert fns["OpenProcess"].restype is wintypes.HANDLE
    assert fns["CloseHandle"].argtypes == (wintypes.HANDLE,)
    assert fns["GetExitCodeProcess"].argtypes[0] is wintypes.HANDLE


def test_a_hang_up_is_seen_without_reading_even_behind_queued_wake_ups() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    closed = _platform.hangup_poller(a)
    assert not closed()
    b.send(b"\x01\x01")  # wake-ups the consumer has not drained yet
    assert not closed()
    b.close()  # the producer's process is gone
    assert closed()
    assert a.recv(8) == b"\x01\x01"  # nothing was consumed by the check
    a.close()


def test_without_pollrdhup_a_hang_up_behind_queued_bytes_is_seen_through_the_producers_pid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows and macOS have no POLLRDHUP: a peek sees the queued wake-up, not the hang-up behind it, so a
    killed producer would pass for alive (and its dead IPC event be waited on). Its pid says it is gone."""
    import subprocess

    monkeypatch.delattr(select, "POLLRDHUP", raising=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid, alive in ((os.getpid(), True), (dead.pid, False)):
        a, b = socket.socketpair()
        a.setblocking(False)
        closed = _platform.hangup_poller(a, pid)
        b.send(b"\x01")  # the wake-up a Receiver leaves queued on purpose
        b.close()  # the producer's end goes
        assert closed() is (not alive)
        assert a.recv(8) == b"\x01"  # nothing consumed
        assert closed()  # once read, the peek sees the hang-up itself
        a.close()


def test_a_clean_close_is_not_a_hang_up_until_the_producer_closes_its_end() -> None:
    from cudalink.transport.control import ClientSocket

    a, b = socket.socketpair()
    a.setblocking(False)
    c = ClientSocket(a)
    b.send(b"\x00")  # the shutdown byte: the producer is closing, its events still live
    assert not c.drain()
    assert not c.hung_up()
    b.close()
    assert c.hung_up()
    a.close()


def test_a_consumer_waits_on_a_frames_event_only_while_its_producer_holds_its_end() -> None:
    """Live: wait on the event. Hung up after a clean close (shutdown flag; it settled every frame first):
    nothing to wait for. Hung up without one (killed): ProducerGone, never a wait on a freed IPC event."""
    import types

    import cudalink
    from cudalink import _backends
    from cudalink.transport import wire

    header = bytearray(wire.OFF_FLAGS + 8)

    class Client:
        hup = False

        def hung_up(self) -> bool:
            return self.hup

    view: Any = types.SimpleNamespace(client=Client())
    view.client.header = memoryview(header)
    assert _backends.CudaView.producer_live(view) is True
    view.client.hup = True
    with pytest.raises(cudalink.ProducerGone, match="died before it was read"):
        _backends.CudaView.producer_live(view)
    wire.write_u32(header, wire.OFF_FLAGS, wire.FLAG_SHUTDOWN)
    assert _backends.CudaView.producer_live(view) is False


def test_macos_names_fit_its_shm_and_socket_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS caps POSIX shm names at 31 characters (the '/' included) and socket paths at 104 bytes: the
    longest link name with the longest suffix must fit both, and two names must never share a segment."""
    monkeypatch.setattr(_platform, "IS_MACOS", True)
    longest = "n" * 48
    _platform.check_name(longest)
    for suffix in ("", f"-{2**64 - 1:016x}", f"-h{2**64 - 1:016x}"):
        assert len("/" + _platform.segment_name(longest, suffix)) <= _platform._MACOS_SHM_NAME_MAX
    names = {_platform.segment_name(f"cam{i}") for i in range(2000)}
    assert len(names) == 2000 and _platform.segment_name("cam0") == _platform.segment_name("cam0")
    assert len(os.path.join("/tmp", f"cudalink-{_platform.user_tag()}", f"{longest}.sock").encode()) < 104


def test_on_macos_the_peer_uid_comes_from_local_peercred(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython has no getpeereid: without LOCAL_PEERCRED every peer passed for this user on macOS."""
    import struct

    class MacSocket:
        def __init__(self, raw: bytes) -> None:
            self.raw = raw
            self.asked: list[tuple[int, int, int]] = []

        def getsockopt(self, level: int, opt: int, size: int) -> bytes:
            self.asked.append((level, opt, size))
            return self.raw

    monkeypatch.setattr(_platform, "IS_LINUX", False)
    monkeypatch.setattr(_platform, "IS_MACOS", True)
    other = MacSocket(struct.pack("=IIh", 0, 4242, 1) + bytes(66))
    assert _platform.peer_credentials(other) == (0, 4242)  # type: ignore[arg-type]
    assert other.asked == [(0, 1, 76)]  # SOL_LOCAL, LOCAL_PEERCRED, sizeof(struct xucred)


# -- ports ----------------------------------------------------------------------------------------------


def test_the_ephemeral_range_is_read_where_linux_keeps_it_and_defaults_elsewhere(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "range"
    f.write_text("20000\t30000\n")
    monkeypatch.setattr(_platform, "IS_LINUX", True)
    assert _platform.ephemeral_ports(str(f)) == (20000, 30000)
    f.write_text("garbage\n")
    assert _platform.ephemeral_ports(str(f)) == _platform.DEFAULT_EPHEMERAL
    assert _platform.ephemeral_ports(str(tmp_path / "missing")) == _platform.DEFAULT_EPHEMERAL
    monkeypatch.setattr(_platform, "IS_LINUX", False)
    f.write_text("20000 30000\n")
    assert _platform.ephemeral_ports(str(f)) == _platform.DEFAULT_EPHEMERAL


@pytest.mark.parametrize("ephemeral", [None, (32768, 60999), (2000, 64600), (1024, 64000), (49152, 65535)])
def test_a_port_picked_for_a_server_lies_outside_the_ephemeral_range_and_is_free_on_every_address(
    ephemeral: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port from the ephemeral range may be taken before the server binds it, by UCX's own port-0 sockets
    in that very server (a CI run waited 15 s on such a port). None: this host's own range. (2000, 64600)
    leaves two short stretches, which together are room enough."""
    from cudalink.transport import ucx_engine

    if ephemeral is not None:
        monkeypatch.setattr(_platform, "ephemeral_ports", lambda: ephemeral)
    low, high = _platform.ephemeral_ports()
    if not ucx_engine.outside_ephemeral():
        pytest.skip(f"this host hands out every unprivileged port itself ({low}-{high})")
    for _ in range(50):
        port = ucx_engine.free_port()
        assert port >= 1024 and not low <= port <= high, port
        with socket.socket() as s:
            s.bind(("", port))  # free on every interface


def test_with_no_room_outside_the_ephemeral_range_a_port_is_still_picked_and_the_risk_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from cudalink.transport import ucx_engine

    monkeypatch.setattr(_platform, "ephemeral_ports", lambda: (1024, 65535))
    assert not ucx_engine.outside_ephemeral()
    port = ucx_engine.free_port()
    assert 1024 <= port <= 65535
    assert "no free port outside the ephemeral range" in caplog.text


@pytest.mark.skipif(sys.platform == "win32", reason="the proactor loop watches no fds (the control socket reads)")
def test_an_async_wait_on_an_fd_wakes_once_times_out_and_leaves_no_reader_behind() -> None:
    """The wait every asyncio consumer makes per frame (a ucx server's included): readable wakes it, a timeout
    ends it, a cancel ends it, and each leaves the loop watching nothing; the reader goes as it fires (it
    fired again each loop turn while the waiter had not run yet, the wake-up byte still queued)."""
    import asyncio

    a, b = socket.socketpair()
    fired: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        selector = loop._selector  # type: ignore[attr-defined]
        real_add = loop.add_reader

        def counting_add(fd: int, cb: Any, *args: Any) -> None:
            def counted(*inner: Any) -> None:
                fired.append(fd)
                cb(*inner)

            real_add(fd, counted, *args)

        loop.add_reader = counting_add  # type: ignore[method-assign]
        t0 = time.monotonic()
        await _platform.wait_readable_async(a.fileno(), 0.05)  # nothing to read: the timeout ends it
        assert 0.04 <= time.monotonic() - t0 < 2.0 and not fired
        assert a.fileno() not in selector.get_map()
        b.send(b"\x01")
        waiter = asyncio.ensure_future(_platform.wait_readable_async(a.fileno(), None))
        await asyncio.sleep(0.05)  # loop turns while the byte stays unread
        assert waiter.done() and fired == [a.fileno()], fired
        assert a.fileno() not in selector.get_map() and a.recv(1) == b"\x01"
        waiter = asyncio.ensure_future(_platform.wait_readable_async(a.fileno(), None))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert a.fileno() not in selector.get_map() and not loop._scheduled  # type: ignore[attr-defined]

    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not hasattr(os, "sched_yield"), reason="no sched_yield on this OS")
def test_a_producer_hands_its_core_over_keeping_the_gil_where_the_core_is_compiled() -> None:
    """``yield_core`` (a send whose woken consumer has not run yet) keeps the GIL where the compiled ring is
    built: ``os.sched_yield`` lets it go, and a busy thread of the producer's process that took it would hold
    ``send()`` up to the switch interval. With a long switch interval, another thread gets the GIL only when
    this one lets it go: its count does not move across compiled yields, and does across ``os.sched_yield``."""
    from cudalink import _native

    count = [0]
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # lets the GIL go each turn: the test thread gets it back

    _platform.yield_core()  # its first call looks the compiled one up (an import): not inside the count
    interval = sys.getswitchinterval()
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        while count[0] < 10:
            time.sleep(0.001)
        sys.setswitchinterval(100.0)
        before = count[0]
        for _ in range(2000):
            _platform.yield_core()
        held = count[0] - before
        before = count[0]
        end = time.monotonic() + 5.0
        while count[0] == before and time.monotonic() < end:  # it wins the GIL in some of these, not each
            os.sched_yield()
        let_go = count[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        t.join(5)
    assert let_go > 0, "os.sched_yield let the GIL go: the other thread ran"  # the test can tell
    if _native.ring is not None:  # (the pure-Python core yields as os.sched_yield does)
        assert held == 0, held
