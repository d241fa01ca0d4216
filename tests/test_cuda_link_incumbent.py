"""cudalink against the incumbent itself (forkni/cuda-link's Python exporter and importer) on Linux, both
directions. Optional: runs where its package imports (installed, or its checkout's ``src`` folder named by
``CUDA_LINK_SRC``), with its CUDA runtime loaded from libcudart (it looks only for Windows DLLs)::

    git -C <mirror of forkni/cuda-link> archive HEAD src | tar -x -C /tmp/cuda-link
    CUDA_LINK_SRC=/tmp/cuda-link/src python -m pytest -m gpu tests/test_cuda_link_incumbent.py
"""

from __future__ import annotations

import importlib.util
import os
import uuid

import pytest

from . import _cuda_link_gpu_procs as clp
from .conftest import Spawned

SRC = os.environ.get("CUDA_LINK_SRC") or None
SHAPE = (48, 64, 4)


def _have_incumbent() -> bool:
    if SRC:
        return os.path.isdir(os.path.join(SRC, "cuda_link"))
    return importlib.util.find_spec("cuda_link") is not None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _have_incumbent(), reason="cuda-link (the incumbent) is not importable; set CUDA_LINK_SRC"),
]


@pytest.fixture
def name() -> str:
    return f"cudalink_ipc_TD>>Python_{uuid.uuid4().hex[:8]}"


def test_incumbent_exporter_to_our_reader(spawned: Spawned, name: str) -> None:
    pytest.importorskip("torch")
    ctx = spawned.ctx
    q, qe, started, go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    spawned(clp.cl_consumer, name, "torch", q, started)
    spawned(clp.incumbent_exporter, name, 300, SHAPE, go, SRC, qe)
    assert started.wait(180)
    go.set()
    _, got, mism, stale, gens, stats, ended, err = q.get(timeout=240)
    assert qe.get(timeout=120) == ""
    assert err == "", err
    assert got > 10 and mism == 0 and stale == 0 and gens == 1 and ended == "gone", (got, mism, stale, gens, stats)


def test_our_writer_to_incumbent_importer(spawned: Spawned, name: str) -> None:
    pytest.importorskip("torch")
    ctx = spawned.ctx
    q, started, go = ctx.Queue(), ctx.Event(), ctx.Event()
    spawned(clp.incumbent_importer, name, started, SRC, q)
    spawned(clp.cl_uniform_producer, name, 300, SHAPE, go)
    assert started.wait(180)
    go.set()
    got, torn, distinct, shape, dtype, err = q.get(timeout=240)
    assert err == "", err
    assert got > 10 and torn == 0 and distinct > 10, (got, torn, distinct)
    assert shape == SHAPE and "uint8" in dtype
