"""Frames: typed, zero-copy, DLPack-exporting views of memory. Nothing here knows about transports."""

from .frame import DLDeviceType, Frame, FrameSync
from .spec import MAX_NDIM, SUPPORTED_DTYPES, FrameSpec, PixelFormat, RowOrigin, as_dtype

__all__ = [
    "MAX_NDIM",
    "SUPPORTED_DTYPES",
    "DLDeviceType",
    "Frame",
    "FrameSpec",
    "FrameSync",
    "PixelFormat",
    "RowOrigin",
    "as_dtype",
]
