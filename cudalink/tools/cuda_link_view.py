"""cuda-link segments for ``monitor`` and ``info``: found, mapped read-only and described; never written."""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

from rich.console import Group
from rich.text import Text

from .. import _platform
from ..errors import LinkError
from ..transport import cuda_link_wire as cw
from ..transport.cuda_link_source import PREFIX, strip_prefix

__all__ = ["PREFIX", "Snapshot", "find_segments", "read_snapshot", "render", "strip_prefix", "summary"]

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class Snapshot:
    """One read-only look at a cuda-link segment."""

    name: str
    segment: cw.Segment
    size: int
    mono: float
    perf: float  # this machine's perf_counter when read: the producer's timestamps are on that clock


#: bytes copied from a segment: more than any cuda-link layout reads (49 + 128·10; v0.6.6's 49 + 192·10), so a
#: huge file that merely starts with its magic is not copied whole
_READ_MAX = 4096


def _read_bytes(name: str) -> bytes:
    """The segment's first bytes, through a read-only mapping where POSIX shm exists (else through SharedMemory)."""
    try:
        mm = _platform.shm_map_readonly(name)
        if mm is None:
            from ..transport.shm import _open_segment

            shm = _open_segment(name)
            data = bytes((shm.buf or b"")[:_READ_MAX])
            shm.close()
            return data
        if isinstance(mm, bytes):
            return mm[:_READ_MAX]
        try:
            return mm[:_READ_MAX]
        finally:
            mm.close()
    except FileNotFoundError as exc:
        raise LinkError(
            f"cudalink: no cuda-link segment named {name!r} here; check the name cuda-link shows (its defaults: "
            f"{', '.join(cw.DEFAULT_NAMES)}) and that its producer runs on this machine"
        ) from exc
    except OSError as exc:  # another user's segment, or not a segment at all
        if exc.errno == errno.EINVAL:
            raise LinkError(
                f"cudalink: {name!r} in /dev/shm is not a shared-memory segment ({exc.strerror}); check the name "
                f"cuda-link shows (its defaults: {', '.join(cw.DEFAULT_NAMES)})"
            ) from exc
        raise LinkError(
            f"cudalink: cannot read cuda-link segment {name!r} ({exc}); run this as the user whose producer made it"
        ) from exc


def read_snapshot(name: str) -> Snapshot:
    """Decode a cuda-link segment (``cuda-link:NAME`` or ``NAME``) from one read-only copy of its bytes."""
    seg_name = strip_prefix(name)
    data = _read_bytes(seg_name)
    mono, perf = time.monotonic(), time.perf_counter()
    return Snapshot(seg_name, cw.read_segment(data, seg_name), len(data), mono, perf)


def find_segments() -> list[str]:
    """Names of the cuda-link segments on this machine (their first 4 bytes are a cuda-link magic).

    Linux lists ``/dev/shm``; elsewhere only cuda-link's default names are tried."""
    names: list[str] = []
    if os.path.isdir(SHM_DIR):
        try:
            entries = os.listdir(SHM_DIR)
        except OSError:
            entries = []
        for entry in sorted(entries):
            head = _head(os.path.join(SHM_DIR, entry))
            if len(head) == 4 and int.from_bytes(head, "little") in cw.MAGICS:
                names.append(entry)
        return names
    for name in cw.DEFAULT_NAMES:
        try:
            _read_bytes(name)
        except LinkError:
            continue
        names.append(name)
    return names


def _head(path: str) -> bytes:
    """The first 4 bytes of a regular file; b"" for anything else. Anyone may put a FIFO in /dev/shm: opened
    blocking, it hung ``info`` until a writer came."""
    try:
        return _platform.read_regular(path, 4, follow=False) or b""
    except OSError:
        return b""


def summary(snap: Snapshot) -> str:
    """One line: release, version, slots, frames, format, state."""
    s = snap.segment
    h, m = s.header, s.metadata
    try:
        fmt = cw.spec_from_meta(m).label
    except LinkError:
        fmt = f"{m.width}x{m.height}x{m.num_comps} {m.dtype_name}"
    state = "closed (shutdown flag set)" if s.shutdown else "open"
    return (
        f"cuda-link {h.release} · version {h.version} · {h.num_slots} slots · {h.write_idx:,} frames published · "
        f"{m.width}x{m.height} {fmt} · {state}"
    )


def _fps(snap: Snapshot, prev: Snapshot | None) -> float | None:
    h = snap.segment.header
    same = prev is not None and prev.segment.header.version == h.version
    dt = snap.mono - prev.mono if same and prev is not None else 0.0
    if same and prev is not None and dt > 0 and h.write_idx >= prev.segment.header.write_idx:
        return (h.write_idx - prev.segment.header.write_idx) / dt
    return None


def plain_line(snap: Snapshot, prev: Snapshot | None) -> str:
    """One line per sample for a pipe or a log (``monitor`` with no terminal)."""
    fps = _fps(snap, prev)
    return f"{time.strftime('%H:%M:%S')} {PREFIX}{snap.name} {summary(snap)} · " + (
        f"{fps:,.1f} fps" if fps is not None else "fps n/a"
    )


def render(snap: Snapshot, prev: Snapshot | None) -> Group:
    s = snap.segment
    h = s.header
    fps = _fps(snap, prev)
    age = snap.perf - s.timestamp if s.timestamp > 0 else None
    events = sum(1 for e in s.event_handles if any(e))
    lines = [
        Text.assemble(("cudalink monitor ", "bold"), (PREFIX + snap.name, "bold cyan"), "  (read-only)"),
        Text(summary(snap)),
        Text(
            f"newest frame in slot {h.newest_slot if h.newest_slot is not None else '-'} · "
            + (f"{fps:,.1f} fps" if fps is not None else "fps n/a (one sample)")
            + " · last publish "
            + (f"{age * 1e3:,.1f} ms ago" if age is not None and 0 <= age < 1e6 else "unknown")
            + f" · {events}/{h.num_slots} slots with an IPC event · data_size {s.metadata.data_size:,} bytes"
        ),
        Text(
            "consumers: not recorded by cuda-link's layout (readers take no leases)",
            style="dim",
        ),
    ]
    return Group(*lines)
