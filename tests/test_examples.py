"""Runs the examples and notebooks as a user would: CPU variants always, GPU variants under ``-m gpu``.

Examples run in subprocesses (they spawn their own producers) and must print ``NAME: OK ...`` and exit 0;
one whose framework or GPU is missing must say so in one line and exit 2. Notebooks run headless
through nbclient. Frames are few and small so the whole file stays well under a minute on two cores.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import cudalink
from cudalink.cuda import devices

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"
QUICK = ("--frames", "30", "--fps", "300", "--size", "48x64")
SKIP_CODE = 2


def _env() -> dict[str, str]:
    """Children import cudalink from this checkout even when it is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_example(name: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(EXAMPLES / f"{name}.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def assert_ok(name: str, proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    assert proc.returncode == 0 and last.startswith(f"{name}: OK"), (
        f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return last


def need_gpu() -> None:
    try:
        devices.device(0)
    except cudalink.CudaUnavailable as exc:
        pytest.skip(f"no CUDA GPU here: {exc}")


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# -- examples on the CPU ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["asyncio_consumer", "model_roundtrip", "fanout"])
def test_example_cpu(name: str) -> None:
    assert_ok(name, run_example(name, "--device", "cpu", *QUICK))


def test_model_roundtrip_numpy_model() -> None:
    last = assert_ok("model_roundtrip", run_example("model_roundtrip", "--model", "numpy", *QUICK))
    assert "30/30 results matched" in last


@pytest.mark.parametrize(("name", "module"), [("torch_consumer", "torch"), ("jax_consumer", "jax")])
def test_framework_example_cpu(name: str, module: str) -> None:
    pytest.importorskip(module)
    assert_ok(name, run_example(name, "--device", "cpu", *QUICK))


@pytest.mark.parametrize(
    ("name", "module"), [("torch_consumer", "torch"), ("cupy_consumer", "cupy"), ("jax_consumer", "jax")]
)
def test_missing_framework_is_one_clear_line(name: str, module: str) -> None:
    if has(module):
        pytest.skip(f"{module} is installed")
    device = "0" if name == "cupy_consumer" else "cpu"  # cupy_consumer on cpu: see the next test
    proc = run_example(name, "--device", device, *QUICK)
    assert proc.returncode == SKIP_CODE, proc.stdout + proc.stderr
    out = proc.stdout.strip()
    assert out.startswith(f"{name}: SKIP {module} is not installed") and "\n" not in out, out
    assert not proc.stderr.strip(), proc.stderr


def test_cupy_consumer_on_cpu_says_it_needs_gpu_frames() -> None:
    """It said "cupy is not installed" to --device cpu, where cupy would not help: the example reads GPU frames."""
    proc = run_example("cupy_consumer", "--device", "cpu", *QUICK)
    assert proc.returncode == SKIP_CODE, proc.stdout + proc.stderr
    out = proc.stdout.strip()
    assert out.startswith("cupy_consumer: SKIP cupy reads GPU frames") and "\n" not in out, out


@pytest.mark.parametrize(
    ("built", "available", "says"),
    [
        (None, False, "has no CUDA (a CPU-only wheel)"),
        ("13.0", False, "is a CUDA 13.0 build but finds no usable GPU"),
        ("13.0", True, None),
    ],
    ids=["cpu-only-build", "cuda-build-no-driver", "usable"],
)
def test_torch_consumer_tells_a_cpu_build_from_a_machine_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch, built: str | None, available: bool, says: str | None
) -> None:
    """It said "this torch build has no CUDA" for a CUDA build of torch on a machine with no driver."""
    import types

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from _demo_producer import torch_cuda_problem

    fake = types.SimpleNamespace(
        version=types.SimpleNamespace(cuda=built), cuda=types.SimpleNamespace(is_available=lambda: available)
    )
    got = torch_cuda_problem(fake)
    assert got == says if says is None else (got is not None and says in got and "--device cpu" in got), got


@pytest.mark.parametrize(
    "args",
    [("asyncio_consumer",), ("model_roundtrip",), ("model_roundtrip", "--role", "producer"), ("fanout",)],
    ids=lambda a: "-".join(a),
)
def test_missing_gpu_is_one_clear_line(args: tuple[str, ...]) -> None:
    try:
        devices.device(0)
        pytest.skip("a GPU is present")
    except cudalink.CudaUnavailable:
        pass
    name = args[0]
    proc = run_example(name, *args[1:], "--device", "0", *QUICK)
    assert proc.returncode == SKIP_CODE, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"{name}: SKIP needs a CUDA GPU") and proc.stdout.count("\n") == 1


def test_demo_start_says_at_once_when_its_device_cannot_carry_a_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo.start`` (the notebooks' producer) spawned its child and returned; the child died on the missing GPU
    with its traceback in the kernel's log, and the notebook's Receiver waited its 30 s to say 'no producer
    published ...; start the Sender first'. The device is now tried in the caller first."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _demo_producer as demo

    started: list[Any] = []
    with pytest.raises(cudalink.LinkError) as err:
        started.append(demo.start(f"demo-start-{os.getpid()}", device=99, frames=1))  # no GPU 99 anywhere
    for proc, stop in started:  # before the fix: a child that dies on its own
        stop.set()
        proc.join(30)
    assert str(err.value).startswith("cudalink:"), err.value


@pytest.mark.parametrize("notebook", ["live_demo.ipynb", "walkthrough.ipynb"])
def test_notebook_with_a_gpu_device_on_a_machine_without_one_says_so(
    notebook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        devices.device(0)
        pytest.skip("a GPU is present")
    except cudalink.CudaUnavailable:
        pass
    nbclient = pytest.importorskip("nbclient")
    if notebook == "live_demo.ipynb":
        pytest.importorskip("matplotlib")
    t0 = time.monotonic()
    with pytest.raises(nbclient.exceptions.CellExecutionError) as err:
        run_notebook(NOTEBOOKS / notebook, monkeypatch, device=0)
    assert "CudaUnavailable" in str(err.value) and "device='cpu'" in str(err.value), str(err.value)[-2000:]
    assert time.monotonic() - t0 < 25, "the cell waited for a producer that could never start"


def test_roles_in_two_processes() -> None:
    """``--role``: the model and the app started separately, as in two terminals."""
    name = f"roles-{os.getpid()}"
    args = ("--name", name, "--model", "numpy", *QUICK)
    cmd = [sys.executable, str(EXAMPLES / "model_roundtrip.py"), "--role", "consumer", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT) as model:
        app = run_example("model_roundtrip", "--role", "producer", *args)
        out, _ = model.communicate(timeout=60)
    assert app.returncode == 0 and "app: 30/30 results match" in app.stdout, app.stdout + app.stderr
    assert model.returncode == 0 and "served 30 frames" in out, out


@pytest.mark.parametrize(
    ("name", "role", "other"),
    [
        ("asyncio_consumer", "consumer", "producer"),
        ("asyncio_consumer", "producer", "consumer"),
        ("model_roundtrip", "consumer", "producer"),
        ("model_roundtrip", "producer", "consumer"),
        ("fanout", "consumer", "producer"),
        ("fanout", "producer", "consumer"),
    ],
)
def test_a_role_whose_other_side_never_comes_is_one_line(name: str, role: str, other: str) -> None:
    """With no other side, ``--role`` ended in a LinkTimeout (or TimeoutError) traceback after 30 s (60 s) and
    exit code 1; the README promises one line and exit code 2 for anything missing."""
    t0 = time.monotonic()
    proc = run_example(name, "--device", "cpu", "--role", role, "--name", f"nobody-{os.getpid()}", "--wait", "1")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == SKIP_CODE and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[0].startswith(f"{name}: ") and f"--role {other}" in lines[0] and "--wait" in lines[0], lines
    assert time.monotonic() - t0 < 20


def test_fanout_roles_as_the_readme_runs_them() -> None:
    """``fanout.py --role producer`` waited for --consumers (3 by default) of which the README starts one: it
    died after 60 s, its consumer after 30 s. With --role it waits for one unless told how many."""
    args = ("--name", f"fanroles-{os.getpid()}", "--device", "cpu", *QUICK)
    cmd = [sys.executable, str(EXAMPLES / "fanout.py"), "--role", "consumer", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT) as consumer:
        producer = run_example("fanout", "--role", "producer", *args, timeout=60)
        out, _ = consumer.communicate(timeout=60)
    assert producer.returncode == 0 and "sent 30 frames to 1 consumers" in producer.stdout, producer
    got = re.search(r"fanout: consumer got (\d+) frames", out)
    assert consumer.returncode == 0 and got and 0 < int(got.group(1)) <= 30, out  # the newest each time: may skip


# -- notebooks ---------------------------------------------------------------------------------------------


def run_notebook(path: Path, monkeypatch: pytest.MonkeyPatch, **params: Any) -> Any:
    """Execute ``path``; ``params`` go in a cell after the one tagged ``parameters`` (papermill style)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])  # the kernel and its children inherit it
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items())))
    client = nbclient.NotebookClient(
        nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError, with the cell's traceback, on any failure
    return nb


def _text(nb: Any) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


def _images(nb: Any) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def test_live_demo_notebook_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    nb = run_notebook(NOTEBOOKS / "live_demo.ipynb", monkeypatch, device="cpu", seconds=1.5)
    assert "received" in _text(nb) and _images(nb) >= 2  # the live view and the histogram


def test_walkthrough_notebook_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    nb = run_notebook(NOTEBOOKS / "walkthrough.ipynb", monkeypatch, device="cpu")
    text = _text(nb)
    assert "ProducerGone" in text and "new generation: True" in text
    assert "False" not in text, text  # every check the notebook prints came out True


def test_notebooks_are_stored_without_outputs() -> None:
    nbformat = pytest.importorskip("nbformat")
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


# -- GPU variants ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("asyncio_consumer", None),
        ("fanout", None),
        ("model_roundtrip", "torch"),
        ("torch_consumer", "torch"),
        ("cupy_consumer", "cupy"),
        ("jax_consumer", "jax"),
    ],
)
def test_example_gpu(name: str, module: str | None) -> None:
    need_gpu()
    if module is not None:
        pytest.importorskip(module)
    assert_ok(name, run_example(name, "--device", "0", *QUICK))


@pytest.mark.gpu
@pytest.mark.parametrize("notebook", ["live_demo.ipynb", "walkthrough.ipynb"])
def test_notebook_gpu(notebook: str, monkeypatch: pytest.MonkeyPatch) -> None:
    need_gpu()
    params: dict[str, Any] = {"device": 0}
    if notebook == "live_demo.ipynb":
        params["seconds"] = 1.5
    nb = run_notebook(NOTEBOOKS / notebook, monkeypatch, **params)
    assert "cuda:0" in _text(nb)


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("asyncio_consumer", ["--size", "10x"], "--size"),
        ("asyncio_consumer", ["--size", "0x5"], "--size"),
        ("asyncio_consumer", ["--frames", "0"], "--frames"),
        ("asyncio_consumer", ["--fps", "-5"], "--fps"),
        ("fanout", ["--name", "bad/x"], "invalid link name"),
        ("fanout", ["--consumers", "0"], "--consumers"),
        ("model_roundtrip", ["--role", "consumer", "--name", "bad/x"], "invalid link name"),
    ],
)
def test_a_bad_flag_is_one_line_before_anything_starts(name: str, args: list[str], needle: str) -> None:
    """They were tracebacks (in the children too), a 30 s wait, a run that never ended (--frames 0), or an OK
    for zero consumers."""
    proc = run_example(name, "--device", "cpu", *args, timeout=30)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (proc.returncode, proc.stderr)
    assert lines[0].startswith(f"{name}: ") and "Traceback" not in proc.stderr


def test_the_readme_links_each_example_with_a_line_on_what_it_shows() -> None:
    """Issue 8: "The README links each example with one line on what it shows". It named them in one sentence,
    with no file and no link but examples/README.md's."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Examples\n") :]
    wanted = [p for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")] + sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(wanted) >= 8
    for path in wanted:
        rel = path.relative_to(ROOT).as_posix()
        line = next((ln for ln in section.splitlines() if f"]({rel})" in ln), "")
        assert line, f"README's Examples section has no link to {rel}"
        assert len(line.split(f"]({rel})", 1)[1].strip(" :-")) > 20, f"no line on what {rel} shows: {line!r}"
