"""The control channel over stream sockets: a producer-side thread and consumer-side helpers.

The producer thread accepts consumers, admits each through its channel's :class:`Gate`, reads each
HELLO, answers (passing fds with SCM_RIGHTS where the socket can), notices EOF at once (a crashed
consumer's leases are reclaimed right away), and turns consumer hints into a callback. Wake-ups go
out from the publishing thread with non-blocking sends. Nothing here is OS-specific: the same code
runs over Unix sockets, loopback TCP and in-process socket pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

from .. import _platform
from ..errors import LinkError
from . import wire
from .base import UNVERIFIED_UID, Client, Peer, ServerHandler
from .wire import HELLO

HANDSHAKE_TIMEOUT = 2.0
#: a wait in a worker thread (a second proactor loop, see ClientSocket._recv_async) looks again this often
_THREAD_STEP_S = 0.25
#: accept() failed for want of fds: how long the listener rests before the next try
_ACCEPT_PAUSE_S = 0.1
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_log = logging.getLogger("cudalink")
#: a wait longer than this is a wait with no limit (``poll`` takes an int of milliseconds; ``inf`` is no int)
_LONGEST_WAIT_S = 2e6
#: a send to a peer that died is an EPIPE we handle, never a SIGPIPE: a process whose SIGPIPE is at its default
#: (a CLI that sets SIG_DFL, a host that embeds Python) was killed by it when the process at the other end died
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # Linux; Windows and macOS have none
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0) | _NOSIGNAL  # Windows has none; our sockets are non-blocking anyway


class Gate:
    """How a channel admits a connection: what the producer says first, and who the peer proves to be."""

    #: bytes the consumer sends before its HELLO
    prefix = 0

    def greet(self) -> bytes:
        """Bytes sent to a new connection at accept (a challenge), or nothing."""
        return b""

    def peer(self, sock: socket.socket, greeting: bytes, prefix: bytes) -> Peer:
        raise NotImplementedError


class CredentialGate(Gate):
    """Unix sockets: the kernel says who connected (SO_PEERCRED / getpeereid)."""

    def peer(self, sock: socket.socket, greeting: bytes, prefix: bytes) -> Peer:
        pid, uid = _platform.peer_credentials(sock)
        return Peer(pid, uid)


class SameProcessGate(Gate):
    """In-process socket pairs: the peer is this process."""

    def peer(self, sock: socket.socket, greeting: bytes, prefix: bytes) -> Peer:
        return Peer(os.getpid(), _platform.uid())


class KeyGate(Gate):
    """Loopback TCP: anyone may connect, so a consumer proves it could read the private rendezvous file."""

    prefix = wire.PROOF_SIZE

    def __init__(self, key: bytes) -> None:
        self._key = key

    def greet(self) -> bytes:
        return secrets.token_bytes(wire.CHALLENGE_SIZE)

    def peer(self, sock: socket.socket, greeting: bytes, prefix: bytes) -> Peer:
        ok = wire.check_proof(self._key, greeting, prefix)
        return Peer(0, _platform.uid() if ok else UNVERIFIED_UID)


class ControlLoop:
    """One daemon thread per producer: accept, handshake, watch for EOF and hints."""

    def __init__(self, listener: socket.socket | None, gate: Gate) -> None:
        self._listener = listener
        self._gate = gate
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._handler: ServerHandler | None = None
        self._pending: dict[int, tuple[socket.socket, bytearray, float, bytes]] = {}
        self._joined: dict[int, socket.socket] = {}
        self._joined_list: tuple[socket.socket, ...] = ()
        self._incoming: list[socket.socket] = []
        self._lock = threading.Lock()
        self._next = 1
        self._closed = False
        self._paused_until = 0.0  # accepting paused (out of fds) until then
        self._warned_fds = False
        self._thread = threading.Thread(target=self._run, name="cudalink-control", daemon=True)

    def start(self, handler: ServerHandler) -> None:
        self._handler = handler
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self._listener is not None:
            self._listener.setblocking(False)
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._thread.start()

    def add(self, sock: socket.socket) -> None:
        """Hand an already-connected socket to the loop (the in-process transport uses this)."""
        with self._lock:
            self._incoming.append(sock)
        self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def wake(self, byte: bytes, conns: list[int] | None = None) -> None:
        joined = self._joined
        for sock in self._joined_list if conns is None else map(joined.get, conns):
            if sock is None:
                continue
            try:
                sock.send(byte, _DONTWAIT)
            except OSError:
                pass  # unread wake-ups fill its buffer (EAGAIN: it will look anyway), or gone (EOF reclaims)

    def wakers(self, conns: list[int], byte: bytes = b"\x01") -> list[Callable[[], object]] | None:
        """``Server.wakers``: each a ``socket.send`` bound in C. A socket closed since raises ``OSError``
        (its fd is -1 then: never another file's number)."""
        joined = self._joined
        socks = [joined.get(conn) for conn in conns]
        if None in socks:  # joining (its handler ran, its socket is not registered yet) or gone
            return None
        return [functools.partial(sock.send, byte, _DONTWAIT) for sock in socks if sock is not None]

    def disconnect(self, conn: int) -> None:
        with self._lock:
            sock = self._joined.get(conn)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def connection_count(self) -> int:
        return len(self._joined_list)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._poke()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        for sock in list(self._joined.values()) + [s for s, *_ in self._pending.values()] + self._incoming:
            with contextlib.suppress(OSError):
                sock.close()
        self._joined.clear()
        self._joined_list = ()
        with contextlib.suppress(Exception):
            self._sel.close()
        for s in (self._wake_r, self._wake_w):
            s.close()

    def forget_after_fork(self) -> None:
        """In a forked child, where this loop's thread does not exist: close our copies of its sockets."""
        self._closed = True
        for sock in [*self._joined.values(), *(s for s, *_ in self._pending.values()), *self._incoming]:
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(Exception):
            self._sel.close()
        for s in (self._wake_r, self._wake_w):
            s.close()

    # -- the thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            timeout = 0.5 if self._pending else None
            if self._paused_until:
                left = self._paused_until - time.monotonic()
                if left <= 0:
                    self._resume_accepting()
                else:
                    timeout = left if timeout is None else min(timeout, left)
            try:
                events = self._sel.select(timeout)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if self._closed:
                    break
                tag = key.data
                if tag == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    self._take_incoming()
                elif tag == "listen":
                    self._accept()
                elif isinstance(tag, tuple) and tag[0] == "pending":
                    self._read_hello(tag[1])
                elif isinstance(tag, tuple) and tag[0] == "joined":
                    self._read_joined(tag[1], key.fileobj)  # type: ignore[arg-type]
            self._expire_pending()
        self._drop_all()

    def _take_incoming(self) -> None:
        with self._lock:
            socks, self._incoming = self._incoming, []
        for sock in socks:
            self._register_new(sock)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._pause_accepting(exc)
                return
            self._register_new(sock)

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of fds: the waiting connection stays readable, so accepting again at once would spin this thread.
        Stop listening for a moment (consumers already joined are served as usual)."""
        assert self._listener is not None
        if not self._warned_fds:
            self._warned_fds = True
            _log.warning(
                "cudalink: the producer is out of file descriptors (%s); new consumers wait until some close. "
                "Raise the limit (ulimit -n) or close unused links",
                exc,
            )
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._listener)
        self._paused_until = time.monotonic() + _ACCEPT_PAUSE_S

    def _resume_accepting(self) -> None:
        self._paused_until = 0.0
        if self._listener is not None and not self._closed:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.register(self._listener, selectors.EVENT_READ, "listen")

    def _register_new(self, sock: socket.socket) -> None:
        _platform.no_delay(sock)
        greeting = self._gate.greet()
        try:
            if greeting:  # a few bytes into a fresh socket's empty buffer: never blocks for long
                sock.settimeout(HANDSHAKE_TIMEOUT)
                sock.sendall(greeting, _NOSIGNAL)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        conn = self._next
        self._next += 1
        self._pending[conn] = (sock, bytearray(), time.monotonic() + HANDSHAKE_TIMEOUT, greeting)
        self._sel.register(sock, selectors.EVENT_READ, ("pending", conn))

    def _read_hello(self, conn: int) -> None:
        sock, buf, _deadline, greeting = self._pending[conn]
        want = self._gate.prefix + HELLO.size
        try:
            chunk = sock.recv(want - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._forget_pending(conn, close=True)
            return
        buf += chunk
        if len(buf) < want:
            return
        self._forget_pending(conn, close=False)
        assert self._handler is not None
        try:
            peer = self._gate.peer(sock, greeting, bytes(buf[: self._gate.prefix]))
        except OSError:
            with contextlib.suppress(OSError):
                sock.close()
            return
        try:
            reply = self._handler.on_hello(conn, bytes(buf[self._gate.prefix :]), peer)
        except Exception as exc:  # a handler bug must not kill the loop
            reply_data, fds, accepted = (
                wire.pack_reject(wire.REJECT_BAD_HELLO, f"producer error: {exc}"),
                tuple[int, ...](),
                False,
            )
        else:
            reply_data, fds, accepted = reply.data, reply.fds, reply.accepted
        if accepted:
            # Register for wake-ups *before* the consumer learns it joined: a frame published in between
            # must still wake it.
            with self._lock:
                self._joined[conn] = sock
                self._joined_list = tuple(self._joined.values())
        try:
            sock.setblocking(True)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if fds:
                socket.send_fds(sock, [reply_data], list(fds), _NOSIGNAL)
            else:
                sock.sendall(reply_data, _NOSIGNAL)
            sock.setblocking(False)
        except OSError:
            sent = False
        else:
            sent = True
        if not (accepted and sent):
            if accepted:
                with self._lock:
                    self._joined.pop(conn, None)
                    self._joined_list = tuple(self._joined.values())
                self._handler.on_leave(conn)
            with contextlib.suppress(OSError):
                sock.close()
            return
        self._sel.register(sock, selectors.EVENT_READ, ("joined", conn))

    def _read_joined(self, conn: int, sock: socket.socket) -> None:
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            assert self._handler is not None
            self._handler.on_hint()
            return
        self._leave(conn, sock)

    def _leave(self, conn: int, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        with self._lock:
            self._joined.pop(conn, None)
            self._joined_list = tuple(self._joined.values())
        with contextlib.suppress(OSError):
            sock.close()
        assert self._handler is not None
        self._handler.on_leave(conn)

    def _forget_pending(self, conn: int, close: bool) -> None:
        sock = self._pending.pop(conn)[0]
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        if close:
            with contextlib.suppress(OSError):
                sock.close()

    def _expire_pending(self) -> None:
        now = time.monotonic()
        for conn in [c for c, (_, _, deadline, _) in self._pending.items() if deadline < now]:
            self._forget_pending(conn, close=True)

    def _drop_all(self) -> None:
        for conn, sock in list(self._joined.items()):
            with contextlib.suppress(OSError):
                sock.close()
            with self._lock:
                self._joined.pop(conn, None)
        self._joined_list = ()


class ClientSocket:
    """The consumer's control connection: admission, handshake, then wake-ups and EOF.

    ``key`` is the loopback channel's rendezvous key: the producer's challenge is answered with a proof
    before HELLO. fds are received only where the socket can carry them (Unix sockets).
    """

    def __init__(self, sock: socket.socket, key: bytes | None = None) -> None:
        self.sock = sock
        self.gone = False
        self._key = key
        self._fds = hasattr(socket, "AF_UNIX") and sock.family == socket.AF_UNIX
        self._hup: Callable[[], bool] | None = None
        self._iocp_taken = False  # Windows: another proactor loop holds this socket (see _recv_async)
        #: the producer's pid (its header says), for a hang-up check where the OS cannot see one behind queued
        #: bytes (see ``_platform.hangup_poller``); 0: unknown
        self.peer_pid = 0
        self._readable = _platform.readable_waiter(sock.fileno())

    def _recv_exact(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionResetError("producer closed the connection during admission")
            data += chunk
        return data

    def handshake(self, hello: bytes, reply_size: int, timeout: float) -> tuple[bytes, list[int]]:
        self.sock.settimeout(timeout)
        if self._key is not None:
            challenge = self._recv_exact(wire.CHALLENGE_SIZE)
            hello = wire.proof(self._key, challenge) + hello
        self.sock.sendall(hello, _NOSIGNAL)
        data = b""
        fds: list[int] = []
        while len(data) < reply_size:
            if self._fds:
                chunk, more, _flags, _addr = socket.recv_fds(self.sock, reply_size - len(data), 4)
                fds.extend(more)
            else:
                chunk = self.sock.recv(reply_size - len(data))
            if not chunk:
                break
            data += chunk
            if data[:4] == b"CLNO":  # a REJECT is shorter than a WELCOME: take what has arrived
                with contextlib.suppress(OSError):
                    self.sock.settimeout(0.2)
                    data += self.sock.recv(4096)
                break
        self.sock.setblocking(False)
        return data, fds

    def fileno(self) -> int:
        return self.sock.fileno()

    def _seen(self, data: bytes) -> bool:
        """False (and gone) on EOF or the shutdown byte."""
        if not data or b"\x00" in data:
            self.gone = True
            return False
        return True

    def hung_up(self) -> bool:
        """The producer's end is closed (it exited or was killed), with nothing read: wake-ups stay queued.

        Not ``gone``: that is also set by a clean close's shutdown byte, and a closing producer keeps its
        events (and its end of the socket) until its consumers have left or its close timed out."""
        if self._hup is None:
            self._hup = _platform.hangup_poller(self.sock, self.peer_pid)
        return self._hup()

    def drain(self) -> bool:
        if self.gone:
            return False
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                data = b""
            if not self._seen(data):
                return False
            if len(data) < 65536:
                return True

    def wait_readable(self, timeout: float | None) -> bool:
        """Until readable (a wake-up, EOF) or ``timeout``; consumes nothing. True where there is something to
        look at now (readable, or the socket gone)."""
        if self.gone:
            return True
        try:
            if timeout is not None and timeout > _LONGEST_WAIT_S:  # no limit (inf), or beyond what poll takes
                timeout = None
            return self._readable(timeout)
        except (OSError, ValueError):
            self.gone = True
            return True

    async def wait_async(self, timeout: float | None) -> None:
        """Return when readable (a wake-up, EOF) or after ``timeout``; the caller then drains.

        Selector loops (Linux, macOS, uvloop) watch the fd. Windows' default proactor loop has no
        ``add_reader``, so there the wake-up bytes are received through the loop instead.
        """
        if self.gone:
            return
        try:
            await _platform.wait_readable_async(self.sock.fileno(), timeout)
        except NotImplementedError:
            await self._recv_async(asyncio.get_running_loop(), timeout)

    async def _recv_async(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        if self._iocp_taken:
            await self._wait_in_thread(timeout)
            return
        try:
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 4096), timeout)
        except asyncio.TimeoutError:
            return
        except OSError as exc:
            if exc.errno == errno.EINVAL or getattr(exc, "winerror", None) == 87:
                # Windows: the socket is bound to the completion port of the first proactor loop that read
                # it, for good; another loop (a second asyncio.run) cannot read it through its own. Not the
                # producer's end: wait in a thread from now on
                self._iocp_taken = True
                await self._wait_in_thread(timeout)
                return
            data = b""
        self._seen(data)

    async def _wait_in_thread(self, timeout: float | None) -> None:
        """Until readable or ``timeout``, in a worker thread, in short steps (a cancelled wait ends within one)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.gone:
            step = _THREAD_STEP_S if end is None else min(_THREAD_STEP_S, end - time.monotonic())
            if step <= 0:
                return
            if await asyncio.to_thread(self.wait_readable, step):
                return

    def hint(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(b"R", _DONTWAIT)

    def interrupt(self) -> None:
        """Shut our reading side: a ``poll`` on it returns (a bare close() would not wake it), and the producer
        sees no EOF, so the leases of frames still held stay until :meth:`close`."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        self.gone = True


class SocketClient(Client):
    """What every socket-based transport's client shares: waiting, wake-ups and EOF on one connection."""

    _sock: ClientSocket | None = None

    def _s(self) -> ClientSocket:
        if self._sock is None:
            raise LinkError("cudalink: not connected")
        return self._sock

    def fileno(self) -> int:
        return self._s().fileno()

    def wait_readable(self, timeout: float | None) -> None:
        self._s().wait_readable(timeout)

    def drain(self) -> bool:
        return self._s().drain()

    def hung_up(self) -> bool:
        return self._sock is None or self._sock.hung_up()

    async def wait_async(self, timeout: float | None) -> None:
        await self._s().wait_async(timeout)

    def hint(self) -> None:
        self._s().hint()

    def interrupt(self) -> None:
        if self._sock is not None:
            self._sock.interrupt()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
