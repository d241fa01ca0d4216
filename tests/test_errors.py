"""Structured errors: code branches on attributes (a reason, a CUresult), never on message text."""

from __future__ import annotations

import pickle

import pytest

import cudalink


def test_a_failed_driver_call_is_a_cuda_error_carrying_its_cuResult() -> None:
    pytest.importorskip("cuda.bindings")
    from cudalink.cuda import driver

    with pytest.raises(cudalink.CudaError, match=r"^cudalink: cuSomething failed with ") as info:
        driver.check((2, None), "cuSomething")  # CUDA_ERROR_OUT_OF_MEMORY's code
    err = info.value
    assert isinstance(err, cudalink.LinkError) and err.result == 2 and err.name in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.result, again.name, str(again)) == (err.result, err.name, str(err))
    assert driver.check((0, "value"), "cuFine") == "value"


def test_translations_keep_the_original_error_as_their_cause() -> None:
    from cudalink.frames.spec import _pixel_format

    with pytest.raises(cudalink.FormatError) as info:
        _pixel_format("NOPE")
    assert isinstance(info.value.__cause__, KeyError)
