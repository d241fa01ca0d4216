"""Frame contents that give a torn, stale or foreign frame away: one implementation for the CPU and GPU tests.

Two kinds of content:

* :func:`pattern` - every byte depends on the frame's seq. Made by numpy for host checks, or with the same
  formula by torch or cupy (``xp=``) where a GPU consumer verifies on the device without a CPU sync.
  :func:`stamp` is its CRC and seq, sent as the frame's meta.
* :func:`content` - the chaos frames: generation and seq in the first 16 bytes, pseudo-random bytes after,
  with :func:`checksum` as meta. :func:`verify` checks a received frame of either kind of link: host frames
  in place, CUDA frames through a host copy (``Frame.to_numpy``, which waits for the frame's ready event).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

import cudalink

# -- seq patterns --------------------------------------------------------------------------------------------

_MUL, _STEP, _MOD = 2654435761, 40503, 251


def pattern(seq: int, shape: tuple[int, ...], dtype: str, xp: Any = np) -> Any:
    """A frame whose every byte depends on its seq, so a torn or stale frame cannot pass.

    ``xp`` makes it where the caller compares: numpy (default), cupy (on its current stream) or torch (on the
    current CUDA device and stream). All three give the same values.
    """
    n = math.prod(shape)
    name = getattr(xp, "__name__", "")
    if name == "torch":
        t = xp.arange(n, device="cuda", dtype=xp.int64)
        return ((t * _MUL + seq * _STEP) % _MOD).to(getattr(xp, dtype)).view(shape)
    base = np.arange(n, dtype=np.uint64) if xp is np else xp.arange(n, dtype=xp.int64)
    return ((base * _MUL + seq * _STEP) % _MOD).astype(dtype).reshape(shape)


def stamp(arr: np.ndarray[Any, Any], seq: int) -> bytes:
    """The meta a pattern frame travels with: CRC-32 of its bytes and its seq."""
    return zlib.crc32(arr.tobytes()).to_bytes(4, "little") + seq.to_bytes(8, "little")


# -- chaos frames --------------------------------------------------------------------------------------------

CHAOS_SHAPE = (256, 256, 4)  # 256 KiB: copies take long enough that kills land inside them


def content(gen: int, seq: int) -> np.ndarray[Any, Any]:
    """Generation and seq in the first 16 bytes, pseudo-random bytes after: stale or foreign frames fail."""
    rng = np.random.default_rng(seq ^ (gen & 0xFFFFFFFF))
    arr = rng.integers(0, 256, size=CHAOS_SHAPE, dtype=np.uint8)
    arr.reshape(-1)[:16] = np.frombuffer(gen.to_bytes(8, "little") + seq.to_bytes(8, "little"), np.uint8)
    return arr


def checksum(arr: np.ndarray[Any, Any]) -> bytes:
    return zlib.crc32(arr.tobytes()).to_bytes(4, "little")


def host_bytes(frame: cudalink.Frame) -> np.ndarray[Any, Any]:
    """The frame's bytes on the host: a view of the slot for host frames, a copy for CUDA ones."""
    return frame.to_numpy() if frame.is_cuda else np.from_dlpack(frame)


def verify(frame: cudalink.Frame, generation: int) -> str | None:
    """None if the chaos frame is intact and of ``generation``, else what is wrong."""
    arr = host_bytes(frame)
    head = arr.reshape(-1)[:16].tobytes()
    gen, seq = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
    if checksum(arr) != frame.meta:
        return f"checksum mismatch at seq {frame.seq}"
    if gen != generation or gen != frame.generation:
        return f"foreign/stale frame: content gen {gen:x}, link gen {generation:x}"
    if seq != frame.seq:
        return f"seq {seq} in content, {frame.seq} in the record"
    return None
