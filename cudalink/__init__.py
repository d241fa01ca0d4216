"""cudalink: zero-copy GPU (and CPU) frames between processes.

    with cudalink.Sender("cam0", shape=(1080, 1920, 4), dtype="uint8", device=0) as tx:
        tx.send(tensor)
    with cudalink.Receiver("cam0") as rx:
        frame = rx.recv()
        t = torch.from_dlpack(frame)

Importing cudalink never touches the GPU; CUDA is initialised by the first CUDA link or frame.
"""

from ._version import __version__
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    CudaError,
    CudaUnavailable,
    ExportError,
    FormatError,
    LandingFull,
    LinkClosed,
    LinkError,
    LinkTimeout,
    ProducerGone,
    ProtocolError,
    ProtocolReason,
)
from .frames import Frame, FrameSpec, PixelFormat, RowOrigin
from .link import Receiver, Sender

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "CudaError",
    "CudaUnavailable",
    "ExportError",
    "FormatError",
    "Frame",
    "FrameSpec",
    "LandingFull",
    "LinkClosed",
    "LinkError",
    "LinkTimeout",
    "PixelFormat",
    "ProducerGone",
    "ProtocolError",
    "ProtocolReason",
    "Receiver",
    "RowOrigin",
    "Sender",
    "__version__",
]
