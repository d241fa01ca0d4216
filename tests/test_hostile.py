"""The edges of issue 32, items 1-4: a /dev/shm too small for the link, refused sends, a header that lies.

Each failed on the code before the fix: a SIGBUS at the first send, a seq (and a slot) used up by a refused
send, a ``recv(timeout=0.5)`` that never returned, a TypeError per ``recv`` instead of a ProtocolError.
What can hang or crash runs in a child process.
"""

from __future__ import annotations

import errno
import glob
import os
import queue
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cudalink
from cudalink import _backends, _native, _platform, _ring
from cudalink.transport import wire

from . import _hostile
from .conftest import DEFAULT, PairFactory, Spawned

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ["python", "compiled"]


def _impl(impl: str) -> None:
    if impl == "compiled" and _native.ring is None:
        pytest.skip(f"compiled ring not in use: {_native.missing.get('ring')}")


def _child_core(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned children pick their core from the environment they start with."""
    _impl(impl)
    if impl == "python":
        monkeypatch.setenv("CUDALINK_PURE_PYTHON", "1")
    else:
        monkeypatch.delenv("CUDALINK_PURE_PYTHON", raising=False)


# ================================================================ 1. a link larger than the free /dev/shm


def test_the_size_check_names_bytes_needed_free_and_the_fix() -> None:
    with pytest.raises(cudalink.LinkError) as err:
        _platform.check_shm_space(530_841_600, 67_096_576, "link 'cam'")
    text = str(err.value)
    assert "530,841,600" in text and "67,096,576" in text and "link 'cam'" in text
    assert "--shm-size" in text and "smaller link" in text
    _platform.check_shm_space(100, 100, "x")  # exactly fits
    _platform.check_shm_space(1 << 50, None, "x")  # unknown (macOS, Windows): nothing to refuse


def test_reserve_checks_the_free_figure_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    called = []
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: called.append(a), raising=False)
    with pytest.raises(cudalink.LinkError, match=r"needs 2,000 bytes .* only 1,000 are free"):
        _platform.reserve_shm(5, 2000, "link 'x'", free=lambda: 1000)
    assert called == []  # refused before a page was allocated
    _platform.reserve_shm(5, 2000, "link 'x'", free=lambda: 4000)
    assert called == [(5, 0, 2000)]


def test_reserve_turns_a_full_tmpfs_into_a_link_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The free figure can be stale (another process filled /dev/shm meanwhile): fallocate's ENOSPC decides."""

    def full(fd: int, off: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def unsupported(fd: int, off: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(cudalink.LinkError, match="--shm-size"):
        _platform.reserve_shm(5, 2000, "link 'x'", free=lambda: 4000)
    monkeypatch.setattr(os, "posix_fallocate", unsupported, raising=False)
    _platform.reserve_shm(5, 2000, "link 'x'", free=lambda: 4000)  # the check above is all there is
    monkeypatch.delattr(os, "posix_fallocate", raising=False)
    _platform.reserve_shm(5, 2000, "link 'x'", free=lambda: 4000)


def test_a_host_link_larger_than_free_shm_is_refused_at_sender(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_platform, "shm_free_bytes", lambda path=_platform.SHM_DIR: 1 << 20)
    with pytest.raises(cudalink.LinkError, match=r"needs 4,194,304 bytes .* only 1,048,576 are free"):
        cudalink.Sender(name, shape=(1024, 1024), dtype="uint8", slots=4, device="cpu")
    monkeypatch.undo()
    with cudalink.Sender(name, shape=(4,), dtype="uint8", device="cpu") as tx:  # nothing was left behind
        tx.send(np.zeros(4, np.uint8))


_SMALL_SHM = textwrap.dedent(
    """
    import os, sys
    import numpy as np, cudalink
    try:
        tx = cudalink.Sender("big", shape=(2160, 3840, 4), dtype="float32", slots=4, device="cpu")
    except cudalink.LinkError as exc:
        print("REFUSED", exc)
    else:
        tx.send(np.zeros((2160, 3840, 4), np.float32))
        print("SENT")
    with cudalink.Sender("small", shape=(1024, 1024, 4), dtype="uint8", slots=4, device="cpu") as tx:
        with cudalink.Receiver("small", timeout=5) as rx:
            tx.send(np.full((1024, 1024, 4), 7, np.uint8))
            assert int(rx.recv(2).numpy()[0, 0, 0]) == 7
    print("SMALL OK", os.listdir("/dev/shm"))
    """
)


def _private_shm(size: str, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a mount namespace of its own whose /dev/shm is a tmpfs of ``size`` (Docker's is 64m)."""
    cmd = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -c "$0"'
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd, script], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_link_larger_than_a_64m_dev_shm_is_an_error_not_a_sigbus() -> None:
    """The issue's case for real: Docker's 64 MiB /dev/shm, a 4K float RGBA link of 4 slots (530 MB)."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs Linux and unshare(1) for a private /dev/shm")
    probe = _private_shm("1m", "print('ok')")
    if probe.returncode != 0 or "ok" not in probe.stdout:
        pytest.skip(f"no private mount namespace here (unshare -m / mount tmpfs need root): {probe.stderr.strip()}")
    got = _private_shm("64m", _SMALL_SHM)
    assert got.returncode == 0, f"exit {got.returncode} (-7/135 is the SIGBUS): {got.stdout}{got.stderr}"
    assert "REFUSED" in got.stdout and "SENT" not in got.stdout, got.stdout
    assert "530,841,600" in got.stdout and "--shm-size" in got.stdout, got.stdout
    assert "SMALL OK" in got.stdout, got.stdout
    leftovers = got.stdout.split("SMALL OK", 1)[1]
    assert "big" not in leftovers, f"the refused link left segments behind: {leftovers}"


# ================================================================ 2. a refused send takes no seq and no slot


def _ring_impl(tx: cudalink.Sender, impl: str) -> None:
    """Publish through ``impl``'s producer ring (the Sender picked the compiled one where it was built)."""
    _impl(impl)
    if impl == "python":
        tx._ring = _ring.PyProducerRing(tx._server.header, tx._layout)


def _state(tx: cudalink.Sender) -> tuple[int, int, tuple[int, ...]]:
    return tx.seq, tx.stats()["published"], wire.read_stamps(tx._server.header, tx._layout)


BAD_META: list[Any] = ["hello", "", 123, 0, 1.5, [1, 2], b"x" * 65, bytearray(65), np.zeros(2, np.uint8)]
BAD_TS: list[Any] = ["1", 1.5, -1, 1 << 64, True, b"12"]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_refused_send_takes_no_seq_no_slot_and_no_frame(pair: PairFactory, impl: str) -> None:
    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8", slots=3, rx={"latest": False})
    _ring_impl(tx, impl)
    good = np.arange(4, dtype=np.uint8)
    tx.send(good)
    tx.send(good)
    before = _state(tx)
    refusals: list[tuple[str, dict[str, Any], type[Exception]]] = [
        *((f"meta={m!r:.20}", {"meta": m}, cudalink.FormatError) for m in BAD_META),
        *((f"timestamp_ns={t!r:.20}", {"timestamp_ns": t}, cudalink.FormatError) for t in BAD_TS),
    ]
    for what, kw, err in refusals:
        with pytest.raises(err, match="cudalink: "):
            tx.send(good, **kw)
        assert _state(tx) == before, what
    for bad in (np.zeros(5, np.uint8), np.zeros(4, np.float32), np.zeros((2, 2), np.uint8), "abcd", None):
        with pytest.raises(cudalink.FormatError):
            tx.send(bad)
        assert _state(tx) == before, repr(bad)
    with pytest.raises(cudalink.FormatError):  # reserve refuses its meta before it claims, too
        tx.reserve(meta="hello")
    assert _state(tx) == before
    assert tx.send(good) == 3
    assert [rx.recv(1).seq for _ in range(3)] == [1, 2, 3]  # the oldest frame is still there: no slot was taken
    assert rx.skipped == 0 and tx.stats()["published"] == tx.seq == 3


@pytest.mark.parametrize("impl", IMPLS)
def test_both_cores_take_the_same_meta(pair: PairFactory, impl: str) -> None:
    """bytes-like in (bytes, bytearray, memoryview), bytes out; None is no meta; str is refused."""
    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8", slots=8, rx={"latest": False})
    _ring_impl(tx, impl)
    metas: list[Any] = [b"ab", bytearray(b"cd"), memoryview(b"xyzw")[1:3], memoryview(np.arange(3, dtype=np.uint16)),
                        None, b"", b"m" * wire.META_MAX]  # fmt: skip
    for m in metas:
        tx.send(np.zeros(4, np.uint8), meta=m)
    got = [rx.recv(1).meta for _ in metas]
    assert got == [b"ab", b"cd", b"yz", np.arange(3, dtype=np.uint16).tobytes(), b"", b"", b"m" * wire.META_MAX]
    assert all(type(m) is bytes for m in got)
    with tx.reserve(meta=bytearray(b"r")) as f:
        np.from_dlpack(f)[...] = 1
    assert rx.recv(1).meta == b"r"
    with pytest.raises(cudalink.FormatError, match=r"meta must be bytes.*meta=text\.encode\(\)"):
        tx.send(np.zeros(4, np.uint8), meta="text")


def test_timestamps_travel_as_given(pair: PairFactory) -> None:
    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8", rx={"latest": False})
    for ts in (0, 123, np.int64(456), (1 << 64) - 1):
        tx.send(np.zeros(4, np.uint8), timestamp_ns=ts)  # type: ignore[arg-type]
        assert rx.recv(1).timestamp_ns == int(ts)


@pytest.mark.parametrize("policy", ["drop", "block"])
def test_a_wrong_array_is_refused_even_when_no_slot_is_free(pair: PairFactory, policy: str) -> None:
    """Refusal does not depend on the ring's state: no drop counted, no wait for a slot first."""
    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8", slots=1, policy=policy, timeout=5.0)
    tx.send(np.zeros(4, np.uint8))
    held = rx.recv(1)  # the only slot is leased
    before = (*_state(tx), tx.stats()["dropped"])
    t0 = time.monotonic()
    with pytest.raises(cudalink.FormatError, match=r"\(5,\) uint8 but the link carries \(4,\)"):
        tx.send(np.zeros(5, np.uint8))
    assert time.monotonic() - t0 < 1.0
    assert (*_state(tx), tx.stats()["dropped"]) == before
    held.release()


def test_a_closed_sender_refuses_everything_first(pair: PairFactory) -> None:
    tx, _rx = pair(DEFAULT, shape=(4,), dtype="uint8")
    tx.close()
    with pytest.raises(cudalink.LinkClosed):
        tx.send(np.zeros(4, np.uint8))
    with pytest.raises(cudalink.LinkClosed):
        tx.send(np.zeros(5, np.uint8), meta="wrong too")  # the closed link is what it is told first
    with pytest.raises(cudalink.LinkClosed), tx.reserve():
        pass


# ================================================================ 3. a lying stamp never hangs recv()


def _wait_for(q: Any, what: str, timeout: float = 60.0) -> Any:
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"{what} never returned (the take loop spun on the corrupt header)")


@pytest.mark.parametrize("impl", IMPLS)
def test_take_over_a_lying_stamp_raises_protocol_error(spawned: Spawned, impl: str) -> None:
    _impl(impl)
    out = spawned.queue()
    p = spawned(_hostile.take_over_a_lying_stamp, impl, out, forever=True)
    kind, text, elapsed, lease = _wait_for(out, "take()")
    spawned.kill(p)
    assert kind == "ProtocolError", text
    assert "slot 0's stamp says frame 1000 but its record holds frame 1" in text and "corrupt" in text
    assert elapsed < 1.0 and lease == 0  # and no lease is left behind on the lying slot


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_over_a_lying_stamp_returns_within_its_timeout(
    spawned: Spawned, name: str, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _child_core(impl, monkeypatch)
    out = spawned.queue()
    p = spawned(_hostile.recv_over_a_lying_stamp, name, out, forever=True)
    kind, text, elapsed = _wait_for(out, "recv(timeout=0.5)")
    spawned.kill(p)
    assert kind in ("ProtocolError", "LinkTimeout"), text
    assert elapsed < _hostile.RECV_TIMEOUT + 1.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_where_the_rendezvous_file_goes_hangs_nothing(spawned: Spawned, name: str) -> None:
    """``NAME.tcp`` was opened blocking: a FIFO there (any process of the user can make one) held a
    Receiver(timeout=0.5), ``clean`` and the next Sender in open() until a writer came, which none did."""
    os.mkfifo(os.path.join(_platform.runtime_dir(), f"{name}.tcp"), 0o600)
    out = spawned.queue()
    p = spawned(_hostile.over_a_fifo_rendezvous, name, out, forever=True)
    steps = {}
    for step in ("receiver", "clean", "sender"):
        try:
            got = out.get(timeout=20.0)
        except queue.Empty:
            pytest.fail(f"the {step} step never returned: it waited in open() for a writer to the FIFO")
        steps[got[0]] = got[1:]
    spawned.kill(p)
    kind, text, elapsed = steps["receiver"]
    assert kind in ("LinkTimeout", "ProducerGone") and text.startswith("cudalink:"), steps
    assert elapsed < _hostile.RECV_TIMEOUT + 1.0, steps
    assert steps["clean"][0] == "ok" and steps["sender"][0] == "ok", steps
    assert not os.path.lexists(os.path.join(_platform.runtime_dir(), f"{name}.tcp"))  # clean removed it


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not _platform.HAS_FD_PASSING, reason="counts fds")
def test_descriptors_a_host_producer_passes_are_not_kept(spawned: Spawned, name: str) -> None:
    """A host link needs no descriptors; a producer that passed some anyway (a bug, or a lie) left each
    consumer two more open fds per attach (11 after one, 109 after fifty), until it ran out."""
    spawned.ready(_hostile.producer_passing_fds, name, forever=True)

    def attach() -> None:
        with cudalink.Receiver(name, timeout=5.0) as rx:
            rx.recv(timeout=5.0).release()

    attach()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        attach()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_take_that_keeps_losing_its_slot_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stamps that change under every lease (a scribbler, not a producer): bounded retries, then no frame."""
    layout = wire.Layout(2, 1)
    buf = bytearray(layout.size)
    rx = _ring.PyConsumerRing(memoryview(buf), layout, 0, 1 << 20)
    real = _ring._get64
    rereads = []

    def moving(b: Any, off: int) -> tuple[int]:
        if off == layout.stamp(0):  # the re-read after our lease: the stamp has moved on
            value = wire.read_u64(buf, off) + 2
            wire.write_u64(buf, off, value)
            rereads.append(value)
            return (value,)
        return real(b, off)  # type: ignore[no-any-return]

    wire.write_u64(buf, layout.stamp(0), 2)
    monkeypatch.setattr(_ring, "_get64", moving)
    assert rx.take(0, True) is None
    assert wire.read_u64(buf, layout.lease(0, 0)) == 0
    assert 10 < len(rereads) <= 100_000


# ================================================================ 4. lying slot handles: ProtocolError at attach


@pytest.mark.parametrize("offset", [1 << 40, 4097, 4096 * 4])
def test_a_host_slot_handle_outside_the_data_segment_is_refused_at_attach(name: str, offset: int) -> None:
    with cudalink.Sender(name, shape=(4096,), dtype="uint8", slots=4, device="cpu") as tx:
        buf = tx._server.header
        wire.write_u64(buf, tx._layout.handle(2) + 64, offset)  # the handle's offset field
        with pytest.raises(cudalink.ProtocolError, match=rf"slot 2 .* offset {offset}"):  # noqa: SIM117
            with cudalink.Receiver(name, timeout=2.0) as rx:  # before the fix: attached, and then
                for _ in range(6):  # a TypeError on every frame of slot 2
                    tx.send(np.zeros(4096, np.uint8))
                    rx.recv(1).release()
        wire.write_u64(buf, tx._layout.handle(2) + 64, 2 * 4096)
        with cudalink.Receiver(name, timeout=2.0) as rx:  # the handle is right again: the link works
            tx.send(np.ones(4096, np.uint8))
            assert rx.recv(1).numpy().sum() == 4096


def test_a_restarted_producer_s_handles_are_checked_again(name: str) -> None:
    rx = cudalink.Receiver(name, timeout=2.0, connect=False)
    try:
        with cudalink.Sender(name, shape=(16,), dtype="uint8", slots=2) as tx:
            tx.send(np.zeros(16, np.uint8))
            assert rx.recv(2).seq == 1
        with pytest.raises(cudalink.ProducerGone):
            rx.recv(1)
        with cudalink.Sender(name, shape=(16,), dtype="uint8", slots=2) as tx:
            wire.write_u64(tx._server.header, tx._layout.handle(1) + 64, 1 << 33)
            with pytest.raises(cudalink.ProtocolError, match="slot 1"):
                rx.recv(2)
    finally:
        rx.close()


def test_a_cuda_slot_handle_smaller_than_the_slots_is_refused() -> None:
    """The CUDA view's check needs no GPU: it reads only the handles (their sizes)."""
    view = object.__new__(_backends.CudaView)
    ok = wire.SlotHandle(b"\0" * 64, 4 << 20, b"\0" * 64, 0)
    view.check([ok, ok], 3 << 20)
    with pytest.raises(cudalink.ProtocolError, match=r"slot 1 of the CUDA link says it is 1024 bytes"):
        view.check([ok, wire.SlotHandle(b"\0" * 64, 1024, b"\0" * 64, 0)], 3 << 20)


# ================================================================ GPU: a pool that cannot be had, refused CUDA sends


@pytest.mark.gpu
@pytest.mark.parametrize("handles", ["pool", "legacy"])
def test_a_cuda_pool_larger_than_the_card_is_a_clear_error(name: str, handles: str) -> None:
    """256 GiB of slots on a card of 80 or 141: a cudalink error naming bytes, device and free memory."""
    if handles == "pool" and _platform.default_handles() != "pool":
        pytest.skip("IPC pools are Linux-only (not WSL)")
    with pytest.raises(cudalink.LinkError) as err:
        cudalink.Sender(name, shape=(16,), dtype="uint8", device=0, slots=1, capacity=1 << 38, handles=handles)
    text = str(err.value)
    assert "274,877,906,944 bytes" in text and "cuda:0" in text and "free" in text, text
    assert "fewer slots" in text, text
    with cudalink.Sender(name, shape=(16,), dtype="uint8", device=0, handles=handles) as tx:  # nothing left over
        assert tx.send(_cuda_zeros(16)) == 1


def _cuda_zeros(n: int) -> Any:
    torch = pytest.importorskip("torch")
    return torch.zeros(n, dtype=torch.uint8, device="cuda")


@pytest.mark.gpu
def test_a_refused_cuda_send_takes_no_seq_and_no_slot(pair: PairFactory) -> None:
    torch = pytest.importorskip("torch")
    tx, rx = pair(DEFAULT, shape=(64,), dtype="float32", slots=2, device=0, rx={"latest": False})
    good = torch.ones(64, device="cuda")
    tx.send(good)
    before = _state(tx)
    for bad in (
        torch.ones(65, device="cuda"),  # shape, through the one-pass read's refusal and the general path
        torch.ones(64, device="cuda", dtype=torch.float16),  # dtype
        np.ones(64, np.float32),  # a host array on a CUDA link
        torch.ones(128, device="cuda")[::2],  # strides no single copy can take
    ):
        with pytest.raises(cudalink.FormatError):
            tx.send(bad)
        assert _state(tx) == before
    with pytest.raises(cudalink.FormatError):
        tx.send(good, meta="text")
    assert _state(tx) == before
    assert tx.send(good * 2) == 2
    assert [float(torch.from_dlpack(rx.recv(2)).sum()) for _ in range(2)] == [64.0, 128.0]
    assert rx.skipped == 0


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="segments are files only where /dev/shm exists")
def test_a_fifo_in_place_of_a_live_links_data_segment_is_a_cudalink_error(name: str) -> None:
    """A consumer maps the data segment read-only through a non-blocking open that refuses anything but a regular
    file; a FIFO put in its place then came out as a bare OSError('a FIFO or device file')."""
    with cudalink.Sender(name, shape=(4,), dtype="uint8", device="cpu") as tx:
        tx.send(np.zeros(4, np.uint8))
        data = [p for p in glob.glob(f"/dev/shm/{_platform.segment_name(name)}-*") if "-h" not in p[-18:]]
        assert len(data) == 1, data
        os.unlink(data[0])
        os.mkfifo(data[0], 0o600)
        try:
            with (
                pytest.raises(cudalink.ProtocolError, match=r"^cudalink: the data segment .* cannot be mapped"),
                cudalink.Receiver(name, timeout=1.0) as rx,
            ):
                rx.recv(timeout=1.0)
        finally:
            os.unlink(data[0])


@pytest.mark.parametrize("ext", ["lock", "sock", "tcp"])
def test_a_directory_where_a_link_keeps_its_files_is_named_and_left_alone(name: str, ext: str) -> None:
    """A directory at NAME.lock, NAME.sock or NAME.tcp: a Sender and ``clean`` failed with a bare
    IsADirectoryError (or ``clean`` said "removed" and removed nothing), and a Receiver said the producer had
    died. Each now stops with a ``cudalink:`` error naming the directory, and removes nothing of it."""
    path = os.path.join(_platform.runtime_dir(), f"{name}.{ext}")
    os.mkdir(path)
    try:
        with pytest.raises(cudalink.LinkError, match=r"is a directory.*rm -r") as exc:
            cudalink.Sender(name, shape=(4,), dtype="uint8")
        assert path in str(exc.value) and str(exc.value).startswith("cudalink:")
        with pytest.raises(cudalink.LinkError, match=r"is a directory") as exc:
            cudalink.Receiver(name, timeout=0.3)
        assert path in str(exc.value) and not isinstance(exc.value, cudalink.ProducerGone)
        run = subprocess.run(
            [sys.executable, "-m", "cudalink", "clean", name], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        assert run.returncode == 1, run
        assert path in run.stderr and "Traceback" not in run.stderr, run
        assert "removed" not in run.stdout, run
        assert os.path.isdir(path)
    finally:
        os.rmdir(path)
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:  # gone: the name works again
        assert tx.send(np.zeros(4, np.uint8)) == 1


def test_clean_removes_every_other_dead_link_past_a_directory_in_the_way(spawned: Spawned, name: str) -> None:
    """One link's directory in the way stops ``clean`` for that link alone: a dead producer's link beside it
    is still removed, and the run says which one it could not clean (exit 1)."""
    other = name + "-dead"
    p = spawned.ready(_hostile.producer_then_wait, other, forever=True)
    spawned.kill(p)
    path = os.path.join(_platform.runtime_dir(), f"{name}.sock")
    os.mkdir(path)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "cudalink", "clean"], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
    finally:
        os.rmdir(path)
    assert run.returncode == 1, run
    assert f"removed {other!r}" in run.stdout and path in run.stderr, run
    assert not cudalink.transport.shm.leftovers(other)[0]


def test_a_receiver_given_a_live_links_segment_name_is_told_which_link_it_is(name: str) -> None:
    """``Receiver("cam0-<generation>")`` (a name copied from ``ls /dev/shm``) while cam0 lives: it was told that a
    producer "died and left its link behind", and pointed at ``clean``, which would have found nothing dead."""
    for control in ("unix", "tcp") if _platform.HAS_FD_PASSING else ("tcp",):
        with cudalink.Sender(
            name, shape=(4,), dtype="uint8", transport=cudalink.transport.SharedMemoryTransport(control)
        ) as tx:
            suffixes = [f"-{tx.generation:016x}"] + ([f"-h{tx.generation:016x}"] if control == "tcp" else [])
            for suffix in suffixes:
                with pytest.raises(
                    cudalink.LinkError, match=rf"not a link but the shared memory of live link {name!r}"
                ) as exc:
                    cudalink.Receiver(name + suffix, timeout=0.3)
                assert not isinstance(exc.value, (cudalink.ProducerGone, cudalink.LinkTimeout))
            with cudalink.Receiver(name, timeout=2.0) as rx:  # the link itself is untouched
                tx.send(np.arange(4, dtype=np.uint8))
                assert rx.recv(timeout=2.0).numpy().tolist() == [0, 1, 2, 3]
