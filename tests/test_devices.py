"""GPUs named by UUID, and clear errors for a GPU that is not there: on a faked device list (no GPU)."""

from __future__ import annotations

import pytest

from cudalink.cuda import devices
from cudalink.errors import CudaUnavailable, LinkError

A = bytes(range(16))
B = bytes(range(16, 32))
TWO = [(0, A), (1, B)]


def test_uuids_read_as_nvidia_smi_spells_them() -> None:
    assert devices.format_uuid(A) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_the_producers_gpu_is_found_by_uuid_whatever_its_ordinal_here() -> None:
    assert devices.ordinal_of(B, TWO) == 1
    assert devices.ordinal_of(B, [(0, B), (1, A)]) == 0  # CUDA_VISIBLE_DEVICES=1,0
    assert devices.ordinal_of(A, [(0, B)]) is None  # CUDA_VISIBLE_DEVICES=1: hidden


def test_a_hidden_producer_gpu_is_named_with_the_visible_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    msg = devices.missing_gpu(A, [(0, B)])
    assert devices.format_uuid(A) in msg and "cuda:0 " + devices.format_uuid(B) in msg
    assert "CUDA_VISIBLE_DEVICES='1'" in msg and "device=N" in msg


def test_an_ordinal_that_is_not_there_names_the_gpus_that_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices.check_ordinal(1, TWO)
    with pytest.raises(CudaUnavailable, match=r"no cuda:2 here; this process sees 2 GPU\(s\): cuda:0 GPU-0001") as e:
        devices.check_ordinal(2, TWO)
    assert "cuda:1 GPU-1011" in str(e.value) and "unset" in str(e.value)
    with pytest.raises(CudaUnavailable, match=r"no cuda:0 here: .*(driver|GPU).*device='cpu'"):
        devices.check_ordinal(0, [])  # none at all: why (no driver, none seen), not "pass one of: none"
    assert isinstance(e.value, LinkError)


def test_without_a_driver_no_gpus_are_visible() -> None:
    if devices.count():
        pytest.skip("this machine has a GPU")
    assert devices.visible() == []
    assert devices.describe_visible() == "none"


def test_info_lists_uuids_handle_kinds_and_the_peer_matrix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cudalink.tools import info

    fake: info.Info = {
        "cudalink": "x",
        "python": "3",
        "platform": "Linux",
        "packages": {"cuda-core": "1", "cuda-bindings": "13", "numpy": "2"},
        "driver": {"cuda": "13.0", "kernel": "580"},
        "core": {"ring": "compiled"},
        "gpus": [
            {
                "ordinal": i,
                "name": "H100",
                "uuid": u,
                "compute_capability": "9.0",
                "ipc": {"memory_pools_supported": True, "handle_type_posix_file_descriptor_supported": True},
                "handles": {"pool": True, "legacy": True},
            }
            for i, u in enumerate(("11111111-2222-3333-4444-555555555555", "GPU-aaaa"))
        ],
        "peer": [[True, False], [True, True]],
        "visible_devices": "1,0",
        "shm": {"path": "/dev/shm", "total": 1 << 30, "free": 1 << 30},
        "runtime_dir": "/run",
        "ucx": {"usable": True, "ucxx": "0.52", "ucx": "1.21.0", "transports": ["cuda_copy", "cuda_ipc", "tcp"]},
    }
    monkeypatch.setattr(info, "gather_info", lambda: fake)
    monkeypatch.setenv("COLUMNS", "400")
    info.cmd_info(None)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "GPU-11111111-2222-3333-4444-555555555555" in out and "GPU-aaaa" in out
    assert "handles: pool, legacy" in out and "1,0" in out
    assert "0→1 no · 1→0 yes" in out
    assert "device=N" in out and "stages through host memory" in out and "stats()['path']" in out
    assert "GPU frames: on this host as GPU memory (cuda_ipc); to other hosts staged through host memory" in out


def test_bench_multi_gpu_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    from cudalink.tools.cli import main

    if devices.count() >= 2:
        pytest.skip("this machine has two GPUs")
    assert main(["bench", "--multi-gpu"]) == 1
    assert "needs two GPUs" in capsys.readouterr().err


def test_bench_multi_gpu_report_prints_rows_and_goals(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cudalink.tools import multigpu_bench

    monkeypatch.setenv("COLUMNS", "300")
    row = {"p50": 100.0, "p99": 200.0, "mean": 1.0, "n": 5.0}
    multigpu_bench.print_report(
        {
            "shape": [1080, 1920, 4],
            "dtype": "float32",
            "nbytes": 33177600,
            "rows": {
                "gpu0": {"device": 0, "path": "zero-copy", "handoff": row, "ready": row},
                "gpu1": {"device": 1, "path": "peer", "handoff": row, "ready": row},
                "bandwidth": {
                    "copy_path": "peer",
                    "torch_to_us": 100.0,
                    "torch_to_gbps": 331.0,
                    "landing_us": 101.0,
                    "landing_gbps": 328.0,
                    "landing_local_gbps": 330.0,
                },
            },
            "goals": {"copy_bandwidth_vs_torch_to": {"value": 0.99, "goal": ">= 0.8", "met": True}},
        }
    )
    out = capsys.readouterr().out
    assert "zero-copy" in out and "peer" in out and "328.0" in out and "0.99x" in out
