"""``Receiver("cuda-link:NAME")`` on CPU: a cuda-link producer written in the test (struct + numpy over real
SharedMemory) and host slot memory instead of CUDA handles, so the polling, seqs, skips, restarts, shutdown
and bad segments run everywhere. The GPU path is in tests/test_cuda_link_gpu.py."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import selectors
import struct
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudalink
from cudalink import _platform
from cudalink.frames import PixelFormat, RowOrigin
from cudalink.link import default_transport
from cudalink.transport import cuda_link_wire as cw
from cudalink.transport.cuda_link_source import CudaLinkAttachment, CudaLinkSource, strip_prefix
from cudalink.transport.shm import _unlink_segment
from cudalink.transport.sources import open_source

from ._cuda_link_fake import FakeProducer, HostSlotMemory, _handle, run_producer


@pytest.fixture
def name() -> str:
    return f"cudalink_ipc_TD>>Py_{uuid.uuid4().hex[:8]}"  # cuda-link's style, '>' included


@pytest.fixture
def producer(name: str) -> Iterator[FakeProducer]:
    p = FakeProducer(name)
    yield p
    p.close()


def _rx(name: str, mem: HostSlotMemory | None = None, **kw: object) -> cudalink.Receiver:
    src = CudaLinkSource("cuda-link:" + name, memory=mem or HostSlotMemory)
    return cudalink.Receiver("cuda-link:" + name, source=src, **kw)  # type: ignore[arg-type]


def test_the_address_picks_this_source() -> None:
    src = open_source("cuda-link:cudalink_ipc_TD>>Python", transport=default_transport(), device=None, copy="auto")
    assert isinstance(src, CudaLinkSource) and src.segment == "cudalink_ipc_TD>>Python" and src.copy
    assert src.name == "cuda-link:cudalink_ipc_TD>>Python"
    assert not CudaLinkSource("cuda-link:x", copy="never").copy
    with pytest.raises(cudalink.LinkError, match="not a cuda-link segment name"):
        strip_prefix("cuda-link:")
    with pytest.raises(cudalink.LinkError, match="not a cuda-link segment name"):
        strip_prefix("cuda-link:a/b")


def test_the_receivers_docstring_states_the_zero_copy_risk_of_a_cuda_link_segment() -> None:
    """Issue 34: copy=False gives zero copy, "with the risk (the writer may overwrite the slot under a slow
    reader) stated in its docstring": the Receiver's, which help(cudalink.Receiver) shows."""
    doc = " ".join((cudalink.Receiver.__doc__ or "").split())
    assert "cuda-link:NAME" in doc and "copy=False" in doc, doc
    assert "may overwrite" in doc and "slow reader" in doc, doc


def test_frames_seq_timestamp_and_format(name: str, producer: FakeProducer) -> None:
    producer.set_format((4, 6, 4), "uint8", cw.FLAG_BGRA)
    producer.publish(7)
    with _rx(name, timeout=2.0) as rx:
        assert rx.backend == "cuda-link" and rx.device == "cpu"
        f = rx.recv(timeout=1.0)  # the newest frame published before we joined is delivered
        assert f.seq == 1 and f.shape == (4, 6, 4) and f.pixel_format is PixelFormat.BGRA
        assert (f.numpy() == 7).all()
        assert abs(f.timestamp_ns - time.time_ns()) < 2e9  # perf_counter turned into wall-clock time
        assert rx.poll() is None
        producer.publish(8)
        g = rx.recv(timeout=1.0)
        assert g.seq == 2 and (g.numpy() == 8).all()
        assert rx.stats() == {"received": 2, "skipped": 0, "reattached": 0, "reconnects": 0, "path": "zero-copy"}


def test_frames_overwritten_before_we_looked_count_as_skipped(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=2.0) as rx:
        for v in (1, 2, 3, 4):
            producer.publish(v)
        f = rx.recv(timeout=1.0)
        assert f.seq == 4 and (f.numpy() == 4).all()
        assert rx.stats()["skipped"] == 3
        producer.publish(5)
        assert rx.recv(timeout=1.0).seq == 5
        assert rx.stats() == {"received": 2, "skipped": 3, "reattached": 0, "reconnects": 0, "path": "zero-copy"}


def test_frames_before_we_joined_are_not_skipped(name: str, producer: FakeProducer) -> None:
    for v in range(10):
        producer.publish(v)
    with _rx(name, timeout=2.0) as rx:
        assert rx.recv(timeout=1.0).seq == 10
        assert rx.stats()["skipped"] == 0


def test_format_change_mid_stream(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=2.0) as rx:
        producer.publish(1)
        assert rx.recv(timeout=1.0).shape == (4, 6, 4)
        producer.set_format((2, 3, 1), "float32")
        producer.publish(2)
        f = rx.recv(timeout=1.0)
        assert f.shape == (2, 3, 1) and f.dtype == np.float32 and (f.numpy() == 2).all()
        assert f.pixel_format is PixelFormat.GRAY


def test_frames_are_bottom_up_as_every_cuda_link_endpoint_lays_them_out(name: str, producer: FakeProducer) -> None:
    """cuda-link's TD exporter copies TD's memory as it is (rows bottom-up) and its TD importer hands the bytes
    to copyCUDAMemory as they are: its frames were labelled top-down, so a Script TOP on "auto" flipped TD's own
    image upside down (and a relay passed the wrong origin on)."""
    import cudalink.td as ctd

    from .td_fakes import FakeCUDAMemoryShape, FakeScriptTOP

    producer.set_format((4, 6, 4), "uint8", cw.FLAG_BGRA)
    producer.publish(0)
    td_memory = np.arange(4 * 6 * 4, dtype=np.uint8).reshape(4, 6, 4)  # row 0 is the image's bottom row
    np.ndarray((4, 6, 4), np.uint8, buffer=producer.data[0].buf)[...] = td_memory
    assert cw.spec_from_meta(cw.read_metadata(producer.buf, producer.n)).origin is RowOrigin.BOTTOM
    with _rx(name, timeout=2.0) as rx:
        f = rx.recv(timeout=1.0)
        assert f.origin is RowOrigin.BOTTOM and f.pixel_format is PixelFormat.BGRA
        op = FakeScriptTOP()
        op.modify_outside_cook = True
        up = ctd.to_script_top(f, op, flip="auto", swap_rb="auto", method="cuda", shape_factory=FakeCUDAMemoryShape)
        assert up.steps == [] and up.zero_copy  # TD's layout already: no pass, no flip
        np.testing.assert_array_equal(op.texture, td_memory)


def test_a_frame_larger_than_the_slots_is_refused(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=2.0) as rx:
        producer.set_format((256, 256, 4), "uint8")  # 256 KiB > the fake's 64 KiB slots
        producer.publish(1)
        with pytest.raises(cudalink.ProtocolError, match="slots hold 65536"):
            rx.recv(timeout=1.0)


def test_version_change_is_a_restart_with_no_stale_frame(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=2.0) as rx:
        producer.publish(1)
        first = rx.recv(timeout=1.0)
        gen = rx.generation
        producer.publish(2)  # published by the old version, never taken
        producer.init((4, 6, 4), "uint8")  # the producer restarts: version 2, write_idx 0
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=1.0)
        producer.publish(3)
        f = rx.recv(timeout=1.0)
        assert rx.generation != gen and f.generation == rx.generation != first.generation
        assert f.seq == 1 and (f.numpy() == 3).all()  # the new version's first frame, not 2
        assert rx.stats()["reattached"] == 1


def test_restart_that_published_before_we_looked_is_still_a_restart(name: str, producer: FakeProducer) -> None:
    """The new version's frames sit in slots the old handles do not map: none may be taken through them."""
    with _rx(name, timeout=2.0) as rx:
        producer.publish(1)
        rx.recv(timeout=1.0)
        gen = rx.generation
        producer.init((4, 6, 4), "uint8")
        for v in (5, 6, 7):
            producer.publish(v)  # write_idx 3 != the 1 we saw, but of another version
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=1.0)
        f = rx.recv(timeout=1.0)
        assert rx.generation != gen and f.seq == 3 and (f.numpy() == 7).all()


def test_restart_before_the_first_publish_waits_for_a_frame(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=2.0) as rx:
        producer.init((4, 6, 4), "uint8")
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=0.5)
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=0.2)  # attached to version 2, which published nothing yet


@pytest.mark.skipif(not _platform.IS_LINUX, reason="only /dev/shm tells a segment's inode")
def test_a_segment_unlinked_without_its_shutdown_flag_is_producer_gone(name: str, producer: FakeProducer) -> None:
    """A writer killed after it unlinked its segment (or a new one made under the name) sets no flag: the inode
    under the name (``_platform.shm_inode``) tells."""
    with _rx(name, timeout=2.0) as rx:
        producer.publish(1)
        rx.recv(timeout=1.0)
        _unlink_segment(name)
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=1.0)


def test_shutdown_flag_is_producer_gone(name: str, producer: FakeProducer) -> None:
    mem = HostSlotMemory()
    with _rx(name, mem, timeout=2.0) as rx:
        producer.publish(1)
        rx.recv(timeout=1.0)
        producer.shutdown()
        assert rx.producer_closing
        t0 = time.monotonic()
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=5.0)
        assert time.monotonic() - t0 < 1.0
        assert mem.closed  # detached: the slots are unmapped
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=0.2)  # the closed segment is not attached again


def test_shutdown_while_waiting_is_seen_within_the_poll_plan(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=2.0, wait="block") as rx:
        producer.publish(1)
        rx.recv(timeout=1.0)
        import threading

        threading.Timer(0.1, producer.shutdown).start()
        t0 = time.monotonic()
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=5.0)
        assert time.monotonic() - t0 < 1.0


def test_a_segment_that_does_not_exist(name: str) -> None:
    with pytest.raises(cudalink.LinkTimeout, match="no cuda-link segment named"):
        _rx(name, timeout=0.2)


def test_a_segment_not_initialised_yet_is_waited_for(name: str, producer: FakeProducer) -> None:
    struct.pack_into("<Q", producer.buf, cw.OFF_VERSION, 0)
    with pytest.raises(cudalink.LinkTimeout, match="initialising"):
        _rx(name, timeout=0.2)
    # cuda-link's Python writers put magic and version 1 before N: no slots yet is "initialising" too
    struct.pack_into("<QI", producer.buf, cw.OFF_VERSION, 1, 0)
    with pytest.raises(cudalink.LinkTimeout, match="initialising"):
        _rx(name, timeout=0.2)


def test_a_segment_with_no_format_yet_is_waited_for_then_read(name: str, producer: FakeProducer) -> None:
    """Width, height and num_comps still 0: a producer that has not published its format; the attach waits
    (told apart by the bytes, not by an error's text), and takes frames once the format is there."""
    struct.pack_into("<III", producer.buf, cw.off_metadata(producer.n), 0, 0, 0)
    with pytest.raises(cudalink.LinkTimeout, match="not published a frame format yet"):
        _rx(name, timeout=0.2)
    producer.set_format((4, 6, 4), "uint8")
    producer.publish(3)
    with _rx(name, timeout=2.0) as rx:
        assert rx.recv(timeout=1.0).shape == (4, 6, 4)


def _python_writer_reinit(producer: FakeProducer, new_slots: list[object], shape: tuple[int, int, int]) -> object:
    """cuda-link's Python writers (its exporter, its TD extension) re-initialise in this order: magic,
    version + 1, N, write_idx = 0, *then* the handles, shutdown and metadata; the TD extension keeps its own
    write_idx count. Returns the second half, to run later."""
    buf, n = producer.buf, producer.n
    producer.version += 1
    struct.pack_into("<IQII", buf, 0, cw.MAGIC, producer.version, n, 0)

    def finish() -> None:
        for i, d in enumerate(new_slots):
            cw.write_handles(buf, i, _handle(d.name.lstrip("/")), bytes(64))  # type: ignore[attr-defined]
        cw.write_shutdown(buf, n, False)
        producer.data = new_slots  # type: ignore[assignment]
        producer.set_format(shape, "uint8")

    return finish


def test_an_attach_between_the_version_and_the_new_handles_never_reads_the_old_slots(
    name: str, producer: FakeProducer
) -> None:
    """The old slots are still allocated (TD frees them 30 frames later): a reader that imported them under the
    new version would take frames from buffers nobody writes. Its first frame sees the handles moved: a restart."""
    from cudalink.transport.shm import _open_segment, _unlink_segment

    new = [_open_segment(f"{name}_n{i}".replace(">", "_"), create=True, size=1 << 16) for i in range(producer.n)]
    old = producer.data
    try:
        producer.publish(11)
        with _rx(name, timeout=1.0) as rx:
            assert (rx.recv(timeout=1.0).numpy() == 11).all()
            finish = _python_writer_reinit(producer, new, (8, 8, 4))
            with pytest.raises(cudalink.ProducerGone):
                rx.recv(timeout=0.5)
            assert rx.poll() is None  # attaches now, with the old handles under the new version
            finish()
            got = []
            for v in (42, 43, 44):
                producer.publish(v)
                try:
                    f = rx.recv(timeout=1.0)
                except cudalink.ProducerGone:  # the first frame showed the handles had moved
                    continue
                assert f.shape == (8, 8, 4)
                got.append(int(f.numpy().flat[0]))
            assert got and all(g == v for g, v in zip(got, (43, 44)[-len(got) :], strict=True)), got
    finally:
        for seg in (*old, *new):
            _unlink_segment(seg.name.lstrip("/"))
            seg.close()
        producer.data = []


def test_new_handles_written_while_ours_are_imported_are_seen_at_the_first_frame(
    name: str, producer: FakeProducer
) -> None:
    """Each import is milliseconds on a GPU: the writer may finish its re-init (new handles) meanwhile. What
    the first frame checks is what was imported, not the segment read again after the imports."""
    from cudalink.transport.shm import _open_segment, _unlink_segment

    new = [_open_segment(f"{name}_m{i}".replace(">", "_"), create=True, size=1 << 16) for i in range(producer.n)]
    old = producer.data
    hook: list[object] = []

    class SlowImport(HostSlotMemory):
        def open(self, slot: int, memory: bytes, event: bytes) -> int:
            size = super().open(slot, memory, event)
            if slot == 0 and hook:
                hook.pop()()  # type: ignore[operator]
            return size

    try:
        producer.publish(11)
        with _rx(name, SlowImport, timeout=1.0) as rx:  # type: ignore[arg-type]
            assert (rx.recv(timeout=1.0).numpy() == 11).all()
            finish = _python_writer_reinit(producer, new, (4, 6, 4))
            with pytest.raises(cudalink.ProducerGone):
                rx.recv(timeout=0.5)
            hook.append(finish)
            assert rx.poll() is None and not hook  # attached; the new handles landed during its imports
            got = []
            for v in (42, 43, 44):
                producer.publish(v)
                try:
                    got.append(int(rx.recv(timeout=1.0).numpy().flat[0]))
                except cudalink.ProducerGone:
                    got.append(-1)
            assert got[0] == -1 and got[1:] == [43, 44], got  # never a frame from the old slots (11)
    finally:
        for seg in (*old, *new):
            _unlink_segment(seg.name.lstrip("/"))
            seg.close()
        producer.data = []


def test_a_writer_that_keeps_counting_across_a_reinit_skips_nothing(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=1.0) as rx:
        for v in range(50):
            producer.publish(v)
            rx.recv(timeout=1.0)
        kept = producer.idx
        producer.init((4, 6, 4), "uint8")  # write_idx 0 in the segment, version + 1 ...
        producer.idx = kept  # ... and the TD extension's own count carries on
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=0.5)
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=0.05)  # attached at write_idx 0, nothing yet
        producer.publish(7)
        f = rx.recv(timeout=1.0)
        assert f.seq == 51 and (f.numpy() == 7).all()
        assert rx.stats()["skipped"] == 0
        producer.publish(8)
        producer.publish(9)
        assert rx.recv(timeout=1.0).seq == 53 and rx.stats()["skipped"] == 1


def test_a_writer_that_counts_from_zero_again_after_a_reinit_still_counts_its_skips(
    name: str, producer: FakeProducer
) -> None:
    """cuda-link's C++ TOP (and cudalink's own writer) start write_idx at 0 again: frames it published before
    our first take are skipped as usual, whatever the last frame of the previous version was."""
    with _rx(name, timeout=1.0) as rx:
        for v in range(5):
            producer.publish(v)
            rx.recv(timeout=1.0)
        producer.init((4, 6, 4), "uint8")
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(timeout=0.5)
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=0.05)
        for v in range(10):
            producer.publish(v)
        assert rx.recv(timeout=1.0).seq == 10 and rx.stats()["skipped"] == 9


@pytest.mark.parametrize("ts", [float("inf"), float("-inf"), float("nan"), 1e300, 1e12])
def test_a_timestamp_that_is_not_one_gets_the_arrival_time(name: str, producer: FakeProducer, ts: float) -> None:
    producer.publish(1)
    struct.pack_into("<d", producer.buf, cw.off_timestamp(producer.n), ts)
    with _rx(name, timeout=1.0) as rx:
        f = rx.recv(timeout=1.0)
        assert abs(f.timestamp_ns - time.time_ns()) < 5e9


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "error", "match"),
    [
        (0, "<I", 0x12345678, cudalink.ProtocolError, "magic 0x12345678"),
        (12, "<I", 11, cudalink.ProtocolError, "11 slots"),
        (cw.off_metadata(3) + 16, "<I", 5, cudalink.FormatError, "data_size 5"),
    ],
)
def test_bad_segments_give_clear_errors(
    name: str, producer: FakeProducer, offset: int, fmt: str, value: int, error: type, match: str
) -> None:
    struct.pack_into(fmt, producer.buf, offset, value)
    t0 = time.monotonic()
    with pytest.raises(error, match=match):
        _rx(name, timeout=5.0)
    assert time.monotonic() - t0 < 1.0  # refused at once, not retried until the timeout


def test_a_truncated_segment(name: str) -> None:
    from cudalink.transport.shm import _open_segment, _unlink_segment

    seg = _open_segment(name, create=True, size=cw.segment_size(3))
    assert seg.buf is not None
    struct.pack_into("<IQII", seg.buf, 0, cw.MAGIC, 1, 10, 0)  # says 10 slots; holds 3 (page-rounded: check)
    try:
        if seg.size >= cw.segment_size(10):
            pytest.skip("the OS rounded the segment up past 10 slots")
        with pytest.raises(cudalink.ProtocolError, match="truncated"):
            _rx(name, timeout=1.0)
    finally:
        seg.close()
        _unlink_segment(name)


def test_a_v066_segment_is_refused_at_once_with_the_upgrade(name: str) -> None:
    from cudalink.transport.shm import _open_segment, _unlink_segment

    from .test_cuda_link_wire import _v066_segment

    old = _v066_segment(2)
    seg = _open_segment(name, create=True, size=len(old))
    assert seg.buf is not None
    seg.buf[: len(old)] = old
    try:
        t0 = time.monotonic()
        with pytest.raises(cudalink.ProtocolError, match="upgrade cuda-link"):
            _rx(name, timeout=5.0)
        assert time.monotonic() - t0 < 1.0  # said at once, not a LinkTimeout after 5 s
    finally:
        seg.close()
        _unlink_segment(name)


def test_the_doorbell_is_waited_on_only_where_cuda_links_switch_says_so(
    name: str, producer: FakeProducer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ring of cuda-link's auto-reset doorbell wakes one waiter: waiting on it by default would steal the
    wake-ups of a TD TOP or importer reading the same segment."""
    from cudalink import _platform
    from cudalink.transport.cuda_link_source import doorbell_wanted

    opened: list[str] = []
    monkeypatch.setattr(_platform.Doorbell, "open", lambda seg: opened.append(seg))
    producer.publish(1)
    monkeypatch.delenv("CUDALINK_DOORBELL", raising=False)
    with _rx(name, timeout=2.0) as rx:
        rx.recv(timeout=1.0).release()
    assert opened == []
    monkeypatch.setenv("CUDALINK_DOORBELL", "1")
    with _rx(name, timeout=2.0) as rx:
        rx.recv(timeout=1.0).release()
    assert opened == [name]
    assert not doorbell_wanted("") and not doorbell_wanted("0") and doorbell_wanted("yes")


def test_cuda_link_v09_segment_is_read(name: str, producer: FakeProducer) -> None:
    struct.pack_into("<I", producer.buf, 0, cw.MAGIC_V09)
    struct.pack_into("<IIIII", producer.buf, cw.off_metadata(3), 6, 4, 4, 2, 96)  # dtype 2 = uint8
    producer.publish(9)
    with _rx(name, timeout=2.0) as rx:
        f = rx.recv(timeout=1.0)
        assert f.shape == (4, 6, 4) and f.dtype == np.uint8 and (f.numpy() == 9).all()


def test_fileno_is_readable_when_a_frame_is_there(name: str, producer: FakeProducer) -> None:
    with _rx(name, timeout=2.0) as rx:
        sel = selectors.DefaultSelector()
        sel.register(rx.fileno(), selectors.EVENT_READ)
        assert sel.select(0.05) == []
        producer.publish(4)
        assert sel.select(1.0)
        f = rx.poll()
        assert f is not None and f.seq == 1
        sel.close()


def test_recv_async_and_async_for(name: str, producer: FakeProducer) -> None:
    async def main() -> list[int]:
        rx = _rx(name, timeout=2.0)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, producer.publish, 1)
        got = [(await rx.recv_async(timeout=1.0)).seq]
        loop.call_later(0.05, producer.publish, 2)
        loop.call_later(0.2, producer.shutdown)
        async for f in rx:
            got.append(f.seq)
        rx.close()
        return got

    assert asyncio.run(main()) == [1, 2]


@pytest.mark.parametrize("mode", ["spin", "hybrid", "block"])
def test_wait_modes_across_processes(name: str, mode: str) -> None:
    """A spawned fake producer publishes 40 frames at 200 Hz; every wait mode sees them in order."""
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=run_producer, args=(name, 40, 0.005, time.time() + 1.0))
    proc.start()
    try:
        src = CudaLinkSource("cuda-link:" + name, memory=HostSlotMemory)
        rx = cudalink.Receiver("cuda-link:" + name, source=src, timeout=10.0, wait=mode)  # type: ignore[arg-type]
        seqs = []
        try:
            while True:
                f = rx.recv(timeout=5.0)
                assert (f.numpy() == f.seq % 256).all()
                seqs.append(f.seq)
        except cudalink.ProducerGone:
            pass
        rx.close()
        assert seqs == sorted(seqs) and seqs[-1] == 40
        # every frame published after we joined was taken or counted skipped; those published before (a slow
        # spawn: the attach's floor) were neither. Not ``seqs[0]``: a frame published after the join but before
        # the first recv() is skipped by the newest-wins take, and counted (seen once in CI)
        assert len(seqs) + rx.stats()["skipped"] == 40 - rx._floor
    finally:
        proc.join(10)


def test_an_idle_receiver_costs_little_cpu(name: str, producer: FakeProducer) -> None:
    """The poll plan backs off: a second of waiting with no frame uses a small fraction of a core."""
    with _rx(name, timeout=2.0, wait="block") as rx:
        t0 = time.process_time()
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=1.0)
        assert time.process_time() - t0 < 0.15


def test_the_poll_plan_follows_the_stream() -> None:
    att = object.__new__(CudaLinkAttachment)
    att._period, att._last_arrival = 0.0, 0.0
    assert att._step(10.0, 9.99) == pytest.approx(1e-3)  # nothing learned: coarse
    assert att._step(10.0, 9.0) == pytest.approx(5e-3)  # idle for a second: idle steps
    att._period, att._last_arrival = 1 / 60, 10.0
    assert att._step(10.001, 10.0) == pytest.approx(10.0 + 1 / 60 - 1.5e-3 - 10.001)  # sleep until just before
    assert att._step(10.0160, 10.0) == pytest.approx(1e-4)  # around the frame: fine
    assert att._step(10.0 + 1 / 60 + 0.005, 10.0) > 1e-3  # missed: sleep to before the next one


def test_generation_is_per_segment_and_version() -> None:
    from cudalink.transport.cuda_link_source import _generation

    assert _generation(5, 1) != _generation(5, 2) != _generation(6, 1)
    assert _generation(5, 1, b"a" * 64) != _generation(5, 1, b"b" * 64)  # a new producer on a reused inode
    assert _generation(5, 1) == _generation(5, 1) and _generation(5, 1) & 1


def test_cpu_device_is_refused_by_name(name: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(cudalink.LinkError, match="GPU memory only"):
        cudalink.Receiver("cuda-link:" + name, device="cpu", timeout=5.0)
    assert time.monotonic() - t0 < 1.0  # at once, not after waiting for a segment


@pytest.mark.parametrize("bad", ["cuda-link:", "cuda-link:a/b", "cuda-link:.."])
def test_a_bad_segment_name_or_device_is_a_value_error_on_both_sides(bad: str, name: str) -> None:
    """Bad arguments get a cudalink error that is also a ValueError (issue 32), as cudalink's own names do:
    the cuda-link Receiver and Sender alike, refused before anything is opened."""
    with pytest.raises(cudalink.ArgumentError, match="not a cuda-link segment name"):
        cudalink.Receiver(bad, timeout=0.2)
    with pytest.raises(ValueError, match="not a cuda-link segment name"):
        cudalink.Sender(bad, shape=(4, 4, 4), dtype="uint8", device=0, protocol="cuda-link")
    with pytest.raises(cudalink.ArgumentError, match="GPU memory only"):
        cudalink.Receiver("cuda-link:" + name, device="cpu", timeout=0.2)


def test_no_segments_left_behind(name: str) -> None:
    p = FakeProducer(name)
    p.publish(1)
    with _rx(name, timeout=1.0) as rx:
        rx.recv(timeout=1.0)
    p.close()
    if os.path.isdir("/dev/shm"):
        assert not [f for f in os.listdir("/dev/shm") if name in f]


class FakeBell:
    """Doorbell's surface over a threading.Event (what WaitForSingleObject on an auto-reset event does)."""

    def __init__(self) -> None:
        import threading

        self.event = threading.Event()
        self.waits: list[float] = []
        self.closed = False

    def ring(self) -> None:
        self.event.set()

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        rung = self.event.wait(timeout)
        self.event.clear()  # auto-reset
        return rung

    def close(self) -> None:
        self.closed = True


def test_a_doorbell_is_slept_on_instead_of_polling(
    name: str, producer: FakeProducer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows: cuda-link's producer may ring ``Local\\cudalink_db_<name>``; a waiting recv sleeps on it (where
    CUDALINK_DOORBELL=1 says it is the only waiter)."""
    import threading

    from cudalink import _platform

    monkeypatch.setenv("CUDALINK_DOORBELL", "1")
    bell = FakeBell()
    monkeypatch.setattr(_platform.Doorbell, "open", classmethod(lambda cls, seg, k=None: bell))
    with _rx(name, timeout=2.0, wait="block") as rx:

        def publish() -> None:
            producer.publish(3)
            bell.ring()

        threading.Timer(0.3, publish).start()
        t0 = time.monotonic()
        f = rx.recv(timeout=5.0)
        assert f.seq == 1 and time.monotonic() - t0 < 2.0
        assert bell.waits  # the wait went through the bell
    assert bell.closed


def test_doorbell_calls_on_a_fake_kernel32() -> None:
    from cudalink import _platform

    class K:
        def __init__(self, handle: int) -> None:
            self.handle = handle
            self.calls: list[tuple[object, ...]] = []

        def OpenEventW(self, access: int, inherit: bool, name: str) -> int:
            self.calls.append(("OpenEventW", access, inherit, name))
            return self.handle

        def CreateEventW(self, attrs: object, manual: bool, initial: bool, name: str) -> int:
            self.calls.append(("CreateEventW", attrs, manual, initial, name))
            return self.handle

        def SetEvent(self, h: int) -> int:
            self.calls.append(("SetEvent", h))
            return 1

        def WaitForSingleObject(self, h: int, ms: int) -> int:
            self.calls.append(("WaitForSingleObject", h, ms))
            return 0x102  # WAIT_TIMEOUT

        def CloseHandle(self, h: int) -> int:
            self.calls.append(("CloseHandle", h))
            return 1

    assert _platform.Doorbell.open("x", K(0)) is None  # no doorbell: the reader polls
    k = K(77)
    bell = _platform.Doorbell.open("cudalink_ipc_TD>>Python", k)
    assert bell is not None
    assert k.calls[0] == ("OpenEventW", 0x00100000 | 0x0002, False, "Local\\cudalink_db_cudalink_ipc_TD>>Python")
    assert bell.wait(0.0004) is False and k.calls[-1] == ("WaitForSingleObject", 77, 1)
    bell.close()
    bell.close()
    assert k.calls[-1] == ("CloseHandle", 77) and k.calls.count(("CloseHandle", 77)) == 1
    k2 = K(5)
    made = _platform.Doorbell.create("n", k2)
    assert made is not None and k2.calls[0] == ("CreateEventW", None, False, False, "Local\\cudalink_db_n")
    made.ring()
    assert k2.calls[-1] == ("SetEvent", 5)
    if not _platform.IS_WINDOWS:
        assert _platform.Doorbell.open("n") is None and _platform.Doorbell.create("n") is None


def test_attach_cycles_leave_no_fds_or_threads(name: str, producer: FakeProducer) -> None:
    """40 attach/detach cycles (with fileno's poller thread) end where they began: fds and threads."""
    import threading

    producer.publish(1)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0

    for i in range(43):
        if i == 3:
            f0, t0 = fds(), threading.active_count()
        with _rx(name, timeout=1.0) as rx:
            rx.fileno()
            f = rx.recv(timeout=1.0)
            f.release()
    assert fds() <= f0 + 1 and threading.active_count() <= t0


def test_write_idx_wrapping_keeps_seq_counting(name: str, producer: FakeProducer) -> None:
    """Past 2**32 the u32 write_idx wraps; seq keeps counting and the slot follows the writer's count (3 slots:
    N does not divide 2**32)."""
    producer.idx = 2**32 - 3
    producer.publish(0)  # write_idx 2**32 - 2, before we join
    with _rx(name, timeout=2.0) as rx:
        assert rx.recv(timeout=1.0).seq == 2**32 - 2
        producer.publish(1)  # 2**32 - 1
        assert rx.recv(timeout=1.0).seq == 2**32 - 1
        producer.publish(2)  # wraps to 0 ("nothing yet" to a reader: not taken)
        producer.publish(3)  # 1
        f = rx.recv(timeout=1.0)
        assert f.seq == 2**32 + 1 and (f.numpy() == 3).all()
        assert rx.stats()["skipped"] == 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_seq_and_skips_follow_any_publish_pattern(name: str, producer: FakeProducer, bursts: list[int]) -> None:
    """Publish a burst, poll once, repeat: each poll gets the newest frame, and received + skipped add up."""
    producer.init((4, 6, 4), "uint8")  # a fresh version per example
    with _rx(name, timeout=2.0) as rx:
        total = 0
        for k in bursts:
            for _ in range(k):
                total += 1
                producer.publish(total % 256)
            f = rx.poll()
            if k == 0:
                assert f is None
            else:
                assert f is not None and f.seq == total and (f.numpy() == total % 256).all()
        s = rx.stats()
        assert s["received"] + s["skipped"] == total


def test_write_idx_back_to_zero_without_a_new_version_is_waited_out_calmly(name: str, producer: FakeProducer) -> None:
    """A producer that resets write_idx (against the layout's rules) leaves nothing to take: the wait sleeps by
    the poll plan instead of spinning on the changed word, and takes the next frame it publishes."""
    producer.publish(1)
    with _rx(name, timeout=2.0, wait="block") as rx:
        rx.recv(timeout=1.0)
        producer.idx = 0
        cw.write_write_idx(producer.buf, 0)
        t0 = time.process_time()
        with pytest.raises(cudalink.LinkTimeout):
            rx.recv(timeout=0.5)
        assert time.process_time() - t0 < 0.1
        producer.publish(2)
        assert (rx.recv(timeout=1.0).numpy() == 2).all()


def test_write_idx_stepping_back_is_not_taken_for_a_wrap(name: str, producer: FakeProducer) -> None:
    """A write_idx that goes back a little with the same version (a writer counting anew, or a corrupt header)
    was taken for the u32 wrapping: seq jumped by 2**32, ~4e9 frames counted skipped, and every later frame
    was read from the slot two behind the writer's. Now seq grows by one and the slot follows the writer."""
    for i in range(1, 6):
        producer.publish(i)
    with _rx(name, timeout=2.0) as rx:
        assert rx.recv(timeout=1.0).seq == 5
        producer.idx = 3
        producer.publish(4)  # the writer counts from 3 again: write_idx 5 -> 4, frame in slot 3 % 3
        f = rx.recv(timeout=1.0)
        assert f.seq == 6 and (f.numpy() == 4).all(), (f.seq, int(f.numpy().flat[0]))
        f.release()
        for i in range(6, 10):
            producer.publish(i)  # frame i in slot (i - 2) % 3 now, every byte i
            f = rx.recv(timeout=1.0)
            assert (f.numpy() == i).all() and f.seq == i + 1, (i, f.seq, int(f.numpy().flat[0]))
            f.release()
        assert rx.stats()["skipped"] == 0  # (frames 1..4 came before it joined)
