"""The wire layout under hypothesis: round trips, and corrupt bytes always give a clear LinkError."""

from __future__ import annotations

import pickle
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudalink
from cudalink.frames import SUPPORTED_DTYPES, FrameSpec, PixelFormat, RowOrigin
from cudalink.transport import wire


def _fixed(**kw: int) -> wire.Fixed:
    base = dict(
        backend=0,
        header_size=wire.Layout(4, 8).size,
        generation=77,
        pid=1,
        flags=1,
        nslots=4,
        nconsumers=8,
        device=-1,
        capacity=4096,
        published=0,
        dropped=0,
        last_publish_ns=0,
        created_ns=1,
        device_uuid=b"\0" * 16,
        data_size=4 * 4096,
    )
    base.update(kw)
    return wire.Fixed(**base)  # type: ignore[arg-type]


@given(
    nslots=st.integers(1, wire.MAX_SLOTS),
    ncons=st.integers(1, wire.MAX_CONSUMERS),
    backend=st.sampled_from([0, 1, 2]),
    gen=st.integers(1, 2**64 - 1),
    cap=st.integers(1, 1 << 30),
)
def test_fixed_header_roundtrip(nslots: int, ncons: int, backend: int, gen: int, cap: int) -> None:
    layout = wire.Layout(nslots, ncons)
    buf = bytearray(layout.size)
    f = _fixed(
        backend=backend,
        header_size=layout.size,
        generation=gen,
        nslots=nslots,
        nconsumers=ncons,
        capacity=cap,
        data_size=cap * nslots,
    )
    wire.write_fixed(buf, f)
    assert wire.read_fixed(buf) == f


class _Recording(bytearray):
    """A header buffer that keeps a copy of itself as it was before each item store (``pack_into`` writes
    through the buffer protocol, unseen)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.before: list[bytes] = []

    def __setitem__(self, key: Any, value: Any) -> None:
        self.before.append(bytes(self))
        super().__setitem__(key, value)


def test_the_header_magic_is_written_last_so_a_half_written_header_reads_as_pending() -> None:
    """A consumer can map the segment while its producer is still writing the header: until the magic is in,
    the header is pending (the consumer waits), and once it is in, everything else already is."""
    layout = wire.Layout(4, 2)
    assert wire.header_pending(bytearray(layout.size))
    f = _fixed(header_size=layout.size, nslots=4, nconsumers=2, capacity=64, data_size=4 * 4096)
    buf = _Recording(layout.size)
    wire.write_fixed(buf, f)
    assert not wire.header_pending(buf) and wire.read_fixed(buf) == f
    assert len(buf.before) == 1  # one store after the packed header: the magic
    last = bytearray(buf.before[0])
    assert wire.header_pending(last)  # just before the magic went in: pending ...
    last[: len(wire.MAGIC)] = wire.MAGIC
    assert wire.read_fixed(last) == f  # ... with every other field already written
    foreign = bytearray(b"NOTOURS!" + bytes(layout.size - 8))
    assert not wire.header_pending(foreign)  # another program's data is an error, not a wait
    with pytest.raises(cudalink.ProtocolError, match="not a cudalink segment"):
        wire.read_fixed(foreign)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=0, max_size=600))
def test_random_bytes_never_decode_as_a_header(data: bytes) -> None:
    with pytest.raises(cudalink.ProtocolError, match="cudalink"):
        wire.read_fixed(bytearray(data))


@settings(max_examples=400)
@given(offset=st.integers(8, 103), value=st.integers(0, 255))
def test_corrupted_header_fields_give_protocol_errors_or_valid_headers(offset: int, value: int) -> None:
    layout = wire.Layout(4, 8)
    buf = bytearray(layout.size)
    wire.write_fixed(buf, _fixed())
    buf[offset] = value
    try:
        f = wire.read_fixed(buf)
    except cudalink.ProtocolError:
        return
    # whatever survives validation is self-consistent: the regions it names fit in the segment
    assert f.layout.size == f.header_size <= len(buf) and f.generation != 0 and f.capacity > 0


def test_specific_header_lies() -> None:
    layout = wire.Layout(4, 8)
    buf = bytearray(layout.size)
    wire.write_fixed(buf, _fixed())
    cases = {
        "magic": (0, b"NOTCUDA!"),
        "version": (8, struct.pack("<H", 99)),
        "backend": (10, struct.pack("<H", 9)),
        "claims": (12, struct.pack("<I", layout.size + 8)),
        "generation 0": (16, struct.pack("<Q", 0)),
        "slot count": (32, struct.pack("<H", 0)),
        "consumer count": (34, struct.pack("<H", 999)),
        "capacity": (40, struct.pack("<Q", 0)),
        "data segment": (96, struct.pack("<Q", 10)),
    }
    for what, (off, raw) in cases.items():
        bad = bytearray(buf)
        bad[off : off + len(raw)] = raw
        with pytest.raises(cudalink.ProtocolError):
            wire.read_fixed(bad)
        assert what
    with pytest.raises(cudalink.ProtocolError, match="segment has"):
        wire.read_fixed(buf, segment_size=100)


specs = st.builds(
    lambda shape, dt, pf, org: FrameSpec(
        shape,
        dt,
        None,
        pf
        if (pf is None or (len(shape) >= 3 and shape[-1] == pf.channels) or (len(shape) < 3 and pf.channels == 1))
        else None,
        org,
    ),
    st.lists(st.integers(1, 12), min_size=1, max_size=8).map(tuple),
    st.sampled_from(SUPPORTED_DTYPES),
    st.sampled_from([None, *PixelFormat]),
    st.sampled_from(list(RowOrigin)),
)


@settings(max_examples=300)
@given(spec=specs, seq=st.integers(1, 2**62), ts=st.integers(0, 2**63), meta=st.binary(max_size=wire.META_MAX))
def test_slot_record_roundtrip(spec: FrameSpec, seq: int, ts: int, meta: bytes) -> None:
    buf = bytearray(wire.RECORD_SIZE)
    wire.pack_record(buf, 0, seq, ts, spec, meta)
    rec = wire.unpack_record(buf, 0, spec.nbytes)
    assert (rec.seq, rec.timestamp_ns, rec.spec, rec.meta) == (seq, ts, spec, meta)


def test_strided_record_roundtrip() -> None:
    spec = FrameSpec((4, 6), "float32", strides=(32, 4))
    buf = bytearray(wire.RECORD_SIZE)
    wire.pack_record(buf, 0, 1, 2, spec, b"")
    assert wire.unpack_record(buf, 0, spec.nbytes).spec == spec


@settings(max_examples=500)
@given(data=st.binary(min_size=wire.RECORD.size, max_size=wire.RECORD.size), cap=st.integers(1, 1 << 24))
def test_random_slot_records_are_refused_or_fit_the_slot(data: bytes, cap: int) -> None:
    try:
        rec = wire.unpack_record(data, 0, cap)
    except cudalink.ProtocolError:
        return
    assert rec.spec.nbytes <= cap and len(rec.meta) <= wire.META_MAX


def test_record_lies_are_refused() -> None:
    spec = FrameSpec((10, 10), "uint8")
    buf = bytearray(wire.RECORD_SIZE)
    wire.pack_record(buf, 0, 1, 2, spec, b"")
    with pytest.raises(cudalink.ProtocolError, match="slot holds"):
        wire.unpack_record(buf, 0, 50)  # bigger than the slot
    bad = bytearray(buf)
    struct.pack_into("<Q", bad, 16, 7)  # nbytes disagrees with the shape
    with pytest.raises(cudalink.ProtocolError):
        wire.unpack_record(bad, 0, 1000)
    bad = bytearray(buf)
    bad[24] = 12  # ndim
    with pytest.raises(cudalink.ProtocolError, match="ndim"):
        wire.unpack_record(bad, 0, 1000)
    bad = bytearray(buf)
    bad[25] = 200  # dtype code
    with pytest.raises(cudalink.ProtocolError, match="unknown codes"):
        wire.unpack_record(bad, 0, 1000)


@given(gen=st.integers(0, 2**64 - 1), token=st.integers(0, 2**64 - 1), pid=st.integers(0, 2**32 - 1))
def test_hello_roundtrip(gen: int, token: int, pid: int) -> None:
    assert wire.unpack_hello(wire.pack_hello(wire.Hello(gen, token, pid))) == wire.Hello(gen, token, pid)


@settings(max_examples=400)
@given(data=st.binary(max_size=64))
def test_random_hello_bytes(data: bytes) -> None:
    try:
        wire.unpack_hello(data)
    except cudalink.ProtocolError:
        return
    assert data[:4] == b"CLHI"


@settings(max_examples=400)
@given(data=st.binary(max_size=300), maxc=st.integers(1, 64))
def test_random_reply_bytes(data: bytes, maxc: int) -> None:
    try:
        w = wire.unpack_reply(data, maxc)
    except cudalink.ProtocolError:
        return
    assert w.index < maxc and w.nfds <= 4


@pytest.mark.parametrize(
    ("code", "reason", "retry"),
    [
        (wire.REJECT_GENERATION, cudalink.ProtocolReason.STALE_GENERATION, True),
        (wire.REJECT_FULL, cudalink.ProtocolReason.FULL, False),
        (wire.REJECT_UID, cudalink.ProtocolReason.WRONG_USER, False),
        (wire.REJECT_BAD_HELLO, cudalink.ProtocolReason.BAD_HELLO, False),
        (wire.REJECT_CLOSING, cudalink.ProtocolReason.CLOSING, True),
        (wire.REJECT_KEY, cudalink.ProtocolReason.STALE_KEY, True),
        (999, cudalink.ProtocolReason.REFUSED, False),  # a newer producer's code: refused, not retried
    ],
)
def test_reject_carries_its_reason_as_an_enum(code: int, reason: cudalink.ProtocolReason, retry: bool) -> None:
    with pytest.raises(cudalink.ProtocolError, match="some text") as info:
        wire.unpack_reply(wire.pack_reject(code, "some text"), 8)
    assert info.value.reason is reason and reason.retryable is retry
    again = pickle.loads(pickle.dumps(info.value))  # crosses process boundaries intact
    assert again.reason is reason and str(again) == str(info.value)


def test_a_corrupt_reply_is_a_corrupt_protocol_error() -> None:
    with pytest.raises(cudalink.ProtocolError) as info:
        wire.unpack_reply(b"CLOK" + bytes(3), 8)
    assert info.value.reason is cudalink.ProtocolReason.CORRUPT and not info.value.reason.retryable


@given(
    handle=st.binary(min_size=64, max_size=64),
    ev=st.binary(min_size=64, max_size=64),
    size=st.integers(0, 2**64 - 1),
    flags=st.integers(0, 255),
)
def test_slot_handles_roundtrip_legacy_and_pool(handle: bytes, ev: bytes, size: int, flags: int) -> None:
    buf = bytearray(wire.HANDLE_SIZE)
    h = wire.SlotHandle(handle, size, ev, flags)
    wire.pack_handle(buf, 0, h)
    assert wire.unpack_handle(buf, 0) == h


def test_layout_regions_do_not_overlap() -> None:
    for n, c in [(1, 1), (4, 16), (64, 64)]:
        lay = wire.Layout(n, c)
        assert lay.stamps >= wire.FIXED.size
        assert lay.records == lay.stamps + 8 * n
        assert lay.lease(n - 1, c - 1) + 8 <= lay.fences
        assert lay.fence(n - 1, c - 1) + 4 <= lay.consumers
        assert lay.release_handle(c - 1, n - 1) + wire.RELEASE.size == lay.size
    with pytest.raises(cudalink.ProtocolError):
        wire.Layout(0, 1)
    with pytest.raises(cudalink.ProtocolError):
        wire.Layout(1, wire.MAX_CONSUMERS + 1)
    assert np.dtype("uint8").name in wire.DTYPE_CODES


@settings(max_examples=300)
@given(
    handles=st.lists(st.binary(min_size=64, max_size=64), min_size=4, max_size=4),
    flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), max_size=4),
)
def test_a_legacy_handle_header_survives_fuzzing_as_an_error_or_a_valid_header(
    handles: list[bytes], flips: list[tuple[int, int]]
) -> None:
    """What a Windows (legacy-handle) producer writes, with random bytes flipped anywhere in it."""
    layout = wire.Layout(4, 8)
    buf = bytearray(layout.size)
    wire.write_fixed(buf, _fixed(backend=wire.BACKEND_CUDA_LEGACY, device=0, data_size=0))
    for slot, h in enumerate(handles):
        wire.pack_handle(buf, layout.handle(slot), wire.SlotHandle(h, 4096, h[::-1], 1))
    for off, value in flips:
        buf[off % len(buf)] = value
    try:
        f = wire.read_fixed(buf)
    except cudalink.ProtocolError:
        return
    assert f.backend in wire.BACKEND_NAMES and f.layout.size <= len(buf)
    for slot in range(f.nslots):
        h = wire.unpack_handle(buf, f.layout.handle(slot))
        assert len(h.memory) == len(h.event) == 64


@given(
    port=st.integers(1, 65535),
    pid=st.integers(0, 2**32 - 1),
    gen=st.integers(1, 2**64 - 1),
    key=st.binary(min_size=32, max_size=32),
)
def test_rendezvous_roundtrip(port: int, pid: int, gen: int, key: bytes) -> None:
    r = wire.Rendezvous(port, pid, gen, key)
    assert wire.unpack_rendezvous(wire.pack_rendezvous(r)) == r


@settings(max_examples=400)
@given(data=st.binary(max_size=80))
def test_random_rendezvous_bytes_are_refused_or_valid(data: bytes) -> None:
    try:
        r = wire.unpack_rendezvous(data)
    except cudalink.ProtocolError:
        return
    assert data[:4] == b"CLRV" and r.port > 0 and r.generation > 0 and len(r.key) == 32


@given(key=st.binary(min_size=32, max_size=32), challenge=st.binary(min_size=32, max_size=32), other=st.binary())
def test_only_the_keys_proof_passes(key: bytes, challenge: bytes, other: bytes) -> None:
    good = wire.proof(key, challenge)
    assert wire.check_proof(key, challenge, good)
    assert wire.check_proof(key, challenge, other) is (other == good)
    assert not wire.check_proof(bytes(b ^ 1 for b in key), challenge, good)
