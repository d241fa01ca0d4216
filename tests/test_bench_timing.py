"""The bench's timing rules, checked on the CPU with fakes: both sides of a comparison timed alike.

Copy-send once compared ``send()`` timed by the CPU clock and a sync of the link's stream with a framework
copy + device sync; with no ``stream=`` the send's copy ran on another stream, after the clock stopped, and
the bench reported 154% of a plain copy. These fakes model CUDA streams on a virtual clock: work queued on
a stream runs after the work before it there, and a timer reads only the stream it is given.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from cudalink.tools import copysend, gpuclock
from cudalink.tools.bench import NOT_SELECTED, goals

COPY_NS = 40_000  # the fake copy's GPU time
CURRENT = 0  # the stream a fake framework copies on when it is given none (torch's current stream)


class FakeGpu:
    """Streams on a virtual clock. The CPU's time moves 1 µs per call; the GPU's work queues per stream."""

    def __init__(self) -> None:
        self.now = 0
        self.tail: dict[int, int] = defaultdict(int)
        self._t0 = 0

    def cpu(self) -> None:
        self.now += 1_000

    def queue(self, stream: int, ns: int) -> None:
        self.cpu()  # the call returns at once: the work runs later, after what the stream already holds
        self.tail[stream] = max(self.tail[stream], self.now) + ns

    # StreamTimer
    def start(self, stream: int) -> None:
        self.cpu()
        self._t0 = max(self.tail[stream], self.now)

    def stop(self, stream: int) -> int:
        self.cpu()
        end = max(self.tail[stream], self.now)
        self.now = end  # the event's sync: the CPU waits for this stream only
        return end - self._t0


class FakeSender:
    """Copies on the stream it is given, else on the framework's current stream, as ``Sender.send`` does with
    a torch tensor; returns before the copy has run."""

    def __init__(self, gpu: FakeGpu, ignore_stream: bool = False) -> None:
        self.gpu = gpu
        self.ignore_stream = ignore_stream

    def send(self, array: object, *, stream: object = None) -> int | None:
        on = CURRENT if stream is None or self.ignore_stream else stream
        assert isinstance(on, int)
        self.gpu.queue(on, COPY_NS)
        return 1


def _share(gpu: FakeGpu, tx: FakeSender) -> float:
    stream = 7
    ours, bare, extra = copysend.paired(tx, object(), lambda s: gpu.queue(s, COPY_NS), stream, stream, gpu, iters=20)
    assert len(ours) == len(bare) == 20 and extra == []
    return float(np.median(bare) / max(np.median(ours), 1))


def test_copy_send_times_both_sides_on_the_stream_the_copy_runs_on() -> None:
    """The same copy on both sides reads as the same time: a share of 100%, never more."""
    gpu = FakeGpu()
    share = _share(gpu, FakeSender(gpu))
    assert 0.95 <= share <= 1.0 + 1e-9, share


def test_the_fake_catches_a_send_timed_on_another_stream() -> None:
    """The check above can fail: a send whose copy goes to another stream than the timed one (what the
    old bench did with no ``stream=``) comes out far faster than the bare copy of the same bytes."""
    gpu = FakeGpu()
    share = _share(gpu, FakeSender(gpu, ignore_stream=True))
    assert share > 1.5, share


def test_copy_send_goal_is_95_percent_of_the_bare_copy() -> None:
    def row(mid: str, ours: float, bare: float) -> dict[str, object]:
        return {
            "id": mid,
            "peer_name": "d2d",
            "status": "ok",
            "cudalink": {"p50": ours, "p99": ours, "mean": ours, "n": 10.0},
            "peer": {"p50": bare, "p99": bare, "mean": bare, "n": 10.0},
        }

    rows = [row("copy_bw_1080p_f32", 100.0, 96.0), row("copy_bw_4k_f32", 100.0, 94.0)]
    rows += [row("copy_burst_1080p_f32", 100.0, 93.0), row("copy_burst_4k_f32", 100.0, 99.0)]
    report = {"rows": rows, "wait_modes": [], "floors": {}}
    got = {g["goal"]: g for g in goals(report, None, {}, True, None)}  # type: ignore[arg-type]
    hd = got["copy-send 1080p_f32 as a share of the bare copy (higher is better)"]
    k4 = got["copy-send 4k_f32 as a share of the bare copy (higher is better)"]
    assert hd["met"] is True and hd["cudalink"] == pytest.approx(0.96)
    assert k4["met"] is False and k4["target"] == ">= 95%"
    # back to back, until every ready event fired: read from their own rows
    burst = {k: v for k, v in got.items() if k.startswith("copy-send") and "back to back" in k}
    assert len(burst) == 2, got.keys()
    hd_b = next(v for k, v in burst.items() if "1080p" in k)
    k4_b = next(v for k, v in burst.items() if "4k" in k)
    assert hd_b["met"] is False and hd_b["cudalink"] == pytest.approx(0.93)
    assert k4_b["met"] is True and k4_b["cudalink"] == pytest.approx(0.99)


def _series(us: float, n: int = 50) -> gpuclock.Series:
    return {"ns": [int(us * 1e3)] * n, "unordered": 0, "frames": n, "late": 0}


def test_gpu_clock_goal_is_the_floor_plus_20_us_per_pass() -> None:
    """The pipelined handoff against the in-process floor of the same pass and the same cadence; a skipped MPS
    pass is no goal."""
    setup: gpuclock.Setup = {
        "status": "ok",
        "reason": "",
        "series": {
            "floor_ahead": _series(8.0),
            "floor_60fps_ahead": _series(12.0),
            "send_2ms_ahead": _series(20.0),
            "send_60fps_ahead": _series(40.0),
        },
        "notes": {},
    }
    clock: gpuclock.GpuClock = {
        "status": "ok",
        "reason": "",
        "labels": dict(gpuclock.CASES),
        "setups": {"no MPS": setup, "MPS": {"status": "skipped", "reason": "no daemon", "series": {}, "notes": {}}},
    }
    rows = [g for g in goals({"rows": [], "wait_modes": [], "floors": {}}, None, {}, True, clock) if "GPU" in g["goal"]]
    assert len(rows) == 2 and all("(no MPS)" in g["goal"] for g in rows), rows
    two_ms, sixty = rows
    assert two_ms["met"] is True and two_ms["reference"] == pytest.approx(8.0)
    assert sixty["met"] is False and sixty["target"] == "<= floor + 20 us"
    assert sixty["reference"] == pytest.approx(12.0)  # the 60 fps floor, not the 2 ms one


def test_gpu_clock_counts_a_consumer_that_read_another_frame_as_unordered() -> None:
    """A consumer kernel that read a stamp other than the one the producer logged for that frame ran before
    the frame was in place: it is counted, never timed."""
    log = np.array([1_000, 2_000, 3_000], np.uint64)
    got = np.array([1_500, 1_000, 2_100, 1_000, 3_010, 3_000], np.uint64)  # (start, stamp read) per sample
    ns, bad = gpuclock._handoffs(got, [0, 1, 2], log)
    assert ns == [500, 10] and bad == 1


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas (CUDA toolkit) here")
def test_gpu_clock_ptx_assembles(tmp_path: Path) -> None:
    """The stamp kernels are PTX the driver JIT-compiles; ptxas checks the same text where a toolkit exists."""
    src = tmp_path / "stamp.ptx"
    src.write_text(gpuclock.PTX)
    proc = subprocess.run(
        ["ptxas", "-arch=sm_90", str(src), "-o", str(tmp_path / "stamp.cubin")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_not_selected_is_a_known_marker() -> None:
    from cudalink.tools import report

    assert report._NOT_SELECTED == NOT_SELECTED


def test_gpu_clock_table_renders_every_pass() -> None:
    """The GPU-only table, fed a made-up pass of each status, prints (it runs only on GPU machines)."""
    from rich.console import Console

    from cudalink.tools import report

    ok: gpuclock.Setup = {
        "status": "ok",
        "reason": "",
        "series": {key: _series(10.0 + i) for i, (key, _) in enumerate(gpuclock.CASES)},
        "notes": {"torchmp": "torch is not installed"},
    }
    ok["series"]["send_2ms_ahead"]["unordered"] = 2
    clock: gpuclock.GpuClock = {
        "status": "ok",
        "reason": "",
        "labels": dict(gpuclock.CASES),
        "setups": {"no MPS": ok, "MPS": {"status": "error", "reason": "boom", "series": {}, "notes": {}}},
    }
    fake = {"gpu_clock": clock, "goals": goals({"rows": [], "wait_modes": [], "floors": {}}, None, {}, True, clock)}
    table = report._gpu_clock_table(fake)  # type: ignore[arg-type]
    assert table is not None
    console = Console(width=200, record=True)
    console.print(table)
    console.print(report._goals_table(fake))  # type: ignore[arg-type]
    text = console.export_text()
    assert "in-process floor" in text and "boom" in text and "torch is not installed" in text
    assert "GPU handoff p50" in text and "(MPS)" in text
    assert report.gpu_clock_errors(fake) == []  # type: ignore[arg-type]  # an MPS failure fails no bench


def test_end_to_end_goal_is_judged_against_the_larger_of_its_two_floors() -> None:
    """Issue 35's end-to-end goal: send() entered -> recv() returned, wait='block', <= 1.5x the larger of the
    driver calls a send makes (timed between the sends) and the bare wake in the same two processes."""

    def s(us: float) -> dict[str, float]:
        return {"p50": us, "p99": us, "mean": us, "n": 100.0}

    waits = [
        {"mode": "block", "handoff": s(10.0), "end_to_end": s(75.0), "wake_paired": s(44.5)},
        {"mode": "block_noahead", "handoff": s(60.0), "end_to_end": s(140.0), "wake_paired": s(45.0)},
    ]
    report = {"rows": [], "wait_modes": waits, "floors": {"memcpy_record": s(40.0)}}
    got = goals(report, None, {"send_floor_paired": s(51.6)}, True, None)  # type: ignore[arg-type]
    row = next(g for g in got if "vs the larger floor" in g["goal"])
    assert row["reference"] == pytest.approx(51.6) and row["met"] is True  # 75 <= 1.5 * 51.6
    assert not [g for g in got if "CUDA graph entered" in g["goal"]]  # no graph run: no row for it
    waits[0]["end_to_end"] = s(127.0)  # the figure issue 35 opened with
    got = goals(report, None, {"send_floor_paired": s(51.6)}, True, None)  # type: ignore[arg-type]
    assert next(g for g in got if "vs the larger floor" in g["goal"])["met"] is False


def test_the_fan_out_goal_against_the_os_says_its_two_spans_are_not_alike() -> None:
    """The fan-out's consumers sleep (wait='hybrid', 4 ms cadence) with wake_ahead=True, so its publish ->
    recv() span holds no OS wake, while the bare fan-out it is judged against is nothing but the OS wake of
    as many processes. The sleeping handoff goals say so ("woken ahead: no OS wake in this span"); this one
    said nothing, and read as an alike comparison."""

    def s(us: float) -> dict[str, float]:
        return {"p50": us, "p99": us, "mean": us, "n": 100.0}

    row = {"id": "fanout", "peer_name": "shm", "status": "ok", "cudalink": s(300.0), "peer": s(250.0)}
    report = {"rows": [row], "wait_modes": [], "floors": {}}
    extra = {"fanout_single": s(100.0), "fanout_floor": s(240.0)}
    got = goals(report, None, extra, False, None)  # type: ignore[arg-type]
    goal = next(g for g in got if g["goal"] == "fan-out p99 vs the OS's own fan-out p99")
    assert goal["cudalink"] == 300.0 and goal["reference"] == 240.0 and goal["ratio"] == pytest.approx(1.25)
    assert goal["target"] == "<= 1.5x" and goal["met"] is True  # the threshold is unchanged
    label = goal["reference_label"]
    assert "in turns with the fan-out" in label and "woken ahead" in label and "no OS wake" in label, label


@pytest.mark.parametrize("interval", [0.002, 1 / 60, 1 / 30])
def test_the_ahead_spin_outlasts_a_slow_consumer_yet_ends_before_the_next_frame(interval: float) -> None:
    """The pipelined case's producer kernel: 500 µs at the 2 ms cadence, longer at 60 fps (where a consumer
    that slept a whole period takes longer than 500 µs to launch), always well inside the period."""
    spin = gpuclock.ahead_spin_ns(interval)
    assert spin >= gpuclock.AHEAD_SPIN_NS
    assert spin <= interval * 1e9 / 4
    if interval > 0.01:
        assert spin >= 2_000_000


def test_copy_send_times_a_third_side_in_the_same_rounds() -> None:
    """The bare copy + the event record (what send() queues) is timed alongside, on the same stream: a send
    that queues just that reads as 100% of it and less than 100% of the bare copy."""
    gpu = FakeGpu()
    event_ns = 3_000

    class EventSender(FakeSender):
        def send(self, array: object, *, stream: object = None) -> int | None:
            assert isinstance(stream, int)
            self.gpu.queue(stream, COPY_NS)
            self.gpu.queue(stream, event_ns)
            return 1

    def bare_event(s: int) -> None:
        gpu.queue(s, COPY_NS)
        gpu.queue(s, event_ns)

    ours, bare, evented = copysend.paired(
        EventSender(gpu), object(), lambda s: gpu.queue(s, COPY_NS), 7, 7, gpu, iters=20, extra=bare_event
    )
    assert len(ours) == len(bare) == len(evented) == 20
    assert np.median(evented) / np.median(ours) == pytest.approx(1.0, abs=0.03)
    assert np.median(bare) / np.median(ours) < 0.95


def test_bursts_count_work_left_off_the_stream_once_and_work_on_it_every_time() -> None:
    """``copysend.bursts``: a send that records its 3 µs ready event on a side stream (after the copy) and
    one that records it on the timed stream. One at a time the side-stream send hides its record (the
    timer reads only its stream); back to back, ending when the side stream is done, the record is paid
    once per burst, while the on-stream record is paid by every frame."""
    gpu = FakeGpu()
    event_ns, side = 3_000, 99

    def wait(target: int, source: int) -> None:  # cuStreamWaitEvent: target runs after source's work so far
        gpu.cpu()
        gpu.tail[target] = max(gpu.tail[target], gpu.tail[source])

    def off_stream(s: int) -> None:
        gpu.queue(s, COPY_NS)
        wait(side, s)
        gpu.queue(side, event_ns)

    def on_stream(s: int) -> None:
        gpu.queue(s, COPY_NS)
        gpu.queue(s, event_ns)

    off: list[int] = []
    on: list[int] = []
    bare: list[int] = []
    copysend.bursts(
        [
            (off_stream, lambda s: wait(s, side), off),
            (on_stream, None, on),
            (lambda s: gpu.queue(s, COPY_NS), None, bare),
        ],
        7,
        gpu,
        copysend.BURST,
        iters=6,
    )
    assert len(off) == len(on) == len(bare) == 6
    n = copysend.BURST
    assert np.median(bare) == pytest.approx(COPY_NS, rel=0.01)
    assert np.median(on) == pytest.approx(COPY_NS + event_ns, rel=0.01)
    assert np.median(off) == pytest.approx(COPY_NS + event_ns / n, rel=0.01)
