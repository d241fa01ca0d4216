"""The local ring as a frame source: a producer's shared header on this host, its slots, its control channel.

This is the hot path: ``receive``/``sleep_receive`` have compiled twins (``_native.ring``) that the Receiver
binds where they were built, step for step the same.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, cast

from .. import _backends, _native, _platform, _trace
from .._ring import consumer_ring
from ..cuda import devices
from ..errors import FormatError, ProducerGone, ProtocolError
from ..frames.frame import Frame, _Hold
from . import wire
from .base import Client, NoProducer, Transport
from .landed import HostCopyAttachment, LandedAttachment
from .source import Attachment, Copy, account

if TYPE_CHECKING:
    from .source import Counters

__all__ = ["RingAttachment", "RingSource", "py_receive", "py_sleep_receive", "receive", "sleep_receive"]


class _Lease(_Hold):
    """A received frame's hold: when the frame and its last export die, the lease on its slot ends.

    The slot and seq live on the hold itself, so a frame costs no closure and no extra call.
    """

    __slots__ = ("att", "seq", "slot")

    def __init__(self, att: RingAttachment, slot: int, seq: int, owner: object, ptr: int) -> None:
        self.owner = owner
        self.ptr = ptr
        self.streams = []
        self.att: RingAttachment | None = att
        self.slot = slot
        self.seq = seq

    def end(self) -> None:
        att = self.att
        if att is not None:
            self.att = None
            att.release(self.slot, self.seq, self.streams)

    def __del__(self) -> None:  # end(), inlined: this runs once per frame
        att = self.att
        if att is not None:
            self.att = None
            try:
                att.release(self.slot, self.seq, self.streams)
            except Exception:  # a finalizer must never raise
                pass


def py_receive(rx: Counters, att: RingAttachment) -> Frame | None:
    """Lease the next frame and build it, or None. The per-frame path: where the compiled core is built, its
    twin ``_native.ring.receive`` (with ``_native.ring.Lease`` for ``_Lease``) runs instead."""
    got = att.ring.take(rx._last, rx.latest)
    if got is None:
        return None
    slot, rec = got
    seq = rec[0]
    if _trace.ON:
        _trace.mark(_trace.LEASED)
    account(rx, seq)
    att.live.add(seq)
    spec = rec[2]
    parts = att.parts[slot]
    if parts is None or parts[0] is not spec:  # the ring caches specs: identity is the common case
        try:
            parts = att.parts[slot] = att.view.slot(slot, att.handles[slot], spec)
        except BaseException:
            _Lease(att, slot, seq, None, 0).end()
            raise
    frame = Frame._received(
        spec,
        _Lease(att, slot, seq, parts[2], parts[1]),
        att.device_id,
        seq,
        rec[1],
        rec[3],
        parts[3],
        att.generation,
        parts[4],
        parts[5],
    )
    if _trace.ON:
        _trace.mark(_trace.FRAME_BUILT)
    return frame


def py_sleep_receive(rx: Counters, att: RingAttachment, timeout: float, waiting: int, after: int) -> Frame | None:
    """Flag ``waiting`` in the ring, sleep until a wake-up (or ``timeout``), flag ``after``, and take the frame
    the wake-up announces straight away, before any bookkeeping: or None.

    A woken receiver usually runs on the producer's core (a socket wake-up asks the kernel for that) once the
    producer sleeps, and after its memcpy every cache line is cold: each Python step here costs microseconds.
    Where the compiled core is built, its twin ``_native.ring.sleep_receive`` runs instead, and sleeps in one
    ``poll()`` on ``att.fd``.
    """
    take = type(att).receive
    ring = att.ring
    ring.set_waiting(waiting)
    try:
        frame = take(rx, att)  # a frame published before our flag was visible
        if frame is None:
            att.client.wait_readable(timeout)
            if _trace.ON:
                _trace.mark(_trace.WOKEN)
    finally:
        ring.set_waiting(after)
    if frame is None:
        frame = take(rx, att)
    return cast("Frame | None", frame)


#: the longest one attempt waits for a producer's WELCOME; the Receiver tries again until its own deadline,
#: which may be none (``timeout=None``)
_HANDSHAKE_S = 5.0
#: the per-frame functions the ring uses: the compiled twins where they were built
receive = py_receive if _native.ring is None else _native.ring.receive
sleep_receive = py_sleep_receive if _native.ring is None else _native.ring.sleep_receive


class RingAttachment:
    """One producer generation of the local ring as seen by one Receiver. Lives until its last frame is released."""

    receive = staticmethod(receive)
    sleep_receive = staticmethod(sleep_receive)

    def __init__(
        self,
        client: Client,
        fixed: wire.Fixed,
        index: int,
        view: _backends.ConsumerView,
        handles: list[wire.SlotHandle],
    ) -> None:
        self.client = client
        self.fixed = fixed
        self.ring = consumer_ring(client.header, fixed.layout, index, fixed.capacity)
        self.view = view
        self.handles = handles  # read and checked once, at attach
        self.generation = fixed.generation
        self.device_id = view.device  #: the CUDA ordinal frames are built with (-1: host)
        self.backend = wire.BACKEND_NAMES[fixed.backend]
        self.path = "zero-copy"
        self.capacity = fixed.capacity
        #: frames published before we joined are not "skipped" by us
        self.floor = wire.read_u64(client.header, wire.OFF_PUBLISHED)
        self.parts: list[_backends.SlotParts | None] = [None] * fixed.nslots  # per slot, for its last spec
        self.counted = 0  # the received count last written to our consumer entry (for monitors)
        #: seqs of frames still held. ``set.add``/``discard`` are single atomic operations under the GIL, so
        #: a frame takes no lock; the lock guards only detaching and unmapping.
        self.live: set[int] = set()
        #: what the compiled sleep polls: the control socket's fd (-1: it calls ``client.wait_readable``)
        self.fd = -1 if _platform.IS_WINDOWS else client.fileno()
        self.detached = False
        self.unmapped = False
        self.lock = threading.Lock()

    @property
    def device(self) -> str:
        return "cpu" if self.fixed.backend == wire.BACKEND_HOST else f"cuda:{self.device_id}"

    def closing(self) -> bool:
        return bool(self.ring.flags() & wire.FLAG_SHUTDOWN)

    def alive(self) -> bool:
        return self.client.drain()

    def set_waiting(self, state: int) -> None:
        self.ring.set_waiting(state)

    def count(self, received: int, skipped: int) -> None:
        if self.counted != received:
            self.counted = received
            self.ring.count(received, skipped)

    def fileno(self) -> int:
        return int(self.client.fileno())

    def published(self) -> int:
        """Frames the producer has published (the seq of its last one): read by a ucx server at a clean close."""
        return wire.read_u64(self.client.header, wire.OFF_PUBLISHED)

    @property
    def last_published(self) -> int:
        """:meth:`published`, read by the Receiver at the producer's end: a frame it published may be gone from its
        slot (a ``reserve()`` block that raised claimed it and marked it empty), and then counts as skipped."""
        try:
            return self.published()
        except (ValueError, TypeError, BufferError):  # unmapped already
            return 0

    def stall_hint(self) -> str:
        """Said when a wait for a frame runs out while this Receiver's own frames hold every slot: the producer
        can land nothing new until one is released (it drops frames, or its send blocks)."""
        n = self.fixed.nslots
        if len(self.live) < n:
            return ""
        return (
            f"; this Receiver holds all {n} of the link's slots (frames it received, or arrays made from them, still "
            "alive), so no new frame can land: release frames when done (frame.release(), or `with rx.recv() as "
            f"frame:`) and drop the arrays made from them, or make the Sender with more than slots={n}"
        )

    async def wait_async(self, timeout: float | None) -> None:
        await self.client.wait_async(timeout)

    def interrupt(self) -> None:
        self.client.interrupt()

    def release(self, slot: int, seq: int, streams: list[int]) -> None:
        fenced = False
        if streams:  # only frames exported to a stream have GPU reads to fence
            try:
                fenced = self.view.fence(slot, streams)
            except Exception:
                fenced = False
        if self.ring.release(slot, seq, fenced) & wire.FLAG_PRODUCER_WAITING:
            with contextlib.suppress(Exception):
                self.client.hint()
        live = self.live
        live.discard(seq)
        if self.detached and not live:  # detach() saw a frame still live; the last one unmaps
            self._unmap()

    def detach(self) -> None:
        """Leave: unmap and close the connection now, or when the last frame goes.

        The connection stays open while frames are alive, so a closing producer keeps waiting (bounded)
        for us and never frees memory this process still maps: the driver's importer-first rule.
        """
        with self.lock:
            if self.detached:
                return
            self.detached = True
        if not self.live:  # read after ``detached`` is set: a release racing us is seen by one side or both
            self._unmap()

    def forget_after_fork(self) -> None:
        """In a forked child: close our copy of the connection (the parent's stays open) and end leases here
        without writing the ring, whose counts are the parent's."""
        self.ring.forget()  # the compiled lease writes the ring itself
        self.release = _no_release  # type: ignore[method-assign]
        self.lock = threading.Lock()  # a parent's thread may hold its copy: the child's last frame would wait
        self.detached = self.unmapped = True
        self.client.close()

    def _unmap(self) -> None:
        with self.lock:
            if self.unmapped:
                return
            self.unmapped = True
        with contextlib.suppress(Exception):
            self.view.close()
        self.client.close()


def _no_release(slot: int, seq: int, streams: list[int]) -> None:
    pass


def _ring_attachment(client: Client, fixed: wire.Fixed, index: int, fds: list[int]) -> RingAttachment:
    """Map the producer's slots and check every slot's handle once, at attach (a producer writes them once, at
    start): a lying handle is a ProtocolError now, not a TypeError on every recv."""
    view = _backends.make_consumer_view(fixed, client, fds)
    handles = [wire.unpack_handle(client.header, fixed.layout.handle(i)) for i in range(fixed.nslots)]
    try:
        view.check(handles, fixed.capacity)
        view.setup(client.header, fixed.layout, index)
    except BaseException:
        view.close()
        raise
    return RingAttachment(client, fixed, index, view, handles)


class RingSource:
    """A producer on this host, found by name through a :class:`~cudalink.transport.base.Transport`.

    ``device``: None (or the producer's GPU) takes frames where the producer made them, with no copy. Another
    GPU of this host (``N``: this process's ordinal) gets each frame copied into a small pool of buffers on
    it (``transport.landed``), unless ``copy="never"``, which refuses. ``copy="always"`` copies even on the
    producer's GPU, or into host memory of ours on a host link (a consumer that holds frames long then never
    holds the producer's slots). The producer's
    GPU is found by the UUID in the header, whatever CUDA_VISIBLE_DEVICES numbers it here.
    """

    def __init__(
        self,
        name: str,
        transport: Transport,
        *,
        device: int | str | None = None,
        copy: Copy = "auto",
        copy_host: bool = True,
    ) -> None:
        self.name = _platform.check_name(name)
        #: whether ``copy="always"`` copies a host link's frames too (the ucx server says no: it sends host
        #: frames straight from the slot, and copies only GPU frames into memory of its own)
        self.copy_host = copy_host
        self.transport = transport
        self.want_device = device
        self.copy = copy
        #: ``device=N`` as an ordinal here, checked now: a GPU that is not there is named before any attach
        self._ordinal = devices.wanted_ordinal(device)
        self._closed = False
        self._handshaking: Client | None = None  # the client whose handshake runs now (see close)

    def attach(self, deadline: float, dead_generation: int) -> Attachment:
        try:
            return self._attach(deadline, dead_generation)
        except NoProducer as exc:
            # a killed producer's leftovers answer nothing: say so now, not after the whole timeout. Not once
            # this Receiver saw its own producer die: then it waits for the restart it was asked to wait for
            if not dead_generation and self.transport.abandoned(self.name):
                raise ProducerGone(
                    f"cudalink: the producer of {self.name!r} died (killed or crashed) and left its link "
                    "behind; start it again (a new Sender replaces the leftovers), or remove them with "
                    "`python -m cudalink clean`"
                ) from exc
            raise

    def _attach(self, deadline: float, dead_generation: int) -> Attachment:
        client = self.transport.connect(self.name)
        try:
            if wire.header_pending(client.header):
                raise NoProducer("producer is starting")
            fixed = wire.read_fixed(client.header)
            if not fixed.flags & wire.FLAG_READY or fixed.flags & wire.FLAG_SHUTDOWN:
                raise NoProducer("producer is starting or stopping")
            if fixed.generation == dead_generation:
                raise NoProducer("only the dead producer's leftovers are there")
            token = secrets.randbits(63)
            hello = wire.pack_hello(wire.Hello(fixed.generation, token, os.getpid()))
            self._handshaking = client  # close() on another thread cuts a wait on a producer that hangs
            try:
                if self._closed:
                    raise NoProducer("closed")
                data, fds = client.handshake(
                    hello, wire.WELCOME.size, min(max(0.05, deadline - time.monotonic()), _HANDSHAKE_S)
                )
            except (TimeoutError, ConnectionError) as exc:
                raise NoProducer(f"handshake failed: {exc}") from exc
            finally:
                self._handshaking = None
            try:
                welcome = wire.unpack_reply(data, fixed.nconsumers)
            except ProtocolError as exc:
                for fd in fds:
                    os.close(fd)
                # nothing, or the shutdown byte (a closing producer wakes every connection, ours among them
                # while it was still joining): that producer is going, not lying
                if exc.reason.retryable or not data or data[:1] == b"\x00":
                    raise NoProducer(str(exc)) from exc
                raise
            if fixed.backend == wire.BACKEND_HOST:
                att = _ring_attachment(client, fixed, welcome.index, fds)
        except BaseException:
            client.close()
            raise
        if fixed.backend == wire.BACKEND_HOST:
            try:
                return self._place(att)
            except BaseException:
                att.detach()
                raise
        # CUDA: mapping the producer's memory makes its GPU current; the caller's current GPU (what torch and
        # cupy call "the current device") is given back, since a Receiver on GPU 1 must not move it to 0
        try:
            with devices.keep_current():
                att = _ring_attachment(client, fixed, welcome.index, fds)
        except BaseException:
            client.close()
            raise
        try:
            with devices.keep_current():
                return self._place(att)
        except BaseException:
            att.detach()
            raise

    def _place(self, att: RingAttachment) -> Attachment:
        """The attachment that delivers frames where this Receiver wants them: the ring's own (zero copy), or
        one that lands each frame on another GPU (``device=N`` with N not the producer's, or ``copy="always"``)."""
        want = self.want_device
        if att.device_id < 0:
            if want is not None and want != "cpu":
                raise FormatError(
                    f"cudalink: {self.name!r} carries host frames; a Receiver cannot put them on {want!r} "
                    "(drop device=, or copy the frame to the GPU yourself)"
                )
            return HostCopyAttachment(att) if self.copy == "always" and self.copy_host else att
        producer = att.device_id  # this process's ordinal for the producer's GPU, found by its UUID
        if want == "cpu":
            raise FormatError(
                f"cudalink: {self.name!r} carries frames on cuda:{producer}; device='cpu' takes only host links "
                "(drop device=, and copy to the host with frame.to_numpy() where you must)"
            )
        target = producer if want is None else self.ordinal
        if target == producer and self.copy != "always":
            return att
        if self.copy == "never":
            raise FormatError(
                f"cudalink: {self.name!r} carries frames on cuda:{producer} "
                f"({devices.format_uuid(att.fixed.device_uuid)}); delivering them to cuda:{target} takes a copy "
                f"across GPUs and copy='never' refuses it: pass copy='auto' (a copy into a pool on cuda:{target}, "
                f"then the producer's slot goes back at once), or receive on cuda:{producer}"
            )
        if target != producer:
            allow = getattr(att.view, "allow_peer", None)
            if allow is not None:
                allow(target, att.handles[0].memory)
        return LandedAttachment(att, producer, target, buffers=att.fixed.nslots + 2)

    @property
    def ordinal(self) -> int:
        """``device=`` as this process's ordinal (checked in ``__init__``)."""
        assert self._ordinal is not None
        return self._ordinal

    def close(self) -> None:
        self._closed = True
        client = self._handshaking
        if client is not None:
            interrupt = getattr(client, "interrupt", None)
            if interrupt is not None:
                interrupt()
