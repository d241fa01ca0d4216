"""Fakes of TouchDesigner's CUDA surface, strict where TD is strict, and a loader for the td/ DATs.

They follow TD's documented behaviour (``/work/shared/notes/touchdesigner.md``):

* ``FakeTOP.cudaMemory(stream=)`` copies the texture into *newly allocated* memory each call and
  returns a ``FakeCUDAMemory`` that frees that memory when it dies: host memory is poisoned (and
  kept mapped a while, so a use-after-free reads garbage instead of crashing the test run), device
  memory is poisoned and ``cuMemFree``'d for real.
* ``FakeScriptTOP.copyCUDAMemory(address, size, shape, stream=)`` validates its arguments like TD
  (``dataType`` a numpy scalar type among uint8/uint16/float32, ``numComps`` 1..4, ``size`` exact),
  waits for ``stream`` and copies the bytes into its own texture array; it only works during a cook.
* Custom parameters follow TD's naming rule, ``addError``/``addWarning`` only work while cooking.

``load_td_script`` imports a DAT file the way TouchDesigner runs it: a fresh module whose globals
already hold ``me``/``op``/``parent``, with a fake ``td`` module importable while it loads.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import itertools
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TD_DIR = ROOT / "td"
POISON = 0xDE
TD_TYPES = (np.uint8, np.uint16, np.float32)

_ids = itertools.count(1)
# Freed host buffers stay mapped (poisoned) a while: reading freed memory gives wrong values, not a crash.
_graveyard: collections.deque[np.ndarray[Any, Any]] = collections.deque(maxlen=64)


class TDError(Exception):
    """What TD raises (``td.tdError``) when a call is used wrongly."""


# =================================================================================== CUDA memory


def _drv() -> Any:
    from cuda.bindings import driver

    return driver


def _check(ret: Any, what: str) -> Any:
    if int(ret[0]) != 0:
        raise TDError(f"{what} failed: {ret[0]!r}")
    return ret[1] if len(ret) > 1 else None


def _set_device(device: int) -> None:
    from cudalink.cuda import devices

    devices.device(device)


class FakeCUDAMemoryShape:
    """``td.CUDAMemoryShape``: plain settable fields."""

    def __init__(self, width: int = 0, height: int = 0, numComps: int = 4, dataType: Any = np.uint8) -> None:
        self.width = width
        self.height = height
        self.numComps = numComps
        self.dataType = dataType
        self.depth = 1
        self.isCube = False
        self.is3D = False

    def __repr__(self) -> str:
        dt = getattr(self.dataType, "__name__", self.dataType)
        return f"CUDAMemoryShape({self.width}x{self.height}x{self.numComps} {dt})"


class FakeCUDAMemory:
    """``td.CUDAMemory``: read-only ``ptr``/``size``/``shape``; the memory is freed when this object dies."""

    live = 0
    freed: list[int] = []

    def __init__(self, size: int, shape: FakeCUDAMemoryShape, device: int | str = "cpu") -> None:
        self._size = int(size)
        self._shape = shape
        self._device = device
        self._buf: np.ndarray[Any, Any] | None = None
        if device == "cpu":
            self._buf = np.empty(max(self._size, 1), np.uint8)
            self._ptr = int(self._buf.ctypes.data)
        else:
            _set_device(int(device))
            self._ptr = int(_check(_drv().cuMemAlloc(max(self._size, 1)), "cuMemAlloc"))
        FakeCUDAMemory.live += 1

    @property
    def ptr(self) -> int:
        return self._ptr

    @property
    def size(self) -> int:
        return self._size

    @property
    def shape(self) -> FakeCUDAMemoryShape:
        return self._shape

    @property
    def device(self) -> int | str:
        return self._device

    def __del__(self) -> None:
        FakeCUDAMemory.live -= 1
        FakeCUDAMemory.freed.append(self._ptr)
        del FakeCUDAMemory.freed[:-256]
        if self._buf is not None:
            self._buf.fill(POISON)
            _graveyard.append(self._buf)
            return
        try:
            drv = _drv()
            drv.cuMemsetD8(self._ptr, POISON, max(self._size, 1))
            drv.cuMemFree(self._ptr)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<FakeCUDAMemory {self._shape} ptr=0x{self._ptr:x} size={self._size} on {self._device}>"


def device_allocated(ptr: int) -> bool:
    """True while ``ptr`` lies in a live device allocation (to prove the fake frees for real)."""
    ret = _drv().cuMemGetAddressRange(ptr)
    return int(ret[0]) == 0


def _check_data_type(dt: Any, call: str) -> np.dtype[Any]:
    if isinstance(dt, np.dtype):
        raise TDError(f"{call}: dataType must be a numpy type such as numpy.uint8, not the dtype object {dt!r}")
    if not (isinstance(dt, type) and issubclass(dt, np.generic)):
        raise TDError(f"{call}: dataType must be a numpy type, got {dt!r}")
    if dt not in TD_TYPES:
        raise TDError(f"{call}: unsupported dataType {dt.__name__}; use uint8, uint16 or float32")
    return np.dtype(dt)


def _check_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TDError(f"{what} must be an int, got {value!r}")
    return int(value)


def _check_stream(stream: Any, call: str) -> int | None:
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TDError(f"{call}: stream must be an int stream handle, got {stream!r}")
    return stream


class FakeTOP:
    """A TOP whose texture is ``texture``: (h, w) or (h, w, c), numpy on host or any CUDA array on device."""

    def __init__(self, texture: Any, *, device: int | str = "cpu", name: str = "null1") -> None:
        self.name = name
        self.path = f"/project1/{name}"
        self.device = device
        self.texture = texture
        self.calls: list[int | None] = []

    def _layout(self, stream: int = 1) -> tuple[int, int, int, np.dtype[Any], int, Any]:
        if self.device == "cpu":
            arr = np.ascontiguousarray(self.texture)
            shape, dtype, ptr, owner = arr.shape, arr.dtype, int(arr.ctypes.data), arr
        else:
            from cudalink.cuda import arrays

            info = arrays.describe_array(self.texture, stream_ptr=stream)  # `stream` waits for the texture
            if info.strides is not None:
                raise TDError("FakeTOP: device textures must be contiguous")
            shape, dtype, ptr, owner = info.shape, info.dtype, info.ptr, info.owner
        h, w = shape[0], shape[1]
        c = shape[2] if len(shape) == 3 else 1
        return h, w, c, dtype, ptr, owner

    @property
    def width(self) -> int:
        return self._layout()[1]

    @property
    def height(self) -> int:
        return self._layout()[0]

    def cudaMemory(self, stream: int | None = None) -> FakeCUDAMemory:
        s = _check_stream(stream, "cudaMemory")
        h, w, c, dtype, src, owner = self._layout(1 if s is None else s)
        if dtype == np.float16:
            raise TDError("cudaMemory(): 16-bit float textures are not supported; use 32-bit float")
        shape = FakeCUDAMemoryShape(w, h, c, dtype.type)
        nbytes = h * w * c * dtype.itemsize
        mem = FakeCUDAMemory(nbytes, shape, self.device)
        if self.device == "cpu":
            ctypes.memmove(mem.ptr, src, nbytes)
        else:
            from cudalink.cuda import driver

            # Filled in order on `stream` (TD's default stream when None): later work there sees it.
            driver.memcpy_dtod(mem.ptr, src, nbytes, 1 if s is None else s)
        del owner
        self.calls.append(s)
        return mem


# =================================================================================== parameters


_PAR_NAME = re.compile(r"[A-Z][a-z0-9]*")


class FakePar:
    def __init__(self, owner: Any, name: str, style: str, label: str | None = None, page: Any = None) -> None:
        self.owner = owner
        self.name = name
        self.style = style
        self.label = label or name
        self.page = page
        self.menuNames: list[str] = []
        self.menuLabels: list[str] = []
        self._default: Any = {"Toggle": False, "Int": 0, "Float": 0.0}.get(style, "")
        self._val: Any = self._default

    @property
    def isPulse(self) -> bool:
        return self.style == "Pulse"

    @property
    def default(self) -> Any:
        return self._default

    @default.setter
    def default(self, value: Any) -> None:
        self._default = value

    @property
    def val(self) -> Any:
        return self._val

    @val.setter
    def val(self, value: Any) -> None:
        if self.menuNames and value not in self.menuNames:
            raise TDError(f"par {self.name}: {value!r} is not one of {self.menuNames}")
        if self.style == "Toggle":
            value = bool(value)
        self._val = value

    def eval(self) -> Any:
        return self._val

    def __repr__(self) -> str:
        return f"<FakePar {self.name}={self._val!r}>"


class FakePage:
    def __init__(self, owner: FakeScriptTOP, name: str) -> None:
        self.owner = owner
        self.name = name
        self.pars: list[FakePar] = []

    def _append(self, style: str, name: str, label: str | None, replace: bool) -> list[FakePar]:
        if not _PAR_NAME.fullmatch(name):
            raise TDError(f"invalid custom parameter name {name!r}: an upper-case letter, then lower-case/digits")
        existing = self.owner.par._pars.get(name)
        if existing is not None:
            if not replace:
                raise TDError(f"parameter {name!r} already exists")
            self.owner._remove_custom(name)
        par = FakePar(self.owner, name, style, label, self)
        self.pars.append(par)
        self.owner.par._pars[name] = par
        return [par]  # TD returns a ParGroup; [0] is the Par in every build

    def appendStr(self, name: str, label: str | None = None, replace: bool = True) -> list[FakePar]:
        return self._append("Str", name, label, replace)

    def appendToggle(self, name: str, label: str | None = None, replace: bool = True) -> list[FakePar]:
        return self._append("Toggle", name, label, replace)

    def appendMenu(self, name: str, label: str | None = None, replace: bool = True) -> list[FakePar]:
        return self._append("Menu", name, label, replace)

    def appendPulse(self, name: str, label: str | None = None, replace: bool = True) -> list[FakePar]:
        return self._append("Pulse", name, label, replace)

    def appendInt(self, name: str, label: str | None = None, replace: bool = True) -> list[FakePar]:
        return self._append("Int", name, label, replace)

    def appendFloat(self, name: str, label: str | None = None, replace: bool = True) -> list[FakePar]:
        return self._append("Float", name, label, replace)


class FakePars:
    def __init__(self) -> None:
        object.__setattr__(self, "_pars", {})

    def __getattr__(self, name: str) -> FakePar:
        try:
            return self._pars[name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(name) from None

    def __iter__(self) -> Iterator[FakePar]:
        return iter(list(self._pars.values()))


#: the Pixel Format (``format``) menu of a TOP's Common page, as TD names its entries: one channel is "mono"
_FORMATS = ["useinput", "rgba8fixed", "srgba8fixed", "rgba16float", "rgba32float", "rgb10a2fixed", "rgba16fixed"] + [
    f"{ch}{depth}" for ch in ("mono", "rg", "a", "monoalpha") for depth in ("8fixed", "16fixed", "16float", "32float")
]


class _Errors:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.script_errors: list[str] = []
        self.cooking = False

    def addError(self, msg: str) -> None:
        if not self.cooking:
            raise TDError("addError is only valid while the operator cooks")
        self.errors.append(str(msg))

    def addWarning(self, msg: str) -> None:
        if not self.cooking:
            raise TDError("addWarning is only valid while the operator cooks")
        self.warnings.append(str(msg))

    def addScriptError(self, msg: str) -> None:
        self.script_errors.append(str(msg))

    def clearScriptErrors(self, recurse: bool = False, error: str = "*") -> None:
        import fnmatch

        self.script_errors = [e for e in self.script_errors if not fnmatch.fnmatchcase(e, error)]

    def scriptErrors(self, recurse: bool = False) -> str:
        return "\n".join(self.script_errors)


class FakeScriptTOP(_Errors):
    """A Script TOP: custom parameters, status, and a texture written by copyCUDAMemory/copyNumpyArray."""

    def __init__(self, name: str = "script1", *, device: int | str = "cpu") -> None:
        super().__init__()
        self.id = next(_ids)
        self.name = name
        self.path = f"/project1/{name}"
        self.valid = True  # TD's OP.valid: False once the operator is deleted
        self.device = device
        self.par = FakePars()
        self.customPages: list[FakePage] = []
        self.texture: np.ndarray[Any, Any] | None = None
        self.copies: list[dict[str, Any]] = []
        self.storage: dict[str, Any] = {}
        self.modify_outside_cook = False
        for name_, style, val, menu in (
            ("outputresolution", "Menu", "useinput", ["useinput", "custom"]),
            ("resolutionw", "Int", 256, []),
            ("resolutionh", "Int", 256, []),
            ("format", "Menu", "useinput", _FORMATS),
        ):
            par = FakePar(self, name_, style)
            par.menuNames = menu
            par.val = val
            self.par._pars[name_] = par

    # -- custom parameters
    def appendCustomPage(self, name: str) -> FakePage:
        page = FakePage(self, name)
        self.customPages.append(page)
        return page

    @property
    def customPars(self) -> list[FakePar]:
        return [p for page in self.customPages for p in page.pars]

    def _remove_custom(self, name: str) -> None:
        for page in self.customPages:
            page.pars = [p for p in page.pars if p.name != name]
        self.par._pars.pop(name, None)

    def destroyCustomPars(self) -> int:
        n = len(self.customPars)
        for p in self.customPars:
            self.par._pars.pop(p.name, None)
        self.customPages = []
        return n

    # -- storage
    def store(self, key: str, value: Any) -> Any:
        self.storage[key] = value
        return value

    def fetch(self, key: str, default: Any = None) -> Any:
        return self.storage.get(key, default)

    # -- cooking
    def cook(self, callbacks: types.ModuleType) -> None:
        """What TD does per cook: clear the last cook's errors/warnings, run onCook."""
        self.errors.clear()
        self.warnings.clear()
        self.cooking = True
        try:
            callbacks.onCook(self)
        finally:
            self.cooking = False

    def _in_cook(self, call: str) -> None:
        if not self.cooking and not self.modify_outside_cook:
            raise TDError(f"{call} can only be called from onCook (or with Modify Outside of Cook on)")

    def copyCUDAMemory(self, address: Any, size: Any, shape: Any, stream: Any = None) -> None:
        call = "copyCUDAMemory"
        self._in_cook(call)
        address = _check_int(address, f"{call}: address")
        size = _check_int(size, f"{call}: size")
        if not address:
            raise TDError(f"{call}: null address")
        for field in ("width", "height", "numComps", "dataType"):
            if not hasattr(shape, field):
                raise TDError(f"{call}: shape must be a CUDAMemoryShape, got {shape!r}")
        w = _check_int(shape.width, f"{call}: shape.width")
        h = _check_int(shape.height, f"{call}: shape.height")
        c = _check_int(shape.numComps, f"{call}: shape.numComps")
        dtype = _check_data_type(shape.dataType, call)
        if w < 1 or h < 1:
            raise TDError(f"{call}: invalid resolution {w}x{h}")
        if not 1 <= c <= 4:
            raise TDError(f"{call}: numComps must be 1 to 4, got {c}")
        if size != w * h * c * dtype.itemsize:
            raise TDError(f"{call}: size {size} does not match {w}x{h}x{c} {dtype.name}")
        s = _check_stream(stream, call)
        texture = np.empty((h, w, c), dtype)
        if self.device == "cpu":
            ctypes.memmove(texture.ctypes.data, address, size)
        else:
            drv = _drv()
            _set_device(int(self.device))
            if s is not None:  # "the given stream's pending work completes first"
                _check(drv.cuStreamSynchronize(drv.CUstream(s)), "cuStreamSynchronize")
            _check(drv.cuMemcpyDtoH(texture.ctypes.data, address, size), "cuMemcpyDtoH")  # legacy stream
        self.texture = texture
        self.copies.append(
            {
                "method": "cuda",
                "address": address,
                "size": size,
                "width": w,
                "height": h,
                "numComps": c,
                "dataType": shape.dataType,
                "stream": s,
            }
        )

    def copyNumpyArray(self, arr: Any) -> None:
        call = "copyNumpyArray"
        self._in_cook(call)
        if not isinstance(arr, np.ndarray):
            raise TDError(f"{call}: expected a numpy array, got {type(arr).__name__}")
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if arr.ndim != 3 or not 1 <= arr.shape[2] <= 4:
            raise TDError(f"{call}: array must be (height, width, 1..4), got {arr.shape}")
        _check_data_type(arr.dtype.type, call)
        self.texture = np.array(arr, copy=True)
        self.copies.append({"method": "numpy", "shape": arr.shape, "dataType": arr.dtype.type})

    def __repr__(self) -> str:
        return f"<FakeScriptTOP {self.path}>"


class FakeDAT(_Errors):
    """An Execute DAT as ``me``: script errors, and op() relative to its network."""

    def __init__(self, name: str = "execute1", ops: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.id = next(_ids)
        self.name = name
        self.path = f"/project1/{name}"
        self.ops = ops if ops is not None else {}

    def op(self, path: str) -> Any:
        return self.ops.get(path)


# =================================================================================== loading DATs


def make_td_module() -> types.ModuleType:
    td = types.ModuleType("td")
    td.CUDAMemoryShape = FakeCUDAMemoryShape  # type: ignore[attr-defined]
    td.tdError = TDError  # type: ignore[attr-defined]
    td.absTime = types.SimpleNamespace(frame=1, seconds=0.0)  # type: ignore[attr-defined]
    return td


_modules = itertools.count()


def load_td_script(
    path: str | Path,
    *,
    me: Any = None,
    ops: dict[str, Any] | None = None,
    td_module: types.ModuleType | None = None,
) -> types.ModuleType:
    """Run a DAT's text as TouchDesigner does: TD's globals preset, ``import td`` resolving to the fake."""
    path = Path(path)
    td_module = td_module or make_td_module()
    me = me if me is not None else FakeDAT(ops=ops)
    lookup: dict[str, Any] = ops if ops is not None else getattr(me, "ops", {})

    def op(p: str) -> Any:
        return lookup.get(p)

    spec = importlib.util.spec_from_file_location(f"td_dat_{path.stem}_{next(_modules)}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(me=me, op=op, parent=lambda n=1: None, debug=print, absTime=td_module.absTime)
    saved = sys.modules.get("td")
    sys.modules["td"] = td_module
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("td", None)
        else:
            sys.modules["td"] = saved
    return module


def setup_parameters(callbacks: types.ModuleType, script_op: FakeScriptTOP) -> None:
    """The "Setup Parameters" button."""
    callbacks.onSetupParameters(script_op)


def pulse(callbacks: types.ModuleType, script_op: FakeScriptTOP, name: str) -> None:
    callbacks.onPulse(getattr(script_op.par, name))


def cook_until(
    callbacks: types.ModuleType, script_op: FakeScriptTOP, done: Callable[[], bool], tries: int = 200
) -> None:
    """Cook like TD's frame loop until ``done()``; frames arrive asynchronously across processes."""
    import time

    for _ in range(tries):
        script_op.cook(callbacks)
        if done():
            return
        time.sleep(0.01)
    raise AssertionError(f"not done after {tries} cooks; errors={script_op.errors} warnings={script_op.warnings}")
