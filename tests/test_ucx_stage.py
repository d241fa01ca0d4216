"""Which bytes a ucx:// server sends for a GPU frame (GPU memory as is, or host bytes), and the host id the
decision rests on. The data paths themselves run in ``tests/test_ucx_gpu.py`` (GPU)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import cudalink
from cudalink import _platform
from cudalink.transport import ucx_engine


@pytest.mark.parametrize(
    ("gpu", "same_host", "rdma", "ipc", "mode", "staged"),
    [
        (True, True, False, True, "auto", False),  # one host: cuda_ipc moves GPU memory
        (True, True, False, False, "auto", True),  # one host, no cuda_ipc (UCX_TLS=tcp,cuda_copy): UCX's staging
        (True, True, True, False, "auto", True),  # RDMA does not decide on one host: cuda_ipc does
        (True, False, False, True, "auto", True),  # across hosts on TCP: UCX's own GPU staging is slow
        (True, False, True, False, "auto", False),  # across hosts with RDMA: GPU memory as is (GPUDirect)
        (False, True, False, True, "auto", True),  # a consumer landing on the host (or with no GPU path)
        (False, False, True, True, "gpu", True),
        (True, True, True, True, "host", True),
        (True, False, False, False, "gpu", False),
    ],
)
def test_stage_on_host(gpu: bool, same_host: bool, rdma: bool, ipc: bool, mode: str, staged: bool) -> None:
    assert ucx_engine.stage_on_host(gpu, same_host, rdma, mode, ipc) is staged


@pytest.mark.parametrize(
    ("transports", "mode", "as_is"),
    [
        ({"tcp", "cuda_copy", "cuda_ipc", "posix"}, "auto", True),
        ({"tcp", "cuda_copy", "posix"}, "auto", False),  # UCX_TLS=tcp,cuda_copy: ask for host bytes
        ({"tcp", "rc_mlx5", "cuda_copy"}, "auto", True),  # GPUDirect RDMA
        ({"tcp", "posix"}, "gpu", True),  # forced either way
        ({"tcp", "cuda_ipc"}, "host", False),
    ],
)
def test_a_gpu_consumer_asks_for_gpu_memory_only_where_its_ucx_has_a_path(
    transports: set[str], mode: str, as_is: bool
) -> None:
    assert ucx_engine.gpu_as_is(transports, mode) is as_is


def test_rdma_transports_are_the_network_ones_beyond_tcp() -> None:
    assert not ucx_engine.rdma_transports({"posix", "tcp", "self", "sysv", "cma"})  # what a plain VM has
    assert not ucx_engine.rdma_transports(["tcp", "cuda_copy", "cuda_ipc", "gdr_copy"])
    assert ucx_engine.rdma_transports({"tcp", "rc_mlx5", "cuda_copy"})
    assert ucx_engine.rdma_transports({"dc_mlx5/mlx5_0:1"})


def test_info_says_how_gpu_frames_would_travel() -> None:
    assert ucx_engine.gpu_paths({"tcp", "cuda_copy", "cuda_ipc"}) == (
        "GPU frames: on this host as GPU memory (cuda_ipc); to other hosts staged through host memory (no RDMA)"
    )
    assert ucx_engine.gpu_paths(["tcp", "cuda_copy", "rc_mlx5"]) == (
        "GPU frames: on this host staged through host memory (no cuda_ipc); to other hosts as GPU memory (RDMA)"
    )


def test_host_id_is_the_boot_id(tmp_path: Path) -> None:
    boot = uuid.uuid4()
    f = tmp_path / "boot_id"
    f.write_text(f"{boot}\n")
    assert _platform.host_id(str(f)) == boot.bytes
    assert _platform.host_id() == _platform.host_id()  # stable within a boot


def test_host_id_without_a_boot_id_is_a_hash_of_the_host_name(tmp_path: Path) -> None:
    missing = _platform.host_id(str(tmp_path / "none"))
    garbage = tmp_path / "bad"
    garbage.write_text("not a uuid")
    assert len(missing) == 16 and missing == _platform.host_id(str(garbage))


def test_a_bad_stage_mode_is_refused_when_the_server_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudalink import ucx_server

    monkeypatch.setenv("CUDALINK_UCX_STAGE", "pcie")
    with pytest.raises(cudalink.LinkError, match="CUDALINK_UCX_STAGE='pcie'; use auto, host or gpu"):
        ucx_server.Server(0, os.urandom(32), "x")
    with pytest.raises(cudalink.LinkError, match="CUDALINK_UCX_STAGE='pcie'; use auto, host or gpu"):
        ucx_engine.stage_mode()  # what a consumer reads too
    with pytest.raises(cudalink.LinkError, match="CUDALINK_UCX_STAGE='pcie'; use auto, host or gpu"):
        cudalink.Receiver("ucx://127.0.0.1:9/x", timeout=0.1)  # when it is made, before it connects


def test_a_pending_gpu_marker_is_looked_at_every_loop_turn_then_every_millisecond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server's GPU frame (and a consumer's landing) waits for a few µs of GPU work: the wait must not sleep
    asyncio's shortest real sleep, epoll's millisecond (``asyncio.sleep(0.0001)`` took 1.1 ms, on every GPU
    frame). Loop turns while the wait is short, millisecond sleeps once it is long, and sleeps from the start
    where this process's waits have lately run long (turns would keep a core busy for nothing); the marker
    is forgotten either way. No GPU: the driver calls are stood in for."""
    import asyncio

    from cudalink.cuda import ucx as cuda_ucx

    now = [0.0]
    looks: list[float] = []
    asked: list[float] = []
    forgot: list[object] = []
    real_sleep = asyncio.sleep

    def done(marker: object) -> bool:
        looks.append(now[0])
        return len(looks) > 40

    async def sleep(delay: float) -> None:
        asked.append(delay)
        now[0] += 0.0002  # each look costs a fifth of a millisecond of (fake) loop time
        await real_sleep(0)

    monkeypatch.setattr(cuda_ucx, "done", done)
    monkeypatch.setattr(cuda_ucx, "_recent_s", 0.0)  # this process's waits were short so far
    monkeypatch.setattr(cuda_ucx, "forget", forgot.append)
    monkeypatch.setattr(cuda_ucx.asyncio, "sleep", sleep)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "time", lambda: now[0])
        await cuda_ucx.passed(("marker", 1))

    asyncio.run(main())
    turns = next(i for i, d in enumerate(asked) if d != 0)  # loop turns before the first real sleep
    assert abs(turns - cuda_ucx.SPIN_S / 0.0002) <= 1, asked  # for SPIN_S of loop time
    assert set(asked[turns:]) == {cuda_ucx.POLL_S}, asked  # then sleeps (asked[turns] exists: see next())
    assert cuda_ucx.POLL_S >= 0.001  # asyncio rounds shorter sleeps up to this anyway: say so in the code
    assert forgot == [("marker", 1)]
    assert 0 < cuda_ucx._recent_s < cuda_ucx.SPIN_S  # learnt: about an eighth of the 7.8 ms this one took
    looks.clear()
    asked.clear()
    monkeypatch.setattr(cuda_ucx, "_recent_s", 2 * cuda_ucx.SPIN_S)  # waits have lately run long
    asyncio.run(main())
    assert asked and set(asked) == {cuda_ucx.POLL_S}, asked  # no core kept busy: sleeps from the start
    looks.clear()
    asked.clear()
    monkeypatch.setattr(cuda_ucx, "done", lambda m: True)
    asyncio.run(main())  # passed already: no sleep at all
    assert asked == [] and forgot[-1] == ("marker", 1) and len(forgot) == 3
