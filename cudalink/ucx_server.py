"""Serve a local link to remote consumers over UCX (``python -m cudalink serve``, ``Sender(serve=...)``).

Each remote consumer gets its own local :class:`Receiver` on the link (its own lease column, with the
latest/in-order mode it asked for), so a slow consumer never touches another, and the producer never
waits on the network. The server runs in its own process (its own GIL). Host frames go out straight
from the leased slot, which is held only while its bytes are on the wire, as long as the link keeps
``SPARE_SLOTS`` slots free of such sends; past that a frame is copied out and its slot given back at once.

A GPU frame is first copied on the GPU into a buffer the server owns (the local Receiver's
``copy="always"``), and its slot goes back as soon as that copy has run; UCX's CUDA transports then send
from the copy once its ready event has completed (polled, never blocking the loop). Why not from the
slot: the slots come from a CUDA memory pool, and UCX 1.21's ``cuda_ipc`` cannot map pool memory. On an
H100 (2026-11-25, bare UCXX, 1080p RGBA, ``UCX_TLS=tcp,cuda_copy,cuda_ipc``) a send from pool memory fell
back to staging at 0.25 GB/s, from ``cuMemAlloc`` memory it ran at 15 GB/s; the copy costs the GPU a few
microseconds per frame, and a remote consumer then never holds a producer's slot during a network send.
For a consumer on another host without RDMA, one whose UCX (or ours) has no ``cuda_ipc``, or one landing on
the host, the frame is instead copied straight from the slot into page-locked host memory and sent as host
bytes (``ucx_engine.stage_on_host``). Up to ``MAX_FLIGHT`` GPU frames of one consumer are on their way at
once, each in its own buffer, so that taking and readying the next overlaps the last one's transfer.

Flow control is by credits: a consumer grants as many as it has landing buffers and returns one per
frame it has released. With no credit left the server takes nothing: the local ring moves on and
the frames this consumer missed are counted (seq gaps) by both sides, never pushed back to the producer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _platform
from .errors import LinkError, LinkTimeout, ProducerGone, ProtocolError, ProtocolReason
from .frames.frame import Frame
from .frames.spec import FrameSpec
from .link import Receiver
from .transport import shm, ucx_engine, ucx_wire
from .transport import wire as shm_wire
from .transport.ring_source import RingAttachment, RingSource
from .transport.source import Copy
from .transport.ucx_engine import say

log = logging.getLogger("cudalink.ucx")

#: landing buffers (credits) a consumer may hold at once; each is one frame in flight or queued there
MAX_GRANT = 4
#: GPU frames one consumer may have on the wire at once, each in a buffer of the server's (its GPU copy, or
#: its page-locked stage): the next frame is taken, copied and readied while the last one's bytes move. One at
#: a time, an H200 GPU -> GPU stream over ``cuda_ipc`` (2026-11-27, 1080p) spent 0.69 ms a frame, 0.3 ms of
#: it readying the next frame after the last one's send had completed; three at a time streamed 1.34-1.61x the
#: frames (benchmarks/results/h200-2026-11-27-s18-remote-gpu-flights-ab.txt).
MAX_FLIGHT = 3
#: producer slots a server's sends from the slots themselves always leave free: one for the producer to write
#: into, one for the newest frame. Each host frame on the wire from its slot holds that slot, so a few remote
#: consumers on a link with few slots took every one, and the local producer dropped frames (2 slots, 4
#: consumers, 1080p at 60 fps on 2 vCPUs: 8 of 387 dropped). Past that, a frame is copied out and sent from
#: the copy.
SPARE_SLOTS = 2
#: how long the endpoint of a consumer dropped for silence stays open, so a stalled one can read why
SILENT_GRACE_S = 10.0
#: how long a consumer may stay silent while a frame's send to it from the server's own memory is under way
#: (a GPU frame's copy, or its host staging): no producer slot waits on it, and a consumer landing frames on a
#: busy GPU may spend that long inside UCX's progress, unable to say anything (H100, 2026-11-26, GPU tests
#: beside ``tcp,cuda_copy``: the consumer's UCX loop was held 0.3 s at a time there)
BUSY_SILENCE_S = 3.0
#: how long a server started on a port still held by a crashed predecessor keeps trying it
BUSY_RETRY_S = 15.0
#: how long a stopping server waits for its consumers to read its goodbye and hang up
GOODBYE_S = 0.5


async def _gpu_ready(frame: Frame, stage: Any) -> Any:
    """The frame's bytes to send, once its ready event has passed (polled: the loop never blocks): the GPU
    memory itself, or with ``stage`` (a ``cuda.ucx.Pinned``) a copy of it in page-locked host memory."""
    from .cuda import ucx as cuda_ucx

    cuda_ucx.use_device(int(frame.device.split(":")[1]))
    # what reading its CUDA array interface does (one of our streams waits on the frame's ready event), which a
    # bfloat16 frame has not: its bytes go as bytes
    ptr, stream = frame._cai_ready()
    if stage is not None:
        return await stage.to_host(ptr, frame.nbytes, stream)
    await cuda_ucx.drained(stream)
    return cuda_ucx.DeviceBytes(ptr, frame.nbytes)


def _producer_gone(rx: Receiver) -> bool:
    """The local producer closed the link or died (read without taking a frame)."""
    att = rx._att
    return att is not None and (att.closing() or not att.alive())


class _Flight:
    """One GPU frame on its way out (see ``_Consumer._flight``)."""

    __slots__ = ("before", "frame", "stage", "turn")

    def __init__(self, frame: Frame, stage: Any, before: asyncio.Future[bool] | None, turn: asyncio.Future[bool]):
        self.frame: Frame | None = frame
        self.stage = stage
        self.before = before  # the flight before's turn: this one posts only after it has posted
        self.turn = turn


class _Consumer:
    """One remote consumer: the handshake, then frames out and credits in until either side goes."""

    def __init__(self, server: Server, ep: Any) -> None:
        self.server = server
        self.ep = ep
        self.credits = 0
        self.credit = asyncio.Event()
        self.heard = time.monotonic()
        self.rx: Receiver | None = None
        self.sent = 0
        self.gone = asyncio.Event()
        self.why = ""
        self.silent = False  # dropped for silence: maybe only stalled, so its endpoint outlives it a while
        self.staged = False  # GPU frames go out as host bytes (see ucx_engine.stage_on_host)
        self.drain_until: float | None = None  # see _draining
        self.hung_up = asyncio.Event()  # our reader of its messages ended: it left, or the connection did
        self.told_end = False  # told its producer is gone: it is given a moment to read that and hang up
        self.inline = 0  # host bytes up to this many go in the FRAME message itself (the client's HELLO)
        self.out = bytearray()  # that one message, made once
        self.copy: np.ndarray[Any, Any] | None = None  # a host frame copied out of its slot (see SPARE_SLOTS)
        self.pinned: list[Any] = []  # their page-locked buffers (``cuda.ucx.Pinned``), one per GPU frame in flight
        self.stages: list[Any] = []  # those of them free
        #: GPU frames on their way out (see _send_gpu): sends from memory of ours, no producer slot held (see
        #: BUSY_SILENCE_S)
        self.flights: set[asyncio.Task[None]] = set()
        self.most_flights = 0
        self.halt = asyncio.Event()  # a flight failed: the connection ends
        self.turn: asyncio.Future[bool] | None = None  # the last flight's: True once it has posted its frame

    async def run(self) -> None:
        try:
            if await self._handshake():
                await self._serve()
        except ProtocolError as exc:
            # "ProtocolError" named (the word for it), the message without its own "cudalink: "
            log.warning("cudalink serve: closing a connection: ProtocolError: %s", str(exc).removeprefix("cudalink: "))
            await self._bye(ucx_wire.R_BAD_MESSAGE, str(exc))
        except (asyncio.CancelledError, Exception) as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.info("cudalink serve: a consumer left (%s: %s; %s)", type(exc).__name__, exc, self._counts())
                log.debug("cudalink serve: why", exc_info=True)
        finally:
            self._close(abort=not self.silent)  # a silent one's endpoint goes after its grace

    async def _handshake(self) -> bool:
        buf = bytearray(ucx_wire.MSG_SIZE)
        nonce = secrets.token_bytes(ucx_wire.NONCE_SIZE)
        await self.ep.send(ucx_wire.pack_challenge(nonce))
        try:
            msg = await asyncio.wait_for(ucx_engine.recv_msg(self.ep, buf, None), ucx_engine.HANDSHAKE_S)
        except asyncio.TimeoutError:
            log.warning("cudalink serve: a connection sent no HELLO within %.0fs", ucx_engine.HANDSHAKE_S)
            return False
        hello = ucx_wire.unpack_hello(msg)
        if not ucx_wire.check_proof(self.server.key, nonce, hello.proof):
            log.warning("cudalink serve: refused a connection with the wrong key")
            await self._send(ucx_wire.pack_reject(ucx_wire.R_KEY, "wrong key: copy the server's key"))
            return False
        try:
            name = _platform.check_name(hello.name)
        except LinkError as exc:
            await self._send(ucx_wire.pack_reject(ucx_wire.R_NAME, str(exc)))
            return False
        if self.server.name is not None and name != self.server.name:
            await self._send(ucx_wire.pack_reject(ucx_wire.R_NO_LINK, f"this server serves {self.server.name!r}"))
            return False
        if self.server.closing is not None:  # goodbye said: a WELCOME now would be cut off by our exit
            log.info("cudalink serve: refused a consumer that connected while stopping")
            await self._send(ucx_wire.pack_reject(*self.server.closing))
            return False
        same_host = hello.host == _platform.host_id()
        srv = self.server
        self.staged = ucx_engine.stage_on_host(hello.device, same_host, srv.rdma, srv.stage_mode, srv.ipc)
        # Sent as GPU memory, a frame is first copied into a buffer of ours (copy="always": see the module's
        # docstring); staged, it is copied out to host memory straight from the producer's slot
        copy: Copy = "auto" if self.staged else "always"
        try:
            # host frames go straight from the slot in either case (copy_host=False)
            # read-write: UCX may register a host slot it sends from for writing (RDMA), and fails on PROT_READ
            source = RingSource(name, shm.SharedMemoryTransport(read_only=False), copy=copy, copy_host=False)
            rx = await asyncio.to_thread(Receiver, name, timeout=0.0, latest=hello.latest, source=source)
        except LinkTimeout:
            await self._send(ucx_wire.pack_reject(ucx_wire.R_NO_LINK, f"no producer publishes {name!r} here now"))
            return False
        except ProtocolError as exc:
            full = exc.reason is ProtocolReason.FULL  # the link's max_consumers are taken
            code = ucx_wire.R_FULL if full else ucx_wire.R_NO_LINK
            await self._send(ucx_wire.pack_reject(code, f"{name!r}: {exc}"))
            return False
        except LinkError as exc:
            await self._send(ucx_wire.pack_reject(ucx_wire.R_NO_LINK, f"{name!r}: {exc}"))
            return False
        self.rx = rx
        self.credits = min(hello.credits, MAX_GRANT)
        self.inline = min(hello.inline, rx.capacity)
        backend = {v: k for k, v in shm_wire.BACKEND_NAMES.items()}.get(rx.backend, shm_wire.BACKEND_HOST)
        self.staged = self.staged and backend != shm_wire.BACKEND_HOST  # host frames are host bytes anyway
        welcome = ucx_wire.Welcome(rx.generation, rx.capacity, self.credits, backend, rx._floor, self.staged)
        await self._send(ucx_wire.pack_welcome(welcome))
        self.credit.set()
        log.info(
            "cudalink serve: a consumer joined %r (latest=%s, %s)",
            name,
            hello.latest,
            "GPU frames as host bytes" if self.staged else "frames as they are",
        )
        return True

    async def _send(self, msg: bytes) -> None:
        await self.ep.send(msg)

    async def _bye(self, reason: int, text: str, wait: float = 0.5, last: int = 0) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ep.send(ucx_wire.pack_bye(reason, text, last)), wait)

    async def _lost_producer(self, why: object) -> None:
        """The local producer closed or died: the consumer hears which (its ProducerGone carries ``why``)."""
        rx = self.rx
        closed = getattr(why, "closed", False) or (rx is not None and rx._att is not None and rx._att.closing())
        if closed:
            assert rx is not None
            # the producer's last seq: frames a consumer behind by more than DRAIN_S never gets are counted by it
            att = rx._att
            last = att.published() if isinstance(att, RingAttachment) else 0
            await self._bye(ucx_wire.R_PRODUCER_CLOSED, f"the producer of {rx.name!r} closed the link", last=last)
        else:
            await self._bye(ucx_wire.R_PRODUCER_GONE, str(why))
        self.why = "lost its producer"
        self.told_end = True

    async def _producer_left(self, why: object) -> None:
        """The sender found the producer gone: GPU frames it took before are posted first (their flights may
        still be readying them), then the goodbye, or a ``latest=False`` consumer would miss them. Not for
        a flight itself, which calls :meth:`_lost_producer` inside its own turn."""
        turn = self.turn
        if turn is not None and not turn.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(turn), GOODBYE_S)
        if not self.halt.is_set():  # a flight that failed has said why already
            await self._lost_producer(why)

    def _draining(self, rx: Receiver) -> bool:
        """The producer closed cleanly less than ``DRAIN_S`` ago: the frames it published before are still this
        consumer's to take once it gives credit back, so it is waited for (and pinged) a while longer."""
        att = rx._att
        if att is None or not att.closing():
            return False
        if self.drain_until is None:
            self.drain_until = time.monotonic() + ucx_engine.DRAIN_S
        return time.monotonic() < self.drain_until

    def _counts(self) -> str:
        most = f"; up to {self.most_flights} GPU frames on their way at once" if self.most_flights else ""
        return f"{self.sent} frames sent{most}"

    async def _failed(self, what: str, exc: BaseException) -> None:
        """Log a failure of ours and say it to the consumer before the connection goes: its ProducerGone
        carries this text."""
        why = f"{what}: {type(exc).__name__}: {exc}"
        if ucx_engine.peer_gone(exc):  # the consumer went away mid-send (it quit, or its cable went): no fault
            self.why = f"went away ({why})"  # of ours, and said once it leaves (run()'s last line, with -v)
            return
        log.warning("cudalink serve: %s", why, exc_info=exc)
        await self._bye(ucx_wire.R_SERVER_ERROR, why)
        self.why = f"was dropped ({why})"

    async def _reader(self) -> None:
        """Credits, pings and goodbyes from the consumer; anything else closes the connection."""
        buf = bytearray(ucx_wire.MSG_SIZE)
        try:
            while True:
                msg = await ucx_engine.recv_msg(self.ep, buf, None)
                self.heard = time.monotonic()
                kind = ucx_wire.expect(msg, ucx_wire.CREDIT, ucx_wire.PING, ucx_wire.BYE)
                if kind == ucx_wire.CREDIT:
                    self.credits = min(self.credits + ucx_wire.unpack_credit(msg), ucx_wire.MAX_CREDITS)
                    self.credit.set()
                elif kind == ucx_wire.BYE:
                    self.why = "said goodbye"
                    return
        finally:
            self.hung_up.set()

    async def _watchdog(self) -> None:
        """A consumer silent for DEAD_AFTER_S (a pulled cable: no RST ever comes) is gone."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(ucx_engine.PING_S)
            now = time.monotonic()
            if ucx_engine.held_up(last, now):
                # our own loop was held up (a long UCX or CUDA call): what the consumer sent meanwhile is
                # not read yet, so its silence is judged from now on
                self.heard = max(self.heard, now - ucx_engine.PING_S)
            last = now
            silent = now - self.heard
            if silent > (BUSY_SILENCE_S if self.flights else ucx_engine.DEAD_AFTER_S):
                self.why = "went silent"
                self.silent = True
                # heard only if it was stalled, not gone: then it connects again and carries on
                await self._bye(
                    ucx_wire.R_SILENT,
                    f"this consumer sent nothing for {silent:.1f}s (its process held the GIL, or the network "
                    "went); the server gave its frames back",
                    wait=0.05,  # a vanished one never acknowledges: its leases go back now, not later
                )
                return

    async def _serve(self) -> None:
        self.heard = time.monotonic()  # the handshake (a local Receiver made) may have taken a while
        tasks = {
            asyncio.ensure_future(self._reader()),
            asyncio.ensure_future(self._watchdog()),
            asyncio.ensure_future(self._sender()),
            asyncio.ensure_future(self.halt.wait()),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        finally:
            if self.told_end:  # aborted at once, it may see the reset before it reads why (the reader still runs)
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self.hung_up.wait(), GOODBYE_S)
            # Give the leases back within the second: cancel, abort the endpoint (its pending requests
            # end), and close the local Receiver even if a task is still unwinding out of UCX. A consumer
            # that went silent may only be stalled: its endpoint lives on a while, so the goodbye that says
            # why can still reach it (an abort now would reset the connection before it reads it).
            for task in tasks:
                task.cancel()
            if not self.silent:
                self._abort()
            await asyncio.wait(tasks, timeout=0.3)
            self._close(abort=not self.silent)
            if self.silent:
                asyncio.get_running_loop().call_later(SILENT_GRACE_S, self._abort)
        log.info("cudalink serve: a consumer %s (%s)", self.why or "left", self._counts())

    async def _sender(self) -> None:
        rx = self.rx
        assert rx is not None
        last_sent = time.monotonic()
        try:
            while not self.halt.is_set():  # a flight failed: the connection ends
                if len(self.flights) >= MAX_FLIGHT:  # as many GPU frames on the wire as we keep: one must land
                    await asyncio.wait(set(self.flights), return_when=asyncio.FIRST_COMPLETED)
                    continue
                if self.credits <= 0:
                    self.credit.clear()
                    try:
                        await asyncio.wait_for(self.credit.wait(), ucx_engine.PING_S)
                    except asyncio.TimeoutError:
                        # a consumer holding every frame it may takes none: see the producer's end here, or it
                        # would hear of it only when it gave one back (after a clean close, once DRAIN_S is over)
                        if _producer_gone(rx) and not self._draining(rx):
                            await self._producer_left(f"the producer of {rx.name!r} closed or died")
                            return
                        await self._send(ucx_wire.pack_ping())
                        last_sent = time.monotonic()
                    continue
                wait = max(0.001, ucx_engine.PING_S - (time.monotonic() - last_sent))
                try:
                    frame = await rx.recv_async(timeout=wait)
                except LinkTimeout:
                    await self._send(ucx_wire.pack_ping())
                    last_sent = time.monotonic()
                    continue
                except ProducerGone as exc:
                    await self._producer_left(exc)
                    return
                except LinkError as exc:  # the local side failed (a CUDA import, say): tell the consumer why
                    await self._failed(f"the server could not take a frame from {rx.name!r}", exc)
                    return
                seq = frame.seq
                try:
                    if frame.device.startswith("cuda"):
                        self._send_gpu(frame)
                    else:
                        await self._send_host(frame)
                except ProducerGone as exc:  # it died while we read the frame: no fault of ours
                    await self._producer_left(exc)
                    return
                except Exception as exc:
                    await self._failed(f"sending frame {seq} failed", exc)
                    return
                finally:
                    del frame  # the flight, if any, holds it now
                self.credits -= 1
                self.sent += 1
                last_sent = time.monotonic()
        except asyncio.CancelledError:
            for task in self.flights:
                task.cancel()
            raise
        finally:
            # Our GPU frames still on the wire: leaving on our own (a goodbye sent behind them), they may land
            # first; cancelled, or out of time, their flights close the endpoint (UCX may still read the
            # buffers) and give the buffers back.
            try:
                if self.flights:
                    await asyncio.wait(set(self.flights), timeout=GOODBYE_S)
            finally:
                for task in self.flights:
                    task.cancel()
                if self.flights:
                    await asyncio.wait(set(self.flights))

    def _head(self, frame: Frame, spec: FrameSpec, inline: bool) -> bytes:
        rx = self.rx
        assert rx is not None
        return ucx_wire.pack_frame(rx.generation, rx.skipped, frame.seq, frame.timestamp_ns, spec, frame.meta, inline)

    async def _send_host(self, frame: Frame) -> None:
        """A host frame, straight from its slot (held until UCX is done with it), or copied behind the header."""
        if self.flights:  # GPU frames still on their way (a link's frames are all of one kind): theirs go first
            await asyncio.wait(set(self.flights))
        data: Any = None
        pending = False  # the pixels' send is under way
        released = False
        counted = False  # in the server's count of slots held by sends (SPARE_SLOTS)
        try:
            spec = frame.spec
            data = frame.numpy()
            own = False  # data is a copy of ours: the slot is not needed for the send
            if spec.strides is not None:  # a padded crop goes contiguous: behind the header, or copied once
                spec = FrameSpec(spec.shape, spec.dtype, None, spec.pixel_format, spec.origin)
                if data.nbytes > self.inline:
                    data, own = np.ascontiguousarray(data), True
            if data.nbytes <= self.inline:
                msg = self._one(self._head(frame, spec, True), data)
                # the bytes are ours now: the producer's slot goes back before the network send (the view
                # of the slot is an export that would keep it)
                data = None
                frame.release()
                released = True
                await self.ep.send(msg)
                return
            head = self._head(frame, spec, False)
            held = self._held()
            if not own and (frame.seq in held or len(held) < self._slots() - SPARE_SLOTS):
                held[frame.seq] += 1  # sent from its slot, held until UCX is done with it
                counted = True
            else:  # a copy (the producer's spare slots would go, or a crop made compact): the slot goes back now
                data = data if own else self._copied(data)
                frame.release()
                released = True
            # both posted at once (UCX keeps one endpoint's messages of one tag in order): the pixels need not
            # wait for the header's completion to be reported
            pending = True
            await asyncio.gather(self.ep.post(head), self.ep.post(data))
            pending = False
            if data.nbytes > ucx_engine.EAGER_MAX:  # a rendezvous: the consumer's worker took part
                self.heard = time.monotonic()
        finally:
            if pending:
                # Cancelled (or failed) while UCX may still read the pixels (a rendezvous waits for the
                # consumer's worker): close the endpoint first, so that UCX lets go of them, then give the
                # memory back; the consumer sees a reset, not this frame with another's bytes.
                self._abort()
            # the view and UCX's wrapper of it are exports of the frame: drop them, or the lease outlives
            # this frame (a cancelled send's traceback would keep them)
            data = None
            if not released:
                frame.release()
            if counted:  # held is this link's count, taken above
                held[frame.seq] -= 1
                if held[frame.seq] <= 0:
                    del held[frame.seq]

    def _held(self) -> collections.Counter[int]:
        rx = self.rx
        assert rx is not None
        return self.server.held[rx.name]

    def _slots(self) -> int:
        """The link's slot count (its producer's ring)."""
        rx = self.rx
        parts = getattr(rx._att, "parts", None) if rx is not None else None
        return len(parts) if parts is not None else 0

    def _copied(self, data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``data`` copied into a buffer of this consumer's (one, reused: a frame's send ends before the next)."""
        if self.copy is None or self.copy.nbytes < data.nbytes:
            self.copy = np.empty(data.nbytes, np.uint8)
        out: np.ndarray[Any, Any] = self.copy[: data.nbytes].view(data.dtype).reshape(data.shape)
        np.copyto(out, data)
        return out

    def _send_gpu(self, frame: Frame) -> None:
        """A GPU frame goes to a flight of its own (:meth:`_flight`): the sender takes the next frame while
        this one is copied, readied and moved, and the GPU runs the copies of several frames in one turn."""
        try:
            if frame.spec.strides is not None:
                raise LinkError("cudalink serve: strided GPU frames cannot be served; send contiguous ones")
            stage: Any = None
            if self.staged:
                if self.stages:
                    stage = self.stages.pop()
                else:
                    from .cuda import ucx as cuda_ucx

                    assert self.rx is not None
                    stage = cuda_ucx.Pinned(int(frame.device.split(":")[1]), self.rx.capacity)
                    self.pinned.append(stage)
        except BaseException:
            frame.release()
            raise
        flight = _Flight(frame, stage, self.turn, asyncio.get_running_loop().create_future())
        self.turn = flight.turn
        task = asyncio.ensure_future(self._flight(flight))
        # a task cancelled before its first step never runs its body: its frame and stage go back here
        task.add_done_callback(lambda t: self._landed(flight, t))
        self.flights.add(task)
        self.most_flights = max(self.most_flights, len(self.flights))

    async def _flight(self, f: _Flight) -> None:
        """One GPU frame, once its bytes are in a buffer of ours (the server's GPU copy, or our page-locked
        stage) and ready: its header and pixels are posted in the frames' order (after the flight before
        has posted its own), and the buffer goes back once UCX is done with it. Cancelled or failed mid-send,
        the endpoint is closed first, so that UCX lets go of the buffer; the consumer sees a reset, not this
        frame with another's bytes."""
        frame = f.frame
        assert frame is not None
        seq = frame.seq
        data: Any = None
        sent: asyncio.Future[Any] | None = None
        try:
            data = await _gpu_ready(frame, f.stage)
            head = self._head(frame, frame.spec, False)
            if f.stage is not None:  # in our page-locked buffer now: the producer's slot goes back at once
                f.frame = None
                frame.release()
            # A GPU frame whose CAI was read holds its slot as long as the object lives: only ``f`` holds it
            del frame
            if f.before is not None and not await f.before:
                return  # the flight before did not post its frame: the connection is ending, so neither do we
            posted = [self.ep.post(head)]
            try:
                posted.append(self.ep.post(data))
            except BaseException:
                posted[0].cancel()  # its outcome is of no interest now (the endpoint failed)
                raise
            sent = asyncio.gather(*posted)
            f.turn.set_result(True)
            await sent
            sent = None
            self.heard = time.monotonic()  # a rendezvous: the consumer's worker took part
        except asyncio.CancelledError:
            raise
        except ProducerGone as exc:  # it died before its frame was ready (its ready event went with it)
            await self._lost_producer(exc)
            self._halt()
        except Exception as exc:
            await self._failed(f"sending frame {seq} failed", exc)
            self._halt()
        finally:
            data = None
            if sent is not None:
                self._abort()
                sent.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.shield(sent)  # its exception, retrieved (the endpoint is gone)
            self._landed(f)

    def _halt(self) -> None:
        """A flight failed: the connection ends (the sender, waiting for a credit, wakes and leaves)."""
        self.halt.set()
        self.credit.set()

    def _landed(self, f: _Flight, task: asyncio.Task[None] | None = None) -> None:
        """A flight's end (once: its task's end calls it again): its frame and stage go back, and a later
        flight waiting for its turn hears whether it posted."""
        if not f.turn.done():
            f.turn.set_result(False)
        frame, f.frame = f.frame, None
        if frame is not None:
            frame.release()
        stage, f.stage = f.stage, None
        if stage is not None and stage in self.pinned:
            self.stages.append(stage)
        if task is not None:
            self.flights.discard(task)

    def _one(self, head: bytes, data: np.ndarray[Any, Any]) -> memoryview:
        """The FRAME header and the pixels copied behind it, compact (``data`` may be a padded crop); the
        frame may be released right after."""
        if not self.out:
            self.out = bytearray(ucx_wire.MSG_SIZE + self.inline)
        end = ucx_wire.MSG_SIZE + data.nbytes
        self.out[: ucx_wire.MSG_SIZE] = head
        np.copyto(np.frombuffer(self.out, data.dtype, data.size, ucx_wire.MSG_SIZE).reshape(data.shape), data)
        return memoryview(self.out)[:end]

    def _close(self, abort: bool = True) -> None:
        if self.rx is not None:
            self.rx.close()
            self.rx = None
        pinned, self.pinned, self.stages = self.pinned, [], []
        for stage in pinned:
            with contextlib.suppress(Exception):
                stage.close()
        if abort:
            self._abort()
        self.server.consumers.discard(self)

    def _abort(self) -> None:
        with contextlib.suppress(Exception):
            self.ep.abort()


class Server:
    """A UCX listener that serves local links (``name``: only that one; None: any the client names)."""

    def __init__(self, port: int, key: bytes, name: str | None = None, parent: int = 0) -> None:
        self.port = port
        self.key = key
        self.name = name
        self.parent = parent
        self.consumers: set[_Consumer] = set()
        #: per link, the seqs of the host frames on the wire from their slots, with how many sends each (one slot
        #: held per seq): see SPARE_SLOTS
        self.held: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        self._tasks: set[asyncio.Task[None]] = set()
        self.listener: Any = None
        self.stage_mode = ucx_engine.stage_mode()
        self.rdma = False  # UCX found a transport that moves GPU memory across hosts itself
        self.ipc = False  # UCX found cuda_ipc: it moves GPU memory between processes of this host itself
        #: the goodbye's (reason, text) once it is said: a consumer that connects after it is refused with them
        self.closing: tuple[int, str] | None = None

    async def run(self, ready: Any = None) -> None:
        # a server restarted after a crash takes its port back at once (else: busy for TIME_WAIT, 60 s)
        os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
        core = ucx_engine.core_here()
        try:
            found = core.transports()
            self.rdma = ucx_engine.rdma_transports(found)
            self.ipc = "cuda_ipc" in found
        except Exception:
            self.rdma = self.ipc = False

        async def accept(ep: ucx_engine.Endpoint) -> None:
            c = _Consumer(self, ep)
            self.consumers.add(c)
            await c.run()

        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            try:
                self.listener = core.listen(accept, self.port)
                break
            except Exception as exc:  # a port a moment ago in use (TIME_WAIT after a crash): UCXXBusyError
                if "Busy" not in type(exc).__name__ or time.monotonic() > deadline:
                    raise LinkError(busy_message(self.port, exc)) from exc
                await asyncio.sleep(0.2)
        if ready is not None:
            ready(int(self.listener.port))
        stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._stop_on_signals(stop)
        while not stop.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(stop), 0.2)
            if not stop.done() and self.parent and self._parent_gone():
                log.info("cudalink serve: the producer process %d is gone; stopping", self.parent)
                await self.goodbye(ucx_wire.R_PRODUCER_GONE, f"the producer of {self.name!r} died")
                return
        if self.parent:  # a Sender's own server: its close() stops us, once we have sent what it published
            await self.goodbye(ucx_wire.R_PRODUCER_CLOSED, f"the producer of {self.name!r} closed the link")
        else:
            what = f"cudalink serve of {self.name!r}" if self.name else "cudalink serve"
            await self.goodbye(ucx_wire.R_CLOSING, f"{what} stopped ({stop.result()})")

    def _parent_gone(self) -> bool:
        """The producer that spawned us (``--parent``: our parent process) died. Killed, it may stay a zombie its
        own parent has not reaped yet (``subprocess.run`` waiting on our inherited stdout, which we then held
        open forever), and a zombie's pid is alive to ``kill(pid, 0)``; but we were handed to another parent
        as it died (ucx serves on Linux only, where a parent's death does that)."""
        return os.getppid() != self.parent or not _platform.pid_alive(self.parent)

    def _stop_on_signals(self, stop: asyncio.Future[str]) -> None:
        """SIGTERM (a service manager, a Sender's close()) and Ctrl-C end ``run`` through :meth:`goodbye`."""
        loop = asyncio.get_running_loop()

        def stopped(name: str) -> None:
            if not stop.done():
                stop.set_result(name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(sig, stopped, sig.name)

    async def goodbye(self, reason: int, text: str) -> None:
        """Tell each consumer why its connection ends, then give them a moment to read it and hang up (a
        reset at once may discard what they have not read yet): they hear "server closing", not "connection
        lost (UCXXCanceledError ...)", which blamed the producer. Bounded: half a second in all. One that
        connects meanwhile is refused with the same words (welcomed, it took a frame or two before our exit,
        and a relay said its upstream "is back" while nothing served it)."""
        self.closing = (reason, text)
        consumers = list(self.consumers)
        if not consumers:
            return
        end = time.monotonic() + GOODBYE_S
        await asyncio.wait(
            [asyncio.ensure_future(c._bye(reason, text, GOODBYE_S)) for c in consumers], timeout=GOODBYE_S
        )
        while self.consumers and time.monotonic() < end:
            await asyncio.sleep(0.01)


def busy_message(port: int, exc: BaseException) -> str:
    """Why a port stayed busy, with the likelier cause where the port is one the OS hands out itself."""
    low, high = _platform.ephemeral_ports()
    if low <= port <= high:
        sides = [f"below {low}"] if low > 1024 else []
        sides += [f"above {high}"] if high < 65535 else []
        where = " or ".join(sides) if sides else "none is left: narrow the range (ip_local_port_range on Linux)"
        return (
            f"cudalink: serve cannot listen on port {port} ({exc}): it lies in the OS's ephemeral range "
            f"({low}-{high}), where outgoing connections and UCX's own sockets take ports, so it may be taken "
            f"by this very server; pick a port outside it ({where})"
        )
    return f"cudalink: serve cannot listen on port {port} ({exc}): another server holds it; pick another port"


def listening(name: str, host: str, port: int, tell: Callable[[str], None]) -> None:
    """Say where the link is served, then ``tell`` the Sender waiting for this server: its own output, on
    the same stdout, then follows these lines instead of cutting into one (the bench's children printed
    "ready" inside "cudalink: serving ...", and were waited for in vain)."""
    say(f"cudalink: serving {name!r} at ucx://{host}:{port}/{name}")
    # UCXX's listener takes a port, no address: say so, whatever host was asked for
    say(
        f"cudalink: UCXX listens on port {port} of every IPv4 interface; only the key keeps others out "
        f"(a firewall rule for the port helps)"
    )
    tell("ok")


def serve(name: str, listen: str, *, parent: int = 0, verbose: bool = False, ready_fd: int = -1) -> int:
    """``python -m cudalink serve NAME --listen ucx://HOST:PORT``: serve until interrupted (or ``parent`` dies).
    ``ready_fd``: a pipe to the Sender that spawned this server, told ``ok`` once it listens, or why it cannot."""
    logging.basicConfig(
        level=(logging.DEBUG if os.environ.get("CUDALINK_DEBUG") else logging.INFO) if verbose else logging.WARNING,
        format="%(message)s",
    )
    told = ready_fd < 0

    def tell(text: str) -> None:
        nonlocal told
        if not told:  # once: the fd is closed after, and its number may be another file's by then
            told = True
            ucx_engine.tell_ready(ready_fd, text)

    def ready(port: int) -> None:
        listening(name, addr.host, port, tell)
        if not shm.published(name):  # served all the same: a producer may start later
            say(
                f"cudalink: no producer publishes {name!r} on this host yet; remote Receivers are refused (and keep "
                "trying within their timeout) until one does"
            )

    try:
        name = _platform.check_name(name)
        addr = ucx_wire.parse_address(listen, need_name=False)
        ucx_engine.check_listen_host(addr)
        ucx_engine.load()
        key, created = ucx_engine.load_key(create=True)
        ucx_engine.announce_key(created)
        if addr.host not in ("127.0.0.1", "localhost"):
            say(f"cudalink: serving {name!r} beyond this host; frames are not encrypted (use a VPN).")
        server = Server(addr.port, key, name, parent)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(server.run(ready))
    except LinkError as exc:
        tell(str(exc))
        raise
    # Leave now: UCX's own threads (its "thread" progress mode) can keep an interpreter from exiting, and a
    # server whose producer process is gone must not linger. The OS returns the leases (the link sees EOF).
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no stdout, or a closed one
        sys.stdout.flush()
    os._exit(0)


__all__ = ["Server", "serve"]
