"""Child processes for ``test_hostile``: what may hang or crash runs here, never in the pytest process.

A take loop that spins on a corrupt header holds the GIL (the compiled one never lets go), so no timeout
inside the test process could stop it; the parent waits on a queue and kills the child instead.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import cudalink
from cudalink.frames.spec import FrameSpec
from cudalink.transport import wire

RECV_TIMEOUT = 0.5


def take_over_a_lying_stamp(impl: str, out: Any) -> None:
    """The ring alone: slot 0's stamp says frame 1000 (even: "ready") over the record of frame 1."""
    from cudalink import _native, _ring

    layout = wire.Layout(4, 2)
    view = memoryview(bytearray(layout.size))
    if impl == "python":
        tx: Any = _ring.PyProducerRing(view, layout)
        rx: Any = _ring.PyConsumerRing(view, layout, 0, 1 << 20)
    else:
        assert _native.ring is not None
        tx = _ring._NativeProducerRing(view, layout)
        rx = _native.ring.ConsumerCore(view, layout, 0, 1 << 20)
    spec = FrameSpec((4,), "uint8")
    for seq in (1, 2, 3):
        slot = tx.claim(seq)
        tx.publish(slot, seq, 0, spec, b"")
    wire.write_u64(view, layout.stamp(0), 2 * 1000)
    t0 = time.monotonic()
    try:
        got = rx.take(0, True)
        result = ("returned", repr(got))
    except Exception as exc:
        result = (type(exc).__name__, str(exc))
    out.put((*result, time.monotonic() - t0, wire.read_u64(view, layout.lease(0, 0))))


def recv_over_a_lying_stamp(name: str, out: Any) -> None:
    """A whole link: the same lie in a live header, under ``recv(timeout=0.5)``."""
    with (
        cudalink.Sender(name, shape=(4,), dtype="uint8", slots=4) as tx,
        cudalink.Receiver(name, timeout=2.0) as rx,
    ):
        for _ in range(3):
            tx.send(np.zeros(4, np.uint8))
        wire.write_u64(tx._server.header, tx._layout.stamp(0), 2 * 1000)  # over frame 1's record
        t0 = time.monotonic()
        try:
            f = rx.recv(timeout=RECV_TIMEOUT)
            result = ("returned", f"seq {f.seq}")
        except Exception as exc:
            result = (type(exc).__name__, str(exc))
        out.put((*result, time.monotonic() - t0))


def over_a_fifo_rendezvous(name: str, out: Any) -> None:
    """A FIFO where a link's loopback rendezvous file goes (``NAME.tcp``): a Receiver, ``clean``, then a Sender.
    Each step's outcome and time go to ``out`` as it ends, so the parent sees which one hung."""
    from cudalink.transport.shm import clean

    for step in ("receiver", "clean", "sender"):
        t0 = time.monotonic()
        try:
            if step == "receiver":
                cudalink.Receiver(name, timeout=RECV_TIMEOUT).close()
            elif step == "clean":
                clean(only=[name])
            else:
                cudalink.Sender(name, shape=(4,), dtype="uint8").close()
            result = ("ok", "")
        except Exception as exc:
            result = (type(exc).__name__, str(exc))
        out.put((step, *result, time.monotonic() - t0))


def producer_passing_fds(name: str, ready: Any) -> None:
    """A host link whose producer (a bug, or a lie) passes two descriptors with every WELCOME."""
    import os

    from cudalink import _backends

    r, w = os.pipe()
    _backends.HostSlots.fds = lambda self: [r, w]  # type: ignore[method-assign]
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
        ready.set()
        while True:
            tx.send(np.zeros(4, np.uint8))
            time.sleep(0.005)


def producer_then_wait(name: str, ready: Any) -> None:
    """A host link's producer that waits to be killed (its link is then a dead producer's leftovers)."""
    tx = cudalink.Sender(name, shape=(4,), dtype="uint8")
    tx.send(np.zeros(4, np.uint8))
    ready.set()
    while True:
        time.sleep(1.0)
