"""The network messages of ``ucx://`` links: every byte that crosses a host boundary is defined here.

UCX moves the bytes (tag send/recv on one endpoint per remote consumer); this file says what they mean.
Every message is exactly ``MSG_SIZE`` bytes, so a receiver always posts one fixed buffer and a peer
cannot make it allocate anything: a message of another size is refused by UCX (truncated) or lacks the
trailer. One exception, which the client asks for: a small frame's pixels may follow its FRAME header in
the same message (``inline``), into a buffer the client posted at ``MSG_SIZE + inline`` bytes. All
integers are little-endian::

    0   4s  magic    b"CLUX"
    4   u16 version  VERSION; any other value is refused
    6   u16 kind     one of the kinds below
    8   ... body     (per kind, zero padded)
    MSG_SIZE-4  4s   trailer b"CLUE" (a short message leaves the zeroed receive buffer without it)

Kinds and bodies::

    CHALLENGE  server -> client  32s nonce                                   (sent at connect)
    HELLO      client -> server  32s proof, u8 latest, u8 GPU memory as is, u16 credits, u16 name length,
                                 16s host (the client's boot id: is it the server's host?),
                                 u32 inline (the most pixel bytes it takes inside a FRAME message; 0: none), name
    WELCOME    server -> client  u64 generation, u64 capacity, u16 credits, u8 producer backend,
                                 u8 staged (1: GPU frames travel as host bytes), 4x pad,
                                 u64 floor (frames published before this consumer joined)
    REJECT     server -> client  u16 reason, u16 text length, text (at most REJECT_TEXT_MAX bytes of UTF-8)
    FRAME      server -> client  u64 generation, u64 server skipped, 256s slot record (transport.wire.RECORD:
                                 seq, timestamp, spec, meta), u8 inline; inline 0: then one message of
                                 exactly ``nbytes`` bytes, the pixels (GPU memory as UCX moves it, or host
                                 bytes where staged); inline 1: the ``nbytes`` host bytes follow the trailer
                                 in this message (at most the client's HELLO inline). One message instead of
                                 two saves a small frame a network round: the receive is already posted.
    CREDIT     client -> server  u32 frames released (each lets the server send one more)
    PING       either way        nothing: "still here" while idle (a peer silent for DEAD_AFTER_S is gone)
    BYE        either way        u16 reason, u16 text length, text: the sender closes the connection
                                 (R_SILENT from a server: the client was dropped for silence, and a client
                                 that was only stalled connects again: a new HELLO, the same generation);
                                 at BYE_LAST_OFF u64 last: from a server, the seq of the producer's last frame
                                 (0: not known), so a consumer counts the frames it never got as skipped

``proof`` is HMAC-SHA256(key, b"cudalink-ucx-proof" + nonce): a client proves it holds the shared key
before the server says anything about the link (not even whether ``name`` exists).
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

from .. import _platform
from ..errors import ArgumentError, ArgumentTypeError, ProtocolError, ProtocolReason
from ..frames.spec import FrameSpec
from . import wire

MAGIC = b"CLUX"
TRAILER = b"CLUE"
VERSION = 3
MSG_SIZE = 320
HEAD = struct.Struct("<4sHH")
BODY_OFF = HEAD.size
TRAILER_OFF = MSG_SIZE - len(TRAILER)
NONCE_SIZE = 32
PROOF_SIZE = 32
KEY_SIZE = 32
NAME_MAX = 64
HOST_ID_SIZE = 16
REJECT_TEXT_MAX = 200
#: the most pixel bytes a client takes inline in a FRAME message (its receive buffer grows by this much)
INLINE_MAX = 1 << 16
MAX_CREDITS = 64  # receive buffers a client may hold; the server leases at most one slot per consumer at a time
DEFAULT_PORT = 13337

CHALLENGE = 1
HELLO = 2
WELCOME = 3
REJECT = 4
FRAME = 5
CREDIT = 6
PING = 7
BYE = 8
KIND_NAMES = {
    CHALLENGE: "CHALLENGE",
    HELLO: "HELLO",
    WELCOME: "WELCOME",
    REJECT: "REJECT",
    FRAME: "FRAME",
    CREDIT: "CREDIT",
    PING: "PING",
    BYE: "BYE",
}

_HELLO = struct.Struct("<32sBBHH16sI")
_WELCOME = struct.Struct("<QQHBBxxxxQ")
_TEXT = struct.Struct("<HH")
_FRAME = struct.Struct("<QQ")
_CREDIT = struct.Struct("<I")
_LAST = struct.Struct("<Q")
#: where a BYE keeps ``last``: after the longest text
BYE_LAST_OFF = BODY_OFF + _TEXT.size + REJECT_TEXT_MAX

# REJECT / BYE reasons (stable codes: append only)
R_KEY = 1  #: the proof was wrong: the client's key is not the server's
R_NO_LINK = 2  #: no producer publishes that name on the server's host now (retryable)
R_FULL = 3  #: the server serves as many consumers as it will
R_BAD_MESSAGE = 4  #: the peer sent something this version cannot read
R_CLOSING = 5  #: the server is shutting down
R_PRODUCER_GONE = 6  #: the producer of the link closed or died (retryable: a new one may start)
R_NAME = 7  #: the name is not a valid link name
R_CLIENT_CLOSE = 8  #: the client left
R_SERVER_ERROR = 9  #: the server failed to send a frame (its text says why; retryable)
#: the server heard nothing from this consumer for DEAD_AFTER_S and gave its frames back; a consumer that
#: was only stalled (its process held the GIL) connects again and carries on
R_SILENT = 10
#: the producer of the link closed it cleanly: the frames it published before were sent first (retryable)
R_PRODUCER_CLOSED = 11
REASON_TEXT = {
    R_KEY: "wrong key",
    R_NO_LINK: "no such link",
    R_FULL: "server full",
    R_BAD_MESSAGE: "bad message",
    R_CLOSING: "server closing",
    R_PRODUCER_GONE: "producer gone",
    R_NAME: "invalid name",
    R_CLIENT_CLOSE: "client left",
    R_SERVER_ERROR: "server error",
    R_SILENT: "dropped while silent",
    R_PRODUCER_CLOSED: "producer closed",
}
RETRYABLE = frozenset({R_NO_LINK, R_PRODUCER_GONE, R_CLOSING, R_FULL, R_SERVER_ERROR, R_SILENT, R_PRODUCER_CLOSED})

_PING_BYTES: bytes | None = None


def _message(kind: int, body: bytes) -> bytes:
    if len(body) > TRAILER_OFF - BODY_OFF:
        raise ProtocolError(f"cudalink: a {KIND_NAMES.get(kind, kind)} body of {len(body)} bytes does not fit")
    pad = TRAILER_OFF - BODY_OFF - len(body)
    return HEAD.pack(MAGIC, VERSION, kind) + body + b"\0" * pad + TRAILER


def kind_of(msg: bytes | bytearray | memoryview) -> int:
    """Check the frame of any message (size, magic, version, trailer, kind) and return its kind."""
    if len(msg) != MSG_SIZE:
        raise ProtocolError(f"cudalink: a ucx message is {len(msg)} bytes, expected {MSG_SIZE}")
    magic, version, kind = HEAD.unpack_from(msg)
    if magic != MAGIC:
        raise ProtocolError(f"cudalink: bad ucx message magic {bytes(magic)!r} (not a cudalink peer?)")
    if version != VERSION:
        raise ProtocolError(
            f"cudalink: the peer speaks ucx protocol version {version}, this cudalink {VERSION}: "
            "install the same cudalink version on both hosts"
        )
    if bytes(msg[TRAILER_OFF:]) != TRAILER:
        raise ProtocolError("cudalink: ucx message lacks its trailer (short or corrupt)")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"cudalink: unknown ucx message kind {kind}")
    return int(kind)


def expect(msg: bytes | bytearray | memoryview, *kinds: int) -> int:
    """``kind_of``, and refuse any kind the protocol does not allow here."""
    kind = kind_of(msg)
    if kind not in kinds:
        want = " or ".join(KIND_NAMES[k] for k in kinds)
        raise ProtocolError(f"cudalink: expected a ucx {want}, got {KIND_NAMES[kind]}")
    return kind


# -- handshake ------------------------------------------------------------------------------------------------


def pack_challenge(nonce: bytes) -> bytes:
    if len(nonce) != NONCE_SIZE:
        raise ValueError("nonce must be NONCE_SIZE bytes")
    return _message(CHALLENGE, nonce)


def unpack_challenge(msg: bytes | bytearray | memoryview) -> bytes:
    expect(msg, CHALLENGE, REJECT, BYE)
    if HEAD.unpack_from(msg)[2] != CHALLENGE:
        raise refusal(msg)
    return bytes(msg[BODY_OFF : BODY_OFF + NONCE_SIZE])


def proof(key: bytes, nonce: bytes) -> bytes:
    """What a client answers a challenge with: only a holder of the shared key can make it."""
    return hmac.new(key, b"cudalink-ucx-proof" + nonce, "sha256").digest()


def check_proof(key: bytes, nonce: bytes, answer: bytes) -> bool:
    return len(answer) == PROOF_SIZE and hmac.compare_digest(proof(key, nonce), answer)


@dataclass(frozen=True)
class Hello:
    proof: bytes
    latest: bool
    #: the client takes GPU memory as is (it lands frames on a GPU, and its UCX has a GPU path); else host bytes
    device: bool
    credits: int
    name: str
    host: bytes = bytes(HOST_ID_SIZE)  #: the client's host (``_platform.host_id``): all zeros when unknown
    inline: int = 0  #: the most pixel bytes the client takes inside a FRAME message (0: always a second one)


def pack_hello(h: Hello) -> bytes:
    raw = h.name.encode()
    if not 1 <= len(raw) <= NAME_MAX:
        raise ProtocolError(f"cudalink: link name {h.name!r} is not 1..{NAME_MAX} bytes")
    if not 1 <= h.credits <= MAX_CREDITS:
        raise ProtocolError(f"cudalink: credits must be 1..{MAX_CREDITS}, got {h.credits}")
    if len(h.host) != HOST_ID_SIZE:
        raise ProtocolError(f"cudalink: a host id is {HOST_ID_SIZE} bytes, got {len(h.host)}")
    if not 0 <= h.inline <= INLINE_MAX:
        raise ProtocolError(f"cudalink: inline must be 0..{INLINE_MAX} bytes, got {h.inline}")
    body = _HELLO.pack(h.proof, int(h.latest), int(h.device), h.credits, len(raw), h.host, h.inline)
    return _message(HELLO, body + raw)


def unpack_hello(msg: bytes | bytearray | memoryview) -> Hello:
    expect(msg, HELLO)
    answer, latest, device, credits, nlen, host, inline = _HELLO.unpack_from(msg, BODY_OFF)
    if latest > 1 or device > 1:
        raise ProtocolError(f"cudalink: HELLO flags latest={latest} device={device}")
    if inline > INLINE_MAX:
        raise ProtocolError(f"cudalink: HELLO takes {inline} inline bytes (0..{INLINE_MAX})")
    if not 1 <= credits <= MAX_CREDITS:
        raise ProtocolError(f"cudalink: HELLO asks for {credits} credits (1..{MAX_CREDITS})")
    if not 1 <= nlen <= NAME_MAX:
        raise ProtocolError(f"cudalink: HELLO name length {nlen} (1..{NAME_MAX})")
    start = BODY_OFF + _HELLO.size
    try:
        name = bytes(msg[start : start + nlen]).decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("cudalink: HELLO name is not UTF-8") from exc
    return Hello(bytes(answer), bool(latest), bool(device), credits, name, bytes(host), inline)


@dataclass(frozen=True)
class Welcome:
    generation: int
    capacity: int
    credits: int
    backend: int  #: transport.wire.BACKEND_* of the producer's slots
    floor: int = 0  #: frames published before the server attached for this consumer (not skipped by it)
    staged: bool = False  #: GPU frames travel as host bytes (the server copies them out, the client back in)


#: the largest frame a client accepts to allocate landing buffers for (a lie beyond it is a ProtocolError)
CAPACITY_MAX = 1 << 34


def pack_welcome(w: Welcome) -> bytes:
    body = _WELCOME.pack(w.generation, w.capacity, w.credits, w.backend, int(w.staged), w.floor)
    return _message(WELCOME, body)


def unpack_welcome(msg: bytes | bytearray | memoryview) -> Welcome:
    """The server's answer to HELLO; a REJECT (or BYE) becomes a ProtocolError carrying its reason."""
    expect(msg, WELCOME, REJECT, BYE)
    if HEAD.unpack_from(msg)[2] != WELCOME:
        raise refusal(msg)
    gen, capacity, credits, backend, staged, floor = _WELCOME.unpack_from(msg, BODY_OFF)
    if gen == 0:
        raise ProtocolError("cudalink: WELCOME names generation 0")
    if not 0 < capacity <= CAPACITY_MAX:
        raise ProtocolError(f"cudalink: WELCOME announces a capacity of {capacity} bytes")
    if not 1 <= credits <= MAX_CREDITS:
        raise ProtocolError(f"cudalink: WELCOME grants {credits} credits")
    if backend not in wire.BACKEND_NAMES:
        raise ProtocolError(f"cudalink: WELCOME names backend {backend}")
    if staged > 1:
        raise ProtocolError(f"cudalink: WELCOME flag staged={staged}")
    return Welcome(gen, capacity, credits, backend, floor, bool(staged))


# -- refusals and goodbyes ------------------------------------------------------------------------------------


def _text(kind: int, reason: int, text: str) -> bytes:
    raw = text.encode()[:REJECT_TEXT_MAX]
    return _message(kind, _TEXT.pack(reason, len(raw)) + raw)


def pack_reject(reason: int, text: str) -> bytes:
    return _text(REJECT, reason, text)


def pack_bye(reason: int, text: str, last: int = 0) -> bytes:
    msg = bytearray(_text(BYE, reason, text))
    _LAST.pack_into(msg, BYE_LAST_OFF, last)
    return bytes(msg)


def bye_last(msg: bytes | bytearray | memoryview) -> int:
    """A BYE's ``last``: the seq of the producer's last frame, 0 where the server does not know it."""
    expect(msg, BYE)
    (last,) = _LAST.unpack_from(msg, BYE_LAST_OFF)
    return int(last)


def unpack_text(msg: bytes | bytearray | memoryview) -> tuple[int, str]:
    """A REJECT's or BYE's reason and text."""
    expect(msg, REJECT, BYE)
    reason, n = _TEXT.unpack_from(msg, BODY_OFF)
    if n > REJECT_TEXT_MAX:
        raise ProtocolError(f"cudalink: refusal text of {n} bytes")
    start = BODY_OFF + _TEXT.size
    return int(reason), bytes(msg[start : start + n]).decode("utf-8", "replace")


class Refused(ProtocolError):
    """The server refused or said goodbye: ``code`` is its R_* reason."""

    def __init__(self, message: str, code: int) -> None:
        reason = ProtocolReason.CLOSING if code in RETRYABLE else ProtocolReason.REFUSED
        if code == R_KEY:
            reason = ProtocolReason.STALE_KEY
        super().__init__(message, reason)
        self.code = code

    def __reduce__(self) -> tuple[type[Refused], tuple[str, int]]:  # type: ignore[override]
        return type(self), (str(self), self.code)


#: what a ProducerGone message ends with: a peer's, quoted inside one of ours, says it twice
_RETRY_HINT = "; recv() again to wait for a new one"


def quoted(text: str) -> str:
    """A peer's text as one of our messages quotes it: without its own ``cudalink: `` prefix, nor the retry
    hint of a ProducerGone (ours says it once)."""
    text = text.removeprefix("cudalink: ")
    return text.removesuffix(_RETRY_HINT)


def refusal(msg: bytes | bytearray | memoryview) -> Refused:
    reason, text = unpack_text(msg)
    what = REASON_TEXT.get(reason, f"reason {reason}")
    return Refused(f"cudalink: the ucx server refused ({what}): {quoted(text)}", reason)


# -- per frame ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrameHeader:
    generation: int
    server_skipped: int
    seq: int
    timestamp_ns: int
    spec: FrameSpec
    meta: bytes
    inline: bool = False  #: the pixels follow in this message (see the module's docstring)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


_INLINE_OFF = BODY_OFF + _FRAME.size + wire.RECORD_SIZE


def pack_frame(
    generation: int, server_skipped: int, seq: int, ts: int, spec: FrameSpec, meta: bytes, inline: bool = False
) -> bytes:
    """A FRAME header; with ``inline`` the caller sends it with the pixels right behind it, as one message."""
    rec = bytearray(wire.RECORD_SIZE)
    wire.pack_record(rec, 0, seq, ts, spec, meta)
    return _message(FRAME, _FRAME.pack(generation, server_skipped) + bytes(rec) + bytes((int(inline),)))


def unpack_frame(msg: bytes | bytearray | memoryview, capacity: int, inline: int = 0) -> FrameHeader:
    """A FRAME header, checked against the ``capacity`` of the buffers it will land in before any is used
    (and, for pixels inline, against the ``inline`` bytes this client asked for)."""
    expect(msg, FRAME)
    gen, skipped = _FRAME.unpack_from(msg, BODY_OFF)
    start = BODY_OFF + _FRAME.size
    rec = wire.unpack_record(bytes(msg[start : start + wire.RECORD_SIZE]), 0, capacity)
    if rec.spec.strides is not None:
        raise ProtocolError("cudalink: a ucx frame must be contiguous")
    flag = msg[_INLINE_OFF]
    if flag > 1:
        raise ProtocolError(f"cudalink: FRAME flag inline={flag}")
    if flag and rec.spec.nbytes > inline:
        raise ProtocolError(f"cudalink: a FRAME carries {rec.spec.nbytes} bytes inline; this client takes {inline}")
    return FrameHeader(gen, skipped, rec.seq, rec.timestamp_ns, rec.spec, rec.meta, bool(flag))


def pack_credit(n: int) -> bytes:
    return _message(CREDIT, _CREDIT.pack(n))


def unpack_credit(msg: bytes | bytearray | memoryview) -> int:
    expect(msg, CREDIT)
    (n,) = _CREDIT.unpack_from(msg, BODY_OFF)
    if not 1 <= n <= MAX_CREDITS:
        raise ProtocolError(f"cudalink: CREDIT returns {n} credits")
    return int(n)


def pack_ping() -> bytes:
    global _PING_BYTES
    if _PING_BYTES is None:
        _PING_BYTES = _message(PING, b"")
    return _PING_BYTES


# -- addresses ------------------------------------------------------------------------------------------------


class _Refused(ProtocolError):
    """A ucx:// address refused before any connection: a ProtocolError (REFUSED), as it always was."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ProtocolReason.REFUSED)

    def __reduce__(self) -> tuple[type[_Refused], tuple[str]]:  # type: ignore[override]
        return type(self), (str(self),)


class BadAddress(_Refused, ArgumentError):
    """A malformed ``ucx://`` address: also a bad argument value (an ArgumentError, so a ValueError), as the
    README says of every bad argument."""


class AddressTypeError(_Refused, ArgumentTypeError):
    """An address that is not a str at all: a mistyped argument (an ArgumentTypeError, so a TypeError)."""


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    name: str | None


def parse_address(url: str, *, need_name: bool) -> Address:
    """``ucx://HOST:PORT[/NAME]``; a bad address names the expected form (IPv6 hosts, in brackets, are
    refused: UCXX listens on IPv4 only), and a bad NAME is refused as a local one is (``check_name``): a
    server would only refuse it, while the Receiver waited out its timeout."""
    form = "ucx://HOST:PORT/NAME" if need_name else "ucx://HOST:PORT"
    if not isinstance(url, str):
        raise AddressTypeError(f"cudalink: {url!r} is not a ucx address (a str); use {form}")
    if not url.startswith("ucx://"):
        raise BadAddress(f"cudalink: {url!r} is not a ucx address; use {form}")
    rest = url[len("ucx://") :]
    hostport, _, name = rest.partition("/")
    if hostport.startswith("["):
        host, _, tail = hostport[1:].partition("]")
        port_s = tail[1:] if tail.startswith(":") else ""
    else:
        host, colon, port_s = hostport.rpartition(":")
        if not colon:  # no port: the default one
            host, port_s = hostport, ""
    if not port_s:
        port = DEFAULT_PORT
    elif port_s.isascii() and port_s.isdigit():  # int() would take "+80", " 80", "8_0" and other scripts' digits
        port = int(port_s)
    else:
        port = -1
    if not host or not 0 < port < 65536:
        why = "no host" if not host else f"port {port_s!r} is not a number from 1 to 65535"
        raise BadAddress(f"cudalink: bad ucx address {url!r} ({why}); use {form}")
    if ":" in host:  # UCXX 0.52's listener binds IPv4 only: an IPv6 server is never reached
        raise BadAddress(f"cudalink: {url!r}: UCXX serves IPv4 only; use an IPv4 address or a host name")
    if need_name and not name:
        raise BadAddress(f"cudalink: {url!r} names no link; use {form}")
    if not need_name and name:
        raise BadAddress(f"cudalink: {url!r}: a listen address names no link; use {form}")
    if name:
        _platform.check_name(name)
    return Address(host, port, name or None)
