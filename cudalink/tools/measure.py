"""What every measuring tool shares (bench, breakdown, floors, demo): percentiles, the backend choice,
the GPU array library children use, and child set-up. Imports none of those tools, so they need not
import each other.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..cuda import devices
from ..errors import CudaUnavailable, LinkError
from ..td.arraylib import ArrayLib, installed


def summarize(values_ns: Sequence[int] | npt.NDArray[np.generic]) -> dict[str, float] | None:
    """p50/p99/mean in microseconds (numpy.percentile), or None when nothing was measured."""
    a = np.asarray(values_ns, dtype=np.float64)
    if a.size == 0:
        return None
    a = a / 1e3
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "n": float(a.size),
    }


def gpu_lib_name() -> str | None:
    """The GPU array library children will use: torch first, then cupy; None if neither is installed."""
    return installed(("torch", "cupy"))


def short_reason(exc: BaseException) -> str:
    """One line, without cudalink's prefix and its generic way-out hint: for 'using the CPU backend (...)'."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    before = getattr(exc, "before_cpu_advice", None)  # a no-GPU error: what it says before its way-out hint
    if before:
        text = before.removesuffix("; ").removesuffix(", or ")  # driver.no_gpu's two joiners
    text = text.removeprefix("cudalink: ")
    if "NVIDIA display driver" in text or "can only be found via system search" in text:
        return "no CUDA driver"
    return text if len(text) <= 120 else text[:117] + "..."


@dataclass(frozen=True)
class Backend:
    """Which backend a command runs on, and what to tell the user about that choice."""

    device: int  # CUDA ordinal, or -1 for the host backend
    lib: str  # "torch" / "cupy" on the GPU, "" on the CPU
    note: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.device >= 0

    @property
    def label(self) -> str:
        return f"cuda:{self.device}" if self.is_cuda else "cpu"

    @property
    def sender_device(self) -> int | str:
        return self.device if self.is_cuda else "cpu"


def resolve_backend(device: str) -> Backend:
    """``auto`` falls back to the CPU with a plain reason; an explicit GPU that cannot work is an error."""
    text = str(device).strip().lower()
    if text == "cpu":
        return Backend(-1, "")
    explicit = text != "auto"
    ordinal = devices.parse_device(int(text) if text.isdigit() else text) if explicit else 0
    try:
        devices.device(ordinal)
    except Exception as exc:
        if explicit:
            if isinstance(exc, LinkError):
                raise
            raise CudaUnavailable(f"cudalink: cannot use cuda:{ordinal}: {short_reason(exc)}") from exc
        return Backend(-1, "", f"no GPU: using the CPU backend ({short_reason(exc)})")
    lib = gpu_lib_name()
    if lib is None:
        msg = (
            f"cuda:{ordinal} works but neither torch nor cupy is installed to make GPU frames"
            " (pip install torch, or cupy-cuda13x)"
        )
        if explicit:
            raise CudaUnavailable(f"cudalink: {msg}")
        return Backend(-1, "", f"{msg}: using the CPU backend")
    return Backend(ordinal, lib)


class GpuLib(ArrayLib):
    """The GPU array library of the demo and bench children: torch or cupy (whichever is installed), on
    ``ordinal``, which it makes the library's current device at once."""

    def __init__(self, name: str, ordinal: int) -> None:
        super().__init__(name, ordinal)
        self.use()


def _child_init() -> None:
    """Children leave Ctrl-C to the parent, which stops them through their queues and events."""
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
