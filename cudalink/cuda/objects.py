"""What cudalink uses of cuda.core's objects, as Protocols.

cuda.core ships no type stubs, so mypy sees its classes as ``Any``. These Protocols name the few
members cudalink relies on; test fakes implement the same ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, SupportsInt

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import CapsuleType


class Event(Protocol):
    """A cuda.core ``Event``."""

    @property
    def handle(self) -> SupportsInt: ...

    @property
    def ipc_descriptor(self) -> object: ...

    @property
    def is_done(self) -> bool: ...

    def sync(self) -> None: ...


class Stream(Protocol):
    """A cuda.core ``Stream``."""

    @property
    def handle(self) -> SupportsInt: ...

    def sync(self) -> None: ...

    def record(self, event: Event | None = None, options: object = None) -> Event: ...

    def close(self) -> None: ...


class Device(Protocol):
    """A cuda.core ``Device``."""

    @property
    def device_id(self) -> int: ...

    @property
    def uuid(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def properties(self) -> object: ...

    def set_current(self) -> object: ...

    def create_stream(self, obj: object = None, options: object = None) -> Stream: ...


class Closable(Protocol):
    """A cuda.core ``Buffer`` that a slot keeps mapped (closed on the stream that last used it)."""

    def close(self, stream: Stream | None = None) -> None: ...


class StridedView(Protocol):
    """A cuda.core ``StridedMemoryView``: what :func:`cudalink.cuda.arrays.describe_array` reads of one."""

    @property
    def ptr(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def strides(self) -> tuple[int, ...] | None: ...

    @property
    def dtype(self) -> np.dtype[np.generic] | str | None: ...

    @property
    def device_id(self) -> int: ...

    @property
    def is_device_accessible(self) -> bool: ...

    @property
    def readonly(self) -> bool: ...

    def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None) -> CapsuleType: ...


class ViewFactory(Protocol):
    """cuda.core's ``StridedMemoryView`` class: how views are made."""

    def from_buffer(
        self, buffer: object, shape: tuple[int, ...], strides: tuple[int, ...] | None = None, **kw: object
    ) -> StridedView: ...

    def from_cuda_array_interface(self, obj: object, stream_ptr: int | None = None) -> StridedView: ...

    def from_dlpack(self, obj: object, stream_ptr: int | None = None) -> StridedView: ...
