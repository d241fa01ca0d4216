"""TouchDesigner bridge: ``TOP.cudaMemory()`` out through a link, received frames into a Script TOP.

Import it inside TouchDesigner (Python 3.11, 2023.10000+) once cudalink is installed into TD's Python;
``td/`` in the repository holds the callbacks DATs that use it. Nothing here imports TD's ``td``
module at import time, so the module also loads (and is tested) outside TouchDesigner with fakes.

What TD documents, and what this module does about it:

* ``TOP.cudaMemory(stream=)`` returns a ``CUDAMemory`` whose memory is freed when that object dies. A
  frame made by :func:`frame_from_cuda_memory` owns the ``CUDAMemory`` object (not just ``.ptr``), so
  the memory lives as long as the frame or any DLPack/CAI view of it.
* ``CUDAMemoryShape.dataType`` is a numpy *scalar type* (``numpy.float32``), never a ``numpy.dtype``;
  TD takes uint8, uint16 and float32, and refuses float16. 8-bit RGBA textures are BGRA in memory
  and rows run bottom-up, which the frame's pixel format and row origin record.
* ``scriptTOP.copyCUDAMemory`` does not say when it has finished reading, so :class:`ScriptTopSink`
  keeps the source of each copy alive until the next one.
"""

from __future__ import annotations

from .formats import (
    TD_DTYPES,
    CUDAMemoryLike,
    CUDAMemoryShapeLike,
    ScriptTOPLike,
    TOPLike,
    pixel_format_for,
    spec_from_cuda_memory,
    td_dtype,
    td_format_name,
)
from .sink import ScriptTopReceiver, ScriptTopSink, TopUpload, to_script_top
from .source import TDSender, frame_from_cuda_memory

__all__ = [
    "TD_DTYPES",
    "CUDAMemoryLike",
    "CUDAMemoryShapeLike",
    "ScriptTOPLike",
    "ScriptTopReceiver",
    "ScriptTopSink",
    "TDSender",
    "TOPLike",
    "TopUpload",
    "frame_from_cuda_memory",
    "pixel_format_for",
    "spec_from_cuda_memory",
    "td_dtype",
    "td_format_name",
    "to_script_top",
]
