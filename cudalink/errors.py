"""Every error cudalink raises derives from :class:`LinkError`, so one ``except`` catches them all."""

from __future__ import annotations

import enum
import math
import operator

import numpy as np

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "CudaError",
    "CudaUnavailable",
    "ExportError",
    "FormatError",
    "LandingFull",
    "LinkClosed",
    "LinkError",
    "LinkTimeout",
    "ProducerGone",
    "ProtocolError",
    "ProtocolReason",
]


class LinkError(Exception):
    """Base class of all cudalink errors."""


class LinkTimeout(LinkError, TimeoutError):
    """A bounded wait ran out (``recv``, attaching, a blocked ``send``)."""


class ProducerGone(LinkError):
    """The producer closed or died; the next ``recv`` re-attaches to a new producer if one appears.

    ``closed`` is True where it closed the link itself (every frame it published before was there to take),
    False where it died or nobody can tell."""

    def __init__(self, message: str = "", closed: bool = False) -> None:
        super().__init__(message)
        self.closed = closed

    def __reduce__(self) -> tuple[type, tuple[str, bool]]:
        return type(self), (str(self), self.closed)


class FormatError(LinkError, ValueError):
    """A frame, array or spec does not match what the link carries."""


class ExportError(LinkError, BufferError):
    """A frame cannot be exported as asked (released, another device, a stream DLPack forbids): DLPack's own
    error kind, which ``from_dlpack`` callers expect, and a LinkError as every other of ours."""


class ArgumentError(LinkError, ValueError):
    """An argument's value is out of range or not one of its choices (``slots=0``, ``policy="never"``)."""


class ArgumentTypeError(LinkError, TypeError):
    """An argument is missing or of the wrong type (``slots="4"``, no ``shape=``)."""


def seconds_arg(value: object, what: str, example: str, none_ok: bool = False, unit: str = "seconds") -> float:
    """A duration argument, >= 0 (``None`` = no limit, ``math.inf``, where ``none_ok``): the one check every
    public timeout goes through, here at the bottom layer so any module may call it."""
    if value is None and none_ok:
        return math.inf
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(
            f"cudalink: {what} must be a number of {unit}{' or None (no limit)' if none_ok else ''}, "
            f"got {type(value).__name__} {value!r}; pass e.g. {example}"
        )
    try:
        out = float(value)
    except OverflowError:  # an integer past float's range: longer than any wait, as inf is
        out = math.inf if value > 0 else -math.inf
    if math.isnan(out) or out < 0:
        raise ArgumentError(f"cudalink: {what} must be >= 0 {unit}, got {value!r}; pass e.g. {example}")
    return out


def int_arg(value: object, what: str, lo: int, hi: int, example: str) -> int:
    """An integer argument in ``lo..hi``: a TypeError-kind error for another type, a ValueError-kind for range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        span = f" from {lo} to {hi}" if hi < 2**31 else ""
        raise ArgumentTypeError(
            f"cudalink: {what} must be an integer{span}, got {type(value).__name__} {value!r}; pass e.g. {example}"
        )
    if not lo <= int(value) <= hi:
        raise ArgumentError(f"cudalink: {what} must be {lo}..{hi}, got {value!r}; pass e.g. {example}")
    return int(value)


def timestamp_arg(ts: object) -> int | None:
    """A caller's frame timestamp: an int (numpy ints too) in 0..2**64-1, or None for the publish time (every
    producer's ``send()`` and ``reserve()``, here at the bottom layer so any module may call it)."""
    if ts is None:
        return None
    try:
        value = operator.index(ts)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if isinstance(ts, bool) or not 0 <= value < 1 << 64:
        raise FormatError(
            f"cudalink: timestamp_ns must be an int of nanoseconds in 0..2**64-1 (e.g. time.time_ns()), got {ts!r}"
        )
    return value


class ProtocolReason(enum.Enum):
    """Why a :class:`ProtocolError` was raised. Code branches on this, never on the message."""

    CORRUPT = "corrupt"  #: shared state or a message breaks the layout's rules (or another version's)
    REFUSED = "refused"  #: the producer refused with a code this version does not know
    STALE_GENERATION = "stale-generation"  #: we read the header of an earlier producer: re-read it
    FULL = "full"  #: every consumer entry is taken
    WRONG_USER = "wrong-user"  #: links are private to the user that created them
    BAD_HELLO = "bad-hello"  #: the producer could not accept our HELLO
    CLOSING = "closing"  #: the producer is shutting down
    STALE_KEY = "stale-key"  #: the loopback rendezvous file changed (the producer restarted): re-read it

    @property
    def retryable(self) -> bool:
        """The producer restarted or is going away: attaching again (to the next one) can succeed."""
        return self in (ProtocolReason.STALE_GENERATION, ProtocolReason.CLOSING, ProtocolReason.STALE_KEY)


class ProtocolError(LinkError):
    """Shared state or a control message is corrupt, foreign or from an incompatible version.

    ``reason`` (a :class:`ProtocolReason`) says which; the message is for people.
    """

    def __init__(self, message: str, reason: ProtocolReason = ProtocolReason.CORRUPT) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type[ProtocolError], tuple[str, ProtocolReason]]:
        return type(self), (str(self), self.reason)


class LandingFull(LinkError):
    """Every buffer of a landing pool (frames copied to this Receiver's GPU) is held by a frame, or a tensor
    made from one, that was never released."""


class LinkClosed(LinkError):
    """The object was used after ``close()``."""


class CudaUnavailable(LinkError, RuntimeError):
    """No usable CUDA driver/GPU, or the GPU lacks a needed feature. The message names the way out."""

    #: where the message ends with the advice to use ``device='cpu'`` (no usable GPU here), the text before
    #: that advice; else None. What refuses the host backend (cuda-link) gives its own advice there instead
    before_cpu_advice: str | None = None


class CudaError(LinkError):
    """A CUDA driver call failed. ``result`` is its ``CUresult`` code, ``name`` the driver's name for it."""

    def __init__(self, message: str, result: int, name: str) -> None:
        super().__init__(message)
        self.result = result
        self.name = name

    def __reduce__(self) -> tuple[type[CudaError], tuple[str, int, str]]:
        return type(self), (str(self), self.result, self.name)
