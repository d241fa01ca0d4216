"""The bench's peers, one module each (cudalink itself, plain SharedMemory, the mp.Queue ones), and what
their consumers are told.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict, TypeVar

if TYPE_CHECKING:
    import multiprocessing.queues as mpq
    from multiprocessing.connection import Connection

    from ...link import WaitMode

PEER_MSG = struct.Struct("<QIq")  # seq, slot, publish time (time.time_ns)

FrameT = TypeVar("FrameT")

if TYPE_CHECKING:
    #: what an mp.Queue peer's consumers get: (seq, the shared tensor or Buffer, publish time), None at the end
    QueueItem = tuple[int, object, int] | None
    #: what travels beside a consumer's job: a pipe (shm), a queue (the mp.Queue peers), nothing (cudalink)
    Channel = Connection | mpq.Queue[QueueItem] | None


@dataclass(frozen=True)
class ConsumerJob:
    """What one bench consumer process does; its channel (pipe or queue) travels beside it."""

    peer: str  # "cudalink" | "shm" | "torch-mp" | "core-pickle"
    index: int
    name: str  # link name, or shared-memory segment name
    mode: str = "recv"  # "recv" (blocking receive) | "poll" (take a waiting frame + export) | "async"
    wait: WaitMode = "hybrid"
    ahead: bool = True  # Receiver(wake_ahead=...)
    latest: bool = True
    shape: tuple[int, ...] = ()
    dtype: str = "uint8"
    nslots: int = 4
    stride: int = 0
    device: int = -1
    lib: str = ""
    timeout: float = 30.0


class JobFields(TypedDict, total=False):
    """What a producer adds to its consumers' jobs."""

    nslots: int
    stride: int


class Source(Protocol[FrameT]):
    """A peer's consumer side: frames of type ``FrameT`` in, exported, handed back."""

    @property
    def skipped(self) -> int: ...

    def take(self) -> tuple[int, FrameT, int, int, int] | None:
        """(seq, frame, publish time, monotonic ns, wall ns), blocking; None once the producer is gone.

        The two clocks are read as soon as the frame is usable, before anything else (even reading its
        seq): the handoff ends where the receive call returns, not after the bench's own bookkeeping.
        """

    def ready(self, timeout: float) -> bool: ...

    def take_now(self) -> tuple[int, FrameT, int] | Literal[False] | None:
        """A waiting frame; False if none waits, None once the producer is gone."""

    def export(self, obj: FrameT) -> object: ...

    def done(self, obj: FrameT) -> None: ...

    def close(self) -> None: ...


class Producer(Protocol):
    """A peer's producer side, driven by the bench's parent process."""

    name: str

    def chan(self, i: int) -> Channel: ...

    def job_fields(self) -> JobFields: ...

    def wait_connected(self, k: int, timeout: float) -> None: ...

    def send(self, src: object) -> int | None:
        """Publish one frame copied from ``src`` (the bench's source: numpy on the CPU backend, the array
        library's array on a GPU); its seq, or None if it was dropped."""

    def close(self) -> None: ...

    def finish(self) -> None: ...
