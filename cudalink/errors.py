"""Every error cudalink raises derives from :class:`LinkError`, so one ``except`` catches them all."""

from __future__ import annotations

__all__ = [
    "CudaUnavailable",
    "FormatError",
    "LinkClosed",
    "LinkError",
    "LinkTimeout",
    "ProducerGone",
    "ProtocolError",
]


class LinkError(Exception):
    """Base class of all cudalink errors."""


class LinkTimeout(LinkError, TimeoutError):
    """A bounded wait ran out (``recv``, attaching, a blocked ``send``)."""


class ProducerGone(LinkError):
    """The producer closed or died; the next ``recv`` re-attaches to a new producer if one appears."""


class FormatError(LinkError, ValueError):
    """A frame, array or spec does not match what the link carries."""


class ProtocolError(LinkError):
    """Shared state or a control message is corrupt, foreign or from an incompatible version."""


class LinkClosed(LinkError):
    """The object was used after ``close()``."""


class CudaUnavailable(LinkError, RuntimeError):
    """No usable CUDA driver/GPU, or the GPU lacks a needed feature. The message names the way out."""
