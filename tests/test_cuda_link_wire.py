"""cuda-link's segment layout: hypothesis round trips of every field, golden bytes from the issue's table, and
bad segments that must give clear cudalink errors (never struct.error, IndexError or a hang)."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cudalink
from cudalink.frames import FrameSpec, PixelFormat
from cudalink.transport import cuda_link_wire as cw

u32 = st.integers(0, 2**32 - 1)
handle = st.binary(min_size=64, max_size=64)
V1_DTYPES = [(0, 8), (0, 16), (0, 32), (1, 8), (1, 16), (1, 32), (2, 16), (2, 32)]


@st.composite
def segments(draw: st.DrawFn, magic: int | None = None) -> cw.Segment:
    n = draw(st.integers(cw.MIN_SLOTS, cw.MAX_SLOTS))
    magic = draw(st.sampled_from([cw.MAGIC, cw.MAGIC_V09])) if magic is None else magic
    w, h, c = draw(st.integers(1, 4096)), draw(st.integers(1, 4096)), draw(st.integers(1, 4))
    if magic == cw.MAGIC_V09:
        code = draw(st.integers(0, 3))
        kind, bits = {0: (2, 32), 1: (2, 16), 2: (1, 8), 3: (1, 16)}[code]
        flags = 0
    else:
        code = None
        kind, bits = draw(st.sampled_from(V1_DTYPES))
        flags = draw(st.integers(0, 0xFFFF)) if not (kind == 2 and bits == 16) else draw(st.integers(0, 7))
    meta = cw.Metadata(w, h, c, kind, bits, flags, w * h * c * bits // 8, code)
    return cw.Segment(
        cw.Header(magic, draw(st.integers(0, 2**64 - 1)), n, draw(u32)),
        tuple(draw(handle) for _ in range(n)),
        tuple(draw(handle) for _ in range(n)),
        draw(st.booleans()),
        meta,
        draw(st.floats(allow_nan=False)),
    )


@given(segments(), st.integers(0, 64))
def test_segment_round_trip_every_field(seg: cw.Segment, extra: int) -> None:
    n = seg.header.num_slots
    buf = bytearray(cw.segment_size(n) + extra)  # SharedMemory rounds sizes up to a page: a longer buffer is fine
    cw.pack_segment(buf, seg)
    assert cw.read_segment(buf) == seg
    assert cw.read_write_idx(buf) == seg.header.write_idx
    assert cw.read_version(buf) == seg.header.version
    assert cw.read_shutdown(buf, n) is seg.shutdown
    assert cw.read_timestamp(buf, n) == seg.timestamp
    for i in range(n):
        assert cw.read_handles(buf, n, i) == (seg.memory_handles[i], seg.event_handles[i])


@given(segments(magic=cw.MAGIC_V09))
def test_v09_dtype_enum_maps_to_the_v1_fields(seg: cw.Segment) -> None:
    buf = bytearray(cw.segment_size(seg.header.num_slots))
    cw.pack_segment(buf, seg)
    meta = cw.read_metadata(buf, seg.header.num_slots, cw.MAGIC_V09)
    assert meta.dtype_name == cw.V09_DTYPES[meta.dtype_code or 0]
    assert cw.read_header(buf).release == "v0.9"
    off = cw.off_metadata(seg.header.num_slots) + 12
    assert struct.unpack_from("<I", buf, off)[0] == seg.metadata.dtype_code


def test_sizes_and_offsets_from_the_table() -> None:
    for n in range(1, 11):
        assert cw.segment_size(n) == 49 + 128 * n
        assert cw.off_shutdown(n) == 20 + 128 * n
        assert cw.off_metadata(n) == 21 + 128 * n
        assert cw.off_timestamp(n) == 41 + 128 * n
        for i in range(n):
            assert cw.off_memory(i) == 20 + 128 * i
            assert cw.off_event(i) == 84 + 128 * i


def test_golden_bytes_v1() -> None:
    """Two slots of 1920x1080 BGRA uint8, written byte by byte from the issue's table, then parsed."""
    gold = bytearray()
    gold += bytes([0x44, 0x50, 0x49, 0x43])  # magic, as bytes
    gold += (7).to_bytes(8, "little")  # version
    gold += (2).to_bytes(4, "little")  # N
    gold += (5).to_bytes(4, "little")  # write_idx
    gold += bytes([0xA0]) * 64 + bytes([0xE0]) * 64  # slot 0: memory, event
    gold += bytes([0xA1]) * 64 + bytes(64)  # slot 1: memory, no event
    gold += bytes([0])  # shutdown
    gold += (1920).to_bytes(4, "little") + (1080).to_bytes(4, "little") + (4).to_bytes(4, "little")
    gold += bytes([1, 8]) + (0b100).to_bytes(2, "little")  # unsigned, 8 bits, BGRA
    gold += (1920 * 1080 * 4).to_bytes(4, "little")
    gold += struct.pack("<d", 12.5)
    assert len(gold) == 49 + 128 * 2

    seg = cw.read_segment(bytes(gold))
    assert seg.header == cw.Header(0x43495044, 7, 2, 5)
    assert seg.header.newest_slot == 0  # (5 - 1) mod 2
    assert seg.memory_handles == (b"\xa0" * 64, b"\xa1" * 64)
    assert seg.event_handles == (b"\xe0" * 64, bytes(64))
    assert seg.shutdown is False
    assert seg.metadata == cw.Metadata(1920, 1080, 4, 1, 8, 4, 1920 * 1080 * 4)
    assert seg.timestamp == 12.5
    spec = cw.spec_from_meta(seg.metadata)
    assert spec == FrameSpec((1080, 1920, 4), "uint8", pixel_format="BGRA", origin="bottom")  # TD's rows

    out = bytearray(len(gold))
    cw.pack_segment(out, seg)
    assert out == gold


def test_golden_bytes_v09() -> None:
    gold = bytearray(cw.segment_size(1))
    gold[0:4] = bytes([0x43, 0x50, 0x49, 0x43])  # "CIPC"
    gold[4:12] = (1).to_bytes(8, "little")
    gold[12:16] = (1).to_bytes(4, "little")
    meta = 21 + 128
    gold[meta : meta + 20] = struct.pack("<IIIII", 64, 32, 4, 1, 64 * 32 * 4 * 2)  # dtype 1 = float16
    m = cw.read_metadata(bytes(gold), 1, cw.read_header(bytes(gold)).magic)
    assert (m.dtype_name, m.dtype_code, m.bits, m.format_kind) == ("float16", 1, 16, 2)
    assert cw.spec_from_meta(m) == FrameSpec((32, 64, 4), "float16", pixel_format="RGBA", origin="bottom")


@pytest.mark.parametrize(
    ("kind", "bits", "flags", "dtype", "pf"),
    [
        (1, 8, 0, "uint8", "RGBA"),
        (1, 8, cw.FLAG_BGRA, "uint8", "BGRA"),
        (1, 16, 0, "uint16", "RGBA"),
        (1, 32, 0, "uint32", "RGBA"),
        (0, 8, 0, "int8", "RGBA"),
        (0, 16, 0, "int16", "RGBA"),
        (0, 32, 0, "int32", "RGBA"),
        (2, 16, 0, "float16", "RGBA"),
        (2, 32, cw.FLAG_BGRA, "float32", "BGRA"),
    ],
)
def test_every_dtype_and_flag_maps_both_ways(kind: int, bits: int, flags: int, dtype: str, pf: str) -> None:
    meta = cw.Metadata(8, 4, 4, kind, bits, flags, 8 * 4 * 4 * bits // 8)
    spec = cw.spec_from_meta(meta)
    assert spec.shape == (4, 8, 4) and spec.dtype == np.dtype(dtype) and spec.pixel_format is PixelFormat[pf]
    assert cw.meta_from_spec(spec) == meta


@pytest.mark.parametrize(
    ("comps", "flags", "pf"),
    [(1, 0, "GRAY"), (2, 0, "RG"), (2, cw.FLAG_MONO_ALPHA, None), (3, 0, "RGB"), (3, cw.FLAG_BGRA, "BGR")],
)
def test_channel_flags(comps: int, flags: int, pf: str | None) -> None:
    spec = cw.spec_from_meta(cw.Metadata(2, 2, comps, 1, 8, flags, 4 * comps))
    assert spec.pixel_format == (None if pf is None else PixelFormat[pf])


def test_bfloat16_is_read_by_its_flag() -> None:
    meta = cw.Metadata(2, 2, 4, 2, 16, cw.FLAG_BFLOAT16, 32)
    assert meta.dtype_name == "bfloat16"
    assert cw.spec_from_meta(meta).dtype.name == "bfloat16"


def test_writer_refuses_what_the_layout_cannot_carry() -> None:
    with pytest.raises(cudalink.FormatError, match="float64"):
        cw.meta_from_spec(FrameSpec((4, 4, 4), "float64"))
    with pytest.raises(cudalink.FormatError, match="height, width, channels"):
        cw.meta_from_spec(FrameSpec((4, 4, 4, 4), "uint8"))
    with pytest.raises(cudalink.FormatError, match="tightly packed"):
        cw.meta_from_spec(FrameSpec((4, 4, 4), "uint8", strides=(32, 4, 1)))
    assert cw.meta_from_spec(FrameSpec((3, 5), "uint8")) == cw.Metadata(5, 3, 1, 1, 8, 0, 15)
    with pytest.raises(cudalink.FormatError, match=r"v0\.9 carries only"):
        cw.write_metadata(bytearray(200), 1, cw.Metadata(2, 2, 1, 0, 8, 0, 4), cw.MAGIC_V09)


def _good(n: int = 3) -> bytearray:
    buf = bytearray(cw.segment_size(n))
    meta = cw.Metadata(16, 8, 4, 1, 8, 0, 16 * 8 * 4)
    cw.pack_segment(
        buf, cw.Segment(cw.Header(cw.MAGIC, 1, n, 0), (b"\1" * 64,) * n, (bytes(64),) * n, False, meta, 0.0)
    )
    return buf


def test_bad_magic() -> None:
    buf = _good()
    buf[0:4] = b"CUDA"
    with pytest.raises(cudalink.ProtocolError, match="magic 0x41445543"):
        cw.read_segment(buf, "cam")
    buf[0:4] = bytes(4)
    with pytest.raises(cudalink.ProtocolError, match="not initialised"):
        cw.read_header(buf)


@pytest.mark.parametrize("n", [0, 11, 2**32 - 1])
def test_slot_count_out_of_range(n: int) -> None:
    buf = _good()
    struct.pack_into("<I", buf, 12, n)
    with pytest.raises(cudalink.ProtocolError, match=rf"{n} slots; the layout allows 1\.\.10"):
        cw.read_header(buf)


@pytest.mark.parametrize("cut", [0, 1, 19, 20, 100, cw.segment_size(3) - 1])
def test_truncated_segment(cut: int) -> None:
    buf = bytes(_good())[:cut]
    with pytest.raises(cudalink.ProtocolError, match=r"truncated|shorter than"):
        cw.read_segment(buf)


def test_data_size_that_does_not_match() -> None:
    buf = _good()
    struct.pack_into("<I", buf, cw.off_metadata(3) + 16, 16 * 8 * 4 + 1)
    with pytest.raises(cudalink.FormatError, match="data_size 513 but 16x8x4 at 8 bits is 512"):
        cw.read_segment(buf)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ((0, 8, 4, 1, 8, 0, 0), "not published a format"),
        ((16, 8, 4, 3, 8, 0, 512), "format_kind 3"),
        ((16, 8, 4, 1, 12, 0, 768), "12 bits"),
        ((16, 8, 4, 1, 0, 0, 0), "0 bits"),
    ],
)
def test_bad_metadata(fields: tuple[int, ...], match: str) -> None:
    buf = _good()
    struct.pack_into("<IIIBBHI", buf, cw.off_metadata(3), *fields)
    with pytest.raises(cudalink.FormatError, match=match):
        cw.read_segment(buf)


def test_bad_v09_dtype_code() -> None:
    buf = _good()
    struct.pack_into("<I", buf, 0, cw.MAGIC_V09)
    struct.pack_into("<I", buf, cw.off_metadata(3) + 12, 4)
    with pytest.raises(cudalink.FormatError, match="dtype code 4"):
        cw.read_segment(buf)


def _v066_segment(n: int) -> bytearray:
    """cuda-link v0.6.6's layout (forkni/cuda-link @214454fe): 192-byte slots whose 128-byte handle fields hold
    a 64-byte cudaIpcMemHandle, then the event handle at +128; shutdown, metadata and timestamp after them."""
    buf = bytearray(49 + 192 * n)
    struct.pack_into("<IQII", buf, 0, cw.MAGIC_V09, 3, n, 7)
    for i in range(n):
        at = 20 + 192 * i
        buf[at : at + 64] = bytes(range(1, 65))
        buf[at + 128 : at + 192] = bytes(range(65, 129))
    struct.pack_into("<IIIII", buf, 21 + 192 * n, 64, 32, 4, 2, 64 * 32 * 4)  # uint8 RGBA
    return buf


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_a_v066_segment_says_upgrade_instead_of_being_misread(n: int) -> None:
    buf = _v066_segment(n)
    assert cw.looks_like_v066(buf, n)
    with pytest.raises(cudalink.ProtocolError, match=r"v0\.6\.6 or older.*upgrade cuda-link"):
        cw.read_header(buf, "old")
    with pytest.raises(cudalink.ProtocolError, match="upgrade"):
        cw.read_segment(bytes(buf) + bytes(4096 - len(buf)))  # as Windows maps it: rounded up to a page


@given(segments(magic=cw.MAGIC_V09), st.integers(0, 4096))
def test_a_current_cipc_segment_is_never_taken_for_v066(seg: cw.Segment, extra: int) -> None:
    n = seg.header.num_slots
    blank = dataclasses.replace(seg, event_handles=(bytes(64),) * n)  # a producer that made no events
    for s in (seg, blank):
        buf = bytearray(cw.segment_size(n) + extra)  # zero filled beyond the end, as a page-rounded mapping
        cw.pack_segment(buf, s)
        assert not cw.looks_like_v066(buf, n)
        assert cw.read_segment(buf) == s


@given(st.binary(max_size=2000))
def test_random_bytes_never_crash(data: bytes) -> None:
    try:
        cw.read_segment(data)
    except cudalink.LinkError:
        pass


@given(segments(), st.data())
def test_corrupting_any_byte_gives_a_link_error_or_a_valid_segment(seg: cw.Segment, data: st.DataObject) -> None:
    buf = bytearray(cw.segment_size(seg.header.num_slots))
    cw.pack_segment(buf, seg)
    i = data.draw(st.integers(0, len(buf) - 1))
    buf[i] ^= data.draw(st.integers(1, 255))
    try:
        cw.read_segment(buf)
    except cudalink.LinkError:
        pass


def test_allocation_rounds_to_2_mib() -> None:
    assert cw.allocation_size(1) == 2 << 20
    assert cw.allocation_size(2 << 20) == 2 << 20
    assert cw.allocation_size((2 << 20) + 1) == 4 << 20
    assert cw.allocation_size(1920 * 1080 * 4 * 4) == 32 << 20  # 31.6 MiB
