"""Which :class:`~cudalink.transport.source.Source` serves a Receiver's name: one line per kind of address."""

from __future__ import annotations

from .base import Transport
from .ring_source import RingSource
from .source import Copy, Source

__all__ = ["open_source"]


def open_source(
    name: str, *, transport: Transport, device: int | str | None, copy: Copy, latest: bool = True
) -> Source:
    """The source for ``name``: a link of this host by default (which also refuses a name that is no name)."""
    # another host (issue 33); ``latest`` tells its server how to pick frames
    if isinstance(name, str) and name.startswith("ucx://"):
        from .ucx_source import UcxSource

        return UcxSource(name, device=device, copy=copy, latest=latest)
    if isinstance(name, str) and name.startswith("cuda-link:"):  # its own layout; the name taken as given
        from .cuda_link_source import CudaLinkSource

        return CudaLinkSource(name, device=device, copy=copy)
    return RingSource(name, transport, device=device, copy=copy)
