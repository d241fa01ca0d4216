"""torch or cupy behind one small interface: the GPU array library of the TD conversions and of the tools.

Neither library is a dependency: TouchDesigner projects and benchmark machines have one or the other, so
both are imported by name. mypy sees neither here, so their arrays are described by the Protocols below,
which name the members cudalink calls. Callers hold the arrays as opaque objects; an :class:`ArrayLib`
only gets back arrays of its own library, so each of its branches reads them as such.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Protocol, cast, overload

import numpy as np
import numpy.typing as npt

from ..errors import LinkError
from ..frames.spec import as_dtype

#: The GPU array libraries an :class:`ArrayLib` wraps, in the tools' order of preference.
NAMES = ("torch", "cupy")


class TorchTensor(Protocol):
    """The members of a ``torch.Tensor`` that cudalink calls."""

    @property
    def dtype(self) -> object: ...

    def dim(self) -> int: ...

    def data_ptr(self) -> int: ...

    def numel(self) -> int: ...

    def element_size(self) -> int: ...

    def unsqueeze(self, dim: int) -> TorchTensor: ...

    def view(self, dtype: object) -> TorchTensor: ...

    def flip(self, *dims: int) -> TorchTensor: ...

    def to(self, dtype: object) -> TorchTensor: ...

    def contiguous(self) -> TorchTensor: ...

    def reshape(self, *shape: int) -> TorchTensor: ...

    def sum(self, *, dtype: object) -> TorchTensor: ...

    def item(self) -> int | float: ...

    def copy_(self, src: object) -> TorchTensor: ...

    def cpu(self) -> TorchTensor: ...

    def numpy(self) -> npt.NDArray[np.generic]: ...

    def __getitem__(self, index: object) -> TorchTensor: ...


class CupyPointer(Protocol):
    """A cupy ``MemoryPointer`` (``ndarray.data``)."""

    @property
    def ptr(self) -> int: ...


class CupyArray(Protocol):
    """The members of a ``cupy.ndarray`` that cudalink calls."""

    @property
    def ndim(self) -> int: ...

    @property
    def dtype(self) -> np.dtype[np.generic]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def data(self) -> CupyPointer: ...

    def astype(self, dtype: npt.DTypeLike) -> CupyArray: ...

    def reshape(self, *shape: int) -> CupyArray: ...

    def view(self, dtype: object) -> CupyArray: ...

    def sum(self, *, dtype: object) -> CupyArray: ...

    def item(self) -> int | float: ...

    def set(self, arr: npt.NDArray[np.generic]) -> None: ...

    def get(self, *, out: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]: ...

    def __getitem__(self, index: object) -> CupyArray: ...


#: A GPU array of one of :data:`NAMES`.
GpuArray = TorchTensor | CupyArray


def installed(names: Sequence[str] = NAMES) -> str | None:
    """The first of ``names`` that is installed (found, not imported); None if none is."""
    for name in names:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def importable(name: str, cache: dict[str, ModuleType | None]) -> ModuleType | None:
    """``name``, imported once per ``cache``; None when it is missing or fails to import."""
    if name not in cache:
        try:
            cache[name] = importlib.import_module(name)
        except Exception:  # not installed, or built for another CUDA: treat as absent
            cache[name] = None
    return cache[name]


@overload
def rearranged(
    xp: ModuleType,
    arr: npt.NDArray[np.generic],
    *,
    flip: bool,
    channels: list[int] | None,
    dtype: np.dtype[np.generic],
) -> npt.NDArray[np.generic]: ...


@overload
def rearranged(
    xp: ModuleType, arr: CupyArray, *, flip: bool, channels: list[int] | None, dtype: np.dtype[np.generic]
) -> CupyArray: ...


def rearranged(
    xp: ModuleType,
    arr: npt.NDArray[np.generic] | CupyArray,
    *,
    flip: bool,
    channels: list[int] | None,
    dtype: np.dtype[np.generic],
) -> npt.NDArray[np.generic] | CupyArray:
    """``arr`` as C-contiguous (h, w, c), rows flipped, channels picked, as ``dtype``: ``xp`` is numpy or cupy."""
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if flip:
        arr = arr[::-1]
    if channels is not None:
        arr = arr[..., channels]
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    out: npt.NDArray[np.generic] | CupyArray = xp.ascontiguousarray(arr)
    return out


class _RawStream:
    """A raw CUstream value in the ``__cuda_stream__`` protocol, for ``cupy.cuda.Stream.from_external``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(cp: ModuleType, ptr: int) -> AbstractContextManager[object]:
    """A cupy stream object for the raw stream ``ptr`` on the current device (cupy does not own it).

    cupy 14 deprecates ``ExternalStream`` for ``Stream.from_external``, which takes the
    ``__cuda_stream__`` protocol; older cupy has only the former.
    """
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    made = cp.cuda.ExternalStream(ptr) if from_external is None else from_external(_RawStream(ptr))
    return cast("AbstractContextManager[object]", made)


class ArrayLib:
    """torch or cupy on CUDA device ``ordinal``: the few GPU array operations cudalink needs of either.

    Making one imports ``name`` (unless its module is given) and changes no device state; :meth:`use`
    makes ``ordinal`` the library's current device.
    """

    def __init__(self, name: str, ordinal: int, mod: ModuleType | None = None) -> None:
        if name not in NAMES:
            raise LinkError(f"cudalink: no GPU array library {name!r}; install torch or cupy")
        self.name = name
        self.ordinal = ordinal
        self.mod = importlib.import_module(name) if mod is None else mod
        self.is_torch = name == "torch"
        self.dev: object = self.mod.device("cuda", ordinal) if self.is_torch else None

    def use(self) -> None:
        """Make ``ordinal`` the library's current device."""
        if self.is_torch:
            self.mod.cuda.set_device(self.ordinal)
        else:
            self.mod.cuda.Device(self.ordinal).use()

    def from_numpy(self, a: npt.NDArray[np.generic]) -> GpuArray:
        bf16 = a.dtype.name == "bfloat16"  # ml_dtypes': torch takes its bits, cupy has no such type
        if bf16 and not self.is_torch:
            raise LinkError("cudalink: cupy has no bfloat16; install torch for bfloat16 frames on the GPU")
        if self.is_torch:
            host = np.ascontiguousarray(a)
            t: TorchTensor = self.mod.from_numpy(host.view(np.int16) if bf16 else host).to(self.dev)
            return t.view(self.mod.bfloat16) if bf16 else t
        c: CupyArray = self.mod.asarray(a)
        return c

    def empty(self, shape: tuple[int, ...], dtype: str) -> GpuArray:
        return self.from_numpy(np.zeros(shape, dtype))

    def copy(self, dst: object, src: object) -> None:
        """D2D, or H2D when ``src`` is a numpy array; ``dst`` is an array of this library."""
        if self.is_torch:
            cast(TorchTensor, dst).copy_(self.mod.from_numpy(src) if isinstance(src, np.ndarray) else src)
        elif isinstance(src, np.ndarray):
            cast(CupyArray, dst).set(src)
        else:
            self.mod.copyto(dst, src)

    def to_host(self, dst: npt.NDArray[np.generic], src: object) -> None:
        """Blocking D2H into existing host memory (a shared-memory slot)."""
        if self.is_torch:
            self.mod.from_numpy(dst).copy_(src)
        else:
            cast(CupyArray, src).get(out=dst)

    def sync(self) -> None:
        if self.is_torch:
            self.mod.cuda.synchronize(self.dev)
        else:
            self.mod.cuda.Device(self.ordinal).synchronize()

    def from_dlpack(self, obj: object) -> GpuArray:
        out: GpuArray = self.mod.from_dlpack(obj)
        return out

    def bytesum(self, x: object) -> int:
        wide = self.mod.int64 if self.is_torch else self.mod.uint64
        return int(cast(GpuArray, x).reshape(-1).view(self.mod.uint8).sum(dtype=wide).item())

    def take(self, x: object, idx: list[int]) -> npt.NDArray[np.generic]:
        if self.is_torch:
            flat = cast(TorchTensor, x).reshape(-1)
            got = flat[self.mod.tensor(idx, device=self.dev)].cpu()
            if got.dtype == self.mod.bfloat16:  # torch's numpy() has no bfloat16: its bits, viewed as ml_dtypes'
                return np.asarray(got.view(self.mod.int16).numpy()).view(as_dtype("bfloat16"))
            return np.asarray(got.numpy())
        return np.asarray(self.mod.asnumpy(cast(CupyArray, x).reshape(-1)[self.mod.asarray(idx)]))

    def ptr(self, x: object) -> int:
        return int(cast(TorchTensor, x).data_ptr()) if self.is_torch else int(cast(CupyArray, x).data.ptr)

    def nbytes(self, x: object) -> int:
        if self.is_torch:
            t = cast(TorchTensor, x)
            return int(t.numel() * t.element_size())
        return int(cast(CupyArray, x).nbytes)

    def context(self) -> None:
        """Create the CUDA context now, so the first measured frame does not pay for it."""
        if self.is_torch:
            self.mod.zeros(1, device=self.dev)
            self.sync()
        else:
            self.mod.zeros(1)

    def rearrange(
        self, src: object, stream: int, *, flip: bool, channels: list[int] | None, dtype: np.dtype[np.generic]
    ) -> GpuArray:
        """``src`` (a DLPack exporter on ``ordinal``) as a new C-contiguous (h, w, c) array, queued on ``stream``.

        Rows flipped, channels picked and converted to ``dtype`` as :func:`rearranged` does, except that
        torch converts only to float32 (the one conversion a TD plan asks for) and moves uint16 as int16:
        few torch kernels take uint16, and flips and gathers only move bits.
        """
        dev = self.ordinal
        if not self.is_torch:
            cp = self.mod
            with cp.cuda.Device(dev), cupy_stream(cp, stream):
                arr: CupyArray = cp.from_dlpack(src)
                out: GpuArray = rearranged(cp, arr, flip=flip, channels=channels, dtype=dtype)
            return out
        torch = self.mod
        with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=f"cuda:{dev}")):
            t: TorchTensor = torch.from_dlpack(src)
            if t.dim() == 2:
                t = t.unsqueeze(-1)
            if t.dtype == torch.uint16:
                t = t.view(torch.int16)
            if flip:
                t = t.flip(0)
            if channels is not None:
                t = t[..., channels]
            if dtype == np.float32 and t.dtype != torch.float32:
                t = t.to(torch.float32)
            out = t.contiguous()
        return out
