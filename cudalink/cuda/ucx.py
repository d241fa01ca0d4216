"""The CUDA side of serving frames over UCX: wait for a frame's data without blocking the server's loop.

UCXX reads GPU memory through ``__cuda_array_interface__`` and ignores its ``stream``, so the server must
know the frame is complete first: it records a marker event on the stream that waits on the frame's
ready event, and polls it (``cuEventQuery``) between its other work.
"""

from __future__ import annotations

from typing import Any, SupportsInt, cast

from . import devices, driver


class DeviceBytes:
    """``nbytes`` of GPU memory at ``ptr`` as UCXX takes them (CAI v3 without a stream: the caller has
    ordered everything before posting)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "stream": None,
        }


def use_device(ordinal: int) -> None:
    """Make GPU ``ordinal`` current on this thread (the UCX loop's, before it touches CUDA)."""
    devices.device(ordinal)


def mark(stream: object) -> tuple[Any, Any]:
    """A fresh event recorded on ``stream`` (an int handle, or None for the legacy default stream)."""
    ev = driver.new_event()
    h = int(cast(SupportsInt, ev)) if driver.compiled() else ev  # the compiled calls take the handle as an int
    driver.record(h, 1 if stream is None else int(cast(SupportsInt, stream)))
    return ev, h


def done(marker: tuple[Any, Any]) -> bool:
    return driver.event_done(marker[1])


def forget(marker: tuple[Any, Any]) -> None:
    driver.destroy_event(marker[0])
