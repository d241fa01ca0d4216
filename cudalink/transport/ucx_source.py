"""Frames from another host: ``Receiver("ucx://HOST:PORT/NAME")`` (the server: ``cudalink.ucx_server``).

One UCX endpoint per attachment (one producer generation). The process's UCX loop (``ucx_engine``) runs
a reader per attachment that receives each frame's header and then its bytes straight into a landing
buffer this Receiver owns, queues it, and writes one byte to a pipe: the pipe's read end is what
``fileno()`` returns and what ``recv`` sleeps on, so selectors and asyncio work as for a local link.

Landing buffers: ``credits`` of them, each ``capacity`` bytes (the link's, from WELCOME), host numpy
arrays where ``device="cpu"`` or no GPU is usable (a GPU producer can feed a CPU-only consumer), else
GPU buffers from ``cuda.landing`` (UCX's CUDA transports write there). The server may send only as many
frames as it has credits; a frame released here returns its buffer and one credit.

Where host bytes come (GPU frames the server staged through host memory: another host without RDMA, or
a UCX without ``cuda_ipc``, as WELCOME says; or a host producer's frames), a GPU consumer receives each
frame into one page-locked buffer and copies it into the landing buffer on the GPU (``cuda.ucx.Pinned``);
the frame's ready event is recorded after that copy. Its HELLO asks for GPU memory as is only where its
own UCX has a GPU path (``ucx_engine.gpu_as_is``).

``copy``: frames always land in memory this Receiver owns, so ``"auto"`` and ``"always"`` mean the same,
and ``"never"`` is refused (the network has no zero-copy). The one exception is a :class:`Lander` (the relay's):
it lends a slot of its own local link for each frame, the bytes land there and it publishes them (host bytes are
received into it; on a GPU link the one copy a GPU landing makes goes into it); a frame it does not take lands
here as any other.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .. import _platform
from ..errors import CudaError, FormatError, LinkError, ProtocolError
from ..frames.frame import Frame, _Hold
from ..frames.spec import FrameSpec
from . import ucx_engine, ucx_wire, wire
from .base import NoProducer
from .source import NO_TIME, Copy, Counters, account

__all__ = ["Lander", "Target", "UcxAttachment", "UcxSource"]

#: landing buffers (and so frames in flight or queued) per Receiver
CREDITS = 3
#: a connection lost this soon after our loop was held up is taken for the server's drop of a consumer it
#: stopped hearing from (it resets where a send was under way), and is connected again
RESUME_AFTER_STALL_S = 2.0
#: drops for silence in a row, with no frame landing in between, after which a consumer gives up (ProducerGone
#: says why) rather than connect again and again
MAX_FRUITLESS_RESUMES = 3
#: how long a closing Receiver waits, its goodbye sent, for the server to hang up before it aborts its end
HANGUP_S = 0.3
#: the longest one attempt to connect may take (a CUDA context, the connection, the handshake); the Receiver
#: tries again until its own deadline, which may be none (``timeout=None``)
_ATTEMPT_S = 30.0


class Target(Protocol):
    """Memory lent for one frame's bytes: a slot of a local link, published by :meth:`commit`.

    ``host`` is a writable uint8 view of it on a host link (None on a GPU link). On a GPU link, ``ptr`` is
    its address and ``stream`` the stream that was ordered after its readers: the one copy into it goes
    there (from the page-locked buffer host bytes land in, or from the buffer UCX wrote GPU memory into)."""

    host: npt.NDArray[np.uint8] | None
    ptr: int
    stream: int

    def commit(self) -> None:
        """The bytes are in place (UCX has finished, or a copy is queued on ``stream``): publish them."""
        ...

    def abort(self) -> None:
        """The frame never arrived whole: publish nothing."""
        ...


class Lander(Protocol):
    """Lends memory for frames as their headers arrive (on the UCX loop's thread): ``cudalink relay``."""

    def take(self, head: ucx_wire.FrameHeader, att: UcxAttachment) -> Target | None:
        """Where ``head``'s bytes go, or None: they land in the attachment's own buffer and ``recv()`` gets
        them, as without a lander. The target's device matches the attachment's (``att.device_id``)."""
        ...


def _pick_device(device: int | str | None) -> int:
    """-1 for host landing, else the GPU ordinal. ``None``: the first usable GPU, else the host."""
    if device in ("cpu", -1):
        return -1
    if device is None:
        try:
            from ..cuda import devices

            devices.device(0)
        except Exception:  # no driver, no GPU, no cuda.core: land on the host
            return -1
        return 0
    from ..cuda import devices

    return devices.parse_device(device)


class UcxSource:
    """A remote link: ``ucx://HOST:PORT/NAME``."""

    def __init__(self, url: str, *, device: int | str | None = None, copy: Copy = "auto", latest: bool = True) -> None:
        self.addr = ucx_wire.parse_address(url, need_name=True)
        assert self.addr.name is not None
        if len(self.addr.name.encode()) > ucx_wire.NAME_MAX:
            raise FormatError(f"cudalink: link name {self.addr.name!r} is longer than {ucx_wire.NAME_MAX} bytes")
        if copy == "never":
            raise FormatError(
                "cudalink: frames from another host always land in buffers this Receiver owns; "
                "use copy='auto' with a ucx:// address"
            )
        if device != -1:  # -1 lands on the host, as "cpu"; the rest is checked as a local Receiver's device=
            from ..cuda import devices

            devices.wanted_ordinal(device)
        self._stage = ucx_engine.stage_mode()  # a bad CUDALINK_UCX_STAGE fails here, before any connection
        ucx_engine.load()  # the clear error naming the extra, now rather than at the first recv
        self.key, _ = ucx_engine.load_key()
        self.name = url
        #: the host's IPv4 address, looked up for a connection and kept while connecting to it works (on the
        #: UCX loop's executor: a poll() never waits for it); a host that has none is refused there, at once
        self._ip: str | None = None
        self.latest = latest
        self._device_arg = device
        self._device: int | None = None
        self._last: UcxAttachment | None = None
        self._closed = False
        #: a connection ``poll()`` started in the background, taken by the next attach
        self._pending: concurrent.futures.Future[UcxAttachment] | None = None
        #: lends memory for each frame instead of the Receiver's own buffers (see :class:`Lander`)
        self.lander: Lander | None = None

    def attach(self, deadline: float, dead_generation: int) -> UcxAttachment:
        """Connect within ``deadline``; with no time left (``poll()``), connect in the background instead and
        say "not yet" until that connection is made: a network round trip must not stall a caller that polls
        once per rendered frame (a TouchDesigner cook, a game loop)."""
        if self._device is None:
            self._device = _pick_device(self._device_arg)
        pending = self._pending
        left = deadline - time.monotonic()
        if pending is None and deadline == NO_TIME:
            eng = ucx_engine.engine()
            pending = self._pending = eng.submit(self._connect(eng, ucx_engine.HANDSHAKE_S))
        if pending is not None:
            if not pending.done():
                concurrent.futures.wait([pending], timeout=min(max(0.0, left), _ATTEMPT_S))  # left may be inf
                if not pending.done():
                    raise NoProducer(f"connecting to {self.addr.host}:{self.addr.port}")
            self._pending = None
            return self._checked(lambda: pending.result(), dead_generation)
        eng = ucx_engine.engine()
        left = min(max(0.2, left), _ATTEMPT_S)
        return self._checked(
            lambda: eng.run(self._connect(eng, min(left, ucx_engine.HANDSHAKE_S)), left + 1.0, UcxAttachment.detach),
            dead_generation,
        )

    def _checked(self, connect: Callable[[], UcxAttachment], dead_generation: int) -> UcxAttachment:
        """The attachment ``connect`` returns, or its failure as the Receiver's retry loop reads it."""
        try:
            att = connect()
        except ucx_wire.Refused as exc:
            if exc.code == ucx_wire.R_KEY:
                ours = (
                    "set CUDALINK_KEY to the server's key (it is set here, so the key file is not read)"
                    if os.environ.get("CUDALINK_KEY")
                    else f"copy the server's key file to {ucx_engine.key_path()} or set CUDALINK_KEY"
                )
                raise ProtocolError(f"cudalink: {self.name}: the server refused our key; {ours}", exc.reason) from exc
            if exc.reason.retryable:  # quoted inside the Receiver's LinkTimeout, which says "cudalink:"
                raise NoProducer(ucx_wire.quoted(str(exc))) from exc
            raise
        except ucx_engine.Unresolved as exc:  # the resolver failed for now: it may answer next time
            raise NoProducer(ucx_wire.quoted(str(exc))) from exc
        except LinkError:  # a protocol breach, a host that never resolves, what we will not allocate: waiting
            raise  # changes none of them
        except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError) as exc:
            raise NoProducer(f"no answer from {self.addr.host}:{self.addr.port}") from exc
        except Exception as exc:  # UCX's connection errors (refused, reset, unreachable)
            ucx = f"{type(exc).__name__}: {exc}"
            if ucx_engine.truncated(exc):  # the wire-up's first read found the connection closed: nobody listens there
                ucx = f"the connection was refused or closed; UCX: {ucx}"
            raise NoProducer(
                f"no cudalink server answered at {self.addr.host}:{self.addr.port}: is `python -m cudalink serve` "
                f"(or a Sender with serve=) running there, and the port reachable? ({ucx})"
            ) from exc
        # ``dead_generation`` is the producer this Receiver saw die; a lost connection (the server died or
        # the network went) says nothing about the producer, which may still be the same one
        last = self._last
        if att.generation == dead_generation and (last is None or last.producer_gone):
            att.detach()
            raise NoProducer("only the dead producer is there")
        if self._closed:  # closed while a background connection was made: nobody will use it
            att.detach()
            raise NoProducer("closed")
        self._last = att
        return att

    async def _connect(self, eng: ucx_engine.Engine, timeout: float) -> UcxAttachment:
        assert self._device is not None
        if self._device >= 0:  # a CUDA context takes a while to make: before the server starts its clock
            from ..cuda import ucx as cuda_ucx

            cuda_ucx.use_device(self._device)
        ep, welcome, hello = await self.handshake(eng, timeout, lambda: CREDITS)
        att = UcxAttachment(eng, ep, welcome, self._device, hello.inline, self)
        att.start()
        return att

    async def handshake(
        self, eng: ucx_engine.Engine, timeout: float, credits: Callable[[], int]
    ) -> tuple[ucx_engine.Endpoint, ucx_wire.Welcome, ucx_wire.Hello]:
        """Connect, prove the key and ask for the link, granting ``credits()`` (read as the HELLO is made):
        at attach, and again when a server dropped a stalled consumer (:meth:`UcxAttachment._resume`).
        Raises ``Refused`` on a REJECT."""
        host = self.addr.host
        if self._ip is None:
            lookup = asyncio.get_running_loop().run_in_executor(None, ucx_engine.resolve, host)
            try:
                self._ip = await asyncio.wait_for(lookup, timeout)
            except (TimeoutError, asyncio.TimeoutError):  # the resolver, not the server, kept us waiting
                raise ucx_engine.Unresolved(
                    f"cudalink: the host {host!r} did not resolve within {timeout:g}s"
                ) from None
        try:
            ep = await asyncio.wait_for(eng.core.connect(self._ip, self.addr.port, timeout), timeout + 0.5)
        except BaseException:
            self._ip = None  # looked up again next time: the server may have moved to another address
            raise
        try:
            buf = bytearray(ucx_wire.MSG_SIZE)
            msg = await asyncio.wait_for(ucx_engine.recv_msg(ep, buf, None), timeout)
            nonce = ucx_wire.unpack_challenge(msg)
            assert self.addr.name is not None
            gpu = self._device is not None and self._device >= 0
            hello = ucx_wire.Hello(
                ucx_wire.proof(self.key, nonce),
                self.latest,
                gpu and ucx_engine.gpu_as_is(eng.core.transports(), self._stage),
                credits(),
                self.addr.name,
                _platform.host_id(),
                0 if gpu else ucx_wire.INLINE_MAX,  # pixels inline only where they land on the host
            )
            await ep.send(ucx_wire.pack_hello(hello))
            msg = await asyncio.wait_for(ucx_engine.recv_msg(ep, buf, None), timeout)
            welcome = ucx_wire.unpack_welcome(msg)
            _check_welcome(welcome, hello, gpu)
        except BaseException:
            with contextlib.suppress(Exception):
                ep.abort()
            raise
        return ep, welcome, hello

    def close(self) -> None:
        self._closed = True
        pending, self._pending = self._pending, None
        if pending is not None:  # a background connection (poll's): close what it makes (it ends within
            pending.add_done_callback(_detach_made)  # HANDSHAKE_S; a cancel could lose one made meanwhile)


def _check_welcome(welcome: ucx_wire.Welcome, hello: ucx_wire.Hello, gpu: bool) -> None:
    """What a WELCOME makes us allocate, checked before anything is: no more landing buffers than we granted,
    and no more host memory than this machine has (``capacity`` is the server's word for its frames' size)."""
    if welcome.credits > hello.credits:
        raise ProtocolError(f"cudalink: the ucx server took {welcome.credits} credits; we granted {hello.credits}")
    host = welcome.capacity * (1 if gpu else welcome.credits)  # a GPU landing stages through one host buffer
    have = _platform.physical_memory()
    if have is not None and host > have:
        raise LinkError(
            f"cudalink: the remote link's frames are up to {welcome.capacity} bytes, and landing "
            f"{'them' if gpu else f'{welcome.credits} of them'} needs {host} bytes of host memory, more than this "
            f"machine's {have}; have its producer send smaller frames"
        )


def _detach_made(fut: concurrent.futures.Future[UcxAttachment]) -> None:
    if fut.exception() is None:
        with contextlib.suppress(Exception):
            fut.result().detach()


class _Landing(_Hold):
    """A received frame's hold: when the frame and its last export die, its buffer (and a credit) go back.

    ``slot`` is a host buffer's index, or a GPU buffer's ``cuda.landing.Landed``, which fences itself on
    the streams the frame was exported to before it is reused."""

    __slots__ = ("att", "slot")

    def __init__(self, att: UcxAttachment, slot: Any, owner: object, ptr: int) -> None:
        super().__init__(owner, ptr)
        self.att: UcxAttachment | None = att
        self.slot = slot

    def end(self) -> None:
        att = self.att
        if att is not None:
            self.att = None
            if not isinstance(self.slot, int):
                self.slot.give_back(self.streams)
            att.give_back(self.slot)

    def __del__(self) -> None:
        try:  # not contextlib.suppress: modules may be torn down at interpreter exit
            self.end()
        except Exception:
            pass


def _receive(rx: Counters, att: Any) -> Frame | None:
    q = att.ready
    if not q:
        return None
    try:
        if rx.latest:
            while len(q) > 1:  # the newest wins: older ones go back at once (counted as skipped by seq)
                _, old = q.popleft()
                att.give_back(old)
        head, idx = q.popleft()
    except IndexError:  # the UCX thread gave the oldest back meanwhile (see _land_frames): the next one comes
        return None
    account(rx, head.seq)
    spec: FrameSpec = head.spec
    if not isinstance(idx, int):  # a GPU landing buffer (cuda.landing.Landed): its sync orders consumers
        from ..cuda import arrays

        hold = _Landing(att, idx, idx, idx.ptr)
        export = arrays.dlpack_exporter(idx.ptr, spec, att.device_id)
        return Frame._received(
            spec, hold, att.device_id, head.seq, head.timestamp_ns, head.meta, idx, att.generation, None, export
        )
    raw = att.buffers[idx]
    arr = raw[: spec.nbytes].view(spec.dtype).reshape(spec.shape)
    ro = arr.view()
    ro.flags.writeable = False
    ptr = int(raw.ctypes.data)
    hold = _Landing(att, idx, raw, ptr)
    return Frame._received(spec, hold, -1, head.seq, head.timestamp_ns, head.meta, None, att.generation, (arr, ro))


def _sleep_receive(rx: Counters, att: Any, timeout: float, waiting: int, after: int) -> Frame | None:
    frame = _receive(rx, att)
    if frame is not None or att.interrupted:
        return frame
    _platform.wait_readable(att.rfd, timeout)  # poll, not select: an fd past 1024 is fine
    return _receive(rx, att)


class UcxAttachment:
    """One producer generation over the network: ``credits`` landing buffers, and the connection that fills
    them. A server that drops this consumer for silence while it was only stalled (its process held the GIL:
    a framework's first CUDA call, say) is reached again on a new connection (:meth:`_resume`): the frames
    that went by meanwhile count as skipped, as they would for a stalled local consumer."""

    backend = "ucx"
    spins = False  # our UCX thread lands the frames: recv() sleeps on the pipe, never spins (see Attachment)
    receive = staticmethod(_receive)
    sleep_receive = staticmethod(_sleep_receive)
    #: guards the wake-up pipe's fds against a close on the other thread; each attachment gets its own in
    #: ``__init__`` (this one serves an attachment made without it)
    _pipe_lock = threading.Lock()
    interrupted = False  #: set by close(): see interrupt()

    def __init__(
        self,
        eng: ucx_engine.Engine,
        ep: Any,
        welcome: ucx_wire.Welcome,
        device: int,
        inline: int = 0,
        source: UcxSource | None = None,
    ) -> None:
        self.eng = eng
        self.inline = inline  # the pixel bytes a FRAME message may carry (what our HELLO asked for)
        self.ep = ep
        self.source = source  # connects again after a drop for silence (None: never)
        self.latest = source.latest if source is not None else True
        self.generation = welcome.generation
        self.capacity = welcome.capacity
        self.staged = welcome.staged
        self.floor = welcome.floor
        self.producer_backend = wire.BACKEND_NAMES[welcome.backend]
        self.device_id = device
        self._device = "cpu" if device < 0 else f"cuda:{device}"
        self.path = "network"  # stats()["path"]: received into buffers this Receiver owns
        n = welcome.credits
        self.pool: Any = None
        self.pinned: Any = None
        if device >= 0:  # GPU landing: UCX's CUDA transports write straight into buffers of this pool
            from ..cuda import landing
            from ..cuda import ucx as cuda_ucx

            cuda_ucx.use_device(device)  # this runs on the UCX loop's thread, which touches CUDA from now on
            self.pool = landing.Landing(device, self.capacity, limit=n)
            # host bytes (GPU frames the server staged, or a host producer's) land here first, then on the GPU
            # on our stream: UCX receiving host bytes into GPU memory itself stages them in its progress calls
            host_bytes = welcome.staged or welcome.backend == wire.BACKEND_HOST
            self.pinned = cuda_ucx.Pinned(device, self.capacity) if host_bytes else None
            self.buffers = []
            self.free = [-1] * n  # credits only; the pool picks the buffer
        else:
            self.buffers = [np.zeros(self.capacity, np.uint8) for _ in range(n)]  # calloc: no stale process memory
            self.free = list(range(n))
        #: landed frames: (header, host buffer index or GPU ``Landed``)
        self.ready: collections.deque[tuple[ucx_wire.FrameHeader, Any]] = collections.deque()
        self.dead = ""  # why the connection ended ("" while it lives)
        #: a GPU call of ours that failed while landing a frame: the end is this process's, not the producer's
        self.failure: CudaError | None = None
        self.leaving = False  # our goodbye is sent: the server's hang-up that follows is no loss to resume from
        self.producer_gone = False  # the server said the producer closed or died (not just: the connection ended)
        #: the server said the producer closed cleanly, after the frames it published before: what ``closing()``
        #: says (a local Receiver reads it off the ring's shutdown flag)
        self.producer_closed = False
        #: the seq of the producer's last frame, as the server's goodbye said it (0: not said): the frames after
        #: the last one landed never come, and the Receiver counts them as skipped (see ``Attachment``)
        self.last_published = 0
        self.heard = time.monotonic()
        self.sent = time.monotonic()
        self.tick = time.monotonic()  # the watchdog's last turn: long ago means our loop is held up right now
        self.stalled = -float("inf")  # when the watchdog last found our loop had been held up
        self.resuming = False  # between a drop for silence and the new connection's WELCOME
        self.resumes = 0
        self.fruitless = 0  # resumes since the last frame landed
        self.last_seq = 0  # the last frame landed: the server's next must come after it
        self.owed = 0  # buffers given back while resuming: credits to send once connected again
        self._freed = asyncio.Event()
        self.rfd, self.wfd = os.pipe()
        self._pipe_lock = threading.Lock()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.detached = False
        self._tasks: list[asyncio.Task[None]] = []
        self._sends: set[asyncio.Future[None]] = set()

    @property
    def device(self) -> str:
        return self._device

    # -- on the UCX loop ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._reader()), asyncio.ensure_future(self._watchdog())]
        self._post(ucx_wire.pack_ping())  # set up (a GPU's landing pool made): the server's clock starts now

    def _wake(self) -> None:
        with self._pipe_lock, contextlib.suppress(OSError):  # never a number _close_pipe has given back
            if self.wfd >= 0:
                os.write(self.wfd, b"\x01")

    def interrupt(self) -> None:
        """The Receiver is being closed: its waiting recv wakes, and leaves. The flag stays: ``alive()``
        drains the pipe, and a close landing between that drain and the sleep would lose its byte."""
        self.interrupted = True
        self._wake()

    def _end(self, why: str) -> None:
        if not self.dead:
            self.dead = why
        self.resuming = False
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        with contextlib.suppress(Exception):
            self.ep.abort()
        self._wake()

    async def _reader(self) -> None:
        while True:
            why, resumable = await self._land_frames()
            if self.dead or self.leaving:
                return
            if not (resumable and await self._resume(why)):
                self._end(why)
                return

    async def _land_frames(self) -> tuple[str, bool]:
        """Land frames until this connection ends: why it ended, and whether to connect again."""
        buf = bytearray(ucx_wire.MSG_SIZE + self.inline)
        msg = memoryview(buf)[: ucx_wire.MSG_SIZE]
        try:
            while True:
                # a posted receive, which says nothing of the length: probing each header for it cost the
                # 64x64x4 handoff ~65 us p50 (2-vCPU VM, paired with phases in turn, 2026-11-26). An inline FRAME
                # shorter than its header says is not caught: its missing pixels read as zeros (below), never
                # as an older frame's.
                await ucx_engine.recv_msg(self.ep, buf, None)
                self.heard = time.monotonic()
                kind = ucx_wire.expect(msg, ucx_wire.FRAME, ucx_wire.PING, ucx_wire.BYE)
                if kind == ucx_wire.PING:
                    continue
                if kind == ucx_wire.BYE:
                    reason, text = ucx_wire.unpack_text(msg)
                    if reason == ucx_wire.R_PRODUCER_CLOSED:  # before the flags: the Receiver's thread reads them
                        self.last_published = ucx_wire.bye_last(msg)
                    self.producer_gone = reason in (ucx_wire.R_PRODUCER_GONE, ucx_wire.R_PRODUCER_CLOSED)
                    self.producer_closed = reason == ucx_wire.R_PRODUCER_CLOSED
                    said = ucx_wire.quoted(text)  # the Receiver's ProducerGone says "cudalink:" and what to do
                    return f"{ucx_wire.REASON_TEXT.get(reason, 'closed')}: {said}", reason == ucx_wire.R_SILENT
                head = ucx_wire.unpack_frame(msg, self.capacity, self.inline)
                if head.generation != self.generation:
                    raise ProtocolError(f"cudalink: frame of generation {head.generation} on {self.generation}")
                if head.seq <= self.last_seq:  # a producer's count only grows within its generation
                    raise ProtocolError(f"cudalink: frame seq {head.seq} after seq {self.last_seq}")
                if not self.free:
                    raise ProtocolError("cudalink: the ucx server sent a frame beyond its credits")
                lander = self.source.lander if self.source is not None else None
                target = lander.take(head, self) if lander is not None else None
                if target is not None:  # lent memory: the frame is published there, and its credit goes back
                    credit = self.free.pop()
                    try:
                        await self._land_in(target, head, buf)
                    except BaseException:
                        self.free.append(credit)  # the frame never landed: the credit is ours again
                        raise
                    self._landed(head)
                    self._returned(credit)
                    continue
                idx = slot = self.free.pop()
                try:
                    if head.inline:  # the pixels came in this message (only a host landing asks for that)
                        n = head.nbytes
                        self.buffers[idx][:n] = np.frombuffer(buf, np.uint8, n, ucx_wire.MSG_SIZE)
                    elif self.pool is not None:
                        idx = await self._land(head.nbytes)
                    else:
                        await self.ep.recv_sized(self.buffers[idx][: head.nbytes])
                except BaseException:
                    self.free.append(slot)  # the frame never landed: its buffer (and credit) is ours again
                    raise
                self._landed(head)
                ready = self.ready
                ready.append((head, idx))
                if self.latest and not self.free and len(ready) > 1:
                    # newest wins: with no buffer left and frames unread (a consumer that stopped calling recv
                    # for a while), the oldest goes back, so its credit brings the next frame and the first
                    # recv() afterwards is handed the newest, not one as old as the pause (counted as skipped)
                    with contextlib.suppress(IndexError):  # recv() on the caller's thread took it meanwhile
                        self._returned(ready.popleft()[1])
                self._wake()
                if head.inline:  # zeroed for the next receive (see above), once the consumer is woken
                    buf[ucx_wire.MSG_SIZE : ucx_wire.MSG_SIZE + head.nbytes] = bytes(head.nbytes)
        except asyncio.CancelledError:
            raise
        except ProtocolError as exc:
            return f"sent a bad message ({exc})", False
        except CudaError as exc:  # our GPU, not the network: read as a lost connection, a relay reconnected for ever
            self.failure = exc
            return f"landing a frame on this process's GPU failed ({exc})", False
        except Exception as exc:
            # a server drops a stalled consumer with a reset where a send to it was under way
            return f"connection lost ({type(exc).__name__}: {exc})", self._was_stalled()

    def _landed(self, head: ucx_wire.FrameHeader) -> None:
        self.heard = time.monotonic()
        self.fruitless = 0
        self.last_seq = head.seq

    async def _land_in(self, target: Target, head: ucx_wire.FrameHeader, buf: bytearray) -> None:
        """Land a frame in memory a :class:`Lander` lent, and commit it there (abort it if it never came)."""
        n = head.nbytes
        try:
            if target.host is not None:
                if head.inline:
                    target.host[:n] = np.frombuffer(buf, np.uint8, n, ucx_wire.MSG_SIZE)
                    buf[ucx_wire.MSG_SIZE : ucx_wire.MSG_SIZE + n] = bytes(n)  # zeroed for the next (as below)
                else:
                    await self.ep.recv_sized(target.host[:n])
            else:
                from ..cuda import ucx as cuda_ucx

                pinned = self.pinned
                if pinned is not None:  # host bytes: into page-locked memory, then one copy on the target's stream
                    await pinned.idle()
                    await self.ep.recv_sized(pinned.array[:n])
                    pinned.to_device(target.ptr, n, target.stream)
                else:
                    # GPU memory as is: UCX writes a buffer of ours, then one GPU copy goes into the target on its
                    # stream. UCX 1.21 wrote the slots (a CUDA pool's memory) itself at a third of the rate: on an
                    # H200 with cuda_ipc, 1080p, 214 frames/s against 624 (benchmarks/relay_rate.py, 2026-11-27)
                    landed, stream = self.pool.take()
                    try:
                        await cuda_ucx.drained(stream)  # UCX writes with its own stream: nothing may read it now
                        await self.ep.recv_sized(cuda_ucx.DeviceBytes(landed.ptr, n))
                        cuda_ucx.copy_on_gpu(target.ptr, landed.ptr, n, target.stream)
                    finally:
                        landed.give_back([target.stream])  # reused once that copy has run
        except BaseException:
            target.abort()
            raise
        target.commit()

    def _was_stalled(self) -> bool:
        """Our loop is held up now, or was a moment ago: a lost connection is then likely the server's drop
        of a consumer it stopped hearing from, not the server's end."""
        now = time.monotonic()
        return ucx_engine.held_up(self.tick, now) or now - self.stalled < RESUME_AFTER_STALL_S

    async def _resume(self, why: str) -> bool:
        """Connect again to the same producer generation after the server dropped us (``why``), and carry on.

        False where that cannot be: no server answers, or it now serves another producer generation (then
        the Receiver's next ``recv()`` raises ProducerGone, as for any producer restart)."""
        source = self.source
        if source is None or self.detached:
            return False
        if self.fruitless >= MAX_FRUITLESS_RESUMES:
            self.dead = (
                f"{why}; dropped {self.fruitless + 1} times in a row without a frame landing in between (this "
                f"process's UCX thread was held up for over {ucx_engine.DEAD_AFTER_S}s each time)"
            )
            return False
        self.fruitless += 1
        self.resuming = True
        with contextlib.suppress(Exception):
            self.ep.abort()
        ucx_engine.log.warning(
            "cudalink: %s: the connection ended (%s); connecting again (frames meanwhile are skipped)",
            source.name,
            why,
        )

        def grant() -> int:  # read as the HELLO is made: buffers freed after it are sent as CREDIT then
            self.owed = 0
            return min(len(self.free), ucx_wire.MAX_CREDITS)

        try:
            while not self.free:  # every landing buffer is held by a frame: the server may send nothing yet
                self._freed.clear()
                await self._freed.wait()
            ep, welcome, _ = await source.handshake(self.eng, ucx_engine.HANDSHAKE_S, grant)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            ucx_engine.log.info("cudalink: %s: connecting again failed (%s: %s)", source.name, type(exc).__name__, exc)
            return False
        same = (welcome.generation, welcome.capacity, welcome.staged) == (self.generation, self.capacity, self.staged)
        if self.dead or not same:
            with contextlib.suppress(Exception):
                ep.abort()
            if not same:
                self.producer_gone = True  # a new producer generation: the Receiver attaches to it afresh
                self.dead = self.dead or f"{why}; the producer restarted meanwhile (generation {welcome.generation})"
            return False
        self.ep = ep
        self.heard = self.sent = time.monotonic()
        self.resuming = False
        self.resumes += 1
        if self.owed:
            self._post(ucx_wire.pack_credit(self.owed))
            self.owed = 0
        return True

    async def _land(self, nbytes: int) -> Any:
        """Receive ``nbytes`` into a GPU landing buffer once every consumer fence on it has passed.

        UCX writes with its own stream and ignores ours, so the fences are waited for on the CPU (polled,
        never blocking the loop); the landed buffer's ready event is recorded after UCX has finished."""
        from ..cuda import ucx as cuda_ucx

        pinned = self.pinned
        if pinned is not None:  # staged by the server: host bytes first, while our GPU may still be busy
            await pinned.idle()
            await self.ep.recv_sized(pinned.array[:nbytes])
        landed, stream = self.pool.take()
        await cuda_ucx.drained(stream)
        try:
            if pinned is not None:
                pinned.to_device(landed.ptr, nbytes, stream)
            else:
                await self.ep.recv_sized(cuda_ucx.DeviceBytes(landed.ptr, nbytes))
            landed.mark_ready(stream)
        except BaseException:
            landed.give_back([])
            raise
        return landed

    async def _watchdog(self) -> None:
        last = time.monotonic()
        while not self.dead:
            await asyncio.sleep(ucx_engine.PING_S)
            now = time.monotonic()
            if ucx_engine.held_up(last, now):
                # our own loop was held up (the application kept the GIL): the silence was ours, not the
                # server's; what the server sent meanwhile is still queued. Judge it from now on.
                self.heard = max(self.heard, now - ucx_engine.PING_S)
                self.stalled = now
            last = self.tick = now
            if self.resuming:  # the handshake has its own timeout
                continue
            if now - self.heard > ucx_engine.DEAD_AFTER_S:
                self._end(f"went silent for {now - self.heard:.1f}s")
                return
            if now - self.sent >= ucx_engine.PING_S:
                self._post(ucx_wire.pack_ping())

    def _post(self, msg: bytes) -> None:
        """Send a PING or CREDIT on the current connection (none while resuming: the HELLO grants)."""
        if self.dead or self.resuming:
            return
        self.sent = time.monotonic()
        ep = self.ep

        async def send() -> None:
            try:
                await ep.send(msg)
            except Exception as exc:
                # the reader sees a lost connection too and decides; this only ends one it would not notice
                if ep is self.ep and not self.resuming and not self._was_stalled():
                    self._end(f"connection lost ({type(exc).__name__}: {exc})")

        self._spawn(send())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return task

    def _returned(self, idx: Any) -> None:
        self.free.append(idx if isinstance(idx, int) else -1)
        if self.resuming:
            self.owed += 1
            self._freed.set()
        elif not self.dead and not self.detached:
            self._post(ucx_wire.pack_credit(1))

    def _close_on_loop(self) -> None:
        async def leave() -> None:
            if not self.dead:
                msg = ucx_wire.pack_bye(ucx_wire.R_CLIENT_CLOSE, "consumer closed")
                self.leaving = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ep.send(msg), 0.5)
                    # the server hangs up once it has read it: our abort before that could reset the
                    # connection first, losing the goodbye (the server then logged a reset, 1 in 10 runs on a
                    # loaded 2-core VM)
                    await asyncio.wait(self._tasks[:1], timeout=HANGUP_S)
                self._end("closed")
            # the endpoint is aborted and the reader has ended: UCX writes into none of our buffers now
            await asyncio.gather(*self._tasks, return_exceptions=True)
            try:
                await asyncio.to_thread(self._free_memory)  # it may wait on the GPU: never on the loop
            except RuntimeError:  # at interpreter exit the executor takes no more work: here, then
                self._free_memory()
            self._close_pipe()

        task = self._spawn(leave())
        closing = self.eng.closing
        closing.add(task)
        task.add_done_callback(closing.discard)

    def _close_pipe(self) -> None:
        """The wake-up pipe, closed with the connection (not left to the garbage collector: a cycle keeps
        an attachment, and so its two fds, alive until a collection runs)."""
        with self._pipe_lock:  # a close() on another thread may be in _wake (interrupt) right now
            rfd, wfd, self.rfd, self.wfd = self.rfd, self.wfd, -1, -1
            for fd in (rfd, wfd):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _free_memory(self) -> None:
        """The landing buffers no frame holds (a held one goes when its frame does: frames landed but never
        taken are given back here) and the page-locked one, freed now: left to the garbage collector, they
        stayed allocated after ``close()``, and were freed at interpreter exit after CUDA's teardown had
        begun, which crashed the process (SIGSEGV, H100, 2026-11-26)."""
        while self.ready:  # landed, never taken: no frame holds these
            _, slot = self.ready.popleft()
            if not isinstance(slot, int):
                slot.give_back([])
        if self.pool is not None:
            self.pool.close()
        pinned, self.pinned = self.pinned, None
        if pinned is not None:
            pinned.close()

    # -- on the Receiver's thread ---------------------------------------------------------------------------

    def give_back(self, idx: Any) -> None:
        self.eng.call_soon(self._returned, idx)

    def closing(self) -> bool:
        return self.producer_closed

    @property
    def reason(self) -> str:
        """Why the connection ended, as the server said or as UCX reported it ("" while it lives)."""
        return self.dead

    def alive(self) -> bool:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.rfd, 4096):
                pass
        return not self.interrupted and (not self.dead or bool(self.ready))

    def set_waiting(self, state: int) -> None:
        pass

    def count(self, received: int, skipped: int) -> None:
        pass

    def fileno(self) -> int:
        return self.rfd

    async def wait_async(self, timeout: float | None) -> None:
        if self.interrupted:
            return
        await _platform.wait_readable_async(self.rfd, timeout)

    def detach(self) -> None:
        """Say goodbye and close the endpoint; landed frames still held stay valid (numpy owns the memory)."""
        if self.detached:
            return
        self.detached = True
        self.eng.call_soon(self._close_on_loop)

    def __del__(self) -> None:
        self._close_pipe()
        if self.pinned is not None and not sys.is_finalizing():  # nothing receives into it: the reader held us
            try:  # not contextlib.suppress: modules may be torn down at interpreter exit
                self.pinned.close()
            except Exception:
                pass


def error_without_ucx(url: str) -> LinkError:
    return LinkError(f"cudalink: {url} needs UCXX; {ucx_engine.INSTALL_HINT}")
