"""Nothing left at the edges: a Sender never closed is closed at exit, a clean close removes everything it
made (the lock file too), and what a killed producer leaves is recognised as dead at once: by the next
Sender, by a Receiver (which says so instead of waiting out its timeout) and by ``cudalink clean``."""

from __future__ import annotations

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

from . import _procs
from .conftest import Spawned

ROOT = Path(__file__).resolve().parents[1]


def nothing_left(name: str) -> bool:
    files, segments = leftovers(name)
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


def test_the_exit_registry_holds_senders_weakly_and_forgets_closed_ones() -> None:
    from cudalink import link

    tx = cudalink.Sender(f"left-weak-{os.getpid()}", shape=(4, 4), dtype="uint8")
    assert isinstance(link._open_senders, weakref.WeakSet) and tx in link._open_senders
    tx.close()
    assert tx not in link._open_senders
    assert nothing_left(tx.name)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
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
        "import numpy as np, cudalink\n"
        f"tx = cudalink.Sender({name!r}, shape=(64, 64, 4), dtype='uint8', device=0)\n"
        "tx.send(np.zeros((64, 64, 4), np.uint8))\n"
        "keep = [tx]  # still alive at exit\n"
        "print('sent', flush=True)\n"
    )
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0 and "sent" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert nothing_left(name), leftovers(name)
