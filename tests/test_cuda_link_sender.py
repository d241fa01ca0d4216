"""``Sender(..., protocol="cuda-link")`` on CPU: argument checks, and the segment it writes (initialisation
order, per-frame fields, restart on reconfigure, close) with the CUDA slots replaced by host stand-ins, read
back by cudalink's own cuda-link reader. The GPU path is in tests/test_cuda_link_gpu.py."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

import cudalink
from cudalink import _backends
from cudalink.cuda_link import CudaLinkSender, writer_lock_path
from cudalink.frames.frame import Frame
from cudalink.frames.spec import FrameSpec
from cudalink.transport import cuda_link_wire as cw
from cudalink.transport import wire
from cudalink.transport.cuda_link_source import CudaLinkSource
from cudalink.transport.shm import _open_segment, _unlink_segment

from ._cuda_link_fake import HostSlotMemory


class FakeCudaSlots:
    """CudaSlots' surface over SharedMemory (handle = b"HOST" + segment name), recording the calls."""

    instances: list[FakeCudaSlots] = []

    def __init__(self, ordinal: int, nslots: int, capacity: int, handles: str) -> None:
        assert handles == "legacy" and capacity % (2 << 20) == 0
        self.device = ordinal
        self.capacity = capacity
        self.stream = None
        self.names = [f"fake_slot_{uuid.uuid4().hex[:10]}" for _ in range(nslots)]
        self.segs = [_open_segment(n, create=True, size=1 << 16) for n in self.names]
        self.calls: list[tuple[str, int]] = []
        self.closed = False
        FakeCudaSlots.instances.append(self)

    def handles(self) -> list[wire.SlotHandle]:
        out = []
        for i, n in enumerate(self.names):
            out.append(wire.SlotHandle((b"HOST" + n.encode()).ljust(64, b"\0"), self.capacity, bytes([i + 1]) * 64, 0))
        return out

    def source(self, spec: FrameSpec, src: object, stream: object) -> object:
        arr = np.asarray(src)
        spec.check_array(arr.shape, arr.dtype)
        return arr

    def copy_in(
        self, slot: int, spec: FrameSpec, src: object, stream: object, fences: list[object], checked: object
    ) -> None:
        buf = self.segs[slot].buf
        assert buf is not None
        np.copyto(np.ndarray(spec.shape, spec.dtype, buffer=buf), np.asarray(checked))
        self.calls.append(("copy+record", slot))

    def writable_frame(self, slot: int, spec: FrameSpec, seq: int, ts: int, fences: list[object]) -> Frame:
        buf = self.segs[slot].buf
        assert buf is not None
        arr = np.ndarray(spec.shape, spec.dtype, buffer=buf)
        return Frame.from_array(arr, seq=seq, timestamp_ns=ts)

    def commit(self, slot: int, streams: list[int], stream: object) -> None:
        self.calls.append(("record", slot))

    def close(self, timeout: float) -> None:
        self.closed = True
        for n, s in zip(self.names, self.segs, strict=True):
            s.close()
            _unlink_segment(n)


@pytest.fixture
def fake_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeCudaSlots]]:
    monkeypatch.setattr(_backends, "CudaSlots", FakeCudaSlots)
    monkeypatch.setattr("cudalink.cuda.devices.parse_device", lambda d: 0)
    FakeCudaSlots.instances = []
    yield FakeCudaSlots
    for s in FakeCudaSlots.instances:
        if not s.closed:
            s.close(0)


@pytest.fixture
def name() -> str:
    return f"cudalink_ipc_Python>>TD_{uuid.uuid4().hex[:8]}"


def _segment(name: str) -> shared_memory.SharedMemory:
    return _open_segment(name)


def test_argument_errors_name_the_fix() -> None:
    with pytest.raises(cudalink.LinkError, match="GPU memory only"):
        cudalink.Sender("x", shape=(4, 4, 4), protocol="cuda-link", device="cpu")
    with pytest.raises(cudalink.LinkError, match=r"1\.\.10 slots"):
        cudalink.Sender("x", shape=(4, 4, 4), protocol="cuda-link", slots=11)
    with pytest.raises(cudalink.LinkError, match="policy='drop'"):
        cudalink.Sender("x", shape=(4, 4, 4), protocol="cuda-link", policy="block")
    with pytest.raises(cudalink.LinkError, match="legacy"):
        cudalink.Sender("x", shape=(4, 4, 4), protocol="cuda-link", handles="pool")
    with pytest.raises(cudalink.FormatError, match="float64"):
        cudalink.Sender("x", shape=(4, 4, 4), dtype="float64", protocol="cuda-link")
    for dtype in ("int8", "int16", "int32", "uint32"):  # cuda-link's readers would take them for other types
        with pytest.raises(cudalink.FormatError, match=f"read {dtype} frames as another type"):
            cudalink.Sender("x", shape=(4, 4, 4), dtype=dtype, protocol="cuda-link")
    with pytest.raises(cudalink.FormatError, match="another type"):
        cudalink.Sender("x", shape=(4, 4, 4), dtype="int8", protocol="cuda-link", magic=cw.MAGIC_V09)
    with pytest.raises(cudalink.LinkError, match="protocol must be"):
        cudalink.Sender("x", shape=(4, 4, 4), protocol="ndi")


def test_argument_types_and_names_the_os_refuses_are_cudalink_errors(
    name: str, fake_slots: type[FakeCudaSlots]
) -> None:
    """Checked as a cudalink Sender checks them: no AttributeError/TypeError/ValueError/OSError from inside, no
    slots=True taken for 1, no timeout='1' or max_consumers='x' let through."""
    for bad_name in (None, b"cudalink_ipc_Python>>TD", 123):
        with pytest.raises(cudalink.ArgumentTypeError, match="cuda-link segment name is a str"):
            cudalink.Sender(bad_name, shape=(4, 4, 4), protocol="cuda-link")  # type: ignore[arg-type]
    for kw, err, needle in (
        ({"slots": True}, cudalink.ArgumentTypeError, "1..10 slots"),
        ({"timeout": "1"}, cudalink.ArgumentTypeError, "timeout must be a number of seconds"),
        ({"timeout": -1}, cudalink.ArgumentError, "timeout must be >= 0"),
        ({"max_consumers": "x"}, cudalink.ArgumentTypeError, "max_consumers must be an integer"),
        ({"capacity": "big"}, cudalink.ArgumentTypeError, "capacity must be an integer"),
        ({"capacity": -5}, cudalink.ArgumentError, "capacity must be 0"),
    ):
        with pytest.raises(err, match=needle):
            cudalink.Sender(name, shape=(4, 4, 4), protocol="cuda-link", **kw)  # type: ignore[arg-type]
    for dots in (".", ".."):
        with pytest.raises(cudalink.LinkError, match="not a cuda-link segment name"):
            cudalink.Sender(dots, shape=(4, 4, 4), protocol="cuda-link")
        with pytest.raises(cudalink.LinkError, match="not a cuda-link segment name"):
            cudalink.Receiver("cuda-link:" + dots, connect=False)
    with pytest.raises(cudalink.LinkError, match="choose another name") as err:
        cudalink.Sender("a" * 300, shape=(4, 4, 4), protocol="cuda-link")  # longer than the OS's names
    assert not isinstance(err.value, OSError)
    with cudalink.Receiver("cuda-link:" + "a" * 300, connect=False) as rx, pytest.raises(cudalink.LinkError) as err:
        rx.poll()
    assert "check the name" in str(err.value)
    assert all(s.closed for s in fake_slots.instances)  # nothing refused keeps its slots


def test_no_gpu_says_cuda_link_needs_one_instead_of_suggesting_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """device='cpu' is refused for cuda-link, so the usual "use device='cpu'" advice would lead nowhere."""
    from cudalink.cuda import driver
    from cudalink.transport import cuda_link_source

    def no_gpu(*args: object, **kw: object) -> None:
        raise driver.no_gpu("cudalink: no usable CUDA driver (none here)")  # what devices.device raises

    monkeypatch.setattr(_backends, "CudaSlots", no_gpu)
    with pytest.raises(cudalink.CudaUnavailable, match="cuda-link Sender needs a usable NVIDIA GPU") as err:
        cudalink.Sender(f"nogpu{uuid.uuid4().hex[:6]}", shape=(4, 4, 4), protocol="cuda-link")
    assert driver.NO_GPU_HINT not in str(err.value)
    monkeypatch.setattr(cuda_link_source, "CudaSlotMemory", no_gpu)
    with pytest.raises(cudalink.CudaUnavailable, match="reading a cuda-link segment needs a usable NVIDIA GPU"):
        cuda_link_source.CudaLinkSource("cuda-link:whatever")._make_memory()


def test_the_segment_it_writes(name: str, fake_slots: type[FakeCudaSlots]) -> None:
    tx = cudalink.Sender(name, shape=(4, 6, 4), pixel_format="BGRA", slots=2, protocol="cuda-link")
    try:
        assert isinstance(tx, CudaLinkSender) and tx.slots == 2 and tx.device == "cuda:0"
        shm = _segment(name)
        assert shm.buf is not None
        seg = cw.read_segment(shm.buf, name)
        assert seg.header == cw.Header(cw.MAGIC, 1, 2, 0)
        assert seg.metadata == cw.Metadata(6, 4, 4, cw.FORMAT_UNSIGNED, 8, cw.FLAG_BGRA, 96)
        assert seg.event_handles == (b"\x01" * 64, b"\x02" * 64) and not seg.shutdown
        assert fake_slots.instances[0].capacity == 2 << 20  # rounded up to 2 MiB

        assert tx.send(np.full((4, 6, 4), 3, np.uint8)) == 1
        assert tx.send(np.full((4, 6, 4), 4, np.uint8)) == 2
        assert tx.send(np.full((4, 6, 4), 5, np.uint8)) == 3
        assert fake_slots.instances[0].calls == [("copy+record", 0), ("copy+record", 1), ("copy+record", 0)]
        assert cw.read_write_idx(shm.buf) == 3 and cw.read_timestamp(shm.buf, 2) > 0
        with tx.reserve() as f:
            np.asarray(f.numpy()).fill(9)
        assert fake_slots.instances[0].calls[-1] == ("record", 1) and cw.read_write_idx(shm.buf) == 4
        with pytest.raises(RuntimeError), tx.reserve():
            raise RuntimeError("aborted")
        assert cw.read_write_idx(shm.buf) == 4  # nothing published
        with pytest.raises(cudalink.FormatError, match="no meta"):
            tx.send(np.zeros((4, 6, 4), np.uint8), meta=b"x")
        assert tx.stats() == {"published": 4, "dropped": 0, "consumers": -1, "version": 1}
        shm.close()
    finally:
        tx.close(timeout=0)
    assert tx.closed and fake_slots.instances[0].closed
    with pytest.raises(FileNotFoundError):
        _segment(name)
    with pytest.raises(cudalink.LinkClosed):
        tx.send(np.zeros((4, 6, 4), np.uint8))


def test_close_sets_shutdown_and_zeroes_handles_before_the_grace(name: str, fake_slots: type[FakeCudaSlots]) -> None:
    tx = cudalink.Sender(name, shape=(4, 6, 4), slots=2, protocol="cuda-link")
    shm = _segment(name)
    assert shm.buf is not None
    seen = {}

    def sleep(s: float) -> None:  # during the grace: what readers see
        assert shm.buf is not None
        seen["shutdown"] = cw.read_shutdown(shm.buf, 2)
        seen["handles"] = [cw.read_handles(shm.buf, 2, i) for i in range(2)]
        seen["grace"] = s

    import cudalink.cuda_link as mod

    orig = mod.time.sleep
    mod.time.sleep = sleep  # type: ignore[assignment]
    try:
        tx.close()
    finally:
        mod.time.sleep = orig
    shm.close()
    assert seen == {"shutdown": True, "handles": [(bytes(64), bytes(64))] * 2, "grace": 0.1}


def test_our_reader_reads_our_writer(name: str, fake_slots: type[FakeCudaSlots]) -> None:
    with cudalink.Sender(name, shape=(4, 6, 3), dtype="float32", slots=3, protocol="cuda-link") as tx:
        src = CudaLinkSource("cuda-link:" + name, memory=HostSlotMemory)
        with cudalink.Receiver("cuda-link:" + name, source=src, timeout=1.0) as rx:
            for v in range(1, 6):
                tx.send(np.full((4, 6, 3), v, np.float32))
                f = rx.recv(timeout=1.0)
                assert f.seq == v and f.shape == (4, 6, 3) and (f.numpy() == v).all()
            gen = rx.generation
            tx.reconfigure(shape=(2, 3, 4), dtype="uint16")  # a restart for cuda-link readers
            assert tx.version == 2
            with pytest.raises(cudalink.ProducerGone):
                rx.recv(timeout=1.0)
            tx.send(np.full((2, 3, 4), 7, np.uint16))
            f = rx.recv(timeout=1.0)
            assert rx.generation != gen and f.seq == 1 and f.dtype == np.uint16 and (f.numpy() == 7).all()
            tx.close(timeout=0)
            with pytest.raises(cudalink.ProducerGone):
                rx.recv(timeout=1.0)


def test_a_reserved_frame_takes_a_timestamp_as_send_does(name: str, fake_slots: type[FakeCudaSlots]) -> None:
    """``reserve(timestamp_ns=)`` as on a cudalink link (a relay passes its upstream's stamps on). cuda-link
    keeps seconds on the writer's ``perf_counter`` clock, which the reader maps back to wall time, so the stamp
    comes back within microseconds, not to the nanosecond."""
    with cudalink.Sender(name, shape=(2, 2, 4), slots=2, protocol="cuda-link") as tx:
        src = CudaLinkSource("cuda-link:" + name, memory=HostSlotMemory)
        with cudalink.Receiver("cuda-link:" + name, source=src, timeout=1.0) as rx:
            stamp = time.time_ns() - 3_000_000_000
            with tx.reserve(timestamp_ns=stamp) as f:
                np.asarray(f.numpy()).fill(6)
            got = rx.recv(timeout=1.0)
            assert (got.numpy() == 6).all() and abs(got.timestamp_ns - stamp) < 100_000, got.timestamp_ns - stamp
            got.release()
            tx.send(np.full((2, 2, 4), 7, np.uint8))  # without one: the publish time, as before
            got = rx.recv(timeout=1.0)
            assert abs(got.timestamp_ns - time.time_ns()) < 1_000_000_000


def test_a_reserve_with_a_stamp_that_is_no_u64_is_refused_before_a_slot_is_written(
    name: str, fake_slots: type[FakeCudaSlots]
) -> None:
    """As on a cudalink link: a bad ``timestamp_ns`` is a FormatError from ``reserve()``, not a TypeError (or
    a negative stamp published) as the block ends, after the slot was written."""
    with cudalink.Sender(name, shape=(2, 2, 4), slots=2, protocol="cuda-link") as tx:
        for bad in (-1, 1 << 64, 1.5, "now"):
            with pytest.raises(cudalink.FormatError, match="timestamp_ns must be an int"):
                tx.reserve(timestamp_ns=bad)  # type: ignore[arg-type]
            with pytest.raises(cudalink.FormatError, match="timestamp_ns must be an int"):  # send() too
                tx.send(np.zeros((2, 2, 4), np.uint8), timestamp_ns=bad)  # type: ignore[arg-type]
        assert tx.stats()["published"] == 0
        assert fake_slots.instances[0].calls == []  # no slot written


@pytest.mark.parametrize(("before", "after"), [(41, 42), (cw.MAX_VERSION, 1)])  # never 0: "initialising"
def test_a_previous_segment_is_taken_over_with_the_next_version(
    name: str, fake_slots: type[FakeCudaSlots], before: int, after: int
) -> None:
    keep = _open_segment(name, create=True, size=cw.segment_size(3))
    assert keep.buf is not None
    seg = cw.Segment(
        cw.Header(cw.MAGIC, before, 3, 17),
        (b"\7" * 64,) * 3,
        (bytes(64),) * 3,
        False,
        cw.Metadata(2, 2, 1, 1, 8, 0, 4),
        1.0,
    )
    cw.pack_segment(keep.buf, seg)
    with cudalink.Sender(name, shape=(4, 6, 4), slots=3, protocol="cuda-link") as tx:
        assert tx.version == after
        got = cw.read_segment(keep.buf)
        assert got.header.version == after and got.header.write_idx == 0 and got.memory_handles[0] != b"\7" * 64
    keep.close()


def test_a_second_writer_of_a_live_name_is_refused_and_the_first_keeps_its_segment(
    name: str, fake_slots: type[FakeCudaSlots]
) -> None:
    with cudalink.Sender(name, shape=(4, 6, 4), slots=3, protocol="cuda-link") as tx:
        tx.send(np.zeros((4, 6, 4), np.uint8))
        with pytest.raises(cudalink.LinkError, match="already published"):
            cudalink.Sender(name, shape=(4, 6, 4), slots=2, protocol="cuda-link")
        assert len(fake_slots.instances) == 1  # refused before any GPU memory was taken
        seg = _segment(name)
        assert seg.buf is not None
        assert cw.read_header(seg.buf, name).num_slots == 3 and cw.read_write_idx(seg.buf) == 1
        seg.close()
        tx.send(np.zeros((4, 6, 4), np.uint8))
    with cudalink.Sender(name, shape=(4, 6, 4), slots=2, protocol="cuda-link") as again:  # once closed: free
        assert again.version == 1
    assert not os.path.exists(writer_lock_path(name))


def test_the_doorbell_rings_at_each_frame_a_format_change_and_close(
    name: str, fake_slots: type[FakeCudaSlots], monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda-link rings its doorbell once more at shutdown: a reader asleep on it lets go at once."""
    import cudalink.cuda_link as mod

    rings: list[str] = []

    class Bell:
        def ring(self) -> None:
            rings.append("ring")

        def close(self) -> None:
            rings.append("closed")

    monkeypatch.setattr(mod._platform.Doorbell, "create", lambda name: Bell())
    tx = cudalink.Sender(name, shape=(4, 6, 4), protocol="cuda-link")
    tx.send(np.zeros((4, 6, 4), np.uint8))
    assert rings == ["ring"]
    tx.reconfigure(shape=(2, 6, 4))
    assert rings == ["ring", "ring"]
    with pytest.raises(cudalink.FormatError, match="tightly packed"):
        tx.reconfigure(strides=(96, 16, 4))
    tx.close()
    assert rings == ["ring", "ring", "ring", "closed"]


@contextlib.contextmanager
def _publishing(publish: Callable[[], object]) -> Iterator[None]:
    """A live foreign writer while the block runs: ``publish()`` every 5 ms on a thread of its own."""
    stop = threading.Event()

    def frames() -> None:
        while not stop.is_set():
            publish()
            time.sleep(0.005)

    t = threading.Thread(target=frames)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def test_a_live_foreign_writers_segment_is_refused_and_a_silent_one_taken_over(
    name: str, fake_slots: type[FakeCudaSlots]
) -> None:
    """cuda-link's layout names no writer: a TD component or an exporter that is publishing is told by its
    frames, and its segment is left alone; one whose frames stopped (dead, or idle) is taken over as before."""
    from ._cuda_link_fake import FakeProducer

    live = FakeProducer(name, slots=3)
    with _publishing(lambda: live.publish(1)):
        with pytest.raises(cudalink.LinkError, match="being written by a live producer"):
            cudalink.Sender(name, shape=(4, 6, 4), slots=2, protocol="cuda-link")
        idx = cw.read_write_idx(live.buf)
        time.sleep(0.05)
        assert cw.read_write_idx(live.buf) > idx and not cw.read_shutdown(live.buf, 3)  # untouched, still going
        assert len(fake_slots.instances) == 1 and fake_slots.instances[0].closed  # nothing of ours left
    with cudalink.Sender(name, shape=(4, 6, 4), slots=3, protocol="cuda-link") as tx:  # silent now: taken over
        assert tx.version == live.version + 1
    live.close()


def test_a_live_writer_of_a_layout_we_cannot_read_keeps_its_segment(name: str, fake_slots: type[FakeCudaSlots]) -> None:
    """A TD project still on cuda-link v0.6.6 (192-byte slots, a header we refuse to parse) publishing under the
    name: its segment was unlinked and replaced, unlike a live current writer's. Its header's write_idx moving
    tells it apart from leftovers, which are still taken over once quiet."""
    from .test_cuda_link_wire import _v066_segment

    old = _v066_segment(2)
    seg = _open_segment(name, create=True, size=len(old))
    buf = seg.buf
    assert buf is not None
    buf[: len(old)] = old
    count = itertools.count(8)
    with _publishing(lambda: cw.write_write_idx(buf, next(count))):  # its write_idx moves, as frames come
        with pytest.raises(cudalink.LinkError, match="being written by a live producer"):
            cudalink.Sender(name, shape=(4, 6, 4), slots=2, protocol="cuda-link")
        still = _open_segment(name)  # not unlinked: the old writer's readers still find it
        assert still.buf is not None and len(still.buf) == len(old) and bytes(still.buf[:4]) == old[:4]
        still.close()
    with cudalink.Sender(name, shape=(4, 6, 4), slots=2, protocol="cuda-link") as tx:  # quiet now: taken over
        assert tx.version == 1
    seg.close()


def test_its_frames_are_bottom_up_as_every_cuda_link_reader_takes_them(
    name: str, fake_slots: type[FakeCudaSlots]
) -> None:
    """The layout has no origin and its readers take TD's bottom-up rows: a Sender says so of its frames (our
    reader labels them bottom-up too), and refuses top-down ones, which TD would show upside down."""
    with pytest.raises(cudalink.FormatError, match=r"rows run bottom-up.*t\.flip\(0\).*origin='bottom'"):
        cudalink.Sender(name, shape=(4, 6, 4), origin="top", protocol="cuda-link")
    with cudalink.Sender(name, shape=(4, 6, 4), protocol="cuda-link") as tx:
        assert tx.spec.origin is cudalink.RowOrigin.BOTTOM
        src = CudaLinkSource("cuda-link:" + name, memory=HostSlotMemory)
        with cudalink.Receiver("cuda-link:" + name, source=src, timeout=1.0) as rx:
            tx.send(np.full((4, 6, 4), 3, np.uint8))
            assert rx.recv(timeout=1.0).origin is cudalink.RowOrigin.BOTTOM
        with pytest.raises(cudalink.FormatError, match="rows run bottom-up"):
            tx.reconfigure(origin="top")
        assert tx.version == 1 and tx.spec.origin is cudalink.RowOrigin.BOTTOM


def test_reconfigure_beyond_the_slots_is_refused(name: str, fake_slots: type[FakeCudaSlots]) -> None:
    with cudalink.Sender(name, shape=(4, 6, 4), protocol="cuda-link") as tx:
        with pytest.raises(cudalink.FormatError, match="capacity="):
            tx.reconfigure(shape=(2048, 2048, 4))
        assert tx.version == 1


def test_a_sender_refused_at_construction_leaves_the_names_live_segment_alone(name: str) -> None:
    """A typo'd device (or no CUDA, or no memory) must not unlink the segment a live producer has under the
    name, when the half-made Sender is collected."""
    import gc

    from ._cuda_link_fake import FakeProducer

    live = FakeProducer(name)
    try:
        live.publish(1)
        with pytest.raises(cudalink.ArgumentError, match="cuda:N"):
            cudalink.Sender(name, shape=(4, 6, 4), device="cuda1", protocol="cuda-link")
        gc.collect()
        seg = _segment(name)  # still there
        assert seg.buf is not None and cw.read_write_idx(seg.buf) == 1
        seg.close()
    finally:
        live.close()


def test_a_sender_that_fails_after_taking_the_segment_gives_it_up(
    name: str, fake_slots: type[FakeCudaSlots], monkeypatch: pytest.MonkeyPatch
) -> None:
    import cudalink.cuda_link as mod

    def no_bell(name: str) -> None:
        raise OSError("no doorbell today")

    monkeypatch.setattr(mod._platform.Doorbell, "create", no_bell)
    with pytest.raises(OSError, match="no doorbell"):
        cudalink.Sender(name, shape=(4, 6, 4), protocol="cuda-link")
    assert fake_slots.instances[0].closed
    with pytest.raises(FileNotFoundError):
        _segment(name)


def test_where_a_held_name_cannot_be_unlinked_its_mapping_is_taken_over_for_another_slot_count(
    name: str, fake_slots: type[FakeCudaSlots], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows: a named mapping lives while any reader (TD's In TOP) holds it, and nothing unlinks it, so the
    name cannot be made anew: the old mapping is laid out again for the new slot count, its version going on."""
    import cudalink.cuda_link as mod

    from ._cuda_link_fake import FakeProducer

    monkeypatch.setattr(mod, "_unlink_segment", lambda name: None)  # as on Windows
    old = FakeProducer(name, slots=3)
    held = old.shm.buf  # a reader's mapping of the name
    assert held is not None
    old.publish(1)
    before = cw.read_version(held)
    with cudalink.Sender(name, shape=(4, 6, 4), slots=2, protocol="cuda-link") as tx:
        header = cw.read_header(held)
        assert header.num_slots == 2 and header.version == before + 1 == tx.version
        tx.send(np.zeros((4, 6, 4), np.uint8))
        assert cw.read_write_idx(held) == 1
    with pytest.raises(cudalink.LinkError, match="a reader still holds the old one"):
        cudalink.Sender(name, shape=(4, 6, 4), slots=10, protocol="cuda-link")  # does not fit the old mapping
    old.shm.close()
    for d in old.data:
        _unlink_segment(d.name.lstrip("/"))
        d.close()
    _unlink_segment(name)


def test_a_segment_of_another_slot_count_is_shut_down_for_its_readers_before_it_is_replaced(
    name: str, fake_slots: type[FakeCudaSlots]
) -> None:
    """cuda-link's readers (TD's component, its importer) watch the shutdown flag and the version only: the old
    segment they hold must say shutdown, or they stay on it for good."""
    from ._cuda_link_fake import FakeProducer

    old = FakeProducer(name, slots=2)
    held = old.shm.buf  # what a reader attached to the old segment keeps mapped
    assert held is not None
    old.publish(1)
    with cudalink.Sender(name, shape=(4, 6, 4), slots=3, protocol="cuda-link") as tx:
        assert cw.read_shutdown(held, 2)
        assert all(cw.read_handles(held, 2, i) == (bytes(64), bytes(64)) for i in range(2))
        seg = _segment(name)
        assert seg.buf is not None and cw.read_header(seg.buf).num_slots == 3 and tx.version == 1
        seg.close()
    old.shm.close()
    for d in old.data:
        _unlink_segment(d.name.lstrip("/"))
        d.close()
