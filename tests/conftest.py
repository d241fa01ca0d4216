"""Shared fixtures: unique link names, a sender/receiver pair, spawned processes, and the GPU gate."""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import pytest

import cudalink
from cudalink.transport import MemoryTransport
from cudalink.transport.base import Transport

#: SIGKILL where it exists; Windows has none (os.kill with SIGTERM is TerminateProcess there)
SIGKILL = getattr(signal, "SIGKILL", signal.SIGTERM)

#: what the ``pair`` fixture returns: ``pair(transport=None, rx=None, **sender_kw) -> (tx, rx)``
PairFactory = Callable[..., tuple[cudalink.Sender, cudalink.Receiver]]

#: ``pair("default", ...)``: both ends on the library's default transport (shared memory), as an application gets
DEFAULT: Literal["default"] = "default"

_counter = itertools.count()


@pytest.fixture
def name() -> str:
    """A link name no other test (or earlier run) uses."""
    return f"t{os.getpid()}-{next(_counter)}"


@pytest.fixture
def pair(name: str) -> Iterator[PairFactory]:
    """A Sender and an attached Receiver on ``name``; both are closed when the test ends.

    ``pair(shape=(4,), dtype="uint8", slots=2, rx={"latest": False})``: Sender keywords as given (shape
    (4, 4) uint16 by default), Receiver keywords in ``rx`` (a 2 s timeout by default), and the
    in-process transport unless ``transport=`` names another (:data:`DEFAULT`: the library's own default,
    shared memory). The Receiver is made right after the Sender; closing either early is fine.
    """
    made: list[Any] = []

    def make(
        transport: Transport | Literal["default"] | None = None, rx: dict[str, Any] | None = None, **kw: Any
    ) -> Any:
        tr: dict[str, Any] = {}
        if transport != DEFAULT:
            tr["transport"] = transport if transport is not None else MemoryTransport()
        kw.setdefault("shape", (4, 4))
        kw.setdefault("dtype", "uint16")
        tx = cudalink.Sender(name, **tr, **kw)
        made.append(tx)
        r = cudalink.Receiver(name, **tr, **{"timeout": 2.0, **(rx or {})})
        made.append(r)
        return tx, r

    yield make
    for obj in reversed(made):
        obj.close()


def close_while_waiting(rx: cudalink.Receiver, after: float = 0.3, join: float = 5.0) -> dict[str, Any]:
    """Start ``rx.recv()`` on a thread, ``rx.close()`` here ``after`` seconds later: what that recv did.

    Keys: ``error`` (what it raised) or ``frame``, ``took`` (seconds in recv), ``stuck`` (still in recv
    ``join`` seconds after the close)."""
    got: dict[str, Any] = {}

    def worker() -> None:
        t0 = time.monotonic()
        try:
            got["frame"] = rx.recv()
        except cudalink.LinkError as exc:
            got["error"] = exc
        got["took"] = time.monotonic() - t0

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    time.sleep(after)  # asleep (or spinning) in recv by now
    rx.close()
    t.join(join)
    got["stuck"] = t.is_alive()
    return got


def need_gpus(n: int) -> Any:
    """torch, or a skip naming how many GPUs this machine has when it has fewer than ``n``."""
    torch = pytest.importorskip("torch")
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs; this machine has {have}")
    return torch


def _traced(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A spawned child's entry: a crash prints its Python stack, and SIGUSR1 (sent at teardown to a child that
    overran its test) prints every thread's, so a hang in a child names its line."""
    import faulthandler

    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    target(*args, **kwargs)


class Spawned:
    """Processes started for one test: spawned (never forked), tracked, and none outlives the test.

    ``spawned(fn, *args, **kwargs)`` starts ``fn`` in a daemon process and returns it;
    ``spawned.ready(fn, *args, **kwargs)`` also passes ``ready=`` (an Event) and returns once the child set
    it, failing at once if the child died first. ``forever=True`` marks a process that never ends by
    itself: teardown kills it at once, where it gives the others ``grace_s`` in all to finish first.
    Teardown kills (SIGKILL) whatever is still alive and warns about the ones that were not ``forever``.
    """

    def __init__(self, ctx: mp.context.SpawnContext, grace_s: float = 15.0) -> None:
        self.ctx = ctx
        self.grace_s = grace_s
        self._procs: list[tuple[BaseProcess, bool]] = []

    def __call__(self, target: Callable[..., Any], *args: Any, forever: bool = False, **kwargs: Any) -> BaseProcess:
        p = self.ctx.Process(target=_traced, args=(target, args, kwargs), name=target.__name__, daemon=True)
        p.start()
        self._procs.append((p, forever))
        return p

    def ready(
        self, target: Callable[..., Any], *args: Any, forever: bool = False, timeout: float = 60.0, **kwargs: Any
    ) -> BaseProcess:
        """Start ``target(*args, ready=Event, **kwargs)`` and wait until it sets ``ready``."""
        ready = self.ctx.Event()
        p = self(target, *args, forever=forever, ready=ready, **kwargs)
        end = time.monotonic() + timeout
        while not ready.wait(0.1):
            if not p.is_alive() and not ready.is_set():
                pytest.fail(f"{target.__name__} exited with code {p.exitcode} before it was ready")
            if time.monotonic() > end:
                pytest.fail(f"{target.__name__} was not ready within {timeout} s")
        return p

    def event(self) -> Any:
        return self.ctx.Event()

    def queue(self) -> Any:
        return self.ctx.Queue()

    def kill(self, p: BaseProcess, timeout: float = 10.0) -> None:
        """SIGKILL ``p`` (no cleanup runs in it; TerminateProcess on Windows) and reap it."""
        if p.pid is not None and p.exitcode is None:
            p.kill()
        p.join(timeout)

    def close(self) -> None:
        end = time.monotonic() + self.grace_s
        for p, forever in self._procs:
            if not forever:
                p.join(max(0.0, end - time.monotonic()))
        for p, forever in self._procs:
            if p.is_alive():
                if not forever:
                    if hasattr(signal, "SIGUSR1") and p.pid is not None:
                        with contextlib.suppress(OSError):
                            os.kill(p.pid, signal.SIGUSR1)  # its stacks, on stderr, before it goes
                        p.join(1.0)
                    warnings.warn(f"{p.name} still ran when its test ended: killed", stacklevel=1)
                p.kill()
                p.join(10)
        self._procs.clear()


@pytest.fixture
def spawned(ctx: mp.context.SpawnContext) -> Iterator[Spawned]:
    """Start processes for this test (spawn only); teardown joins them briefly and kills what is left."""
    procs = Spawned(ctx)
    try:
        yield procs
    finally:
        procs.close()


def header_bytes(name: str) -> bytes:
    """A snapshot of a link's header, read as any monitor would (public: ``header_segment``, ``map_readonly``)."""
    from cudalink.transport import shm

    buf, let_go = shm.map_readonly(shm.header_segment(name))
    try:
        return bytes(buf)
    finally:
        del buf
        let_go()


@functools.lru_cache(maxsize=1)
def gpu_reason() -> str | None:
    """None when a CUDA GPU with IPC pools is usable here, else why not."""
    try:
        from cudalink.cuda import devices

        dev = devices.device(0)
        missing = [k for k, v in devices.ipc_support(dev).items() if not v]
        if missing:
            return f"GPU lacks {missing}"
    except Exception as exc:
        return f"no usable GPU: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    reason = gpu_reason()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def ctx() -> mp.context.SpawnContext:
    """Processes are spawned, never forked: forking after CUDA init is undefined."""
    return mp.get_context("spawn")


@pytest.fixture(params=["unix", "tcp"])
def control(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test over each control channel: the Unix socket, and the loopback TCP one Windows uses.

    Spawned children inherit the variable, so producers and consumers in other processes follow it.
    """
    monkeypatch.setenv("CUDALINK_CONTROL", request.param)
    return str(request.param)
