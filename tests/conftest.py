"""Shared fixtures: unique link names, the GPU gate, and spawn-only process helpers."""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import cudalink
from cudalink.transport import MemoryTransport
from cudalink.transport.base import Transport

#: what the ``pair`` fixture returns: ``pair(transport=None, rx=None, **sender_kw) -> (tx, rx)``
PairFactory = Callable[..., tuple[cudalink.Sender, cudalink.Receiver]]

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
    in-process transport unless ``transport=`` names another.
    """
    made: list[Any] = []

    def make(transport: Transport | None = None, rx: dict[str, Any] | None = None, **kw: Any) -> Any:
        tr = transport if transport is not None else MemoryTransport()
        kw.setdefault("shape", (4, 4))
        kw.setdefault("dtype", "uint16")
        tx = cudalink.Sender(name, transport=tr, **kw)
        made.append(tx)
        r = cudalink.Receiver(name, transport=tr, **{"timeout": 2.0, **(rx or {})})
        made.append(r)
        return tx, r

    yield make
    for obj in reversed(made):
        obj.close()


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
