"""Child processes for the reliability suite (the frames they send and their checks are in ``_content``)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np

import cudalink

from ._content import CHAOS_SHAPE, checksum, content


def chaos_producer(name: str, ready: Any) -> None:
    with cudalink.Sender(name, shape=CHAOS_SHAPE, dtype="uint8", slots=4) as tx:
        ready.set()
        seq = 0
        while True:
            seq += 1
            arr = content(tx.generation, seq)
            if random.random() < 0.5:
                tx.send(arr, meta=checksum(arr))
            else:
                with tx.reserve(meta=checksum(arr)) as f:
                    np.from_dlpack(f)[...] = arr


def other_user_producer(name: str, ready: Any, stop: Any) -> None:
    os.setgid(65534)
    os.setuid(65534)
    with cudalink.Sender(name, shape=(4,), dtype="uint8") as tx:
        tx.send(np.arange(4, dtype=np.uint8))
        ready.set()
        stop.wait(30)


def churn_consumer(name: str, seconds: float, seed: int) -> None:
    """Join, take frames, sometimes hold them, leave or die: over and over."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with cudalink.Receiver(name, timeout=5) as rx:
                held = []
                for _ in range(rng.randint(1, 20)):
                    f = rx.recv(timeout=2)
                    if rng.random() < 0.3:
                        held.append(f)  # keep a few leases
                    else:
                        f.release()
                if rng.random() < 0.2:
                    os._exit(0)  # die holding leases: no goodbye, no cleanup
                del held
        except cudalink.LinkError:
            time.sleep(0.01)
