"""The ucx:// network messages under hypothesis: every message round-trips, and any bytes a peer sends
either decode to a message within its limits or give a cudalink ProtocolError (never another exception)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cudalink
from cudalink.frames import FrameSpec
from cudalink.transport import ucx_wire as uw
from cudalink.transport import wire

from .test_wire import specs

names = st.text(st.sampled_from("abcXYZ019_-."), min_size=1, max_size=uw.NAME_MAX)


def _decoders(msg: bytes, cap: int) -> list[object]:
    return [
        lambda: uw.unpack_challenge(msg),
        lambda: uw.unpack_hello(msg),
        lambda: uw.unpack_welcome(msg),
        lambda: uw.unpack_text(msg),
        lambda: uw.unpack_frame(msg, cap),
        lambda: uw.unpack_frame(msg, cap, min(cap, uw.INLINE_MAX)),
        lambda: uw.unpack_credit(msg),
        lambda: uw.kind_of(msg),
    ]


@given(nonce=st.binary(min_size=32, max_size=32), key=st.binary(min_size=32, max_size=32))
def test_challenge_and_proof(nonce: bytes, key: bytes) -> None:
    msg = uw.pack_challenge(nonce)
    assert len(msg) == uw.MSG_SIZE
    got = uw.unpack_challenge(msg)
    assert got == nonce
    answer = uw.proof(key, got)
    assert uw.check_proof(key, nonce, answer)
    assert not uw.check_proof(bytes(32) if key != bytes(32) else b"\1" * 32, nonce, answer)
    assert not uw.check_proof(key, nonce, answer[:-1])


@given(
    proof=st.binary(min_size=32, max_size=32),
    latest=st.booleans(),
    device=st.booleans(),
    credits=st.integers(1, uw.MAX_CREDITS),
    name=names,
    host=st.binary(min_size=uw.HOST_ID_SIZE, max_size=uw.HOST_ID_SIZE),
    inline=st.integers(0, uw.INLINE_MAX),
)
def test_hello_roundtrip(
    proof: bytes, latest: bool, device: bool, credits: int, name: str, host: bytes, inline: int
) -> None:
    h = uw.Hello(proof, latest, device, credits, name, host, inline)
    assert uw.unpack_hello(uw.pack_hello(h)) == h


def test_hello_limits() -> None:
    with pytest.raises(cudalink.ProtocolError, match="name"):
        uw.pack_hello(uw.Hello(bytes(32), True, False, 2, "x" * (uw.NAME_MAX + 1)))
    with pytest.raises(cudalink.ProtocolError, match="credits"):
        uw.pack_hello(uw.Hello(bytes(32), True, False, 0, "x"))
    with pytest.raises(cudalink.ProtocolError, match="host id"):
        uw.pack_hello(uw.Hello(bytes(32), True, False, 2, "x", b"short"))
    with pytest.raises(cudalink.ProtocolError, match="inline"):
        uw.pack_hello(uw.Hello(bytes(32), True, False, 2, "x", inline=uw.INLINE_MAX + 1))
    lie = bytearray(uw.pack_hello(uw.Hello(bytes(32), True, False, 2, "x")))
    lie[uw.BODY_OFF + 54 : uw.BODY_OFF + 58] = (uw.INLINE_MAX + 1).to_bytes(4, "little")
    with pytest.raises(cudalink.ProtocolError, match="inline"):
        uw.unpack_hello(bytes(lie))


def test_hello_golden_layout() -> None:
    """The host id sits between the fixed fields and the name, where the module docstring says."""
    msg = uw.pack_hello(uw.Hello(b"P" * 32, True, True, 3, "cam", b"H" * 16, 0xFF01))
    body = msg[uw.BODY_OFF :]
    assert body[:32] == b"P" * 32
    assert body[32:40] == bytes([1, 1, 3, 0, 3, 0, *b"HH"])
    assert body[38:54] == b"H" * 16 and body[54:58] == bytes([1, 0xFF, 0, 0]) and body[58:61] == b"cam"


@given(
    gen=st.integers(1, 2**64 - 1),
    cap=st.integers(1, uw.CAPACITY_MAX),
    credits=st.integers(1, uw.MAX_CREDITS),
    backend=st.sampled_from(sorted(wire.BACKEND_NAMES)),
    floor=st.integers(0, 2**64 - 1),
    staged=st.booleans(),
)
def test_welcome_roundtrip(gen: int, cap: int, credits: int, backend: int, floor: int, staged: bool) -> None:
    w = uw.Welcome(gen, cap, credits, backend, floor, staged)
    assert uw.unpack_welcome(uw.pack_welcome(w)) == w


def test_welcome_refuses_a_staged_flag_beyond_one() -> None:
    msg = bytearray(uw.pack_welcome(uw.Welcome(1, 64, 1, 0, 0, True)))
    assert msg[uw.BODY_OFF + 19] == 1
    msg[uw.BODY_OFF + 19] = 2
    with pytest.raises(cudalink.ProtocolError, match="staged"):
        uw.unpack_welcome(msg)


@given(reason=st.integers(0, 65535), text=st.text(max_size=300))
def test_reject_and_bye_carry_reason_and_text(reason: int, text: str) -> None:
    for pack in (uw.pack_reject, uw.pack_bye):
        code, got = uw.unpack_text(pack(reason, text))
        assert code == reason
        assert text.encode()[: uw.REJECT_TEXT_MAX].decode("utf-8", "replace") == got
    with pytest.raises(uw.Refused) as info:
        uw.unpack_welcome(uw.pack_reject(reason, text))
    assert info.value.code == reason
    assert info.value.reason.retryable == (reason in uw.RETRYABLE or reason == uw.R_KEY)


@given(reason=st.integers(0, 65535), text=st.text(max_size=300), last=st.integers(0, 2**64 - 1))
def test_a_bye_carries_the_producers_last_seq_beside_any_text(reason: int, text: str, last: int) -> None:
    msg = uw.pack_bye(reason, text, last)
    assert len(msg) == uw.MSG_SIZE and uw.bye_last(msg) == last
    assert uw.unpack_text(msg)[0] == reason  # the longest text never reaches it
    assert uw.bye_last(uw.pack_bye(reason, text)) == 0  # not known: nothing is counted
    with pytest.raises(cudalink.ProtocolError):
        uw.bye_last(uw.pack_reject(reason, text))


def test_refusals_say_what_happened() -> None:
    with pytest.raises(uw.Refused, match="wrong key") as info:
        uw.unpack_challenge(uw.pack_reject(uw.R_KEY, "set CUDALINK_KEY"))
    assert info.value.reason is cudalink.ProtocolReason.STALE_KEY


@settings(max_examples=200)
@given(
    spec=specs,
    gen=st.integers(1, 2**64 - 1),
    skipped=st.integers(0, 2**64 - 1),
    seq=st.integers(1, 2**62),
    ts=st.integers(0, 2**63),
    meta=st.binary(max_size=wire.META_MAX),
)
def test_frame_header_roundtrip(spec: FrameSpec, gen: int, skipped: int, seq: int, ts: int, meta: bytes) -> None:
    h = uw.unpack_frame(uw.pack_frame(gen, skipped, seq, ts, spec, meta), spec.nbytes)
    got = (h.generation, h.server_skipped, h.seq, h.timestamp_ns, h.spec, h.meta)
    assert got == (gen, skipped, seq, ts, spec, meta)
    assert h.nbytes == spec.nbytes


@given(spec=specs, inline=st.booleans())
def test_frame_inline_flag_roundtrips(spec: FrameSpec, inline: bool) -> None:
    msg = uw.pack_frame(1, 0, 1, 0, spec, b"", inline)
    assert len(msg) == uw.MSG_SIZE
    if inline and spec.nbytes > uw.INLINE_MAX:
        with pytest.raises(cudalink.ProtocolError, match="inline"):
            uw.unpack_frame(msg, spec.nbytes, uw.INLINE_MAX)
    else:
        assert uw.unpack_frame(msg, spec.nbytes, uw.INLINE_MAX).inline is inline


def test_inline_pixels_a_client_did_not_ask_for_are_refused() -> None:
    spec = FrameSpec((64, 64, 4), "uint8")
    msg = uw.pack_frame(1, 0, 1, 0, spec, b"", True)
    with pytest.raises(cudalink.ProtocolError, match="takes 0"):
        uw.unpack_frame(msg, spec.nbytes)  # a GPU landing asks for none
    bad = bytearray(msg)
    bad[uw.BODY_OFF + 16 + wire.RECORD_SIZE] = 2
    with pytest.raises(cudalink.ProtocolError, match="inline=2"):
        uw.unpack_frame(bytes(bad), spec.nbytes, uw.INLINE_MAX)


def test_frame_larger_than_the_landing_buffers_is_refused_before_use() -> None:
    spec = FrameSpec((1080, 1920, 4), "uint8")
    msg = uw.pack_frame(1, 0, 1, 0, spec, b"")
    with pytest.raises(cudalink.ProtocolError, match="slot holds"):
        uw.unpack_frame(msg, spec.nbytes - 1)
    strided = uw.pack_frame(1, 0, 1, 0, FrameSpec((4, 6), "float32", strides=(32, 4)), b"")
    with pytest.raises(cudalink.ProtocolError, match="contiguous"):
        uw.unpack_frame(strided, 1 << 20)


@given(n=st.integers(1, uw.MAX_CREDITS))
def test_credit_roundtrip(n: int) -> None:
    assert uw.unpack_credit(uw.pack_credit(n)) == n
    assert uw.kind_of(uw.pack_ping()) == uw.PING


def test_framing_lies() -> None:
    good = uw.pack_credit(1)
    cases = {
        "bytes, expected": good[:-1],
        "magic": b"XXXX" + good[4:],
        "version": good[:4] + b"\x09\x00" + good[6:],
        "trailer": good[:-4] + b"\0\0\0\0",
        "kind": good[:6] + b"\x63\x00" + good[8:],
        "expected a ucx HELLO": good,
    }
    for what, msg in cases.items():
        with pytest.raises(cudalink.ProtocolError, match=what):
            uw.unpack_hello(msg)
    with pytest.raises(cudalink.ProtocolError, match="credits"):
        uw.unpack_credit(uw.pack_credit(0))
    with pytest.raises(cudalink.ProtocolError, match="capacity"):
        uw.unpack_welcome(uw.pack_welcome(uw.Welcome(1, uw.CAPACITY_MAX + 1, 1, 0)))


@settings(max_examples=400)
@given(data=st.binary(min_size=0, max_size=uw.MSG_SIZE + 8), cap=st.integers(1, 1 << 24))
def test_random_bytes_are_refused_cleanly(data: bytes, cap: int) -> None:
    for decode in _decoders(data, cap):
        try:
            decode()  # type: ignore[operator]
        except cudalink.ProtocolError:
            pass


@settings(max_examples=400)
@given(
    kind=st.sampled_from(sorted(uw.KIND_NAMES)),
    body=st.binary(max_size=uw.TRAILER_OFF - uw.BODY_OFF),
    cap=st.integers(1, 1 << 24),
)
def test_well_framed_random_bodies_decode_within_limits_or_are_refused(kind: int, body: bytes, cap: int) -> None:
    msg = uw.HEAD.pack(uw.MAGIC, uw.VERSION, kind) + body.ljust(uw.TRAILER_OFF - uw.BODY_OFF, b"\0") + uw.TRAILER
    assert uw.kind_of(msg) == kind
    for decode in _decoders(msg, cap):
        try:
            got = decode()  # type: ignore[operator]
        except cudalink.ProtocolError:
            continue
        if isinstance(got, uw.FrameHeader):
            assert got.nbytes <= cap and len(got.meta) <= wire.META_MAX
        elif isinstance(got, uw.Hello):
            assert 1 <= got.credits <= uw.MAX_CREDITS and 1 <= len(got.name.encode()) <= uw.NAME_MAX
        elif isinstance(got, uw.Welcome):
            assert 0 < got.capacity <= uw.CAPACITY_MAX


@pytest.mark.parametrize(
    ("url", "need_name", "want"),
    [
        ("ucx://127.0.0.1:5000/cam0", True, uw.Address("127.0.0.1", 5000, "cam0")),
        ("ucx://host.lan/cam0", True, uw.Address("host.lan", uw.DEFAULT_PORT, "cam0")),
        ("ucx://0.0.0.0:9", False, uw.Address("0.0.0.0", 9, None)),
    ],
)
def test_addresses(url: str, need_name: bool, want: uw.Address) -> None:
    assert uw.parse_address(url, need_name=need_name) == want


@pytest.mark.parametrize(
    ("url", "need_name"),
    [("tcp://h:1/a", True), ("ucx://h:0/a", True), ("ucx://h:x/a", True), ("ucx://h:5", True), ("ucx://h:5/a", False)],
)
def test_bad_addresses_name_the_form(url: str, need_name: bool) -> None:
    with pytest.raises(cudalink.LinkError, match="ucx://HOST:PORT"):
        uw.parse_address(url, need_name=need_name)


@pytest.mark.parametrize("url", ["ucx://[::1]:7000/a", "ucx://[fe80::1]/a", "ucx://[::]:7000"])
def test_ipv6_addresses_are_refused_with_the_reason(url: str) -> None:
    """UCXX 0.52's listener binds IPv4 only: an IPv6 address would never be reached (a timeout naming UCX's
    truncation error, once); it is refused at once instead."""
    with pytest.raises(cudalink.LinkError, match="IPv4 only"):
        uw.parse_address(url, need_name=not url.endswith(":7000"))


@pytest.mark.parametrize("url", ["ucx://:99999/x", "ucx://:5/x", "ucx:///x"])
def test_an_address_with_no_host_is_called_bad_not_ipv6(url: str) -> None:
    with pytest.raises(cudalink.ProtocolError, match=r"bad ucx address .*\(no host\)"):
        uw.parse_address(url, need_name=True)


@pytest.mark.parametrize("port", ["99999", "0", "http", "-1"])
def test_a_bad_port_is_named_in_the_error(port: str) -> None:
    with pytest.raises(cudalink.ProtocolError, match=rf"port '{port}' is not a number from 1 to 65535"):
        uw.parse_address(f"ucx://10.0.0.1:{port}/x", need_name=True)


@pytest.mark.parametrize("url", ["ucx://h:99999/x", "ucx://h:port/x", "ucx://:5/x", "ucx://[::1]:5/x", "ucx://h:5"])
def test_a_bad_address_is_a_bad_argument_value_as_the_readme_says_of_bad_arguments(url: str) -> None:
    """README: a bad argument value is an ArgumentError (also a ValueError), a mistyped one an ArgumentTypeError
    (also a TypeError). A bad ucx:// address was only a ProtocolError; it is still one, and now also those."""
    for call in (
        lambda: uw.parse_address(url, need_name=True),
        lambda: cudalink.Receiver(url, timeout=0.1),
    ):
        with pytest.raises(cudalink.ArgumentError, match=r"^cudalink: .*; use ") as got:
            call()
        assert isinstance(got.value, cudalink.ProtocolError) and isinstance(got.value, ValueError)


@pytest.mark.parametrize("serve", ["ucx://h:99999", "ucx://:5", "ucx://h:5/x", "tcp://h:5"])
def test_a_bad_serve_address_is_a_bad_argument_value(serve: str) -> None:
    with pytest.raises(cudalink.ArgumentError, match=r"^cudalink: .*ucx://HOST:PORT") as got:
        cudalink.Sender("audit-bad-serve", shape=(4, 4), serve=serve)
    assert isinstance(got.value, cudalink.ProtocolError)


@pytest.mark.parametrize("serve", [13337, True, b"ucx://127.0.0.1:5"])
def test_a_serve_address_that_is_no_str_is_a_type_error(serve: object) -> None:
    with pytest.raises(cudalink.ArgumentTypeError, match=r"^cudalink: .*ucx://HOST:PORT") as got:
        cudalink.Sender("audit-bad-serve", shape=(4, 4), serve=serve)
    assert isinstance(got.value, cudalink.ProtocolError) and isinstance(got.value, TypeError)


@pytest.mark.parametrize("port", ["1_4051", "+14051", " 14051", "14051 ", "\u0661\u0664\u0660\u0665\u0661"])
def test_a_port_int_would_take_but_no_one_writes_is_refused(port: str) -> None:
    with pytest.raises(uw.BadAddress, match="is not a number from 1 to 65535"):
        uw.parse_address(f"ucx://127.0.0.1:{port}/x", need_name=True)
