"""bfloat16 frames: the dtype AI pipelines run in, carried as numpy knows it through ml_dtypes (as jax and cuda.core
do) and exported through DLPack's kDLBfloat, so torch and jax take them with no copy."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import sys
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import cudalink
from cudalink import _native
from cudalink.frames import spec as spec_mod
from cudalink.transport import cuda_link_wire as cw
from cudalink.transport import wire

from .conftest import DEFAULT, PairFactory, Spawned

BF16 = np.dtype(ml_dtypes.bfloat16)
_DL_BFLOAT = 4  # DLPack's kDLBfloat


def bits_of(seq: int, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """bfloat16 bits that differ for every seq, with the awkward values among them: NaN, infinities, -0, a
    subnormal. A copy through float32 or float16 would change some; a copy of the bytes changes none."""
    n = int(np.prod(shape))
    bits = ((np.arange(n, dtype=np.uint32) * 2654435761 + seq * 40503) & 0xFFFF).astype(np.uint16)
    bits[:5] = [0x7FC1, 0x7F80, 0xFF80, 0x8000, 0x0001]
    return bits.reshape(shape)


class _TorchDtype:
    """Stands in for a torch dtype object (``torch.bfloat16``): numpy reads none of them."""

    __module__ = "torch"

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


def test_bfloat16_is_named_every_way_a_user_writes_it() -> None:
    for said in ("bfloat16", ml_dtypes.bfloat16, BF16, _TorchDtype("bfloat16")):
        spec = cudalink.FrameSpec((2, 3, 4), said, pixel_format="RGBA")  # type: ignore[arg-type]
        assert spec.dtype == BF16 and spec.nbytes == 2 * 3 * 4 * 2 and spec.label == "RGBA bfloat16"
    assert cudalink.FrameSpec((2,), _TorchDtype("float16")).dtype == np.float16  # type: ignore[arg-type]
    assert "bfloat16" in cudalink.frames.SUPPORTED_DTYPES
    with pytest.raises(cudalink.FormatError, match=r"^cudalink: dtype float8_e4m3fn is not supported"):
        cudalink.FrameSpec((2,), ml_dtypes.float8_e4m3fn)
    with pytest.raises(cudalink.FormatError, match=r"^cudalink: .*is not a dtype"):
        cudalink.FrameSpec((2,), _TorchDtype("quint8"))  # type: ignore[arg-type]


def test_big_endian_bfloat16_is_refused_for_its_byte_order_by_name(pair: PairFactory) -> None:
    """It was "dtype bfloat16 is not supported; use a native-endian one of ..., bfloat16" (refusing the type it
    lists) and "array is >V2 (big-endian) but the link carries <V2" (raw bytes, no type)."""
    big = np.zeros((2, 3), BF16.newbyteorder(">"))
    with pytest.raises(cudalink.FormatError, match=r"^cudalink: dtype bfloat16 \(big-endian\) is not supported"):
        cudalink.FrameSpec((2, 3), big.dtype)
    with pytest.raises(cudalink.FormatError, match=r"^cudalink: dtype bfloat16 \(big-endian\) is not supported"):
        cudalink.Frame.from_array(big)
    tx, _ = pair(shape=(2, 3), dtype="bfloat16", device="cpu")
    with pytest.raises(cudalink.FormatError) as info:
        tx.send(big)
    assert str(info.value).startswith("cudalink: array is bfloat16 (big-endian) but the link carries bfloat16 in")
    assert "V2" not in str(info.value) and "newbyteorder('=')" in str(info.value)
    fixed = big.astype(big.dtype.newbyteorder("="))  # the fix it names works
    assert tx.send(fixed) == 1


def test_without_ml_dtypes_a_bfloat16_link_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes raises ImportError
    monkeypatch.setattr(spec_mod, "_packaged", {})
    with pytest.raises(cudalink.FormatError, match=r"^cudalink: bfloat16 frames need the ml_dtypes .*pip install"):
        cudalink.FrameSpec((2,), "bfloat16")


def test_the_slot_record_carries_bfloat16() -> None:
    spec = cudalink.FrameSpec((5, 7, 3), "bfloat16", pixel_format="RGB", origin="bottom")
    buf = bytearray(wire.RECORD_SIZE)
    wire.pack_record(buf, 0, 9, 123, spec, b"m")
    rec = wire.unpack_record(buf, 0, spec.nbytes)
    assert rec.spec == spec and rec.spec.dtype == BF16


def test_cuda_link_segments_carry_bfloat16_as_its_flag_both_ways() -> None:
    spec = cudalink.FrameSpec((4, 6, 4), "bfloat16", pixel_format="BGRA", origin="bottom")
    meta = cw.meta_from_spec(spec)
    assert (meta.format_kind, meta.bits) == (cw.FORMAT_FLOAT, 16)
    assert meta.flags == cw.FLAG_BFLOAT16 | cw.FLAG_BGRA and meta.data_size == spec.nbytes
    assert cw.spec_from_meta(meta) == spec
    # a float16 frame keeps no flag: the two 16-bit floats stay apart
    assert cw.meta_from_spec(cudalink.FrameSpec((4, 6, 4), "float16")).flags & cw.FLAG_BFLOAT16 == 0
    with pytest.raises(cudalink.FormatError, match=r"v0\.9 carries only"):
        cw.write_metadata(bytearray(4096), 1, meta, cw.MAGIC_V09)


def _dl_dtype(capsule: object) -> tuple[int, int, int]:
    """(code, bits, lanes) of a legacy ``dltensor`` capsule: DLTensor's dtype sits after data, device and ndim."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, b"dltensor")
    raw = (ctypes.c_uint8 * 4).from_address(ptr + 20)
    return raw[0], raw[1], raw[2] | raw[3] << 8


@pytest.mark.parametrize("transport", [None, DEFAULT], ids=["memory", "shm"])
def test_bfloat16_frames_travel_bit_for_bit_and_export_as_kdlbfloat(pair: PairFactory, transport: Any) -> None:
    shape = (6, 5, 4)
    tx, rx = pair(transport=transport, shape=shape, dtype="bfloat16", device="cpu", rx={"latest": False})
    with tx, rx:
        for seq in (1, 2, 3):
            tx.send(bits_of(seq, shape).view(BF16))
        for seq in (1, 2, 3):
            with rx.recv(2) as frame:
                assert frame.dtype == BF16 and frame.shape == shape and frame.seq == seq
                got = frame.numpy()
                assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), bits_of(seq, shape))
                assert np.array_equal(np.asarray(frame).view(np.uint16), bits_of(seq, shape))
                if _native.dlpack is None:
                    with pytest.raises(cudalink.ExportError, match=r"^cudalink: numpy cannot export bfloat16.*numpy"):
                        frame.__dlpack__()
                    continue
                capsule = frame.__dlpack__()
                assert _dl_dtype(capsule) == (_DL_BFLOAT, 16, 1)
                with pytest.raises(cudalink.ExportError, match=r"^cudalink: numpy cannot copy bfloat16"):
                    frame.__dlpack__(copy=True)
                del capsule


def test_a_bfloat16_array_of_ones_own_becomes_a_frame_and_a_capsule() -> None:
    arr = bits_of(7, (3, 8)).view(BF16)
    frame = cudalink.Frame.from_array(arr)
    assert frame.dtype == BF16 and frame.numpy().ctypes.data == arr.ctypes.data  # no copy
    if _native.dlpack is not None:
        assert _dl_dtype(frame.__dlpack__()) == (_DL_BFLOAT, 16, 1)


def _produce(name: str, n: int, ready: Any, go: Any) -> None:
    with cudalink.Sender(name, shape=(16, 9), dtype="bfloat16", device="cpu", slots=4) as tx:
        ready.set()
        go.wait(30)
        for seq in range(1, n + 1):
            tx.send(bits_of(seq, (16, 9)).view(BF16), meta=seq.to_bytes(4, "little"))
            time.sleep(0.002)


def test_bfloat16_frames_from_another_process_arrive_bit_for_bit(name: str) -> None:
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_produce, args=(name, 40, ready, go), daemon=True)
    p.start()
    seqs: list[int] = []
    try:
        assert ready.wait(60)
        with cudalink.Receiver(name, timeout=10, latest=False) as rx:
            go.set()
            while True:
                try:
                    frame = rx.recv()
                except cudalink.ProducerGone:
                    break
                with frame:
                    assert frame.seq == int.from_bytes(frame.meta, "little") and frame.dtype == BF16
                    assert np.array_equal(frame.numpy().view(np.uint16), bits_of(frame.seq, (16, 9)))
                    seqs.append(frame.seq)
            skipped = rx.stats()["skipped"]
    finally:
        p.join(20)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert seqs == sorted(seqs) and seqs[-1] == 40 and len(seqs) + skipped == 40, (seqs, skipped)


class _TorchCpuBfloat16:
    """A CPU torch bfloat16 tensor as cudalink meets it: DLPack only (no array interface), exporting DLPack's
    kDLBfloat, which numpy's from_dlpack refuses with a RuntimeError ("Unsupported dtype in DLTensor"), not the
    BufferError the int16 fallback waited for; ``view(torch.int16)`` gives its bits."""

    __module__ = "torch"

    def __init__(self, bits: np.ndarray[Any, Any]) -> None:
        self.bits = bits
        self.dtype = _TorchDtype("bfloat16")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, *, max_version: tuple[int, int] | None = None, **kw: object) -> object:
        dlpack = pytest.importorskip("cudalink._native.dlpack")  # a kDLBfloat capsule, as torch makes
        b = self.bits
        ex = dlpack.Exporter(b.ctypes.data, 1, 0, b.shape, tuple(s // 2 for s in b.strides), _DL_BFLOAT, 16)
        return ex.capsule(b, False, max_version is not None and max_version[0] >= 1)

    def view(self, dtype: object) -> np.ndarray[Any, Any]:
        assert dtype == "int16"
        return self.bits.view(np.int16)


def test_a_cpu_torch_bfloat16_tensor_is_read_as_its_bits_whatever_numpy_raises(
    pair: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", type(sys)("torch"))
    monkeypatch.setattr(sys.modules["torch"], "int16", "int16", raising=False)
    bits = bits_of(3, (6, 5, 4))
    src = _TorchCpuBfloat16(bits)
    frame = cudalink.Frame.from_array(src)
    assert frame.dtype == BF16 and frame.ptr == bits.ctypes.data  # no copy
    assert np.array_equal(frame.numpy().view(np.uint16), bits)
    tx, rx = pair(DEFAULT, shape=(6, 5, 4), dtype="bfloat16", device="cpu")
    with tx, rx:
        tx.send(src)
        with rx.recv(2) as got:
            assert np.array_equal(got.numpy().view(np.uint16), bits)


# -- torch, jax and the GPU (where they are installed: the GPU machine) ----------------------------------------


def test_a_torch_cpu_bfloat16_tensor_is_sent_and_read_back_as_torch(pair: PairFactory) -> None:
    """numpy takes no bfloat16 through DLPack: a CPU tensor is read as its int16 bits, still with no copy."""
    torch = pytest.importorskip("torch")
    src = (torch.arange(6 * 5 * 4, dtype=torch.float32).reshape(6, 5, 4) / 7 - 3).to(torch.bfloat16)
    frame = cudalink.Frame.from_array(src)
    assert frame.dtype == BF16 and frame.ptr == src.data_ptr()
    tx, rx = pair(DEFAULT, shape=(6, 5, 4), dtype=torch.bfloat16, device="cpu")
    with tx, rx:
        tx.send(src)
        with rx.recv(2) as got:
            assert np.array_equal(got.numpy().view(np.int16), src.view(torch.int16).numpy())
            if _native.dlpack is not None:
                assert torch.equal(torch.from_dlpack(got), src)


def test_a_server_sends_a_bfloat16_gpu_frame_though_it_has_no_cuda_array_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ucx server read each GPU frame's pointer and ready stream from its CUDA array interface, which a bfloat16
    frame refuses: every frame of a served bfloat16 CUDA link failed ("sending frame N failed"). Here on the CPU,
    with the GPU calls stood in for."""
    import asyncio

    from cudalink import ucx_server
    from cudalink.cuda import ucx as cuda_ucx

    drained: list[object] = []

    async def drain(stream: object) -> None:
        drained.append(stream)

    class _Sync:
        def wait(self, stream: int) -> None:
            pass

        def cai_stream(self) -> int:
            return 77

    class _Stage:
        async def to_host(self, ptr: int, nbytes: int, stream: object) -> tuple[int, int, object]:
            return ptr, nbytes, stream

    monkeypatch.setattr(cuda_ucx, "use_device", lambda ordinal: None)
    monkeypatch.setattr(cuda_ucx, "drained", drain)
    spec = cudalink.FrameSpec((4, 6, 4), "bfloat16")
    frame = cudalink.Frame(spec, 0x10000, object(), device=0, sync=_Sync())
    data = asyncio.run(ucx_server._gpu_ready(frame, None))
    assert data.__cuda_array_interface__["data"][0] == 0x10000 and data.__cuda_array_interface__["shape"] == (192,)
    assert drained == [77] and frame._export_streams() == [77]
    assert asyncio.run(ucx_server._gpu_ready(frame, _Stage())) == (0x10000, 192, 77)


@pytest.mark.gpu
def test_a_cuda_bfloat16_tensor_is_a_frame_torch_and_jax_read_and_the_cai_refuses(pair: PairFactory) -> None:
    torch = pytest.importorskip("torch")
    src = (torch.arange(5 * 6 * 4, dtype=torch.float32, device="cuda").reshape(5, 6, 4) / 7 - 3).to(torch.bfloat16)
    ref = src.view(torch.int16).cpu().numpy()
    frame = cudalink.Frame.from_array(src)
    assert frame.is_cuda and frame.dtype == BF16 and frame.ptr == src.data_ptr()
    assert np.array_equal(frame.to_numpy().view(np.int16), ref)
    with pytest.raises(AttributeError, match=r"no bfloat16 .*DLPack"):
        frame.__cuda_array_interface__  # noqa: B018
    tx, rx = pair(DEFAULT, shape=(5, 6, 4), dtype="bfloat16", device=0, rx={"timeout": 5.0})
    with tx, rx:
        # with stream= the tensor is read through cuda.core (DLPack, which orders that stream), without through torch
        tx.send(src, stream=torch.cuda.current_stream().cuda_stream)
        with rx.recv(timeout=5) as f:
            assert f.dtype == BF16 and np.array_equal(f.to_numpy().view(np.int16), ref)
        tx.send(src)
        with rx.recv(timeout=5) as f:
            assert f.dtype == BF16 and np.array_equal(f.to_numpy().view(np.int16), ref)
            if _native.dlpack is None:  # cuda.core 1.x refuses bfloat16 ("Unsupported dtype for DLPack export")
                for made in (frame, f):
                    with pytest.raises(cudalink.ExportError, match=r"^cudalink: cuda\.core cannot export bfloat16"):
                        torch.from_dlpack(made)
                return
            jax = pytest.importorskip("jax")
            for made in (frame, f):
                assert torch.equal(torch.from_dlpack(made), src)
                assert np.array_equal(np.asarray(jax.dlpack.from_dlpack(made)).view(np.int16), ref)


@pytest.mark.gpu
@pytest.mark.parametrize(("framework", "mode"), [("torch", "send"), ("torch", "reserve"), ("jax", "send")])
def test_bfloat16_gpu_frames_from_another_process_verify_on_the_device(
    spawned: Spawned, name: str, framework: str, mode: str
) -> None:
    from . import _gpu_procs as gp

    if _native.dlpack is None:
        pytest.skip("bfloat16 CUDA frames export through the compiled core only (cuda.core 1.x refuses them)")
    result = spawned.queue()
    prod = spawned.ready(gp.gpu_producer, name, 300, (64, 48, 4), "bfloat16", 4, mode, every=0.001, policy="block")
    spawned(gp.gpu_consumer, name, framework, result, False, framework == "jax")
    fw, got, mism, err = result.get(timeout=120)
    prod.join(60)
    assert mism == 0 and got > 0, (fw, got, mism, err)
    assert prod.exitcode == 0


def test_a_gpu_bfloat16_demo_with_cupy_alone_is_refused_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cudalink.tools import cli, demo
    from cudalink.tools.measure import Backend

    monkeypatch.setattr(demo, "resolve_backend", lambda device: Backend(0, "cupy"))
    assert cli.main(["demo", "--device", "0", "--dtype", "bfloat16", "--frames", "5"]) == 1
    err = capsys.readouterr().err
    assert "cupy has no bfloat16" in err and "--device cpu" in err, err


@pytest.mark.gpu
def test_the_demo_streams_bfloat16_on_the_gpu_and_verifies_every_frame() -> None:
    pytest.importorskip("torch")
    from .test_cli import run_cli

    args = ["--frames", "40", "--consumers", "2", "--fps", "200", "--shape", "32,48,4", "--dtype", "bfloat16"]
    proc = run_cli("demo", "--device", "0", *args, timeout=180)
    if _native.dlpack is None:  # cuda.core 1.x exports no bfloat16: refused before anything starts
        assert proc.returncode == 1 and "compiled core" in proc.stderr, proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summary: 40 frames published" in proc.stdout and "mismatches: 0" in proc.stdout, proc.stdout
