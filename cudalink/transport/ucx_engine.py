"""UCXX in one place: the import (with the error naming the extra), the shared key, and the one event loop
a process runs UCX on.

UCXX's asyncio API binds its progress to the loop that called ``ucxx.init``, so a process has exactly one:
the server's main loop, or a daemon thread's loop in a consumer (:func:`engine`), which all its remote
Receivers share. The progress mode is chosen on purpose: ``"thread"`` with Python futures. Measured on a
2-core VM (TCP loopback, 2026-11-25): in ``"blocking"`` mode an awaited request is polled with
``asyncio.sleep(0)`` until it completes, and a connection always has a receive pending, so an idle
consumer and its server each kept ~45% of a core busy (and the ready-to-run loop delayed the other
processes: 64x64x4 handoff p99 5-12 ms); ``"thread"`` with futures sleeps while idle (0.05 s of CPU in
4 s) and gave p50 0.7 ms / p99 1.0 ms. ``CUDALINK_UCX_PROGRESS`` picks another mode for measurements.
"""

from __future__ import annotations

import asyncio
import binascii
import concurrent.futures
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

from ..errors import LinkError
from . import ucx_wire

T = TypeVar("T")

INSTALL_HINT = 'pip install "cudalink[ucx]" (Linux, Python 3.11+)'
#: a peer silent this long is gone (each side sends a PING every PING_S while idle): a pulled cable sends no
#: reset, and a consumer that vanished must give its leases back within a second. A consumer whose process
#: holds the GIL that long (``import torch`` after connecting) sends no PING either: the server drops it with
#: a goodbye that says so, and its next ``recv()`` reconnects.
DEAD_AFTER_S = float(os.environ.get("CUDALINK_UCX_DEAD_S", "0.9"))
PING_S = DEAD_AFTER_S / 4
HANDSHAKE_S = 3.0
#: UCXX's progress mode (``CUDALINK_UCX_PROGRESS`` overrides; see the module's docstring)
PROGRESS = "thread"

_lock = threading.Lock()
_ucxx: ModuleType | None = None


def load() -> ModuleType:
    """``import ucxx``, or a LinkError that names the extra to install."""
    global _ucxx
    if _ucxx is not None:
        return _ucxx
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables this UCX build does not know
    try:
        import ucxx
    except ImportError as exc:
        raise LinkError(
            f"cudalink: ucx:// addresses need UCXX, which is not installed ({exc}); {INSTALL_HINT}"
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


def init_here(ucxx: ModuleType) -> None:
    """``ucxx.init`` on the running loop (once per process)."""
    mode = os.environ.get("CUDALINK_UCX_PROGRESS", PROGRESS)
    try:
        # a request awaited without a Python future is polled (``asyncio.sleep(0)`` in a loop): a pending
        # receive would keep a core busy; the thread modes complete requests through real futures
        ucxx.init(progress_mode=mode, enable_python_future=mode.startswith("thread"))
    except RuntimeError:
        pass  # already initiated in this process (the server and a relay may share one)


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
            return sorted(ucxx.get_active_transports())

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


def stage_on_host(consumer_gpu: bool, same_host: bool, rdma: bool, mode: str = "auto") -> bool:
    """Whether a server sends a GPU frame as host bytes: always for a consumer landing on the host; across
    hosts unless UCX has an RDMA transport; on one host never (UCX's ``cuda_ipc`` moves GPU memory there).
    ``mode`` (``CUDALINK_UCX_STAGE``) forces ``host`` or ``gpu``."""
    if mode == "host" or not consumer_gpu:
        return True
    if mode == "gpu":
        return False
    return not same_host and not rdma


# -- Sender(serve=...) -----------------------------------------------------------------------------------------


def check_listen(listen: str) -> None:
    """Fail in the producer, before it allocates anything, on a bad address or a missing extra."""
    import importlib.util

    ucx_wire.parse_address(listen, need_name=False)
    if importlib.util.find_spec("ucxx") is None:
        raise LinkError(f"cudalink: serve={listen!r} needs UCXX, which is not installed; {INSTALL_HINT}")


def free_port() -> int:
    """A TCP port no socket of this host holds now, on any address: UCXX's listener binds every interface
    whatever host it is given, so a port free on 127.0.0.1 alone may still be taken on another address
    (by an outgoing connection's local port, say). For tests and benches that pick their own port."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def spawn_server(name: str, listen: str) -> subprocess.Popen[bytes]:
    """``python -m cudalink serve NAME --listen ADDR`` as a child that exits when this process does."""
    cmd = [sys.executable, "-m", "cudalink", "serve", name, "--listen", listen, "--parent", str(os.getpid())]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


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
        with open(path) as f:
            return _decode(f.read(), path), None
    except FileNotFoundError:
        if not create:
            raise LinkError(
                f"cudalink: no ucx key: set CUDALINK_KEY, or copy the server's key file to {path} "
                "(`python -m cudalink serve` prints the command)"
            ) from None
    key = secrets.token_bytes(ucx_wire.KEY_SIZE)
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key, path


# -- the consumer side's loop -------------------------------------------------------------------------------


class Engine:
    """A daemon thread running the asyncio loop UCX progresses on; coroutines are submitted to it."""

    def __init__(self) -> None:
        self.ucxx = load()
        self.loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="cudalink-ucx", daemon=True)
        self.thread.start()
        ready.result(30.0)

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            init_here(self.ucxx)

        try:
            self.loop.run_until_complete(start())
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the engine's loop and wait for it (never call this from the loop itself)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"cudalink: ucx operation took over {timeout:.1f}s") from None

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
        if "runcat" in type(exc).__name__ or "runcat" in str(exc):  # UCXXMessageTruncatedError
            from ..errors import ProtocolError

            raise ProtocolError(f"cudalink: a ucx peer sent a message of the wrong size ({exc})") from exc
        raise
    return buf
