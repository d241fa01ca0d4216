"""The README's Use section runs as written: its CPU pair (and the asyncio consumer) as two processes
here, its GPU pair under ``-m gpu``, and no snippet names anything it never defined. Only the link name
changes (``cam0`` -> a name of this test's own), so runs beside each other never meet."""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import symtable
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cudalink

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def use_snippets() -> dict[str, str]:
    """The Use section's python blocks, keyed by the file name their first line gives (``# producer.py``)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Use\n")
    use = text[start : text.index("\n## ", start + 1)]
    out = {}
    for block in re.findall(r"```python\n(.*?)```", use, re.S):
        first = block.splitlines()[0]
        m = re.match(r"# (\w+\.py)\b", first)
        assert m, f"every Use snippet starts with '# <file>.py': {first!r}"
        out[m.group(1)] = block
    return out


def undefined_names(code: str, filename: str) -> set[str]:
    """Names a snippet reads that it never imports, assigns or gets from builtins."""
    top = symtable.symtable(code, filename, "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins))
    missing: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            reads_global = sym.is_global() or (table is top and sym.is_referenced())
            if reads_global and sym.is_referenced() and sym.get_name() not in defined:
                missing.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return missing


def test_every_use_snippet_compiles_and_defines_what_it_uses() -> None:
    snippets = use_snippets()
    assert {"producer.py", "consumer.py", "async_consumer.py", "gpu_producer.py", "gpu_consumer.py"} <= set(snippets)
    for filename, code in snippets.items():
        compile(code, filename, "exec")  # no top-level ``async for``: it would be a SyntaxError here
        assert not undefined_names(code, filename), (filename, undefined_names(code, filename))


def _write(tmp_path: Path, snippets: dict[str, str], name: str) -> dict[str, Path]:
    out = {}
    for filename, code in snippets.items():
        path = tmp_path / filename
        path.write_text(code.replace('"cam0"', repr(name)), encoding="utf-8")
        out[filename] = path
    return out


def _start(path: Path) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, str(path)], cwd=path.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    return out


def test_the_readme_cpu_pair_runs_as_written(tmp_path: Path) -> None:
    files = _write(tmp_path, use_snippets(), f"readme-{os.getpid()}")
    consumers = [_start(files["consumer.py"]), _start(files["async_consumer.py"])]  # they wait for the producer
    time.sleep(0.5)
    producer = _start(files["producer.py"])
    _finish(producer, 60)
    out, aout = (_finish(c, 30) for c in consumers)
    rows = [re.fullmatch(r"(\d+) \(480, 640, 3\) (\d+) frame (\d+)", ln) for ln in out.splitlines()]
    assert len(rows) == 60 and all(rows), out
    seqs = [int(m.group(1)) for m in rows if m]
    assert seqs == sorted(seqs) and len(set(seqs)) == 60
    for m in rows:  # pixels, seq and meta agree: frame i (seq i + 1) is filled with i
        assert m is not None and int(m.group(3)) == int(m.group(1)) - 1 and int(m.group(2)) == int(m.group(3)) % 256
    arows = aout.splitlines()
    assert len(arows) >= 30 and all(r.endswith("(480, 640, 3)") for r in arows), aout


@pytest.mark.gpu
def test_the_readme_gpu_pair_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    files = _write(tmp_path, use_snippets(), f"readme-gpu-{os.getpid()}")
    consumer = _start(files["gpu_consumer.py"])
    time.sleep(3.0)  # its torch import done, it waits in Receiver() (timeout 10 s) before the producer exists
    _finish(_start(files["gpu_producer.py"]), 120)
    out = _finish(consumer, 30)
    rows = out.splitlines()
    assert rows and all("torch.Size([1080, 1920, 4])" in r for r in rows), out


# -- README and behaviour agree on non-contiguous sources (the GPU half: test_gpu's pitched-copy test) ------


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[::-1],  # a flip: negative strides
        lambda a: a.transpose(1, 0, 2)[:, :, :].copy().transpose(1, 0, 2),  # a transposed buffer
        lambda a: np.pad(a, ((0, 0), (0, 3), (0, 0)))[:, :6],  # padded rows (a crop)
        lambda a: np.repeat(a, 2, axis=2)[:, :, ::2],  # every other element
    ],
    ids=["flip", "transposed", "crop", "every-other"],
)
def test_a_cpu_link_copies_any_strided_array_right(make: object) -> None:
    name = f"readme-strided-{os.getpid()}"
    base = np.arange(4 * 6 * 3, dtype=np.uint16).reshape(4, 6, 3)
    src = make(base)  # type: ignore[operator]
    assert src.shape == (4, 6, 3) and not src.flags.c_contiguous
    with cudalink.Sender(name, shape=(4, 6, 3), dtype="uint16") as tx, cudalink.Receiver(name, timeout=5) as rx:
        tx.send(src)
        with rx.recv(timeout=5) as frame:
            assert np.array_equal(np.from_dlpack(frame), src)


def test_the_code_map_names_every_module_of_the_tree() -> None:
    """Issue 15: the README's code map matches the tree (it had lost eight modules: cli, copysend, gpuclock,
    remote_bench, ui and the mpqueue peer among them). A module is named in the entry of its own package
    (``cudalink/tools/``'s for ``peers/link.py``), not anywhere: ``link.py`` is also ``cudalink/link.py``."""
    text = (ROOT / "README.md").read_text()
    start = text.index("Code map, lowest layer first")
    code_map = text[start : text.index("\n## ", start)]
    entries = code_map.split("\n- ")
    trivial = {"__init__.py", "__main__.py", "_version.py"}

    def named(p: Path) -> bool:
        parts = p.relative_to(ROOT / "cudalink").parts
        if len(parts) == 1:  # a top-level module: by its path
            return f"cudalink/{p.name}`" in code_map or f"`cudalink/{p.name}`" in code_map
        own = [e for e in entries if f"cudalink/{parts[0]}/" in e]
        return any(f"{p.name}`" in e or f"`{p.stem}`" in e for e in own)  # `cli.py`; a command: `serve`

    missing = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "cudalink").rglob("*"))
        if p.suffix in (".py", ".pyx") and p.name not in trivial and not named(p)
    ]
    assert not missing, f"the README's code map does not name: {missing}"
