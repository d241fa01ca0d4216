"""What TouchDesigner's CUDA memory is in cudalink's terms: dtypes, pixel formats, the TD-side protocols."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import FormatError
from ..frames.spec import FrameSpec, PixelFormat, RowOrigin

#: The numpy scalar types TouchDesigner's CUDA calls accept (8-bit fixed, 16-bit fixed, 32-bit float).
TD_DTYPES: tuple[type[np.generic], ...] = (np.uint8, np.uint16, np.float32)

#: Element types we convert to float32 before TD sees them (TD refuses float16 and bfloat16; float64 is no
#: texture). A model's bfloat16 output shown in TD is the common case of the second.
_TO_FLOAT32 = ("float16", "float64", "bfloat16")

Switch = bool | str  # True/False, or "auto"/"on"/"off" (TD menus give strings)
Method = Literal["auto", "cuda", "numpy"]


class CUDAMemoryShapeLike(Protocol):
    """TD's ``CUDAMemoryShape`` (TD 2025 adds ``depth``, ``isCube`` and ``is3D``)."""

    width: int
    height: int
    numComps: int
    dataType: type[np.generic]  # a numpy scalar type (numpy.float32), never a numpy.dtype


class CUDAMemoryLike(Protocol):
    """TD's ``CUDAMemory``: read-only, no methods; its memory is freed when the object is destroyed."""

    @property
    def ptr(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def shape(self) -> CUDAMemoryShapeLike: ...


class TOPLike(Protocol):
    """A TD ``TOP``, as far as the export reads it."""

    def cudaMemory(self, stream: int | None = None) -> CUDAMemoryLike: ...


class ScriptTOPLike(Protocol):
    """TD's Script TOP (``scriptOp`` in its callbacks), as far as the bridge writes it.

    Status goes through ``addError``/``addWarning``/``addScriptError`` and the texture format through
    ``par``, both looked up by name, so an operator without them still takes frames.
    """

    def copyCUDAMemory(
        self, address: int, size: int, shape: CUDAMemoryShapeLike, stream: int | None = None
    ) -> None: ...

    def copyNumpyArray(self, arr: npt.NDArray[np.generic]) -> None: ...

    def clearScriptErrors(self, recurse: bool = False, error: str = "*") -> None: ...


#: Makes an empty ``CUDAMemoryShape`` (``td.CUDAMemoryShape``, or a fake outside TouchDesigner).
ShapeFactory = Callable[[], CUDAMemoryShapeLike]


# =============================================================================================== formats


def td_dtype(data_type: object, *, what: str = "CUDAMemoryShape.dataType") -> np.dtype[np.generic]:
    """The numpy dtype of a TD ``dataType``; refuses what TD refuses, with the fix in the message."""
    if isinstance(data_type, np.dtype):
        raise FormatError(
            f"cudalink: {what} is the numpy.dtype instance {data_type!r}, but TouchDesigner uses "
            f"numpy scalar types: use numpy.{data_type.name} (that is, dtype.type), "
            f"not numpy.dtype('{data_type.name}')"
        )
    if not (isinstance(data_type, type) and issubclass(data_type, np.generic)):
        raise FormatError(
            f"cudalink: {what} must be a numpy scalar type (numpy.uint8, numpy.uint16 or numpy.float32), "
            f"got {data_type!r}"
        )
    if data_type is np.float16:
        raise FormatError(
            f"cudalink: {what} is numpy.float16, which TouchDesigner refuses for CUDA memory; set the "
            "TOP's Pixel Format to 32-bit float (Common page, e.g. on a Null TOP before the export), or "
            "8/16-bit fixed"
        )
    if data_type not in TD_DTYPES:
        raise FormatError(
            f"cudalink: {what} numpy.{data_type.__name__} is not a TouchDesigner texture type; "
            "use numpy.uint8, numpy.uint16 or numpy.float32 (8-bit fixed, 16-bit fixed, 32-bit float)"
        )
    return np.dtype(data_type)


def pixel_format_for(dtype: npt.DTypeLike, comps: int) -> PixelFormat:
    """TD's channel order: BGRA for 8-bit 4-channel textures, RGBA (or fewer channels) otherwise."""
    if comps == 4:
        return PixelFormat.BGRA if np.dtype(dtype) == np.uint8 else PixelFormat.RGBA
    return {1: PixelFormat.GRAY, 2: PixelFormat.RG, 3: PixelFormat.RGB}[comps]


def td_format_name(dtype: npt.DTypeLike, comps: int) -> str | None:
    """The Script TOP ``format`` menu entry (``rgba8fixed``, ``mono32float``...); None where TD has none."""
    depth = {"uint8": "8fixed", "uint16": "16fixed", "float32": "32float"}.get(np.dtype(dtype).name)
    channels = {1: "mono", 2: "rg", 4: "rgba"}.get(comps)  # TD's menu calls one channel "mono", not "r"
    return None if depth is None or channels is None else channels + depth


def _int_field(obj: object, name: str, owner: str) -> int:
    value = getattr(obj, name, None)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise FormatError(f"cudalink: {owner}.{name} must be an int, got {value!r}")
    return int(value)


def spec_from_cuda_memory(mem: CUDAMemoryLike) -> FrameSpec:
    """The frame description of a ``CUDAMemory``: (height, width, numComps), TD's channel order, bottom-up."""
    shape = getattr(mem, "shape", None)
    if shape is None:
        raise FormatError(f"cudalink: {type(mem).__name__} has no .shape; pass TOP.cudaMemory()'s result")
    width = _int_field(shape, "width", "CUDAMemoryShape")
    height = _int_field(shape, "height", "CUDAMemoryShape")
    comps = _int_field(shape, "numComps", "CUDAMemoryShape")
    depth = getattr(shape, "depth", 1)
    if getattr(shape, "is3D", False) or getattr(shape, "isCube", False) or depth not in (None, 0, 1):
        raise FormatError(
            "cudalink: 3D, cube and 2D-array textures are not supported; export one 2D slice "
            "(e.g. a Null TOP after a Texture 3D TOP's output slice)"
        )
    if width < 1 or height < 1:
        raise FormatError(f"cudalink: TOP is {width}x{height}; nothing to export")
    if not 1 <= comps <= 4:
        raise FormatError(f"cudalink: CUDAMemoryShape.numComps must be 1 to 4, got {comps}")
    dtype = td_dtype(getattr(shape, "dataType", None))
    return FrameSpec((height, width, comps), dtype, None, pixel_format_for(dtype, comps), RowOrigin.BOTTOM)
