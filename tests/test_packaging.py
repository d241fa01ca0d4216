"""Where no CUDA wheels exist (macOS), ``pip install cudalink`` must give the CPU backend, not fail.

The markers are checked on the metadata of a wheel built here (offline, with the setuptools and Cython
the test extra installs), with no working C compiler: the compiled core is optional, so the wheel must
still build, pure Python. The CPU backend is run in a process that cannot import any ``cuda`` module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent

_NO_CUDA = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, _Block())
import numpy as np
import cudalink
from cudalink.transport import MemoryTransport
tr = MemoryTransport()
with cudalink.Sender("nocuda", shape=(4,), dtype="uint8", transport=tr) as tx, \\
        cudalink.Receiver("nocuda", transport=tr) as rx:
    tx.send(np.arange(4, dtype=np.uint8))
    with rx.recv(1) as f:
        assert np.from_dlpack(f).tolist() == [0, 1, 2, 3]
try:
    cudalink.Sender("nocuda-gpu", shape=(4,), dtype="uint8", device=0, transport=tr)
except cudalink.CudaUnavailable as exc:
    print("CUDA:", exc)
assert not [m for m in sys.modules if m == "cuda" or m.startswith("cuda.")]
print("CPU backend OK")
"""


@pytest.fixture(scope="module")
def requires(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Requirement]:
    out = tmp_path_factory.mktemp("wheel")
    # A clean copy of the sources: a developer's build/ or in-place .so must not stand in for the build
    src = tmp_path_factory.mktemp("src") / "cudalink"
    junk = ("build", "dist", "out", ".git", ".*venv", ".nox", "*_cache", ".hypothesis", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*junk, "*.so", "*.pyd", "*.c", "benchmarks"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "CC": "false", "CXX": "false"},  # a machine with no working compiler
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cudalink._native.ring not built" in proc.stderr + proc.stdout
    (wheel,) = out.glob("cudalink-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "cudalink/_native/__init__.py" in names and "cudalink/py.typed" in names
        assert not [n for n in names if n.endswith((".so", ".pyd"))], names
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return {r.name: r for r in reqs if r.marker is None or "extra" not in str(r.marker)}


@pytest.mark.parametrize(("platform", "wants_cuda"), [("linux", True), ("win32", True), ("darwin", False)])
def test_wheel_pulls_cuda_packages_only_where_they_exist(
    requires: dict[str, Requirement], platform: str, wants_cuda: bool
) -> None:
    env = {"sys_platform": platform, "extra": ""}
    for name in ("cuda-core", "cuda-bindings"):
        req = requires[name]
        assert req.marker is not None and req.marker.evaluate(env) is wants_cuda, (name, str(req))
    assert requires["numpy"].marker is None or requires["numpy"].marker.evaluate(env)
    assert "<2" in str(requires["cuda-core"].specifier)


def test_cpu_backend_runs_without_any_cuda_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_CUDA],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CPU backend OK" in proc.stdout
    # asking for a GPU there is one clear cudalink error naming both ways out
    assert "CUDA: cudalink: the CUDA packages are not installed" in proc.stdout
    assert "pip install cuda-core cuda-bindings" in proc.stdout and "device='cpu'" in proc.stdout
