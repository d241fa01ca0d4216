"""The seam behind ``Receiver``: where frames come from (the local ring, a network peer, a foreign segment).

``Receiver`` owns what users see, once: the wait modes, ``recv``/``poll``/``recv_async``/``async for``,
timeouts, ``ProducerGone``/``LinkTimeout``, ``stats()``. A :class:`Source` owns only how it reaches one producer
and hands over frames: it attaches (and re-attaches after a restart) and returns an :class:`Attachment`, which
the facade's loops drive. The cut follows httpx's transports: each source is one module, and a mock source in
the tests drives the facade with no process at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from ..errors import ArgumentError, ArgumentTypeError

if TYPE_CHECKING:
    from ..frames.frame import Frame

__all__ = ["NO_TIME", "Attachment", "Copy", "Counters", "Source", "account", "copy_mode"]

#: ``attach``'s deadline where the caller gives no time at all (``poll()``), unlike a deadline that has just
#: passed: a source that needs a network round trip may start it in the background and say NoProducer meanwhile
NO_TIME = 0.0

#: when a source may copy a frame into memory the Receiver owns (see each source's docs for what ``auto`` means)
Copy = Literal["auto", "never", "always"]


class Counters(Protocol):
    """The part of a Receiver a source's ``receive`` updates, per frame."""

    latest: bool
    received: int
    skipped: int
    _last: int
    _floor: int


class Attachment(Protocol):
    """One producer generation as one Receiver sees it; lives until its last frame is released.

    ``receive`` and ``sleep_receive`` are plain functions on the class (staticmethods), so a compiled
    function can serve as the local ring's does; the Receiver binds them once per attach, not per frame.
    """

    generation: int  #: changes when the producer restarts (its seqs start again)
    backend: str  #: how frames reach us: "host", "cuda-pool", "cuda-legacy", "cuda-link", "ucx", ...
    capacity: int  #: bytes a frame may have
    floor: int  #: frames published before we joined: not counted as skipped
    #: how frames reach the Receiver, for ``stats()["path"]``: "zero-copy" (the producer's memory itself), or a
    #: copy into memory the Receiver owns ("copy", "peer", "staged", "same-device", "network", ...)
    path: str

    #: ``(rx, att) -> Frame | None``: take the next frame now, or None; never blocks
    receive: Callable[..., Frame | None]
    #: ``(rx, att, timeout, waiting, after) -> Frame | None``: flag ``waiting`` (``wire.WAIT_ON`` or
    #: ``WAIT_AHEAD``; a source with no wake-ahead treats both alike), sleep until a frame may be there or
    #: ``timeout`` seconds pass, flag ``after``, then take once
    sleep_receive: Callable[..., Frame | None]

    @property
    def device(self) -> str:
        """Where this Receiver's frames live: ``"cpu"`` or ``"cuda:N"``."""
        ...

    def closing(self) -> bool:
        """The producer announced shutdown."""
        ...

    def alive(self) -> bool:
        """Drain pending wake-ups; False once the producer is gone (its end of the channel closed)."""
        ...

    # Optional: ``reason`` (str), why the source ended where it knows more than "closed or died" (a remote
    # server's goodbye); the Receiver adds it to its ProducerGone.
    # Optional: ``spins`` (bool, default True): False where a thread of this process lands the frames (a
    # network source). The Receiver then sleeps on ``fileno()`` in every wait mode: a caller spinning with
    # the GIL would starve the very thread that brings its frame.
    # Optional: ``resumes`` (int, default 0): times a network source made its connection again to the same
    # producer (after a stall got it dropped); the Receiver's ``stats()["reconnects"]``.
    # Optional: ``interrupt()``: wake a recv waiting on this attachment (on another thread, or a task) without
    # leaving yet; ``Receiver.close()`` then lets that waiter leave. Returning False (or lacking it) says it
    # cannot: close() then leaves at once, as before.
    # Optional: ``last_published`` (int, 0 where not known): the seq of the producer's last frame, known at its
    # clean close (a remote server's goodbye). Frames after the last one taken, up to it, never come: at that
    # end the Receiver counts them as skipped. A local ring reads it from its header: its last frame may have been
    # claimed by a reserve() block that raised (its slot marked empty), and never be taken.
    # Optional: ``failure`` (a LinkError, or None): an error of this process's own that ended the source (a GPU
    # call that failed as a network source landed a frame). The Receiver raises it instead of ProducerGone: the
    # producer is not gone, and treating it as gone (waiting for a new one) would hit the same error again.
    # Optional: ``stall_hint()`` (str, "" for none): why no frame may come that is this Receiver's own doing (it
    # holds every slot); added to the LinkTimeout of a wait that ran out.

    def set_waiting(self, state: int) -> None:
        """Tell the producer whether (and how early) to wake us: ``wire.WAIT_OFF``/``WAIT_ON``/``WAIT_AHEAD``."""
        ...

    def count(self, received: int, skipped: int) -> None:
        """Publish this Receiver's counters for monitors (off the latency path; may do nothing)."""
        ...

    def fileno(self) -> int:
        """Readable when a frame may be waiting or the producer died: for selectors and event loops."""
        ...

    async def wait_async(self, timeout: float | None) -> None:
        """Return when :meth:`fileno` is readable or ``timeout`` seconds passed."""
        ...

    def detach(self) -> None:
        """Leave: now, or once the last frame still held is released."""
        ...


class Source(Protocol):
    """Where one Receiver's frames come from, for its whole life."""

    name: str

    def attach(self, deadline: float, dead_generation: int) -> Attachment:
        """Attach to the producer now. Raise ``transport.base.NoProducer`` to be retried until ``deadline``
        (``time.monotonic()``; :data:`NO_TIME` from ``poll()``); never attach to ``dead_generation``, the
        producer this Receiver saw die."""
        ...

    def close(self) -> None:
        """Give back what the source itself holds (attachments are detached by the Receiver)."""
        ...


def account(rx: Counters, seq: int) -> None:
    """Count one taken frame on ``rx``: every source's ``receive`` calls this (the ring's compiled twin inlines it).

    Frames between the last one taken (or the floor at attach) and ``seq`` were skipped.
    """
    last = rx._last
    # the floor (the producer's count as we joined) stands only until a first frame is taken: a latest=False
    # Receiver may first take older frames still in the slots, and then every frame after them that it never
    # got was skipped, the floor's own included
    floor = last if last else rx._floor
    if seq > floor + 1:
        rx.skipped += seq - floor - 1
    rx._last = seq
    rx.received += 1


def copy_mode(copy: object) -> Copy:
    """``copy=`` as given by a user (True/False or a word) as one of :data:`Copy`."""
    if copy is True:
        return "always"
    if copy is False:
        return "never"
    if copy in ("auto", "never", "always"):
        return copy  # type: ignore[return-value]
    kind = ArgumentError if isinstance(copy, str) else ArgumentTypeError
    raise kind(f"cudalink: copy must be 'auto', 'never' or 'always' (or True/False), got {copy!r}")
