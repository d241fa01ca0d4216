"""GPUs: parsing ``device=``, opening one by ordinal or by the UUID the header carries, and what IPC it supports."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError, CudaUnavailable
from . import driver

if TYPE_CHECKING:
    from .objects import Device


def parse_device(device: object) -> int:
    """``0``, ``"cuda"``, ``"cuda:1"`` -> ordinal; anything else is a clear error."""
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool) and int(device) >= 0:
        return int(device)
    if isinstance(device, str):
        text = device.strip().lower()
        if text == "cuda":
            return 0
        if text.startswith("cuda:") and text[5:].isdigit():
            return int(text[5:])
    kind = ArgumentError if isinstance(device, (str, int, np.integer)) else ArgumentTypeError
    raise kind(f"cudalink: device must be 'cpu', a CUDA ordinal like 0, or 'cuda:N'; got {device!r}")


def device(ordinal: int) -> Device:
    """The cuda.core Device, made current; CudaUnavailable (with the way out) when there is none."""
    core = driver.core()
    try:
        dev: Device = core.Device(ordinal)
        dev.set_current()
    except RuntimeError as exc:  # includes cuda.pathfinder's DynamicLibNotFoundError (no driver)
        raise CudaUnavailable(f"cudalink: no usable CUDA driver ({exc}); {driver.NO_GPU_HINT}") from exc
    except (ValueError, IndexError) as exc:
        raise CudaUnavailable(f"cudalink: no CUDA device {ordinal} ({exc}); {driver.NO_GPU_HINT}") from exc
    return dev


def device_by_uuid(uuid: bytes, fallback: int) -> Device:
    """Open the producer's GPU by UUID, so differing CUDA_VISIBLE_DEVICES still meet on the same chip."""
    core = driver.core()
    try:
        count = int(core.system.get_num_devices())
    except Exception:
        count = 0
    if any(uuid):
        for i in range(count):
            found: Device = core.Device(i)
            if uuid_of(found) == uuid:
                found.set_current()
                return found
        raise CudaUnavailable("cudalink: the producer's GPU is not visible here; check CUDA_VISIBLE_DEVICES")
    return device(fallback)


def uuid_of(dev: Device) -> bytes:
    """The GPU's 16-byte UUID (zeros where the driver gives none): how the header names the device."""
    import uuid as _uuid

    try:
        return _uuid.UUID(str(dev.uuid)).bytes
    except Exception:
        return b"\0" * 16


def ipc_support(dev: Device) -> dict[str, bool]:
    props = dev.properties
    out = {}
    for key in ("memory_pools_supported", "handle_type_posix_file_descriptor_supported"):
        try:
            out[key] = bool(getattr(props, key))
        except Exception:
            out[key] = False
    out["linux"] = sys.platform.startswith("linux")
    return out


def require_pool_ipc(dev: Device) -> None:
    sup = ipc_support(dev)
    missing = [k for k, v in sup.items() if not v]
    if missing:
        raise CudaUnavailable(
            f"cudalink: this GPU/OS cannot share cuda.core IPC memory pools (missing: {', '.join(missing)}); "
            f"pass handles='legacy' (cuIpc handles, also on Windows/WSL) or {driver.NO_GPU_HINT}"
        )
