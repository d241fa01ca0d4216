"""Test-pattern producer and small helpers shared by the examples and notebooks.

It lives in its own importable module because ``multiprocessing`` spawn (the only start method that is
safe once CUDA is initialised) re-imports the child's target by name: a function typed into a notebook
cannot be found by the child. Every frame carries ``meta = (k, checksum)`` so a consumer can prove it got
the bytes that were sent, whichever frames it skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import os
import signal
import statistics
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np

import cudalink

META = struct.Struct("<II")  # pattern index k, byte sum mod 2**32
SKIP = 2  # exit code of an example whose GPU or framework is missing


# -- the test pattern ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _grid(shape: tuple[int, ...]) -> np.ndarray:
    h, w, c = shape
    yy, xx = np.mgrid[0:h, 0:w].astype(np.int32)
    return np.stack([xx, yy, xx + yy, xx - yy], axis=-1)[..., :c]


def pattern(k: int, shape: tuple[int, ...] = (240, 320, 3)) -> np.ndarray:
    """Frame ``k`` (HxWxC uint8, C <= 4): colour gradients that scroll with ``k``, so a live view moves."""
    shift = np.array([3 * k, 2 * k, -5 * k, k])[: shape[2]]
    return ((_grid(tuple(shape)) + shift) % 256).astype(np.uint8)


def checksum(host: np.ndarray) -> int:
    return int(host.sum(dtype=np.uint64)) & 0xFFFFFFFF


def frame_ok(frame: cudalink.Frame) -> bool:
    """Check a frame against its meta on the host (``to_numpy`` copies a CUDA frame: fine for a check)."""
    _, want = META.unpack(frame.meta)
    return checksum(frame.to_numpy() if frame.is_cuda else frame.numpy()) == want


# -- producing ---------------------------------------------------------------------------------------------


def to_device(host: np.ndarray, device: int) -> Any:
    """A GPU copy of ``host`` through whichever framework is installed; None if there is none."""
    try:
        import torch

        return torch.from_numpy(host).to(f"cuda:{device}")
    except ImportError:
        pass
    try:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.asarray(host)
    except ImportError:
        return None


def publish(tx: cudalink.Sender, host: np.ndarray, meta: bytes) -> None:
    """Send ``host`` on a CPU or CUDA link. With no GPU framework, copy straight into a reserved slot."""
    if tx.device == "cpu":
        tx.send(host, meta=meta)
        return
    arr = to_device(host, int(tx.device.split(":")[1]))
    if arr is not None:
        tx.send(arr, meta=meta)
        return
    from cuda.bindings import driver

    with tx.reserve(stream=tx.stream, meta=meta) as slot:  # tx.stream first waits for readers of the slot
        (err,) = driver.cuMemcpyHtoDAsync(slot.ptr, host.ctypes.data, host.nbytes, tx.stream.handle)
        if int(err):
            raise RuntimeError(f"cuMemcpyHtoDAsync failed: {err}")


def wait_for_consumers(tx: cudalink.Sender, n: int, timeout: float) -> None:
    """Frames sent before anyone attached reach nobody; an example wants to account for every one."""
    deadline = time.monotonic() + timeout
    while tx.stats()["consumers"] < n:
        if time.monotonic() > deadline:
            got = tx.stats()["consumers"]
            raise cudalink.LinkTimeout(f"cudalink: {got} of {n} consumers attached to {tx.name!r} within {timeout:g}s")
        time.sleep(0.005)


def produce(
    name: str,
    device: str | int = "cpu",
    frames: int = 100,
    fps: float = 60.0,
    shape: tuple[int, ...] = (240, 320, 3),
    consumers: int = 1,
    policy: str = "block",
    wait: float = 30.0,
    stop: Any = None,
    max_seconds: float = 600.0,
) -> None:
    """Publish ``frames`` test frames (0 = until ``stop`` is set) at ``fps`` (0 = flat out).

    ``policy="block"`` (examples) never drops, so a consumer that keeps up sees seq 1..frames; the
    notebooks use ``"drop"`` so a person pausing between cells never stalls it. It also stops when its
    parent process dies, so a killed kernel leaves no orphan behind.
    """
    fmt = {1: "GRAY", 3: "RGB", 4: "RGBA"}[shape[2]]
    if threading.current_thread() is threading.main_thread():
        # An exiting parent terminate()s daemon children: unwind, so the Sender closes and frees its memory.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = mp.parent_process()
    t_end = time.monotonic() + max_seconds
    with cudalink.Sender(name, shape=shape, device=device, pixel_format=fmt, policy=policy) as tx:
        wait_for_consumers(tx, consumers, wait)
        period = 1.0 / fps if fps > 0 else 0.0
        tick = time.monotonic()
        k = 0
        while (frames == 0 or k < frames) and time.monotonic() < t_end:
            if (stop is not None and stop.is_set()) or (parent is not None and not parent.is_alive()):
                break
            host = pattern(k, shape)
            publish(tx, host, META.pack(k, checksum(host)))
            k += 1
            tick += period
            time.sleep(max(0.0, tick - time.monotonic()))


def start(name: str, **kwargs: Any) -> tuple[Any, Any]:
    """Run :func:`produce` in a spawned daemon process (for notebooks); returns ``(process, stop_event)``.

    The device is tried here first: a child that cannot make its Sender dies with the reason in the kernel's
    log, and the notebook's Receiver would only say, after its timeout, that no producer came."""
    check_device(kwargs.get("device", "cpu"))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=produce, args=(name,), kwargs={**kwargs, "stop": stop}, daemon=True)
    proc.start()
    return proc, stop


# -- what every example shares ------------------------------------------------------------------------------


def skip(who: str, why: str) -> None:
    """The one-line, exit-code-2 answer of an example that cannot run here."""
    print(f"{who}: SKIP {why}", flush=True)
    sys.exit(SKIP)


def missing(who: str, why: str) -> NoReturn:
    """The one-line, exit-code-2 answer to a wrong flag or a missing other side, on stderr as argparse's own."""
    print(f"{who}: {why}", file=sys.stderr, flush=True)
    sys.exit(SKIP)


@contextlib.contextmanager
def other_side(args: argparse.Namespace) -> Iterator[None]:
    """With ``--role`` the other side runs in another terminal, and may not come within ``--wait``: that is one
    line and exit code 2, as anything missing is (the README's promise), not a LinkTimeout traceback. With
    ``--role both`` the other side is our own child: its failing to come is a failure, and raises."""
    try:
        yield
    except cudalink.LinkTimeout as exc:
        if args.role == "both":
            raise
        other = "consumer" if args.role == "producer" else "producer"
        why = str(exc).removeprefix("cudalink: ").replace("; start the Sender first, or pass a longer timeout", "")
        missing(
            args.who,
            f"{why}; start the {other} side (python examples/{args.who}.py --role {other} --name {args.name}), "
            "or wait longer with --wait SECONDS",
        )


def torch_cuda_problem(torch: Any) -> str | None:
    """Why this torch cannot reach a GPU, told apart: a CPU-only build, or a CUDA build with no driver or GPU."""
    built = getattr(torch.version, "cuda", None)
    if not built:
        return "this torch build has no CUDA (a CPU-only wheel); install a CUDA build of torch, or use --device cpu"
    if not torch.cuda.is_available():
        return (
            f"this torch is a CUDA {built} build but finds no usable GPU (no NVIDIA driver, or no device visible: "
            "check nvidia-smi and CUDA_VISIBLE_DEVICES); or use --device cpu"
        )
    return None


def check_device(device: str | int, who: str = "demo") -> None:
    """Raise (:class:`cudalink.CudaUnavailable`, ...) when ``device`` cannot carry a link on this machine."""
    if device != "cpu":  # a throwaway Sender is the honest test: it needs the driver, the GPU and IPC memory pools
        cudalink.Sender(f"{who}-probe-{os.getpid()}", shape=(1,), device=device).close()


def require_device(device: str | int, who: str) -> None:
    """Skip (exit 2) when ``device`` cannot carry a link on this machine."""
    try:
        check_device(device, who)
    except cudalink.CudaUnavailable as exc:
        skip(who, f"needs a CUDA GPU for --device {device}: {exc}")


def device_label(device: str | int) -> str:
    return "cpu" if device == "cpu" else f"cuda:{device}"


def parse_device(text: str) -> str | int:
    """``--device`` value: ``cpu`` or a CUDA ordinal (``0`` or ``cuda:0``)."""
    return "cpu" if text == "cpu" else int(text.removeprefix("cuda:"))


def example_args(who: str, doc: str | None, device: str = "cpu") -> argparse.ArgumentParser:
    """The flags every example shares; ``--role`` splits producer and consumer over two terminals."""
    p = argparse.ArgumentParser(prog=who, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--device", default=device, type=parse_device, help="cpu or a CUDA ordinal (default %(default)s)")
    add("--frames", type=int, default=100, help="frames to send (default %(default)s)")
    add("--fps", type=float, default=120.0, help="producer rate, 0 = flat out (default %(default)s)")
    add("--size", default="240x320", help="frame HEIGHTxWIDTH (default %(default)s)")
    roles = ("both", "producer", "consumer")
    add("--role", choices=roles, default="both", help="both: spawn the producer (default); else run one side")
    add("--name", help="link name (default: unique per run; give both sides the same with --role)")
    add("--wait", type=float, default=30.0, help="seconds to wait for the other side, and for each frame (default 30)")
    return p


def finish_args(args: argparse.Namespace, who: str) -> argparse.Namespace:
    """The flags checked before any process starts: a bad one is one line and exit 2, as argparse's own."""
    args.who = who  # for other_side()
    hw = args.size.lower().split("x")
    if len(hw) != 2 or not all(v.isdigit() and int(v) > 0 for v in hw):
        missing(who, f"--size must be HEIGHTxWIDTH in pixels, e.g. 240x320; got {args.size!r}")
    args.shape = (int(hw[0]), int(hw[1]), 3)
    if args.frames < 1:
        missing(who, f"--frames must be at least 1; got {args.frames}")
    if not args.fps >= 0:
        missing(who, f"--fps must be 0 (flat out) or more; got {args.fps}")
    if not 0 < args.wait < 1e6:
        missing(who, f"--wait must be a number of seconds more than 0; got {args.wait}")
    if getattr(args, "consumers", 1) < 1:
        missing(who, f"--consumers must be at least 1; got {args.consumers}")
    if args.name is None:  # unique per run, so parallel runs (and tests) never meet on one link
        args.name = f"{who}-{os.getpid()}" if args.role == "both" else f"{who}-demo"
    try:
        cudalink.Receiver(args.name, connect=False).close()  # the name's rules, before anything starts
    except cudalink.LinkError as exc:
        missing(who, f"--name: {exc}")
    return args


def spawn_producer(args: argparse.Namespace, consumers: int = 1) -> Any:
    """``--role both``: start :func:`produce` in a spawned child. ``producer``: be the producer, then exit."""
    kwargs = {
        "device": args.device,
        "frames": args.frames,
        "fps": args.fps,
        "shape": args.shape,
        "consumers": consumers,
    }
    if args.role == "producer":
        with other_side(args):
            produce(args.name, wait=args.wait, **kwargs)
        print(f"producer: sent {args.frames} frames on {args.name!r}")
        sys.exit(0)
    if args.role == "consumer":
        return None
    proc = mp.get_context("spawn").Process(target=produce, args=(args.name,), kwargs=kwargs, daemon=True)
    proc.start()
    return proc


class Tally:
    """Counts what a consumer saw and prints the example's one result line."""

    def __init__(self, who: str, frames: int, device: str | int) -> None:
        self.who, self.frames, self.device = who, frames, device_label(device)
        self.received = self.bad = self.last = 0
        self.ages_ms: list[float] = []

    def add(self, frame: cudalink.Frame, ok: bool) -> None:
        self.ages_ms.append((time.time_ns() - frame.timestamp_ns) / 1e6)
        self.received += 1
        self.bad += not ok
        self.last = frame.seq

    def finish(self, proc: Any = None, extra: str = "") -> int:
        """Print ``WHO: OK ...`` (exit code 0) or ``WHO: FAIL ...`` (1)."""
        problems = []
        if proc is not None:
            proc.join(30)
            if proc.exitcode != 0:
                problems.append(f"producer exit code {proc.exitcode}")
        if self.bad:
            problems.append(f"{self.bad} checksum mismatches")
        if self.last != self.frames:
            problems.append(f"last frame was seq {self.last}, expected {self.frames}")
        age = statistics.median(self.ages_ms) if self.ages_ms else float("nan")
        status = "FAIL " + "; ".join(problems) + "," if problems else "OK"
        skipped = self.frames - self.received
        print(
            f"{self.who}: {status} {self.received}/{self.frames} frames on {self.device}, "
            f"{skipped} skipped, median age {age:.2f} ms{extra}",
            flush=True,
        )
        return 1 if problems else 0
