"""cuda-link's shared-memory segment (forkni/cuda-link, v0.6.7 to v1.12): the one file that owns its layout.

cuda-link is the library most TouchDesigner users share GPU frames with today. Its TD components and its
Python exporter/importer all read and write one ``SharedMemory`` segment, laid out here; speaking it lets a
cudalink process replace either side without touching a ``.toe`` file. All fields are little-endian;
N = number of slots, 1..10; the segment is ``49 + 128·N`` bytes:

====================  =====  =================================================================================
offset                size   field
====================  =====  =================================================================================
0                     u32    magic ``0x43495044`` ("CIPD", v1.0+) or ``0x43495043`` ("CIPC", v0.6.7-v0.9)
4                     u64    version: +1 each time a producer (re)initialises the segment
12                    u32    num_slots N
16                    u32    write_idx: 0 = nothing yet; the newest frame is slot (write_idx - 1) mod N
20 + 128·i            64     ``cudaIpcMemHandle_t`` of slot i (a cudaMalloc base, frame at offset 0)
84 + 128·i            64     ``cudaIpcEventHandle_t`` of slot i; all zeros = no event
20 + 128·N            u8     shutdown flag: 1 once the producer closes
21 + 128·N            20     metadata: width u32, height u32, num_comps u32, then v1: format_kind u8
                             (0 signed, 1 unsigned, 2 float), bits u8, flags u16 (bit 0 bfloat16, bit 1
                             mono+alpha, bit 2 BGRA) / v0.9: dtype u32 (0 float32, 1 float16, 2 uint8,
                             3 uint16); then data_size u32
41 + 128·N            f64    timestamp: the producer's ``time.perf_counter()`` at publish
====================  =====  =================================================================================

Pixels are tightly packed HWC, rows bottom-up as TouchDesigner's memory (no field says so: every cuda-link
endpoint copies TD's bytes as they are); ``data_size`` must be ``width·height·num_comps·bits/8``. There is no
back-pressure: the producer overwrites slots freely (latest frame wins).

Everything here is pure Python over a buffer (bytes, bytearray, memoryview): no CUDA, no OS calls.
Every read of bytes another process wrote is validated and fails with a :class:`ProtocolError` or
:class:`FormatError` that says what is wrong and what to do, never with a ``struct.error`` or an
``IndexError``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, ProtocolError
from ..frames.spec import FrameSpec, PixelFormat, RowOrigin

__all__ = [
    "DEFAULT_NAMES",
    "HEADER_SIZE",
    "MAGIC",
    "MAGIC_V09",
    "MAX_SLOTS",
    "MAX_VERSION",
    "FormatNotPublished",
    "Header",
    "Metadata",
    "Segment",
    "check_size",
    "meta_from_spec",
    "pack_segment",
    "read_header",
    "read_metadata",
    "read_segment",
    "segment_size",
    "spec_from_meta",
]

#: v1.0+ magic, "CIPD" in the bytes ``44 50 49 43``
MAGIC = 0x43495044
#: v0.6.7-v0.9 magic, "CIPC": the same layout with a 4-byte dtype enum in the metadata (v0.6.6 and older
#: share it with other slots: :func:`looks_like_v066`)
MAGIC_V09 = 0x43495043
MAGICS = {MAGIC: "v1.0+", MAGIC_V09: "v0.9"}
MIN_SLOTS = 1
MAX_SLOTS = 10
HANDLE_SIZE = 64
SLOT_SIZE = 128  # memory handle + event handle
#: cuda-link v0.6.6 and older: the same header and magic as v0.9, 128-byte handle fields (see looks_like_v066)
V066_SLOT_SIZE = 192
HEADER_SIZE = 20
META_SIZE = 20
#: the allocation granularity cuda-link rounds each slot's cudaMalloc up to
ALLOC_GRANULARITY = 2 << 20
#: segment names cuda-link uses by default (they hold characters cudalink's own names refuse)
DEFAULT_NAMES = ("cudalink_output_ipc", "cudalink_ipc_TD>>Python", "cudalink_ipc_Python>>TD")

OFF_MAGIC = 0
OFF_VERSION = 4
OFF_NUM_SLOTS = 12
OFF_WRITE_IDX = 16
OFF_SLOTS = HEADER_SIZE

FORMAT_SIGNED = 0
FORMAT_UNSIGNED = 1
FORMAT_FLOAT = 2
FLAG_BFLOAT16 = 1 << 0
FLAG_MONO_ALPHA = 1 << 1
FLAG_BGRA = 1 << 2
KNOWN_FLAGS = FLAG_BFLOAT16 | FLAG_MONO_ALPHA | FLAG_BGRA

#: v0.9's dtype enum
V09_DTYPES = ("float32", "float16", "uint8", "uint16")

_HEADER = struct.Struct("<IQII")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_META_V1 = struct.Struct("<IIIBBHI")
_META_V09 = struct.Struct("<IIIII")
assert _HEADER.size == HEADER_SIZE and _META_V1.size == META_SIZE == _META_V09.size

_KIND_NAMES = {FORMAT_SIGNED: "signed", FORMAT_UNSIGNED: "unsigned", FORMAT_FLOAT: "float"}
#: (format_kind, bits) -> numpy dtype name, for the dtypes cudalink frames can carry
_DTYPE_OF = {
    (FORMAT_UNSIGNED, 8): "uint8",
    (FORMAT_UNSIGNED, 16): "uint16",
    (FORMAT_UNSIGNED, 32): "uint32",
    (FORMAT_SIGNED, 8): "int8",
    (FORMAT_SIGNED, 16): "int16",
    (FORMAT_SIGNED, 32): "int32",
    (FORMAT_FLOAT, 16): "float16",
    (FORMAT_FLOAT, 32): "float32",
}
_KIND_BITS_OF = {name: kb for kb, name in _DTYPE_OF.items()}


# -- offsets --------------------------------------------------------------------------------------------


def segment_size(nslots: int) -> int:
    """Bytes of a segment with ``nslots`` slots: ``49 + 128·N``."""
    return HEADER_SIZE + SLOT_SIZE * nslots + 1 + META_SIZE + 8


def off_memory(slot: int) -> int:
    return OFF_SLOTS + SLOT_SIZE * slot


def off_event(slot: int) -> int:
    return OFF_SLOTS + SLOT_SIZE * slot + HANDLE_SIZE


def off_shutdown(nslots: int) -> int:
    return OFF_SLOTS + SLOT_SIZE * nslots


def off_metadata(nslots: int) -> int:
    return off_shutdown(nslots) + 1


def off_timestamp(nslots: int) -> int:
    return off_metadata(nslots) + META_SIZE


# -- records ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """The first 20 bytes."""

    magic: int
    version: int
    num_slots: int
    write_idx: int

    @property
    def release(self) -> str:
        """Which cuda-link releases write this magic."""
        return MAGICS.get(self.magic, f"unknown (0x{self.magic:08X})")

    @property
    def newest_slot(self) -> int | None:
        """Slot of the newest frame, None before the first publish."""
        return None if self.write_idx == 0 else (self.write_idx - 1) % self.num_slots


@dataclass(frozen=True)
class Metadata:
    """The 20 metadata bytes: the frame format every slot currently carries.

    ``format_kind``/``bits``/``flags`` are v1's fields; a v0.9 segment's dtype enum is read into them too
    (``dtype_code`` keeps the raw enum, None for v1).
    """

    width: int
    height: int
    num_comps: int
    format_kind: int
    bits: int
    flags: int
    data_size: int
    dtype_code: int | None = None

    @property
    def expected_size(self) -> int:
        return self.width * self.height * self.num_comps * self.bits // 8

    @property
    def dtype_name(self) -> str:
        """numpy's name for the element type; ``bfloat16`` where the flag says so."""
        if self.format_kind == FORMAT_FLOAT and self.bits == 16 and self.flags & FLAG_BFLOAT16:
            return "bfloat16"
        name = _DTYPE_OF.get((self.format_kind, self.bits))
        if name is None:
            kind = _KIND_NAMES.get(self.format_kind, f"kind {self.format_kind}")
            return f"{kind}{self.bits}"
        return name


@dataclass(frozen=True)
class Segment:
    """A whole segment as read at one moment."""

    header: Header
    memory_handles: tuple[bytes, ...]
    event_handles: tuple[bytes, ...]
    shutdown: bool
    metadata: Metadata
    timestamp: float


# -- reading -------------------------------------------------------------------------------------------------


def check_size(buf: bytes | bytearray | memoryview, what: str = "segment") -> None:
    """A segment too short for its header is refused by name."""
    if len(buf) < HEADER_SIZE:
        raise ProtocolError(
            f"cudalink: cuda-link {what} is {len(buf)} bytes, shorter than its {HEADER_SIZE}-byte header "
            f"(a truncated or foreign segment); restart the cuda-link producer"
        )


def read_header(buf: bytes | bytearray | memoryview, name: str = "") -> Header:
    """Parse and validate the header: magic, N in 1..10, and that the buffer holds all ``49 + 128·N`` bytes."""
    where = f" {name!r}" if name else ""
    check_size(buf, f"segment{where}")
    magic, version, nslots, write_idx = _HEADER.unpack_from(buf, 0)
    if magic not in MAGICS:
        raise ProtocolError(
            f"cudalink: segment{where} has magic 0x{magic:08X}, not cuda-link's 0x{MAGIC:08X} (v1.0+) or "
            f"0x{MAGIC_V09:08X} (v0.9); it was not written by cuda-link (or is not initialised yet)"
        )
    if not MIN_SLOTS <= nslots <= MAX_SLOTS:
        raise ProtocolError(
            f"cudalink: cuda-link segment{where} says it has {nslots} slots; the layout allows "
            f"{MIN_SLOTS}..{MAX_SLOTS} (a corrupt segment or one being initialised); restart its producer"
        )
    if magic == MAGIC_V09 and looks_like_v066(buf, nslots):
        raise ProtocolError(
            f"cudalink: cuda-link segment{where} has the layout of cuda-link v0.6.6 or older (192-byte slots; its "
            f"magic 0x{MAGIC_V09:08X} is shared with v0.6.7-v0.9, which use 128), which cudalink cannot read; "
            "upgrade cuda-link (its TouchDesigner component and Python package) to v1.0 or newer, then restart "
            "the producer"
        )
    need = segment_size(nslots)
    if len(buf) < need:
        raise ProtocolError(
            f"cudalink: cuda-link segment{where} is {len(buf)} bytes but {nslots} slots need {need} "
            f"(49 + 128·N): the segment is truncated; restart its producer"
        )
    return Header(magic, version, nslots, write_idx)


def looks_like_v066(buf: bytes | bytearray | memoryview, nslots: int) -> bool:
    """Whether a "CIPC" segment is cuda-link v0.6.6's or older (same magic and header, 192-byte slots).

    Its handle fields are 128 bytes of which ``cudaIpcGetMemHandle`` fills 64, so bytes 64..127 of every slot
    are zero, and its metadata sits at ``21 + 192·N``, past the end of a 128-byte segment of N slots (where
    a current one has nothing, or Windows' zero fill of a page-rounded mapping): both must hold."""
    old = OFF_SLOTS + V066_SLOT_SIZE * nslots
    if len(buf) < old + 1 + META_SIZE + 8:
        return False
    for i in range(nslots):
        at = OFF_SLOTS + V066_SLOT_SIZE * i + HANDLE_SIZE
        if any(buf[at : at + HANDLE_SIZE]):
            return False
    width, height, comps, code, _size = _META_V09.unpack_from(buf, old + 1)
    return bool(width > 0 and height > 0 and comps > 0 and code < len(V09_DTYPES))


def read_write_idx(buf: bytes | bytearray | memoryview) -> int:
    value: int = _U32.unpack_from(buf, OFF_WRITE_IDX)[0]
    return value


def read_version(buf: bytes | bytearray | memoryview) -> int:
    value: int = _U64.unpack_from(buf, OFF_VERSION)[0]
    return value


def read_shutdown(buf: bytes | bytearray | memoryview, nslots: int) -> bool:
    return bool(buf[off_shutdown(nslots)])


def read_timestamp(buf: bytes | bytearray | memoryview, nslots: int) -> float:
    value: float = _F64.unpack_from(buf, off_timestamp(nslots))[0]
    return value


def read_handles(buf: bytes | bytearray | memoryview, nslots: int, slot: int) -> tuple[bytes, bytes]:
    """(memory handle, event handle) of ``slot``: 64 bytes each; an all-zero event handle means none."""
    if not 0 <= slot < nslots:
        raise ProtocolError(f"cudalink: cuda-link slot {slot} is outside 0..{nslots - 1}")
    mem = off_memory(slot)
    return bytes(buf[mem : mem + HANDLE_SIZE]), bytes(buf[mem + HANDLE_SIZE : mem + SLOT_SIZE])


def read_metadata(buf: bytes | bytearray | memoryview, nslots: int, magic: int = MAGIC) -> Metadata:
    """Parse and validate the metadata (v1 or v0.9 by ``magic``): known dtype, non-zero sizes, data_size match."""
    off = off_metadata(nslots)
    if len(buf) < off + META_SIZE:
        raise ProtocolError(
            f"cudalink: cuda-link segment is {len(buf)} bytes, too short for its metadata at {off}; "
            f"restart its producer"
        )
    if magic == MAGIC_V09:
        width, height, comps, code, size = _META_V09.unpack_from(buf, off)
        if code >= len(V09_DTYPES):
            raise FormatError(
                f"cudalink: cuda-link v0.9 segment has dtype code {code}; v0.9 knows 0 float32, 1 float16, "
                f"2 uint8, 3 uint16 (upgrade the producer to cuda-link v1.0+)"
            )
        kind, bits = _KIND_BITS_OF[V09_DTYPES[code]]
        meta = Metadata(width, height, comps, kind, bits, 0, size, code)
    else:
        meta = Metadata(*_META_V1.unpack_from(buf, off))
    check_metadata(meta)
    return meta


class FormatNotPublished(FormatError):
    """The metadata's sizes are zero: the producer has not written a frame format yet (or the segment is
    corrupt). A reader waits for it rather than refusing the segment."""


def check_metadata(meta: Metadata) -> None:
    """What cuda-link's own TD receiver checks, plus what a cudalink frame needs."""
    if meta.width == 0 or meta.height == 0 or meta.num_comps == 0:
        raise FormatNotPublished(
            f"cudalink: cuda-link segment describes a {meta.width}x{meta.height}x{meta.num_comps} frame; its "
            f"producer has not published a format yet (or the segment is corrupt)"
        )
    if meta.format_kind not in _KIND_NAMES:
        raise FormatError(
            f"cudalink: cuda-link segment has format_kind {meta.format_kind}; the layout knows 0 signed, "
            f"1 unsigned, 2 float"
        )
    if meta.bits == 0 or meta.bits % 8:
        raise FormatError(f"cudalink: cuda-link segment has {meta.bits} bits per component; want 8, 16 or 32")
    if meta.data_size != meta.expected_size:
        raise FormatError(
            f"cudalink: cuda-link segment says data_size {meta.data_size} but {meta.width}x{meta.height}x"
            f"{meta.num_comps} at {meta.bits} bits is {meta.expected_size} bytes (cuda-link's own receiver "
            f"refuses this too); fix the producer's format"
        )


def read_segment(buf: bytes | bytearray | memoryview, name: str = "") -> Segment:
    """The whole segment, validated (a snapshot: the producer may change it while this runs)."""
    h = read_header(buf, name)
    n = h.num_slots
    handles = [read_handles(buf, n, i) for i in range(n)]
    return Segment(
        h,
        tuple(m for m, _ in handles),
        tuple(e for _, e in handles),
        read_shutdown(buf, n),
        read_metadata(buf, n, h.magic),
        read_timestamp(buf, n),
    )


# -- writing ---------------------------------------------------------------------------------------------


def write_write_idx(buf: bytearray | memoryview, value: int) -> None:
    _U32.pack_into(buf, OFF_WRITE_IDX, value & 0xFFFFFFFF)


#: the last version a u64 holds
MAX_VERSION = 0xFFFFFFFFFFFFFFFF


def write_version(buf: bytearray | memoryview, value: int) -> None:
    _U64.pack_into(buf, OFF_VERSION, value & MAX_VERSION)


def write_shutdown(buf: bytearray | memoryview, nslots: int, closing: bool) -> None:
    _U8.pack_into(buf, off_shutdown(nslots), 1 if closing else 0)


def write_timestamp(buf: bytearray | memoryview, nslots: int, value: float) -> None:
    _F64.pack_into(buf, off_timestamp(nslots), value)


def write_handles(buf: bytearray | memoryview, slot: int, memory: bytes, event: bytes) -> None:
    for what, h in (("memory", memory), ("event", event)):
        if len(h) != HANDLE_SIZE:
            raise ProtocolError(f"cudalink: a cuda-link {what} handle is {HANDLE_SIZE} bytes, got {len(h)}")
    off = off_memory(slot)
    buf[off : off + HANDLE_SIZE] = memory
    buf[off + HANDLE_SIZE : off + SLOT_SIZE] = event


def write_metadata(buf: bytearray | memoryview, nslots: int, meta: Metadata, magic: int = MAGIC) -> None:
    off = off_metadata(nslots)
    if magic == MAGIC_V09:
        name = meta.dtype_name
        if name not in V09_DTYPES:
            raise FormatError(f"cudalink: cuda-link v0.9 carries only {', '.join(V09_DTYPES)}, not {name}")
        code = V09_DTYPES.index(name)
        _META_V09.pack_into(buf, off, meta.width, meta.height, meta.num_comps, code, meta.data_size)
    else:
        _META_V1.pack_into(
            buf, off, meta.width, meta.height, meta.num_comps, meta.format_kind, meta.bits, meta.flags, meta.data_size
        )


def write_header_start(buf: bytearray | memoryview, magic: int, nslots: int) -> None:
    """Magic, N and write_idx = 0: the start of an initialisation (the version goes last)."""
    if len(buf) < segment_size(nslots):
        raise ProtocolError(f"cudalink: a {nslots}-slot cuda-link segment needs {segment_size(nslots)} bytes")
    _U32.pack_into(buf, OFF_MAGIC, magic)
    _U32.pack_into(buf, OFF_NUM_SLOTS, nslots)
    _U32.pack_into(buf, OFF_WRITE_IDX, 0)


def pack_segment(buf: bytearray | memoryview, seg: Segment) -> None:
    """Write a whole segment in the initialisation order: everything else first, the version last."""
    h = seg.header
    write_header_start(buf, h.magic, h.num_slots)
    _U32.pack_into(buf, OFF_WRITE_IDX, h.write_idx)
    for i, (m, e) in enumerate(zip(seg.memory_handles, seg.event_handles, strict=True)):
        write_handles(buf, i, m, e)
    write_shutdown(buf, h.num_slots, seg.shutdown)
    write_metadata(buf, h.num_slots, seg.metadata, h.magic)
    write_timestamp(buf, h.num_slots, seg.timestamp)
    write_version(buf, h.version)


# -- formats -------------------------------------------------------------------------------------------------


def spec_from_meta(meta: Metadata) -> FrameSpec:
    """The cudalink frame a cuda-link metadata describes: (height, width, num_comps), its dtype and pixel format.

    Row origin is bottom: the layout has no field for it, and every cuda-link endpoint moves TouchDesigner's
    memory as it is (its exporter copies a TOP's bottom-up rows, its importer hands the bytes to
    ``copyCUDAMemory``), so the frame says so (``t.flip(0)`` gives top-down rows).
    """
    name = meta.dtype_name
    if name not in _KIND_BITS_OF and name != "bfloat16":
        raise FormatError(f"cudalink: cuda-link segment carries {name} components, which cudalink does not support")
    return FrameSpec((meta.height, meta.width, meta.num_comps), name, None, _pixel_format(meta), RowOrigin.BOTTOM)


def _pixel_format(meta: Metadata) -> PixelFormat | None:
    c, bgra = meta.num_comps, bool(meta.flags & FLAG_BGRA)
    if c == 1:
        return PixelFormat.GRAY
    if c == 2:
        return None if meta.flags & FLAG_MONO_ALPHA else PixelFormat.RG  # luminance + alpha has no PixelFormat
    if c == 3:
        return PixelFormat.BGR if bgra else PixelFormat.RGB
    if c == 4:
        return PixelFormat.BGRA if bgra else PixelFormat.RGBA
    return None


def meta_from_spec(spec: FrameSpec) -> Metadata:
    """The metadata cuda-link receivers read for frames of ``spec``; refuse what the layout cannot carry."""
    if not spec.is_contiguous:
        raise FormatError(
            "cudalink: cuda-link frames are tightly packed HWC; this spec has strides (use a contiguous one)"
        )
    if spec.ndim == 2:
        height, width, comps = spec.shape[0], spec.shape[1], 1
    elif spec.ndim == 3:
        height, width, comps = spec.shape
    else:
        raise FormatError(f"cudalink: cuda-link frames are (height, width, channels) images; shape {spec.shape} is not")
    bf16 = spec.dtype.name == "bfloat16"  # v1's float 16 with its bfloat16 flag
    kb = (FORMAT_FLOAT, 16) if bf16 else _KIND_BITS_OF.get(spec.dtype.name)
    if kb is None:
        raise FormatError(
            f"cudalink: cuda-link's layout cannot carry {spec.dtype.name}; use one of "
            f"{', '.join(sorted(_KIND_BITS_OF))} (its TD components read uint8, uint16, float16, float32)"
        )
    pf = spec.pixel_format
    flags = (FLAG_BGRA if pf in (PixelFormat.BGRA, PixelFormat.BGR) else 0) | (FLAG_BFLOAT16 if bf16 else 0)
    size = height * width * comps * spec.itemsize
    if size > 0xFFFFFFFF or max(height, width, comps) > 0xFFFFFFFF:
        raise FormatError(f"cudalink: a cuda-link frame holds at most 4 GiB (u32 data_size); {spec.shape} does not fit")
    return Metadata(width, height, comps, kb[0], kb[1], flags, size)


def allocation_size(nbytes: int) -> int:
    """What cuda-link allocates for a slot of ``nbytes``: rounded up to 2 MiB (at least one granule)."""
    return max(1, math.ceil(nbytes / ALLOC_GRANULARITY)) * ALLOC_GRANULARITY


def dtype_of(meta: Metadata) -> np.dtype[np.generic]:
    """The numpy dtype of ``meta`` (a :class:`FormatError` for a type cudalink frames do not carry)."""
    return spec_from_meta(meta).dtype
