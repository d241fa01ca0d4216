"""Child processes for the reliability suite."""

from __future__ import annotations

import os
import random
import time
import zlib
from typing import Any

import numpy as np

import cudalink

SHAPE = (256, 256, 4)  # 256 KiB: copies take long enough that kills land inside them


def content(gen: int, seq: int) -> np.ndarray:
    """Generation and seq in the first 16 bytes, pseudo-random bytes after: stale or foreign frames fail."""
    rng = np.random.default_rng(seq ^ (gen & 0xFFFFFFFF))
    arr = rng.integers(0, 256, size=SHAPE, dtype=np.uint8)
    arr.reshape(-1)[:16] = np.frombuffer(gen.to_bytes(8, "little") + seq.to_bytes(8, "little"), np.uint8)
    return arr


def checksum(arr: np.ndarray) -> bytes:
    return zlib.crc32(arr.tobytes()).to_bytes(4, "little")


def verify(frame: cudalink.Frame, generation: int) -> str | None:
    """None if the frame is intact and of ``generation``, else what is wrong."""
    arr = np.from_dlpack(frame)
    head = arr.reshape(-1)[:16].tobytes()
    gen, seq = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
    if checksum(arr) != frame.meta:
        return f"checksum mismatch at seq {frame.seq}"
    if gen != generation or gen != frame.generation:
        return f"foreign/stale frame: content gen {gen:x}, link gen {generation:x}"
    if seq != frame.seq:
        return f"seq {seq} in content, {frame.seq} in the record"
    return None


def chaos_producer(name: str, ready: Any) -> None:
    with cudalink.Sender(name, shape=SHAPE, dtype="uint8", slots=4) as tx:
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
