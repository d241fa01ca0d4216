"""``python -m cudalink relay ucx://HOST:PORT/NAME --as LOCAL``: a remote stream as a local link.

Unmodified local consumers (a TouchDesigner Script TOP, say) read ``LOCAL`` as any link. Each remote frame
lands in a slot of the local link, taken with ``Sender.reserve()`` as its header arrives, and is published
there, on the UCX thread: host bytes are received straight into the slot; on a GPU link the one copy a GPU
landing makes (from the page-locked buffer host bytes arrive in, or from the buffer UCX writes GPU memory into:
UCX writes the slots' pool memory three times slower) goes into the slot, on the GPU. A frame that finds every
local slot held by consumers is dropped, and the local link counts it, as its own ``send()`` would. A format
change upstream reconfigures the local link (its slots are sized to the remote link's capacity, so every format
the producer may send fits).
A producer restart upstream keeps the local link up: consumers see a gap, not an error (one whose frames no
longer fit its slots restarts the local link: consumers see a new generation, as after any restart). The relay
says on stdout when its upstream goes away and when it is back.
Frames keep their timestamp and meta.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _platform
from ..errors import ArgumentError, LinkError, LinkTimeout, ProducerGone, int_arg
from ..frames.frame import Frame
from ..frames.spec import FrameSpec
from ..link import Receiver, Sender, default_transport
from ..transport import ucx_wire, wire
from ..transport.sources import open_source
from ..transport.ucx_engine import say
from ..transport.ucx_source import UcxAttachment, UcxSource
from .ui import Stopped, sigterm_stops, stop_requested


class _Local:
    """The local link a relay republishes to: made at the first frame, reconfigured or made again as the
    upstream's format changes, and what the relay says about it and its upstream."""

    def __init__(self, url: str, local: str, device: int | str, slots: int, quiet: bool) -> None:
        self.url = url
        self.local = local
        self.device = device
        self.slots = slots
        self.quiet = quiet
        self.tx: Sender | None = None
        self.stream: Any = None  # a GPU link's: where frames are landed (see _Slot)
        self.stream_int = 0
        self.lost = False  # the upstream went away and has sent nothing since: said once, and once when back
        self.relayed = 0

    def _make(self, spec: FrameSpec, capacity: int) -> Sender:
        tx = Sender(
            self.local,
            shape=spec.shape,
            dtype=spec.dtype,
            slots=self.slots,
            device=self.device,
            pixel_format=spec.pixel_format,
            origin=spec.origin,
            capacity=max(capacity, spec.nbytes),
        )
        if tx.device != "cpu" and self.stream is None:
            from ..cuda import devices, driver

            self.stream = devices.device(int(tx.device.split(":")[1])).create_stream()
            self.stream_int = driver.stream_handle(self.stream)
        return tx

    def ready_for(self, spec: FrameSpec, capacity: int) -> Sender:
        """The local link, ready for a frame of ``spec`` from an upstream whose frames take up to ``capacity``."""
        if self.lost and not self.quiet:
            say(f"cudalink: {self.url} is back ({spec.label})")
        self.lost = False
        tx = self.tx
        if tx is None:
            tx = self.tx = self._make(spec, capacity)
            if not self.quiet:
                say(f"cudalink: relaying {self.url} as {self.local!r} ({spec.label})")
        elif self.needs_new_link(spec):  # a restarted producer with larger frames: a new local link
            self.tx = None
            tx.close()
            tx = self.tx = self._make(spec, capacity)
            if not self.quiet:
                say(f"cudalink: {self.url} now sends {spec.label}; {self.local!r} started again")
        elif tx.spec != spec:  # "" clears a format: None would keep the old one (and the specs would never match)
            fmt = "" if spec.pixel_format is None else spec.pixel_format
            tx.reconfigure(spec.shape, spec.dtype, pixel_format=fmt, origin=spec.origin)
        return tx

    def needs_new_link(self, spec: FrameSpec) -> bool:
        """A frame of ``spec`` does not fit the local link's slots: it must be closed and made again."""
        tx = self.tx
        return tx is not None and tx.spec != spec and spec.nbytes > tx.capacity

    def lose(self, exc: ProducerGone) -> None:
        if not (self.quiet or self.lost):
            why = str(exc).removeprefix("cudalink: ").split("; recv() again")[0]
            why = why.replace(f"producer of {self.url!r}", "its producer")
            say(f"cudalink: lost {self.url}: {why}; {self.local!r} stays up, waiting for it")
        self.lost = True

    def close(self) -> None:
        tx, self.tx = self.tx, None
        if tx is not None:
            tx.close()


class _Slot:
    """A reserved slot of the local link, lent to the UCX source for one frame's bytes (``ucx_source.Target``)."""

    def __init__(self, lander: _Lander, block: contextlib.AbstractContextManager[Frame], frame: Frame) -> None:
        self.lander = lander
        self.block = block
        self.ptr = frame.ptr
        self.stream = lander.local.stream_int
        self.host: npt.NDArray[np.uint8] | None = None
        if frame.device == "cpu":  # the slot's bytes (the Sender keeps them mapped while it is open)
            raw = (ctypes.c_uint8 * frame.spec.nbytes).from_address(frame.ptr)
            self.host = np.ctypeslib.as_array(raw)

    def commit(self) -> None:
        try:
            self.block.__exit__(None, None, None)
            self.lander.local.relayed += 1
        except Exception as exc:  # raised on the UCX thread it would read as a lost connection: the relay's says it
            self.lander.fail(exc)
        finally:
            self.lander.busy = False

    def abort(self) -> None:
        try:
            with contextlib.suppress(LinkError):
                self.block.__exit__(LinkError, None, None)  # publishes nothing: the slot goes back as it was
        finally:
            self.lander.busy = False


class _Lander:
    """Lends a slot of the local link for each remote frame, on the UCX loop's thread (``ucx_source.Lander``)."""

    def __init__(self, local: _Local) -> None:
        self.local = local
        self.lock = threading.Lock()
        self.closed = False
        self.busy = False  # a frame is landing in a slot now: the next one waits for it to be published
        #: why the local link could not be made or changed (its name taken, say): the relay's thread raises it
        self.failed: BaseException | None = None
        #: the last frame (generation, seq) left to the relay's thread (set on the UCX thread only), and the last one
        #: that thread has sent or passed over (set there only): no slot is lent while it is behind, or a frame
        #: lent one would be published before the frames it still has to send
        self.handed = (0, 0)
        self.done = (0, 0)
        #: frames that found every local slot held (dropped, counted by the local link): the relay's thread sends
        #: none of them
        self.dropped: set[tuple[int, int]] = set()

    def take(self, head: ucx_wire.FrameHeader, att: UcxAttachment) -> _Slot | None:
        # Never waits: the relay's thread holds the lock while it makes the local link again, which closes the
        # old one, and a GPU link's close waits up to 2 s for its consumers to unmap. On this thread that
        # silence got the relay dropped by its server (0.9 s) and reconnected. Such a frame (and any that comes
        # meanwhile) lands in the Receiver's own buffer instead, and the relay's thread sends it.
        key = (head.generation, head.seq)
        if not self.lock.acquire(blocking=False):
            self.handed = key
            return None
        try:
            if self.closed or self.busy:
                return None
            if self.behind(key) or self.local.needs_new_link(head.spec):
                self.handed = key  # the relay's thread sends it, after those it has yet to send
                return None
            try:
                tx = self.local.ready_for(head.spec, att.capacity)
                # the GPU link's own stream of the relay's (None on a host link, which takes none)
                block = tx.reserve(stream=self.local.stream, meta=head.meta, timestamp_ns=head.timestamp_ns)
                frame = block.__enter__()
            except LinkTimeout:  # every local slot is held by consumers: dropped (the local link counts it)
                self.dropped.add(key)
                return None
            except Exception as exc:  # on the UCX thread it would read as a lost connection: the relay's says it
                self.fail(exc)
                return None
            self.busy = True
            return _Slot(self, block, frame)
        finally:
            self.lock.release()

    def behind(self, key: tuple[int, int]) -> bool:
        """The relay's thread has frames of this producer (``key``'s generation) it has not sent yet."""
        handed, done = self.handed, self.done
        return handed[0] == key[0] and (done[0] != handed[0] or done[1] < handed[1])

    def passed(self, key: tuple[int, int]) -> bool:
        """The relay's thread has taken the frame ``key``: whether it was dropped here (then it is not sent). The
        frames dropped before it are forgotten (a relay that takes the newest frame never sees some)."""
        dropped = self.dropped
        if not dropped:
            return False
        was = key in dropped
        for k in list(dropped):
            if k[0] != key[0] or k[1] <= key[1]:
                dropped.discard(k)
        return was

    def fail(self, exc: BaseException) -> None:
        """The local link could not be made, changed or published to: lend nothing more, and end the relay
        with ``exc`` (its thread raises it)."""
        self.failed, self.closed = exc, True

    def close(self) -> None:
        with self.lock:
            self.closed = True


def _send(out: _Local, tx: Sender, frame: Frame) -> None:
    """``frame`` published on the local link: ``send()`` copies once, from the landed frame (host or GPU) into the
    slot, with its timestamp and meta."""
    src = frame.numpy() if frame.device == "cpu" else frame
    tx.send(src, timestamp_ns=frame.timestamp_ns, meta=frame.meta)
    out.relayed += 1


def relay(
    url: str,
    local: str,
    *,
    device: int | str = "cpu",
    slots: int = 4,
    latest: bool = True,
    seconds: float | None = None,
    quiet: bool = False,
    land: bool = True,
) -> int:
    """Republish ``url`` as ``local`` until ``seconds`` pass (None: forever); returns the frames relayed.

    ``land=False`` lands each ``ucx://`` frame in the Receiver's own buffers and copies it into the local link
    with ``send()``, as frames from any other source are: ``benchmarks/relay_rate.py`` sets the two side by side.
    """
    _platform.check_name(local)  # before waiting for a first frame: a bad --as or --slots fails now
    int_arg(slots, "relay --slots", 1, wire.MAX_SLOTS, "--slots 4")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf
    ):
        raise ArgumentError(
            f"cudalink: relay --seconds must be a finite number of seconds more than 0 (omit it: until "
            f"stopped), got {seconds!r}; pass e.g. --seconds 60"
        )
    stop = None if seconds is None else time.monotonic() + seconds
    # the first connection gets 5 s, no more than --seconds leaves: `--seconds 2` against a server that is down
    # ran 6 s before it said so
    first = 5.0 if stop is None else min(5.0, max(0.0, stop - time.monotonic()))
    out = _Local(url, local, device, slots, quiet)
    source = open_source(url, transport=default_transport(), device=device, copy="auto", latest=latest)
    lander = None
    if land and isinstance(source, UcxSource):  # frames land in the local link's slots (see the module's docstring)
        lander = source.lander = _Lander(out)
    try:
        with Receiver(url, source=source, latest=latest, timeout=first) as rx:
            try:
                while (stop is None or time.monotonic() < stop) and not stop_requested():
                    if lander is not None and lander.failed is not None:
                        raise lander.failed
                    try:
                        frame = rx.recv(timeout=0.5 if stop is None else max(0.01, min(0.5, stop - time.monotonic())))
                    except LinkTimeout:
                        continue
                    except ProducerGone as exc:
                        out.lose(exc)
                        continue
                    with frame:
                        if lander is None:
                            _send(out, out.ready_for(frame.spec, rx.capacity), frame)
                            continue
                        key = (frame.generation, frame.seq)
                        try:
                            if lander.passed(key):  # it found no local slot free: dropped, and counted
                                continue
                            # one the lander left to us (a new local link to make, or it came meanwhile): sent
                            # under the lock, so no slot is lent while the old link closes or before this frame
                            with lander.lock:
                                _send(out, out.ready_for(frame.spec, rx.capacity), frame)
                        finally:
                            lander.done = key
            finally:
                if lander is not None:  # no slot is lent from now on; closing the Receiver ends the one landing
                    lander.close()
    finally:
        # after the Receiver's close, which ends its UCX reader soon after (on that thread): a frame still landing
        # holds the Sender's lock, so close() waits for it to be given back, then nothing is lent any more
        out.close()
    return out.relayed


def cmd_relay(args: argparse.Namespace) -> int:
    device = int(args.device) if args.device.isdigit() else args.device  # "0", as the help says
    # SIGTERM (a service manager) stops the relay as the end of --seconds does: the local link is closed, so its
    # consumers hear a clean close and nothing is left in /dev/shm (killed where it stood, both were lost)
    with contextlib.suppress(Stopped), sigterm_stops():
        relay(args.url, args.local, device=device, slots=args.slots, latest=not args.in_order, seconds=args.seconds)
    return 0
