"""``info``: is this machine ready? Driver, GPUs, IPC support, the compiled core, shared memory, the live
cudalink links of this user, and the cuda-link segments present (``info cuda-link:NAME`` describes one)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
from typing import TypedDict

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .. import _native, _platform
from .._version import __version__
from ..cuda import devices, driver
from ..errors import LinkError
from ..transport import shm as shm_transport
from . import cuda_link_view
from .monitor import Snapshot, device_label, read_snapshot
from .ui import _console


class _GpuFields(TypedDict):
    ordinal: int
    name: str | None
    uuid: str | None
    compute_capability: str | None


class GpuInfo(_GpuFields, total=False):
    ipc: dict[str, bool]  # devices.ipc_support's, plus ipc_event_supported
    ipc_error: str
    handles: dict[str, bool]  # the IPC handle kinds a Sender on it can use: "pool", "legacy"


class ShmInfo(TypedDict, total=False):
    path: str
    total: int
    free: int
    error: str


class _InfoFields(TypedDict):
    cudalink: str
    python: str
    platform: str
    packages: dict[str, str | None]


class Info(_InfoFields, total=False):
    """What ``info`` finds; the probes' keys are added as they run."""

    driver: dict[str, str | None]  # "cuda", "kernel"
    core: dict[str, str]
    gpu_error: str
    gpus: list[GpuInfo]
    peer: list[list[bool]]  # peer[i][j]: GPU i reaches GPU j's memory directly (cuDeviceCanAccessPeer)
    peer_error: str
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES as this process saw it
    shm: ShmInfo
    runtime_dir: str
    runtime_dir_error: str
    ucx: dict[str, object]  # ucx_engine.describe(): usable, versions, transports (or why not)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_versions() -> tuple[str | None, str | None]:
    """(CUDA driver API version, kernel driver version); None where no driver answers."""
    cuda_v = kernel_v = None
    try:
        from cuda.core import system

        fn = getattr(system, "get_user_mode_driver_version", None)
        if fn is not None:
            cuda_v = ".".join(map(str, fn()))
        kfn = getattr(system, "get_kernel_mode_driver_version", None) or getattr(system, "get_driver_version", None)
        if kfn is not None:
            v = kfn()
            kernel_v = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    except Exception:
        pass
    if cuda_v is None:
        try:
            drv = importlib.import_module("cuda.bindings.driver")
            v = int(driver.check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
            cuda_v = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
    return cuda_v, kernel_v


def _attr(dev: object, attr: str) -> str | None:
    """A device's ``attr`` as text (compute capability as "9.0"); None where it cannot be read."""
    try:
        v = getattr(dev, attr)
        return ".".join(map(str, tuple(v))) if attr == "compute_capability" else str(v)
    except Exception:
        return None


def gather_info() -> Info:
    """Everything ``info`` reports, each probe wrapped so a missing driver is a finding, not a crash."""
    from .measure import short_reason

    out: Info = {
        "cudalink": __version__,
        "python": f"{sys.version.split()[0]} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "packages": {
            d: _version(d)
            for d in (
                "cuda-core",
                "cuda-bindings",
                "numpy",
                "rich",
                "torch",
                "cupy-cuda13x",
                "cupy-cuda12x",
                "jax",
            )
        },
    }
    cuda_v, kernel_v = _driver_versions()
    out["driver"] = {"cuda": cuda_v, "kernel": kernel_v}
    from ..transport import ucx_engine

    out["ucx"] = (
        ucx_engine.describe()
        if importlib.util.find_spec("ucxx")
        else {"usable": False, "why": (f"UCXX is not installed; {ucx_engine.INSTALL_HINT}")}
    )
    _native.load_driver()  # so the report says why the compiled driver calls are (not) in use
    out["core"] = _native.status()  # after the driver probe, which decides the driver calls' module
    gpus: list[GpuInfo] = []
    try:
        dev0 = devices.device(0)
    except Exception as exc:
        out["gpu_error"] = short_reason(exc)
    else:
        try:
            import cuda.core

            devs = list(cuda.core.Device.get_all_devices())
        except Exception:
            devs = [dev0]
        for d in devs:
            g: GpuInfo = {
                "ordinal": int(d.device_id),
                "name": _attr(d, "name"),
                "uuid": _attr(d, "uuid"),
                "compute_capability": _attr(d, "compute_capability"),
            }
            try:
                g["ipc"] = devices.ipc_support(d)
            except Exception as exc:
                g["ipc"] = {}
                g["ipc_error"] = short_reason(exc)
            try:
                g["ipc"]["ipc_event_supported"] = bool(d.properties.ipc_event_supported)
            except Exception:
                g["ipc"].setdefault("ipc_event_supported", False)
            try:
                kinds = devices.ipc_kinds(int(d.device_id))
                pool_os = _platform.default_handles() == "pool"  # native Linux: WSL 2 refuses IPC pools
                g["handles"] = {"pool": kinds["pool"] and pool_os, "legacy": kinds["legacy"]}
            except Exception:
                g["handles"] = {}
            gpus.append(g)
        if len(gpus) > 1:
            try:
                out["peer"] = devices.peer_matrix(len(gpus))
            except Exception as exc:
                out["peer_error"] = short_reason(exc)
    out["gpus"] = gpus
    out["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    try:
        du = shutil.disk_usage(shm_dir)
        out["shm"] = {"path": shm_dir, "total": du.total, "free": du.free}
    except OSError as exc:
        out["shm"] = {"path": shm_dir, "error": str(exc)}
    try:
        out["runtime_dir"] = _platform.runtime_dir()
    except Exception as exc:
        out["runtime_dir_error"] = str(exc)
    return out


def _verdict(info: Info) -> tuple[bool, str]:
    """(ready, one line that says what works and what to do)."""
    if "runtime_dir_error" in info:
        return False, f"not ready: {info['runtime_dir_error']}"
    shm = info.get("shm", {})
    low = ""
    if "free" in shm and shm["free"] < 256 << 20:
        low = f"; note {shm['path']} has only {shm['free'] >> 20} MiB free (in Docker pass --shm-size=1g or --ipc=host)"
    gpus = info.get("gpus", [])
    ready = [
        g
        for g in gpus
        if all(
            g.get("ipc", {}).get(k)
            for k in ("memory_pools_supported", "handle_type_posix_file_descriptor_supported", "linux")
        )
    ]
    if ready:
        events = "" if all(g["ipc"].get("ipc_event_supported") for g in ready) else " (IPC events unsupported!)"
        ords = ", ".join(str(g["ordinal"]) for g in ready)
        return (
            True,
            f"CUDA IPC ready on GPU {ords}{events}: Sender(name, shape=..., device=0) shares frames zero-copy{low}",
        )
    if gpus:
        return True, (
            "GPU found, but cuda.core IPC memory pools are not available here: use "
            f"Sender(..., handles='legacy') (cuIpc handles) or device='cpu'{low}"
        )
    why = info.get("gpu_error", "no GPU")
    return True, (
        f"no GPU ({why}): CPU backend works; use Sender(name, shape=..., device='cpu') (same API, numpy "
        f"frames). For CUDA IPC, run on a Linux machine with an NVIDIA driver and GPU{low}"
    )


def _uuid_text(uuid: str | None) -> str:
    """cuda.core's UUID as ``nvidia-smi -L`` and CUDA_VISIBLE_DEVICES spell it (``GPU-...``)."""
    if not uuid:
        return "UUID ?"
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _peer_text(m: list[list[bool]]) -> str:
    """``0→1 yes · 1→0 yes``: which GPU can read and write which one's memory directly."""
    return " · ".join(f"{i}→{j} {'yes' if m[i][j] else 'no'}" for i in range(len(m)) for j in range(len(m)) if i != j)


def _multi_gpu_text(m: list[list[bool]]) -> str:
    """What a consumer on another GPU than the producer's gets here."""
    both = all(m[i][j] for i in range(len(m)) for j in range(len(m)))
    how = (
        "a peer copy (NVLink/PCIe) into a pool on that GPU"
        if both
        else "a copy into a pool on that GPU: a peer copy where peer access is marked yes, else one the driver "
        "stages through host memory (slower)"
    )
    return (
        f"Receiver(name, device=N) on another GPU than the producer's gets {how}; the producer's slot goes back "
        "as soon as the copy ran. On the producer's GPU: zero copy. rx.stats()['path'] says which; "
        "copy='never' refuses the copy"
    )


def _cuda_link_segments() -> list[str]:
    """cuda-link segments on this machine (a TouchDesigner project or a cuda-link exporter running)."""
    try:
        return cuda_link_view.find_segments()
    except Exception:
        return []


def _is_cudalink_link(name: str) -> bool:
    """A cudalink link of that name is here (``info`` describes cuda-link segments; ``monitor``, links)."""
    from ..transport.shm import _exists

    try:
        return _exists(_platform.segment_name(_platform.check_name(name)))
    except LinkError:
        return False


def _link_text(snap: Snapshot) -> str:
    """One live link: its frames, where they live, its consumers, and how to watch it."""
    f = snap.fixed
    frames = "no frame published yet"
    if snap.newest is not None:
        spec = snap.newest.spec
        fmt = f" {spec.pixel_format.value}" if spec.pixel_format else ""
        frames = f"{'x'.join(map(str, spec.shape))} {spec.dtype.name}{fmt}"
    return (
        f"{frames} · {device_label(f)} · {len(snap.consumers)} consumer(s) · producer pid {f.pid} · "
        f"python -m cudalink monitor {snap.name}"
    )


def cmd_info(args: argparse.Namespace) -> int:
    console = _console()
    info = gather_info()
    table = Table(title=f"cudalink {__version__} · {info['platform']}", show_header=False, title_justify="left")
    table.add_column("check", style="bold")
    table.add_column("value")
    table.add_row("python", info["python"])
    pk = info["packages"]
    table.add_row(
        "cuda.core / cuda-bindings",
        f"{pk['cuda-core'] or 'not installed'} / {pk['cuda-bindings'] or 'not installed'}",
    )
    frameworks = [f"{d} {pk[d]}" for d in ("torch", "cupy-cuda13x", "cupy-cuda12x", "jax") if pk.get(d)]
    table.add_row("numpy / frameworks", f"{pk['numpy']} / {', '.join(frameworks) or 'none (numpy only)'}")
    table.add_row("compiled core", " · ".join(f"{k} {v}" for k, v in info["core"].items()))
    drv = info["driver"]
    if drv["cuda"] or drv["kernel"]:
        table.add_row("driver", f"CUDA {drv['cuda'] or '?'} · kernel driver {drv['kernel'] or '?'}")
    else:
        table.add_row("driver", "no CUDA driver")
    if info["gpus"]:
        for g in info["gpus"]:
            ipc = g.get("ipc", {})
            marks = " · ".join(
                f"{label} {'yes' if ipc.get(key) else 'no'}"
                for key, label in (
                    ("memory_pools_supported", "IPC pool"),
                    ("handle_type_posix_file_descriptor_supported", "POSIX fd handle"),
                    ("ipc_event_supported", "IPC event"),
                    ("linux", "Linux"),
                )
            )
            kinds = [k for k, v in g.get("handles", {}).items() if v]
            table.add_row(
                f"GPU {g['ordinal']}",
                f"{g.get('name')} (sm {g.get('compute_capability')}) · {_uuid_text(g.get('uuid'))} · {marks} · "
                f"handles: {', '.join(kinds) or 'none'}",
            )
        table.add_row("CUDA_VISIBLE_DEVICES", info.get("visible_devices") or "unset (every GPU, in PCI order)")
        if "peer" in info:
            table.add_row("peer access", _peer_text(info["peer"]))
            table.add_row("several GPUs", _multi_gpu_text(info["peer"]))
        elif "peer_error" in info:
            table.add_row("peer access", f"unknown ({info['peer_error']})")
    else:
        table.add_row("GPUs", f"none ({info.get('gpu_error', 'no CUDA driver')})")
    shm = info["shm"]
    if "free" in shm:
        table.add_row(
            "shared memory",
            f"{shm['path']}: {shm['free'] / 2**30:,.1f} GiB free of {shm['total'] / 2**30:,.1f} GiB",
        )
    else:
        table.add_row("shared memory", f"{shm['path']}: {shm.get('error')}")
    table.add_row("control sockets", info.get("runtime_dir") or f"ERROR {info.get('runtime_dir_error')}")
    links = shm_transport.live_links() if "runtime_dir" in info else []
    if not links:
        table.add_row("links", "none: no producer of yours publishes a link on this machine now")
    for name in links:
        try:
            line = _link_text(read_snapshot(name))
        except LinkError as exc:  # starting, or gone since it was listed
            line = str(exc)
        table.add_row(f"link {escape(name)}", escape(line))
    for name in getattr(args, "segments", None) or _cuda_link_segments():
        try:
            line = cuda_link_view.summary(cuda_link_view.read_snapshot(name))
        except LinkError as exc:
            line = str(exc)
            if not name.startswith(cuda_link_view.PREFIX) and _is_cudalink_link(name):
                line += f"; {name!r} is a cudalink link: `python -m cudalink monitor {name}` shows it"
        # escaped: a segment's name is anyone's text, and "[red]" in it would be read as markup, not shown
        table.add_row(escape(cuda_link_view.PREFIX + cuda_link_view.strip_prefix(name)), escape(line))
    ucx = info.get("ucx", {})
    if ucx.get("usable"):
        names = list(map(str, ucx.get("transports", [])))  # type: ignore[call-overload]
        line = f"UCXX {ucx.get('ucxx')} · UCX {ucx.get('ucx')} · transports: {', '.join(names) or 'none found'}"
        if info.get("gpus"):
            from ..transport import ucx_engine

            line += " · " + ucx_engine.gpu_paths(names)
        table.add_row("across hosts (ucx://)", line)
    else:
        table.add_row("across hosts (ucx://)", escape(f"not usable: {ucx.get('why', '?')}"))
    console.print(table)
    ok, line = _verdict(info)
    console.print(Text("verdict: " + line, style="bold green" if ok else "bold red"), soft_wrap=True)
    return 0 if ok else 1
