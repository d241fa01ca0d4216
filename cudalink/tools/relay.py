"""``python -m cudalink relay ucx://HOST:PORT/NAME --as LOCAL``: a remote stream as a local link.

Unmodified local consumers (a TouchDesigner Script TOP, say) read ``LOCAL`` as any link. Each remote frame
lands in the relay's own buffers (host, or a GPU pool on ``--device``) and is then copied once into a slot of the
local link by ``send()``: one copy more than issue 33 asks (landing straight into a slot taken with
``Sender.reserve()`` needs the UCX source to land into memory it does not own). A format change upstream
reconfigures the local link (its slots are sized to the remote link's capacity, so every format the producer may
send fits).
A producer restart upstream keeps the local link up: consumers see a gap, not an error (one whose frames no
longer fit its slots restarts the local link: consumers see a new generation, as after any restart). The relay
says on stdout when its upstream goes away and when it is back.
Frames keep their timestamp and meta.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

from .. import _platform
from ..errors import ArgumentError, LinkTimeout, ProducerGone, int_arg
from ..frames.spec import FrameSpec
from ..link import Receiver, Sender
from ..transport import wire
from ..transport.ucx_engine import say
from .ui import Stopped, sigterm_stops, stop_requested


def relay(
    url: str,
    local: str,
    *,
    device: int | str = "cpu",
    slots: int = 4,
    latest: bool = True,
    seconds: float | None = None,
    quiet: bool = False,
) -> int:
    """Republish ``url`` as ``local`` until ``seconds`` pass (None: forever); returns the frames relayed."""
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
    relayed = 0
    # the first connection gets 5 s, no more than --seconds leaves: `--seconds 2` against a server that is down
    # ran 6 s before it said so
    first = 5.0 if stop is None else min(5.0, max(0.0, stop - time.monotonic()))
    with Receiver(url, device=device, latest=latest, timeout=first) as rx:
        tx: Sender | None = None

        def make(spec: FrameSpec) -> Sender:
            return Sender(
                local,
                shape=spec.shape,
                dtype=spec.dtype,
                slots=slots,
                device=device,
                pixel_format=spec.pixel_format,
                origin=spec.origin,
                capacity=max(rx.capacity, spec.nbytes),
            )

        lost = False  # the upstream went away and has sent nothing since: said once, and once when it is back
        try:
            while (stop is None or time.monotonic() < stop) and not stop_requested():
                try:
                    frame = rx.recv(timeout=0.5 if stop is None else max(0.01, min(0.5, stop - time.monotonic())))
                except LinkTimeout:
                    continue
                except ProducerGone as exc:
                    if not (quiet or lost):
                        why = str(exc).removeprefix("cudalink: ").split("; recv() again")[0]
                        why = why.replace(f"producer of {url!r}", "its producer")
                        say(f"cudalink: lost {url}: {why}; {local!r} stays up, waiting for it")
                    lost = True
                    continue
                with frame:
                    spec = frame.spec
                    if lost and not quiet:
                        say(f"cudalink: {url} is back ({spec.label})")
                    lost = False
                    if tx is None:
                        tx = make(spec)
                        if not quiet:
                            say(f"cudalink: relaying {url} as {local!r} ({spec.label})")
                    elif tx.spec != spec:
                        if spec.nbytes > tx.capacity:  # a restarted producer with larger frames: a new local link
                            tx.close()
                            tx = None
                            tx = make(spec)
                            if not quiet:
                                say(f"cudalink: {url} now sends {spec.label}; {local!r} started again")
                        else:
                            tx.reconfigure(spec.shape, spec.dtype, pixel_format=spec.pixel_format, origin=spec.origin)
                    # send() copies once, from the landed frame (host or GPU) into the slot, with its timestamp
                    src = frame.numpy() if frame.device == "cpu" else frame
                    tx.send(src, timestamp_ns=frame.timestamp_ns, meta=frame.meta)
                    relayed += 1
        finally:
            if tx is not None:
                tx.close()
    return relayed


def cmd_relay(args: argparse.Namespace) -> int:
    device = int(args.device) if args.device.isdigit() else args.device  # "0", as the help says
    # SIGTERM (a service manager) stops the relay as the end of --seconds does: the local link is closed, so its
    # consumers hear a clean close and nothing is left in /dev/shm (killed where it stood, both were lost)
    with contextlib.suppress(Stopped), sigterm_stops():
        relay(args.url, args.local, device=device, slots=args.slots, latest=not args.in_order, seconds=args.seconds)
    return 0
