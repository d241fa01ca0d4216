"""The compiled core (``cudalink._native``) against the Python reference it replaces.

One protocol, two implementations: every operation sequence hypothesis draws is run on two header
buffers, one through the Python rings and one through the compiled ones, and every result and every
byte must agree. A compiled producer and a pure-Python consumer (and the reverse) share a real
SharedMemory link across processes. The whole suite also runs once more with
``CUDALINK_PURE_PYTHON=1`` (README's test command), so each implementation passes the same tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudalink
from cudalink import _native, _ring
from cudalink.frames.spec import FrameSpec
from cudalink.transport import wire

from . import _procs
from .conftest import Spawned

ROOT = Path(__file__).resolve().parent.parent
native = pytest.mark.skipif(_native.ring is None, reason=f"compiled ring not in use: {_native.missing.get('ring')}")
SPEC = FrameSpec((4, 6), np.dtype("uint16"))
#: a slot's spec changes under the consumer's per-slot spec cache (a reconfigure), and some cannot fit
SPECS = (SPEC, FrameSpec((3, 5, 4), np.dtype("float32")), FrameSpec((1024, 1025), np.dtype("uint8")))


def test_compiled_core_is_built_where_a_compiler_exists() -> None:
    """A silently failed build would leave only the Python twin tested: where a compiler exists, fail."""
    if _native.PURE:
        pytest.skip("CUDALINK_PURE_PYTHON is set: this run tests the Python implementations")
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("cl")):
        pytest.skip("no C compiler here: the pure-Python core is the expected one")
    assert _native.ring is not None, _native.missing
    assert _native.exchange is not None, _native.missing
    assert _native.dlpack is not None, _native.missing
    assert (ROOT / "cudalink" / "_native").is_dir()


def test_pure_python_switch_is_honoured_in_a_child() -> None:
    code = "import cudalink._native as n; print(n.status()['ring'])"
    env = {**os.environ, "CUDALINK_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("python (CUDALINK_PURE_PYTHON is set)"), out.stdout


# -- differential: the same operations on both implementations ------------------------------------------

NSLOTS, NCONS = 4, 3

_op = st.one_of(
    st.tuples(st.just("claim"), st.integers(1, 40), st.integers(0, (1 << NSLOTS) - 1)),
    st.tuples(st.just("abort"), st.integers(0, NSLOTS - 1)),
    st.tuples(
        st.just("publish"),
        st.integers(0, NSLOTS - 1),
        st.integers(1, 40),
        st.integers(0, 2**63),
        st.binary(max_size=wire.META_MAX),
        st.sampled_from(SPECS),
    ),
    st.tuples(st.just("drop")),
    st.tuples(st.just("fences"), st.integers(0, NSLOTS - 1)),
    # masks of consumers, with a bit beyond the table now and then (both refuse it alike)
    st.tuples(st.just("sleepers"), st.integers(0, (1 << (NCONS + 1)) - 1)),
    st.tuples(st.just("wake_ahead"), st.integers(0, (1 << (NCONS + 1)) - 1)),
    st.tuples(st.just("woken_ahead"), st.integers(0, (1 << (NCONS + 1)) - 1)),
    st.tuples(st.just("take"), st.integers(0, NCONS - 1), st.integers(0, 40), st.booleans()),
    st.tuples(
        st.just("release"), st.integers(0, NCONS - 1), st.integers(0, NSLOTS - 1), st.integers(0, 40), st.booleans()
    ),
    st.tuples(st.just("set_waiting"), st.integers(0, NCONS - 1), st.integers(-1, 4)),
    st.tuples(st.just("flags"), st.integers(0, NCONS - 1)),
    # a whole frame, so that slots come round with new specs and meta under the consumers' caches
    st.tuples(st.just("frame"), st.integers(0, NCONS - 1), st.sampled_from(SPECS), st.binary(max_size=8)),
)


class _Side:
    def __init__(self, producer: Any, consumer: Any) -> None:
        self.layout = wire.Layout(NSLOTS, NCONS)
        self.buf = bytearray(self.layout.size)
        view = memoryview(self.buf)
        self.tx = producer(view, self.layout)
        self.rx = [consumer(view, self.layout, c, 1 << 20) for c in range(NCONS)]
        self.seq = 100  # "frame" ops' seqs, above those the other ops draw

    def apply(self, op: tuple[Any, ...]) -> Any:
        kind, *args = op
        try:
            if kind == "claim":
                return self.tx.claim(*args)
            if kind == "abort":
                return self.tx.abort(args[0])
            if kind == "publish":
                slot, seq, ts, meta, spec = args
                return self.tx.publish(slot, seq, ts, spec, meta)
            if kind == "drop":
                return self.tx.count_drop()
            if kind == "fences":
                return self.tx.take_fences(args[0])
            if kind == "sleepers":
                return self.tx.sleepers(args[0])
            if kind == "wake_ahead":
                return self.tx.wake_ahead(args[0])
            if kind == "woken_ahead":
                return self.tx.woken_ahead(args[0])
            if kind == "take":
                c, after, newest = args
                return self.rx[c].take(after, newest)
            if kind == "release":
                c, slot, seq, fenced = args
                return self.rx[c].release(slot, seq, fenced)
            if kind == "set_waiting":
                return self.rx[args[0]].set_waiting(args[1])
            if kind == "flags":
                return self.rx[args[0]].flags()
            if kind == "frame":
                c, spec, meta = args
                self.seq += 1
                slot = self.tx.claim(self.seq)
                if slot is None:
                    return None
                self.tx.publish(slot, self.seq, 7, spec, meta)
                got = self.rx[c].take(self.seq - 1, True)
                if got is not None:
                    self.rx[c].release(got[0], got[1].seq, False)
                return got
        except Exception as exc:  # both must fail the same way, too
            return ("raised", type(exc).__name__)
        raise AssertionError(kind)


@native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_op, max_size=60))
def test_compiled_ring_matches_the_python_ring_byte_for_byte(ops: list[tuple[Any, ...]]) -> None:
    assert _native.ring is not None
    py = _Side(_ring.PyProducerRing, _ring.PyConsumerRing)
    c = _Side(_ring._NativeProducerRing, _native.ring.ConsumerCore)
    for i, op in enumerate(ops):
        want, got = py.apply(op), c.apply(op)
        assert got == want, (i, op)
        assert c.buf == py.buf, (i, op, [k for k in range(len(py.buf)) if c.buf[k] != py.buf[k]][:8])


def _side(impl: str) -> _Side:
    """Both rings of one implementation over one header: ``"python"`` or ``"compiled"`` (skips if not built)."""
    if impl == "python":
        return _Side(_ring.PyProducerRing, _ring.PyConsumerRing)
    if _native.ring is None:
        pytest.skip("compiled ring not in use")
    return _Side(_ring._NativeProducerRing, _native.ring.ConsumerCore)


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_a_slot_whose_spec_changes_is_read_with_its_new_spec(impl: str) -> None:
    """Consumers keep the last spec read in each slot; a reconfigure rewrites a slot with a new one."""
    side = _side(impl)
    rx = side.rx[0]
    seen = []
    for seq, spec in enumerate([SPECS[0], SPECS[0], SPECS[1], SPECS[0], SPECS[1]], start=1):
        slot = side.tx.claim(seq)
        assert slot is not None
        side.tx.publish(slot, seq, 0, spec, b"m" * seq)
        got = rx.take(seq - 1, True)
        assert got is not None
        seen.append((got[0], got[1].seq, got[1].spec, got[1].meta))
        rx.release(got[0], seq, False)
    assert [x[2] for x in seen] == [SPECS[0], SPECS[0], SPECS[1], SPECS[0], SPECS[1]]
    assert [x[3] for x in seen] == [b"m" * k for k in range(1, 6)]
    assert len({x[0] for x in seen}) < len(seen)  # slots came round: the cache was consulted


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_the_waiting_word_says_who_to_wake_and_when(impl: str) -> None:
    """WAIT_ON: after the publish; WAIT_AHEAD: once ahead (then none after); WOKEN_AHEAD: no more.

    The producer asks about a set of consumers at once (a bit mask) and gets the subset back.
    """
    side = _side(impl)
    tx, rx = side.tx, side.rx[1]
    everyone = 0b111
    assert tx.sleepers(everyone) == 0 and tx.wake_ahead(everyone) == 0
    rx.set_waiting(wire.WAIT_ON)
    assert tx.sleepers(everyone) == 0b010 and tx.wake_ahead(everyone) == 0 and tx.sleepers(0b010) == 0b010
    assert tx.sleepers(0b101) == 0  # only those asked about
    side.rx[2].set_waiting(wire.WAIT_AHEAD)
    rx.set_waiting(wire.WAIT_AHEAD)
    assert tx.sleepers(everyone) == 0b110  # a producer that does not wake ahead still wakes them after
    assert tx.woken_ahead(everyone) == 0  # asking to be woken ahead is not being woken
    assert tx.wake_ahead(0b011) == 0b010  # consumer 2 was not asked about: it stays as it was
    assert tx.woken_ahead(everyone) == 0b010 and tx.woken_ahead(0b101) == 0  # woken, not yet running
    assert tx.sleepers(everyone) == 0b100  # woken once: no second wake-up of either kind for consumer 1
    assert tx.wake_ahead(everyone) == 0b100 and tx.wake_ahead(everyone) == 0
    assert tx.sleepers(everyone) == 0 and tx.woken_ahead(everyone) == 0b110
    rx.set_waiting(wire.WAIT_OFF)  # consumer 1 runs: it clears its word
    assert tx.sleepers(everyone) == 0 and tx.wake_ahead(everyone) == 0 and tx.woken_ahead(everyone) == 0b100
    with pytest.raises(ValueError, match="cudalink: waiting state 4"):
        rx.set_waiting(4)
    with pytest.raises(IndexError, match=r"cudalink: consumer mask 0x8 names consumers outside 0\.\.2"):
        tx.sleepers(0b1000)
    with pytest.raises(IndexError, match="cudalink: consumer mask 0x9"):
        tx.wake_ahead(0b1001)
    with pytest.raises(IndexError, match="cudalink: consumer mask 0xa"):
        tx.woken_ahead(0b1010)


@native
def test_compiled_ring_counts_like_the_python_ring() -> None:
    assert _native.ring is not None
    py = _Side(_ring.PyProducerRing, _ring.PyConsumerRing)
    c = _Side(_ring._NativeProducerRing, _native.ring.ConsumerCore)
    for side in (py, c):
        side.rx[1].count(12345, 678)
        entry = side.layout.consumer(1)
        got = wire.U64X2.unpack_from(side.buf, entry + wire.CONSUMER_OFF_RECEIVED)
        assert got == (12345, 678)
        assert wire.read_u64(side.buf, entry + wire.CONSUMER_OFF_LAST_RECV) > 0


@native
def test_compiled_ring_refuses_bad_input_with_clear_errors() -> None:
    assert _native.ring is not None
    side = _Side(_ring._NativeProducerRing, _native.ring.ConsumerCore)
    with pytest.raises(IndexError, match="cudalink: slot 9"):
        side.tx.abort(9)
    with pytest.raises(IndexError, match="cudalink: consumer mask 0x80"):
        side.tx.sleepers(1 << 7)
    with pytest.raises(cudalink.ProtocolError, match="at most 64"):
        side.tx.publish(0, 1, 5, SPEC, b"x" * 65)
    with pytest.raises(ValueError, match="smaller than its layout"):
        _native.ring.ConsumerCore(memoryview(bytearray(64)), side.layout, 0, 1)


@native
def test_compiled_ring_on_a_closed_segment_raises_instead_of_touching_it() -> None:
    """The ring never keeps a pointer: a segment the transport unmapped is an error, not a crash."""
    assert _native.ring is not None
    layout = wire.Layout(2, 1)
    view = memoryview(bytearray(layout.size))
    tx = _ring.producer_ring(view, layout)
    assert type(tx) is _ring._NativeProducerRing
    view.release()
    with pytest.raises(ValueError):
        tx.claim(1)


@native
def test_an_unaligned_header_gets_the_python_ring() -> None:
    layout = wire.Layout(2, 1)
    view = memoryview(bytearray(layout.size + 1))[1:]
    assert type(_ring.producer_ring(view, layout)) is _ring.PyProducerRing
    assert type(_ring.consumer_ring(view, layout, 0, 16)) is _ring.PyConsumerRing


# -- the two implementations on one real link, across processes ---------------------------------------


@native
@pytest.mark.parametrize("pure_side", ["producer", "consumer"])
def test_compiled_and_pure_python_processes_share_a_link(
    name: str, spawned: Spawned, monkeypatch: pytest.MonkeyPatch, pure_side: str
) -> None:
    """The env switch is read at import in each child: one side runs the Python ring, the other C."""
    n, shape = 3000, (16, 16)
    result = spawned.queue()
    if pure_side == "producer":
        monkeypatch.setenv("CUDALINK_PURE_PYTHON", "1")
    spawned.ready(_procs.host_producer, name, n, shape, "uint8", 4, every=0.0002)
    if pure_side == "consumer":
        monkeypatch.setenv("CUDALINK_PURE_PYTHON", "1")
    else:
        monkeypatch.delenv("CUDALINK_PURE_PYTHON")
    spawned(_procs.host_consumer, name, n, result, 0.0, False)
    _pid, got, mismatches, tail, _, ordered = result.get(timeout=120)
    assert got > 100 and mismatches == 0 and ordered, (got, mismatches, tail)


# -- the DLPack C exchange reader (send's source read) --------------------------------------------------

exchange = pytest.mark.skipif(
    _native.exchange is None, reason=f"compiled exchange reader not in use: {_native.missing.get('exchange')}"
)
_DL = {"uint8": (1, 8), "int16": (0, 16), "float32": (2, 32), "float64": (2, 64), "complex64": (5, 64)}


def _view(arr: np.ndarray) -> Any:
    """cuda.core's StridedMemoryView of a host array: a type that publishes the C exchange table, no GPU needed."""
    from cudalink.cuda import driver

    return driver.view_class().from_dlpack(arr, stream_ptr=-1)


@exchange
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.sampled_from(sorted(_DL)),
    st.data(),
)
def test_exchange_reader_vouches_only_for_a_compact_array_of_the_exact_spec(
    shape: list[int], dtype: str, data: st.DataObject
) -> None:
    """A pointer is returned exactly when the array is C-contiguous and its shape, dtype and device match."""
    ex = _native.exchange
    assert ex is not None
    base = np.arange(int(np.prod(shape)) * 4, dtype=dtype).reshape([*shape[:-1], shape[-1] * 4])
    step = data.draw(st.sampled_from([1, 2, 4]))
    arr = base[..., ::step][..., : shape[-1]]  # strided unless step is 1 or the last axis has one element
    if data.draw(st.booleans()) and arr.ndim > 1:
        arr = arr.swapaxes(0, -1)
    view = _view(arr)
    code, bits = _DL[dtype]
    got = ex.source(view, (tuple(arr.shape), code, bits, 1, 0))
    from cudalink.cuda import arrays

    want = arrays.SourceWant(tuple(arr.shape), code, bits, 1, 0, arr.dtype)  # what send() passes
    assert ex.source(view, want) == got
    if arr.flags.c_contiguous:
        assert got == (arr.ctypes.data, 0)
    else:
        assert got is None
    wrong = (
        ((*arr.shape[:-1], arr.shape[-1] + 1), code, bits, 1, 0),  # another shape
        (tuple(arr.shape), code, bits * 2, 1, 0),  # another width
        (tuple(arr.shape), (code + 1) % 3, bits, 1, 0),  # another kind
        (tuple(arr.shape), code, bits, 2, 0),  # the array is on the host, not CUDA
        (tuple(arr.shape)[:-1], code, bits, 1, 0),  # fewer dimensions
    )
    for args in wrong:
        assert ex.source(view, args) is None, args


@exchange
def test_exchange_reader_passes_over_types_without_a_table() -> None:
    """numpy publishes no C exchange table: no pointer, and the general path reads it instead."""
    ex = _native.exchange
    assert ex is not None
    arr = np.zeros((2, 3), np.float32)
    assert not ex.has_api(arr) and ex.source(arr, ((2, 3), 2, 32, 1, 0)) is None
    assert ex.source(object(), ((2, 3), 2, 32, 1, 0)) is None
    assert ex.has_api(_view(arr))


# -- the compiled driver calls, on a GPU ------------------------------------------------------------------


@pytest.mark.gpu
def test_compiled_driver_calls_copy_order_and_fail_like_the_python_ones() -> None:
    """Where the driver module was built, frames go through it; its copies, events and errors are right."""
    torch = pytest.importorskip("torch")
    from cudalink.cuda import devices, driver

    driver.bindings()
    if _native.PURE:
        assert not driver.compiled()
        pytest.skip("CUDALINK_PURE_PYTHON is set: the Python driver calls are in use")
    fast = _native.driver
    assert driver.compiled() and fast is not None, _native.missing
    assert driver.record is fast.record and driver.memcpy_dtod is fast.memcpy_dtod
    dev = devices.device(0)
    dev.set_current()
    stream = torch.cuda.current_stream()
    s = int(stream.cuda_stream)
    src = torch.arange(48 * 64, dtype=torch.int32, device="cuda").reshape(48, 64)
    flat = torch.zeros_like(src)
    driver.memcpy_dtod(flat.data_ptr(), src.data_ptr(), src.numel() * 4, s)
    crop = src[:, 8:40]  # padded rows: one pitched copy
    packed = torch.zeros((48, 32), dtype=torch.int32, device="cuda")
    driver.memcpy_2d_dtod(packed.data_ptr(), 32 * 4, crop.data_ptr(), 64 * 4, 32 * 4, 48, s)
    ev = driver.new_event()
    h = int(ev)
    slow = torch.cuda.Stream()
    with torch.cuda.stream(slow):
        torch.cuda._sleep(50_000_000)  # keep the event pending for a while
    driver.record(h, int(slow.cuda_stream))
    assert driver.event_done(h) is False  # pending work
    driver.wait(s, h)
    after = flat + 1  # queued behind the wait on the current stream
    torch.cuda.synchronize()
    assert driver.event_done(h) is True
    assert torch.equal(flat, src) and torch.equal(packed, crop) and torch.equal(after, src + 1)
    with pytest.raises(cudalink.LinkError, match=r"cudalink: cuMemcpyDtoDAsync failed with CUDA_ERROR_\w+"):
        driver.memcpy_dtod(0, src.data_ptr(), 16, s)
    driver.destroy_event(ev)


@pytest.mark.gpu
@pytest.mark.parametrize("reader", ["exchange", "torch calls"])
def test_fast_source_reads_torch_tensors_as_torch_does(monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    """send()'s source read, both ways: torch's pointer and current stream, or None for the general path."""
    torch = pytest.importorskip("torch")
    from cudalink.cuda import arrays

    if reader == "torch calls":
        monkeypatch.setattr(_native, "exchange", None)
    elif _native.exchange is None:
        pytest.skip(f"compiled exchange reader not in use: {_native.missing.get('exchange')}")
    want = arrays.source_want(FrameSpec((48, 64, 4), np.dtype("uint8")), 0)
    t = torch.zeros((48, 64, 4), dtype=torch.uint8, device="cuda")

    def stream_now() -> int:
        return int(torch.cuda.current_stream().cuda_stream) or 1

    assert arrays.fast_source(t, want) == (t.data_ptr(), stream_now())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert arrays.fast_source(t, want) == (t.data_ptr(), int(side.cuda_stream))
    part = torch.zeros((50, 64, 4), dtype=torch.uint8, device="cuda")[1:49]  # compact, at an offset
    assert arrays.fast_source(part, want) == (part.data_ptr(), stream_now())
    for other in (
        torch.zeros((64, 48, 4), dtype=torch.uint8, device="cuda").transpose(0, 1),  # strided
        torch.zeros((48, 64, 4), dtype=torch.int8, device="cuda"),  # another dtype
        torch.zeros((48, 64, 3), dtype=torch.uint8, device="cuda"),  # another shape
        torch.zeros((48, 64, 4), dtype=torch.uint8),  # host memory
        np.zeros((48, 64, 4), np.uint8),
    ):
        assert arrays.fast_source(other, want) is None
    if reader == "exchange":
        print("torch publishes a DLPack C exchange table:", _native.exchange.has_api(t))  # type: ignore[union-attr]


# -- the compiled DLPack exporter ---------------------------------------------------------------------------

compiled_dlpack = pytest.mark.skipif(
    _native.dlpack is None, reason=f"compiled DLPack exporter not in use: {_native.missing.get('dlpack')}"
)


class _Hold:
    """Stands in for a frame's hold: what a capsule must keep alive, and let go of exactly once."""


class _Exports:
    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kw: Any) -> Any:
        return self.capsule(kw.get("max_version"))

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


@compiled_dlpack
@pytest.mark.parametrize(("versioned", "readonly"), [(True, True), (True, False), (False, False)])
def test_compiled_exporter_describes_the_slot_and_holds_it_until_the_consumer_lets_go(
    versioned: bool, readonly: bool
) -> None:
    import weakref

    from cudalink.cuda import arrays

    base = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    strided = base[::2, 1::3]  # strides the exporter must state in elements, not bytes
    spec = FrameSpec(strided.shape, strided.dtype, strided.strides)
    exporter = arrays.dlpack_exporter(strided.ctypes.data, spec, -1)
    assert exporter is not None
    hold = _Hold()
    gone = weakref.ref(hold)
    got = np.from_dlpack(_Exports(lambda mv, h=hold: exporter.capsule(h, readonly, versioned and mv is not None)))
    assert got.shape == strided.shape and got.strides == strided.strides and got.dtype == np.float32
    np.testing.assert_array_equal(got, strided)
    if versioned:  # only a versioned capsule can say read-only (numpy decides for a legacy one)
        assert got.flags.writeable is not readonly
    del hold
    assert gone() is not None  # the array keeps the hold
    del got
    assert gone() is None  # and lets go of it once, with the array
    hold = _Hold()
    gone = weakref.ref(hold)
    unused = exporter.capsule(hold, False, versioned)
    del hold
    assert gone() is not None
    del unused  # a capsule nobody consumed frees its tensor and lets go too
    assert gone() is None


@compiled_dlpack
def test_compiled_exporter_refuses_what_dlpack_cannot_describe() -> None:
    from cudalink.cuda import arrays

    with pytest.raises(ValueError, match=r"cudalink: a DLPack export takes 1\.\.8 dims"):
        _native.dlpack.Exporter(0, 1, 0, (), (), 1, 8)
    with pytest.raises(ValueError, match=r"cudalink: a DLPack export takes 1\.\.8 dims"):
        _native.dlpack.Exporter(0, 1, 0, (2, 2), (1,), 1, 8)
    with pytest.raises(ValueError, match="cudalink: DLPack type code"):
        _native.dlpack.Exporter(0, 1, 0, (2,), (1,), 1, 0)
    from cudalink.frames.spec import MAX_NDIM

    widest = FrameSpec((1,) * MAX_NDIM, np.dtype("uint8"))  # the compiled bound follows the spec's
    assert arrays.dlpack_exporter(0, widest, -1) is not None


@pytest.mark.parametrize("transport_name", ["memory", "default"])
def test_received_host_frames_export_through_the_compiled_core_where_built(transport_name: str) -> None:
    """The link hands each received frame its slot's exporter (None in the pure-Python core): same data,
    same read-only rule, same lease."""
    import gc

    from cudalink.transport import MemoryTransport

    transport = MemoryTransport() if transport_name == "memory" else None
    name = f"exp-{os.getpid()}-{transport_name}"
    with (
        cudalink.Sender(name, shape=(3, 4), dtype="uint16", slots=1, device="cpu", transport=transport) as tx,
        cudalink.Receiver(name, timeout=5, transport=transport) as rx,
    ):
        tx.send(np.full((3, 4), 7, np.uint16))
        frame = rx.recv()
        assert (frame._export is not None) is (_native.dlpack is not None)
        view = np.from_dlpack(frame)
        assert not view.flags.writeable and view.shape == (3, 4) and view[2, 3] == 7
        frame.release()
        gc.collect()
        assert tx.send(np.full((3, 4), 8, np.uint16)) is None  # the view holds the only slot
        del view
        gc.collect()
        assert tx.send(np.full((3, 4), 9, np.uint16)) is not None


# -- the Receiver's per-frame take: compiled (_native.ring.receive + Lease) against the Python one --------

#: what a consumer does between sends: poll, export a held frame, release one, drop an export
_rx_op = st.one_of(
    st.tuples(st.just("send"), st.integers(1, 3)),
    st.tuples(st.just("poll"), st.just(0)),
    st.tuples(st.just("export"), st.integers(0, 5)),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("drop"), st.integers(0, 5)),
)


def _receiver_side(name: str, impl: str, latest: bool) -> tuple[Any, Any]:
    import types

    from cudalink import link
    from cudalink.transport import MemoryTransport

    transport = MemoryTransport()
    tx = cudalink.Sender(name, shape=(3, 4), dtype="uint16", slots=3, device="cpu", policy="drop", transport=transport)
    rx = cudalink.Receiver(name, timeout=5, latest=latest, transport=transport)
    if impl == "python":  # this receiver only: the other one keeps the class's (compiled) take
        rx._try_take = types.MethodType(link.py_try_take, rx)  # type: ignore[method-assign]
    return tx, rx


def _lease_cells(tx: Any) -> list[int]:
    layout = tx._layout
    return [wire.read_u64(tx._server.header, layout.lease(s, 0)) for s in range(layout.nslots)]


@native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_rx_op, max_size=40), st.booleans())
def test_compiled_receive_matches_the_python_one(ops: list[tuple[str, int]], latest: bool) -> None:
    """The same sends, polls, exports and releases on two links, one received through each take: the same
    frames (seq, data, meta), counters, and lease cells after every step."""
    from cudalink import link

    assert link.Receiver._try_take is _native.ring.receive  # type: ignore[union-attr]
    sides = [_receiver_side(f"rxd-{os.getpid()}-{impl}", impl, latest) for impl in ("python", "compiled")]
    held: list[list[Any]] = [[], []]
    exports: list[list[Any]] = [[], []]
    try:
        seq = 0
        for kind, arg in ops:
            seen = []
            for i, (tx, rx) in enumerate(sides):
                if kind == "send":
                    out = [tx.send(np.full((3, 4), seq + k, np.uint16), meta=bytes([k])) for k in range(arg)]
                elif kind == "poll":
                    f = rx.poll()
                    out = None if f is None else (f.seq, int(np.from_dlpack(f)[0, 0]), f.meta)
                    if f is not None:
                        held[i].append(f)
                    del f  # holds die by reference count alone: no gc.collect() between steps
                elif kind == "export" and held[i]:
                    exports[i].append(np.from_dlpack(held[i][arg % len(held[i])]))
                    out = len(exports[i])
                elif kind == "release" and held[i]:
                    held[i].pop(arg % len(held[i])).release()
                    out = len(held[i])
                elif kind == "drop" and exports[i]:
                    exports[i].pop(arg % len(exports[i]))
                    out = len(exports[i])
                else:
                    out = None
                seen.append((out, rx.received, rx.skipped, _lease_cells(tx)))
            assert seen[0] == seen[1], (kind, arg, seen)
            if kind == "send":
                seq += arg
    finally:
        held, exports = [[], []], [[], []]
        for tx, rx in sides:
            rx.close()
            tx.close()


@native
def test_compiled_holds_release_their_slot_once_and_a_failed_slot_view_leaks_no_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frames carry the compiled Lease; ending it twice releases once; a slot view that fails mid-take
    leaves the slot unleased and the error visible."""
    from cudalink.transport import MemoryTransport

    transport = MemoryTransport()
    name = f"rxl-{os.getpid()}"
    with (
        cudalink.Sender(name, shape=(3, 4), dtype="uint16", slots=2, device="cpu", transport=transport) as tx,
        cudalink.Receiver(name, timeout=5, transport=transport) as rx,
    ):
        tx.send(np.zeros((3, 4), np.uint16))
        frame = rx.recv()
        hold = frame._hold
        assert type(hold) is _native.ring.Lease  # type: ignore[union-attr]
        assert (hold.slot, hold.seq) == (0, 1) and _lease_cells(tx)[0] == 1
        hold.end()
        assert _lease_cells(tx) == [0, 0] and not rx._att.live  # type: ignore[union-attr]
        hold.end()  # a second end is a no-op: the next frame's lease on the same slot survives it
        frame.release()
        att = rx._att
        assert att is not None

        def broken(*_: object) -> None:
            raise RuntimeError("slot view failed")

        att.parts = [None] * len(att.parts)
        monkeypatch.setattr(att.view, "slot", broken)
        tx.send(np.ones((3, 4), np.uint16))
        with pytest.raises(RuntimeError, match="slot view failed"):
            rx.poll()
        assert _lease_cells(tx) == [0, 0] and not att.live


# -- the Receiver's sleep: compiled (_native.ring.sleep_receive, one poll) against the Python one ----------


def _sleep_side(name: str, impl: str) -> tuple[Any, Any]:
    import types

    from cudalink import link
    from cudalink.transport import SharedMemoryTransport

    transport = SharedMemoryTransport()
    tx = cudalink.Sender(name, shape=(3, 4), dtype="uint16", slots=3, device="cpu", transport=transport)
    rx = cudalink.Receiver(name, timeout=5, wait="block", transport=transport)
    if impl == "python":  # this receiver only: the other one keeps the class's compiled take and sleep
        rx._try_take = types.MethodType(link.py_try_take, rx)  # type: ignore[method-assign]
        rx._sleep_take = types.MethodType(link.py_sleep_take, rx)  # type: ignore[method-assign]
    return tx, rx


def _waiting(tx: Any, index: int) -> int:
    return wire.read_u32(tx._server.header, tx._layout.consumer(index) + wire.CONSUMER_OFF_WAITING)


@pytest.mark.parametrize("impl", ["python", pytest.param("compiled", marks=native)])
@pytest.mark.parametrize("no_fd", [False, True])
def test_the_sleep_takes_what_its_wake_up_announces_and_leaves_the_waiting_word_as_asked(
    impl: str, no_fd: bool
) -> None:
    """A frame already there is taken without sleeping; none there sleeps until ``timeout``; a frame sent
    while asleep wakes it, the producer having seen the word it asked for; the word is ``after`` every
    time. ``no_fd``: a client with no pollable fd sleeps in ``client.wait_readable``."""
    import threading
    import time

    from cudalink import link

    if impl == "compiled":
        assert link.Receiver._sleep_take is _native.ring.sleep_receive  # type: ignore[union-attr]
    tx, rx = _sleep_side(f"rxs-{os.getpid()}-{impl}-{no_fd}", impl)
    with tx, rx:
        tx.send(np.full((3, 4), 1, np.uint16))
        first = rx.recv()  # attached now
        first.release()
        att = rx._att
        if no_fd:
            att.fd = -1
        index = att.ring.index
        tx.send(np.full((3, 4), 2, np.uint16))
        t0 = time.monotonic()
        f = rx._sleep_take(att, 30.0, wire.WAIT_ON, wire.WAIT_OFF)
        assert f is not None and f.seq == 2 and int(np.from_dlpack(f)[0, 0]) == 2
        assert time.monotonic() - t0 < 10  # it did not sleep out its 30 s
        assert _waiting(tx, index) == wire.WAIT_OFF
        f.release()
        del f

        t0 = time.monotonic()
        assert rx._sleep_take(att, 0.05, wire.WAIT_AHEAD, wire.WAIT_ON) is None
        assert time.monotonic() - t0 >= 0.04
        assert _waiting(tx, index) == wire.WAIT_ON  # ``after``: what a receiver with a fileno() keeps
        assert att.client.drain()  # no wake-up was sent: the word said WAIT_ON only after the sleep

        seen: list[int] = []

        def send_once_asleep() -> None:
            deadline = time.monotonic() + 10
            while _waiting(tx, index) != wire.WAIT_ON and time.monotonic() < deadline:
                time.sleep(0.001)
            seen.append(_waiting(tx, index))
            tx.send(np.full((3, 4), 3, np.uint16))

        rx._att.ring.set_waiting(wire.WAIT_OFF)
        t = threading.Thread(target=send_once_asleep)
        t.start()
        t0 = time.monotonic()
        f = rx._sleep_take(att, 30.0, wire.WAIT_ON, wire.WAIT_OFF)
        t.join()
        assert seen == [wire.WAIT_ON]
        assert f is not None and f.seq == 3 and int(np.from_dlpack(f)[0, 0]) == 3
        assert time.monotonic() - t0 < 10  # woken, not timed out
        assert _waiting(tx, index) == wire.WAIT_OFF
        f.release()


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("impl", ["python", pytest.param("compiled", marks=native)])
def test_a_signal_handlers_error_ends_the_sleep_and_withdraws_the_waiting_word(impl: str) -> None:
    """Ctrl-C in a blocked recv(): the compiled poll returns EINTR, the handler runs and its exception
    comes out of the sleep at once, as it does from ``select.poll``; the word is ``after`` either way."""
    import signal
    import time

    tx, rx = _sleep_side(f"rxi-{os.getpid()}-{impl}", impl)

    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        with tx, rx:
            tx.send(np.full((3, 4), 1, np.uint16))
            rx.recv().release()
            att = rx._att
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(Interrupted):
                rx._sleep_take(att, 30.0, wire.WAIT_ON, wire.WAIT_OFF)
            assert time.monotonic() - t0 < 10
            assert _waiting(tx, att.ring.index) == wire.WAIT_OFF
            with pytest.raises(Interrupted):
                signal.setitimer(signal.ITIMER_REAL, 0.1)
                rx.recv(30.0)  # the whole recv(), not only its sleep
            assert _waiting(tx, att.ring.index) == wire.WAIT_OFF
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@native
def test_a_frame_built_in_c_is_the_one_frame_received_builds() -> None:
    """The compiled receive fills ``Frame``'s slots in C (its bytecode cost ~6 us on a cold core): every
    slot ``Frame._received`` sets, to the same object, each value held (not borrowed)."""
    import weakref

    from cudalink.frames.frame import Frame

    ring = _native.ring
    assert ring is not None
    assert ring.frame_builder() == "c"
    assert set(Frame.__slots__) - {"__weakref__"} == set(ring._FRAME_SLOTS)  # a new slot must be added there
    hold, sync, host, export = object(), object(), object(), object()
    for device in (-1, 0, 3):
        args = (SPEC, hold, device, 2**64 - 1, 123, b"meta", sync, 7, host, export)
        got, want = ring.build_frame(*args), Frame._received(*args)
        assert type(got) is Frame
        for slot in ring._FRAME_SLOTS:
            a, b = getattr(got, slot), getattr(want, slot)
            assert a is b or (type(a) is type(b) and a == b), slot
        assert got.seq == 2**64 - 1 and got.is_cuda == (device >= 0) and got.meta == b"meta"
        ref = weakref.ref(got)
        del got
        assert ref() is None  # no cycle, no leak: freed on its last reference
    before = [sys.getrefcount(x) for x in (hold, sync, host, export, Frame)]
    frames = [ring.build_frame(SPEC, hold, 0, 1, 2, b"", sync, 3, host, export) for _ in range(10)]
    assert [sys.getrefcount(x) for x in (hold, sync, host, export, Frame)] == [n + 10 for n in before]
    del frames
    assert [sys.getrefcount(x) for x in (hold, sync, host, export, Frame)] == before


# -- a corrupt ring: take() returns or raises, alike in both cores (issue 32) -------------------------------


def _published(side: _Side) -> None:
    for seq, spec in zip((1, 2, 3), SPECS, strict=True):
        slot = side.tx.claim(seq)
        assert slot is not None
        side.tx.publish(slot, seq, 7, spec, b"m" * seq)


_RING_SPAN = NSLOTS * 8 + NSLOTS * wire.RECORD_SIZE  # the stamps, then the records
_STAMP_AT = st.sampled_from([8 * i for i in range(NSLOTS)])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    writes=st.lists(
        st.one_of(
            st.tuples(st.integers(0, _RING_SPAN - 1), st.binary(min_size=1, max_size=1)),
            st.tuples(st.sampled_from([8 * i for i in range(NSLOTS)]), st.integers(0, 2**64 - 1).map(wire.U64.pack)),
            st.tuples(
                st.sampled_from([8 * i for i in range(NSLOTS)]), st.integers(0, 40).map(lambda s: wire.U64.pack(2 * s))
            ),
        ),
        max_size=12,
    ),
    after=st.integers(0, 8),
    newest=st.booleans(),
)
def test_take_on_a_corrupt_ring_returns_or_raises_alike(
    writes: list[tuple[int, bytes]], after: int, newest: bool
) -> None:
    """Stamps and records scribbled on: each core's take comes back with no frame, a frame its stamp names,
    or a ProtocolError, the same one in both, and leaves no lease behind unless it returned a frame."""
    sides = [_side("python")] + ([_side("compiled")] if _native.ring is not None else [])
    for side in sides:
        _published(side)
        for off, data in writes:
            at = side.layout.stamps + off
            side.buf[at : at + len(data)] = data
    got = [side.apply(("take", 0, after, newest)) for side in sides]
    for side, res in zip(sides, got, strict=True):
        leases = [wire.read_u64(side.buf, side.layout.lease(s, 0)) for s in range(NSLOTS)]
        if res is None or res[0] == "raised":
            assert res is None or res[1] == "ProtocolError", res
            assert not any(leases)
        else:
            slot, rec = res
            assert wire.read_u64(side.buf, side.layout.stamp(slot)) == 2 * rec.seq and rec.seq > after
            assert leases == [rec.seq if s == slot else 0 for s in range(NSLOTS)]
    assert all(g == got[0] for g in got), got
    assert all(side.buf == sides[0].buf for side in sides)


@pytest.mark.parametrize(
    ("why", "says"),
    [
        (
            'cudalink._native.driver: cuInit raised "cuda" is an NVIDIA driver library ...',
            "built (unused: no CUDA driver",
        ),
        ("No module named 'cudalink._native.driver'", "python (not built: no C compiler or Cython"),
        ("CUDALINK_PURE_PYTHON is set", "python (CUDALINK_PURE_PYTHON is set)"),
    ],
    ids=["built-no-driver", "not-built", "forced"],
)
def test_status_tells_a_built_driver_module_on_a_machine_without_a_driver(
    monkeypatch: pytest.MonkeyPatch, why: str, says: str
) -> None:
    """``info`` showed "driver python (cuInit raised ...)" where the module was built and there is simply no
    GPU: that reads as a broken build. A built module with no driver to call says so."""
    monkeypatch.setattr(_native, "driver", None)
    monkeypatch.setitem(_native.missing, "driver", why)
    assert _native.status()["driver"].startswith(says)


def test_oldest_first_never_passes_a_frame_a_torn_scan_missed() -> None:
    """The stamp scan is no atomic read: frames landing while it runs can show a later slot's new frame after
    the scan passed an earlier slot just before its older frame landed. ``latest=False`` must still take the
    oldest frame the slots hold, not skip it. (The compiled twin does the same re-scan; only the Python scan
    can be torn on purpose.)"""
    side = _side("python")
    rx = side.rx[0]
    real = rx._stamps
    torn_once: list[int] = []

    def torn(buf: Any, off: int) -> tuple[int, ...]:
        before = real(buf, off)  # the scan has read slots 0 and 1 ...
        if not torn_once:
            torn_once.append(1)
            for seq in (1, 2, 3):  # ... the producer publishes frames 1, 2, 3 ...
                slot = side.tx.claim(seq)
                assert slot is not None
                side.tx.publish(slot, seq, 0, SPEC, b"")
        after = real(buf, off)  # ... and the scan reads the rest
        return before[:2] + after[2:]

    rx._stamps = torn  # type: ignore[method-assign]
    got = rx.take(0, False)
    assert got is not None and got[1].seq == 1, got
    for want in (2, 3):
        rx.release(got[0], got[1].seq, False)
        got = rx.take(got[1].seq, False)
        assert got is not None and got[1].seq == want


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_a_claim_skips_the_slots_it_is_told_to_and_takes_back_a_slot_left_half_claimed(impl: str) -> None:
    """The Sender passes the slots its open ``reserve()`` blocks write: a ``send()`` inside a block must take
    another slot or none (with one slot both wrote the same memory and a frame was lost). A slot left odd by a
    claim that never published (an exception between the two) is not lost: the next claim takes it."""
    side = _side(impl)
    first = side.tx.claim(1)
    assert first is not None
    skip = 1 << first
    others = set()
    for seq in range(2, 2 + 8):
        slot = side.tx.claim(seq, skip)
        if slot is None:
            break
        assert not (skip >> slot) & 1, (seq, slot)
        others.add(slot)
        skip |= 1 << slot
    assert len(others) == 3 and side.tx.claim(99, skip) is None  # every other slot, then none
    assert side.tx.claim(100, 1 << first) is not None  # the others, half claimed: taken again
    side.tx.publish(first, 1, 0, SPECS[0], b"")
    assert side.tx.claim(101, 0) is not None


def test_a_compiled_module_older_than_its_source_is_left_unused_and_says_rebuild(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An editable install pulled past a change of the ring's calls but not rebuilt kept its old ring.so:
    ``claim(seq)`` took no skip mask, and every send raised TypeError while ``info`` said "compiled"."""
    import importlib
    import types

    stale = types.ModuleType("cudalink._native.ring")  # a build from before ABI 2: no ABI attribute
    monkeypatch.setattr(importlib, "import_module", lambda name: stale)
    monkeypatch.setattr(_native, "PURE", False)
    monkeypatch.setattr(_native, "missing", {})
    assert _native._load("ring") is None
    assert _native.missing["ring"].startswith("stale build") and "build_ext --inplace" in _native.missing["ring"]
    stale.ABI = _native.ABI["ring"]  # type: ignore[attr-defined]
    assert _native._load("ring") is stale
    if _native.ring is not None:  # the build in use here is the source's
        assert _native.ABI["ring"] == _native.ring.ABI
