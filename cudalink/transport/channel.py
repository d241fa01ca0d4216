"""How consumers find and reach a producer: a Unix socket, or loopback TCP where Unix sockets are missing.

This is the one interface behind which the control channel differs between operating systems. Both
channels are portable code and both run in CI on Linux (``CUDALINK_CONTROL=tcp`` forces the one
Windows uses); the OS calls they make are in :mod:`cudalink._platform`.

=========  ====================================  ==========================  ==============
channel    rendezvous                            access check                passes fds
=========  ====================================  ==========================  ==============
unix       ``<name>.sock`` (0600, 0700 dir)      SO_PEERCRED uid             yes (pools)
tcp        ``<name>.tcp`` file (port, key, gen)  challenge/HMAC of the key   no (legacy)
=========  ====================================  ==========================  ==============
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass

from .. import _platform
from ..errors import LinkError, ProtocolError
from . import wire
from .base import NoProducer
from .control import ClientSocket, CredentialGate, Gate, KeyGate

DENIED = (
    "cudalink: permission denied for link {name!r}: links are private to the user that created them; "
    "run the consumer as the same user"
)


@dataclass
class Listening:
    """A producer's open channel: the listening socket, how it admits, and the names to remove at close."""

    listener: socket.socket
    gate: Gate
    files: tuple[str, ...]

    def close(self) -> None:
        for path in self.files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            self.listener.close()


@dataclass(frozen=True)
class Found:
    """A consumer's view of a published link: where its header is and how to connect."""

    kind: str
    header: str
    connect: Callable[[float], ClientSocket]


class Channel:
    kind = ""
    passes_fds = False

    def header(self, name: str, generation: int) -> str:
        """The header segment's name."""
        raise NotImplementedError

    def listen(self, name: str, generation: int) -> Listening:
        """Open the channel (the caller holds the name's lock, so leftovers are stale)."""
        raise NotImplementedError

    def find(self, name: str) -> Found | None:
        """The published link under ``name``, or None."""
        raise NotImplementedError

    def leftovers(self, name: str) -> tuple[list[str], list[int]]:
        """A dead producer's rendezvous files and the generations it named (for segment cleanup)."""
        raise NotImplementedError


class UnixChannel(Channel):
    kind = "unix"
    passes_fds = True

    def header(self, name: str, generation: int) -> str:
        return _platform.segment_name(name)

    def leftovers(self, name: str) -> tuple[list[str], list[int]]:
        return [_platform.socket_path(name)], []

    def listen(self, name: str, generation: int) -> Listening:
        path = _platform.socket_path(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(64)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise LinkError(f"cudalink: link {name!r} was just claimed by another producer") from exc
            raise
        finally:
            os.umask(old)
        return Listening(listener, CredentialGate(), (path,))

    def find(self, name: str) -> Found | None:
        path = _platform.socket_path(name)
        if not os.path.exists(path):
            return None

        def connect(timeout: float) -> ClientSocket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                raise NoProducer(str(exc)) from exc
            except PermissionError as exc:
                sock.close()
                raise LinkError(DENIED.format(name=name)) from exc
            except OSError:
                sock.close()
                raise
            return ClientSocket(sock)

        return Found(self.kind, self.header(name, 0), connect)


class LoopbackChannel(Channel):
    """TCP on 127.0.0.1 for systems without Unix-socket fd passing (Windows).

    Any local process can connect to a TCP port, so the access check is the rendezvous file: it holds
    a fresh 32-byte key and is readable only by the producer's user; a consumer must answer the
    producer's challenge with an HMAC of that key (``wire.proof``) before its HELLO is read.
    """

    kind = "tcp"
    passes_fds = False

    @staticmethod
    def record_path(name: str) -> str:
        return os.path.join(_platform.runtime_dir(), f"{name}.tcp")

    def header(self, name: str, generation: int) -> str:
        return _platform.segment_name(name, f"-h{generation:016x}")

    def _read(self, name: str) -> wire.Rendezvous | None:
        try:
            data = _platform.read_regular(self.record_path(name), wire.RENDEZVOUS.size + 1)
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            raise LinkError(DENIED.format(name=name)) from exc
        if data is None:  # a FIFO or a directory under its name: no producer's file, and never waited on
            return None
        try:
            return wire.unpack_rendezvous(data)
        except ProtocolError:
            return None  # not ours, or from another cudalink version: nothing we can attach to

    def leftovers(self, name: str) -> tuple[list[str], list[int]]:
        old = self._read(name)
        path = self.record_path(name)
        # a killed writer's temp file is PATH.<pid>.tmp: "*" alone would also match link "x.tcp.5"'s own one
        # (x.tcp.5.tcp.<pid>.tmp) as x's, while that live producer writes it
        temps = [t for t in glob.glob(f"{glob.escape(path)}.*.tmp") if t[len(path) + 1 : -4].isdigit()]
        return [path, *temps], [] if old is None else [old.generation]

    def listen(self, name: str, generation: int) -> Listening:
        listener = _platform.loopback_listener()
        key = secrets.token_bytes(wire.KEY_SIZE)
        record = wire.Rendezvous(int(listener.getsockname()[1]), os.getpid(), generation, key)
        path = self.record_path(name)
        try:
            _platform.write_private(path, wire.pack_rendezvous(record))
        except BaseException:
            listener.close()
            raise
        return Listening(listener, KeyGate(key), (path,))

    def find(self, name: str) -> Found | None:
        record = self._read(name)
        if record is None or not _platform.pid_alive(record.pid):
            return None

        def connect(timeout: float) -> ClientSocket:
            try:
                sock = socket.create_connection(("127.0.0.1", record.port), timeout=timeout)
            except (ConnectionRefusedError, TimeoutError) as exc:
                raise NoProducer(str(exc)) from exc
            return ClientSocket(sock, record.key)

        return Found(self.kind, self.header(name, record.generation), connect)


CHANNELS: dict[str, Channel] = {"unix": UnixChannel(), "tcp": LoopbackChannel()}


def channel(kind: str | None = None) -> Channel:
    """The channel a producer opens: ``kind``, else ``CUDALINK_CONTROL``, else what the OS supports."""
    return CHANNELS[_platform.default_control(kind)]


def find(name: str) -> Found | None:
    """Whichever channel the live producer of ``name`` opened (consumers need no configuration)."""
    for kind in ("unix", "tcp") if hasattr(socket, "AF_UNIX") else ("tcp",):
        found = CHANNELS[kind].find(name)
        if found is not None:
            return found
    return None
