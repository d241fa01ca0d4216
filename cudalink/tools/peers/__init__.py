"""The bench's peers, one module each (cudalink itself, plain SharedMemory, the mp.Queue ones), and what
their consumers are told.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PEER_MSG = struct.Struct("<QIq")  # seq, slot, publish time (time.time_ns)


@dataclass(frozen=True)
class ConsumerJob:
    """What one bench consumer process does; its channel (pipe or queue) travels beside it."""

    peer: str  # "cudalink" | "shm" | "torch-mp" | "core-pickle"
    index: int
    name: str  # link name, or shared-memory segment name
    mode: str = "recv"  # "recv" (blocking receive) | "poll" (take a waiting frame + export) | "async"
    wait: str = "hybrid"
    latest: bool = True
    shape: tuple[int, ...] = ()
    dtype: str = "uint8"
    nslots: int = 4
    stride: int = 0
    device: int = -1
    lib: str = ""
    timeout: float = 30.0
