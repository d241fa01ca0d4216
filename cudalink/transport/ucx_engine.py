"""UCXX in one place: the import (with the error naming the extra), the shared key, and the UCX worker a
loop progresses (:class:`Core`).

cudalink drives UCXX's core API (``ucxx._lib.libucxx``) from its own asyncio loop: the worker runs in
blocking progress mode, its epoll fd is one of the loop's readers, and the loop progresses it and completes
the requests awaited on it. No UCXX thread: a message's arrival wakes the one thread that handles it. UCXX's
own asyncio API (``ucxx.init``) wakes a progress thread, then a notifier thread, then the loop; measured on
a 2-core VM (2026-11-26, ``.diag/corepair.py``, 64x64x4 every 5 ms, paired, p50): a bare send/recv of
that API 253 µs, the same on the core API woken by its fd 96 µs. That API stays here only as a floor for
the bench (:func:`init_asyncio`; ``CUDALINK_UCX_PROGRESS`` picks its mode).

A server's loop is its main one; a consumer process runs one daemon thread's loop (:func:`engine`), which
all its remote Receivers share.
"""

from __future__ import annotations

import asyncio
import atexit
import binascii
import collections
import concurrent.futures
import contextlib
import gc
import hashlib
import logging
import os
import random
import re
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any, TypeVar

from .. import _platform
from ..errors import LinkError, ProtocolError, ProtocolReason
from . import ucx_wire

T = TypeVar("T")

INSTALL_HINT = 'pip install "cudalink[ucx]" (Linux, Python 3.11+; in a checkout of cudalink: pip install ".[ucx]")'
#: a peer silent this long is gone (each side sends a PING every PING_S while idle): a pulled cable sends no
#: reset, and a consumer that vanished must give its leases back within a second. A consumer whose process
#: holds the GIL that long (``import torch`` after connecting) sends no PING either: the server drops it
#: (its leases go back), and the consumer, running again, connects anew and carries on; the frames that
#: went by count as skipped.
DEAD_AFTER_S = float(os.environ.get("CUDALINK_UCX_DEAD_S", "0.9"))
PING_S = DEAD_AFTER_S / 4
HANDSHAKE_S = 3.0
#: how long a server still serves a consumer after its producer closed cleanly, for the frames it published
#: before: one that holds every frame it may (no credit left) takes them once it gives some back, as a local
#: consumer reads them from the ring later. A producer that died leaves nothing to wait for.
DRAIN_S = 1.0
#: the progress mode of UCXX's asyncio API, for the bench's floor (``CUDALINK_UCX_PROGRESS`` overrides)
PROGRESS = "thread"
log = logging.getLogger("cudalink.ucx")

_lock = threading.Lock()
_ucxx: ModuleType | None = None
#: ``UCX_RNDV_THRESH`` as the user set it, before ``import ucxx`` sets its own (8192)
_user_rndv: str | None = None
#: messages up to this size go eagerly, in one trip (a FRAME header and its inline pixels included). UCXX
#: sets 8192: a 64x64x4 frame then took a rendezvous, a round trip more; on a 2-core VM (2026-11-26,
#: paired, p50) the bare core-API floor for its bytes went from 239 to 104 µs with this.
EAGER_MAX = ucx_wire.MSG_SIZE + ucx_wire.INLINE_MAX


def held_up(last: float, now: float) -> bool:
    """A watchdog turn that came over two PINGs after ``last`` means its own loop was held up (the GIL, a long
    UCX or CUDA call): what the peer sent meanwhile is not read yet, so that silence is not the peer's."""
    return now - last > 2 * PING_S


def load() -> ModuleType:
    """``import ucxx``, or a LinkError that names the extra to install."""
    global _ucxx
    if _ucxx is not None:
        return _ucxx
    global _user_rndv
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables this UCX build does not know
    if not os.environ.get("CUDALINK_DEBUG"):
        # UCXX logs every failed endpoint as an ERROR line (about 20 a second while a Receiver waits for a server
        # that is down); cudalink reports each connection's end itself. UCXX_LOG_LEVEL set by the user wins.
        os.environ.setdefault("UCXX_LOG_LEVEL", "FATAL")
    if "ucxx" not in sys.modules:
        _user_rndv = os.environ.get("UCX_RNDV_THRESH")
    try:
        import ucxx
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "ucxx":  # not a module ucxx itself imports
            raise LinkError(
                f"cudalink: ucx:// addresses need UCXX, which is not installed ({exc}); {INSTALL_HINT}"
            ) from exc
        # installed, but it failed to load: where a UCX of the system (an MPI's, say) is older than UCXX takes, it
        # was loaded instead of the wheel's libucx-cu13, as happens when librmm-cu13 is missing (one H200 lease,
        # 2026-11-27: "Support for UCX 1.16.0 has ended" from Debian's libucx0 until librmm-cu13 was installed)
        raise LinkError(
            f"cudalink: UCXX is installed but failed to load ({exc}); reinstall the extra with what it needs: "
            'pip install --force-reinstall "cudalink[ucx]" (it brings libucx-cu13 and librmm-cu13)'
        ) from exc
    _ucxx = ucxx
    mod: ModuleType = ucxx
    return mod


def available() -> bool:
    try:
        load()
    except LinkError:
        return False
    return True


#: UCX's TCP segments (send and receive), where the user sets none (``UCX_TCP_TX_SEG_SIZE`` /
#: ``UCX_TCP_RX_SEG_SIZE``): UCX's own (8k to send) cut every frame into many sends and receives. On the 2-vCPU
#: VM (2026-11-27, loopback, 1080p, two runs each) the bare UCXX stream went from 261-292 fps to 317-331 with
#: 128k, 432-463 with 256k and 490-492 with 1m; cudalink's from 155-242 to 267-283, 329-342 and 380-413. NVIDIA
#: Holoscan raises them the same way (to 128k) for its UCX transport, for the same reason.
TCP_SEG_SIZE = "256k"


def config() -> dict[str, str]:
    """UCX settings of cudalink's context (the user's ``UCX_RNDV_THRESH`` and TCP segment sizes win; other
    ``UCX_*`` apply)."""
    out = {} if _user_rndv else {"RNDV_THRESH": str(EAGER_MAX + 1)}
    for key in ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"):
        if not os.environ.get(f"UCX_{key}"):
            out[key] = TCP_SEG_SIZE
    return out


def init_asyncio() -> ModuleType:
    """``ucxx.init`` on the running loop (once per process), and the module: UCXX's asyncio API, which only
    the bench's floor uses now (cudalink itself runs :class:`Core`)."""
    ucxx = load()
    mode = os.environ.get("CUDALINK_UCX_PROGRESS", PROGRESS)
    try:
        # a request awaited without a Python future is polled (``asyncio.sleep(0)`` in a loop): a pending
        # receive would keep a core busy; the thread modes complete requests through real futures
        ucxx.init(options=config(), progress_mode=mode, enable_python_future=mode.startswith("thread"))
    except RuntimeError:
        pass  # already initiated in this process
    return ucxx


def describe() -> dict[str, object]:
    """For ``cudalink info``: whether UCX is usable, its version and the transports it found."""
    try:
        ucxx = load()
    except LinkError as exc:
        return {"usable": False, "why": str(exc)}
    out: dict[str, object] = {"usable": True, "ucxx": getattr(ucxx, "__version__", "?")}
    try:
        out["ucx"] = ".".join(map(str, ucxx.get_ucx_version()))

        async def transports() -> list[str]:
            return sorted(core_here().transports())

        out["transports"] = engine().run(transports(), 10.0)
    except Exception as exc:  # a broken UCX install: say what it said
        out["usable"] = False
        out["why"] = f"{type(exc).__name__}: {exc}"
    return out


# -- what travels: GPU memory as is, or host bytes ---------------------------------------------------------


def rdma_transports(names: set[str] | list[str]) -> bool:
    """Whether UCX found a network transport that moves GPU memory itself (InfiniBand/RoCE verbs, EFA...):
    anything beyond TCP, shared memory and the CUDA copy engines."""
    local = {"tcp", "self", "posix", "sysv", "cma", "knem", "xpmem", "cuda_copy", "cuda_ipc", "gdr_copy"}
    local |= {"rocm_copy", "rocm_ipc", "rocm_gdr"}
    return any(n.split("/")[0] not in local for n in names)


def stage_mode() -> str:
    """``CUDALINK_UCX_STAGE``: ``auto`` (the default), or ``host``/``gpu`` to force either way; read by the
    server and by a consumer alike."""
    mode = os.environ.get("CUDALINK_UCX_STAGE", "auto")
    if mode not in ("auto", "host", "gpu"):
        raise LinkError(f"cudalink: CUDALINK_UCX_STAGE={mode!r}; use auto, host or gpu")
    return mode


def gpu_paths(transports: set[str] | list[str]) -> str:
    """For ``cudalink info`` on a GPU machine: how GPU frames would travel with these transports, by the rule
    a server applies (:func:`stage_on_host`, for a GPU consumer that asks for GPU memory as is)."""
    ipc, rdma = "cuda_ipc" in transports, rdma_transports(transports)
    staged = "staged through host memory"
    here = f"{staged} (no cuda_ipc)" if stage_on_host(True, True, rdma, "auto", ipc) else "as GPU memory (cuda_ipc)"
    away = f"{staged} (no RDMA)" if stage_on_host(True, False, rdma, "auto", ipc) else "as GPU memory (RDMA)"
    return f"GPU frames: on this host {here}; to other hosts {away}"


def stage_on_host(consumer_gpu: bool, same_host: bool, rdma: bool, mode: str = "auto", ipc: bool = True) -> bool:
    """Whether a server sends a GPU frame as host bytes. Only where UCX moves GPU memory by itself (``cuda_ipc``
    on one host, ``ipc``; an RDMA transport across hosts, ``rdma``) does it go as is: elsewhere UCX stages it
    through its own bounce buffers inside its progress calls, which on an H100 (2026-11-26, one host,
    ``UCX_TLS=tcp,cuda_copy``, 1080p) carried 3 frames a second, and 0.4 with another process keeping the GPU
    busy, where cudalink's staging carried 158 (95 of 100 offered, busy). ``consumer_gpu``: the consumer's
    HELLO asks for GPU memory as is (it lands on a GPU and its UCX has such a path: :func:`gpu_as_is`).
    ``mode`` (:func:`stage_mode`) forces ``host`` or ``gpu``."""
    if mode == "host" or not consumer_gpu:
        return True
    if mode == "gpu":
        return False
    return not ipc if same_host else not rdma


def gpu_as_is(transports: set[str], mode: str) -> bool:
    """What a consumer landing on a GPU asks for in its HELLO: GPU memory as is only where its own UCX has a
    path for it (``cuda_ipc``, or an RDMA transport), else host bytes (see :func:`stage_on_host`)."""
    if mode != "auto":
        return mode == "gpu"
    return "cuda_ipc" in transports or rdma_transports(transports)


# -- Sender(serve=...) -----------------------------------------------------------------------------------------


#: how long a serve waits for its port to be let go of before it says the port is in use
PORT_WAIT_S = 2.0


def check_listen(listen: str) -> None:
    """Fail in the producer, before it allocates anything, on a bad address or a missing extra."""
    import importlib.util

    addr = ucx_wire.parse_address(listen, need_name=False)
    if importlib.util.find_spec("ucxx") is None:
        raise LinkError(f"cudalink: serve={listen!r} needs UCXX, which is not installed; {INSTALL_HINT}")
    check_listen_host(addr)


def check_listen_host(addr: ucx_wire.Address) -> None:
    """A listen address's host and port, checked before a server starts: a host that never resolves is refused
    (not printed as where the link is served; one whose DNS does not answer yet is let through: the host is
    only said, UCXX listens on every interface), and a port a live listener holds is refused at once, not
    after UCX's 15 s of retries."""
    with contextlib.suppress(Unresolved):
        resolve(addr.host)
    check_port(addr.port)


#: getaddrinfo's answers that say a name has no IPv4 address, now or ever (not a DNS server that failed to
#: answer): waiting for a server there is in vain
_NO_SUCH_HOST = {
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY") if hasattr(socket, name)
}


class Unresolved(LinkError):
    """The host did not resolve this time (its DNS server did not answer): trying again may succeed."""


def resolve(host: str) -> str:
    """``host``'s IPv4 address (UCXX connects and listens over IPv4 only). A host that has none (no such
    name, an address like ``999.1.1.1`` or ``user@host``) is a :class:`ProtocolError` naming it; UCX
    only says "Invalid IP address or hostname", on every attempt until a Receiver's timeout. Raises
    :class:`Unresolved` where the resolver failed for now (``EAI_AGAIN``)."""
    try:
        found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno not in _NO_SUCH_HOST:
            raise Unresolved(f"cudalink: cannot resolve the host {host!r} now ({exc.strerror})") from exc
        raise ProtocolError(
            f"cudalink: the host {host!r} of a ucx:// address does not resolve to an IPv4 address "
            f"({exc.strerror}); give the server's IPv4 address, or a host name this machine resolves",
            ProtocolReason.REFUSED,
        ) from None
    except UnicodeError as exc:  # a label over 63 characters, say
        raise ProtocolError(
            f"cudalink: the host {host!r} of a ucx:// address is not a valid host name ({exc}); give the server's "
            "IPv4 address, or a host name this machine resolves",
            ProtocolReason.REFUSED,
        ) from None
    return str(found[0][4][0])


def check_port(port: int) -> None:
    """Refuse a port a live listener holds (on any address: UCXX's listener binds every interface), before
    anything is started: the server process would only find out later, and alone. A port held by a socket
    in TIME_WAIT passes (SO_REUSEADDR), as UCXX's listener takes it too; one held for up to ``PORT_WAIT_S``
    more (the server of a producer that just crashed, which sees its parent gone within 0.2 s) is waited for."""
    deadline = time.monotonic() + PORT_WAIT_S
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise LinkError(
                        f"cudalink: port {port} is in use on this host ({exc.strerror}); pick another port for serve="
                    ) from None
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port no socket of this host holds now, on any address, and outside the OS's ephemeral range.

    UCXX's listener binds every interface whatever host it is given, so the port is tried on all of them;
    and a port from the ephemeral range (what binding port 0 returns) may be taken, before the server
    listens, by any outgoing connection or by the TCP sockets UCX itself opens on port 0 in that very
    server. For tests and benches that pick their own port."""
    ports = outside_ephemeral()
    rng = random.Random()
    for _ in range(200 if len(ports) >= 64 else 0):
        port = ports[rng.randrange(len(ports))]
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    # no room outside the range (a range of 1024-65535, say), or all of it taken: the OS's choice is left
    log.warning("cudalink: no free port outside the ephemeral range; a server may find the one picked busy")
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def outside_ephemeral() -> range | list[int]:
    """The unprivileged ports (1024 up) the OS does not hand out itself: below its ephemeral range and above."""
    low, high = _platform.ephemeral_ports()
    below, above = range(1024, max(1024, low)), range(max(1024, high + 1), 65536)
    if not below or not above:
        return above or below
    return [*below, *above]


#: the longest a ``Sender(serve=)`` waits for its server to listen (it may wait out a crashed predecessor's
#: port: ``ucx_server.BUSY_RETRY_S``); it is up in about a second
SERVE_READY_S = 30.0


def spawn_server(name: str, listen: str) -> subprocess.Popen[bytes]:
    """``python -m cudalink serve NAME --listen ADDR`` as a child that exits when this process does, once it
    listens: a server that cannot (its port taken meanwhile by another's, which a check made before it
    started cannot see) is a LinkError here, not a child that exits alone while its Sender carries on."""
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "cudalink", "serve", name, "--listen", listen, "--parent", str(os.getpid())]
    try:
        proc = subprocess.Popen([*cmd, "--ready-fd", str(w)], stdin=subprocess.DEVNULL, pass_fds=(w,))
    finally:
        os.close(w)
    said: bytes | None = None  # None: nothing within the time; b"": it exited without a word
    listening = False
    try:
        with os.fdopen(r, "rb", buffering=0) as ready:
            if _platform.wait_readable(r, SERVE_READY_S):
                said = ready.read(4096) or b""
        listening = said is not None and said.startswith(b"ok")
    finally:
        if not listening:
            stop_server(proc)
    if listening:
        return proc
    if said is None:
        why = f"it did not listen within {SERVE_READY_S:.0f}s"
    else:
        why = said.decode(errors="replace").strip() or f"it exited ({proc.returncode}); its output above says why"
    raise LinkError(f"cudalink: serve={listen!r}: the ucx server did not start: {why}")


def tell_ready(fd: int, text: str) -> None:
    """The server's word to the Sender that spawned it (``spawn_server``): ``ok``, or why not."""
    with contextlib.suppress(OSError):
        os.write(fd, text.encode()[:4096])
        os.close(fd)


def stop_server(proc: subprocess.Popen[bytes], timeout: float = 2.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


# -- the shared key ---------------------------------------------------------------------------------------


def key_path() -> str:
    """Where the key lives: ``CUDALINK_KEY_FILE``, else ``$XDG_CONFIG_HOME/cudalink/ucx.key``."""
    path = os.environ.get("CUDALINK_KEY_FILE")
    if path:
        return path
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "cudalink", "ucx.key")


def _decode(text: str, where: str) -> bytes:
    try:
        key = binascii.unhexlify(text.strip())
    except (binascii.Error, ValueError):
        key = b""
    if len(key) < 16:
        raise LinkError(f"cudalink: the ucx key in {where} is not hex of at least 16 bytes; copy it again")
    return key


def load_key(create: bool = False) -> tuple[bytes, str | None]:
    """The shared key: ``CUDALINK_KEY`` (hex), else the key file; ``create`` writes a fresh one (0600).

    Returns the key and the path of a file just created (None otherwise), so a server can print how to
    copy it to the consumer's host.
    """
    env = os.environ.get("CUDALINK_KEY")
    if env:
        return _decode(env, "CUDALINK_KEY"), None
    path = key_path()
    try:
        # never a plain open(): one of a FIFO left at the path blocks until a writer comes, which none may
        data, mode = _platform.read_regular_mode(path, 4096)
        if data is None:
            raise LinkError(
                f"cudalink: the ucx key path {path} is no regular file (a directory, FIFO or device); remove it "
                "and copy the server's key file there again"
            )
        if _platform.open_to_others(mode):  # others may read it, or put a key of their own in its place
            raise LinkError(
                f"cudalink: the ucx key file {path} is open to other users (mode {mode & 0o777:o}); "
                f"it must be private: chmod 600 {path} (on a filesystem that keeps no modes, set CUDALINK_KEY to "
                "its contents instead)"
            )
        return _decode(data.decode(), path), None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise LinkError(
            f"cudalink: cannot read the ucx key file {path} ({exc}); copy the server's key there again"
        ) from None
    except FileNotFoundError:
        if not create:
            raise LinkError(
                f"cudalink: no ucx key: set CUDALINK_KEY, or copy the server's key file to {path} "
                "(`python -m cudalink serve` prints the command)"
            ) from None
    key = secrets.token_bytes(ucx_wire.KEY_SIZE)
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)

    def write_new(where: str) -> None:  # FileExistsError where it exists
        with os.fdopen(os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(key.hex() + "\n")

    # written whole under a private name, then linked into place: a process that makes one at the same
    # moment (a Sender and its server) finds either no file or a whole one, and the first key made wins
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    write_new(tmp)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return load_key(create=False)
        except OSError:  # a filesystem without hard links (vfat, some SMB/FUSE mounts): create it in place
            try:
                write_new(path)
            except FileExistsError:
                time.sleep(0.05)  # its maker's one write is done by now
                return load_key(create=False)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return key, path


def say(line: str) -> None:
    """One line to stdout in one write: a producer that spawned its server shares the stream (print, with
    PYTHONUNBUFFERED set, writes the line and its newline apart, and another writer's line came between).
    Lines that cannot be written (no stdout, a closed pipe) are dropped: they inform, and the server
    serves without them."""
    out = sys.stdout
    if out is None:  # pythonw, or a daemon that closed it
        return
    with contextlib.suppress(OSError, ValueError):
        out.write(line + "\n")
        out.flush()


def announce_key(created: str | None) -> None:
    """Say where a key just made lives and how to copy it to the consumers' hosts (nothing if none was made)."""
    if created:
        say(
            f"cudalink: made a new key in {created}. On each consumer's host run:\n"
            f"  mkdir -p ~/.config/cudalink && scp {socket.gethostname()}:{created} ~/.config/cudalink/ucx.key\n"
            "or set CUDALINK_KEY to its contents there."
        )


# -- the worker a loop progresses -----------------------------------------------------------------------------

#: how soon a loop looks again at a request that no fd event may announce: GPU memory (UCX's CUDA copies
#: complete on the GPU, so it is polled while one is in flight), a send (a rendezvous waits on the peer),
#: anything else (a safety net, as UCXX's own blocking mode keeps)
POLL_GPU_S = 0.0
POLL_SEND_S = 0.001
POLL_IDLE_S = 1.0
#: the peer-info message UCXX's asyncio API exchanges on a new endpoint (so either side may be UCXX's)
_PEER_INFO = struct.Struct("QQ")


def _hash64(*args: object) -> int:
    """UCXX's ``hash64bits``: the checksum its peers put beside their tag."""
    return int(hashlib.sha1(repr(args).encode()).hexdigest()[:16], 16)


class _Pending:
    __slots__ = ("delay", "ep", "fut", "keep", "req")

    def __init__(self, req: Any, fut: asyncio.Future[None], keep: object, delay: float, ep: Any = None) -> None:
        self.req = req
        self.fut = fut
        self.keep = keep  # the buffer's wrapper: alive until UCX is done with it, even if nobody awaits
        self.delay = delay
        self.ep = ep  # a wire-up's endpoint: its failure ends the request's wait (see _complete)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Core:
    """A UCX worker progressed by one asyncio loop, and the requests awaited on it.

    The worker's epoll fd is a reader of the loop. Each time it fires, and right after each request is
    posted, the loop progresses the worker until ``arm()`` says no event is left, then completes the
    futures of finished requests; the loop sleeps in its own ``epoll_wait`` meanwhile. UCX's rule (progress
    until idle, then arm, then wait) holds because every call into UCX is made on this loop's thread and
    ends in :meth:`progress`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        load()  # the error naming the extra, and the user's UCX_RNDV_THRESH read before ucxx sets its own
        from ucxx._lib import libucxx as api
        from ucxx._lib.arr import Array

        self.api = api
        self.Array = Array
        self.loop = loop
        self.context = api.UCXContext(config())
        self.worker = api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.fd = int(self.worker.epoll_file_descriptor)
        self._pending: list[_Pending] = []
        self._progressed: list[asyncio.Future[None]] = []  # woken by the next progress (Endpoint.recv_sized)
        #: requests of failed endpoints, which UCX may never complete (see _failed): the latest few kept with
        #: their buffers, in case it does after all
        self._orphans: collections.deque[_Pending] = collections.deque(maxlen=64)
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._transports: set[str] | None = None
        self._endpoints: weakref.WeakSet[Endpoint] = weakref.WeakSet()  # aborted by shutdown()
        loop.add_reader(self.fd, self.progress)
        self.progress()

    def shutdown(self) -> None:
        """Let go of the UCX worker and context now (on this loop's thread, while CUDA lives): UCX frees the
        CUDA events and streams of its CUDA transports in the calling thread's current context. Left to the
        garbage at interpreter exit, the main thread (no context current) freed them, and every GPU consumer
        printed 129 lines of ``cuEventDestroy_v2(...) failed: context is destroyed`` as it exited (H200,
        2026-11-27; none when freed here). Endpoints still open are aborted: each holds the worker."""
        if self.worker is None:
            return
        for ep in list(self._endpoints):
            ep.abort()
        self.loop.remove_reader(self.fd)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending.clear()
        self._orphans.clear()
        woken, self._progressed = self._progressed, []
        for fut in woken:
            _settle(fut)
        self.worker = self.context = None
        if getattr(self.loop, "_cudalink_ucx_core", None) is self:
            del self.loop._cudalink_ucx_core  # type: ignore[attr-defined]
        gc.collect()  # a cycle (a task's frame, a traceback) may hold UCXX objects: freed here, not later

    def transports(self) -> set[str]:
        """UCX's active transports, as ``ucxx.get_active_transports`` reads them from the context's info
        (read once: they are fixed when the context is made)."""
        if self._transports is None:
            info = str(self.context.info)
            found = re.findall(r"^#.*resource.*md.*dev.*flags.*$", info, re.MULTILINE)
            self._transports = {r.split()[-1].split("/")[0] for r in found}
        return set(self._transports)

    def progress(self) -> None:
        w = self.worker
        while True:
            w.progress()
            if self._pending:
                self._complete()
            if w.arm():
                break
        if self._progressed:
            woken, self._progressed = self._progressed, []
            for fut in woken:
                _settle(fut)
        if self._pending:
            self._look_again()

    async def progressed(self, within: float) -> None:
        """Until the worker has progressed again (an fd event: a message came, say), or ``within`` seconds."""
        fut = self.loop.create_future()
        self._progressed.append(fut)
        timer = self.loop.call_later(within, _settle, fut)  # a safety net, as for requests (POLL_IDLE_S)
        try:
            await fut
        finally:
            timer.cancel()

    def _complete(self) -> None:
        left = []
        for p in self._pending:
            if not p.req.completed:
                if p.ep is not None and self._failed(p):
                    continue
                left.append(p)
            elif not p.fut.done():  # a cancelled waiter's request still ran to its end
                try:
                    p.req.check_error()
                except Exception as exc:
                    p.fut.set_exception(exc)
                else:
                    p.fut.set_result(None)
        self._pending = left

    def _failed(self, p: _Pending) -> bool:
        """A wire-up request whose endpoint failed: UCX may never complete it (two connects at once to a port
        nobody listens on: one waited out its whole timeout, and its request was polled every millisecond
        for the life of the process). Its waiter fails now; the request is kept, unpolled, with its buffer."""
        try:
            p.ep.raise_on_error()
        except Exception as exc:
            if not p.fut.done():
                p.fut.set_exception(exc)
            self._orphans.append(p)
            return True
        return False

    def _look_again(self) -> None:
        when = self.loop.time() + min(p.delay for p in self._pending)
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.progress()

    async def wait(self, req: Any, keep: object, delay: float, ep: Any = None) -> None:
        """Until ``req`` completes (raising what UCX reported), or its endpoint ``ep`` fails; ``keep`` lives
        as long as the request."""
        await self.watch(req, keep, delay, ep)

    def watch(self, req: Any, keep: object, delay: float, ep: Any = None) -> asyncio.Future[None]:
        """:meth:`wait` as a future, watched from now on (``keep`` with it) whether or not it is awaited yet."""
        fut = self.loop.create_future()
        if req.completed:
            try:
                req.check_error()
            except Exception as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
            return fut
        self._pending.append(_Pending(req, fut, keep, delay, ep))
        self.progress()
        return fut

    def array(self, buf: Any) -> Any:
        if isinstance(buf, self.Array):
            return buf
        dtype = getattr(buf, "dtype", None)
        if dtype is not None and dtype.kind == "V" and hasattr(buf, "view"):
            # UCXX reads buffers through the buffer protocol, which has no format for ml_dtypes' bfloat16
            # ("cannot include dtype 'E' in a buffer"): its bits go as unsigned ints of the same size
            buf = buf.view(f"u{dtype.itemsize}")
        return self.Array(buf)

    async def _peer_info(self, ep: Any, listener: bool) -> tuple[int, int]:
        """UCXX's endpoint wire-up: each side's receive tag, over UCX streams; (send tag, receive tag)."""
        mine = _hash64("msg_tag", os.urandom(16), ep.handle)
        out = self.Array(_PEER_INFO.pack(mine, _hash64(mine)))
        theirs = bytearray(_PEER_INFO.size)
        got = self.Array(theirs)
        steps = [(ep.stream_send, out), (ep.stream_recv, got)]
        for post, arr in steps if listener else steps[::-1]:
            await self.wait(post(arr), arr, POLL_SEND_S, ep)
        tag, check = _PEER_INFO.unpack(theirs)
        if check != _hash64(tag):
            raise ProtocolError("cudalink: a ucx peer's endpoint wire-up failed its checksum")
        return tag, mine

    async def connect(self, host: str, port: int, timeout: float) -> Endpoint:
        ep = self.api.UCXEndpoint.create(self.worker, host, port, True)
        try:
            send_tag, recv_tag = await asyncio.wait_for(self._peer_info(ep, False), timeout)
        except BaseException:
            self.close(ep)
            raise
        return Endpoint(self, ep, send_tag, recv_tag)

    def listen(self, handler: Callable[[Endpoint], Coroutine[Any, Any, None]], port: int) -> Any:
        """A UCX listener on ``port`` (every interface); each connection runs ``handler`` as a task. Keep
        the returned listener: it stops listening when it dies."""
        listener: Any = None

        def accepted(conn_request: Any) -> None:  # called inside UCX's progress, on this loop's thread
            ep = listener.create_endpoint_from_conn_request(conn_request, True)
            task = self.loop.create_task(self._accepted(ep, handler))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        listener = self.api.UCXListener.create(worker=self.worker, port=port, cb_func=accepted)
        self.progress()
        return listener

    def close(self, ep: Any) -> None:
        """Close a UCX endpoint at once; requests pending on it fail (completed by the progress after)."""
        with contextlib.suppress(Exception):
            ep.close_blocking(period=10**10, max_attempts=1)
        with contextlib.suppress(Exception):
            ep.remove_close_callback()
        self.progress()

    async def _accepted(self, ep: Any, handler: Callable[[Endpoint], Coroutine[Any, Any, None]]) -> None:
        try:
            send_tag, recv_tag = await asyncio.wait_for(self._peer_info(ep, True), HANDSHAKE_S)
        except Exception as exc:
            log.info("cudalink: a ucx connection failed its wire-up (%s: %s)", type(exc).__name__, exc)
            self.close(ep)
            return
        try:
            await handler(Endpoint(self, ep, send_tag, recv_tag))
        except Exception:
            log.warning("cudalink: a ucx connection's handler failed", exc_info=True)


#: UCXX's errors that say the peer is gone (it closed, reset, or stopped answering), not that we failed
_PEER_GONE = ("ConnectionResetError", "EndpointTimeoutError", "NotConnectedError", "UnreachableError", "CanceledError")


def truncated(exc: BaseException) -> bool:
    """Whether ``exc`` is UCX's report of a message of another size than the buffer (UCXXMessageTruncatedError,
    known by name and text: UCXX is imported lazily)."""
    return "runcat" in type(exc).__name__ or "runcat" in str(exc)


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` from a send or receive means the other side went away (by name: UCXX is imported
    lazily, and our own closed endpoint raises the builtin ConnectionResetError)."""
    return isinstance(exc, ConnectionResetError) or type(exc).__name__.endswith(_PEER_GONE)


class Endpoint:
    """One connection: whole messages of our peer's tag out, of ours in (UCX keeps them in order)."""

    def __init__(self, core: Core, ep: Any, send_tag: int, recv_tag: int) -> None:
        self.core = core
        self._ep: Any = ep
        core._endpoints.add(self)
        self._send_tag = core.api.UCXXTag(send_tag)
        self._recv_tag = core.api.UCXXTag(recv_tag)

    def _live(self) -> Any:
        if self._ep is None:
            raise ConnectionResetError("cudalink: this ucx endpoint is closed")
        return self._ep

    async def send(self, buf: Any) -> None:
        await self.post(buf)

    def post(self, buf: Any) -> asyncio.Future[None]:
        """Send ``buf`` (posted now, so messages posted in turn go out in turn); the future completes once
        UCX is done with ``buf``, which must stay untouched until then."""
        arr = self.core.array(buf)
        req = self._live().tag_send(arr, self._send_tag)
        return self.core.watch(req, arr, POLL_GPU_S if arr.cuda else POLL_SEND_S)

    async def recv(self, buf: Any) -> None:
        """One message into ``buf``. A message that arrived before the endpoint failed is still received
        (UCX cancels receives posted on a failed endpoint; the message waits on the worker)."""
        core = self.core
        arr = core.array(buf)
        delay = POLL_GPU_S if arr.cuda else POLL_IDLE_S
        ep = self._live()
        try:
            ep.raise_on_error()
        except Exception:
            if not await self._from_worker(arr, delay):
                raise
            return
        try:
            await core.wait(ep.tag_recv(arr, self._recv_tag, core.api.UCXXTagMaskFull), arr, delay)
        except Exception as exc:
            if "ancel" not in type(exc).__name__ or not await self._from_worker(arr, delay):
                raise

    async def recv_sized(self, buf: Any) -> None:
        """One message into ``buf``, which it must fill exactly, else a :class:`ProtocolError` (a posted
        receive completes short without saying so, and the rest of ``buf`` would pass for the message's).
        So the message is probed for its length, then received by its handle: a frame's pixels, sent right
        behind its header, mostly there already (a header's own probe cost more than this is worth: see
        ``UcxAttachment._land_frames``)."""
        core = self.core
        arr = core.array(buf)
        w = core.worker
        while True:
            probe = w.tag_probe(self._recv_tag, remove=True)
            if probe.matched:
                break
            self._live().raise_on_error()  # after the probe: a message that came before a failure still counts
            await core.progressed(POLL_IDLE_S)
        done = core.wait(w.tag_recv_with_handle(arr, probe), arr, POLL_GPU_S if arr.cuda else POLL_SEND_S)
        if probe.length == arr.nbytes:
            await done
            return
        with contextlib.suppress(Exception):  # taken all the same (a longer one cut short), so UCX frees it
            await done
        raise ProtocolError(f"cudalink: a ucx peer sent {probe.length} bytes where {arr.nbytes} were due")

    async def _from_worker(self, arr: Any, delay: float) -> bool:
        w = self.core.worker
        probe = w.tag_probe(self._recv_tag, remove=True)
        if not probe.matched:
            return False
        await self.core.wait(w.tag_recv_with_handle(arr, probe), arr, delay)
        return True

    def abort(self) -> None:
        """Close at once (the peer sees its connection reset); awaited requests on it fail."""
        ep, self._ep = self._ep, None
        if ep is not None:
            self.core.close(ep)


def core_here() -> Core:
    """The running loop's :class:`Core`, made on first use. It hangs off the loop, so a loop that is closed
    and dropped (each ``asyncio.run``) takes its worker with it instead of leaking one per loop."""
    loop = asyncio.get_running_loop()
    core: Core | None = getattr(loop, "_cudalink_ucx_core", None)
    if core is None:
        core = Core(loop)
        loop._cudalink_ucx_core = core  # type: ignore[attr-defined]
    return core


# -- the consumer side's loop -------------------------------------------------------------------------------


class Engine:
    """A daemon thread running the asyncio loop UCX progresses on; coroutines are submitted to it."""

    core: Core

    def __init__(self) -> None:
        load()  # the error naming the extra, in the caller's thread
        self.loop = asyncio.new_event_loop()
        #: closings under way (a Receiver's goodbye and the freeing of its memory): waited for at exit
        self.closing: set[asyncio.Future[None]] = set()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="cudalink-ucx", daemon=True)
        self.thread.start()
        ready.result(30.0)
        # registered after the CUDA packages' own handlers (a Receiver comes after them): runs before them
        atexit.register(self.stop)

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the loop and its thread: at interpreter exit, before CUDA is torn down. A daemon thread would
        go on progressing UCX meanwhile, and a message landing in a GPU buffer after CUDA's teardown
        aborted the process (UCX 1.21 "Fatal: mem type unpack failed", H200, 2026-11-26)."""
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            # a Receiver closed just before exit is still saying goodbye and freeing its memory: let it finish
            # (bounded), else its tasks die pending and its GPU memory outlives CUDA
            async def closed() -> None:
                if self.closing:
                    await asyncio.wait(list(self.closing), timeout=timeout)

            async def shutdown() -> None:
                self.core.shutdown()

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(closed(), self.loop).result(timeout + 0.5)
            with contextlib.suppress(Exception):  # UCX's CUDA resources go on this thread: see Core.shutdown
                asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout + 2.0)
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.core = core_here()

        try:
            self.loop.run_until_complete(start())
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, orphan: Callable[[T], object] | None = None) -> T:
        """Run ``coro`` on the engine's loop and wait for it (never call this from the loop itself).

        Where we stop waiting (the time is up, or an exception in this thread) it is cancelled, and whatever
        it makes all the same (it was finishing as we gave up, or did not heed the cancel) goes to ``orphan``:
        a connection nobody will use must still be closed. A lock decides which side has it."""
        gate = threading.Lock()
        state = {"abandoned": False, "delivered": False}

        async def guarded() -> T:
            made = await coro
            with gate:
                if not state["abandoned"]:
                    state["delivered"] = True
                    return made
            if orphan is not None:
                with contextlib.suppress(Exception):
                    orphan(made)
            return made

        fut = self.submit(guarded())
        try:
            return fut.result(timeout)
        except BaseException as exc:
            with gate:
                state["abandoned"] = True
                delivered = state["delivered"]
            if not delivered:
                fut.cancel()
            elif orphan is not None:  # made, on its way to us: nobody takes it now
                with contextlib.suppress(Exception):
                    orphan(fut.result(5.0))
            if isinstance(exc, concurrent.futures.TimeoutError):
                raise TimeoutError(f"cudalink: ucx operation took over {timeout:.1f}s") from None
            raise

    def call_soon(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone at interpreter exit
            self.loop.call_soon_threadsafe(fn, *args)


_engine: Engine | None = None


def engine() -> Engine:
    global _engine
    with _lock:
        if _engine is None:
            _engine = Engine()
        return _engine


# -- one message at a time ----------------------------------------------------------------------------------


async def recv_msg(ep: Any, buf: bytearray, timeout: float | None) -> bytearray:
    """Receive one message into ``buf`` (its first ``MSG_SIZE`` bytes zeroed first: a short message then
    lacks its trailer). ``buf`` is ``MSG_SIZE`` bytes, or more where a FRAME may carry its pixels inline.

    A longer message is a :class:`ProtocolError` (UCX reports it truncated); a dead peer raises what UCX
    raises (``ConnectionError``-like UCXX errors), which the callers treat as EOF.
    """
    buf[: ucx_wire.MSG_SIZE] = bytes(ucx_wire.MSG_SIZE)
    try:
        if timeout is None:
            await ep.recv(buf)
        else:
            await asyncio.wait_for(ep.recv(buf), timeout)
    except Exception as exc:
        if truncated(exc):
            raise ProtocolError(f"cudalink: a ucx peer sent a message of the wrong size ({exc})") from exc
        raise
    return buf
