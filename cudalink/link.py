"""``Sender`` and ``Receiver``: the thin facade users hold. Protocol in ``_ring``, memory in ``_backends``."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import os
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing import util as _mp_util
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import numpy as np
from numpy.typing import DTypeLike

from . import _backends, _platform, _trace
from ._ring import mask_bits, producer_ring
from .cuda import driver
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    CudaError,
    FormatError,
    LinkClosed,
    LinkError,
    LinkTimeout,
    ProducerGone,
    ProtocolError,
    int_arg,
    timestamp_arg,
)
from .errors import seconds_arg as _seconds_arg
from .frames.frame import Frame
from .frames.spec import MAX_NBYTES, META_MAX, FrameSpec, PixelFormat, RowOrigin, check_meta_size
from .transport import ring_source, ucx_engine, wire
from .transport.base import UNVERIFIED_UID, NoProducer, Peer, Reply, ServerHandler, Transport
from .transport.shm import SharedMemoryTransport
from .transport.source import NO_TIME, Attachment, Copy, Source, copy_mode
from .transport.sources import open_source

if TYPE_CHECKING:
    from .cuda.driver import RawEvent
    from .cuda.objects import Event, Stream

__all__ = ["Receiver", "Sender"]

Policy = Literal["drop", "block"]
#: what ``send``/``reserve`` take as a frame's meta: bytes-like, at most ``META_MAX`` bytes; None for none
Meta = bytes | bytearray | memoryview | None
WaitMode = Literal["spin", "block", "hybrid"]

_default_transport: Transport | None = None
_perf_ns = time.perf_counter_ns
_AHEAD_SPIN_S = wire.AHEAD_SPIN_NS / 1e9
_AHEAD_CLAMP_NS = 2 * wire.AHEAD_MAX_NS  # one stalled send moves the moving average of send times little
#: a host copy too long to wake ahead of (a 1080p memcpy: about a millisecond) wakes who asked this long
#: before its end instead: an OS wake on a busy two-core box (55 µs p50 measured, its write syscall 20+),
#: with room, so the consumer is running, spinning, when the frame lands
_LATE_LEAD_NS = 150_000
_COPY_CLAMP_NS = 100_000_000
#: the message of the cancel with which close() ends a recv_async() waiting on a loop that did not run then
_WOKEN_BY_CLOSE = "cudalink: Receiver.close() ended this recv_async()"
#: the longest one sleep inside ``recv`` (it loops while time is left): every source's wait takes it
_LONGEST_SLEEP_S = 3600.0
_SPIN_BURST = 63  # takes per spin burst between deadline checks and GIL hand-overs
#: a consumer that always finds a frame waiting never sleeps, where it tells monitors its counts: it tells them
#: every 8th frame instead (a mask on ``received``)
_COUNT_EVERY = 7
T = TypeVar("T")


#: Senders still open, closed at interpreter exit (a script that simply ends leaves nothing behind); weak,
#: so the registry never keeps a Sender alive. Only atexit: a library must not take the application's signals.
_open_senders: weakref.WeakSet[Sender] = weakref.WeakSet()
_atexit_registered = False
_mp_hooked_pid = 0  #: the process whose multiprocessing exit hooks close its Senders (see _register_open)
#: the interpreter is ending (set by the exit-time close): a close() then waits for the Sender's lock at most its
#: timeout, since daemon threads run on meanwhile and a reserve() block of theirs may never end
_exiting = False


def _close_at_exit() -> None:
    global _exiting
    _exiting = True
    pid = os.getpid()
    # this process's own consumers first: a Sender closing waits for its GPU consumers to unmap, and one of
    # ours, idle as the interpreter ends, would never answer (a forked child's set holds only its own)
    for rx in list(_open_receivers):
        with contextlib.suppress(Exception):
            rx.close()
    for tx in list(_open_senders):
        if tx._pid != pid:  # a forked child exiting must not tear down its parent's link
            continue
        with contextlib.suppress(Exception):
            tx.close()


#: Receivers not closed, for the fork hook below (weak, as the Senders')
_open_receivers: weakref.WeakSet[Receiver] = weakref.WeakSet()


def _forget_in_forked_child() -> None:
    """A forked child (``multiprocessing``'s fork, a DataLoader worker) inherits copies of every link's lock
    and sockets: while it lives, a killed parent would look alive to its peers (the lock held, no EOF). The
    child closes its copies, never unlocking or shutting down what the parent still uses, and its copies of
    the links are closed here: they belong to the parent."""
    links: list[Sender | Receiver] = [*_open_senders, *_open_receivers]
    for link in links:
        with contextlib.suppress(Exception):
            link._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)


def _forked_note(link: object) -> str:
    """Why a link is closed in a forked child, for its errors."""
    if getattr(link, "_forked", False):
        return " in this process: it was made in the process this one was forked from, and stays that one's"
    return ""


def _register_open(tx: Sender) -> None:
    global _atexit_registered, _mp_hooked_pid
    if not _atexit_registered:
        # registered with the first Sender, after the CUDA packages it loaded registered theirs: atexit runs
        # in reverse, so Senders close (and free their GPU memory) before cuda.core tears itself down
        atexit.register(_close_at_exit)
        _atexit_registered = True
    if _mp_hooked_pid != os.getpid():
        # a multiprocessing child started by fork or forkserver ends in os._exit, where atexit never runs; its
        # exit hooks do run (once per process: a forked child starts with its parent's cleared)
        _mp_hooked_pid = os.getpid()
        _mp_util.Finalize(None, _close_at_exit, exitpriority=0)
    _open_senders.add(tx)


def _secs(value: float) -> str:
    """A duration for a message: ``0.3s``, not ``0.2999986300001183s`` (what is left of a deadline)."""
    value += 0.0  # -0.0 reads as 0
    return f"{value:.3g}s" if value < 100 else f"{value:.0f}s"


class _Default:
    """``timeout=`` not given to ``recv``/``recv_async``: the Receiver's own (``None`` given: no limit, as the
    README and Python's own blocking calls have it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<the Receiver's timeout>"


_RECEIVER_TIMEOUT: Any = _Default()


def _call_timeout(timeout: object) -> float:
    """A ``timeout=`` given to one call (``recv``, ``send``, ...): checked as the constructors check theirs."""
    if timeout.__class__ is float and timeout >= 0.0:  # type: ignore[operator]  # NaN fails this test too
        return timeout  # type: ignore[return-value]
    return _seconds_arg(timeout, "timeout", "timeout=1.0", none_ok=True)


def _choice_arg(value: object, what: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"cudalink: {what} must be one of {', '.join(map(repr, choices))}, got {type(value).__name__} {value!r}"
        )
    if value not in choices:
        raise ArgumentError(f"cudalink: {what} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _bool_arg(value: object, what: str) -> bool:
    """True or False (numpy's bools, and 0 or 1, as a TouchDesigner toggle may give, too): a word such as "no"
    is truthy and would quietly mean the opposite."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise ArgumentTypeError(f"cudalink: {what} must be True or False, got {type(value).__name__} {value!r}")


class _NoName:
    """``name`` left out: refused as a missing argument of ours (an ArgumentTypeError, a LinkError) rather than
    Python's bare TypeError, which an ``except cudalink.LinkError`` would let through."""

    def __repr__(self) -> str:
        return "<no name>"

    @staticmethod
    def check(name: object, what: str, extra: tuple[object, ...] = (), example: str = "...") -> None:
        if isinstance(name, _NoName):
            raise ArgumentTypeError(f"cudalink: {what} needs a link name first, e.g. {what}('cam0', ...)")
        if extra:  # Python's own "takes 2 positional arguments but 3 were given" is no LinkError either
            raise ArgumentTypeError(
                f"cudalink: {what} takes only the link name by position, and got {len(extra)} more "
                f"({', '.join(repr(a) for a in extra)}); pass the rest by keyword, e.g. {what}('cam0', {example})"
            )


_NO_NAME: Any = _NoName()


def _plugin_arg(value: T, what: str, needs: tuple[str, ...], example: str) -> T:
    """A pluggable part (``transport=``, ``source=``), duck-typed as the protocols are: one without the methods
    it must have is refused here, not with an AttributeError from deep inside the first call that uses it."""
    if value is not None and not all(callable(getattr(value, n, None)) for n in needs):
        raise ArgumentTypeError(
            f"cudalink: {what}= takes an object with {', '.join(f'{n}()' for n in needs)}, got "
            f"{type(value).__name__} {value!r}; pass e.g. {example}, or leave it out for the default"
        )
    return value


def _transport_arg(transport: Transport | None) -> Transport | None:
    return _plugin_arg(transport, "transport", ("serve", "connect"), "SharedMemoryTransport('tcp')")


def default_transport() -> Transport:
    global _default_transport
    if _default_transport is None:
        _default_transport = SharedMemoryTransport()
    return _default_transport


# ============================================================================================ Sender


class _Handler(ServerHandler):
    """Runs on the transport's control thread: admits consumers, reclaims the leases of those who leave."""

    def __init__(self, sender: Sender) -> None:
        # not a cycle: a Sender the application drops goes at once (with its mappings and fds), not when the
        # cycle collector next runs
        self.sender: Sender = weakref.proxy(sender)
        self.conns: dict[int, int] = {}
        self.pids: dict[int, int] = {}  #: each connection's process (a ``serve=`` server's are waited for at close)
        #: for the hot path, swapped whole on each change: joined consumers' indexes as a bit mask, and
        #: each index's connection
        self.joined = 0
        self.conn_at: dict[int, int] = {}
        #: a wake-up's calls (``Server.wakers``) by the mask of consumers it wakes, filled as masks come: a
        #: stream of frames wakes the same few masks, and a dict hit is the cheapest step on a cold-cache path
        self.wakers_of: dict[int, list[Callable[[], object]]] = {}
        self.lock = threading.Lock()

    def on_hello(self, conn: int, message: bytes, peer: Peer) -> Reply:
        s = self.sender
        try:
            hello = wire.unpack_hello(message)
        except ProtocolError as exc:
            return Reply(wire.pack_reject(wire.REJECT_BAD_HELLO, str(exc)), accepted=False)
        if peer.uid == UNVERIFIED_UID:
            return Reply(
                wire.pack_reject(wire.REJECT_KEY, "wrong rendezvous key (the producer restarted); re-read it"),
                accepted=False,
            )
        if peer.uid != _platform.uid():
            return Reply(
                wire.pack_reject(wire.REJECT_UID, "links are private to the user that created them"),
                accepted=False,
            )
        if hello.generation != s.generation:
            return Reply(wire.pack_reject(wire.REJECT_GENERATION, "stale header; re-read it"), accepted=False)
        with self.lock:  # closing is read under the lock close() reads ``conns`` under (see Sender.close)
            if s._closing:
                return Reply(wire.pack_reject(wire.REJECT_CLOSING, "producer is closing"), accepted=False)
            index = s._ring.free_index()
            if index is None:
                return Reply(
                    wire.pack_reject(
                        wire.REJECT_FULL,
                        f"all {s._layout.nconsumers} consumer places taken; "
                        "create the Sender with a larger max_consumers",
                    ),
                    accepted=False,
                )
            s._join_consumer(index, peer.pid or hello.pid, hello.token)
            self.conns[conn] = index
            self.pids[conn] = peer.pid or hello.pid
            self._swap()
        fds = tuple(s._slots.fds())
        return Reply(wire.pack_welcome(wire.Welcome(index, s.generation, len(fds))), fds)

    def on_leave(self, conn: int) -> None:
        with self.lock, contextlib.suppress(ReferenceError):  # the Sender gone (collected): nothing to reclaim
            index = self.conns.pop(conn, None)
            self.pids.pop(conn, None)
            self._swap()
            if index is not None:
                self.sender._forget_consumer(index)
            self.sender._released.set()

    def on_hint(self) -> None:
        with contextlib.suppress(ReferenceError):
            self.sender._released.set()

    def _swap(self) -> None:
        """Publish who is joined for the hot path: a new dict first, then the mask that names its keys."""
        self.conn_at = {index: conn for conn, index in self.conns.items()}
        self.wakers_of = {}  # after conn_at: a sender that sees this dict fills it from the new conn_at
        self.joined = sum(1 << index for index in self.conns.values())


class Sender:
    """Publishes frames of one spec (changeable with :meth:`reconfigure`) to any number of Receivers.

    ``device="cpu"`` keeps frames in shared host memory; ``device=0`` (or ``"cuda:0"``) allocates the slots
    from a cuda.core IPC memory pool and orders everything with IPC events, never blocking the CPU.
    ``policy`` says what ``send`` does when consumers hold every slot: ``"drop"`` the frame (counted) or
    ``"block"`` up to ``timeout`` seconds.
    """

    def __new__(cls, name: str = _NO_NAME, *args: object, protocol: str = "cudalink", **kwargs: object) -> Sender:
        """``protocol="cuda-link"`` makes a :class:`~cudalink.cuda_link.CudaLinkSender` (same API, cuda-link's
        segment layout, for its TouchDesigner components and importers)."""
        _NoName.check(name, "Sender", args, "shape=(480, 640, 3), dtype='uint8'")
        if protocol == "cuda-link":
            from .cuda_link import CudaLinkSender

            return cast("Sender", CudaLinkSender(name, protocol=protocol, **kwargs))  # type: ignore[arg-type]
        if protocol != "cudalink":
            raise ArgumentError(f"cudalink: protocol must be 'cudalink' or 'cuda-link', got {protocol!r}")
        return super().__new__(cls)

    def __init__(
        self,
        name: str = _NO_NAME,
        *,
        shape: tuple[int, ...] | list[int] | None = None,
        dtype: DTypeLike = "uint8",
        slots: int = 4,
        device: int | str = "cpu",
        pixel_format: PixelFormat | str | None = None,
        origin: RowOrigin | str = RowOrigin.TOP,
        strides: tuple[int, ...] | None = None,
        capacity: int | None = None,
        policy: Policy = "drop",
        timeout: float = 1.0,
        max_consumers: int = 16,
        handles: str = "auto",
        transport: Transport | None = None,
        protocol: str = "cudalink",
        serve: str | None = None,
    ) -> None:
        # every argument is checked before anything is made: a cudalink error that is also the
        # ValueError / TypeError Python users expect, naming the fix
        self.name = _platform.check_name(name)
        if shape is None:
            raise ArgumentTypeError(
                f"cudalink: Sender({name!r}) needs the frame shape, e.g. shape=(1080, 1920, 4) with dtype='uint8'"
            )
        if serve is not None:  # before anything is allocated: a bad address or a missing extra fails first
            ucx_engine.check_listen(serve)
            # the key exists once we return (its server would make it a moment later): a Receiver made
            # right after this, on this host, finds it
            ucx_engine.announce_key(ucx_engine.load_key(create=True)[1])
        self._spec = FrameSpec(shape, dtype, strides, pixel_format, origin)
        policy = _choice_arg(policy, "policy", ("drop", "block"))  # type: ignore[assignment]
        slots = int_arg(slots, "slots", 1, wire.MAX_SLOTS, "slots=4")
        max_consumers = int_arg(max_consumers, "max_consumers", 1, wire.MAX_CONSUMERS, "max_consumers=16")
        nbytes = self._spec.nbytes
        cap = nbytes  # at most a frame's own limit (MAX_NBYTES): past it, shared_memory overflowed
        if capacity is not None:
            cap = int_arg(capacity, "capacity", 0, MAX_NBYTES, f"capacity={nbytes}")
        if cap < nbytes:
            raise ArgumentError(
                f"cudalink: capacity {cap} is smaller than one frame ({nbytes} bytes); pass capacity={nbytes} or more"
            )
        timeout = _seconds_arg(timeout, "timeout", "timeout=1.0", none_ok=True)
        _choice_arg(handles, "handles", ("auto", "pool", "legacy"))
        transport = _transport_arg(transport)
        if not (isinstance(device, str) and device == "cpu"):
            from .cuda import devices

            devices.parse_device(device)
        self.policy: Policy = policy
        self.timeout = timeout
        self.capacity = cap
        self.generation = secrets.randbits(63) | 1
        self._layout = wire.Layout(slots, max_consumers)
        self._seq = 0
        self._closing = False
        self._closed = False
        self._final_stats: dict[str, int] | None = None  # stats() once closed
        self._lock = threading.RLock()
        self._released = threading.Event()
        #: send_async()'s cancel flags, by the thread that runs each send: a cancelled one stops waiting for a slot
        self._abandons: dict[int, threading.Event] = {}
        self._reserved = 0  # slots open reserve() blocks write (bit i: slot i): never claimed until they end
        #: a close() called inside this thread's own reserve() block: (its timeout,), done as the block ends
        self._close_after_block: tuple[float | None] | None = None
        #: per (consumer index, slot): that consumer's imported release event, with the token of the consumer
        #: it came from. Items are replaced whole (atomic under the GIL), so the control thread's leave never
        #: races a send iterating a dict.
        self._fence_events: list[tuple[int, Event, RawEvent] | None] = [None] * (slots * max_consumers)
        self._tokens = [0] * max_consumers  # the token of the consumer at each index, written as it joins
        #: wake sleepers when a send has claimed its slot, so their OS wake overlaps the copy; only while
        #: sends finish soon after (a moving average, claim -> publish), since the woken consumer spins
        self._ahead = True
        self._send_ns = 0
        self._copy_ns = 0  # host sends' claim -> publish, clamped at 100 ms only: where _copy_late cuts the copy
        self._transport = transport or default_transport()
        self._slots = _backends.make_producer_slots(device, slots, cap, handles, self._transport.passes_fds)
        self.device = "cpu" if device == "cpu" else f"cuda:{self._slots.device}"
        self._host = self._slots.backend == wire.BACKEND_HOST
        try:
            self._server = self._transport.serve(self.name, self._layout.size, self._slots.data_size, self.generation)
        except BaseException:
            self._slots.close(0)
            raise
        self._slots.bind(self._server.data_segment)
        buf = self._server.header
        for slot, h in enumerate(self._slots.handles()):
            wire.pack_handle(buf, self._layout.handle(slot), h)
        now = time.time_ns()
        wire.write_fixed(
            buf,
            wire.Fixed(
                self._slots.backend,
                self._layout.size,
                self.generation,
                os.getpid(),
                wire.FLAG_READY,
                slots,
                max_consumers,
                self._slots.device,
                cap,
                0,
                0,
                0,
                now,
                self._slots.device_uuid,
                self._slots.data_size,
            ),
        )
        self._ring = producer_ring(buf, self._layout)
        self._handler = _Handler(self)
        self._server.start(self._handler)
        self._pid = os.getpid()
        _register_open(self)
        #: ``serve=``: the UCX server for remote consumers, in a process of its own (its own GIL)
        self._remote: Any = None
        if serve is not None:
            try:
                self._remote = ucx_engine.spawn_server(self.name, serve)
            except BaseException:
                self.close()
                raise

    # -- properties -----------------------------------------------------------------------------------

    @property
    def spec(self) -> FrameSpec:
        return self._spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype[np.generic]:
        return self._spec.dtype

    @property
    def slots(self) -> int:
        return self._layout.nslots

    @property
    def seq(self) -> int:
        """Sequence number of the last published frame."""
        return self._seq

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stream(self) -> Stream | None:
        """The link's own CUDA stream (cuda.core ``Stream``), or None on CPU links."""
        return self._slots.stream

    def stats(self) -> dict[str, int]:
        """``published`` frames; ``dropped``: frames not published because consumers held every slot (dropped
        by policy='drop', or a policy='block' send or reserve that timed out); ``consumers`` attached now."""
        final = self._final_stats
        if final is not None:  # closed: the header's memory went back to the OS
            return dict(final)
        buf = self._server.header
        return {
            "published": wire.read_u64(buf, wire.OFF_PUBLISHED),
            "dropped": wire.read_u64(buf, wire.OFF_DROPPED),
            "consumers": self._server.connection_count(),
        }

    def __repr__(self) -> str:
        return f"<cudalink.Sender {self.name!r} {self._spec.label} slots={self.slots} {self.device}>"

    def __reduce__(self) -> tuple[object, ...]:
        """Refused clearly: ``multiprocessing`` pickles what it passes to a child, and a Sender is this process's."""
        raise ArgumentTypeError(
            f"cudalink: a Sender can't be pickled or passed to another process; make Sender({self.name!r}, ...) in "
            "the process that produces the frames"
        )

    # -- publishing -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LinkClosed(f"cudalink: Sender {self.name!r} is closed; create a new one{_forked_note(self)}")

    def _checked(self, meta: object, timestamp_ns: object) -> tuple[bytes, int | None]:
        """Refuse what cannot be published, before a slot or a seq is taken: a closed link, meta that is not
        bytes-like or too long, a timestamp that is not a u64. Returns them as the ring writes them."""
        self._check_open()
        return _meta_bytes(meta), timestamp_arg(timestamp_ns)

    def _claim(self, timeout: float | None) -> int | None:
        slot = self._ring.claim(self._seq + 1, self._reserved)
        if slot is None and self._reserved:
            self._check_own_reservations()
        if slot is not None or self.policy == "drop":
            return slot
        return self._claim_waiting(timeout)

    def _check_own_reservations(self) -> None:
        """No slot was free and this thread's open ``reserve()`` blocks write some (the block holds the lock,
        so only its own thread gets here): where they write every slot, no consumer can ever free one, and
        waiting (or dropping frame after frame) would only hide the mistake."""
        n = self._layout.nslots
        if self._reserved == (1 << n) - 1:
            raise LinkError(
                f"cudalink: every slot of {self.name!r} ({n}) is being written by an open reserve() block of this "
                f"Sender; a send() or reserve() inside it needs a free slot: make the link with slots={n + 1} "
                "or more, or leave the block first"
            )

    def _claim_waiting(self, timeout: float | None) -> int | None:
        """policy='block' with every slot held: wait (bounded) for a consumer to release one (``timeout`` was
        checked by the call that took it: ``send`` or ``reserve``)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self._ring.set_flag(wire.FLAG_PRODUCER_WAITING, True)
        try:
            while True:
                self._released.clear()
                if self._closing:
                    raise LinkClosed(f"cudalink: Sender {self.name!r} was closed while this send waited for a slot")
                if self._abandons:
                    self._check_abandoned()
                slot = self._ring.claim(self._seq + 1, self._reserved)
                if slot is not None:
                    return slot
                left = deadline - time.monotonic()
                if left <= 0:
                    self._ring.count_drop()  # a frame not published, as policy='drop' counts its own
                    raise LinkTimeout(
                        f"cudalink: every slot of {self.name!r} stayed held by consumers for {_secs(limit)} "
                        "(policy='block'); release frames sooner, add slots, or use policy='drop'"
                    )
                self._released.wait(min(left, 0.01))
        finally:
            self._ring.set_flag(wire.FLAG_PRODUCER_WAITING, False)

    def _check_abandoned(self) -> None:
        abandon = self._abandons.get(threading.get_ident())
        if abandon is not None and abandon.is_set():
            raise LinkTimeout("cudalink: send_async() was cancelled before its frame was sent; nothing was sent")

    def _fences(self, slot: int, consumers: list[int]) -> list[RawEvent]:
        """Raw handles of the release events ``consumers`` (``take_fences(slot)``) left on ``slot`` that the
        GPU has not passed yet.

        Each event is imported once and kept.

        A fence whose event has completed orders nothing: in a steady stream the consumer's reads ended
        long before the slot comes round again, so a query replaces a stream wait.
        """
        if self._host or not consumers:  # host consumers never fence: their release is the lease alone
            return []
        out = []
        events = self._fence_events
        nslots = self._layout.nslots
        for c in consumers:
            token = self._tokens[c]
            got = events[c * nslots + slot]
            if got is None or got[0] != token:  # first fence, or a new consumer in that place
                raw, flag = wire.RELEASE.unpack_from(self._server.header, self._layout.release_handle(c, slot))
                try:
                    ev = driver.import_event(bytes(raw), flag)
                except LinkError:
                    continue  # that consumer is gone; nothing of its can still be queued on our memory
                got = events[c * nslots + slot] = (token, ev, driver.raw(ev))  # the Event owns the handle
            if not driver.event_done(got[2]):
                out.append(got[2])
        return out

    def _join_consumer(self, index: int, pid: int, token: int) -> None:
        self._tokens[index] = token  # before its first fence can exist: a cached event of another token is stale
        self._ring.join(index, pid, token)

    def _forget_consumer(self, index: int) -> None:
        self._ring.leave(index)
        n = self._layout.nslots
        for k in range(index * n, index * n + n):
            self._fence_events[k] = None

    def send(
        self,
        array: object,
        *,
        stream: object = None,
        timestamp_ns: int | None = None,
        meta: Meta = b"",
        timeout: float | None = None,
    ) -> int | None:
        """Copy ``array`` into the next free slot and publish it; returns its seq, or None if dropped.

        On CUDA links the copy is queued on ``stream`` and the CPU never waits for it. Without one, a
        torch tensor is copied on torch's current stream (after its producer, with nothing to order);
        other arrays, and any send while a consumer's release fence is pending, use the link's stream,
        ordered after the array's producer through DLPack/CAI.

        ``meta`` is bytes-like (bytes, bytearray, memoryview; None for none), at most ``META_MAX`` bytes;
        ``timestamp_ns`` an int (default: the publish time). What cannot be sent (a closed link, another meta
        type, an array of another shape, dtype or device) is refused before a slot or a seq is taken, so a
        refused send leaves the link as it was: :class:`LinkClosed` or :class:`FormatError`.
        """
        if _trace.ON:
            _trace.mark(_trace.SEND_ENTERED)
        with self._lock:
            # everything a send can refuse is refused here, before a slot or a seq is taken
            if self._closed or meta.__class__ is not bytes or len(meta) > META_MAX or timestamp_ns is not None:
                meta, timestamp_ns = self._checked(meta, timestamp_ns)
            if timeout is not None:
                timeout = _call_timeout(timeout)
            if self._abandons:  # a send_async() cancelled while it waited for this lock sends nothing
                self._check_abandoned()
            spec = self._spec
            checked = self._slots.source(spec, array, stream)
            slot = self._ring.claim(self._seq + 1, self._reserved)  # _claim(), its common case inlined
            if slot is None and self._reserved:
                self._check_own_reservations()
            if slot is None and self.policy == "block":
                slot = self._claim_waiting(timeout)
            if slot is None:
                self._ring.count_drop()
                return None
            # From here to the return this is one flat run of calls, each into compiled code where it was
            # built: at a 2 ms cadence every step runs with cold caches, and each Python call level costs
            # microseconds then. ``_publish`` is the same tail, for reserve().
            t0 = _perf_ns()
            ring = self._ring
            woke = 0
            try:
                if self._ahead:  # wake who asked for it now, before the copy: they spin for the publish
                    woke = ring.wake_ahead(self._handler.joined)
                    if woke:
                        self._wake(woke, _trace.WAKING_AHEAD, _trace.AHEAD_SENT)
                fenced = ring.take_fences(slot)  # consumers that fenced it (a query each; usually none)
                fences = self._fences(slot, fenced) if fenced else []
                if _trace.ON:
                    _trace.mark(_trace.SLOT_CLAIMED)
                if self._ahead or not self._host:
                    self._slots.copy_in(slot, spec, array, stream, fences, checked)
                else:
                    woke = self._copy_late(slot, spec, checked)
            except BaseException:
                ring.abort(slot)
                raise
            # one stalled send moves the average little (clamped, 1/16): waking ahead stops only when
            # sends stay slow, as a 4K host memcpy does. Learned before the publish, not between it and
            # the wake-up, where every step adds to the handoff.
            dt = _perf_ns() - t0
            if self._host:
                self._copy_ns += ((dt if dt < _COPY_CLAMP_NS else _COPY_CLAMP_NS) - self._copy_ns) >> 3
            dt = dt if dt < _AHEAD_CLAMP_NS else _AHEAD_CLAMP_NS
            avg = self._send_ns = self._send_ns + ((dt - self._send_ns) >> 4)
            self._ahead = avg < wire.AHEAD_MAX_NS
            seq = self._seq + 1
            ring.publish(slot, seq, timestamp_ns, spec, meta)  # ends with a full fence: see _publish
            self._seq = seq
            if _trace.ON:
                _trace.mark(_trace.PUBLISHED)
            # the wake-up last: a consumer it wakes usually runs on this core, once we stop running
            asleep = ring.sleepers(self._handler.joined)
            if asleep:
                self._wake(asleep, _trace.WAKING, _trace.WAKE_SENT)
            if woke and ring.woken_ahead(woke):
                # A consumer woken ahead has not run since (it clears its mark as it runs). Where the OS
                # queued it behind this thread on our own core (a 2-vCPU VM: 97% of frames), it would start
                # only once we stop; hand the core over now. Where it is merely waking elsewhere, this
                # returns at once. 2-vCPU VM, bench --quick: the woken-ahead handoff 44-48 -> 25-27 us.
                _platform.yield_core()
            return seq

    def _copy_late(self, slot: int, spec: FrameSpec, checked: object) -> int:
        """A host copy too slow to wake ahead of: wake who asked _LATE_LEAD_NS before it ends (the copy in
        two parts, the wake-up between), so that OS wake overlaps the copy's tail instead of following the
        publish. Sends average ``_copy_ns``; how far in to wake is read from it. Returns who was woken."""
        avg = self._copy_ns
        nbytes = spec.nbytes
        cut = nbytes - nbytes * _LATE_LEAD_NS // avg if avg > _LATE_LEAD_NS else 0
        host = cast(_backends.HostSlots, self._slots)
        woke: list[int] = []
        host.copy_split(slot, spec, checked, cut, lambda: woke.append(self._wake_ahead()))
        return woke[0] if woke else 0

    def _wake_ahead(self) -> int:
        woke = self._ring.wake_ahead(self._handler.joined)
        if woke:
            self._wake(woke, _trace.WAKING_AHEAD, _trace.AHEAD_SENT)
        return woke

    def _wake(self, mask: int, waking: str, sent: str) -> None:
        """One wake-up byte to each joined consumer in ``mask`` (bit i: index i), marked ``waking``/``sent``.

        Between the publish and the syscall runs only this frame: each wake-up is a C call kept per mask.
        """
        handler = self._handler
        wakers_of = handler.wakers_of  # the dicts are swapped whole on a join or leave: read each once
        wakers = wakers_of.get(mask)
        if wakers is None:
            conn_at = handler.conn_at
            # None: it left since the mask was read
            conns = [c for c in map(conn_at.get, mask_bits(mask)) if c is not None]
            wakers = self._server.wakers(conns)
            if wakers is None:  # one is still joining: through the server this time, and ask again next time
                wakers = [functools.partial(self._server.wake, b"\x01", conns)]
            else:
                wakers_of[mask] = wakers
        if _trace.ON:
            _trace.mark(waking)
        for wake in wakers:
            try:
                wake()
            except OSError:
                pass  # unread wake-ups fill its buffer (EAGAIN: it will look anyway), or gone (EOF reclaims)
        if _trace.ON:
            _trace.mark(sent)

    def _publish(self, slot: int, spec: FrameSpec, timestamp_ns: int | None, meta: bytes) -> int:
        ring = self._ring
        ring.publish(slot, self._seq + 1, timestamp_ns, spec, meta)  # ends with a full fence: the stamp is
        # visible before we read who sleeps (pairs with the consumer's set_waiting)
        self._seq += 1
        if _trace.ON:
            _trace.mark(_trace.PUBLISHED)
        asleep = ring.sleepers(self._handler.joined)
        if asleep:
            self._wake(asleep, _trace.WAKING, _trace.WAKE_SENT)
        return self._seq

    def reserve(
        self, *, stream: object = None, meta: Meta = b"", timeout: float | None = None, timestamp_ns: int | None = None
    ) -> contextlib.AbstractContextManager[Frame]:
        """Zero-copy: yields the next slot as a writable Frame; it is published when the block exits cleanly.

        On CUDA links write on ``stream`` (or export the frame through DLPack on your stream: that stream
        first waits for consumers still reading the slot); the ready event is recorded when the block
        ends. If the block raises, nothing is published. When consumers hold every slot it raises
        :class:`LinkTimeout` (after ``timeout`` under ``policy="block"``, at once under ``"drop"``).
        Inside the block the frame's ``seq`` is the one it gets if nothing is published before it (a ``send()``
        or another block inside this one goes first); after the block, its ``seq``, ``timestamp_ns`` and
        ``meta`` are what it was published with. ``timestamp_ns``, as ``send()``'s: default the publish time
        (a relay passes on its upstream's).
        """
        self._check_open()  # here, not only when the block begins
        if stream is not None and self._slots.stream is None:
            raise _backends.host_stream()
        meta_b, ts = self._checked(meta, timestamp_ns)
        return _Reservation(self, stream, meta_b, None if timeout is None else _call_timeout(timeout), ts)

    def _reserve(self, stream: object, meta: bytes, timeout: float | None) -> tuple[int, FrameSpec, Frame]:
        """The start of a ``reserve()`` block, under the lock the block holds: (slot, spec, frame)."""
        self._check_open()
        spec = self._spec
        slot = self._claim(timeout)
        if slot is None:
            self._ring.count_drop()
            waited = "within the timeout" if self.policy == "block" else "(policy='drop' waits for none)"
            raise LinkTimeout(
                f"cudalink: every slot of {self.name!r} is held by consumers; nothing to reserve {waited}: make the "
                "link with more slots= than consumers hold at once, have them release frames sooner"
                + ("" if self.policy == "block" else ", or use policy='block' to wait up to a timeout")
            )
        try:
            fences = self._fences(slot, self._ring.take_fences(slot))
            frame = self._slots.writable_frame(slot, spec, self._seq + 1, time.time_ns(), fences)
            if fences:  # whoever writes the slot first waits for consumers still reading it (GPU-side)
                writer = driver.stream_handle(stream) if stream is not None else self._slots.stream_int
                frame._sync.wait(writer)  # type: ignore[union-attr]
        except BaseException:
            self._ring.abort(slot)
            raise
        self._reserved |= 1 << slot
        return slot, spec, frame

    def _commit(
        self, slot: int, spec: FrameSpec, frame: Frame, stream: object, meta: bytes, ts: int | None = None
    ) -> None:
        """The clean end of a ``reserve()`` block: the ready event after the writer's streams, then the publish,
        stamped now (``ts`` None), as ``send()``'s frames are (not when the block began: its rendering is not
        handoff)."""
        streams = frame._export_streams()
        frame.release()
        try:
            self._slots.commit(slot, streams, stream)
        except BaseException:
            self._ring.abort(slot)
            raise
        if ts is None:
            ts = time.time_ns()
        # the frame now says what it went out as: inside the block a send() or a nested block may go first
        frame._seq, frame._timestamp_ns, frame._meta = self._publish(slot, spec, ts, meta), ts, meta

    def reconfigure(
        self,
        shape: tuple[int, ...] | list[int] | None = None,
        dtype: DTypeLike | None = None,
        *,
        pixel_format: PixelFormat | str | None = None,
        origin: RowOrigin | str | None = None,
        strides: tuple[int, ...] | list[int] | None = None,
    ) -> FrameSpec:
        """Change the format mid-stream; the next frame carries it. Must fit the slot capacity.

        Arguments left out keep their value, except that a new shape drops the pixel format and a new shape or
        dtype resets strides to compact (the old ones may not fit). ``pixel_format=""`` clears the format."""
        with self._lock:
            self._check_open()
            spec = self._spec.reconfigured(shape, dtype, pixel_format, origin, self.capacity, strides)
            self._spec = spec
            return spec

    async def send_async(
        self,
        array: object,
        *,
        stream: object = None,
        timestamp_ns: int | None = None,
        meta: Meta = b"",
        timeout: float | None = None,
    ) -> int | None:
        """``send`` that waits for a free slot (policy ``"block"``) in a thread, not on the event loop.

        Cancelled while it waits for a slot, it sends nothing and lets the Sender go at once (its thread would
        otherwise wait on, holding the Sender's lock); cancelled once the copy has begun, the frame is sent."""
        import asyncio

        _running_loop(f"send_async() on {self.name!r}", "send()")
        abandon = threading.Event()

        def send() -> int | None:
            me = threading.get_ident()
            self._abandons[me] = abandon
            try:
                return self.send(array, stream=stream, timestamp_ns=timestamp_ns, meta=meta, timeout=timeout)
            finally:
                self._abandons.pop(me, None)

        try:
            return await asyncio.to_thread(send)
        except asyncio.CancelledError:
            abandon.set()
            self._released.set()  # wake its wait now
            raise

    # -- teardown ------------------------------------------------------------------------------------------

    def close(self, timeout: float | None = 2.0) -> None:
        """Tell consumers, give GPU consumers ``timeout`` seconds to unmap (the driver's rule; ``None``: as long
        as they take; one not inside a call does so at its next), then free everything. Consumers of a CPU link
        are not waited for: their mappings outlive ours, and they still read the frames published before.
        Called inside a ``reserve()`` block on the block's own thread (a signal handler, say), it closes the link
        as that block ends: the block still writes its slot."""
        timeout = _seconds_arg(timeout, "timeout", "close(timeout=2.0)", none_ok=True)
        if self._closed:
            return
        if self._reserved and not _exiting:
            # (at exit a block still open on this thread is suspended, a generator's say, and only ends, if ever,
            # in the interpreter's teardown, too late to close anything: the link is closed now instead)
            owned = getattr(self._lock, "_is_owned", None)  # CPython's RLock: whether this thread holds it
            if owned is not None and owned():
                # the slot's memory (and on a GPU its ready event) would be freed under the writer, and the
                # block's end would publish into a closed link
                self._close_after_block = (timeout,)
                return
        _open_senders.discard(self)
        remote = getattr(self, "_remote", None)
        self._closing = True  # before the lock: a send waiting for a slot (policy="block") holds it, and ends now
        self._released.set()
        if not self._lock.acquire(timeout=timeout if _exiting and timeout < threading.TIMEOUT_MAX else -1):
            # the interpreter is ending and a reserve() block on a daemon thread holds the lock: waiting on would
            # hang the exit for good. Left as a killed producer leaves it: consumers see EOF as we exit.
            warnings.warn(
                f"cudalink: Sender {self.name!r} was not closed at exit: a reserve() block on another thread did not "
                f"end within {_secs(timeout)}; its link is left as a killed producer's (the next Sender of that "
                "name replaces it, or run `python -m cudalink clean`). End reserve() blocks before the program ends",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        try:
            self._closed = True
            try:
                self._ring.set_flag(wire.FLAG_SHUTDOWN, True)
                self._server.wake(b"\x00")
                if self._slots.unmap_first:
                    self._wait_for_consumers(self._server.connection_count, timeout)
                if remote is not None:
                    # our ucx server sends its remote consumers what we published before this close (as a local
                    # consumer still reads it), then hangs up: its own bound, ucx_engine.DRAIN_S
                    self._wait_for_consumers(
                        lambda: self._served_by(remote.pid), min(timeout, ucx_engine.DRAIN_S + 0.5)
                    )
            finally:
                try:
                    self._slots.settle()  # every published frame complete before we hang up (see CudaView)
                finally:
                    self._final_stats = {**self.stats(), "consumers": 0}
                    # a consumer that still holds a frame keeps its connection (and its lease) to the end; one
                    # admitted as we closed is in ``conns`` before its WELCOME goes (closing is set by now, so
                    # no later one is admitted)
                    with self._handler.lock:
                        unread = bool(self._handler.conns) or self._server.connection_count() > 0
                    self._server.close()
                    discard = getattr(self._server, "discard_frames", None)
                    if discard is not None and not unread:
                        discard()  # the frames' memory back to the OS now, not when this Sender is collected
                    self._fence_events = [None] * len(self._fence_events)
                    try:
                        self._slots.close(timeout)
                    finally:
                        if remote is not None:
                            ucx_engine.stop_server(remote)
        finally:
            self._lock.release()

    def _wait_for_consumers(self, left: Callable[[], object], timeout: float) -> None:
        """Until ``left()`` says none are left, for at most ``timeout``: woken as each one leaves."""
        deadline = time.monotonic() + timeout
        while left() and time.monotonic() < deadline:
            self._released.wait(0.01)
            self._released.clear()

    def _served_by(self, pid: int) -> bool:
        """Whether process ``pid`` (our ucx server) still has a consumer of this link."""
        with self._handler.lock:
            return pid in self._handler.pids.values()

    def _forget_after_fork(self) -> None:
        """In a forked child: closed here without a word to anyone (see ``_forget_in_forked_child``)."""
        self._closed = True
        self._forked = True
        # a fresh lock: a thread of the parent (a send waiting for a slot) may hold its copy, and that thread
        # does not exist here; a send() or reconfigure() would wait for it forever instead of refusing
        self._lock = threading.RLock()
        _open_senders.discard(self)
        forget = getattr(self._server, "forget_after_fork", None)
        if forget is not None:
            forget()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # not contextlib.suppress: modules may be torn down at interpreter exit
            if not self._closed:
                self.close(timeout=0.2)
        except Exception:
            pass


def _running_loop(call: str, instead: str) -> Any:
    """The running asyncio loop, or a LinkError that says ``call`` needs one and to use ``instead`` without."""
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise LinkError(
            f"cudalink: {call} needs a running asyncio event loop: await it in a coroutine run by asyncio.run() "
            f"(or uvloop); without one, call {instead}"
        ) from None


def _meta_bytes(meta: object) -> bytes:
    """A frame's meta as the ring writes it: bytes-like (bytes, bytearray, memoryview) of at most
    ``META_MAX`` bytes; None is no meta. Anything else is a :class:`FormatError` in both cores."""
    if meta is None:
        return b""
    if not isinstance(meta, (bytes, bytearray, memoryview)):
        hint = "; encode it first, e.g. meta=text.encode()" if isinstance(meta, str) else ""
        raise FormatError(
            f"cudalink: meta must be bytes, bytearray or memoryview (or None), got {type(meta).__name__}{hint}"
        )
    raw = bytes(meta)
    check_meta_size(len(raw))
    return raw


class _Reservation:
    """One ``Sender.reserve()`` block. A class, not a ``contextlib`` generator: that costs ~1 us a frame.

    The block holds the Sender's lock from entry to exit, so a reserved slot is published (or given back)
    before any other send on the link.
    """

    __slots__ = ("_done", "_meta", "_stream", "_taken", "_timeout", "_ts", "_tx")

    def __init__(self, tx: Sender, stream: object, meta: bytes, timeout: float | None, ts: int | None) -> None:
        self._tx = tx
        self._ts = ts
        self._stream = stream
        self._meta = meta
        self._timeout = timeout
        self._taken: tuple[int, FrameSpec, Frame] | None = None
        self._done = False

    def __enter__(self) -> Frame:
        if self._taken is not None:
            raise LinkError("cudalink: a reserve() block is entered once; call tx.reserve() again for the next frame")
        tx = self._tx
        tx._lock.acquire()
        try:
            taken = self._taken = tx._reserve(self._stream, self._meta, self._timeout)
        except BaseException:
            tx._lock.release()
            raise
        return taken[2]

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        taken = self._taken
        if taken is None or self._done:  # never entered, or left already (a second exit publishes nothing)
            return
        tx = self._tx
        owned = getattr(tx._lock, "_is_owned", None)  # CPython's RLock says whether this thread holds it
        if owned is not None and not owned():
            raise LinkError(
                "cudalink: a reserve() block is left on the thread that entered it (that thread holds the Sender's "
                "lock until then); leave it there"
            )
        self._done = True
        slot, spec, frame = taken
        try:
            if exc_type is None:
                tx._commit(slot, spec, frame, self._stream, self._meta, self._ts)
            else:  # nothing is published: the slot goes back as it was
                frame.release()
                tx._ring.abort(slot)
        finally:
            tx._reserved &= ~(1 << slot)
            tx._lock.release()
        deferred = tx._close_after_block
        if deferred is not None and not tx._reserved and not (owned is not None and owned()):
            tx._close_after_block = None
            tx.close(*deferred)  # asked for inside the block (see Sender.close)


# ============================================================================================ Receiver


class Receiver:
    """Receives frames from the producer named ``name``; attaches lazily, re-attaches after restarts.

    ``latest=True`` (default) returns the newest unseen frame and counts the ones skipped;
    ``latest=False`` returns every frame in order while the producer's slots still hold it.
    ``wait`` picks how ``recv`` waits: ``"hybrid"`` (spin ``spin_us`` then sleep in the kernel; the
    spin is skipped while recent frames came far apart, so a slow stream costs no CPU), ``"block"``
    or ``"spin"``. A source whose frames are landed by a thread of this process (``ucx://``) is never
    spun on, whatever the mode: a spinning caller holds the GIL that thread needs to land the frame.

    ``wake_ahead=True`` (default) asks a sleeping ``recv`` or ``recv_async`` to be woken when the producer's
    ``send`` has claimed a slot rather than after it publishes: the OS wake-up then overlaps the producer's
    copy, and the woken receiver spins for what is left of the send (at most ``wire.AHEAD_SPIN_NS``,
    typically a few microseconds; ``recv_async`` spins on its event loop's thread). ``False`` sleeps until
    the frame is published and never spins after a wake.

    Where frames come from is a :class:`~cudalink.transport.source.Source` chosen by ``name``
    (``transport.sources``): a link of this host by default. ``source=`` takes any other. ``device`` and
    ``copy`` say where frames should land and whether the source may copy them there. For a link of this
    host: ``device=None`` (or the producer's GPU) is zero copy; ``device=N``, another GPU (this process's
    ordinal), gets each frame copied into a small pool on GPU N, and the producer's slot goes back as soon as
    that copy has run (``stats()["path"]``: ``"peer"`` or ``"staged"``); ``copy="never"`` refuses that copy,
    ``copy="always"`` copies even on the producer's GPU.

    ``"cuda-link:NAME"`` reads a cuda-link producer's segment (its TouchDesigner component or Python exporter).
    Its writer never waits for readers, so by default (``copy="auto"``, or ``True``) each frame is copied on
    the GPU into a buffer this Receiver owns, after the slot's event, and stays valid however long it is held.
    ``copy=False`` (``"never"``) is zero copy, at a risk: the frame points into the producer's slot, which
    **the writer may overwrite while a slow reader still reads it** (once it has published N more frames, N
    its slot count, typically 2 or 3). Use it only when each frame is done with quickly.
    """

    #: the local ring's per-frame take and sleep (compiled where built); a Receiver whose source takes
    #: frames otherwise binds its source's pair on its instance when it attaches
    _try_take = cast("Callable[[Receiver, Attachment], Frame | None]", ring_source.receive)
    _sleep_take = cast("Callable[[Receiver, Attachment, float, int, int], Frame | None]", ring_source.sleep_receive)

    def __new__(cls, name: str = _NO_NAME, *args: object, **kwargs: object) -> Receiver:
        _NoName.check(name, "Receiver", args, "timeout=5.0")
        return super().__new__(cls)

    def __init__(
        self,
        name: str = _NO_NAME,
        *,
        timeout: float = 5.0,
        latest: bool = True,
        wait: WaitMode = "hybrid",
        spin_us: float = 50.0,
        wake_ahead: bool = True,
        device: int | str | None = None,
        copy: bool | Copy = "auto",
        transport: Transport | None = None,
        source: Source | None = None,
        connect: bool = True,
    ) -> None:
        _NoName.check(name, "Receiver")
        wait = _choice_arg(wait, "wait", ("spin", "block", "hybrid"))  # type: ignore[assignment]
        latest = _bool_arg(latest, "latest")
        wake_ahead = _bool_arg(wake_ahead, "wake_ahead")
        connect = _bool_arg(connect, "connect")
        self.timeout = _seconds_arg(timeout, "timeout", "timeout=5.0", none_ok=True)
        spin_s = _seconds_arg(spin_us, "spin_us", "spin_us=50", unit="microseconds") / 1e6
        transport = _transport_arg(transport)
        source = _plugin_arg(source, "source", ("attach", "close"), "a RingSource of cudalink.transport.ring_source")
        self._source: Source = source or open_source(
            name, transport=transport or default_transport(), device=device, copy=copy_mode(copy), latest=latest
        )
        self.name = self._source.name
        self.latest = latest
        self.wait_mode: WaitMode = wait
        self.spin_s = spin_s
        self.wake_ahead = bool(wake_ahead)
        self._att: Attachment | None = None
        self._spins = True  # whether recv() may spin on the attachment (see _attach)
        self._last = 0
        self._dead_generation = 0
        self._sticky_wake = False
        #: a recv()/recv_async() is under way (maybe on another thread): close() then wakes it, and it leaves
        self._busy = False
        self._busy_loop: Any = None  # the loop of a recv_async() under way (None: a recv() on a thread)
        self._busy_task: Any = None  # that recv_async()'s task (close() wakes it where its loop is not running)
        self._attach_lock = threading.Lock()  # one attachment wins where two calls attach at once
        self._joining: tuple[concurrent.futures.Future[None], threading.Event] | None = None  # see _join_async
        self._floor = 0
        self._wait_avg = 0.0  # seconds recv() waited for recent frames (moving average)
        self.received = 0
        self.skipped = 0
        self.reattached = 0
        self._reconnected = 0  # connections made again by attachments already dropped (see stats())
        self._closed = False
        _open_receivers.add(self)
        if connect:
            self._attach(self.timeout)

    # -- attaching ----------------------------------------------------------------------------------------

    @property
    def source(self) -> Source:
        """Where this Receiver's frames come from."""
        return self._source

    def __repr__(self) -> str:
        att = self._att
        state = "closed" if self._closed else (f"{att.backend} {att.device}" if att is not None else "not attached")
        mode = "latest" if self.latest else "in order"
        return f"<cudalink.Receiver {self.name!r} {mode} {state} received={self.received}>"

    @property
    def generation(self) -> int:
        return self._att.generation if self._att else 0

    @property
    def connected(self) -> bool:
        return self._att is not None

    @property
    def device(self) -> str:
        """Where received frames live (``"cpu"``, ``"cuda:N"``), or ``"unknown"`` before attaching."""
        return self._att.device if self._att is not None else "unknown"

    @property
    def backend(self) -> str:
        """How the attached producer shares its frames: ``"host"``, ``"cuda-pool"``, ``"cuda-legacy"``, ..."""
        return self._att.backend if self._att is not None else "unknown"

    @property
    def capacity(self) -> int:
        return self._att.capacity if self._att else 0

    @property
    def mean_wait_s(self) -> float:
        """How long ``recv()`` waited for recent frames (a moving average, seconds), learned while
        ``wait_mode`` is ``"hybrid"``, the one mode it steers.

        ``wait="hybrid"`` spins before sleeping while this stays under four times ``spin_us``: a fast
        stream keeps it spinning, a slow one lets it sleep. Watch it when tuning ``spin_us``.
        """
        return self._wait_avg

    @property
    def producer_closing(self) -> bool:
        """The producer announced shutdown: copy what you must keep, then release your frames."""
        return bool(self._att is not None and self._att.closing())

    def fileno(self) -> int:
        """Readable when a frame may be waiting (or the producer died): for selectors and event loops.

        From the first call on, the producer sends this receiver a wake-up for every frame (normally it
        wakes only receivers blocked inside ``recv``); take frames with :meth:`poll` when it is readable.
        The descriptor belongs to one producer: after :class:`ProducerGone` it is closed, and once
        :meth:`poll` (or :meth:`recv`) has attached to the next producer, ``fileno()`` gives that one's.
        """
        if self._att is None:
            self._check_open()
            why = (
                "its producer is gone; poll() (or recv()) attaches to the next one, then register the new fileno()"
                if self._dead_generation
                else "not attached yet (connect=False); call poll() or recv() first"
            )
            raise LinkError(f"cudalink: Receiver {self.name!r} has no descriptor now: {why}")
        self._sticky_wake = True
        self._att.set_waiting(wire.WAIT_ON)
        return self._att.fileno()

    def _unwait(self, att: Attachment) -> None:
        if self._att is not att:  # detached meanwhile (its producer went): its header may be unmapped
            return
        att.set_waiting(wire.WAIT_ON if self._sticky_wake else wire.WAIT_OFF)

    def _attach(self, timeout: float, polling: bool = False, abandon: threading.Event | None = None) -> bool:
        """Attach within ``timeout``; False where another call attached meanwhile (its attachment is kept).
        ``abandon``: set by a cancelled ``recv_async``, whose thread then stops trying at its next turn."""
        # NO_TIME tells a source the caller (poll) gives no time at all, where timeout=0 elsewhere still asks
        # for one attempt made now
        deadline = NO_TIME if polling else time.monotonic() + timeout
        delay = 0.001
        last_error = "no producer"
        while True:
            try:
                att = self._source.attach(deadline, self._dead_generation)
                break
            except NoProducer as exc:
                last_error = str(exc) or "no producer"
            if self._closed:  # close() on another thread while we wait for a producer
                raise self._closed_meanwhile()
            if abandon is not None and abandon.is_set():
                raise LinkTimeout(f"cudalink: recv_async() on {self.name!r} was cancelled before a producer came")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._no_producer_within(timeout, last_error)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)
        with self._attach_lock:
            if self._att is not None:  # a cancelled recv_async's attach, finished after a later call attached
                att.detach()
                return False
            self._install(att)
        if self._closed:  # closed meanwhile (a cancelled recv_async's attach runs on in its thread): leave
            self._leave()
            raise self._closed_meanwhile()
        return True

    def _no_producer_within(self, limit: float, why: str) -> LinkTimeout:
        return LinkTimeout(
            f"cudalink: no producer published {self.name!r} within {_secs(limit)} ({why}); "
            "start the Sender first, or pass a longer timeout"
        )

    def _no_restart_within(self, limit: float) -> ProducerGone:
        return ProducerGone(
            f"cudalink: producer of {self.name!r} is gone and no new one appeared within {_secs(limit)}"
        )

    def _install(self, att: Attachment) -> None:
        kind = type(att)
        if kind.receive is not type(self)._try_take:  # another source's per-frame pair, bound once here
            self._try_take = functools.partial(kind.receive, self)  # type: ignore[method-assign]
            self._sleep_take = functools.partial(kind.sleep_receive, self)  # type: ignore[method-assign]
        else:  # the ring's again (a producer that restarted on our GPU): drop a pair bound for another kind
            self.__dict__.pop("_try_take", None)
            self.__dict__.pop("_sleep_take", None)
        self._att = att
        # False where our own thread lands the frames: a spin holding the GIL would starve it (on an H100,
        # a ucx:// consumer that spun got its 64x64 frames 2-18x later (p50) than one that slept, and skipped some)
        self._spins = bool(getattr(att, "spins", True))
        if self._sticky_wake:
            att.set_waiting(wire.WAIT_ON)
        self._last = 0
        self._floor = att.floor

    def _join(self, limit: float, end_is_timeout: bool = False, abandon: threading.Event | None = None) -> None:
        """Attach within ``limit`` seconds: the first time, or to a new producer after this one's died (counted in
        ``reattached``). None coming in time after a death is :class:`ProducerGone` (the stream's end), or with
        ``end_is_timeout`` (``poll``: "nothing now") :class:`LinkTimeout`, as always."""
        try:
            installed = self._attach(limit, polling=end_is_timeout, abandon=abandon)
        except LinkTimeout as exc:
            if self._dead_generation and not end_is_timeout:
                raise self._no_restart_within(limit) from exc
            raise
        if installed and self._dead_generation:
            self.reattached += 1

    def _gone(self, why: str | None = None) -> LinkError:
        """The producer's end, said once: ``why``, or (None) what the source tells of it, whether the end was
        seen by its shutdown flag or at the hang-up (poll, EOF). Where the source ended on an error of this
        process's own (its ``failure``: a GPU call that failed as a frame landed), that error instead: the
        producer is not gone."""
        att = self._att
        failure = getattr(att, "failure", None)
        if att is not None and isinstance(failure, LinkError):
            self._drop(att)
            said = str(failure).removeprefix("cudalink: ")
            msg = f"cudalink: {self.name!r}: a frame could not be landed here: {said}; recv() again connects anew"
            own = CudaError(msg, failure.result, failure.name) if isinstance(failure, CudaError) else LinkError(msg)
            own.__cause__ = failure
            return own
        closed = False
        if att is not None:
            with contextlib.suppress(Exception):  # read before the drop unmaps what says it
                closed = bool(att.closing())
        if why is None:
            why = "closed the link" if closed else "closed or died"
        said = getattr(att, "reason", "")  # what the source knows of the end (a server's goodbye, say)
        if said:
            why = f"{why} ({said})"
        if att is not None:
            last = getattr(att, "last_published", 0)  # frames published that never came (see Attachment)
            taken = self._last or self._floor  # as source.account counts
            if last > taken:
                self.skipped += last - taken
            self._dead_generation = att.generation
            self._drop(att)
        return ProducerGone(
            f"cudalink: producer of {self.name!r} {why}; recv() again to wait for a new one", closed=closed
        )

    # -- receiving ------------------------------------------------------------------------------------------

    def _publish_counts(self, att: Attachment) -> None:
        """Tell monitors what we received. Done off the latency path: before sleeping, and while idle."""
        att.count(self.received, self.skipped)

    def poll(self) -> Frame | None:
        """A new frame if one is there now, else None; never waits. While no producer is there (not yet, or
        not again after its end) it raises :class:`LinkTimeout`, and once at a producer's end ProducerGone,
        so a loop that polls can tell "no new frame" from "nobody sends"."""
        att = self._att
        if att is None or self._closed:  # the per-frame path: one test when attached and open
            self._check_open()
            self._join(0.0, end_is_timeout=True)
            att = self._att
            assert att is not None
        try:
            frame = self._try_take(att)
        except ProducerGone as exc:  # a source found its producer gone mid-take
            raise self._gone("died") from exc
        if frame is None:
            self._publish_counts(att)
            if not att.alive():
                return self._final(att)
        elif not self.received & _COUNT_EVERY:
            self._publish_counts(att)
        return frame

    def recv(self, timeout: float | None = _RECEIVER_TIMEOUT, wait: WaitMode | None = None) -> Frame:
        """The next frame (newest unseen by default), within ``timeout`` seconds (default: the Receiver's;
        ``None``: no limit). ``wait``: how this call waits, ``"spin"``, ``"block"`` or ``"hybrid"`` (default:
        the Receiver's ``wait=``). Raises LinkTimeout or ProducerGone; LinkClosed where :meth:`close` is called
        meanwhile (on another thread)."""
        if self._busy:
            self._check_second_waiter()
        self._busy = True  # before the check: a close() on another thread sees this, or we see its _closed
        try:
            self._check_open()
            mode = self.wait_mode if wait is None else _choice_arg(wait, "wait", ("spin", "block", "hybrid"))
            limit = (
                self.timeout
                if timeout is _RECEIVER_TIMEOUT
                else (timeout if timeout.__class__ is float and timeout >= 0.0 else _call_timeout(timeout))
            )
            deadline = time.monotonic() + limit
            if self._att is None:
                self._join(limit)
            att = self._att
            assert att is not None
            entered = time.monotonic()
            spins = self._spins  # see _attach
            if not spins:
                spin_until = 0.0
            elif mode == "spin":
                spin_until = deadline
            elif mode == "hybrid" and self._wait_avg < 4 * self.spin_s:
                spin_until = entered + self.spin_s
            else:  # block, or hybrid while frames come far apart: a spin would only burn the core
                spin_until = 0.0
            take = self._try_take
            learn = mode == "hybrid"  # only hybrid reads the average; woken, every call is microseconds
            n = 0
            try:
                while True:
                    frame = take(att)
                    if frame is not None:
                        if not self.received & _COUNT_EVERY:  # a consumer that never waits tells monitors too
                            self._publish_counts(att)
                        return self._arrived(frame, entered) if learn else frame
                    if self._closed:
                        raise self._closed_meanwhile()
                    if att.closing():
                        return self._final(att)
                    now = time.monotonic()
                    if now >= deadline:
                        if not att.alive():
                            return self._final(att)
                        raise self._no_frame_within(limit, att)
                    if now < spin_until:
                        for _ in range(_SPIN_BURST):  # bare takes; the bookkeeping around them runs once a burst
                            frame = take(att)
                            if frame is not None:
                                return self._arrived(frame, entered) if learn else frame
                        # hand the GIL over now and then: a spinning thread must not starve this process's
                        # other threads (which may be the very producer we wait for)
                        self._publish_counts(att)
                        _platform.yield_cpu()
                        n += 1
                        if n & 15 == 0 and (self._closed or not att.alive()):
                            return self._final(att)  # closed meanwhile: LinkClosed there
                        continue
                    # Drain stale wake-ups (and see EOF) *before* sleeping, not after waking: the wake-up that
                    # ends this sleep is left in the socket, so the frame it announces is taken with no recv()
                    # syscall in between. It is drained the next time this receiver is about to sleep.
                    if not att.alive():
                        return self._final(att)
                    self._publish_counts(att)
                    ahead = self.wake_ahead and not self._sticky_wake  # a selector's wake-up must mean a frame
                    frame = self._sleep_take(
                        att,
                        min(deadline - now, _LONGEST_SLEEP_S),  # with no limit (inf) a source sleeps in bounded steps
                        wire.WAIT_AHEAD if ahead else wire.WAIT_ON,
                        wire.WAIT_ON if self._sticky_wake else wire.WAIT_OFF,
                    )
                    if frame is not None:
                        if self._closed:  # woken by close(): a frame found meanwhile is not handed out
                            frame.release()
                            raise self._closed_meanwhile()
                        return self._arrived(frame, entered) if learn else frame
                    # woken ahead of the frame, maybe: the rest of its send() is shorter than a sleep
                    if ahead and spins:
                        spin_until = max(spin_until, time.monotonic() + _AHEAD_SPIN_S)
            except ProducerGone as exc:  # a source found its producer gone mid-take (a copy from a dead one)
                if self._att is att:
                    raise self._gone("died") from exc
                raise
        finally:  # inline, not a wrapper: a call level costs the per-frame path ~0.1 us
            self._busy = False
            if self._closed:
                self._leave()

    def _no_frame_within(self, limit: float, att: Attachment) -> LinkTimeout:
        hint = getattr(att, "stall_hint", None)  # optional: see Attachment
        why = hint() if hint is not None else ""
        return LinkTimeout(f"cudalink: no frame on {self.name!r} within {_secs(limit)}{why}")

    def _final(self, att: Attachment) -> Frame:
        """The end is seen (the shutdown flag, EOF): one more take first. A producer publishes its last frames
        before it says it closes, so a take made after seeing that finds every frame it sent, even those that
        landed between our last empty take and the look at the flag. Only then is the stream over. (A close()
        meanwhile, which may be what ended the wait, hands out nothing more.)"""
        if self._closed:
            raise self._closed_meanwhile()
        try:
            frame = self._try_take(att)
        except ProducerGone:
            frame = None
        if frame is not None:
            return frame
        raise self._gone()

    def _arrived(self, frame: Frame, entered: float) -> Frame:
        """Learn how long frames keep us waiting: ``hybrid`` spins only while frames come within its spin.

        Only ``hybrid`` learns it: in the other modes this call (a clock read) would only add to the
        handoff, on a core the wake-up leaves cold."""
        self._wait_avg += (time.monotonic() - entered - self._wait_avg) * 0.125
        return frame

    async def recv_async(self, timeout: float | None = _RECEIVER_TIMEOUT) -> Frame:
        """Await the next frame: the event loop watches the source's fd, no thread and no polling. ``timeout``
        as for :meth:`recv`. Woken ahead of a frame (``wake_ahead``), it takes the frame as it is published,
        holding the loop for the rest of that send instead of sleeping for a second wake-up."""
        import asyncio

        # before the claim below: a call with no loop to run on must leave the Receiver as it was
        loop = _running_loop(f"recv_async() on {self.name!r}", "recv()")
        if self._busy:
            self._check_second_waiter()
        self._busy = True
        self._busy_loop = loop
        self._busy_task = asyncio.current_task()
        try:
            return await self._recv_async(timeout)
        except asyncio.CancelledError as exc:
            if exc.args[:1] != (_WOKEN_BY_CLOSE,) or not self._closed:
                raise
            uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11+: not the caller's cancel
            if uncancel is not None and uncancel():  # the caller's own cancel came too (after ours): it ends the task
                raise
            raise self._closed_meanwhile() from None
        finally:
            if self._busy_loop is loop:  # not when a later waiter took over from this one (see below)
                self._busy = False
                self._busy_loop = None
                self._busy_task = None
            if self._closed:
                self._leave()

    async def _recv_async(self, timeout: float | None) -> Frame:
        import asyncio

        self._check_open()
        limit = self.timeout if timeout is _RECEIVER_TIMEOUT else _call_timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        if self._att is None:
            await self._join_async(limit)
        woken = False
        while True:
            frame = self.poll()
            if frame is not None:
                return frame
            att = self._att
            assert att is not None
            if att.closing():
                return self._final(att)
            left = deadline - loop.time()
            if left <= 0:
                raise self._no_frame_within(limit, att)
            ahead = self.wake_ahead and self._spins and not self._sticky_wake
            if woken and ahead:  # woken ahead of the frame, maybe: the rest of its send() is shorter than a sleep
                woken = False
                frame = self._spin_ahead(att)
                if frame is not None:
                    return frame
                if self._closed:
                    raise self._closed_meanwhile()
                continue
            att.set_waiting(wire.WAIT_AHEAD if ahead else wire.WAIT_ON)
            try:
                try:
                    frame = self._try_take(att)  # published before our flag was visible
                except ProducerGone as exc:
                    raise self._gone("died") from exc
                if frame is not None:
                    return frame
                await att.wait_async(None if left == float("inf") else left)
                woken = True
            finally:
                if self._busy_loop is loop:  # not a stale waiter's end (see _check_second_waiter)
                    self._unwait(att)
            if self._closed:  # closed by another task or thread while we waited: said as recv() says it
                raise self._closed_meanwhile()

    def _spin_ahead(self, att: Attachment) -> Frame | None:
        """After a wake-up with no frame yet (a producer wakes ahead as its ``send()`` starts), take until the
        frame is there, for at most ``wire.AHEAD_SPIN_NS``: on the event loop's thread, so the loop is held
        for what is left of that send (microseconds) instead of a second OS wake-up (tens of microseconds).
        None at the end of the spin, or where the link is closing: the caller looks again and sleeps."""
        take = self._try_take
        until = time.monotonic() + _AHEAD_SPIN_S
        try:
            while True:
                for _ in range(_SPIN_BURST):
                    frame = take(att)
                    if frame is not None:
                        return frame
                if self._closed or att.closing() or time.monotonic() >= until:
                    return None
                _platform.yield_cpu()  # the producer may be a thread of this process
        except ProducerGone as exc:  # a source found its producer gone mid-take
            raise self._gone("died") from exc

    def _start_join(self, limit: float) -> tuple[concurrent.futures.Future[None], threading.Event]:
        """``_join`` on a daemon thread of its own; (its end, the event that makes it stop at its next try)."""
        abandon = threading.Event()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def join() -> None:
            done.set_running_or_notify_cancel()
            try:
                self._join(limit, abandon=abandon)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=join, name=f"cudalink-attach-{self.name}", daemon=True).start()
        return done, abandon

    async def _join_async(self, limit: float) -> None:
        """Attach off the loop, on one thread per Receiver at a time: a later call waits on the attach an
        earlier (cancelled) one began instead of starting its own. Cancelled with no other waiter, that thread
        stops at its next try. In the loop's default executor each cancelled call's attach went on trying
        (``asyncio.run`` waited for it at exit: forever with no time limit) and replaced, when it came, the
        attachment a newer call was reading."""
        import asyncio

        loop = asyncio.get_running_loop()
        end = loop.time() + limit
        while True:
            job, mine = self._joining, False
            if job is None or job[0].done():
                job, mine = self._start_join(max(0.0, end - loop.time())), True
                self._joining = job
            done, abandon = job
            abandon.clear()  # waited for again: it goes on
            # our own attach ends with its clearer error at our deadline: a second more for it to say so
            grace = 1.0 if mine else 0.0
            attached = asyncio.wrap_future(done)
            # read its end even where nobody waits for it any more: one whose waiter was cancelled is left
            # unread, and asyncio logged 'Future exception was never retrieved' for each cancelled wait
            attached.add_done_callback(_read_end)
            try:
                # asyncio.wait, which never cancels the attach, not wait_for(shield()): before Python 3.12 a
                # cancel (asyncio.timeout, wait_for, task.cancel) that came as the attach ended was lost, and
                # the call went on to wait for a frame, with no limit under timeout=None
                finished, _ = await asyncio.wait((attached,), timeout=max(0.0, end - loop.time()) + grace)
                if finished:
                    attached.result()
            except (LinkTimeout, ProducerGone):
                if mine or self._closed or loop.time() >= end:
                    raise
                continue  # an earlier call's attach gave up at its own deadline (or was abandoned); ours is later
            except BaseException:
                abandon.set()
                raise
            if not finished:  # our time is up; an earlier call's attach, with a later end, still tries
                abandon.set()
                timed_out = self._no_producer_within(limit, "no producer came")
                if self._dead_generation:
                    raise self._no_restart_within(limit) from timed_out
                raise timed_out from None
            return

    def __aiter__(self) -> AsyncIterator[Frame]:
        return _Frames(self)

    def __iter__(self) -> Iterator[Frame]:
        while not self._closed:
            try:
                yield self.recv()
            except (ProducerGone, LinkClosed) as exc:
                if not _ends_stream(self, exc):
                    raise
                return

    def stats(self) -> dict[str, int | str]:
        """Counters, and ``path``: how frames reach this Receiver: ``zero-copy`` (the producer's own memory),
        ``peer`` (copied from the producer's GPU over NVLink/PCIe peer access), ``staged`` (copied by the
        driver through host memory: no peer access between the two GPUs), ``same-device`` (``copy="always"``
        on the producer's GPU), ``copy`` (a host link with ``copy="always"``, or a cuda-link segment read
        through a copy), ``network`` (a ``ucx://`` link: received into buffers this Receiver owns), or
        ``unknown`` before attaching.

        ``reattached`` counts new producers (restarts) this Receiver went on with; ``reconnects`` counts times a
        network source lost its connection while it was stalled and made it again to the same producer (the
        frames that went by meanwhile are in ``skipped``); always 0 for a local link."""
        att = self._att
        path = "unknown" if att is None else att.path
        reconnects = self._reconnected + (0 if att is None else getattr(att, "resumes", 0))
        return {
            "received": self.received,
            "skipped": self.skipped,
            "reattached": self.reattached,
            "reconnects": reconnects,
            "path": path,
        }

    # -- teardown ---------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LinkClosed(f"cudalink: Receiver {self.name!r} is closed; create a new one{_forked_note(self)}")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Leave the link. Frames you still hold stay valid; their memory is unmapped after the last one."""
        if self._closed:
            return
        self._closed = True
        _open_receivers.discard(self)
        att = self._att
        loop = self._busy_loop
        if att is not None and self._busy and (loop is None or (loop.is_running() and not loop.is_closed())):
            # a recv() on another thread (or a recv_async() awaiting on a running loop) may be reading this
            # attachment right now: wake it instead, and it leaves the link on its way out (_leave)
            interrupt = getattr(att, "interrupt", None)
            if interrupt is None or interrupt() is False:  # it cannot be woken: leave now, as before
                self._leave()
        else:  # nobody waits (or only a task on a loop that does not run now: it reads nothing meanwhile)
            self._leave()
            if self._busy and loop is not None:  # also a task still attaching (no attachment yet): its attempt
                self._wake_task_later(loop)  # to connect may run for seconds (a server that never answers)
        self._source.close()

    def _wake_task_later(self, loop: Any) -> None:
        """A ``recv_async()`` task waits on a loop that does not run now (a host application runs its loop a
        moment per frame; or it was stopped): close() has left the link, so that task waits on a socket closed
        under it, forever once the loop runs again. Cancel it there instead, first thing, while it still waits
        in this call: it raises the LinkClosed of a close() during a wait (and ``async for`` ends). So too for
        a task that waits for its attach's thread: one attempt to connect (a ucx:// server that answers nothing)
        ends only after seconds; the abandoned thread leaves what it attaches to at its end."""
        task = self._busy_task

        def wake() -> None:
            # not where the caller cancelled it meanwhile (Python 3.11+ says): that cancel stays its own
            if self._busy_task is task and task is not None and not getattr(task, "cancelling", int)():
                task.cancel(_WOKEN_BY_CLOSE)

        with contextlib.suppress(RuntimeError):  # a loop closed meanwhile never runs that task again
            loop.call_soon_threadsafe(wake)

    def _leave(self) -> None:
        att = self._att
        if att is not None:
            self._drop(att)

    def _check_second_waiter(self) -> None:
        """Another waiter is under way: refused, unless it is a ``recv_async`` whose loop was closed while it
        waited (never cancelled, it will never run again): the new one takes over."""
        loop = self._busy_loop
        if loop is not None and loop.is_closed():
            self._busy_loop = self._busy_task = None
            return
        raise self._second_waiter()

    def _second_waiter(self) -> LinkError:
        return LinkError(
            f"cudalink: a recv()/recv_async() is already waiting on Receiver {self.name!r}; one waiter at a time "
            "(make one Receiver per task or thread: each gets every frame)"
        )

    def _closed_meanwhile(self) -> LinkClosed:
        return LinkClosed(f"cudalink: Receiver {self.name!r} was closed while it waited for a frame")

    def _forget_after_fork(self) -> None:
        """In a forked child: closed here without a word to the producer; frames the child still holds end
        without touching the leases the parent's frames are counted in."""
        self._closed = True
        self._forked = True
        # a recv() under way on a thread of the parent is not under way here: ours is refused as closed, not as
        # a second waiter; and the attach lock such a thread may hold is not ours to wait for
        self._busy = False
        self._busy_loop = self._busy_task = None
        self._attach_lock = threading.Lock()
        _open_receivers.discard(self)
        att, self._att = self._att, None
        forget = getattr(att, "forget_after_fork", None)
        if forget is not None:
            forget()

    def _drop(self, att: Attachment) -> None:
        """Leave ``att``, keeping its count of reconnections for ``stats()`` (once: a close() on another thread
        and the waiter it woke may both come here)."""
        if not getattr(att, "_counted_out", False):
            with contextlib.suppress(AttributeError):  # a compiled attachment may take no new attributes
                att._counted_out = True  # type: ignore[attr-defined]
                self._reconnected += getattr(att, "resumes", 0)
        self._att = None
        att.detach()

    def __reduce__(self) -> tuple[object, ...]:
        """Refused clearly: its leases and mappings are this process's; the name is what travels."""
        raise ArgumentTypeError(
            f"cudalink: a Receiver can't be pickled or passed to another process; pass its name and make "
            f"Receiver({self.name!r}) there"
        )

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # not contextlib.suppress: modules may be torn down at interpreter exit
            self.close()
        except Exception:
            pass


def _read_end(fut: Any) -> None:
    """A done callback: marks the future's exception as read (asyncio logs one never read)."""
    if not fut.cancelled():
        fut.exception()


class _Frames:
    """``async for``'s iterator over a Receiver: each ``__anext__`` is one ``recv_async()``, so a cancelled one
    (``asyncio.wait_for(anext(it), t)``) ends nothing and the next goes on with the stream. (An async generator
    was finished by the CancelledError thrown into it: its next ``anext`` said StopAsyncIteration, the stream's
    end, while the producer still sent.)"""

    __slots__ = ("_ended", "_rx")

    def __init__(self, rx: Receiver) -> None:
        self._rx = rx
        self._ended = False

    def __aiter__(self) -> _Frames:
        return self

    async def __anext__(self) -> Frame:
        rx = self._rx
        if self._ended or rx.closed:
            self._ended = True
            raise StopAsyncIteration
        try:
            return await rx.recv_async()
        except (ProducerGone, LinkClosed) as exc:
            if not _ends_stream(rx, exc):
                raise
        self._ended = True
        raise StopAsyncIteration


def _ends_stream(rx: Receiver, exc: LinkError) -> bool:
    """Whether ``for``/``async for`` over ``rx`` ends quietly on ``exc``: at the producer's clean close (after
    every frame it published) or at ``close()`` from elsewhere. A producer that died (or one found dead at
    attach) raises its ProducerGone there: a crash is not the stream's end."""
    if isinstance(exc, ProducerGone):
        return bool(rx._dead_generation) and exc.closed
    return isinstance(exc, LinkClosed) and rx.closed


#: the Python references of the local ring's per-frame take and sleep, kept by name for the tests that compare
#: them with their compiled twins (the class binds whichever ``ring_source`` picked)
py_try_take = ring_source.py_receive
py_sleep_take = ring_source.py_sleep_receive
