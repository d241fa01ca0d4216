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
    with pytest.raises(CudaUnavailable, match=r"sees 0 GPU.*none"):
        devices.check_ordinal(0, [])
    assert isinstance(e.value, LinkError)


def test_without_a_driver_no_gpus_are_visible() -> None:
    if devices.count():
        pytest.skip("this machine has a GPU")
    assert devices.visible() == []
    assert devices.describe_visible() == "none"
