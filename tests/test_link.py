"""Sender/Receiver behaviour in one process, over both the in-process and the shared-memory transports."""

from __future__ import annotations

import functools
import gc
import os
import select
import stat
import threading
import time

import numpy as np
import pytest

import cudalink
from cudalink import _platform
from cudalink.transport import MemoryTransport, SharedMemoryTransport
from cudalink.transport.base import Transport

from .conftest import PairFactory


@pytest.fixture(params=["memory", "shm"])
def transport(request: pytest.FixtureRequest) -> cudalink.transport.Transport:
    return MemoryTransport() if request.param == "memory" else SharedMemoryTransport()


def test_send_recv_newest_and_skips(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, slots=4)
    with tx, rx:
        for i in range(1, 4):
            assert tx.send(np.full((4, 4), i, np.uint16)) == i
        f = rx.recv(1)
        assert f.seq == 3 and np.from_dlpack(f)[0, 0] == 3
        assert rx.skipped == 2
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(0.05)  # nothing unseen
        assert isinstance(cudalink.LinkTimeout("x"), TimeoutError)


def test_in_order_delivery(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, shape=(2,), dtype="int32", slots=8, rx={"latest": False})
    with tx, rx:
        for i in range(1, 6):
            tx.send(np.array([i, -i], np.int32))
        seqs = []
        for _ in range(5):
            with rx.recv(1) as f:
                seqs.append(int(np.from_dlpack(f)[0]))
        assert seqs == [1, 2, 3, 4, 5] and rx.skipped == 0


def test_an_in_order_receiver_that_joins_late_counts_every_frame_it_never_got(name: str, transport: Transport) -> None:
    """A latest=False Receiver that joins while older frames are still in the slots takes those first. Frames it
    then missed (the ring wrapped meanwhile) were counted from the producer's count at its join instead of from
    the last frame it took: those in between were neither received nor skipped in ``stats()``."""
    with cudalink.Sender(name, shape=(2,), dtype="int32", slots=8, transport=transport) as tx:
        for i in range(1, 7):  # the producer's count is 6 as the Receiver joins, with 1..6 in the slots
            tx.send(np.array([i, -i], np.int32))
        with cudalink.Receiver(name, latest=False, timeout=2.0, transport=transport) as rx:
            seqs = []
            for _ in range(3):
                with rx.recv() as f:
                    seqs.append(f.seq)
            for i in range(7, 27):  # 20 more into 8 slots: 19..26 are still there
                tx.send(np.array([i, -i], np.int32))
            while seqs[-1] < 26:
                with rx.recv() as f:
                    seqs.append(f.seq)
            got = rx.stats()
    assert seqs == sorted(seqs) and seqs[0] < 6 and got["received"] == len(seqs), (seqs, got)
    assert got["received"] + got["skipped"] == 26 - seqs[0] + 1, (seqs, got)


@pytest.mark.parametrize("latest", [True, False])
def test_a_frame_a_failed_reserve_block_wiped_is_counted_as_skipped_at_the_end(
    name: str, transport: Transport, latest: bool
) -> None:
    """A reserve() block that raises marks its slot empty; where that slot held the newest frame (every other slot
    held by the consumer) that published frame is never delivered. At the producer's close it was neither received
    nor skipped in ``stats()``: the local ring assumed its last frame is always taken."""
    tx = cudalink.Sender(name, shape=(4,), slots=2, transport=transport)
    rx = cudalink.Receiver(name, latest=latest, timeout=2.0, transport=transport)
    with rx:
        tx.send(np.full(4, 1, np.uint8))
        held = rx.recv()  # seq 1 holds one slot
        tx.send(np.full(4, 2, np.uint8))  # seq 2 in the other
        with pytest.raises(RuntimeError), tx.reserve():  # claims seq 2's slot, then raises
            raise RuntimeError("render failed")
        held.release()
        tx.close()
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(0.5)
        got = rx.stats()
    assert tx.stats()["published"] == 2
    assert got["received"] + got["skipped"] == 2, got


def test_held_slot_is_never_overwritten_and_drop_policy_counts(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, slots=2)
    with tx, rx:
        tx.send(np.full((4, 4), 1, np.uint16))
        a = rx.recv(1)
        tx.send(np.full((4, 4), 2, np.uint16))
        b = rx.recv(1)
        # both slots are held now: the producer must drop, not overwrite
        assert tx.send(np.full((4, 4), 3, np.uint16)) is None
        assert tx.stats()["dropped"] == 1
        assert np.from_dlpack(a)[0, 0] == 1 and np.from_dlpack(b)[0, 0] == 2
        a.release()
        gc.collect()
        assert tx.send(np.full((4, 4), 4, np.uint16)) == 3
        assert np.from_dlpack(b)[0, 0] == 2  # the slot still held was left alone
        assert np.from_dlpack(rx.recv(1))[0, 0] == 4


def test_block_policy_waits_then_times_out(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, slots=1, policy="block", timeout=0.2)
    with tx, rx:
        tx.send(np.zeros((4, 4), np.uint16))
        held = rx.recv(1)
        with pytest.raises(cudalink.LinkTimeout, match="policy='block'"):
            tx.send(np.ones((4, 4), np.uint16))
        held.release()
        gc.collect()
        assert tx.send(np.ones((4, 4), np.uint16)) is not None


def test_a_receiver_waits_out_a_producer_still_writing_its_header() -> None:
    """A segment that exists but has no header yet (its producer is between creating it and writing it) is a
    producer starting: recv() waits for it, and times out saying so, instead of calling it foreign."""
    from cudalink.transport import MemoryTransport

    t = MemoryTransport()
    layout = cudalink.transport.wire.Layout(2, 1)
    server = t.serve("starting", layout.size, 0)
    try:
        with pytest.raises(cudalink.LinkTimeout, match="producer is starting"):
            cudalink.Receiver("starting", timeout=0.2, transport=t)
    finally:
        server.close()


def test_views_keep_the_lease(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, slots=1)
    with tx, rx:
        tx.send(np.full((4, 4), 5, np.uint16))
        frame = rx.recv(1)
        view = np.from_dlpack(frame)
        frame.release()
        gc.collect()
        assert tx.send(np.full((4, 4), 6, np.uint16)) is None  # the view still holds the only slot
        assert view[0, 0] == 5
        del view
        gc.collect()
        assert tx.send(np.full((4, 4), 6, np.uint16)) is not None


def test_reserve_is_zero_copy_and_aborts_cleanly(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, shape=(3, 5, 4), dtype="uint8", pixel_format="RGBA8")
    with tx, rx:
        with tx.reserve(meta=b"m1") as w:
            arr = np.from_dlpack(w)
            arr[...] = 9
        f = rx.recv(1)
        assert f.meta == b"m1" and f.pixel_format is cudalink.PixelFormat.RGBA
        assert np.all(np.from_dlpack(f) == 9)
        with pytest.raises(RuntimeError), tx.reserve() as w:
            np.from_dlpack(w)[...] = 1
            raise RuntimeError("producer bug")
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(0.05)  # nothing half-written was published
        tx.send(np.full((3, 5, 4), 2, np.uint8))
        assert np.all(np.from_dlpack(rx.recv(1)) == 2)


def test_a_reserved_frame_is_stamped_when_published_not_when_reserved(pair: PairFactory, transport: Transport) -> None:
    """The time spent rendering inside the block is not handoff: the frame's timestamp is its publish time,
    as for ``send()``."""
    tx, rx = pair(transport, shape=(4,), dtype="uint8")
    with tx, rx:
        with tx.reserve() as w:
            np.from_dlpack(w)[...] = 1
            time.sleep(0.05)
            published_after = time.time_ns()
        f = rx.recv(1)
        assert f.timestamp_ns >= published_after, (f.timestamp_ns - published_after) / 1e6


def test_a_reserved_frame_takes_a_timestamp_as_send_does(pair: PairFactory, transport: Transport) -> None:
    """``reserve(timestamp_ns=)``, as ``send()``'s: a relay republishes its upstream's frames with their own
    stamps. A stamp that is no u64 is refused before a slot is taken."""
    tx, rx = pair(transport, shape=(4,), dtype="uint8")
    with tx, rx:
        with tx.reserve(timestamp_ns=123_456_789) as w:
            np.from_dlpack(w)[...] = 3
        assert w.timestamp_ns == 123_456_789
        f = rx.recv(1)
        assert f.timestamp_ns == 123_456_789 and np.from_dlpack(f)[0] == 3
        f.release()
        for bad in (-1, 1 << 64, 1.5, "now"):
            with pytest.raises(cudalink.FormatError, match="timestamp_ns must be an int"):
                tx.reserve(timestamp_ns=bad)  # type: ignore[arg-type]
        assert tx.stats()["published"] == 1


def test_a_send_inside_a_reserve_block_never_writes_the_reserved_slot(pair: PairFactory, transport: Transport) -> None:
    """With one slot, a send() (or a second reserve()) inside an open block had the block's own slot: it wrote
    over the frame being rendered, and one of the two frames was lost. It is refused, saying what to do; with
    a slot to spare, both frames arrive whole and in order."""
    tx, rx = pair(transport, shape=(4,), dtype="uint8", slots=1, rx={"latest": False})
    with tx, rx:
        with tx.reserve() as w:
            view = np.from_dlpack(w)
            view[...] = 7
            with pytest.raises(cudalink.LinkError, match="slots=2"):
                tx.send(np.full(4, 5, np.uint8))
            with pytest.raises(cudalink.LinkError, match="open reserve"), tx.reserve():
                pass
            assert view.tolist() == [7] * 4
            view[...] = 8
            del view
        f = rx.recv(1)
        assert (f.seq, np.from_dlpack(f).tolist()) == (1, [8] * 4)
        f.release()
    tx, rx = pair(transport, shape=(4,), dtype="uint8", slots=3, rx={"latest": False})
    with tx, rx:
        with tx.reserve() as a, tx.reserve() as b:
            va, vb = np.from_dlpack(a), np.from_dlpack(b)
            assert not np.shares_memory(va, vb)
            va[...], vb[...] = 1, 2
            assert tx.send(np.full(4, 3, np.uint8)) is not None
            assert (va.tolist(), vb.tolist()) == ([1] * 4, [2] * 4)
            del va, vb
        got = []
        for _ in range(3):
            f = rx.recv(1)
            got.append(np.from_dlpack(f).tolist())
            f.release()
        assert got == [[3] * 4, [2] * 4, [1] * 4]  # published as each ended: the send, the inner, the outer


def test_a_reserved_frame_says_what_it_was_published_as_once_its_block_ends(
    pair: PairFactory, transport: Transport
) -> None:
    """Inside a block the seq is the one the frame gets if nothing goes first; a send() and a nested block
    did go first here, and the outer frame kept saying seq 1 after it went out as seq 3."""
    tx, rx = pair(transport, shape=(4,), dtype="uint8", slots=3, rx={"latest": False})
    with tx, rx:
        with tx.reserve(meta=b"outer") as outer:
            assert outer.seq == 1
            with tx.reserve(meta=b"inner") as inner:
                pass
            tx.send(np.zeros(4, np.uint8), meta=b"sent")
        got = []
        for _ in range(3):
            with rx.recv(1) as f:
                got.append((f.seq, f.timestamp_ns, f.meta))
        assert [(g[0], g[2]) for g in got] == [(1, b"inner"), (2, b"sent"), (3, b"outer")]
        assert (inner.seq, inner.timestamp_ns, inner.meta) == got[0]
        assert (outer.seq, outer.timestamp_ns, outer.meta) == got[2]


def test_leaving_a_reserve_block_twice_publishes_once(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, shape=(4,), dtype="uint8", rx={"latest": False})
    with tx, rx:
        block = tx.reserve()
        np.from_dlpack(block.__enter__())[...] = 4
        block.__exit__(None, None, None)
        block.__exit__(None, None, None)  # a second exit: nothing published, no lock error
        assert tx.send(np.full(4, 5, np.uint8)) == 2
        seqs = []
        while (f := rx.poll()) is not None:
            seqs.append(f.seq)
            f.release()
        assert seqs == [1, 2]
        block = tx.reserve()
        np.from_dlpack(block.__enter__())[...] = 6
        errors: list[BaseException] = []

        def leave() -> None:
            try:
                block.__exit__(None, None, None)
            except BaseException as exc:  # looked at below
                errors.append(exc)

        t = threading.Thread(target=leave)
        t.start()
        t.join(5)
        # left on another thread: refused before anything is done, so the owner can still leave it
        assert len(errors) == 1 and isinstance(errors[0], cudalink.LinkError), errors
        assert "thread that entered it" in str(errors[0])
        block.__exit__(None, None, None)
        f = rx.recv(1)
        assert (f.seq, np.from_dlpack(f).tolist()) == (3, [6] * 4)
        f.release()
        assert tx.send(np.full(4, 7, np.uint8)) == 4  # the lock went back


def test_a_reserve_block_gives_the_lock_back_however_it_ends(pair: PairFactory, transport: Transport) -> None:
    """The block holds the Sender's lock: after a clean end, a raise in the block, or a refused entry,
    another thread's send must go through; a block object is entered once."""
    tx, rx = pair(transport, shape=(4, 4), dtype="uint8", slots=1, policy="drop", rx={"latest": False})

    def send_from_another_thread(value: int) -> int | None:
        got: list[int | None] = []
        t = threading.Thread(target=lambda: got.append(tx.send(np.full((4, 4), value, np.uint8))), daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "the reserve block kept the Sender's lock"
        return got[0]

    with tx, rx:
        block = tx.reserve()
        with block as w:
            np.from_dlpack(w)[...] = 1
        with pytest.raises(cudalink.LinkError, match="entered once"), block:
            pass
        f = rx.recv(1)  # holds the only slot
        assert np.from_dlpack(f)[0, 0] == 1
        with pytest.raises(cudalink.LinkTimeout, match="held by consumers"), tx.reserve():
            pass
        assert send_from_another_thread(2) is None  # dropped (the slot is still held), not blocked
        f.release()
        del f
        gc.collect()
        with pytest.raises(ValueError), tx.reserve() as w:
            np.from_dlpack(w)[...] = 3
            raise ValueError("producer bug")
        assert rx.poll() is None  # the aborted block published nothing
        assert send_from_another_thread(4) is not None
        assert np.from_dlpack(rx.recv(1))[0, 0] == 4


def test_reconfigure_mid_stream(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, shape=(4, 6, 4), dtype="uint8", capacity=8 * 8 * 4 * 4, rx={"latest": False})
    with tx, rx:
        tx.send(np.ones((4, 6, 4), np.uint8))
        tx.reconfigure(shape=(8, 8, 4), dtype="float32")
        with pytest.raises(cudalink.FormatError, match="reconfigure"):
            tx.send(np.ones((4, 6, 4), np.uint8))
        tx.send(np.full((8, 8, 4), 0.5, np.float32))
        a, b = rx.recv(1), rx.recv(1)
        assert a.shape == (4, 6, 4) and a.dtype == np.uint8
        assert b.shape == (8, 8, 4) and b.dtype == np.float32 and np.all(np.from_dlpack(b) == 0.5)
        with pytest.raises(cudalink.FormatError, match="capacity="):
            tx.reconfigure(shape=(64, 64, 4))
        assert tx.spec.shape == (8, 8, 4)  # a refused reconfigure changes nothing


def test_reconfigure_keeps_a_pitched_layout_and_can_clear_the_pixel_format(
    pair: PairFactory, transport: Transport
) -> None:
    pitched = (4 * 8 * 4, 4, 1)  # rows padded to 8 pixels
    tx, rx = pair(
        transport,
        shape=(3, 5, 4),
        dtype="uint8",
        capacity=4096,
        strides=pitched,
        pixel_format="RGBA",
        rx={"latest": False},
    )
    with tx, rx:
        img = np.arange(3 * 5 * 4, dtype=np.uint8).reshape(3, 5, 4)
        tx.reconfigure(origin="bottom")  # shape and dtype stay: so do the strides and the pixel format
        assert tx.spec.strides == pitched and tx.spec.pixel_format is cudalink.PixelFormat.RGBA
        tx.send(img)
        tx.reconfigure(pixel_format="")  # said outright: no pixel format
        assert tx.spec.pixel_format is None and tx.spec.strides == pitched
        tx.send(img)
        tx.reconfigure(shape=(2, 5, 4))  # a new shape: compact again, unless strides are given
        assert tx.spec.strides is None
        tx.reconfigure(shape=(2, 5, 4), strides=(4 * 6 * 4, 4, 1))
        tx.send(img[:2])
        a, b, c = rx.recv(1), rx.recv(1), rx.recv(1)
        assert a.strides == pitched and a.pixel_format is cudalink.PixelFormat.RGBA and a.origin.value == "bottom"
        assert b.pixel_format is None and b.strides == pitched
        assert c.strides == (96, 4, 1)
        for f, want in ((a, img), (b, img), (c, img[:2])):
            assert np.array_equal(np.from_dlpack(f), want)
        with pytest.raises(cudalink.FormatError, match="strides"):
            tx.reconfigure(strides=(1, 1))


def test_reconfigure_with_the_current_shape_keeps_the_pixel_format(pair: PairFactory, transport: Transport) -> None:
    """``reconfigure(tx.shape, "float32")`` (the shape passed as it is, to change the dtype) dropped the pixel
    format as if the shape were new: consumers saw ``pixel_format=None`` from then on, and a cuda-link link lost
    its BGRA flag (its readers swap red and blue)."""
    tx, rx = pair(transport, shape=(2, 3, 4), dtype="uint8", capacity=4096, pixel_format="BGRA", rx={"latest": False})
    with tx, rx:
        assert tx.reconfigure(tx.shape, "float32").pixel_format is cudalink.PixelFormat.BGRA
        tx.send(np.zeros((2, 3, 4), np.float32))
        assert tx.reconfigure([2, 3, 4], origin="bottom").pixel_format is cudalink.PixelFormat.BGRA
        tx.send(np.zeros((2, 3, 4), np.float32))
        a, b = rx.recv(1), rx.recv(1)
        assert a.pixel_format is cudalink.PixelFormat.BGRA and a.dtype == np.float32
        assert b.pixel_format is cudalink.PixelFormat.BGRA and b.origin is cudalink.RowOrigin.BOTTOM
        assert tx.reconfigure((2, 5, 4)).pixel_format is None  # a new shape still drops it, as documented


def test_copy_always_on_a_host_link_holds_no_slot(pair: PairFactory, transport: Transport) -> None:
    pitched = (4 * 4 * 3, 3, 1)  # a padded layout: the copy is compact
    tx, rx = pair(
        transport,
        shape=(2, 3, 3),
        dtype="uint8",
        slots=2,
        capacity=64,
        strides=pitched,
        pixel_format="RGB",
        rx={"latest": False, "copy": "always"},
    )
    with tx, rx:
        kept = []
        for i in range(6):  # three times the slots, every frame kept: the producer never drops
            assert tx.send(np.full((2, 3, 3), i, np.uint8)) is not None
            kept.append(rx.recv(1))
        assert tx.stats()["dropped"] == 0 and rx.stats()["path"] == "copy"
        for i, f in enumerate(kept):
            assert f.seq == i + 1 and f.strides == (9, 3, 1) and f.pixel_format is cudalink.PixelFormat.RGB
            out = np.from_dlpack(f)
            assert out.shape == (2, 3, 3) and np.all(out == i) and not out.flags.writeable


def test_a_selector_loop_follows_a_restarted_producer(name: str) -> None:
    """The README's selector pattern: register fileno(), poll() when readable; after ProducerGone, poll until
    the next producer is there and register its descriptor."""
    import selectors

    rx = cudalink.Receiver(name, connect=False, timeout=2.0)
    sel = selectors.DefaultSelector()
    got: list[tuple[int, int]] = []
    try:
        for generation in range(2):
            with cudalink.Sender(name, shape=(2,), dtype="uint8") as tx:
                deadline = time.monotonic() + 5
                while True:  # not attached: poll() says no producer until it attaches
                    assert time.monotonic() < deadline
                    try:
                        frame = rx.poll()
                        break
                    except cudalink.LinkTimeout:
                        time.sleep(0.01)
                assert frame is None
                sel.register(rx.fileno(), selectors.EVENT_READ)
                for i in range(3):
                    tx.send(np.full(2, 10 * generation + i, np.uint8))
                    assert sel.select(5.0)
                    with rx.poll() as f:  # type: ignore[union-attr]
                        got.append((generation, int(np.from_dlpack(f)[0])))
                sel.unregister(rx.fileno())
            with pytest.raises(cudalink.ProducerGone):
                while rx.poll() is None:
                    pass
            with pytest.raises(cudalink.LinkError, match=r"producer is gone.*register the new fileno"):
                rx.fileno()
    finally:
        rx.close()
    assert got == [(0, 0), (0, 1), (0, 2), (1, 10), (1, 11), (1, 12)]


def test_many_consumers_each_get_every_frame(name: str, transport: object) -> None:
    tx = cudalink.Sender(name, shape=(2,), dtype="int64", slots=4, transport=transport)  # type: ignore[arg-type]
    rxs = [cudalink.Receiver(name, transport=transport, latest=False) for _ in range(8)]  # type: ignore[arg-type]
    with tx:
        for i in range(1, 4):
            tx.send(np.array([i, i], np.int64))
        for rx in rxs:
            assert [int(np.from_dlpack(rx.recv(1))[0]) for _ in range(3)] == [1, 2, 3]
        assert tx.stats()["consumers"] == 8
        for rx in rxs:
            rx.close()


def test_consumer_table_full_is_refused_clearly(name: str, pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, shape=(2,), dtype="uint8", max_consumers=1)
    with pytest.raises(cudalink.ProtocolError, match="max_consumers"):
        cudalink.Receiver(name, transport=transport, timeout=0.5)
    rx.close()
    tx.send(np.zeros(2, np.uint8))  # the link is still usable


def test_bad_input_is_refused_and_the_link_stays_usable(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport)
    with tx, rx:
        for bad in (np.zeros((4, 5), np.uint16), np.zeros((4, 4), np.float32), "hello", object()):
            with pytest.raises(cudalink.FormatError):
                tx.send(bad)
        with pytest.raises(cudalink.FormatError, match="meta"):
            tx.send(np.zeros((4, 4), np.uint16), meta=b"x" * 100)
        tx.send(np.arange(16, dtype=np.uint16).reshape(4, 4))
        assert np.from_dlpack(rx.recv(1))[3, 3] == 15
        strided = np.zeros((8, 4), np.uint16)[::2]
        tx.send(strided)  # non-contiguous host input is copied correctly
        assert np.from_dlpack(rx.recv(1)).shape == (4, 4)
    with pytest.raises(cudalink.LinkClosed):
        tx.send(np.zeros((4, 4), np.uint16))
    with pytest.raises(cudalink.LinkClosed):
        rx.recv(0.1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"slots": 0}, "slots"),
        ({"slots": 1000}, "slots"),
        ({"policy": "wait"}, "policy"),
        ({"max_consumers": 0}, "max_consumers"),
        ({"device": "gpu"}, "device"),
        ({"capacity": 1}, "capacity"),
        ({"dtype": "object"}, "dtype"),
        ({"shape": (0, 3)}, "dimension"),
    ],
)
def test_bad_sender_arguments(name: str, kw: dict[str, object], match: str) -> None:
    kw.setdefault("shape", (4, 4))
    with pytest.raises(cudalink.LinkError, match=match):
        cudalink.Sender(name, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".hidden", "x" * 60, "a..b", None, "sp ace"])
def test_names_cannot_escape(bad: object) -> None:
    with pytest.raises(cudalink.LinkError, match="invalid link name"):
        cudalink.Sender(bad, shape=(1,))  # type: ignore[arg-type]
    with pytest.raises(cudalink.LinkError, match="invalid link name"):
        cudalink.Receiver(bad, timeout=0.1)  # type: ignore[arg-type]


def test_segments_and_socket_are_private(name: str) -> None:
    with cudalink.Sender(name, shape=(8,)) as tx:
        sock = _platform.socket_path(name)
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
        for seg in (_platform.segment_name(name), _platform.segment_name(name, f"-{tx.generation:016x}")):
            assert stat.S_IMODE(os.stat(f"/dev/shm/{seg}").st_mode) == 0o600
    assert not os.path.exists(sock)
    assert not os.path.exists(f"/dev/shm/{_platform.segment_name(name)}")


def test_second_live_producer_is_refused(name: str) -> None:
    with cudalink.Sender(name, shape=(8,)), pytest.raises(cudalink.LinkError, match="already published"):
        cudalink.Sender(name, shape=(8,))


def test_receiver_waits_for_a_producer_then_times_out(name: str) -> None:
    with pytest.raises(cudalink.LinkTimeout, match="no producer"):
        cudalink.Receiver(name, timeout=0.2)
    rx = cudalink.Receiver(name, connect=False)
    with cudalink.Sender(name, shape=(2,)) as tx:
        tx.send(np.ones(2, np.uint8))
        assert rx.recv(1).seq == 1
    rx.close()


def test_close_with_frames_held_keeps_them_valid(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport)
    tx.send(np.full((4, 4), 7, np.uint16))
    frame = rx.recv(1)
    view = np.from_dlpack(frame)
    rx.close()
    tx.close()
    gc.collect()
    assert view[2, 2] == 7  # mapping outlives both ends while a view exists


def test_a_closed_receiver_unmaps_once_after_its_last_frame_dies_on_any_thread(
    pair: PairFactory, transport: Transport
) -> None:
    """Frames take no lock: their leases are counted in a set. Released from six threads at once, after
    close(), the mapping goes exactly once, and only when the last frame is gone."""
    tx, rx = pair(transport, slots=8)
    frames = []
    for i in range(6):
        tx.send(np.full((4, 4), i, np.uint16))
        frames.append(rx.recv(1))
    att = rx._att
    assert att is not None and len(att.live) == 6
    closes: list[int] = []
    close = att.view.close

    def counted_close() -> None:
        closes.append(1)
        close()

    att.view.close = counted_close  # type: ignore[method-assign]
    rx.close()
    assert not att.unmapped and closes == []  # six frames still hold the mapping
    views = [np.from_dlpack(f) for f in frames]
    barrier = threading.Barrier(len(frames))

    def drop(f: cudalink.Frame) -> None:
        barrier.wait()
        f.release()

    threads = [threading.Thread(target=drop, args=(f,)) for f in frames]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [int(v[1, 1]) for v in views] == list(range(6))  # the views still hold the memory
    assert not att.unmapped and closes == []
    del views
    gc.collect()
    assert att.unmapped and closes == [1] and not att.live
    tx.close()


def test_reserve_refuses_oversized_meta_before_taking_a_slot(pair: PairFactory, transport: Transport) -> None:
    tx, rx = pair(transport, slots=1)
    with tx, rx:
        with pytest.raises(cudalink.FormatError, match="meta"), tx.reserve(meta=b"x" * 100) as w:
            np.from_dlpack(w)[...] = 1
        assert tx.stats()["published"] == 0
        with tx.reserve(meta=b"ok") as w:  # the single slot is still free: nothing leaked
            np.from_dlpack(w)[...] = 2
        f = rx.recv(1)
        assert f.meta == b"ok" and np.from_dlpack(f)[0, 0] == 2


def test_a_receiver_in_a_left_ones_place_is_woken(pair: PairFactory, transport: Transport, name: str) -> None:
    """The producer caches which connections a wake-up goes to: a receiver that joins at the index a
    departed one held must get its own wake-ups, not sleep out its timeout."""
    import time

    tx, first = pair(transport, rx={"wait": "block", "timeout": 30.0})

    def sleeper(rx: cudalink.Receiver, out: list[tuple[int, float]]) -> threading.Thread:
        def run() -> None:
            t0 = time.monotonic()
            f = rx.recv()
            out.append((f.seq, time.monotonic() - t0))
            f.release()

        return threading.Thread(target=run)

    with tx:
        tx.send(np.full((4, 4), 1, np.uint16))
        first.recv().release()  # attached
        index = first._att.ring.index if first._att else -1
        for turn in range(2):
            rx = first if turn == 0 else cudalink.Receiver(name, transport=transport, wait="block", timeout=30.0)
            with rx:
                if rx is not first:
                    tx.send(np.full((4, 4), 2, np.uint16))
                    rx.recv().release()  # attached, in the place the first one left
                    assert rx._att is not None and rx._att.ring.index == index
                got: list[tuple[int, float]] = []
                t = sleeper(rx, got)
                t.start()
                deadline = time.monotonic() + 10
                while not tx._ring.sleepers(tx._handler.joined) and time.monotonic() < deadline:
                    time.sleep(0.001)  # asleep in recv() now
                seq = tx.send(np.full((4, 4), 3, np.uint16))
                t.join()
                assert got and got[0][0] == seq
                assert got[0][1] < 10  # woken by the send, not by its 30 s timeout
            deadline = time.monotonic() + 10
            while tx._handler.joined and time.monotonic() < deadline:
                time.sleep(0.001)  # the producer saw it leave


def test_wake_ups_are_kept_per_mask_once_every_connection_is_joined(pair: PairFactory, transport: Transport) -> None:
    """``Server.wakers`` is None while a connection is not registered yet (a consumer between its hello
    and its welcome): that wake-up goes through ``Server.wake`` and nothing is kept, so the consumer is
    not left out of that mask's wake-ups for good."""
    tx, rx = pair(transport, rx={"wait": "block"})
    with tx, rx:
        tx.send(np.full((4, 4), 1, np.uint16))
        rx.recv().release()
        assert rx._att is not None
        mine = 1 << rx._att.ring.index
        handler = tx._handler
        assert tx._server.wakers([handler.conn_at[rx._att.ring.index], -12345]) is None
        spare = next(i for i in range(64) if not handler.joined & (1 << i))
        handler.conn_at = {**handler.conn_at, spare: -12345}  # joined as the handler sees it, not registered yet
        assert rx._att.client.drain()
        tx._wake(mine | 1 << spare, "waking", "sent")
        assert (mine | 1 << spare) not in handler.wakers_of
        assert select.select([rx.fileno()], [], [], 5.0)[0]  # the wake-up reached the joined one all the same
        tx._wake(mine, "waking", "sent")
        assert len(handler.wakers_of[mine]) == 1  # kept once every connection in it is registered


def test_a_kept_wake_up_to_a_closed_connection_is_harmless(pair: PairFactory, transport: Transport) -> None:
    """A consumer's socket can close between the producer reading the mask and the handler forgetting
    the wake-ups kept for it: the send raises inside, never out of ``send()``."""
    tx, rx = pair(transport, rx={"wait": "block"})
    with tx:
        tx.send(np.full((4, 4), 1, np.uint16))
        rx.recv().release()
        assert rx._att is not None
        mine = 1 << rx._att.ring.index
        tx._wake(mine, "waking", "sent")
        (waker,) = tx._handler.wakers_of[mine]
        assert isinstance(waker, functools.partial)  # socket.send, bound in C
        sock = waker.func.__self__
        sock.close()  # as the control loop does when the consumer leaves
        with pytest.raises(OSError):
            waker()
        tx._wake(mine, "waking", "sent")  # swallowed
        rx.close()


def test_a_close_inside_a_reserve_block_on_its_thread_closes_as_the_block_ends(
    pair: PairFactory, transport: Transport
) -> None:
    """A signal handler (or another task of the block's loop) that calls close() runs on the thread whose
    reserve() block is open: the close went through under the block's writer (its slot freed; on a GPU its memory
    and ready event too) and the block's end then published into a closed link. The close now waits for the
    block: its frame is the link's last, then the consumer hears the producer closed."""
    tx, rx = pair(transport, shape=(4,), dtype="uint8", slots=2, rx={"latest": False})
    with rx:
        with tx.reserve() as w, tx.reserve() as inner:
            np.from_dlpack(w)[...] = 7
            np.from_dlpack(inner)[...] = 6
            tx.close()  # as a signal handler would, on this thread
            assert not tx.closed  # the blocks still write their slots
            np.from_dlpack(w)[...] = 8
        assert tx.closed  # closed as the outer block ended
        got = []
        with pytest.raises(cudalink.ProducerGone):
            while True:
                f = rx.recv(2)
                got.append((f.seq, np.from_dlpack(f).tolist()))
                f.release()
        assert got == [(1, [6] * 4), (2, [8] * 4)]
