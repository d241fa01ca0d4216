"""The landing pool's bookkeeping, on fake pointers and events (no GPU): which buffer a copy gets, when a
buffer may be reused (its fences passed), GPU-side waits instead of CPU ones, and teardown."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cudalink.cuda import devices
from cudalink.cuda.landing import Landing, LandingFull
from cudalink.errors import LinkError


class FakeEvent:
    def __init__(self, ctx: int, n: int) -> None:
        self.ctx = ctx
        self.n = n
        self.passed = True  # an event never recorded is complete, as CUDA's
        self.records: list[int] = []

    def __repr__(self) -> str:
        return f"ev{self.n}"


class FakeOps:
    """Records every call; streams 100+ belong to context 1 (the source), 200+ to context 2 (the buffers)."""

    device = 1
    path = devices.PATH_PEER

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.next_ptr = 0x1000
        self.live: set[int] = set()
        self.events: list[FakeEvent] = []
        self.destroyed: list[FakeEvent] = []
        self.closed = False
        self.fail_record: set[int] = set()

    def alloc(self, nbytes: int) -> int:
        ptr = self.next_ptr
        self.next_ptr += 0x1000
        self.live.add(ptr)
        self.calls.append(("alloc", ptr))
        return ptr

    def free(self, ptr: int) -> None:
        self.live.remove(ptr)
        self.calls.append(("free", ptr))

    def context_of(self, stream: int) -> int:
        return 1 if stream < 200 else 2

    def new_event(self, ctx: int) -> FakeEvent:
        ev = FakeEvent(ctx, len(self.events))
        self.events.append(ev)
        return ev

    def destroy_event(self, ev: FakeEvent) -> None:
        self.destroyed.append(ev)

    def record(self, ev: FakeEvent, stream: int) -> None:
        if stream in self.fail_record:
            raise LinkError("stream gone")
        assert ev.ctx == self.context_of(stream), "an event is recorded only on a stream of its own context"
        ev.passed = False
        ev.records.append(stream)
        self.calls.append(("record", ev, stream))

    def wait(self, stream: int, ev: FakeEvent) -> None:
        self.calls.append(("wait", stream, ev))

    def done(self, ev: FakeEvent) -> bool:
        return ev.passed

    def sync(self, ev: FakeEvent) -> None:
        self.calls.append(("sync", ev))
        ev.passed = True

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        assert dst in self.live
        self.calls.append(("copy", dst, src, nbytes, stream))

    def copy_2d(self, dst: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        self.calls.append(("copy_2d", dst, src, src_pitch, width, height, stream))

    def copy_stream(self) -> int:
        return 100

    def local_stream(self) -> int:
        return 250

    def close(self) -> None:
        self.closed = True

    def waits(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == "wait"]


def pool(limit: int = 3) -> tuple[Landing, FakeOps]:
    ops = FakeOps()
    return Landing(1, 1024, limit=limit, ops=ops), ops


def test_land_orders_the_copy_after_the_source_and_records_ready_on_the_copy_stream() -> None:
    p, ops = pool()
    src_ready = FakeEvent(1, -1)
    got = p.land(0xBEEF, 512, after=src_ready)
    assert ops.calls[0] == ("wait", 100, src_ready)  # first: the copy stream waits on the source
    assert ops.calls[1][0] == "alloc"
    assert ops.calls[2] == ("copy", got.ptr, 0xBEEF, 512, 100)
    assert ops.calls[3] == ("record", got.ready, 100)
    assert got.device == 1 and got.nbytes == 512
    # a consumer stream waits on the ready event, on the GPU; CAI gets a local stream that waited
    got.wait(201)
    assert ops.calls[-1] == ("wait", 201, got.ready)
    assert got.cai_stream() == 250
    assert p.stats()["path"] == "peer" and p.stats()["held"] == 1


def test_a_buffer_is_reused_only_after_its_fences_pass() -> None:
    p, ops = pool(limit=3)
    a = p.land(1, 8)
    a.give_back([201, 202])  # exported to two consumer streams: one fence each, recorded in their context
    fences = [c for c in ops.calls if c[0] == "record" and c[2] >= 200]
    assert [c[2] for c in fences] == [201, 202]
    b = p.land(2, 8)
    assert b.ptr != a.ptr  # a's fences have not passed: a new buffer, not a wait
    for _, ev, _ in fences:
        ev.passed = True
    c = p.land(3, 8)
    assert c.ptr == a.ptr  # passed: reused, with no GPU wait
    assert not [w for w in ops.waits() if w[2] in [f[1] for f in fences]]


def test_at_the_limit_the_copy_waits_on_the_oldest_fence_on_the_gpu_never_the_cpu() -> None:
    p, ops = pool(limit=2)
    a = p.land(1, 8)
    b = p.land(2, 8)
    a.give_back([201])
    b.give_back([202])
    fence_a = next(c[1] for c in ops.calls if c[0] == "record" and c[2] == 201)
    c = p.land(3, 8)
    assert c.ptr == a.ptr  # the oldest given back
    assert ("wait", 100, fence_a) in ops.calls
    assert not [x for x in ops.calls if x[0] == "sync"]
    assert p.stats()["gpu_waits"] == 1 and p.stats()["buffers"] == 2


def test_every_buffer_held_is_a_clear_error_and_nothing_leaks() -> None:
    p, _ops = pool(limit=2)
    held = [p.land(1, 8), p.land(2, 8)]
    with pytest.raises(LandingFull, match="release frames"):
        p.land(3, 8)
    held[0].give_back([])
    assert p.land(3, 8).ptr == held[0].ptr  # never exported: no fence, reused at once


def test_give_back_twice_is_harmless() -> None:
    p, _ops = pool(limit=1)
    a = p.land(1, 8)
    a.give_back([201])
    a.give_back([201])
    assert p.stats()["held"] == 0
    p.land(2, 8)
    with pytest.raises(LandingFull):
        p.land(3, 8)


def test_too_large_a_copy_is_refused() -> None:
    p, _ = pool()
    with pytest.raises(LinkError, match="do not fit"):
        p.land(1, 2048)
    with pytest.raises(LinkError, match="does not fit"):
        p.land(1, 64, pitch=(128, 64, 32))  # 2 KiB of rows
    with pytest.raises(LinkError):
        Landing(0, 0, ops=FakeOps())


def test_pitched_copy_is_one_2d_copy_into_a_packed_buffer() -> None:
    p, ops = pool()
    got = p.land(0x10, 64 * 8, pitch=(128, 64, 8))
    assert ("copy_2d", got.ptr, 0x10, 128, 64, 8, 100) in ops.calls


def test_a_failed_copy_gives_the_buffer_back() -> None:
    p, ops = pool(limit=1)

    def boom(*a: object) -> None:
        raise LinkError("copy failed")

    ops.copy = boom  # type: ignore[method-assign]
    with pytest.raises(LinkError, match="copy failed"):
        p.land(1, 8)
    assert p.stats()["held"] == 0


def test_a_dead_stream_at_give_back_does_not_lose_the_buffer() -> None:
    p, ops = pool(limit=1)
    a = p.land(1, 8)
    ops.fail_record.add(203)
    a.give_back([203])
    assert p.stats()["held"] == 0
    assert p.land(2, 8).ptr == a.ptr


def test_a_reused_buffer_waits_for_its_last_copy_when_that_ran_on_another_stream() -> None:
    p, ops = pool(limit=1)
    a = p.land(1, 8, stream=150)
    a.give_back([])
    assert not a.ready.passed  # type: ignore[union-attr]
    p.land(2, 8, stream=160)
    assert ("wait", 160, a.ready) in ops.calls


def test_take_then_mark_ready_for_writers_that_fill_the_buffer_themselves() -> None:
    p, ops = pool()
    landed, s = p.take()
    assert s == 100 and landed.ready is None
    landed.mark_ready(201)
    assert ops.calls[-1] == ("record", landed.ready, 201)
    assert landed.ready.ctx == 2  # type: ignore[union-attr]  # made in the stream's own context
    landed.give_back([])
    with pytest.raises(LinkError):
        landed.mark_ready(201)


def test_close_frees_idle_buffers_now_and_held_ones_when_given_back() -> None:
    p, ops = pool()
    a = p.land(1, 8)
    b = p.land(2, 8)
    b.give_back([201])
    p.close()
    assert b.ptr not in ops.live and a.ptr in ops.live
    assert ("sync", next(c[1] for c in ops.calls if c[0] == "record" and c[2] == 201)) in ops.calls
    assert not ops.closed
    with pytest.raises(LinkError, match="closed"):
        p.land(3, 8)
    a.give_back([202])
    assert not ops.live and ops.closed
    assert set(ops.destroyed) == set(ops.events)  # every event made was destroyed
    p.close()  # twice: nothing


def test_give_back_from_many_threads_keeps_the_count() -> None:
    p, _ops = pool(limit=64)
    landed = [p.land(i, 8) for i in range(64)]
    threads = [threading.Thread(target=lambda x=x: x.give_back([]) or x.give_back([])) for x in landed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.stats()["held"] == 0 and len(p._free) == 64


def test_fences_of_streams_gone_by_do_not_pile_up() -> None:
    p, ops = pool(limit=1)
    for s in range(201, 241):  # a framework that hands each export a new stream
        x = p.land(1, 8)
        x.give_back([s])
        ops.events[-1].passed = True
    assert len(p._bufs[0].fences) <= 9


def test_available_says_whether_a_copy_would_wait_on_the_gpu() -> None:
    p, ops = pool(limit=1)
    assert p.available()  # room to allocate
    a = p.land(1, 8)
    assert p.available()  # every buffer held: a copy raises LandingFull rather than wait for nothing
    a.give_back([201])
    assert not p.available() and not p.wait_available(0.01)  # fenced by work still queued
    ops.events[-1].passed = True
    assert p.available() and p.wait_available(0.0)


def test_check_room_refuses_only_when_every_buffer_is_held() -> None:
    p, _ = pool(limit=2)
    p.check_room()
    a = p.land(1, 8)
    p.check_room()  # one more can be allocated
    b = p.land(2, 8)
    with pytest.raises(LandingFull):
        p.check_room()
    a.give_back([])
    p.check_room()
    del b
