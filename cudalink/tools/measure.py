"""What every measuring tool shares (bench, breakdown, floors, demo): percentiles, the backend choice,
the GPU array library children use, and child set-up. Imports none of those tools, so they need not
import each other.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cuda import devices
from ..errors import CudaUnavailable, LinkError


def summarize(values_ns: Sequence[int] | np.ndarray[Any, Any]) -> dict[str, float] | None:
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
    for name in ("torch", "cupy"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def short_reason(exc: BaseException) -> str:
    """One line, without cudalink's prefix and its generic way-out hint: for 'using the CPU backend (...)'."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text.removeprefix("cudalink: ")
    text = text.split("; use device='cpu'")[0]
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


class GpuLib:
    """The few GPU array operations the demo and bench need, from torch or cupy (whichever is installed)."""

    def __init__(self, name: str, ordinal: int) -> None:
        self.name = name
        self.ordinal = ordinal
        if name == "torch":
            import torch

            torch.cuda.set_device(ordinal)
            self.mod: Any = torch
            self.dev: Any = torch.device("cuda", ordinal)
        elif name == "cupy":
            import cupy

            cupy.cuda.Device(ordinal).use()
            self.mod = cupy
            self.dev = None
        else:
            raise LinkError(f"cudalink: no GPU array library {name!r}; install torch or cupy")

    def from_numpy(self, a: np.ndarray[Any, Any]) -> Any:
        if self.name == "torch":
            return self.mod.from_numpy(np.ascontiguousarray(a)).to(self.dev)
        return self.mod.asarray(a)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self.from_numpy(np.zeros(shape, dtype))

    def copy(self, dst: Any, src: Any) -> None:
        """D2D, or H2D when ``src`` is a numpy array."""
        if self.name == "torch":
            dst.copy_(self.mod.from_numpy(src) if isinstance(src, np.ndarray) else src)
        elif isinstance(src, np.ndarray):
            dst.set(src)
        else:
            self.mod.copyto(dst, src)

    def to_host(self, dst: np.ndarray[Any, Any], src: Any) -> None:
        """Blocking D2H into existing host memory (a shared-memory slot)."""
        if self.name == "torch":
            self.mod.from_numpy(dst).copy_(src)
        else:
            src.get(out=dst)

    def sync(self) -> None:
        if self.name == "torch":
            self.mod.cuda.synchronize(self.dev)
        else:
            self.mod.cuda.Device(self.ordinal).synchronize()

    def from_dlpack(self, obj: Any) -> Any:
        return self.mod.from_dlpack(obj)

    def bytesum(self, x: Any) -> int:
        if self.name == "torch":
            return int(x.reshape(-1).view(self.mod.uint8).sum(dtype=self.mod.int64).item())
        return int(x.reshape(-1).view(self.mod.uint8).sum(dtype=self.mod.uint64).item())

    def take(self, x: Any, idx: list[int]) -> np.ndarray[Any, Any]:
        if self.name == "torch":
            flat = x.reshape(-1)
            return np.asarray(flat[self.mod.tensor(idx, device=self.dev)].cpu().numpy())
        return np.asarray(self.mod.asnumpy(x.reshape(-1)[self.mod.asarray(idx)]))

    def ptr(self, x: Any) -> int:
        return int(x.data_ptr()) if self.name == "torch" else int(x.data.ptr)

    def context(self) -> None:
        """Create the CUDA context now, so the first measured frame does not pay for it."""
        if self.name == "torch":
            self.mod.zeros(1, device=self.dev)
            self.sync()
        else:
            self.mod.zeros(1)


def _child_init() -> None:
    """Children leave Ctrl-C to the parent, which stops them through their queues and events."""
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
