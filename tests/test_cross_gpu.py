"""Receiving on another GPU, without one: the wrapper that lands each frame (on a fake landing pool) and the
ring source's choice between zero copy, a landing copy, and a clear refusal (on a faked device list)."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

import cudalink
from cudalink.cuda import devices
from cudalink.cuda.landing import Landing
from cudalink.errors import CudaUnavailable, FormatError
from cudalink.frames.frame import Frame
from cudalink.frames.spec import FrameSpec
from cudalink.transport import ring_source
from cudalink.transport.landed import LandedAttachment
from cudalink.transport.source import account

from .test_landing import FakeOps

SPEC = FrameSpec((4, 8), "uint8")


class FakeLease:
    """The slot's lease as a frame holds it: ``ptr``, the ``streams`` it went to, ``end()``."""

    def __init__(self, log: list[Any], slot_ptr: int) -> None:
        self.owner = None
        self.ptr = slot_ptr
        self.streams: list[int] = []
        self.log = log

    def end(self) -> None:
        self.log.append(("slot released", list(self.streams)))


class FakeSync:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def wait(self, stream: int) -> None:
        self.log.append(("slot ready waited", stream))

    def cai_stream(self) -> int | None:
        return None


class FakeRing:
    """A CUDA attachment on the producer's GPU (0), with frames queued by the test."""

    backend = "cuda-pool"
    capacity = 1024
    floor = 0
    generation = 7
    device = "cuda:0"

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.frames: deque[int] = deque()
        self.detached = False

    @staticmethod
    def receive(rx: Any, att: FakeRing) -> Frame | None:
        if not att.frames:
            return None
        seq = att.frames.popleft()
        account(rx, seq)
        lease = FakeLease(att.log, 0x9000 + seq)
        return Frame._received(SPEC, lease, 0, seq, 123, b"m", FakeSync(att.log), att.generation)  # type: ignore[arg-type]

    @staticmethod
    def sleep_receive(rx: Any, att: FakeRing, timeout: float, waiting: int, after: int) -> Frame | None:
        return FakeRing.receive(rx, att)

    def closing(self) -> bool:
        return False

    def alive(self) -> bool:
        return True

    def set_waiting(self, state: int) -> None:
        pass

    def count(self, received: int, skipped: int) -> None:
        pass

    def fileno(self) -> int:
        return -1

    async def wait_async(self, timeout: float | None) -> None:
        pass

    def detach(self) -> None:
        self.detached = True


class Rx:
    latest = True
    received = 0
    skipped = 0
    _last = 0
    _floor = 0


def wrapped() -> tuple[LandedAttachment, FakeRing, FakeOps]:
    ops = FakeOps()
    ring = FakeRing()
    att = LandedAttachment(ring, 0, 1, buffers=3, pool=Landing(1, 1024, limit=3, ops=ops))
    return att, ring, ops


def test_a_landed_frame_lives_on_our_gpu_and_the_slot_goes_back_after_the_copy() -> None:
    att, ring, ops = wrapped()
    rx = Rx()
    assert att.receive(rx, att) is None
    ring.frames.append(5)
    frame = att.receive(rx, att)
    assert frame is not None
    assert (frame.device, frame.seq, frame.timestamp_ns, frame.meta, frame.generation) == ("cuda:1", 5, 123, b"m", 7)
    assert rx.received == 1 and rx._last == 5  # the wrapped take counted it, once
    copy = next(c for c in ops.calls if c[0] == "copy")
    assert copy[2] == 0x9005 and copy[3] == SPEC.nbytes and copy[4] == att.copy_stream
    # the copy stream waited on the slot's ready event first, and the slot went back at once, fenced only by
    # the copy stream: a consumer that keeps the frame holds a landing buffer, never the producer's slot
    assert ring.log == [("slot ready waited", 100), ("slot released", [100])]
    assert frame.ptr == copy[1]
    assert att.pool.stats()["held"] == 1
    # consumers wait on the landed buffer's ready event (GPU-side); the release fences the buffer
    frame._sync.wait(201)  # type: ignore[union-attr]
    assert ops.calls[-1][0] == "wait" and ops.calls[-1][1] == 201
    frame._hold.streams.append(201)  # type: ignore[union-attr]  # as a DLPack export to stream 201 does
    frame.release()
    del frame
    assert att.pool.stats()["held"] == 0
    assert [c[2] for c in ops.calls if c[0] == "record"][-1] == 201


def test_the_sleeping_take_lands_too_and_detach_frees_the_pool_once_frames_are_gone() -> None:
    att, ring, ops = wrapped()
    ring.frames.extend([1, 2])
    a = att.sleep_receive(Rx(), att, 0.1, 1, 0)
    assert a is not None and a.device == "cuda:1"
    att.detach()
    assert ring.detached and att.pool.closed
    assert ops.live  # a frame still holds its buffer
    a.release()
    del a
    assert not ops.live and ops.closed


def test_a_failed_landing_still_gives_the_slot_back() -> None:
    att, ring, _ops = wrapped()
    ring.frames.extend([1, 2, 3, 4])
    held = [att.receive(Rx(), att) for _ in range(3)]  # every landing buffer held
    with pytest.raises(cudalink.LandingFull, match="release frames"):
        att.receive(Rx(), att)
    assert list(ring.frames) == [4]  # refused before the take: the frame is still there for later
    # a landing that fails after the take (here: the pool's own bookkeeping) still gives the slot back
    att.pool.check_room = lambda: None  # type: ignore[method-assign]
    with pytest.raises(cudalink.LandingFull):
        att.receive(Rx(), att)
    assert ring.log[-1] == ("slot released", [])  # released unfenced: nothing queued reads it
    del held


# -- which attachment the ring source picks --------------------------------------------------------------------


class FakeFixed:
    device_uuid = bytes(range(16))
    nslots = 4


class FakeView:
    allowed: list[int] = []

    def allow_peer(self, ordinal: int, probe: bytes) -> bool:
        FakeView.allowed.append(ordinal)
        return True


class FakeHandle:
    memory = b"h" * 64


class FakeRingAtt:
    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self.fixed = FakeFixed()
        self.view = FakeView()
        self.handles = [FakeHandle()]


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    monkeypatch.setattr(devices, "visible", lambda: [(0, bytes(range(16))), (1, bytes(range(16, 32)))])
    made: list[Any] = []
    monkeypatch.setattr(ring_source, "LandedAttachment", lambda att, src, dst, buffers: made.append((src, dst)) or made)
    return made


def place(device: Any, copy: str, producer: int) -> Any:
    src = ring_source.RingSource("x", transport=None, device=device, copy=copy)  # type: ignore[arg-type]
    return src._place(FakeRingAtt(producer))  # type: ignore[arg-type]


def test_the_producers_gpu_or_none_is_zero_copy(two_gpus: list[Any]) -> None:
    for device in (None, 1, "cuda:1"):
        att = place(device, "auto", 1)
        assert isinstance(att, FakeRingAtt)
    assert not two_gpus


def test_another_gpu_lands_and_always_lands_even_on_the_producers(two_gpus: list[Any]) -> None:
    FakeView.allowed.clear()
    place(1, "auto", 0)
    place(None, "always", 0)
    place(0, "always", 0)
    assert two_gpus == [(0, 1), (0, 0), (0, 0)]
    assert FakeView.allowed == [1]  # GPU 1 was let into the producer's pool; the same GPU needs nothing


def test_copy_never_refuses_a_cross_gpu_link_by_name(two_gpus: list[Any]) -> None:
    with pytest.raises(FormatError, match=r"cuda:0 \(GPU-00010203.*cuda:1.*copy='never' refuses it.*copy='auto'"):
        place(1, "never", 0)


def test_a_gpu_that_is_not_there_is_refused_before_attaching(two_gpus: list[Any]) -> None:
    with pytest.raises(CudaUnavailable, match="no cuda:2 here; this process sees 2 GPU"):
        place(2, "auto", 0)


def test_cpu_and_host_links_keep_their_rules(two_gpus: list[Any]) -> None:
    assert isinstance(place("cpu", "auto", -1), FakeRingAtt)
    with pytest.raises(FormatError, match="host frames"):
        place(1, "auto", -1)
    with pytest.raises(FormatError, match="device='cpu' takes only host links"):
        place("cpu", "auto", 0)


def test_receiver_device_on_a_machine_without_that_gpu_is_a_clear_error() -> None:
    if devices.count() > 1:
        pytest.skip("this machine has a second GPU")
    # one GPU: names the one there is; none: says why there is none
    with pytest.raises(CudaUnavailable, match=r"no cuda:1 here(; this process sees 1 GPU|: .*device='cpu')"):
        cudalink.Receiver("nobody-here", device=1, connect=False)
    with pytest.raises(cudalink.LinkError, match="copy must be"):
        cudalink.Receiver("nobody-here", copy="sometimes", connect=False)  # type: ignore[arg-type]


def test_a_consumer_whose_gpu_is_behind_takes_no_slot_until_a_buffer_is_free() -> None:
    att, ring, ops = wrapped()  # three landing buffers
    ring.frames.extend(range(1, 10))
    rx = Rx()
    for _ in range(3):
        f = att.receive(rx, att)
        assert f is not None
        f._hold.streams.append(201)  # type: ignore[union-attr]  # exported: the release leaves a fence
        f.release()
        del f
    fences = [c[1] for c in ops.calls if c[0] == "record" and c[2] == 201]
    assert len(fences) == 3 and att.pool.stats()["buffers"] == 3
    taken = rx.received
    assert att.receive(rx, att) is None  # every buffer still fenced by our GPU: no slot taken
    assert att.sleep_receive(rx, att, 0.02, 1, 0) is None  # waited (bounded) for our own GPU, took nothing
    assert rx.received == taken and att.pool.stats()["gpu_waits"] == 0
    fences[1].passed = True
    f = att.receive(rx, att)
    assert f is not None and f.ptr == next(c[1] for c in ops.calls if c[0] == "copy" and c[2] == 0x9002)
    assert att.pool.stats()["gpu_waits"] == 0  # the copy never waited on the GPU for the consumer


class LandedSource:
    """A source whose attachments land frames on GPU 1 (fake pool), as the ring source builds them."""

    name = "landed"

    def __init__(self) -> None:
        self.made: list[LandedAttachment] = []

    def attach(self, deadline: float, dead_generation: int) -> LandedAttachment:
        att, ring, _ = wrapped()
        ring.frames.extend(range(1, 6))
        self.made.append(att)
        return att

    def close(self) -> None:
        pass


def test_the_receiver_drives_a_landed_attachment_and_reports_its_path() -> None:
    src = LandedSource()
    rx = cudalink.Receiver("landed", source=src, latest=False, wait="spin", timeout=1.0)
    assert rx.device == "cuda:1" and rx.stats()["path"] == "peer"
    got = [rx.recv(timeout=1.0) for _ in range(3)]
    assert [f.seq for f in got] == [1, 2, 3] and all(f.device == "cuda:1" for f in got)
    with pytest.raises(cudalink.LandingFull, match="release frames"):  # three buffers, three frames held
        rx.poll()
    for f in got:
        f.release()
    assert rx.poll().seq == 4  # type: ignore[union-attr]  # not taken while the pool was full: not lost
    assert rx.stats()["received"] == 4
    rx.close()
    att = src.made[0]
    assert att.inner.detached and att.pool.closed  # type: ignore[attr-defined]


def test_a_receiver_back_on_the_ring_drops_the_pair_bound_for_another_kind() -> None:
    """A producer that restarts on the Receiver's own GPU turns a landed link into a zero-copy one: the per-frame
    pair bound for the landed attachment must go, or the ring's attachment would be driven by it."""
    import numpy as np

    from cudalink.transport.memory import MemoryTransport

    tr = MemoryTransport()
    ring = ring_source.RingSource("ringback", tr)

    class Alternating:
        name = "ringback"
        n = 0

        def attach(self, deadline: float, dead_generation: int) -> Any:
            self.n += 1
            return wrapped()[0] if self.n == 1 else ring.attach(deadline, dead_generation)

        def close(self) -> None:
            pass

    with cudalink.Sender("ringback", shape=(4,), dtype="uint8", transport=tr) as tx:
        rx = cudalink.Receiver("ringback", source=Alternating(), timeout=1.0)  # type: ignore[arg-type]
        assert "_try_take" in rx.__dict__  # the landed pair, bound on the instance
        rx._gone("restarted")
        rx._attach(1.0)
        assert "_try_take" not in rx.__dict__ and "_sleep_take" not in rx.__dict__
        tx.send(np.arange(4, dtype=np.uint8))
        assert rx.recv(timeout=1.0).seq == 1
        rx.close()
