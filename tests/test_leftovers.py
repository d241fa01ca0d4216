"""Nothing left at the edges: a Sender never closed is closed at exit, a clean close removes everything it
made (the lock file too), and what a killed producer leaves is recognised as dead at once: by the next
Sender, by a Receiver (which says so instead of waiting out its timeout) and by ``cudalink clean``."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import cudalink
from cudalink import _platform
from cudalink.transport.shm import SharedMemoryTransport, clean, leftovers

from . import _content, _procs
from .conftest import SIGKILL, Spawned

ROOT = Path(__file__).resolve().parents[1]


def nothing_left(name: str) -> bool:
    files, segments = leftovers(name, unrecorded=True)
    return not files and not segments and not os.path.exists(_platform.lock_path(name))


def run_python(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_clean_close_removes_everything_it_made_even_the_lock_file(control: str) -> None:
    name = f"left-close-{os.getpid()}-{control}"
    with cudalink.Sender(name, shape=(4, 4), dtype="uint8") as tx:
        tx.send(np.zeros((4, 4), np.uint8))
        files, segments = leftovers(name)
        assert files and segments and os.path.exists(_platform.lock_path(name))
    assert nothing_left(name), (leftovers(name), os.listdir(_platform.runtime_dir()))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="measures /dev/shm")
def test_close_gives_the_frames_memory_back_at_once_while_the_object_lives() -> None:
    """Re-creating a Sender after close (a format change) must not need twice the shared memory: close() frees
    the frames' pages when no consumer holds one, not when the garbage collector finds the Sender."""

    def used() -> int:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    shape = (1024, 1024, 4)  # 4 MiB a frame, 4 slots
    gc.disable()  # as if the collector had not run yet
    try:
        before = used()
        tx = cudalink.Sender(f"left-mem-{os.getpid()}", shape=shape, dtype="uint8", slots=4)
        for _ in range(4):
            tx.send(np.ones(shape, np.uint8))  # every slot's pages touched
        grown = used() - before
        assert grown >= 15 << 20, grown
        tx.close()
        assert used() - before < grown // 4, (before, grown, used())
        assert tx.stats()["published"] == 4  # still says what it did
    finally:
        gc.enable()


def test_a_consumer_admitted_as_the_producer_closes_keeps_its_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() gives the frames' memory back only when no consumer can hold one: a consumer admitted just as
    close() began (its WELCOME still on the way) reads the real frame, never zeros."""
    import subprocess
    import threading

    from cudalink import link

    admitting = threading.Event()
    join = link.Sender._join_consumer

    def slow_join(self: link.Sender, *args: int) -> None:
        admitting.set()
        time.sleep(0.3)  # the control thread descheduled mid-admission
        join(self, *args)

    monkeypatch.setattr(link.Sender, "_join_consumer", slow_join)
    consumer = (
        "import sys, time, cudalink\n"
        "try:\n"
        "    with cudalink.Receiver(sys.argv[1], timeout=5.0) as rx:\n"
        "        f = rx.recv(timeout=2.0)\n"
        "        a = f.numpy()\n"
        "        time.sleep(0.5)\n"
        "        print('HELD', int(a.min()), int(a.max()))\n"
        "except cudalink.LinkError as exc:\n"  # too late for the frame (its segment gone): fine, not zeros
        "    print('NONE', type(exc).__name__, exc)\n"
    )
    name = f"left-admit-{os.getpid()}"
    tx = cudalink.Sender(name, shape=(64, 64, 4), dtype="uint8")
    tx.send(np.full((64, 64, 4), 7, np.uint8))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", consumer, name], stdout=subprocess.PIPE, text=True, env=env)
    assert admitting.wait(20)
    tx.close()
    out = proc.communicate(timeout=30)[0]
    assert "HELD 7 7" in out or "NONE" in out, out


def test_a_sender_the_application_drops_goes_at_once_with_its_fds() -> None:
    """No reference cycle keeps a Sender (and its mappings and fds) until the collector runs."""
    gc.disable()
    try:
        fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
        for i in range(3):
            tx = cudalink.Sender(f"left-drop-{os.getpid()}-{i}", shape=(8, 8), dtype="uint8")
            rx = cudalink.Receiver(tx.name, timeout=2.0)
            tx.send(np.zeros((8, 8), np.uint8))
            rx.recv().release()
            rx.close()
            gone = weakref.ref(tx)
            tx.close()
            del tx
            assert gone() is None
        if fds is not None:
            assert len(os.listdir("/proc/self/fd")) <= fds + 2
    finally:
        gc.enable()


def test_a_script_that_never_closes_its_sender_leaves_nothing(control: str) -> None:
    name = f"left-script-{os.getpid()}-{control}"
    code = (
        "import numpy as np, cudalink\n"
        f"tx = cudalink.Sender({name!r}, shape=(4, 4), dtype='uint8')\n"
        "tx.send(np.zeros((4, 4), np.uint8))\n"
        "keep = [tx]  # still referenced when the interpreter exits: only atexit closes it\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert nothing_left(name), leftovers(name)


def _exit_lag(device: str) -> float:
    """Seconds from a script's last line to its exit, with a Sender and an idle Receiver of its own still open."""
    name = f"left-lag-{os.getpid()}-{device.strip(chr(39))}"
    code = (
        "import time, cudalink\n"
        f"tx = cudalink.Sender({name!r}, shape=(4, 4), dtype='uint8', device={device})\n"
        f"rx = cudalink.Receiver({name!r})  # attached, never used again\n"
        "keep = [tx, rx]\n"
        "print(time.monotonic(), flush=True)\n"
    )
    proc = run_python(code, timeout=120)
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert nothing_left(name), leftovers(name)
    return ended - float(proc.stdout.split()[-1])


def test_a_script_ending_with_its_own_sender_and_receiver_open_exits_without_waiting_for_itself() -> None:
    """The exit-time close used to wait its whole 2 s for the script's own idle Receiver to hang up (which it
    never does while the interpreter is closing the Sender): its Receivers now close first."""
    assert _exit_lag("'cpu'") < 1.5


@pytest.mark.gpu
def test_a_gpu_script_ending_with_its_own_sender_and_receiver_open_exits_without_waiting_for_itself() -> None:
    """On a GPU link the Sender does wait for consumers to unmap: the script's own Receiver unmaps first."""
    assert _exit_lag("0") < 1.5


def test_a_cpu_sender_closes_at_once_beside_an_idle_consumer_which_still_reads_its_last_frames() -> None:
    """A host consumer's mapping outlives the producer's, so close() waits for nobody, even with
    ``timeout=None`` (it used to wait forever for a consumer that was not inside a call); the consumer,
    calling again later, still gets every frame published before the close, then ProducerGone."""
    import threading

    name = f"left-idle-{os.getpid()}"
    consumer = (
        "import sys, cudalink\n"
        "rx = cudalink.Receiver(sys.argv[1], latest=False, timeout=10)\n"
        "print('attached', flush=True)\n"
        "sys.stdin.readline()  # idle: no call under way while the producer closes\n"
        "try:\n"
        "    while True:\n"
        "        with rx.recv() as f:\n"
        "            print('frame', f.seq, int(f.numpy()[0, 0]), flush=True)\n"
        "except cudalink.ProducerGone:\n"
        "    print('gone', flush=True)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    tx = cudalink.Sender(name, shape=(4, 4), dtype="uint8", device="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", consumer, name],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "attached"
        for i in range(3):
            tx.send(np.full((4, 4), 10 + i, np.uint8))
        closer = threading.Thread(target=tx.close, kwargs={"timeout": None}, daemon=True)
        closer.start()
        closer.join(5.0)
        assert not closer.is_alive(), "close(timeout=None) waited for a consumer that was not inside a call"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tx.close()
    assert out.split("\n")[:4] == ["frame 1 10", "frame 2 11", "frame 3 12", "gone"], out + err
    assert nothing_left(name), leftovers(name)


def test_finalizers_run_at_interpreter_exit_with_their_modules_torn_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed Sender, Receiver or segment collected during interpreter teardown printed "Exception ignored
    in __del__ ... 'NoneType' object has no attribute 'suppress'": by then the module's globals (contextlib)
    may be None. The finalizers need none of them."""
    from cudalink import link
    from cudalink.transport import shm

    name = f"left-del-{os.getpid()}"
    tx = cudalink.Sender(name, shape=(4,), dtype="uint8", device="cpu")
    rx = cudalink.Receiver(name, timeout=1.0)
    tx.send(np.zeros(4, np.uint8))
    rx.recv().release()
    rx.close()
    tx.close()
    for module in (link, shm):
        monkeypatch.setattr(module, "contextlib", None)
    tx.__del__()
    rx.__del__()
    shm.Segment.__del__(object.__new__(shm.Segment))  # a half-made one: its attributes never set


@pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(), reason="no forkserver")
def test_a_multiprocessing_child_ending_with_its_sender_open_leaves_nothing() -> None:
    """A ``multiprocessing`` child started by fork or forkserver (Linux's default from Python 3.14) ends in
    ``os._exit``: atexit never runs there, so a Sender it kept open was never closed and its segments and socket
    stayed in /dev/shm. The exit-time close now also runs from multiprocessing's own exit hooks."""
    import multiprocessing

    name = f"left-mp-{os.getpid()}"
    ctx = multiprocessing.get_context("forkserver")
    ready = ctx.Event()
    child = ctx.Process(target=_procs.host_producer_kept_open, args=(name, ready))
    child.start()
    try:
        assert ready.wait(60)
        child.join(30)
        assert child.exitcode == 0
        left = leftovers(name, unrecorded=True)
    finally:
        if child.is_alive():
            child.kill()
        clean(only=[name])
    assert left == ([], []), left


def test_a_script_ending_while_a_daemon_thread_is_stuck_in_a_reserve_block_still_exits() -> None:
    """A daemon thread inside a ``reserve()`` block that never ends (a camera read that hangs) holds the Sender's
    lock; daemon threads run on while atexit runs, and the exit-time close waited for that lock forever: the
    script never exited, and its consumers were never told. The exit-time close now waits for it only its
    timeout, then leaves the link as a killed producer does (consumers see it gone at once; the next Sender
    or ``cudalink clean`` removes it), and says so."""
    name = f"left-stuck-{os.getpid()}"
    code = (
        "import threading, time, numpy as np, cudalink\n"
        f"tx = cudalink.Sender({name!r}, shape=(4, 4), dtype='uint8', slots=3)\n"
        "tx.send(np.full((4, 4), 1, np.uint8))\n"
        "entered = threading.Event()\n"
        "def render():\n"
        "    with tx.reserve():\n"
        "        entered.set()\n"
        "        time.sleep(3600)  # never ends\n"
        "threading.Thread(target=render, daemon=True).start()\n"
        "entered.wait(10)\n"
    )
    try:
        proc = run_python(code, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the script hung at exit: the exit-time close waited for a reserve() block that never ends")
    finally:
        clean(only=[name])
    assert proc.returncode == 0, proc.stderr
    assert "reserve() block" in proc.stderr and "cudalink clean" in proc.stderr, proc.stderr
    assert nothing_left(name), leftovers(name)


def test_a_script_ending_with_a_reserve_block_open_in_a_suspended_generator_leaves_nothing() -> None:
    """A generator that yields inside ``with tx.reserve() as frame:`` and is never resumed keeps that block open, on
    the main thread, past the script's end. The exit-time close deferred itself to the block's end (as a close
    called from inside a block does), and the block ended only when the generator was finalized during interpreter
    teardown: that close then failed ("ImportError: sys.meta_path is None") and left the link's segments in
    /dev/shm. At exit nothing can end such a block any more: the link is closed then, and the block's late end
    publishes nothing."""
    name = f"left-gen-{os.getpid()}"
    code = (
        "import numpy as np, cudalink\n"
        f"tx = cudalink.Sender({name!r}, shape=(4, 4), dtype='uint8', slots=3)\n"
        "def frames():\n"
        "    while True:\n"
        "        with tx.reserve() as frame:\n"
        "            yield frame\n"
        "writer = frames()\n"
        "np.from_dlpack(next(writer))[...] = 1  # never resumed: its block stays open\n"
    )
    try:
        proc = run_python(code, timeout=30)
        left = leftovers(name, unrecorded=True)
    finally:
        clean(only=[name])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert left == ([], []), left


def test_the_exit_registry_holds_senders_weakly_and_forgets_closed_ones() -> None:
    from cudalink import link

    tx = cudalink.Sender(f"left-weak-{os.getpid()}", shape=(4, 4), dtype="uint8")
    assert isinstance(link._open_senders, weakref.WeakSet) and tx in link._open_senders
    tx.close()
    assert tx not in link._open_senders
    assert nothing_left(tx.name)


@pytest.mark.parametrize("sig", [SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_producer_is_recognised_as_dead_at_once(spawned: Spawned, control: str, sig: int) -> None:
    name = f"left-kill-{os.getpid()}-{control}-{int(sig)}"
    producer = spawned.ready(_procs.host_producer_forever, name, (4, 4), "uint8", forever=True)
    assert not SharedMemoryTransport().abandoned(name)  # alive: its lock is held
    assert clean(only=[name]) == []  # ... and never touched
    assert producer.pid is not None
    os.kill(producer.pid, sig)  # no handler of ours: SIGTERM kills it as the application's default says
    producer.join(10)
    assert producer.exitcode == -sig
    files, segments = leftovers(name)
    assert files and segments  # what it left

    t0 = time.monotonic()
    with pytest.raises(cudalink.ProducerGone, match=r"died .* start it again") as err:
        cudalink.Receiver(name, timeout=10.0)
    assert time.monotonic() - t0 < 2.0, "a Receiver waited out its timeout on a dead producer's leftovers"
    assert "cudalink clean" in str(err.value)
    with pytest.raises(cudalink.ProducerGone, match="died"):  # a for loop says so too, it does not just end
        for _ in cudalink.Receiver(name, timeout=10.0, connect=False):
            pass

    listed = clean(dry_run=True, only=[name])
    assert [n for n, _ in listed] == [name]
    assert leftovers(name) == (files, segments)  # a dry run removes nothing
    removed = clean(only=[name])
    assert [n for n, _ in removed] == [name]
    assert set(files + segments) <= set(removed[0][1])
    assert nothing_left(name)


def test_clean_is_not_put_off_by_another_look_at_a_dead_links_lock(spawned: Spawned) -> None:
    """Another ``clean`` (or a Receiver asking whether the producer lives) holds a dead link's lock for a moment:
    that is not a live producer, and this clean still removes the link."""
    import threading

    name = f"left-peek-{os.getpid()}"
    producer = spawned.ready(_procs.host_producer_forever, name, (4, 4), "uint8", forever=True)
    spawned.kill(producer)
    looker = _platform.ProcessLock(_platform.lock_path(name))
    assert looker.acquire()
    threading.Timer(0.02, looker.release).start()
    removed = clean(only=[name])
    assert [n for n, _ in removed] == [name]
    assert nothing_left(name)


def test_the_next_sender_replaces_a_killed_producers_leftovers(spawned: Spawned, control: str) -> None:
    name = f"left-next-{os.getpid()}-{control}"
    producer = spawned.ready(_procs.host_producer_forever, name, (4, 4), "uint8", forever=True)
    assert producer.pid is not None
    os.kill(producer.pid, signal.SIGTERM)
    producer.join(10)
    with cudalink.Sender(name, shape=(2, 2), dtype="uint8") as tx, cudalink.Receiver(name, timeout=5.0) as rx:
        tx.send(np.full((2, 2), 7, np.uint8))
        with rx.recv(timeout=5.0) as frame:
            assert frame.numpy().tolist() == [[7, 7], [7, 7]]
    assert nothing_left(name)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="segments can be listed only where /dev/shm exists")
def test_what_no_record_names_is_removed_by_the_next_sender_and_by_clean(control: str) -> None:
    """A producer killed while it made its segments (before its header or rendezvous file named the
    generation) or while it removed them (the record first) leaves segments nothing names, and one killed
    while writing its rendezvous file leaves a temporary file: the next Sender and ``clean`` find them by name.
    A live look-alike link (named ``NAME-<16 hex>``, whose header has such a name) is left alone."""
    from cudalink.transport.channel import LoopbackChannel
    from cudalink.transport.shm import _open_segment

    name = f"left-unrec-{os.getpid()}-{control}"
    gen = 0x0123456789ABCDEF
    orphans = [_platform.segment_name(name, f"-{gen:016x}"), _platform.segment_name(name, f"-h{gen:016x}")]
    tmp = f"{LoopbackChannel.record_path(name)}.999999.tmp"

    def leave() -> None:
        for seg in orphans:
            _open_segment(seg, create=True, size=1 << 16).close()
        with open(tmp, "wb") as f:
            f.write(b"half a record")

    # other live links whose Unix headers look like our data segments (NAME-<hex>) and TCP headers (NAME-h<hex>)
    alike, alike_h = f"{name}-{gen + 1:016x}", f"{name}-h{gen + 2:016x}"
    with (
        cudalink.Sender(alike, shape=(2, 2), dtype="uint8", device="cpu") as other,
        cudalink.Sender(alike_h, shape=(2, 2), dtype="uint8", device="cpu") as other_h,
    ):
        leave()
        files, segments = leftovers(name, unrecorded=True)
        assert set(orphans) <= set(segments) and tmp in files
        assert not {_platform.segment_name(alike), _platform.segment_name(alike_h)} & set(segments)  # live
        with cudalink.Sender(name, shape=(2, 2), dtype="uint8", device="cpu"):
            assert not any(os.path.exists(f"/dev/shm/{seg}") for seg in orphans) and not os.path.exists(tmp)
        assert nothing_left(name)
        leave()
        removed = dict(clean(only=[name]))
        assert set(orphans) <= set(removed[name]) and tmp in removed[name]
        assert nothing_left(name)
        for look_alike, tx in ((alike, other), (alike_h, other_h)):  # the look-alikes live on, whole
            tx.send(np.ones((2, 2), np.uint8))
            with cudalink.Receiver(look_alike, timeout=5.0) as rx:
                assert rx.recv(timeout=1.0).numpy().tolist() == [[1, 1], [1, 1]]


def test_a_receiver_waiting_for_a_producer_never_lists_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing /dev/shm (thousands of entries on a busy box) is for the next Sender and ``clean``; a Receiver
    asks whether a name is abandoned at every retry while it waits."""
    listed: list[str] = []
    real = _platform.shm_segments
    monkeypatch.setattr(_platform, "shm_segments", lambda prefix: listed.append(prefix) or real(prefix))
    with pytest.raises(cudalink.LinkTimeout):
        cudalink.Receiver(f"left-nobody-{os.getpid()}", timeout=0.2)
    assert not listed


def test_a_sender_that_fails_to_start_leaves_no_lock_file(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudalink.transport import shm

    name = f"left-fail-{os.getpid()}"
    made = shm._create_segment

    def refuse_data(seg: str, size: int, what: str) -> object:
        if seg != _platform.segment_name(name) and "-h" not in seg[len(_platform.segment_name(name)) :]:
            raise cudalink.LinkError("cudalink: not enough shared memory (test)")
        return made(seg, size, what)

    monkeypatch.setattr(shm, "_create_segment", refuse_data)
    with pytest.raises(cudalink.LinkError, match="not enough shared memory"):
        cudalink.Sender(name, shape=(4, 4), dtype="uint8", device="cpu")
    assert nothing_left(name), os.listdir(_platform.runtime_dir())


def test_a_receiver_still_waits_for_a_producer_that_has_not_started(spawned: Spawned, control: str) -> None:
    """Only a name whose lock is free *and* whose leftovers exist is dead: nothing there, or a lone lock
    file (an older version's), is a producer not started yet."""
    name = f"left-later-{os.getpid()}-{control}"
    with open(_platform.lock_path(name), "wb"):
        pass  # what an older cudalink left after every clean close
    spawned.ready(_procs.host_producer_later, name, 1.0)
    t0 = time.monotonic()
    with cudalink.Receiver(name, timeout=20.0) as rx:
        frame = rx.recv(timeout=10.0)
        assert frame.shape == (4, 4)
        frame.release()
    assert time.monotonic() - t0 >= 0.5


def test_clean_on_the_command_line(spawned: Spawned) -> None:
    name = f"left-cli-{os.getpid()}"
    producer = spawned.ready(_procs.host_producer_forever, name, (4, 4), "uint8", forever=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cudalink", "clean", *args], cwd=ROOT, env=env, capture_output=True, text=True
        )

    live = cli(name)
    assert live.returncode == 0 and "nothing to clean" in live.stdout, live.stdout + live.stderr
    spawned.kill(producer)
    dry = cli("--dry-run", name)
    assert dry.returncode == 0 and f"would remove {name!r}" in dry.stdout, dry.stdout + dry.stderr
    assert leftovers(name) != ([], [])
    done = cli(name)
    assert done.returncode == 0 and f"removed {name!r}" in done.stdout, done.stdout + done.stderr
    assert nothing_left(name)


@pytest.mark.gpu
def test_a_script_that_never_closes_its_cuda_sender_exits_cleanly_and_leaves_nothing() -> None:
    """The exit-time close runs before cuda.core's own teardown (atexit is last in, first out): no crash,
    no CUDA error at exit, nothing left."""
    name = f"left-gpu-{os.getpid()}"
    code = (
        "import cudalink\n"
        f"tx = cudalink.Sender({name!r}, shape=(64, 64, 4), dtype='uint8', device=0)\n"
        "with tx.reserve():\n"  # a CUDA link takes GPU arrays: a reserved frame needs no framework
        "    pass\n"
        "keep = [tx]  # still alive at exit\n"
        "print('sent', flush=True)\n"
    )
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0 and "sent" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert nothing_left(name), leftovers(name)


def test_a_name_another_user_holds_is_refused_with_whose_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm is shared: another user can make a segment under one of our names, which we cannot remove.
    The error says whose it is and what to do, not a bare FileExistsError."""
    from cudalink.transport import shm

    name = f"left-squat-{os.getpid()}"
    opened = shm._open_segment

    def squatted(seg: str, create: bool = False, size: int = 0) -> object:
        if create:
            raise FileExistsError(17, "File exists", seg)
        return opened(seg, create=create, size=size)

    monkeypatch.setattr(shm, "_open_segment", squatted)
    monkeypatch.setattr(_platform, "shm_owner", lambda seg: 4242)
    with pytest.raises(cudalink.LinkError, match=r"another user's \(uid 4242\).*choose another link name"):
        cudalink.Sender(name, shape=(4, 4), dtype="uint8", device="cpu")
    assert nothing_left(name)


def test_a_consumer_stopped_while_it_asks_whether_the_producer_died_does_not_keep_the_producer_out(
    spawned: Spawned,
) -> None:
    """A Receiver waiting for a producer looks at the name's leftovers at every try; a consumer stopped there
    (SIGSTOP, Ctrl-Z, a debugger) held the name's lock all the while, and the producer could not start:
    'already published by a live producer'."""
    name = f"left-stopped-{os.getpid()}"
    looking = spawned.event()
    consumer = spawned(_procs.waiting_consumer_that_stops_while_it_looks, name, looking, forever=True)
    assert looking.wait(60)
    assert consumer.pid is not None
    os.kill(consumer.pid, signal.SIGSTOP)
    try:
        with cudalink.Sender(name, shape=(2, 2), dtype="uint8") as tx, cudalink.Receiver(name, timeout=5.0) as rx:
            tx.send(np.full((2, 2), 3, np.uint8))
            with rx.recv(timeout=5.0) as frame:
                assert frame.numpy().tolist() == [[3, 3], [3, 3]]
    finally:
        os.kill(consumer.pid, signal.SIGCONT)
        spawned.kill(consumer)
    assert nothing_left(name)


def test_a_link_named_like_anothers_record_keeps_its_temporary_file() -> None:
    """Link ``NAME.tcp.5`` writes its rendezvous file through ``NAME.tcp.5.tcp.<pid>.tmp``, which the pattern
    for NAME's own killed writes (``NAME.tcp.*.tmp``) also matched: NAME's cleanup could remove it mid-write."""
    from cudalink.transport.channel import LoopbackChannel

    name = f"left-tmp-{os.getpid()}"
    own = f"{LoopbackChannel.record_path(name)}.999999.tmp"
    theirs = f"{LoopbackChannel.record_path(name + '.tcp.5')}.999998.tmp"
    try:
        for path in (own, theirs):
            with open(path, "wb") as f:
                f.write(b"half a record")
        files = LoopbackChannel().leftovers(name)[0]
        assert own in files and theirs not in files
    finally:
        for path in (own, theirs):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_segment_another_user_squats_under_our_name_is_never_taken_for_our_leftovers(spawned: Spawned) -> None:
    """/dev/shm is anyone's: another user's empty, world-writable file under our header's name was taken for a
    dead producer's leftovers. The Sender, then ``clean``, tried to remove it and failed with a bare
    PermissionError; the Receiver said our producer had died and that a new Sender or ``clean`` would fix it."""
    if os.geteuid() != 0:
        pytest.skip("two other users' processes need root")
    from . import _chaos

    name = f"left-squat-{os.getpid()}"
    path = f"/dev/shm/cudalink-65534-{name}"
    try:
        squatter = spawned(_chaos.squat_segment, path)
        squatter.join(30)
        assert squatter.exitcode == 0 and os.path.exists(path)
        out = spawned.queue()
        spawned(_chaos.victim_of_a_squat, name, out)
        (sender, cleaned, receiver) = out.get(timeout=60)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    assert sender[1] == "LinkError" and "another user's (uid 65533)" in sender[2], sender
    assert sender[2].startswith("cudalink:") and "choose another link name" in sender[2], sender
    assert cleaned[1] == "ok", cleaned  # nothing of ours to clean, and nothing of another's touched
    assert receiver[1] == "LinkTimeout" and "no producer published" in receiver[2], receiver


def _frame_is_right(name: str, shape: tuple[int, ...]) -> None:
    """A new consumer of ``name`` (a live host_producer_forever) gets an intact frame of that producer."""
    with cudalink.Receiver(name, timeout=5.0) as rx, rx.recv(timeout=5.0) as frame:
        assert frame.numpy().tolist() == _content.pattern(frame.seq, shape, "uint8").tolist(), frame.seq


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="segments can be listed only where /dev/shm exists")
def test_a_link_named_like_a_live_links_segment_is_refused(spawned: Spawned, control: str) -> None:
    """A link named ``NAME-<generation>`` (or ``NAME-h<generation>``) has the header name of live link NAME's
    data segment (loopback header). Its Sender removed that segment as its own leftover and made its header
    there: a consumer that joined NAME afterwards read the look-alike's header bytes as NAME's frames (frame
    value 0 where 9 was sent), or, over the loopback channel, found NAME's header gone."""
    name = f"left-live-{os.getpid()}-{control}"
    spawned.ready(_procs.host_producer_forever, name, (64,), "uint8", forever=True)
    prefix = _platform.segment_name(name)
    suffixes = [seg[len(prefix) :] for seg in _platform.shm_segments(prefix + "-")]
    assert suffixes
    for suffix in suffixes:
        with pytest.raises(cudalink.LinkError, match=r"^cudalink: .*live link .*choose another link name"):
            cudalink.Sender(name + suffix, shape=(4,), dtype="uint8")
    other = "-" + "".join("0" if c != "0" else "1" for c in suffixes[0][-16:])  # not NAME's generation: no clash
    cudalink.Sender(name + other, shape=(4,), dtype="uint8").close()
    _frame_is_right(name, (64,))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="segments can be listed only where /dev/shm exists")
def test_a_restart_never_removes_a_live_look_alike_links_header(spawned: Spawned) -> None:
    """NAME's producer was killed; its header still names generation G when a link named NAME-G (allowed: NAME
    is dead) starts, with its header where NAME's data segment was. The next Sender of NAME (and ``clean``)
    removed that header as NAME's leftover: NAME-G, alive, could not be joined any more."""
    name = f"left-dead-{os.getpid()}"
    producer = spawned.ready(_procs.host_producer_forever, name, (4, 4), "uint8", forever=True)
    prefix = _platform.segment_name(name)
    (suffix,) = [seg[len(prefix) :] for seg in _platform.shm_segments(prefix + "-")]
    spawned.kill(producer)
    look_alike = name + suffix
    spawned.ready(_procs.host_producer_forever, look_alike, (8,), "uint8", forever=True)
    clean(only=[name])
    _frame_is_right(look_alike, (8,))
    with cudalink.Sender(name, shape=(2, 2), dtype="uint8"):
        _frame_is_right(look_alike, (8,))
