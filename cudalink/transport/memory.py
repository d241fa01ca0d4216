"""An in-process transport for tests and notebooks: the same protocol over plain bytearrays.

Connections are real socket pairs, so waiting, wake-ups and EOF behave exactly as they do across
processes; only the memory is private to this process.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import numpy as np

from .. import _platform
from ..errors import LinkError
from .base import NoProducer, Region, Server, ServerHandler, Transport
from .control import ClientSocket, ControlLoop, SameProcessGate, SocketClient

__all__ = ["MemoryTransport"]


class _Region:
    """A bytearray with a stable address that frames can point into."""

    def __init__(self, size: int) -> None:
        self._raw = bytearray(size)
        self.buf = memoryview(self._raw)
        self.address = int(np.frombuffer(self._raw, np.uint8).ctypes.data) if size else 0


class _MemoryServer(Server):
    def __init__(self, owner: MemoryTransport, name: str, header: _Region, data: _Region | None, gen: int) -> None:
        self._owner = owner
        self._name = name
        self.header_segment = header
        self.data_segment = data
        self.header = header.buf
        self.data = data.buf if data is not None else None
        self.generation = gen
        self.loop = ControlLoop(None, SameProcessGate())
        self._closed = False

    def start(self, handler: ServerHandler) -> None:
        self.loop.start(handler)

    def wake(self, byte: bytes = b"\x01", conns: list[int] | None = None) -> None:
        self.loop.wake(byte, conns)

    def wakers(self, conns: list[int], byte: bytes = b"\x01") -> list[Callable[[], object]] | None:
        return self.loop.wakers(conns, byte)

    def disconnect(self, conn: int) -> None:
        self.loop.disconnect(conn)

    def connection_count(self) -> int:
        return self.loop.connection_count()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._owner.lock:
            if self._owner.links.get(self._name) is self:
                del self._owner.links[self._name]
        self.loop.close()


class _MemoryClient(SocketClient):
    def __init__(self, server: _MemoryServer) -> None:
        self._server = server
        self.header_segment = server.header_segment
        self.header = server.header
        self.data_segment: Region | None = None
        self._sock: ClientSocket | None = None

    def handshake(self, hello: bytes, reply_size: int, timeout: float) -> tuple[bytes, list[int]]:
        if self._server._closed:
            raise NoProducer("closed")
        mine, theirs = socket.socketpair()
        mine.settimeout(timeout)
        self._server.loop.add(theirs)
        self._sock = ClientSocket(mine)
        return self._sock.handshake(hello, reply_size, timeout)

    def map_data(self, generation: int, size: int) -> memoryview:
        region = self._server.data_segment
        if region is None or generation != self._server.generation:
            raise NoProducer("data region vanished")
        if len(region.buf) < size:
            raise LinkError("cudalink: data region smaller than the header promises")
        self.data_segment = region
        return region.buf


class MemoryTransport(Transport):
    """Links live in this object; share one instance between a Sender and its Receivers."""

    passes_fds = _platform.HAS_FD_PASSING  # its socket pairs are Unix sockets where those exist

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.links: dict[str, _MemoryServer] = {}

    def serve(self, name: str, header_size: int, data_size: int, generation: int = 0) -> _MemoryServer:
        _platform.check_name(name)
        with self.lock:
            if name in self.links:
                raise LinkError(f"cudalink: link {name!r} is already published in this transport")
            server = _MemoryServer(
                self, name, _Region(header_size), _Region(data_size) if data_size else None, generation
            )
            self.links[name] = server
        return server

    def connect(self, name: str) -> _MemoryClient:
        _platform.check_name(name)
        with self.lock:
            server = self.links.get(name)
        if server is None:
            raise NoProducer(f"no link named {name!r}")
        return _MemoryClient(server)
