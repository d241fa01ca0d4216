"""The transport cut: what a link needs from the OS, in plain primitives (memoryviews, bytes, ints, fds).

A transport makes two shared regions (the header and, for host frames, the data) visible to both
sides, and runs the control channel: the HELLO/WELCOME handshake (with fd passing), one wake-up byte
per publish, and end-of-file as the death notice. It knows nothing of frames, slots or CUDA; the
ring protocol in ``cudalink._ring`` works over whatever memory a transport hands it.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["UNVERIFIED_UID", "Client", "NoProducer", "Peer", "Region", "Server", "ServerHandler", "Transport"]


class Region(Protocol):
    """A shared region with a stable address: host frames point into it and keep it mapped while alive."""

    buf: memoryview
    address: int


class NoProducer(Exception):
    """Nothing is published under that name right now (the caller decides whether to wait)."""


#: the uid of a peer that failed its channel's access check (the loopback channel's key proof)
UNVERIFIED_UID = -1


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a control connection, as the OS (or the channel's proof) says."""

    pid: int
    uid: int


@dataclass(frozen=True)
class Reply:
    """The producer's answer to a HELLO."""

    data: bytes
    fds: tuple[int, ...] = ()
    accepted: bool = True


class ServerHandler(abc.ABC):
    """Callbacks a server runs on its control thread."""

    @abc.abstractmethod
    def on_hello(self, conn: int, message: bytes, peer: Peer) -> Reply: ...

    @abc.abstractmethod
    def on_leave(self, conn: int) -> None: ...

    @abc.abstractmethod
    def on_hint(self) -> None: ...


class Server(abc.ABC):
    """The producer's end: owns the shared regions and the listening control channel."""

    header: memoryview
    data: memoryview | None
    #: the host data region (None for CUDA links, whose slots live on the GPU)
    data_segment: Region | None

    @abc.abstractmethod
    def start(self, handler: ServerHandler) -> None:
        """Begin accepting consumers (after the header is fully written)."""

    @abc.abstractmethod
    def wake(self, byte: bytes = b"\x01", conns: list[int] | None = None) -> None:
        """Send one wake-up byte to the given connections (default: all joined); never blocks."""

    def wakers(self, conns: list[int], byte: bytes = b"\x01") -> list[Callable[[], object]] | None:
        """One call per connection that sends it ``byte`` (never blocking; ``OSError`` once it is gone), for
        a caller to keep while these connections stay joined; None while one of them is not joined yet.

        The producer keeps them per set of sleeping consumers: its wake-up is then a C call per consumer,
        with no Python frame between the publish and the syscall. This default goes through ``wake``.
        """
        return [functools.partial(self.wake, byte, [conn]) for conn in conns]

    @abc.abstractmethod
    def disconnect(self, conn: int) -> None:
        """Drop one consumer connection (it will see EOF)."""

    @abc.abstractmethod
    def connection_count(self) -> int: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting, close every connection and remove the names. Idempotent."""


class Client(abc.ABC):
    """The consumer's end of one producer generation."""

    header: memoryview
    #: the host data region, once :meth:`map_data` has mapped it
    data_segment: Region | None

    @abc.abstractmethod
    def handshake(self, hello: bytes, reply_size: int, timeout: float) -> tuple[bytes, list[int]]:
        """Send HELLO, return the producer's reply bytes and any passed fds."""

    @abc.abstractmethod
    def map_data(self, generation: int, size: int) -> memoryview:
        """Map the host data region of that generation."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """Readable when a wake-up byte or EOF arrives (for select/asyncio)."""

    @abc.abstractmethod
    def wait_readable(self, timeout: float | None) -> None:
        """Block until a wake-up or EOF is readable, or ``timeout``; consume nothing.

        The caller takes its frame first and calls :meth:`drain` before it next sleeps: the wake-up
        path then costs one poll and no recv.
        """

    @abc.abstractmethod
    def drain(self) -> bool:
        """Non-blocking :meth:`wait`: False = producer gone."""

    def hung_up(self) -> bool:
        """The producer's process has closed its end (exited or killed), read without consuming a wake-up.

        Checked before a consumer's stream waits on a frame's IPC ready event: CUDA calls any use of an
        imported event after its exporter freed it undefined, and a process that is gone has freed it."""
        return False

    @abc.abstractmethod
    async def wait_async(self, timeout: float | None) -> None:
        """Return when a wake-up or EOF may have arrived, or after ``timeout``; then call :meth:`drain`."""

    @abc.abstractmethod
    def hint(self) -> None:
        """Tell a waiting producer that a lease was released."""

    def interrupt(self) -> None:
        """Wake a thread waiting on this client (the Receiver is being closed); the producer sees nothing yet:
        the connection, and the leases of frames still held, stay until :meth:`close`. A client with nothing to
        wake (none of ours so far) does nothing."""
        return None

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    """A way to share a link: SharedMemory + Unix socket by default, in-process for tests."""

    #: the control channel can carry file descriptors (cuda.core IPC pools need this)
    passes_fds: bool = True

    @abc.abstractmethod
    def serve(self, name: str, header_size: int, data_size: int, generation: int = 0) -> Server:
        """Create the named link; replace stale leftovers; refuse a name that a live producer holds."""

    @abc.abstractmethod
    def connect(self, name: str) -> Client:
        """Map an existing link's header; raise :class:`NoProducer` when none is there."""

    def abandoned(self, name: str) -> bool:
        """``name`` holds a dead producer's leftovers (it will not answer; a new producer replaces them),
        as opposed to nothing published yet. Transports whose links die with their process say False."""
        return False
