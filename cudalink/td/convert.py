"""Frames into what a Script TOP takes: the conversion plan (flip, swap, float32, channels) on the GPU or host."""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import numpy.typing as npt

from ..cuda import devices, driver
from ..errors import FormatError, LinkError
from ..frames.frame import Frame
from ..frames.spec import PixelFormat, RowOrigin
from .arraylib import ArrayLib, GpuArray, importable, rearranged
from .formats import _TO_FLOAT32, CUDAMemoryShapeLike, Switch


def _switch(value: Switch | None, name: str) -> bool | None:
    """True/False, or None for "auto" (TD menus give strings, toggles bools or 0/1)."""
    if value is None:
        return False
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0", ""):
        return False
    raise FormatError(f"cudalink: {name} must be True, False or 'auto', got {value!r}")


def _td_default_shape() -> CUDAMemoryShapeLike:
    td: ModuleType | None = None
    try:
        td = importlib.import_module("td")  # TouchDesigner's own module; only exists inside TD
    except ImportError:
        pass
    factory = getattr(td, "CUDAMemoryShape", None)
    if factory is None:
        raise LinkError(
            "cudalink: td.CUDAMemoryShape is not available (not running inside TouchDesigner); "
            "pass shape_factory= (e.g. a fake) to use the Script TOP helpers elsewhere"
        )
    shape: CUDAMemoryShapeLike = factory()
    return shape


class _Plan:
    """What a frame needs before TD can take it: its TD shape and the GPU/CPU steps to get there."""

    __slots__ = ("comps", "dtype", "flip", "height", "swap", "width")

    def __init__(self, frame: Frame, flip: Switch, swap_rb: Switch, method: str) -> None:
        shape = frame.shape
        if frame.ndim == 2:
            self.height, self.width, self.comps = shape[0], shape[1], 1
        elif frame.ndim == 3 and 1 <= shape[2] <= 4:
            self.height, self.width, self.comps = shape
        else:
            raise FormatError(
                f"cudalink: a Script TOP takes (height, width) or (height, width, 1..4) frames, got {shape}"
            )
        name = frame.dtype.name
        if name in _TO_FLOAT32:
            self.dtype: np.dtype[np.generic] = np.dtype(np.float32)
        elif name in ("uint8", "uint16", "float32"):
            self.dtype = frame.dtype
        else:
            raise FormatError(
                f"cudalink: TouchDesigner textures are uint8, uint16 or float32 (float16/bfloat16/float64 are "
                f"converted to float32); a {name} frame needs converting by its producer"
            )
        want_bgr = self.comps == 4 and self.dtype == np.uint8 and method == "cuda"
        do_flip = _switch(flip, "flip")
        self.flip = frame.origin is RowOrigin.TOP if do_flip is None else do_flip
        do_swap = _switch(swap_rb, "swap_rb")
        if do_swap is None:
            pf = frame.pixel_format
            has_rb = pf is not None and pf.channels >= 3
            do_swap = has_rb and (pf in (PixelFormat.BGR, PixelFormat.BGRA)) != want_bgr
        if do_swap and self.comps < 3:
            raise FormatError(f"cudalink: swap_rb needs 3 or 4 channels; this frame has {self.comps}")
        self.swap = do_swap

    def steps(self, frame: Frame) -> list[str]:
        out = []
        if self.flip:
            out.append("row flip")
        if self.swap:
            out.append("red/blue swap")
        if self.dtype != frame.dtype:
            out.append(f"{frame.dtype.name}->float32")
        if not frame.spec.is_contiguous:
            out.append("contiguous copy")
        return out

    @property
    def swap_index(self) -> list[int]:
        return [2, 1, 0, 3] if self.comps == 4 else [2, 1, 0]

    @property
    def channels(self) -> list[int] | None:
        """The channel order to pick, or None to keep it."""
        return self.swap_index if self.swap else None


def _convert_host(arr: npt.NDArray[np.generic], plan: _Plan) -> npt.NDArray[np.generic]:
    return rearranged(np, arr, flip=plan.flip, channels=plan.channels, dtype=plan.dtype)


_BACKENDS = ("cupy", "torch")
_backend_cache: dict[str, ModuleType | None] = {}


def _array_module(preferred: str | None) -> tuple[str, ModuleType]:
    """cupy or torch, whichever imports (TD users usually have one); None of them is a clear error."""
    names = (preferred,) if preferred else _BACKENDS
    for name in names:
        if name not in _BACKENDS:
            raise LinkError(f"cudalink: array_backend must be 'cupy' or 'torch', got {name!r}")
        mod = importable(name, _backend_cache)
        if mod is not None:
            return name, mod
    raise LinkError("cudalink: no GPU array library; " + ("/".join(names)) + " could not be imported")


def _convert_cuda(frame: Frame, plan: _Plan, stream: int, backend: str | None) -> tuple[GpuArray, int, int]:
    """Run the plan's steps on ``stream`` with cupy or torch; returns (array to keep, ptr, nbytes)."""
    bf16 = frame.dtype.name == "bfloat16"
    try:
        name, mod = _array_module(backend if backend is not None or not bf16 else "torch")  # cupy has no bfloat16
    except LinkError as exc:
        raise FormatError(
            f"{exc}. This {frame.spec.label} frame needs {', '.join(plan.steps(frame))} before "
            "TouchDesigner can take it, which runs on the GPU: install cupy or torch into TD's Python "
            "(td/README.md), or pass method='numpy' for a slow host round trip, or have the producer "
            "send what TD takes as-is "
            "(uint8/uint16/float32, origin='bottom', BGRA for 8-bit RGBA)"
        ) from exc
    if name == "cupy" and bf16:
        raise FormatError(
            "cudalink: cupy has no bfloat16, so it cannot convert this frame to the float32 TouchDesigner takes; "
            "install torch into TD's Python (td/README.md) and pass array_backend='torch', or pass "
            "method='numpy' for a slow host round trip, or have the producer send float16 or float32"
        )
    dev = frame._device_id
    devices.device(dev)
    lib = ArrayLib(name, dev, mod)
    out = lib.rearrange(frame, stream, flip=plan.flip, channels=plan.channels, dtype=plan.dtype)
    return out, lib.ptr(out), lib.nbytes(out)


class _DeviceBuffer:
    """Plain cuMemAlloc memory for snapshots: no cupy/torch needed to keep an image past its link."""

    def __init__(self, nbytes: int, device: int) -> None:
        devices.device(device)
        self.ptr = int(driver.check(driver.bindings().cuMemAlloc(nbytes), "cuMemAlloc"))

    def __del__(self) -> None:
        try:
            driver.bindings().cuMemFree(self.ptr)
        except Exception:
            pass


def _sync(stream: int) -> None:
    drv = driver.bindings()
    driver.check(drv.cuStreamSynchronize(drv.CUstream(stream)), "cuStreamSynchronize")
