"""``python -m cudalink demo|info|monitor|bench`` on the CPU backend, as CI runs them (no GPU needed).

The commands run as real subprocesses, because what users see is exit codes, stdout and one-line
errors, and because demo and bench spawn their own children.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cudalink
from cudalink.cuda import devices
from cudalink.tools import demo, measure

from .conftest import DEFAULT, PairFactory, header_bytes

ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment, with this checkout first on the path, plus ``extra``."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = cli_env(COLUMNS="200")  # rich would otherwise wrap tables at 80 columns when piped
    return subprocess.run(
        [sys.executable, "-m", "cudalink", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("cudalink:"), proc.stderr


def gpu_usable() -> bool:
    try:
        devices.device(0)
    except Exception:
        return False
    return True


# -- demo ------------------------------------------------------------------------------------------


def test_demo_cpu_two_consumers_verify_every_frame() -> None:
    proc = run_cli("demo", "--device", "cpu", "--seconds", "3", "--consumers", "2", timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"frames received: (\d+), mismatches: (\d+), failed consumers: (\d+)", proc.stdout)
    assert m, proc.stdout
    received, mismatches, failed = map(int, m.groups())
    assert received > 0
    assert mismatches == 0
    assert failed == 0
    assert "OK: 2 consumer(s) verified" in proc.stdout
    assert len(re.findall(r"consumer \d \(pid \d+\): done", proc.stdout)) == 2


def test_demo_frames_limit() -> None:
    proc = run_cli(
        "demo",
        "--device",
        "cpu",
        "--frames",
        "20",
        "--consumers",
        "1",
        "--fps",
        "200",
        "--shape",
        "32,48,3",
        "--dtype",
        "float32",
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summary: 20 frames published" in proc.stdout
    assert "mismatches: 0" in proc.stdout


def test_demo_streams_bfloat16_whose_children_never_imported_ml_dtypes() -> None:
    """The demo's spawned producer and consumers made their pattern with np.dtype("bfloat16"), which numpy knows
    only once ml_dtypes is imported: both failed ("data type 'bfloat16' not understood") and nothing streamed."""
    args = ["--frames", "20", "--consumers", "1", "--fps", "200", "--shape", "16,24,4", "--dtype", "bfloat16"]
    proc = run_cli("demo", "--device", "cpu", *args, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summary: 20 frames published" in proc.stdout and "mismatches: 0" in proc.stdout, proc.stdout


def test_demo_bad_shape_is_one_line() -> None:
    assert_one_line_error(run_cli("demo", "--device", "cpu", "--shape", "0,12"))


@pytest.mark.skipif(gpu_usable(), reason="checks the no-GPU error path")
def test_explicit_gpu_without_gpu_is_one_line() -> None:
    proc = run_cli("demo", "--device", "cuda:0", "--seconds", "1")
    assert_one_line_error(proc)
    assert "--device cpu" in proc.stderr and "device='cpu'" not in proc.stderr  # the command line's words


def test_demo_pattern_checksums_are_exact() -> None:
    for dtype in ("uint8", "int8", "float16", "float32", "uint16", "bfloat16"):
        pat = demo.Pattern((5, 7, 3), dtype)
        src = pat.source()
        for k in (0, 1, 112, 113, 999):
            s = k % demo.PATTERN_PERIOD
            frame = src[s : s + pat.n]
            assert int(frame.view(np.uint8).sum(dtype=np.uint64)) == pat.checksum(k)
            assert np.array_equal(frame[pat.sample_idx], pat.expected(k))
        assert not np.array_equal(src[0 : pat.n][pat.sample_idx], pat.expected(1))  # a stale frame is caught


def _start_demo(name: str, *args: str) -> tuple[subprocess.Popen[str], int, list[int]]:
    """A CPU demo on link ``name``, streaming to one consumer: (its process, its producer's pid, its children)."""
    from cudalink.tools.monitor import read_snapshot

    cmd = [sys.executable, "-m", "cudalink", "demo", "--device", "cpu", "--name", name, "--consumers", "1", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(COLUMNS="200"), stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the demo never streamed"
        with contextlib.suppress(cudalink.LinkError):
            snap = read_snapshot(name)
            if snap.consumers and snap.fixed.published > 30:
                break
        time.sleep(0.1)
    return proc, snap.fixed.pid, [snap.fixed.pid, snap.consumers[0].pid]


def _running(pid: int) -> bool:
    """Alive and not a zombie (one whose parent is gone waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the children's state in /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_demo_stopped_by_a_signal_stops_its_children(sig: str) -> None:
    """Killed by SIGTERM (``timeout``, a service manager) or SIGHUP (a closed terminal), the demo's parent died
    where it stood and its producer and consumers ran on to the end of --seconds. It stops them as on Ctrl-C now,
    and exits with the status a shell gives that signal."""
    import signal

    signum = getattr(signal, sig)
    proc, _, children = _start_demo(f"clitest-demosig-{os.getpid()}-{sig}", "--seconds", "60", "--shape", "8,8,3")
    try:
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_running, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in children if _running(pid)]
    finally:
        proc.kill()
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"children still running after {sig}: {left}"
    assert proc.returncode == 128 + signum, (proc.returncode, out[-2000:])
    assert "OK: 1 consumer(s) verified" in out, out[-2000:]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILLs the demo's producer")
def test_demo_summary_after_its_producer_is_killed_counts_what_it_published() -> None:
    """The summary took the producer's count from its last report (every 0.25 s): "107 frames published"
    while each consumer had received 118. A crashed producer's count comes from the link's header now."""
    import signal

    from cudalink.transport.shm import clean

    name = f"clitest-demokill-{os.getpid()}"
    proc, producer, _ = _start_demo(name, "--seconds", "60", "--fps", "240", "--shape", "32,32,3")
    try:
        os.kill(producer, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        clean(only=[name])  # what the killed producer left
    assert proc.returncode == 1, out[-2000:]
    published = re.search(r"summary: ([\d,]+) frames published", out)
    received = re.search(r"consumer 0 \(pid \d+\): \w+, received ([\d,]+), skipped ([\d,]+)", out)
    assert published and received, out[-2000:]
    got, skipped = (int(v.replace(",", "")) for v in received.groups())
    assert int(published.group(1).replace(",", "")) >= got + skipped, out[-2000:]


def test_demo_summary_says_when_a_crashed_producer_count_is_lost() -> None:
    """Its header gone too, the most a consumer saw is a floor, and the summary says so."""
    from rich.console import Console

    cfg = demo.DemoConfig("d", (2, 2), "uint8", 4, -1, "numpy", 1, 1.0, None, 60.0)
    prod = demo._ProducerState(status="crashed", error="exit code -9", stats={"published": 10, "elapsed": 1.0})
    cons = [demo._ConsumerState(0, status="done", received=15, skipped=2)]
    demo._recount_crashed(prod, cons, f"nosuchlink-{os.getpid()}")
    console = Console(width=200, record=True)
    assert demo._demo_summary(console, cfg, "cpu", prod, cons) == 1
    text = console.export_text()
    assert "summary: at least 17 frames published" in text and "its own count was lost" in text, text


# -- info -------------------------------------------------------------------------------------------


def test_info_prints_a_verdict() -> None:
    proc = run_cli("info", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict:" in proc.stdout
    assert "cuda.core" in proc.stdout
    assert "shared memory" in proc.stdout
    if not gpu_usable():
        assert "no CUDA driver" in proc.stdout or "no GPU" in proc.stdout
        assert "CPU backend works" in proc.stdout


def test_info_lists_the_live_links_here(pair: PairFactory) -> None:
    """``monitor NAME`` of a missing link says "python -m cudalink info lists the links here": it listed none."""
    tx, rx = pair(DEFAULT, shape=(24, 32, 4), dtype="uint8", pixel_format="RGBA", device="cpu")
    with tx, rx:
        tx.send(np.zeros((24, 32, 4), np.uint8))
        proc = run_cli("info", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("│", " ").split())  # the table's cells, wrapped lines joined
    want = f"link {tx.name} 24x32x4 uint8 RGBA · cpu · 1 consumer(s) · producer pid {os.getpid()}"
    assert want in text and f"monitor {tx.name}" in text, text


def test_demo_rates_are_timed_on_the_counting_process_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The live producer line said 46.2 fps where the summary said 57.2: it timed the reports by when they
    reached the parent (behind a render and the consumers' reports), the summary by the producer's clock.
    Now both use the producer's: a steady stream reads the same rate in both, however late reports arrive."""
    state = demo._ProducerState()
    parent_clock = iter([0.0, 0.61, 0.93, 1.72, 1.9, 2.8, 3.05, 3.5, 4.4, 4.45])  # jittered arrivals
    monkeypatch.setattr(demo.time, "monotonic", lambda: next(parent_clock))
    rates = []
    for i in range(10):
        elapsed = 0.5 * (i + 1)  # the producer reports every 0.5 s of its own time, 60 frames a second
        demo._update_fps(state, int(60 * elapsed), elapsed)
        rates.append(state.fps)
    assert rates[1:] == [pytest.approx(60.0)] * 9, rates
    assert int(60 * elapsed) / elapsed == pytest.approx(state.fps)  # the summary's average: the same figure
    # once the producer is done, its line shows the summary's own figure, labelled as an average
    from rich.console import Console

    cfg = demo.DemoConfig("d", (2, 2), "uint8", 4, -1, "numpy", 1, 1.0, None, 60.0)
    state.stats, state.status = {"published": 171, "elapsed": 3.0}, "done"
    state.fps = demo._average_fps(state.stats)
    console = Console(width=200, record=True)
    console.print(demo._demo_view(cfg, "cpu", state, [], None))
    assert "57.0 fps on average" in console.export_text()


# -- monitor ----------------------------------------------------------------------------------------


def test_monitor_once_is_read_only(control: str) -> None:
    name = f"clitest-mon-{os.getpid()}-{control}"
    with cudalink.Sender(name, shape=(24, 32, 4), dtype="uint8", pixel_format="RGBA") as tx:
        for i in range(3):
            tx.send(np.full((24, 32, 4), i, np.uint8))
        before = header_bytes(name)
        proc = run_cli("monitor", name, "--once", "--interval", "0.1", timeout=60)
        after = header_bytes(name)
        assert tx.stats()["consumers"] == 0  # the monitor never connected
        assert after == before  # ... and wrote nothing: not even a counter moved
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"generation {tx.generation:016x}" in proc.stdout
    assert "seq 3" in proc.stdout
    assert "(24, 32, 4) uint8 RGBA" in proc.stdout
    assert "consumers (0 joined)" in proc.stdout


def test_monitor_shows_consumers_and_leases(pair: PairFactory) -> None:
    tx, rx = pair(DEFAULT, shape=(8, 8), dtype="float32", rx={"timeout": 5.0})  # recv() waits up to 5 s
    name = tx.name
    with tx, rx:
        tx.send(np.zeros((8, 8), np.float32))
        frame = rx.recv()  # held: its slot stays leased
        for _ in range(3):
            tx.send(np.ones((8, 8), np.float32))
        from cudalink.transport import wire

        before = header_bytes(name)
        layout = wire.read_fixed(before).layout
        proc = run_cli("monitor", name, "--once", "--interval", "0.1", timeout=60)
        after = header_bytes(name)
        assert after[layout.consumers : layout.size] == before[layout.consumers : layout.size]
        assert after[layout.leases : layout.fences] == before[layout.leases : layout.fences]
        assert tx.stats()["consumers"] == 1  # still only our Receiver
        seq = frame.seq
        frame.release()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "consumers (1 joined)" in proc.stdout
    assert str(os.getpid()) in proc.stdout
    assert re.search(rf"\d+:{seq} · 3 · ", proc.stdout), proc.stdout  # lease slot:seq, 3 frames behind


def test_monitor_piped_shows_the_spec_and_lease_ages(pair: PairFactory) -> None:
    """Issue 6: monitor shows "the generation, the spec, the consumers, fps, drops and lease ages". Piped (no
    terminal: a log, a test's capture) its per-sample line had the generation, fps, drops and a lease count,
    but neither the frame spec nor any lease's age."""
    tx, rx = pair(DEFAULT, shape=(8, 8, 4), dtype="float32", pixel_format="RGBA", rx={"timeout": 5.0})
    with tx, rx:
        tx.send(np.zeros((8, 8, 4), np.float32))
        frame = rx.recv()  # held: its slot stays leased
        for _ in range(2):
            tx.send(np.ones((8, 8, 4), np.float32))
        proc = run_cli("monitor", tx.name, "--seconds", "0.3", "--interval", "0.1", timeout=60)
        seq, gen = frame.seq, tx.generation
        frame.release()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines and all(f"gen {gen:016x}" in ln for ln in lines), proc.stdout
    last = lines[-1]
    assert "(8, 8, 4) float32 RGBA" in last, last  # the spec
    assert "dropped 0" in last and "consumers 1" in last, last
    assert re.search(rf"leases 1 \(\d+:{seq} · 2 · [\d.,]+ (µs|ms)\)", last), last  # slot:seq · behind · age


@pytest.mark.parametrize("how", ["recv", "poll"])
def test_monitor_counts_a_consumer_that_never_waits(pair: PairFactory, how: str) -> None:
    """A consumer slower than its producer always finds a frame waiting and never sleeps: the monitor must
    still see what it received (it was shown as 0 received, 'never')."""
    from cudalink.tools.monitor import read_snapshot

    tx, rx = pair(DEFAULT, shape=(4,), dtype="uint8", slots=8, rx={"latest": False})
    with tx, rx:
        for i in range(40):
            tx.send(np.full(4, i, np.uint8))  # always there before the consumer asks
            frame = rx.recv() if how == "recv" else rx.poll()
            assert frame is not None and frame.seq == i + 1
            frame.release()
        (consumer,) = read_snapshot(tx.name).consumers
        assert 32 <= consumer.received <= 40, consumer


def test_monitor_says_its_counts_are_as_the_consumer_last_reported_them(pair: PairFactory) -> None:
    """A consumer writes its counts into the header only when it waits, or every 8th frame: one that took 5 frames
    without waiting, holding the last, read "received 0, last recv never". The column is what it is now, the
    time of the consumer's last report, and a note under the table says how the counts lag."""
    from rich.console import Console

    from cudalink.tools.monitor import read_snapshot, render_snapshot

    tx, rx = pair(DEFAULT, shape=(4, 4), dtype="uint8", device="cpu")
    with tx, rx:
        for i in range(5):
            tx.send(np.zeros((4, 4), np.uint8))
            frame = rx.recv()  # there already: it never waits, so never reports
            if i < 4:
                frame.release()
        snap = read_snapshot(tx.name)
        frame.release()
    console = Console(width=250, record=True)
    console.print(render_snapshot(snap, None))
    text = console.export_text()
    row = next(ln for ln in text.splitlines() if f"│ {os.getpid()} │" in ln)
    assert "never" not in row and "not yet" in row, row
    assert "reported" in text and "counts as it last reported them" in text, text


def test_monitor_piped_prints_a_line_per_interval_and_exits_on_sigterm() -> None:
    """Without a terminal (a pipe, a log, ``timeout``) the live view printed nothing: now one plain line a
    sample, flushed, and SIGTERM ends it with status 0."""
    import queue
    import signal
    import threading
    import time

    name = f"clitest-monpipe-{os.getpid()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with cudalink.Sender(name, shape=(4, 4), dtype="uint8") as tx:
        tx.send(np.zeros((4, 4), np.uint8))
        proc = subprocess.Popen(
            [sys.executable, "-m", "cudalink", "monitor", name, "--interval", "0.1"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            got: queue.Queue[str] = queue.Queue()
            threading.Thread(target=lambda: [got.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            lines = [got.get(timeout=15) for _ in range(3)]  # each line arrives as it is sampled (flushed)
            tx.send(np.zeros((4, 4), np.uint8))
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
            err = proc.stderr.read() if proc.stderr is not None else ""
            time.sleep(0.1)
            rest = "".join(got.queue)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert all(name in ln and "published" in ln and "consumers 0" in ln for ln in lines), lines
    assert "fps n/a" in lines[0] and re.search(r"fps \d", lines[2]), lines  # a rate from the second sample on
    assert "published 2" in rest.splitlines()[-1], rest
    assert "Traceback" not in err


@pytest.mark.parametrize("columns", ["0", "00", "wide"])
def test_info_and_monitor_print_whatever_columns_says(columns: str) -> None:
    """``COLUMNS=0`` (what ``$(tput cols)`` gives without a terminal) made rich lay out zero columns: ``info`` and
    ``monitor --once`` printed nothing at all and exited 0."""
    name = f"clitest-cols-{os.getpid()}"
    env = cli_env(COLUMNS=columns)
    with cudalink.Sender(name, shape=(4, 4), dtype="uint8") as tx:
        tx.send(np.zeros((4, 4), np.uint8))
        for args, needle in ((["info"], "verdict:"), (["monitor", name, "--once", "--interval", "0.05"], "published")):
            proc = subprocess.run(
                [sys.executable, "-m", "cudalink", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
            )
            assert proc.returncode == 0, proc.stderr
            assert needle in proc.stdout, proc.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="closes the child's stdout through a POSIX shell")
@pytest.mark.parametrize("args", [["info"], ["monitor", "NAME", "--seconds", "0.3", "--interval", "0.1"]])
def test_a_closed_stdout_is_not_a_crash(args: list[str]) -> None:
    """Started with stdout closed (``>&-``, a daemon), Python's ``sys.stdout`` is None: every command that prints
    through rich failed with 'cudalink: AttributeError: 'NoneType' object has no attribute 'isatty''."""
    name = f"clitest-closed-{os.getpid()}"
    args = [name if a == "NAME" else a for a in args]
    env = cli_env()
    with cudalink.Sender(name, shape=(4, 4), dtype="uint8") as tx:
        tx.send(np.zeros((4, 4), np.uint8))
        proc = subprocess.run(
            ["sh", "-c", '"$0" -m cudalink "$@" >&-', sys.executable, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_monitor_piped_into_a_reader_that_stops_early_ends_quietly() -> None:
    """``monitor NAME | head -1``: the reader closed the pipe after one line, and monitor said
    'cudalink: BrokenPipeError: [Errno 32] Broken pipe' and exited 1. A reader that stops is a stop from
    outside, as SIGTERM is: quiet, status 0."""
    name = f"clitest-monhead-{os.getpid()}"
    env = cli_env()
    with cudalink.Sender(name, shape=(4, 4), dtype="uint8") as tx:
        tx.send(np.zeros((4, 4), np.uint8))
        proc = subprocess.Popen(
            [sys.executable, "-m", "cudalink", "monitor", name, "--interval", "0.05", "--seconds", "30"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            first = proc.stdout.readline()
            proc.stdout.close()  # what head -1 does after its line
            proc.wait(timeout=20)
            err = proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert name.encode() in first
    assert proc.returncode == 0, err
    assert err == ""


def test_monitor_missing_link_is_one_line() -> None:
    proc = run_cli("monitor", f"nosuchlink-{os.getpid()}", "--once")
    assert_one_line_error(proc)
    assert "no link named" in proc.stderr


@pytest.mark.parametrize("magic", [b"\0" * 8, b"NOTOURS!"], ids=["pending", "foreign"])
def test_monitor_tells_a_starting_producer_from_a_foreign_segment(magic: bytes) -> None:
    """A header whose magic is still zero is a producer mid-start (it writes the magic last): say so, and
    keep "not a cudalink segment" for a segment someone else wrote."""
    from multiprocessing import shared_memory

    from cudalink import _platform
    from cudalink.tools.monitor import read_snapshot

    name = f"starting-{os.getpid()}-{magic[0]}"
    seg = shared_memory.SharedMemory(name=_platform.segment_name(name), create=True, size=4096)
    try:
        seg.buf[:8] = magic
        with pytest.raises(cudalink.LinkError) as err:
            read_snapshot(name)
        if magic == b"\0" * 8:
            assert "is starting" in str(err.value) and not isinstance(err.value, cudalink.ProtocolError)
        else:
            assert isinstance(err.value, cudalink.ProtocolError) and "not a cudalink segment" in str(err.value)
    finally:
        seg.close()
        seg.unlink()


def test_monitor_of_a_link_nobody_publishes_says_so_once_and_fails_at_the_end() -> None:
    """It printed the same "no link named" line every interval (twice in one second) and exited 0."""
    name = f"nosuchlink-{os.getpid()}"
    t0 = time.monotonic()
    proc = run_cli("monitor", name, "--seconds", "1", "--interval", "0.1", timeout=30)
    assert time.monotonic() - t0 >= 1.0  # it kept watching until --seconds
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "no link named" in lines[0] and "waiting for a producer" in lines[0], proc.stdout
    assert_one_line_error(proc)
    assert f"no producer published {name!r} here within --seconds 1" in proc.stderr, proc.stderr


def test_monitor_prints_each_change_of_state_once() -> None:
    """Piped: a line a sample while the link is up, and each change to "cannot read it" once, not per sample."""
    from cudalink.tools import monitor

    name = "some-link"
    gone = cudalink.LinkError(f"cudalink: no link named {name!r} here")
    starting = cudalink.LinkError(f"cudalink: link {name!r} is starting")
    live = object()  # a snapshot, as far as the loop cares
    script: list[object] = [gone, gone, gone, starting, starting, live, live, gone, gone]
    looks = iter(script)

    def read(_name: str) -> object:
        got = next(looks, gone)  # then gone for good, however many looks the deadline leaves
        if isinstance(got, Exception):
            raise got
        return got

    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        seen = monitor._watch_plain(name, 0.001, time.monotonic() + 0.5, read, lambda s, p: "00:00:00 snapshot")
    lines = [ln.split(" ", 1)[1] for ln in out.getvalue().splitlines()]
    assert [ln.split(";")[0] for ln in lines] == [
        str(gone),
        str(starting),
        "snapshot",
        "snapshot",
        str(gone),
    ], lines
    assert seen  # it read the link once at least: the command exits 0

    def never(_name: str) -> object:
        raise gone

    from rich.console import Console

    quiet = Console(file=io.StringIO(), force_terminal=True)
    assert monitor._watch_live(name, 0.01, time.monotonic() + 0.05, quiet, never, lambda s, p: None) is False


def test_monitor_bad_name_is_one_line() -> None:
    assert_one_line_error(run_cli("monitor", "../etc", "--once"))


# -- bench ------------------------------------------------------------------------------------------

CPU_ROWS = ("handoff", "send_cost", "recv_export", "small_throughput", "fanout")


def test_bench_quick_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--quick", "--json", str(out), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vs peers" in proc.stdout and "wait modes" in proc.stdout
    report = json.loads(out.read_text())
    for key in ("cudalink_version", "backend", "quick", "rows", "wait_modes", "plan", "machine", "ratio"):
        assert key in report
    assert report["backend"] == "cpu" and report["quick"] is True
    rows = {(r["id"], r["peer_name"]): r for r in report["rows"]}
    for rid in CPU_ROWS:
        row = rows[(rid, "shm")]
        assert row["status"] == "ok", row
        for side in ("cudalink", "peer"):
            stats = row[side]
            assert isinstance(stats["p50"], float) and isinstance(stats["p99"], float), row
            assert stats["p99"] >= stats["p50"]
            assert stats["n"] > 0
        assert isinstance(row["ratio_p50"], float) and isinstance(row["ratio_p99"], float)
    for rid in ("handoff", "fanout"):
        assert rows[(rid, "shm")]["cudalink"]["p50"] > 0  # publish -> recv can never be negative
        assert "from_send_return" in rows[(rid, "shm")]
    # GPU rows are reported, never faked
    for key, row in rows.items():
        if key[1] in ("torch-mp", "core-pickle") or key[0].startswith(("copy_bw", "copy_burst")):
            assert row["status"] == "skipped" and row["reason"], row
            assert row["peer"] is None
    # the CPU goal's floor is paired: timed in the polling consumer itself, on alternate frames
    paired, own = report["extra"]["view_read_paired"], report["extra"]["recv_export_release"]
    assert paired["n"] > 0 and own["n"] > 0 and abs(paired["n"] - own["n"]) <= 2, (paired, own)
    assert 0 < paired["p50"] < own["p50"], (paired, own)  # a bare view costs less than cudalink's path
    goal = next(g for g in report["goals"] if g["goal"].startswith("poll + np.from_dlpack"))
    assert goal["reference"] == paired["p50"] and "same consumer" in goal["reference_label"], goal
    modes = {w["mode"]: w for w in report["wait_modes"]}
    assert set(modes) == {"spin", "hybrid", "block", "block_noahead", "async"}
    for w in modes.values():
        assert w["status"] == "ok", w
        assert isinstance(w["handoff"]["p50"], float) and isinstance(w["handoff"]["p99"], float)
        assert w["end_to_end"]["p50"] > 0  # send() entered -> recv returned: the same process's clock
        assert w["consumer_cpu_us"] > 0
    assert "wake_ahead=False" in modes["block_noahead"]["api"]
    # the sleeping modes' floor: a bare wake a beat after each of their frames, in the same two processes
    goals = {g["goal"]: g for g in report["goals"]}
    for mode, goal in (
        ("hybrid", "handoff p50, wait='hybrid', 2 ms cadence (woken ahead: no OS wake in this span)"),
        ("block", "handoff p50, wait='block', 2 ms cadence (woken ahead: no OS wake in this span)"),
        ("block_noahead", "handoff p50, wait='block', wake_ahead=False"),
    ):
        beat, handoff = modes[mode]["wake_paired"], modes[mode]["handoff"]
        assert beat["n"] >= 0.9 * handoff["n"] and beat["p50"] > 0, (mode, beat, handoff)
        assert goals[goal]["reference"] == beat["p50"], goals[goal]
        assert "same two processes" in goals[goal]["reference_label"], goals[goal]
    assert modes["spin"]["wake_paired"] is None and modes["async"]["wake_paired"] is None
    # the fan-out goal's one-consumer reference ran in turns with the fan-out runs, at their cadence
    single = report["extra"]["fanout_single"]
    plan = report["plan"]
    # every turn's frames after its warm-up, pooled: as many samples as the fan-out's consumers pool, so that
    # the two p99s are read alike (a p99 of 8x fewer samples is moved by a few hiccups of the machine)
    # (a frame it skipped on two busy cores, latest=True, is not a sample: more than k-1 times the frames)
    assert single["n"] > plan["fanout_frames"] * (plan["fanout_consumers"] - 1), single
    # every frame reaches every consumer or is counted as skipped by it: eight consumers on two busy cores
    # legitimately skip a few (latest=True), and none is lost without a count
    fanned, skipped = rows[("fanout", "shm")]["cudalink"]["n"], report["extra"]["fanout_skipped"]
    total = plan["fanout_frames"] * plan["fanout_consumers"]
    assert fanned + skipped >= total and fanned >= total // 2, (fanned, skipped, total)
    goal = next(g for g in report["goals"] if g["goal"].startswith("fan-out p99"))
    assert goal["reference"] == single["p99"] and "in turns with the fan-out" in goal["reference_label"], goal
    # the OS's own fan-out, in the same turns: as many bare processes, each woken once per frame
    bare = report["extra"]["fanout_floor"]
    assert bare["n"] >= total and bare["p99"] > 0, (bare, total)
    goal = next(g for g in report["goals"] if g["goal"] == "fan-out p99 vs the OS's own fan-out p99")
    assert goal["reference"] == bare["p99"] and goal["target"] == "<= 1.5x", goal


def test_bench_only_runs_the_parts_it_names(tmp_path: Path) -> None:
    """``--only``: the named parts run, the rest read "not selected" (not an error: the exit code is 0)."""
    from cudalink.tools.bench import NOT_SELECTED

    out = tmp_path / "only.json"
    proc = run_cli("bench", "--quick", "--only", "handoff", "--json", str(out), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {(r["id"], r["peer_name"]): r for r in report["rows"]}
    assert rows[("handoff", "shm")]["status"] == "ok" and rows[("send_cost", "shm")]["status"] == "ok"
    for rid in ("recv_export", "small_throughput", "fanout"):
        assert rows[(rid, "shm")]["status"] == "skipped" and rows[(rid, "shm")]["reason"] == NOT_SELECTED
    assert report["floors"] == NOT_SELECTED and report["breakdown"] == NOT_SELECTED
    assert all(w["status"] == "skipped" for w in report["wait_modes"])
    assert report["gpu_clock"]["status"] == "skipped"  # GPU only


def test_bench_only_refuses_an_unknown_part() -> None:
    proc = run_cli("bench", "--quick", "--only", "handof")
    assert_one_line_error(proc)
    assert "copy-send" in proc.stderr  # names the parts it takes


@pytest.mark.parametrize("only", ["", " , ,", ","])
def test_bench_only_refuses_an_empty_list_at_once(only: str) -> None:
    """``--only ""`` picked no part and ran the whole bench (killed under a timeout, it left segments behind)."""
    t0 = time.monotonic()
    proc = run_cli("bench", "--only", only, timeout=30)
    assert_one_line_error(proc)
    assert "--only takes a comma-separated list of" in proc.stderr and "gpu-clock" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("mode", ["--remote", "--multi-gpu"])
def test_bench_only_with_a_bench_of_its_own_rows_is_refused(mode: str) -> None:
    """``--remote --only floors`` ran the whole remote bench, ignoring --only without a word."""
    proc = run_cli("bench", mode, "--only", "floors", timeout=30)
    assert_one_line_error(proc)
    assert f"{mode} runs its own rows: drop --only" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--remote", "--breakdown"], "--remote runs its own rows; --breakdown would be ignored there"),
        (["--remote", "--frames", "50"], "--remote runs its own rows; --frames would be ignored there"),
        (["--remote", "--fanout", "4"], "--remote runs its own rows; --fanout would be ignored there"),
        (["--remote", "--no-wake-ahead"], "--remote runs its own rows; --no-wake-ahead would be ignored there"),
        (["--multi-gpu", "--breakdown"], "--multi-gpu runs its own rows; --breakdown would be ignored there"),
        (["--multi-gpu", "--fanout", "4"], "--multi-gpu runs its own rows; --fanout would be ignored there"),
        (["--remote", "--multi-gpu"], "run one at a time"),
        (["--breakdown", "--only", "handoff"], "--breakdown runs only the floors and the breakdown"),
        (["--breakdown", "--only", "floors,fanout"], "--only fanout would be ignored"),
        (["--breakdown", "--fanout", "4"], "--breakdown has no fan-out run: drop --fanout"),
        (["--only", "handoff", "--no-wake-ahead"], "--only leaves the breakdown out: add breakdown to it"),
    ],
)
def test_bench_flags_a_run_would_ignore_are_refused_at_once(args: list[str], needle: str) -> None:
    """``--remote --breakdown`` ran the remote rows and no breakdown, ``--breakdown --only handoff`` measured
    nothing at all and exited 0, ``--remote --multi-gpu`` ran the multi-GPU bench alone: each without a word."""
    t0 = time.monotonic()
    proc = run_cli("bench", "--quick", *args, timeout=30)
    assert_one_line_error(proc)
    assert needle in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 15


def test_bench_only_error_is_the_only_line_on_stderr() -> None:
    """``--only nosuch`` printed a blank line (the progress bar's teardown) and the backend note above it."""
    proc = run_cli("bench", "--only", "nosuch", timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.startswith("cudalink: --only takes") and proc.stderr.count("\n") == 1, repr(proc.stderr)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--device", "cpu"], "this run uses the CPU backend"),
        (["--quick"], "--quick runs on the CPU unless --device names a GPU"),
        (["--quick", "--device", "cpu"], "this run uses the CPU backend"),
        (["--remote"], "--remote has no GPU-clock rows"),
        (["--remote", "--device", "0"], "--remote has no GPU-clock rows"),
        (["--multi-gpu"], "--multi-gpu has no GPU-clock rows"),
        (["--device", "0", "--breakdown"], "--breakdown has no GPU-clock rows"),
        (["--device", "0", "--only", "floors,copy-send"], "--only leaves them out; add gpu-clock"),
    ],
)
def test_bench_mps_where_it_would_change_nothing_is_refused_at_once(args: list[str], needle: str) -> None:
    """``--mps`` only adds an MPS pass to the GPU-clock rows: with none to run it was accepted and ignored."""
    proc = run_cli("bench", *args, "--mps", timeout=30)
    assert_one_line_error(proc)
    assert "--mps runs the GPU-clock rows under the MPS daemon" in proc.stderr and needle in proc.stderr, proc.stderr


@pytest.mark.skipif(gpu_usable(), reason="checks the no-GPU fallback of --device auto")
def test_bench_mps_without_a_gpu_is_refused_at_once() -> None:
    proc = run_cli("bench", "--mps", timeout=30)
    assert_one_line_error(proc)
    assert "would use the CPU backend: no GPU" in proc.stderr, proc.stderr


def test_bench_bad_json_dir_is_one_line(tmp_path: Path) -> None:
    proc = run_cli("bench", "--quick", "--json", str(tmp_path / "missing" / "x.json"))
    assert_one_line_error(proc)


def test_bench_json_that_is_a_directory_is_refused_before_the_run(tmp_path: Path) -> None:
    """It was found only after the whole run, whose report was then lost."""
    proc = run_cli("bench", "--quick", "--json", str(tmp_path), timeout=30)
    assert_one_line_error(proc)
    assert "is a directory" in proc.stderr and "bench.json" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [["--frames", "0"], ["--frames", "-5"], ["--fanout", "0"], ["--fanout", "65"], ["--remote", "--frames", "0"]],
)
def test_bench_counts_it_cannot_use_are_refused_before_the_run(args: list[str]) -> None:
    """``--frames 0`` ran a full bench (raised to the warm-up plus ten, silently)."""
    proc = run_cli("bench", "--quick", *args, timeout=30)
    assert_one_line_error(proc)
    assert args[-2] in proc.stderr and "pass e.g." in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--interval", "0"], "--interval"),
        (["--interval", "nan"], "--interval"),
        (["--seconds", "-1"], "--seconds"),
        (["--seconds", "inf"], "--seconds"),
    ],
)
def test_monitor_bad_durations_are_one_line(args: list[str], needle: str) -> None:
    proc = run_cli("monitor", "some-link", *args, timeout=30)
    assert_one_line_error(proc)
    assert needle in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"), [(["--as", "bad/name"], "invalid link name"), (["--as", "ok", "--slots", "0"], "--slots")]
)
def test_relay_checks_its_arguments_before_waiting_for_a_frame(args: list[str], needle: str) -> None:
    """They were checked only when the first frame came: against an idle upstream, relay ran on silently."""
    proc = run_cli("relay", "no-such-upstream", *args, "--seconds", "20", timeout=30)
    assert_one_line_error(proc)
    assert needle in proc.stderr


@pytest.mark.parametrize("device", ["0", "cuda:0"])
def test_relay_takes_a_gpu_ordinal_as_its_help_says(device: str) -> None:
    """``--device 0`` (the help: "cpu | 0 | cuda:N") was refused: "device must be 'cpu', a CUDA ordinal like 0,
    or 'cuda:N'; got '0'". Without a GPU it is the missing GPU that is named; with one, the missing upstream."""
    proc = run_cli("relay", "no-such-upstream", "--as", "ok", "--device", device, "--seconds", "3", timeout=60)
    assert_one_line_error(proc)
    assert "device must be" not in proc.stderr, proc.stderr
    assert ("--device cpu" in proc.stderr) != gpu_usable(), proc.stderr


def test_serve_and_relay_help_say_what_the_readme_does() -> None:
    """``serve --help`` said nothing of the key both hosts need (README: the first serve writes
    ~/.config/cudalink/ucx.key, or set CUDALINK_KEY), ``relay --help`` neither its --device default nor the port
    a URL without one gets, nor that SIGTERM stops it too."""
    serve = run_cli("serve", "--help", timeout=30).stdout
    assert "ucx.key" in serve and "CUDALINK_KEY" in serve, serve
    relay = " ".join(run_cli("relay", "--help", timeout=30).stdout.split())
    assert "default cpu" in relay and "13337" in relay and "SIGTERM" in relay, relay


@pytest.mark.parametrize("seconds", ["-1", "0", "nan", "inf", "1e400"])
def test_relay_refuses_a_duration_it_cannot_run_for_at_once(seconds: str) -> None:
    """``--seconds -1`` waited 5 s for the upstream before anything was said."""
    t0 = time.monotonic()
    proc = run_cli("relay", "ucx://127.0.0.1:9/x", "--as", "ok", "--seconds", seconds, timeout=30)
    assert_one_line_error(proc)
    assert "--seconds must be a finite number of seconds more than 0" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 4.5


def _stub_bench(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], json_arg: str | None
) -> tuple[int, str, str]:
    """``cmd_bench`` with the measurements stubbed out: what it prints, and where."""
    import argparse

    from cudalink.tools import bench as bench_mod
    from cudalink.tools import report as report_mod

    fake = {"backend": "cpu", "floors": {}, "breakdown": None, "marker": "x" * 8, "rows": [], "wait_modes": []}

    class Bench:
        def __init__(self, **kw: object) -> None:
            pass

        def run(self) -> dict[str, object]:
            return fake

    monkeypatch.setattr(bench_mod, "Bench", Bench)
    args = argparse.Namespace(
        quick=True,
        device="cpu",
        json=json_arg,
        frames=None,
        fanout=8,
        breakdown=True,
        wake_ahead=True,
        only=None,
        mps=False,
    )
    code = report_mod.cmd_bench(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_prints_json_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``bench --quick`` used to print ~930 lines of JSON after its tables; now only ``--json PATH|-`` does."""
    _code, out, _err = _stub_bench(monkeypatch, capsys, None)
    assert "floors on cpu" in out and '"marker"' not in out and "{" not in out.splitlines()[-1]
    _code, out, err = _stub_bench(monkeypatch, capsys, "-")
    assert json.loads(out)["marker"] == "x" * 8  # stdout is the JSON alone, ready for a pipe
    assert "floors on cpu" in err
    path = tmp_path / "r.json"
    _code, out, _err = _stub_bench(monkeypatch, capsys, str(path))
    assert json.loads(path.read_text())["marker"] == "x" * 8 and '"marker"' not in out


@pytest.mark.parametrize("mode", ["--remote", "--multi-gpu"])
def test_bench_of_its_own_rows_refuses_a_json_path_it_cannot_write_at_once(mode: str, tmp_path: Path) -> None:
    """``--remote --json /missing/x.json`` ran the whole remote bench (half a minute) and then died with
    "cudalink: FileNotFoundError: ..."; the local bench refused it before the run."""
    t0 = time.monotonic()
    proc = run_cli("bench", mode, "--json", str(tmp_path / "missing" / "x.json"), timeout=60)
    assert_one_line_error(proc)
    assert "cannot write --json" in proc.stderr and "no directory" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("module", ["remote_bench", "multigpu_bench"])
def test_bench_of_its_own_rows_writes_json_to_stdout_for_a_dash(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--remote --json -`` (the help: "'-': stdout, and the tables go to stderr") wrote a file named "-" in
    the working directory and printed only the tables on stdout."""
    import argparse
    import importlib

    mod = importlib.import_module(f"cudalink.tools.{module}")
    fake = {"marker": "x" * 8, "nan": float("nan")}
    monkeypatch.setattr(mod, "run", lambda **kw: fake)
    monkeypatch.setattr(mod, "print_report", lambda r: print("the tables"))
    if module == "remote_bench":
        monkeypatch.setattr(mod.ucx_engine, "load", lambda: None)
        cmd = mod.cmd_remote_bench
    else:
        cmd = mod.cmd_multi_gpu
        fake["goals"] = {}
    monkeypatch.chdir(tmp_path)
    cmd(argparse.Namespace(device="cpu", quick=True, frames=None, json="-"))
    out, err = capsys.readouterr()
    assert not (tmp_path / "-").exists()
    got = json.loads(out, parse_constant=lambda c: pytest.fail(f"invalid JSON: {c}"))  # stdout: the JSON alone
    assert got["marker"] == "x" * 8 and got["nan"] is None
    assert "the tables" in err


def test_bench_json_never_holds_nan_or_infinity(tmp_path: Path) -> None:
    """``json.dumps`` writes float("nan") as ``NaN``, which no strict JSON reader takes (``copysend.peak_gbps``
    returns NaN when no copy could be timed); a figure that is not a number is written as null."""
    import io

    from rich.console import Console

    from cudalink.tools.report import write_json

    path = tmp_path / "r.json"
    report = {"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": -float("inf"), "e": 2}}
    write_json(report, str(path), Console(file=io.StringIO()))  # type: ignore[arg-type]
    got = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"invalid JSON: {c}"))
    assert got == {"a": None, "b": [1.5, None], "c": {"d": None, "e": 2}}


def test_summarize_percentiles() -> None:
    s = measure.summarize([1000, 2000, 3000, 4000])
    assert s is not None
    assert s["p50"] == pytest.approx(2.5) and s["n"] == 4
    assert measure.summarize([]) is None


def test_no_command_prints_help() -> None:
    proc = run_cli()
    assert proc.returncode == 2
    assert "demo" in proc.stdout and "bench" in proc.stdout


# -- cuda-link segments -------------------------------------------------------------------------------


def test_monitor_and_info_read_a_cuda_link_segment() -> None:
    """A cuda-link producer (written in the test) is described by ``monitor cuda-link:NAME`` and ``info``."""
    from cudalink.transport import cuda_link_wire as cw

    from ._cuda_link_fake import FakeProducer

    name = f"cudalink_ipc_TD>>Python_{os.getpid()}"
    p = FakeProducer(name, shape=(4, 6, 4), slots=2, flags=cw.FLAG_BGRA)
    try:
        for v in range(5):
            p.publish(v)
        proc = run_cli("monitor", "cuda-link:" + name, "--once", "--interval", "0.1", timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = " ".join(proc.stdout.split())
        assert f"cuda-link:{name}" in out and "v1.0+" in out and "version 1" in out
        assert "2 slots" in out and "5 frames published" in out and "BGRA8" in out
        assert "consumers: not recorded" in out
        proc = run_cli("info", timeout=60)
        assert f"cuda-link:{name}" in proc.stdout, proc.stdout
        proc = run_cli("info", "cuda-link:" + name, timeout=60)
        assert "5 frames published" in " ".join(proc.stdout.split())
        p.shutdown()
        proc = run_cli("monitor", "cuda-link:" + name, "--once", "--interval", "0.05", timeout=60)
        assert "closed (shutdown flag set)" in " ".join(proc.stdout.split())
    finally:
        p.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="info lists /dev/shm where it exists")
def test_info_passes_over_what_anyone_may_put_in_dev_shm() -> None:
    """/dev/shm is writable by every user: a FIFO there hung ``info`` (opened blocking, it waits for a writer),
    and a large sparse file that starts with cuda-link's magic was copied whole (2 GiB: 4 GiB of memory, 10 s)."""
    from cudalink.transport import cuda_link_wire as cw

    fifo = f"/dev/shm/cudalink_test_fifo_{os.getpid()}"
    big = f"cudalink_test_big_{os.getpid()}"
    os.mkfifo(fifo)
    try:
        with open(f"/dev/shm/{big}", "wb") as f:
            f.write(cw.MAGIC.to_bytes(4, "little"))
            f.truncate(1 << 30)
        proc = run_cli("info", timeout=60)
        assert f"cuda-link:{big}" in proc.stdout, proc.stdout + proc.stderr
        probe = (
            "import resource; from cudalink.tools import cuda_link_view as v\n"
            f"try: v.read_snapshot({big!r})\n"
            "except Exception as e: print(type(e).__name__)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
        )
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        error, rss_kib = out.stdout.split()
        assert error == "ProtocolError" and int(rss_kib) < 300 << 10, out.stdout + out.stderr
    finally:
        os.unlink(fifo)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{big}")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="a FIFO in /dev/shm")
def test_a_fifo_named_as_a_cuda_link_segment_is_refused_at_once_and_left_where_it_is() -> None:
    """Named outright, a FIFO hung ``info cuda-link:NAME`` and ``monitor`` (even with --seconds) in a blocking
    open; a Receiver's failed mapping of it unlinked it (``SharedMemory`` does that to a segment it cannot map,
    made by it or not). A name with markup in it ("[red]") was shown without it."""
    fifo = f"cudalink_test_fifo[red]{os.getpid()}"
    os.mkfifo(f"/dev/shm/{fifo}")
    try:
        for args in (("info", f"cuda-link:{fifo}"), ("monitor", f"cuda-link:{fifo}", "--once")):
            proc = run_cli(*args, timeout=30)
            said = " ".join((proc.stdout + proc.stderr).split())
            assert "not a shared-memory segment (a FIFO or device file)" in said, said
            assert f"cuda-link:{fifo}" in said or f"'{fifo}'" in said, said
        with pytest.raises(cudalink.LinkError, match="cannot open cuda-link segment"):
            cudalink.Receiver(f"cuda-link:{fifo}", timeout=0.3)
        assert os.path.lexists(f"/dev/shm/{fifo}"), "a reader unlinked what it could not map"
    finally:
        os.unlink(f"/dev/shm/{fifo}")


def test_monitor_missing_cuda_link_segment_is_one_line() -> None:
    proc = run_cli("monitor", f"cuda-link:nosuch_{os.getpid()}", "--once")
    assert_one_line_error(proc)
    assert "no cuda-link segment named" in proc.stderr


def test_monitor_corrupt_cuda_link_segment_is_one_line() -> None:
    import struct

    from cudalink.transport import cuda_link_wire as cw

    from ._cuda_link_fake import FakeProducer

    name = f"cudalink_bad_{os.getpid()}"
    p = FakeProducer(name, slots=2)
    try:
        struct.pack_into("<I", p.buf, 12, 11)
        proc = run_cli("monitor", "cuda-link:" + name, "--once")
        assert_one_line_error(proc)
        assert "11 slots" in proc.stderr
        assert cw.MAGIC  # (the magic is intact: the slot count is what is wrong)
    finally:
        p.close()


def test_monitor_of_a_name_that_can_never_be_valid_exits_at_once() -> None:
    """Without ``--once`` it waited for a producer that no such name can have, twice a second, forever."""
    proc = run_cli("monitor", "bad/name", timeout=20)
    assert_one_line_error(proc)
    assert "invalid link name" in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--slots", "0"], "--slots"),
        (["--name", "bad/name"], "invalid link name"),
        (["--frames", "0"], "--frames"),
        (["--seconds", "0"], "--seconds"),
        (["--fps", "-5"], "--fps"),
    ],
)
def test_demo_checks_every_flag_before_it_starts(args: list[str], needle: str) -> None:
    """They were found only after the live table had drawn (or never: --fps -5 ran flat out)."""
    proc = run_cli("demo", "--device", "cpu", *args, timeout=30)
    assert_one_line_error(proc)
    assert needle in proc.stderr and "consumers" not in proc.stdout


def test_clean_of_a_live_link_names_it(pair: PairFactory) -> None:
    tx, rx = pair(shape=(2,), dtype="uint8")
    with tx, rx:
        proc = run_cli("clean", tx.name, timeout=30)
    assert proc.returncode == 0 and f"nothing to clean for {tx.name!r}" in proc.stdout, proc.stdout


def test_info_of_a_cudalink_link_name_points_to_monitor() -> None:
    """``info NAME`` describes cuda-link segments; given a cudalink link's name it said only that no such
    segment is here."""
    with cudalink.Sender(f"info-{os.getpid()}", shape=(2,), dtype="uint8", device="cpu") as tx:
        proc = run_cli("info", tx.name, timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.replace("│", " ").split())  # the table's cells, wrapped lines joined
    assert "is a cudalink link" in text and f"monitor {tx.name}" in text, text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped raise, on purpose
def test_a_sigterm_whose_stop_is_dropped_on_its_way_still_stops_the_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM raises Stopped wherever the main thread stands. As an Exception it was swallowed by the
    library's ``except Exception`` cleanups, and the relay ran on (its test hung 1 run in 6): it is a
    BaseException now, and where it lands in a finalizer (which drops anything) the relay's loop still sees
    the stop at its next turn, as the monitor's does."""
    from cudalink.errors import LinkTimeout
    from cudalink.tools import relay as relay_mod
    from cudalink.tools import ui

    assert not issubclass(ui.Stopped, Exception)
    with pytest.raises(ui.Stopped), contextlib.suppress(Exception):
        ui._on_sigterm(15, None)
    turns = []

    class Dropper:
        def __del__(self) -> None:
            ui._on_sigterm(15, None)  # raised inside a finalizer: Python prints it and drops it

    class Rx:
        capacity = 64

        def __init__(self, *a: object, **k: object) -> None:
            pass

        def __enter__(self) -> Rx:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def recv(self, timeout: float) -> object:
            turns.append(timeout)
            assert len(turns) < 50, "the relay ran on after SIGTERM"
            if len(turns) == 2:
                Dropper()
            raise LinkTimeout("cudalink: nothing yet")

    monkeypatch.setattr(relay_mod, "Receiver", Rx)
    with ui.sigterm_stops():
        assert relay_mod.relay("ucx://127.0.0.1:1/up", "relaydown") == 0
        assert ui.stop_requested() and len(turns) == 2
    with ui.sigterm_stops():
        assert not ui.stop_requested()  # each command's stop is its own


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("relay", "ucx://127.0.0.1:1/x"), "the following arguments are required: --as"),
        (("relay", "ucx://127.0.0.1:1/x", "--as", "y", "--slots", "abc"), "argument --slots: invalid int value"),
        (("serve",), "the following arguments are required: name"),
        (("bogus",), "invalid choice: 'bogus'"),
    ],
)
def test_a_usage_error_is_a_cudalink_line_that_points_at_help(args: tuple[str, ...], said: str) -> None:
    """argparse said ``python -m cudalink relay: error: ...``: the one kind of bad input whose message did not start
    with ``cudalink:`` as every other error's does."""
    proc = run_cli(*args)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cudalink: python -m cudalink") and said in last and last.endswith("--help"), proc.stderr
    assert "Traceback" not in proc.stderr
