"""GPUs: parsing ``device=``, opening one by ordinal or by the UUID the header carries, and what IPC it supports."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError, CudaUnavailable, LinkError
from . import driver

if TYPE_CHECKING:
    from .objects import Device

T = TypeVar("T")


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
        raise driver.no_gpu(f"cudalink: no usable CUDA driver ({exc})") from exc
    except (ValueError, IndexError) as exc:
        check_ordinal(ordinal)  # names the GPUs that exist
        raise driver.no_gpu(f"cudalink: no CUDA device {ordinal} ({exc})") from exc
    return dev


@contextlib.contextmanager
def gpu_only(what: str) -> Iterator[None]:
    """For what exists on a GPU only (cuda-link's segments): a missing GPU says so, instead of the usual
    advice to pass device='cpu', which that call refuses."""
    try:
        yield
    except CudaUnavailable as exc:
        if exc.before_cpu_advice is None:  # not the no-GPU kind: its advice stands
            raise
        hint = f"{what} needs a usable NVIDIA GPU and driver (device='cpu' exists only for cudalink's own links)"
        raise CudaUnavailable(exc.before_cpu_advice + hint) from exc


@contextlib.contextmanager
def keep_current() -> Iterator[None]:
    """Give the calling thread its current CUDA context back afterwards.

    Frameworks read "the current device" from it (torch, cupy): a consumer that receives on GPU 1 of a
    producer on GPU 0 must not find its current device moved to 0 by attaching. A thread that had no context
    keeps the one set inside (it needs one for what follows, as before).
    """
    try:
        drv = driver.bindings()
        err, ctx = drv.cuCtxGetCurrent()
    except Exception:  # no driver here: nothing to give back, and the block's first CUDA call says why
        err, ctx = 1, 0
    try:
        yield
    finally:
        if not err and int(ctx):
            drv.cuCtxSetCurrent(ctx)


_primaries: dict[int, int] = {}


def primary_context(ordinal: int) -> int:
    """GPU ``ordinal``'s primary context, as an int (made once; the caller's current context stays): where
    DLPack's default streams (1: legacy, 2: per-thread) of an array on that GPU live. The driver reads those
    values in the calling thread's current context, which may be another GPU's: torch's ``from_dlpack`` passes
    1 for a tensor on GPU 0 while GPU 1 is current, and switches nothing."""
    got = _primaries.get(ordinal)
    if got is None:
        with keep_current():
            got = _primaries[ordinal] = context(ordinal)
    return got


def in_context(ctx: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with context ``ctx`` current, the caller's put back after; where ``ctx`` already is current,
    one driver call more than ``fn`` itself (this runs per frame for DLPack's default streams). A thread that had
    no context keeps ``ctx``, as :func:`keep_current` does."""
    cur = driver.current_context()
    if cur == ctx:
        return fn(*args)
    driver.set_context(ctx)
    try:
        return fn(*args)
    finally:
        if cur:
            driver.set_context(cur)


#: DLPack's default stream values (1: legacy, 2: per-thread; 0 too, for the null stream): each names a stream of
#: whatever context is current in the calling thread, not of a GPU of its own
LAST_DEFAULT_STREAM = 2


def on_stream(ctx: int, stream: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a call that queues work on ``stream`` of the GPU whose context is ``ctx``: the one place
    that knows DLPack's default streams name that GPU's only once its context is current (a consumer's
    ``from_dlpack`` or ``release()`` may run with another GPU current, and torch's switches nothing). A real
    stream handle carries its own context, so the common case costs nothing more."""
    if stream > LAST_DEFAULT_STREAM:
        return fn(*args)
    return in_context(ctx, fn, *args)


def has_current() -> bool:
    """Whether the calling thread has a current CUDA context."""
    drv = driver.bindings()
    err, ctx = drv.cuCtxGetCurrent()
    return not err and bool(int(ctx))


def device_by_uuid(uuid: bytes, fallback: int) -> Device:
    """Open the producer's GPU by UUID, so differing CUDA_VISIBLE_DEVICES still meet on the same chip."""
    if any(uuid):
        gpus = visible()
        found = ordinal_of(uuid, gpus)
        if found is None:
            raise CudaUnavailable(missing_gpu(uuid, gpus))
        return device(found)
    return device(fallback)


def missing_gpu(uuid: bytes, gpus: list[tuple[int, bytes]]) -> str:
    """Why a consumer cannot reach the producer's GPU, naming it and what this process sees instead."""
    return (
        f"cudalink: the producer's frames live on GPU {format_uuid(uuid)}, which this process cannot see "
        f"(CUDA_VISIBLE_DEVICES={_visible_env()}; visible: {describe_visible(gpus)}). A consumer maps the "
        "producer's GPU memory even when it receives on another GPU: make that GPU visible (CUDA_VISIBLE_DEVICES "
        "takes UUIDs too, e.g. CUDA_VISIBLE_DEVICES=<yours>,<the producer's>), then pick yours with device=N"
    )


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


# -- several GPUs: counting them, peer access, and where a copy between two of them goes ---------------------

#: how a frame reaches a consumer's GPU: the producer's own memory, a peer copy (NVLink/PCIe P2P), or a
#: device-to-device copy that the driver stages through host memory (no peer access between the two)
PATH_ZERO_COPY = "zero-copy"
PATH_SAME = "same-device"
PATH_PEER = "peer"
PATH_STAGED = "staged"


def count() -> int:
    """How many GPUs this process sees (after CUDA_VISIBLE_DEVICES); 0 where there is no driver."""
    try:
        drv = driver.bindings()
        err, n = drv.cuInit(0)[0], driver.check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
    except (LinkError, RuntimeError):
        return 0
    return int(n) if not err else 0


def uuid_at(ordinal: int) -> bytes:
    """The 16-byte UUID of visible GPU ``ordinal`` (as the header carries it), without making it current."""
    return uuid_of(driver.core().Device(ordinal))


def name_at(ordinal: int) -> str:
    drv = driver.bindings()
    dev = driver.check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    raw = driver.check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")


def format_uuid(uuid: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-...``, as ``nvidia-smi -L`` and CUDA_VISIBLE_DEVICES spell it."""
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def visible() -> list[tuple[int, bytes]]:
    """``(ordinal, uuid)`` of every GPU this process sees."""
    return [(i, uuid_at(i)) for i in range(count())]


def describe_visible(gpus: list[tuple[int, bytes]] | None = None) -> str:
    """The visible GPUs in words, for error messages: ``cuda:0 GPU-..., cuda:1 GPU-...`` (or ``none``)."""
    gpus = visible() if gpus is None else gpus
    return ", ".join(f"cuda:{i} {format_uuid(u)}" for i, u in gpus) or "none"


def ordinal_of(uuid: bytes, gpus: list[tuple[int, bytes]] | None = None) -> int | None:
    """This process's ordinal for the GPU with ``uuid``, or None where it is hidden (CUDA_VISIBLE_DEVICES)."""
    for i, u in visible() if gpus is None else gpus:
        if u == uuid:
            return i
    return None


def wanted_ordinal(device: object) -> int | None:
    """A Receiver's ``device=``: None for the host (``"cpu"``) or no choice (None), else the GPU ordinal, checked
    now: a bad value, or a GPU that is not there (naming those that are), fails when the Receiver is made, not
    at its first attach."""
    if device is None or device == "cpu":
        return None
    ordinal = parse_device(device)
    check_ordinal(ordinal)
    return ordinal


def check_ordinal(ordinal: int, gpus: list[tuple[int, bytes]] | None = None) -> None:
    """A clear error naming the GPUs that exist when ``ordinal`` is not one of them."""
    gpus = visible() if gpus is None else gpus
    if not gpus:  # no GPU at all: say why (no driver, or the driver sees none), not "pass one of: none"
        raise driver.no_gpu(f"cudalink: there is no cuda:{ordinal} here: {_why_no_gpu()}")
    if not any(i == ordinal for i, _ in gpus):
        raise CudaUnavailable(
            f"cudalink: there is no cuda:{ordinal} here; this process sees {len(gpus)} GPU(s): "
            f"{describe_visible(gpus)} (CUDA_VISIBLE_DEVICES={_visible_env()}); pass one of those ordinals"
        )


def _why_no_gpu() -> str:
    try:
        drv = driver.bindings()
        err = drv.cuInit(0)[0]
    except (LinkError, RuntimeError) as exc:  # includes cuda.pathfinder's DynamicLibNotFoundError
        return f"no usable CUDA driver ({exc})"
    if err:
        return f"the CUDA driver found no usable GPU ({err!r}; CUDA_VISIBLE_DEVICES={_visible_env()})"
    return f"the CUDA driver sees no GPU (CUDA_VISIBLE_DEVICES={_visible_env()})"


def _visible_env() -> str:
    import os

    got = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "unset" if got is None else repr(got)


def can_access_peer(ordinal: int, peer: int) -> bool:
    """cuDeviceCanAccessPeer: whether GPU ``ordinal`` can read and write ``peer``'s memory directly."""
    if ordinal == peer:
        return True
    drv = driver.bindings()
    a = driver.check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    b = driver.check(drv.cuDeviceGet(peer), "cuDeviceGet")
    return bool(driver.check(drv.cuDeviceCanAccessPeer(a, b), "cuDeviceCanAccessPeer"))


def peer_matrix(n: int | None = None) -> list[list[bool]]:
    """``m[i][j]``: GPU i can access GPU j's memory directly (the diagonal is True)."""
    n = count() if n is None else n
    return [[can_access_peer(i, j) for j in range(n)] for i in range(n)]


def context(ordinal: int) -> int:
    """The primary context of GPU ``ordinal`` (made current), as an int: what cross-device copies name."""
    device(ordinal)
    drv = driver.bindings()
    return int(driver.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent"))


def enable_peer_access(ordinal: int, peer: int) -> bool:
    """Let GPU ``ordinal``'s primary context reach ``peer``'s memory; False where the hardware cannot.

    Idempotent (the driver's "already enabled" counts as done). Leaves ``ordinal``'s context current.
    """
    if ordinal == peer:
        return True
    if not can_access_peer(ordinal, peer):
        return False
    drv = driver.bindings()
    peer_ctx = context(peer)
    context(ordinal)
    err = drv.cuCtxEnablePeerAccess(drv.CUcontext(peer_ctx), 0)[0]
    if err and err != drv.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
        driver.check((err,), "cuCtxEnablePeerAccess")
    return True


def copy_path(src: int, dst: int) -> str:
    """How a copy from GPU ``src`` to GPU ``dst`` runs: ``same-device``, ``peer`` (peer access enabled
    both ways here, where cuDeviceCanAccessPeer allows it) or ``staged`` (the driver stages it)."""
    if src == dst:
        return PATH_SAME
    if enable_peer_access(src, dst) and enable_peer_access(dst, src):
        return PATH_PEER
    return PATH_STAGED


def ipc_kinds(ordinal: int) -> dict[str, bool]:
    """Which IPC handle kinds GPU ``ordinal`` supports, as far as the GPU and driver say: ``pool`` (cuda.core
    IPC pools: memory pools with POSIX fd handles; the OS must also be native Linux, not WSL 2: the caller
    checks that), ``legacy`` (cuIpc handles, every platform) and ``ipc_events``."""
    drv = driver.bindings()
    dev = driver.check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = drv.CUdevice_attribute

    def get(name: str) -> bool:
        a = getattr(attr, name, None)
        if a is None:
            return False
        try:
            return bool(driver.check(drv.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute"))
        except LinkError:
            return False

    pools = get("CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED")
    fd_handles = get("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
    return {
        "pool": pools and fd_handles and sys.platform.startswith("linux"),
        "legacy": True,
        "ipc_events": get("CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED"),
    }
