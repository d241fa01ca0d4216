"""Structured errors: code branches on attributes (a reason, a CUresult), never on message text."""

from __future__ import annotations

import contextlib
import math
import os
import pickle

import numpy as np
import pytest

import cudalink
from cudalink import _platform

from .conftest import DEFAULT, PairFactory


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


# -- constructor arguments: a cudalink error that is also the ValueError / TypeError Python users expect ------

_OK_TX: dict[str, object] = {"shape": (4, 4), "dtype": "uint8"}

SENDER_BAD = [
    # (argument overrides, expected class, words the message must hold)
    ({"name": "../x"}, ValueError, "invalid link name"),
    ({"name": "ucx://127.0.0.1:5000/cam"}, ValueError, "serve='ucx://HOST:PORT'"),  # an address is no name to publish
    ({"name": 7}, TypeError, "link name is a str"),
    ({"shape": None}, TypeError, "needs the frame shape"),
    ({"shape": (0, 4)}, ValueError, "dimension"),
    ({"shape": "4x4"}, ValueError, "shape must be"),
    ({"dtype": ">f4"}, ValueError, "not supported"),
    ({"dtype": object()}, ValueError, "not a dtype"),
    ({"dtype": None}, ValueError, "dtype None is not a dtype"),  # numpy would make it float64
    ({"slots": 0}, ValueError, "slots must be 1.."),
    ({"slots": 1000}, ValueError, "slots must be 1.."),
    ({"slots": "4"}, TypeError, "slots must be an integer"),
    ({"slots": 2.0}, TypeError, "slots must be an integer"),
    ({"max_consumers": 0}, ValueError, "max_consumers must be 1.."),
    ({"max_consumers": None}, TypeError, "max_consumers must be an integer"),
    ({"policy": "never"}, ValueError, "policy must be one of"),
    ({"policy": 1}, TypeError, "policy must be one of"),
    ({"timeout": -1}, ValueError, "timeout must be >= 0"),
    ({"timeout": "1"}, TypeError, "timeout must be a number"),
    ({"device": "gpu"}, ValueError, "device must be 'cpu'"),
    ({"device": -1}, ValueError, "device must be 'cpu'"),
    ({"device": 1.5}, TypeError, "device must be 'cpu'"),
    ({"handles": "ipc"}, ValueError, "handles must be one of"),
    ({"capacity": 3}, ValueError, "capacity 3 is smaller than one frame"),
    ({"capacity": "big"}, TypeError, "capacity must be an integer"),
    ({"capacity": 2**61}, ValueError, "capacity must be 0.."),  # overflowed shared_memory, leaving a segment
    ({"timeout": -(10**400)}, ValueError, "timeout must be >= 0"),  # past float's range: raw OverflowError
    ({"transport": "x"}, TypeError, "transport= takes an object with serve()"),
    ({"pixel_format": "NOPE"}, ValueError, "pixel"),
    ({"pixel_format": "RGBA", "shape": (4, 4, 3)}, ValueError, "channel"),
    ({"origin": "left"}, ValueError, "origin must be"),
    ({"strides": (1,)}, ValueError, "strides"),
    ({"protocol": "cudalnk"}, ValueError, "protocol must be"),
    ({"protocol": "cuda-link", "slots": 11}, ValueError, "1..10 slots"),
    ({"protocol": "cuda-link", "slots": "3"}, TypeError, "1..10 slots"),
    ({"protocol": "cuda-link", "policy": "block"}, ValueError, "policy='drop'"),
    ({"protocol": "cuda-link", "handles": "pool"}, ValueError, "legacy"),
    ({"protocol": "cuda-link", "device": "cpu"}, ValueError, "GPU memory only"),
]


@pytest.mark.parametrize(("bad", "kind", "words"), SENDER_BAD, ids=[repr(b) for b, _, _ in SENDER_BAD])
def test_every_bad_sender_argument_is_a_cudalink_error_python_users_can_catch(
    bad: dict[str, object], kind: type[Exception], words: str
) -> None:
    args = {"name": f"argtest-{os.getpid()}", **_OK_TX, **bad}
    name = args.pop("name")
    with pytest.raises(cudalink.LinkError) as info:
        cudalink.Sender(name, **args)  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, kind), (type(err).__mro__, err)
    assert str(err).startswith("cudalink: ") and words in str(err), str(err)
    assert not os.path.exists(_platform.lock_path(f"argtest-{os.getpid()}"))  # refused before anything was made


@pytest.mark.parametrize("name", ["cuda-link:cudalink_ipc_Python>>TD", "cuda-link:x", "cudalink_ipc_Python>>TD"])
def test_a_cuda_link_name_given_to_a_cudalink_sender_names_the_protocol_that_writes_it(name: str) -> None:
    """Sender('cuda-link:NAME', ...) without protocol='cuda-link' said the segment "is read as
    'cuda-link:cuda-link:NAME'" (a doubled prefix, and a reader's advice to a writer), and 'cuda-link:x' no way
    out at all."""
    seg = name.removeprefix("cuda-link:")
    with pytest.raises(cudalink.ArgumentError) as info:
        cudalink.Sender(name, **_OK_TX)  # type: ignore[arg-type]
    text = str(info.value)
    assert f"written by Sender({seg!r}, ..., protocol='cuda-link')" in text, text
    assert f"read as 'cuda-link:{seg}'" in text and "cuda-link:cuda-link:" not in text, text


RECEIVER_BAD = [
    ({"name": "a/b"}, ValueError, "invalid link name"),
    ({"name": "tcp://host:5000/cam"}, ValueError, "ucx://HOST:PORT/NAME"),  # an address of a kind we do not speak
    ({"name": "UCX://host:5000/cam"}, ValueError, "ucx://HOST:PORT/NAME"),
    ({"name": "cudalink_ipc_TD>>Python"}, ValueError, "read as 'cuda-link:cudalink_ipc_TD>>Python'"),
    ({"name": None}, TypeError, "link name is a str"),
    ({"wait": "sleep"}, ValueError, "wait must be one of"),
    ({"wait": 3}, TypeError, "wait must be one of"),
    ({"timeout": -0.5}, ValueError, "timeout must be >= 0"),
    ({"timeout": "5"}, TypeError, "timeout must be a number"),
    ({"spin_us": -1}, ValueError, "spin_us must be >= 0 microseconds"),
    ({"spin_us": "fast"}, TypeError, "spin_us must be a number of microseconds"),
    ({"device": "gpu"}, ValueError, "device must be 'cpu'"),
    ({"device": 0.5}, TypeError, "device must be 'cpu'"),
    ({"copy": "maybe"}, ValueError, "copy must be"),
    ({"latest": "no"}, TypeError, "latest must be True or False"),
    ({"latest": None}, TypeError, "latest must be True or False"),
    ({"wake_ahead": "off"}, TypeError, "wake_ahead must be True or False"),
    ({"connect": "no"}, TypeError, "connect must be True or False"),  # a truthy word: it connected
    ({"source": "x"}, TypeError, "source= takes an object with attach()"),
    ({"transport": 3}, TypeError, "transport= takes an object with serve()"),
]


@pytest.mark.parametrize(("bad", "kind", "words"), RECEIVER_BAD, ids=[repr(b) for b, _, _ in RECEIVER_BAD])
def test_every_bad_receiver_argument_is_a_cudalink_error_python_users_can_catch(
    bad: dict[str, object], kind: type[Exception], words: str
) -> None:
    args: dict[str, object] = {"name": f"argtest-rx-{os.getpid()}", "connect": False, **bad}
    name = args.pop("name")
    with pytest.raises(cudalink.LinkError) as info:
        cudalink.Receiver(name, **args)  # type: ignore[arg-type]
    assert isinstance(info.value, kind), (type(info.value).__mro__, info.value)
    assert str(info.value).startswith("cudalink: ") and words in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("timeout", "kind", "words"),
    [
        ("x", TypeError, "timeout must be a number"),
        (-1, ValueError, "timeout must be >= 0"),
        (float("nan"), ValueError, ">= 0"),
    ],
)
def test_a_bad_close_timeout_is_refused_and_none_waits_without_limit(timeout: object, kind: type, words: str) -> None:
    """close(timeout=None) raised a raw TypeError (and closed all the same); -1 and NaN passed unseen."""
    tx = cudalink.Sender(f"argtest-close-{os.getpid()}", device="cpu", **_OK_TX)  # type: ignore[arg-type]
    with pytest.raises(cudalink.LinkError) as info:
        tx.close(timeout=timeout)  # type: ignore[arg-type]
    assert isinstance(info.value, kind) and str(info.value).startswith("cudalink: ") and words in str(info.value)
    assert not tx.closed  # refused before anything was done
    tx.close(timeout=None)  # no consumer: returns at once
    assert tx.closed


def test_a_link_made_without_a_name_is_a_cudalink_argument_error() -> None:
    """``Sender()`` and ``Receiver()`` raised Python's bare "missing 1 required positional argument", which an
    ``except cudalink.LinkError`` lets through; the README promises ArgumentTypeError for a missing argument."""
    for make in (lambda: cudalink.Sender(shape=(4, 4)), lambda: cudalink.Receiver(connect=False)):  # type: ignore[call-arg]
        with pytest.raises(cudalink.ArgumentTypeError, match=r"^cudalink: (Sender|Receiver) needs a link name"):
            make()


def test_arguments_given_by_position_after_the_name_are_a_cudalink_argument_error() -> None:
    """``Sender("cam0", (480, 640, 3))`` raised Python's bare "takes from 1 to 2 positional arguments but 3 were
    given", which an ``except cudalink.LinkError`` lets through; it now says to pass them by keyword."""
    cases = [
        (lambda: cudalink.Sender("x", (4, 4)), r"Sender takes only the link name by position, and got 1 more"),  # type: ignore[misc]
        (lambda: cudalink.Sender("x", (4, 4), "uint8", protocol="cuda-link"), r"Sender takes only .*2 more"),  # type: ignore[misc]
        (lambda: cudalink.Receiver("x", 1.0), r"Receiver takes only the link name .*Receiver\('cam0', timeout="),  # type: ignore[misc]
    ]
    for make, words in cases:
        with pytest.raises(cudalink.ArgumentTypeError, match=rf"^cudalink: {words}"):
            make()


def test_a_timeout_past_floats_range_is_no_limit() -> None:
    """``10**400`` seconds raised a raw OverflowError from every timeout argument; it is as long as inf."""
    from cudalink.errors import seconds_arg

    assert seconds_arg(10**400, "timeout", "timeout=1.0") == math.inf
    with cudalink.Sender(f"argtest-huge-{os.getpid()}", device="cpu", timeout=10**400, **_OK_TX) as tx:  # type: ignore[arg-type]
        assert tx.send(np.zeros((4, 4), np.uint8), timeout=10**400) == 1


@pytest.mark.parametrize(
    "thing",
    [None, b"\x00" * 16, "pixels", object(), np.zeros((4, 4), object), np.full((4, 4), "a"), np.zeros((4, 4), "V1")],
)
def test_sending_what_is_not_an_array_says_so(thing: object) -> None:
    """send(None) said "array is () object but the link carries (4, 4) uint8; call reconfigure(...)"."""
    with cudalink.Sender(f"argtest-send-{os.getpid()}", device="cpu", **_OK_TX) as tx:  # type: ignore[arg-type]
        with pytest.raises(
            cudalink.FormatError, match=r"^cudalink: [\w ]+ is not an array of pixels; pass a numpy"
        ) as info:
            tx.send(thing)
        assert "reconfigure" not in str(info.value)
        assert tx.stats()["published"] == 0


def _added_dtypes() -> list[object]:
    """Dtypes a package adds to numpy: ml_dtypes' where it is installed (jax brings it), and numpy's own test one."""
    from numpy._core._rational_tests import rational

    added: list[object] = [rational]
    with contextlib.suppress(ImportError):
        import ml_dtypes

        added += [ml_dtypes.float8_e4m3fn, ml_dtypes.int4]  # their bfloat16 is carried: test_bfloat16.py
    return added


@pytest.mark.parametrize("dtype", _added_dtypes(), ids=lambda d: np.dtype(d).name)  # type: ignore[arg-type]
def test_a_dtype_a_package_adds_is_refused_by_its_name_with_a_conversion(dtype: object) -> None:
    """float8 (ml_dtypes) is a "V" dtype to numpy: refused as "dtype <V1" and as "not an array of pixels; pass
    ... an array of numbers", which named neither the dtype nor the way out (convert, or send the bits)."""
    name = np.dtype(dtype).name  # type: ignore[call-overload]
    with pytest.raises(cudalink.FormatError, match=rf"^cudalink: dtype {name} is not supported; use a native"):
        cudalink.FrameSpec((4, 4), dtype)  # type: ignore[arg-type]
    with cudalink.Sender(f"argtest-added-{os.getpid()}", device="cpu", **_OK_TX) as tx:  # type: ignore[arg-type]
        for call in (tx.send, cudalink.Frame.from_array):
            with pytest.raises(cudalink.FormatError, match=rf"^cudalink: a numpy array of {name} has a dtype .*astype"):
                call(np.zeros((4, 4), dtype))  # type: ignore[call-overload]
        assert tx.stats()["published"] == 0


class _RefusingExporter:
    """A host array whose own DLPack export refuses, as a CPU torch tensor with ``requires_grad`` does."""

    def __dlpack__(self, **kw: object) -> object:
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _DatetimeExporter:
    """numpy's own exporter refusing a dtype DLPack has no code for."""

    a = np.zeros((4, 4), "M8[ns]")

    def __dlpack__(self, **kw: object) -> object:
        return self.a.__dlpack__(**kw)  # type: ignore[arg-type]

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _NoData:
    __array_interface__ = {"shape": (4, 4), "typestr": "|u1", "version": 3}


@pytest.mark.parametrize("thing", [_RefusingExporter(), _DatetimeExporter(), _NoData()], ids=lambda t: type(t).__name__)
def test_a_host_array_whose_own_export_fails_is_a_format_error_naming_it(thing: object) -> None:
    """The GPU path said "cudalink: cannot read X through DLPack/CAI"; a host array's failing export escaped
    raw (RuntimeError, BufferError, ValueError), from send() and Frame.from_array alike."""
    with cudalink.Sender(f"argtest-host-{os.getpid()}", device="cpu", **_OK_TX) as tx:  # type: ignore[arg-type]
        for call in (tx.send, cudalink.Frame.from_array):
            with pytest.raises(cudalink.FormatError, match=rf"^cudalink: cannot read {type(thing).__name__} through"):
                call(thing)
        assert tx.stats()["published"] == 0


def test_the_argument_errors_are_exported_and_pickle() -> None:
    for cls, base in ((cudalink.ArgumentError, ValueError), (cudalink.ArgumentTypeError, TypeError)):
        assert issubclass(cls, cudalink.LinkError) and issubclass(cls, base)
        again = pickle.loads(pickle.dumps(cls("cudalink: x")))
        assert type(again) is cls and str(again) == "cudalink: x"
    assert cudalink.Receiver("argtest-none", timeout=None, connect=False).timeout == float("inf")


def test_links_and_frames_refuse_pickling_with_the_fix(tmp_path: object) -> None:
    """``multiprocessing`` pickles what it hands a child: a link or a frame gets a cudalink error naming what to
    pass instead, not numpy's or struct's 'cannot pickle' from deep inside."""
    import multiprocessing

    import numpy as np

    name = f"pickle-{os.getpid()}"
    with cudalink.Sender(name, shape=(4, 4), dtype="uint8", device="cpu") as tx, cudalink.Receiver(name) as rx:
        tx.send(np.full((4, 4), 7, np.uint8))
        with rx.recv(timeout=5) as frame:
            for obj, words in ((tx, f"Sender({name!r}"), (rx, f"Receiver({name!r})"), (frame, "np.array(frame)")):
                with pytest.raises(cudalink.ArgumentTypeError, match="can't be pickled") as info:
                    pickle.dumps(obj)
                assert words in str(info.value), str(info.value)
            child = multiprocessing.get_context("spawn").Process(target=print, args=(rx,))
            with pytest.raises(cudalink.ArgumentTypeError, match="pass its name"):
                child.start()
            assert int(np.asarray(frame).sum()) == 7 * 16  # the refusal touched nothing


def test_a_send_of_the_right_shape_in_another_dtype_names_the_conversion(pair: PairFactory) -> None:
    """A Python list arrives as int64: the error only said to reconfigure the link, never to convert the data."""
    tx, _ = pair(DEFAULT, shape=(4, 4), dtype="uint16")
    with pytest.raises(cudalink.FormatError, match=r"np\.asarray\(x, dtype='uint16'\).*or call reconfigure"):
        tx.send([[1] * 4] * 4)
    with pytest.raises(cudalink.FormatError) as other_shape:
        tx.send(np.zeros((2, 2), np.uint16))
    assert "asarray" not in str(other_shape.value)  # another shape: converting would not help
    assert tx.stats()["published"] == 0


def test_a_stream_given_to_a_cpu_link_is_refused_and_takes_nothing(name: str) -> None:
    """``send(x, stream=s)`` / ``reserve(stream=s)`` on a CPU link were accepted and the stream ignored: a program
    that meant to make a CUDA link (and to order its copy after its kernel) never learnt that it had not."""
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
        for stream in (5, object()):
            with pytest.raises(cudalink.ArgumentError, match=r"stream=.*CPU frames.*device=0"):
                tx.send(np.zeros(4, np.uint8), stream=stream)
            with pytest.raises(cudalink.ArgumentError, match=r"stream=.*CPU frames.*device=0"):
                tx.reserve(stream=stream)
        assert tx.seq == 0  # nothing was taken
        assert tx.send(np.ones(4, np.uint8), stream=None) == 1
        with tx.reserve(stream=None) as frame:
            np.from_dlpack(frame)[:] = 2
        assert tx.seq == 2


def test_a_blocked_send_that_times_out_counts_as_dropped(name: str) -> None:
    """policy='block': a send (or reserve) that timed out waiting for a slot published nothing, like a drop, but
    ``stats()["dropped"]`` did not count it, so a monitor showed a lossless link that was losing frames."""
    with (
        cudalink.Sender(name, shape=(4,), dtype="uint8", slots=2, policy="block") as tx,
        cudalink.Receiver(name, latest=False, timeout=2.0) as rx,
    ):
        held = []
        for i in range(2):
            tx.send(np.full(4, i, np.uint8))
            held.append(rx.recv(timeout=2.0))
        with pytest.raises(cudalink.LinkTimeout, match="policy='block'"):
            tx.send(np.zeros(4, np.uint8), timeout=0.05)
        assert tx.stats()["dropped"] == 1
        with pytest.raises(cudalink.LinkTimeout):
            tx.reserve(timeout=0.05).__enter__()
        assert tx.stats() == {"published": 2, "dropped": 2, "consumers": 1}
        held.pop(0).release()
        assert tx.send(np.ones(4, np.uint8), timeout=1.0) == 3
        assert tx.stats()["dropped"] == 2
