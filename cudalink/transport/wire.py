"""The wire layout: every byte that crosses a process boundary is defined here and nowhere else.

All integers are little-endian. A link is one shared header segment (below) plus, for the host
backend, one data segment; the control socket carries only HELLO / WELCOME / REJECT and then
single wake-up bytes.

Header segment::

    region      offset                      size                       writer
    ---------   -------------------------   ------------------------   ---------------------------
    fixed       0                           FIXED_SIZE (256)           producer
    stamps      FIXED_SIZE                  8 * nslots                 producer (per-slot seqlock)
    records     + stamps                    RECORD_SIZE * nslots       producer (while stamp odd)
    handles     + records                   HANDLE_SIZE * nslots       producer, once at start
    leases      + handles                   8 * nslots * nconsumers    consumer c writes column c
    fences      + leases                    4 * nslots * nconsumers    consumer sets, producer clears
    consumers   + fences                    CONSUMER_SIZE(nslots) * nconsumers

Fixed part (``FIXED``)::

    off  type  field           meaning
    0    8s    magic           b"CUDALINK"
    8    u16   version         LAYOUT_VERSION; any other value is refused
    10   u16   backend         BACKEND_HOST / BACKEND_CUDA_POOL / BACKEND_CUDA_LEGACY
    12   u32   header_size     total bytes of this segment, checked against the slot/consumer counts
    16   u64   generation      random, nonzero, new at every producer start (restarts are visible)
    24   u32   pid             producer pid
    28   u32   flags           FLAG_READY | FLAG_SHUTDOWN | FLAG_PRODUCER_WAITING
    32   u16   nslots          1..MAX_SLOTS
    34   u16   nconsumers      1..MAX_CONSUMERS (table entries)
    36   i32   device          CUDA ordinal in the producer (-1 = host)
    40   u64   capacity        bytes per slot
    48   u64   published       frames published
    56   u64   dropped         frames dropped because every slot was held
    64   u64   last_publish_ns time.time_ns() of the last publish (liveness for monitors)
    72   u64   created_ns      time.time_ns() at start
    80   16s   device_uuid     GPU UUID, so a consumer opens the same GPU whatever its CUDA_VISIBLE_DEVICES
    96   u64   data_size       bytes of the host data segment (0 for CUDA)
    104  ...   reserved (zero)

Slot stamps (``u64`` each): 0 = never written; odd ``2*seq+1`` = being written; even ``2*seq`` =
holds frame ``seq``. A consumer reads a stamp, takes a lease, and re-reads the stamp: equal and
even means the slot is its to read. The producer claims a slot by making its stamp odd only when no
lease is set, and re-checks the leases after the claim. The two sides write-then-read opposite
cells (a Dekker handshake), so each side puts a full fence between its store and its load
(``cudalink._ring.full_fence`` in Python, a C fence in ``cudalink._native.ring``). Stamps only ever
change in their lowest byte first (even to odd to even), so a torn read never shows a stale even stamp as
a newer one; the compiled ring stores each cell in one aligned 8-byte write. A stamp that stays even under
a consumer's lease while the slot's record names another frame is something no producer writes: a consumer
raises ``ProtocolError`` for it, and gives up (no frame) after ``TAKE_RETRIES`` stamps in a row that moved
under its lease, so a header that lies never holds a ``recv`` past its deadline.

Slot record (``RECORD``, valid while the stamp is even and unchanged)::

    0 u64 seq | 8 u64 timestamp_ns | 16 u64 nbytes | 24 u8 ndim | 25 u8 dtype | 26 u8 pixel format |
    27 u8 origin | 28 u8 meta_len | 32 u64[8] shape | 96 i64[8] byte strides (0s = contiguous) | 160 64s meta

Slot handles (``HANDLE``, static for the producer's life)::

    0 64s memory handle (pool: CUmemPoolPtrExportData; legacy: CUipcMemHandle; host: unused) |
    64 u64 memory size / host offset | 72 64s ready-event handle (CUipcEventHandle) | 136 u8 event flags

Consumer entry (``CONSUMER`` + per-slot release-event handles)::

    0 u32 state (0 free, 1 joined) | 4 u32 pid | 8 u64 token | 16 u64 received | 24 u64 skipped |
    32 u64 joined_ns | 40 u64 last_recv_ns | 48 u32 waiting (non-zero while blocked: see below) |
    52 12s reserved | 64 + 72*i: 64s release-event handle, u64 flags

    ``waiting`` is the futex-style half of wake-ups: the consumer sets it, fences, re-checks the stamps, then
    sleeps; the producer publishes, fences, and wakes only consumers whose ``WAIT_ON`` bit is set.
    ``WAIT_AHEAD`` (3) also asks to be woken *ahead*: as soon as ``send()`` has claimed a slot, so the OS
    wake overlaps the copy; the producer swaps it to ``WOKEN_AHEAD`` (2, a wake-up is in flight: none is
    sent after the publish) and the woken consumer spins up to ``AHEAD_SPIN_NS`` for the frame. The
    producer wakes ahead only while its sends take under ``AHEAD_MAX_NS`` from claim to publish.

Control messages (a Unix socket; each message is one ``send``)::

    HELLO   consumer -> producer  b"CLHI" u16 version u16 0 u64 generation u64 token u32 pid    (28 bytes)
    WELCOME producer -> consumer  b"CLOK" u16 version u16 consumer index u64 generation u32 nfds (24 bytes)
                                  + nfds file descriptors via SCM_RIGHTS (the CUDA pool's)
    REJECT  producer -> consumer  b"CLNO" u16 version u16 reason, then up to 200 bytes of UTF-8 text
    then    producer -> consumer  b"\\x01" per publish while the consumer is waiting, b"\\x00" on shutdown; EOF = gone
            consumer -> producer  b"R": "I released a lease" (only while FLAG_PRODUCER_WAITING is set)

The control channel is a Unix socket (the peer's uid is checked with SO_PEERCRED, fds can be passed) or,
where those are missing (Windows), loopback TCP. The TCP channel publishes a rendezvous file
``<name>.tcp`` (0600, in the private runtime directory) and admits only consumers that prove they
could read it::

    RENDEZVOUS  file                  b"CLRV" u16 version u16 port u32 pid u64 generation 32s key    (52 bytes)
    CHALLENGE   producer -> consumer  32 random bytes, sent at accept
    PROOF       consumer -> producer  HMAC-SHA256(key, b"cudalink-proof" + challenge), then HELLO
                                      (a wrong proof gets REJECT_KEY: the consumer re-reads the file and retries)

Over TCP the header segment is named per generation (``-h<generation>``, from the rendezvous file):
Windows keeps a segment alive while any process maps it, so a restarted producer needs a fresh name.
"""

from __future__ import annotations

import hmac
import mmap
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ProtocolError, ProtocolReason
from ..frames.spec import MAX_NDIM, META_MAX, SUPPORTED_DTYPES, FrameSpec, PixelFormat, RowOrigin

#: what a header is written in: a SharedMemory's memoryview, or a bytearray in tests
Buf = memoryview | bytearray
#: what a header is read from: also a read-only mapping (``mmap``) or a snapshot (``bytes``), for monitors
ReadBuf = memoryview | bytearray | bytes | mmap.mmap

MAGIC = b"CUDALINK"
LAYOUT_VERSION = 1
MAX_SLOTS = 64
MAX_CONSUMERS = 64
HANDLE_BYTES = 64

BACKEND_HOST = 0
BACKEND_CUDA_POOL = 1
BACKEND_CUDA_LEGACY = 2
BACKEND_NAMES = {BACKEND_HOST: "host", BACKEND_CUDA_POOL: "cuda-pool", BACKEND_CUDA_LEGACY: "cuda-legacy"}

FLAG_READY = 1
FLAG_SHUTDOWN = 2
FLAG_PRODUCER_WAITING = 4

# a consumer entry's ``waiting`` word
WAIT_OFF = 0
WAIT_ON = 1  # sleeping: wake me once the frame is published
WOKEN_AHEAD = 2  # written by the producer: a wake-up ahead of the frame is on its way
WAIT_AHEAD = 3  # sleeping: wake me when a send starts (WAIT_ON | 2), I spin for the rest
AHEAD_MAX_NS = 200_000  # a producer whose sends take longer (claim -> publish) does not wake ahead
AHEAD_SPIN_NS = 300_000  # how long a consumer woken ahead spins for its frame before sleeping again

FIXED = struct.Struct("<8sHHIQIIHHiQQQQQ16sQ")
FIXED_SIZE = 256
RECORD = struct.Struct("<QQQBBBBB3x8Q8q64s")
RECORD_SIZE = 256
HANDLE = struct.Struct("<64sQ64sB")
HANDLE_SIZE = 192
CONSUMER = struct.Struct("<IIQQQQQ16x")
CONSUMER_FIXED = 64
RELEASE = struct.Struct("<64sQ")
HELLO = struct.Struct("<4sHHQQI")
WELCOME = struct.Struct("<4sHHQI")
REJECT = struct.Struct("<4sHH")
REJECT_TEXT_MAX = 200
RENDEZVOUS = struct.Struct("<4sHHIQ32s")
CHALLENGE_SIZE = 32
PROOF_SIZE = 32
KEY_SIZE = 32

# stable codes: append only
DTYPE_CODES: dict[str, int] = {name: i + 1 for i, name in enumerate(SUPPORTED_DTYPES)}
DTYPE_NAMES: dict[int, str] = {v: k for k, v in DTYPE_CODES.items()}
PIXFMT_CODES: dict[PixelFormat | None, int] = {None: 0, **{pf: i + 1 for i, pf in enumerate(PixelFormat)}}
PIXFMT_BY_CODE: dict[int, PixelFormat | None] = {v: k for k, v in PIXFMT_CODES.items()}
ORIGIN_CODES = {RowOrigin.TOP: 0, RowOrigin.BOTTOM: 1}
ORIGIN_BY_CODE = {v: k for k, v in ORIGIN_CODES.items()}

# fixed-header field offsets used on hot paths
OFF_FLAGS = 28
OFF_PUBLISHED = 48
OFF_DROPPED = 56
OFF_LAST_PUBLISH = 64
CONSUMER_OFF_RECEIVED = 16  # u64 received, then u64 skipped
CONSUMER_OFF_LAST_RECV = 40
CONSUMER_OFF_WAITING = 48

REJECT_GENERATION = 1
REJECT_FULL = 2
REJECT_UID = 3
REJECT_BAD_HELLO = 4
REJECT_CLOSING = 5
REJECT_KEY = 6  # the loopback channel's proof failed: a stale rendezvous file, so re-read it
#: what each REJECT code means to the consumer (``ProtocolError.reason``; ``.retryable`` says whether to retry)
REJECT_REASONS = {
    REJECT_GENERATION: ProtocolReason.STALE_GENERATION,
    REJECT_FULL: ProtocolReason.FULL,
    REJECT_UID: ProtocolReason.WRONG_USER,
    REJECT_BAD_HELLO: ProtocolReason.BAD_HELLO,
    REJECT_CLOSING: ProtocolReason.CLOSING,
    REJECT_KEY: ProtocolReason.STALE_KEY,
}

assert FIXED.size <= FIXED_SIZE and RECORD.size <= RECORD_SIZE and HANDLE.size <= HANDLE_SIZE
assert CONSUMER.size == CONSUMER_FIXED


class Layout:
    """Offsets of every region for a given slot and consumer count.

    Every offset is computed once here: the ring reads them on each frame.
    """

    __slots__ = (
        "column_struct",
        "consumer_size",
        "consumers",
        "fence_column_struct",
        "fences",
        "handles",
        "leases",
        "nconsumers",
        "nslots",
        "records",
        "size",
        "stamps",
        "stamps_struct",
    )

    def __init__(self, nslots: int, nconsumers: int) -> None:
        if not 1 <= nslots <= MAX_SLOTS:
            raise ProtocolError(f"cudalink: slot count {nslots} outside 1..{MAX_SLOTS}")
        if not 1 <= nconsumers <= MAX_CONSUMERS:
            raise ProtocolError(f"cudalink: consumer count {nconsumers} outside 1..{MAX_CONSUMERS}")
        self.nslots = nslots
        self.nconsumers = nconsumers
        self.stamps = FIXED_SIZE
        self.records = self.stamps + 8 * nslots
        self.handles = self.records + RECORD_SIZE * nslots
        self.leases = self.handles + HANDLE_SIZE * nslots
        self.fences = self.leases + 8 * nslots * nconsumers
        self.consumers = self.fences + 4 * nslots * nconsumers
        self.consumer_size = CONSUMER_FIXED + RELEASE.size * nslots
        self.size = self.consumers + self.consumer_size * nconsumers
        #: all stamps in one unpack; one slot's lease (or fence) cells across consumers in one unpack
        self.stamps_struct = struct.Struct(f"<{nslots}Q")
        self.column_struct = struct.Struct(f"<{nconsumers}Q")
        self.fence_column_struct = struct.Struct(f"<{nconsumers}I")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self.nslots, self.nconsumers) == (other.nslots, other.nconsumers)

    def __hash__(self) -> int:
        return hash((self.nslots, self.nconsumers))

    def __repr__(self) -> str:
        return f"Layout(nslots={self.nslots}, nconsumers={self.nconsumers})"

    def stamp(self, slot: int) -> int:
        return self.stamps + 8 * slot

    def record(self, slot: int) -> int:
        return self.records + RECORD_SIZE * slot

    def handle(self, slot: int) -> int:
        return self.handles + HANDLE_SIZE * slot

    def lease(self, slot: int, consumer: int) -> int:
        """Leases are slot-major, so the producer reads one slot's column in one unpack."""
        return self.leases + 8 * (slot * self.nconsumers + consumer)

    def fence(self, slot: int, consumer: int) -> int:
        return self.fences + 4 * (slot * self.nconsumers + consumer)

    def consumer(self, index: int) -> int:
        return self.consumers + self.consumer_size * index

    def release_handle(self, index: int, slot: int) -> int:
        return self.consumer(index) + CONSUMER_FIXED + RELEASE.size * slot


@dataclass(frozen=True)
class Fixed:
    """The decoded fixed header."""

    backend: int
    header_size: int
    generation: int
    pid: int
    flags: int
    nslots: int
    nconsumers: int
    device: int
    capacity: int
    published: int
    dropped: int
    last_publish_ns: int
    created_ns: int
    device_uuid: bytes
    data_size: int

    @property
    def layout(self) -> Layout:
        return Layout(self.nslots, self.nconsumers)


def header_pending(buf: ReadBuf) -> bool:
    """A segment whose producer has not finished its header yet: no magic at all (see :func:`write_fixed`)."""
    return not any(bytes(buf[: len(MAGIC)]))


def write_fixed(buf: Buf, f: Fixed) -> None:
    """The whole fixed header, its magic last: a consumer that maps the segment while the producer is still
    writing sees either no magic (:func:`header_pending`: wait) or a complete header, never half of one."""
    FIXED.pack_into(
        buf,
        0,
        bytes(len(MAGIC)),
        LAYOUT_VERSION,
        f.backend,
        f.header_size,
        f.generation,
        f.pid,
        f.flags,
        f.nslots,
        f.nconsumers,
        f.device,
        f.capacity,
        f.published,
        f.dropped,
        f.last_publish_ns,
        f.created_ns,
        f.device_uuid,
        f.data_size,
    )
    buf[: len(MAGIC)] = MAGIC


def read_fixed(buf: ReadBuf, segment_size: int | None = None) -> Fixed:
    """Decode and validate the fixed header; anything inconsistent is a :class:`ProtocolError`."""
    if len(buf) < FIXED_SIZE:
        raise ProtocolError(f"cudalink: header segment is {len(buf)} bytes, smaller than the {FIXED_SIZE}-byte header")
    magic, version, *rest = FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ProtocolError(f"cudalink: not a cudalink segment (magic {magic!r}); is another program using the name?")
    if version != LAYOUT_VERSION:
        raise ProtocolError(
            f"cudalink: producer speaks layout version {version}, this cudalink speaks {LAYOUT_VERSION}; "
            "install the same cudalink version on both sides"
        )
    f = Fixed(*rest)
    if f.backend not in BACKEND_NAMES:
        raise ProtocolError(f"cudalink: unknown backend code {f.backend} in header")
    layout = Layout(f.nslots, f.nconsumers)
    if f.header_size != layout.size:
        raise ProtocolError(f"cudalink: header claims {f.header_size} bytes but its counts need {layout.size}")
    limit = len(buf) if segment_size is None else segment_size
    if f.header_size > limit:
        raise ProtocolError(f"cudalink: header claims {f.header_size} bytes but the segment has {limit}")
    if f.generation == 0:
        raise ProtocolError("cudalink: header has generation 0 (not initialised)")
    if f.capacity <= 0 or f.capacity > (1 << 40):
        raise ProtocolError(f"cudalink: slot capacity {f.capacity} is out of range")
    if f.backend == BACKEND_HOST and f.data_size < f.capacity * f.nslots:
        raise ProtocolError(f"cudalink: host data segment of {f.data_size} bytes cannot hold {f.nslots} slots")
    return f


U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
U64X2 = struct.Struct("<QQ")
U64X3 = struct.Struct("<QQQ")
_u64_unpack = U64.unpack_from
_u32_unpack = U32.unpack_from


def read_u64(buf: ReadBuf, off: int) -> int:
    return int(_u64_unpack(buf, off)[0])


def write_u64(buf: Buf, off: int, value: int) -> None:
    U64.pack_into(buf, off, value)


def read_u32(buf: ReadBuf, off: int) -> int:
    return int(_u32_unpack(buf, off)[0])


def write_u32(buf: Buf, off: int, value: int) -> None:
    U32.pack_into(buf, off, value)


def read_stamps(buf: ReadBuf, layout: Layout) -> tuple[int, ...]:
    return layout.stamps_struct.unpack_from(buf, layout.stamps)  # type: ignore[no-any-return]


def read_column(buf: ReadBuf, layout: Layout, slot: int) -> tuple[int, ...]:
    """All consumers' lease cells of one slot."""
    return layout.column_struct.unpack_from(buf, layout.lease(slot, 0))  # type: ignore[no-any-return]


# -- slot records ---------------------------------------------------------------------------------------


#: how many times in a row a consumer's ``take`` looks again after losing a slot to the producer before it gives up
TAKE_RETRIES = 1000


def stamp_lie(slot: int, seq: int, recorded: int) -> str:
    """The message of a slot whose stamp and record disagree (both cores raise it)."""
    return (
        f"cudalink: slot {slot}'s stamp says frame {seq} but its record holds frame {recorded}: the link's header "
        "is corrupt (something other than the producer wrote to it); restart the producer"
    )


class SlotRecord(NamedTuple):
    seq: int
    timestamp_ns: int
    spec: FrameSpec
    meta: bytes


_SPEC_BYTES = slice(16, 160)  # nbytes .. strides (meta_len included): everything that defines the spec
_META_LEN = 28 - _SPEC_BYTES.start  # meta_len's index inside those bytes
_SPEC_RECORD = struct.Struct("<QBBBBB3x8Q8q")  # the record's bytes 16..160
_spec_cache: dict[bytes, FrameSpec] = {}


def spec_bytes(spec: FrameSpec) -> bytes:
    """The record bytes 16..160 for ``spec`` (meta_len 0), packed once per spec object and kept on it."""
    raw: bytes | None = spec.__dict__.get("_wire")
    if raw is None:
        pad = MAX_NDIM - spec.ndim
        strides = (*spec.strides, *(0,) * pad) if spec.strides is not None else (0,) * MAX_NDIM
        raw = _SPEC_RECORD.pack(
            spec.nbytes,
            spec.ndim,
            DTYPE_CODES[spec.dtype.name],
            PIXFMT_CODES[spec.pixel_format],
            ORIGIN_CODES[spec.origin],
            0,
            *spec.shape,
            *(0,) * pad,
            *strides,
        )
        object.__setattr__(spec, "_wire", raw)
    return raw


def pack_record(buf: Buf, off: int, seq: int, timestamp_ns: int, spec: FrameSpec, meta: bytes) -> None:
    """Write a slot record: the spec's bytes are packed once per spec, so a frame writes two integers."""
    pack_record_spec(buf, off, spec, meta)
    U64X2.pack_into(buf, off, seq, timestamp_ns)


def pack_record_spec(buf: Buf, off: int, spec: FrameSpec, meta: bytes) -> None:
    """Everything of a record but ``seq`` and ``timestamp_ns`` (bytes 0..16), which the publisher writes last."""
    mlen = len(meta)
    if mlen > META_MAX:
        raise ProtocolError(f"cudalink: meta is {mlen} bytes; at most {META_MAX} travel with a frame")
    buf[off + 16 : off + 160] = spec_bytes(spec)
    if mlen:
        buf[off + 28] = mlen
        buf[off + 160 : off + 160 + mlen] = meta


def unpack_record(buf: ReadBuf, off: int, capacity: int) -> SlotRecord:
    """Decode a slot record; a record that lies about its sizes is a :class:`ProtocolError`, never a crash.

    Validated specs are cached by their raw bytes: a stream repeats one spec, and rebuilding it is most
    of a ``recv``'s CPU cost. Only records that passed full validation enter the cache.
    """
    raw = bytes(buf[off + 16 : off + 160])
    spec = _spec_cache.get(raw)
    if spec is None or spec.nbytes > capacity:
        rec = _unpack_record(buf, off, capacity)
        if len(_spec_cache) > 256:
            _spec_cache.clear()
        _spec_cache[raw] = rec.spec
        return rec
    seq, ts = U64X2.unpack_from(buf, off)
    mlen = raw[_META_LEN]
    return SlotRecord(seq, ts, spec, bytes(buf[off + 160 : off + 160 + mlen]) if mlen else b"")


def _unpack_record(buf: ReadBuf, off: int, capacity: int) -> SlotRecord:
    vals = RECORD.unpack_from(buf, off)
    seq, ts, nbytes, ndim, dcode, pcode, ocode, mlen = vals[:8]
    shape, strides, meta = vals[8:16], vals[16:24], vals[24]
    if not 1 <= ndim <= MAX_NDIM:
        raise ProtocolError(f"cudalink: slot record has ndim {ndim}")
    if dcode not in DTYPE_NAMES or pcode not in PIXFMT_BY_CODE or ocode not in ORIGIN_BY_CODE:
        raise ProtocolError(f"cudalink: slot record has unknown codes dtype={dcode} format={pcode} origin={ocode}")
    if mlen > META_MAX:
        raise ProtocolError(f"cudalink: slot record meta length {mlen} > {META_MAX}")
    st = tuple(strides[:ndim])
    try:
        spec = FrameSpec(
            shape[:ndim],
            DTYPE_NAMES[dcode],
            None if not any(st) else st,
            PIXFMT_BY_CODE[pcode],
            ORIGIN_BY_CODE[ocode],
        )
    except ValueError as exc:
        raise ProtocolError(f"cudalink: slot record holds an invalid spec: {exc}") from exc
    if spec.nbytes != nbytes or nbytes > capacity:
        raise ProtocolError(f"cudalink: slot record spans {spec.nbytes} bytes (says {nbytes}), slot holds {capacity}")
    return SlotRecord(seq, ts, spec, bytes(meta[:mlen]))


# -- static handles ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotHandle:
    memory: bytes
    size: int
    event: bytes
    event_flags: int


def pack_handle(buf: Buf, off: int, h: SlotHandle) -> None:
    HANDLE.pack_into(buf, off, h.memory, h.size, h.event, h.event_flags)


def unpack_handle(buf: ReadBuf, off: int) -> SlotHandle:
    mem, size, ev, flags = HANDLE.unpack_from(buf, off)
    return SlotHandle(bytes(mem), size, bytes(ev), flags)


# -- control messages ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    generation: int
    token: int
    pid: int


@dataclass(frozen=True)
class Welcome:
    index: int
    generation: int
    nfds: int


def pack_hello(h: Hello) -> bytes:
    return HELLO.pack(b"CLHI", LAYOUT_VERSION, 0, h.generation, h.token, h.pid)


def _unpack_checked(st: struct.Struct, data: bytes, magic: bytes, what: str) -> tuple[Any, ...]:
    """The size, magic and version checks every fixed-size message shares; returns the fields after them."""
    if len(data) != st.size:
        raise ProtocolError(f"cudalink: {what} is {len(data)} bytes, expected {st.size}")
    got, version, *rest = st.unpack(data)
    if got != magic:
        raise ProtocolError(f"cudalink: bad {what} magic {got!r}")
    if version != LAYOUT_VERSION:
        raise ProtocolError(f"cudalink: {what} is version {version}, this cudalink speaks {LAYOUT_VERSION}")
    return tuple(rest)


def unpack_hello(data: bytes) -> Hello:
    _, gen, token, pid = _unpack_checked(HELLO, data, b"CLHI", "HELLO")
    return Hello(gen, token, pid)


def pack_welcome(w: Welcome) -> bytes:
    return WELCOME.pack(b"CLOK", LAYOUT_VERSION, w.index, w.generation, w.nfds)


def pack_reject(reason: int, text: str) -> bytes:
    return REJECT.pack(b"CLNO", LAYOUT_VERSION, reason) + text.encode()[:REJECT_TEXT_MAX]


def unpack_reply(data: bytes, max_consumers: int) -> Welcome:
    """Decode the producer's answer to HELLO; a REJECT becomes a ProtocolError carrying its reason and text."""
    if len(data) >= REJECT.size and data[:4] == b"CLNO":
        _, _, reason = REJECT.unpack_from(data)
        text = data[REJECT.size : REJECT.size + REJECT_TEXT_MAX].decode("utf-8", "replace")
        why = REJECT_REASONS.get(reason, ProtocolReason.REFUSED)
        raise ProtocolError(f"cudalink: producer refused to attach (reason {reason}, {why.value}): {text}", why)
    if len(data) != WELCOME.size:
        raise ProtocolError(f"cudalink: WELCOME is {len(data)} bytes, expected {WELCOME.size}")
    magic, version, index, gen, nfds = WELCOME.unpack(data)
    if magic != b"CLOK" or version != LAYOUT_VERSION:
        raise ProtocolError(f"cudalink: bad WELCOME ({magic!r}, version {version})")
    if index >= max_consumers:
        raise ProtocolError(f"cudalink: WELCOME names consumer slot {index} of {max_consumers}")
    if nfds > 4:
        raise ProtocolError(f"cudalink: WELCOME announces {nfds} descriptors")
    return Welcome(index, gen, nfds)


# -- loopback channel: rendezvous file and admission proof ----------------------------------------------------


@dataclass(frozen=True)
class Rendezvous:
    port: int
    pid: int
    generation: int
    key: bytes


def pack_rendezvous(r: Rendezvous) -> bytes:
    return RENDEZVOUS.pack(b"CLRV", LAYOUT_VERSION, r.port, r.pid, r.generation, r.key)


def unpack_rendezvous(data: bytes) -> Rendezvous:
    port, pid, gen, key = _unpack_checked(RENDEZVOUS, data, b"CLRV", "rendezvous file")
    if port == 0 or gen == 0:
        raise ProtocolError(f"cudalink: rendezvous file names port {port}, generation {gen}")
    return Rendezvous(port, pid, gen, key)


def proof(key: bytes, challenge: bytes) -> bytes:
    """What a consumer sends back for a challenge: only a reader of the 0600 rendezvous file can make it."""
    return hmac.new(key, b"cudalink-proof" + challenge, "sha256").digest()


def check_proof(key: bytes, challenge: bytes, answer: bytes) -> bool:
    return len(answer) == PROOF_SIZE and hmac.compare_digest(proof(key, challenge), answer)
