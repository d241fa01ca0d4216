"""The package's shape, checked: the import graph has no cycle and no upward import, and the CUDA glue
(``cudalink.cuda``) stands on its own: it imports nothing of cudalink above ``errors`` and ``_native``.

Edges come from every ``import`` that runs, function-level ones included (not those under
``if TYPE_CHECKING:``), plus the implicit ones to the packages of what is imported (importing ``a.b`` from outside ``a``
first runs ``a/__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "cudalink"

#: lower layers never import higher ones; a module may import its own layer (the cycle check covers that)
LAYERS: list[set[str]] = [
    {"cudalink.errors", "cudalink._version", "cudalink._trace", "cudalink._native", "cudalink._platform"},
    {"cudalink.cuda", "cudalink.cuda.objects", "cudalink.cuda.driver"},
    {"cudalink.cuda.devices"},
    {
        "cudalink.cuda.arrays",
        "cudalink.cuda.memory",
        "cudalink.cuda.landing",
        "cudalink.transport.base",
        "cudalink.cuda.ucx",
    },
    {"cudalink.frames", "cudalink.frames.spec", "cudalink.frames.frame"},
    {
        "cudalink.transport",
        "cudalink.transport.wire",
        "cudalink.transport.cuda_link_wire",
        "cudalink.transport.cuda_link_source",
        "cudalink.transport.control",
        "cudalink.transport.channel",
        "cudalink.transport.shm",
        "cudalink.transport.landed",
        "cudalink.transport.memory",
        "cudalink.transport.ucx_wire",
        "cudalink.transport.ucx_engine",
        "cudalink.transport.ucx_source",
        "cudalink.transport.source",
        "cudalink.transport.ring_source",
        "cudalink.transport.sources",
        "cudalink._ring",
        "cudalink._backends",
        "cudalink.cuda_link",
    },
    {"cudalink.link"},
    {
        "cudalink",
        "cudalink.td",
        "cudalink.td.arraylib",
        "cudalink.td.formats",
        "cudalink.td.source",
        "cudalink.td.convert",
        "cudalink.td.sink",
        "cudalink.ucx_server",
    },
    {
        "cudalink.tools",
        "cudalink.tools.measure",
        "cudalink.tools.ui",
        "cudalink.tools.peers",
        "cudalink.tools.cuda_link_view",
    },
    {"cudalink.tools.peers.link", "cudalink.tools.peers.shm", "cudalink.tools.peers.mpqueue"},
    {
        "cudalink.tools.floors",
        "cudalink.tools.breakdown",
        "cudalink.tools.copysend",
        "cudalink.tools.gpuclock",
        "cudalink.tools.bench",
        "cudalink.tools.monitor",
        "cudalink.tools.multigpu_bench",
        "cudalink.tools.clean",
    },
    {"cudalink.tools.remote_bench"},
    {
        "cudalink.tools.demo",
        "cudalink.tools.info",
        "cudalink.tools.report",
        "cudalink.tools.serve",
        "cudalink.tools.relay",
    },
    {"cudalink.tools.cli"},
    {"cudalink.__main__"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for the type checker never run)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_nodes(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t not in mods or t == mod:
                    continue
                graph[mod].add(t)
                pkg = t
                while "." in pkg:  # importing a.b.c from outside a.b first runs a/b/__init__
                    pkg = pkg.rsplit(".", 1)[0]
                    if pkg in mods and pkg != mod and not mod.startswith(pkg + "."):
                        graph[mod].add(pkg)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_checker_finds_a_cycle_when_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_no_module_imports_upward() -> None:
    graph = import_graph()
    layer = {m: i for i, group in enumerate(LAYERS) for m in group}
    unplaced = sorted(set(graph) - set(layer))
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"
    upward = [
        f"{m} (layer {layer[m]}) imports {d} (layer {layer[d]})"
        for m, deps in graph.items()
        for d in deps
        if layer[d] > layer[m]
    ]
    assert not upward, upward


def test_compiled_modules_import_only_modules_that_exist() -> None:
    """The .pyx sources are outside the AST walk above; a stale cudalink import there fails only when its
    line runs (the compiled driver calls import the error translation on their error path)."""
    import re

    mods = set(_modules())
    # cimports name Cython declaration files (.pxd) as modules of their own
    mods |= {".".join(("cudalink", *p.relative_to(PKG).with_suffix("").parts)) for p in PKG.rglob("*.pxd")}
    found = []
    for pyx in sorted(PKG.rglob("*.pyx")):
        for target in re.findall(r"^\s*(?:from|import)\s+(cudalink[\w.]*)", pyx.read_text(), re.M):
            found.append(target)
            assert target in mods, f"{pyx.name} imports {target}, which does not exist"
    assert "cudalink.cuda.driver" in found, found  # the scan sees the function-level import too
    assert "cudalink._native.dlpack_abi" in found, found  # and the cimports


def test_frames_know_nothing_of_transports_and_cuda_glue_nothing_of_frames() -> None:
    graph = import_graph()
    library = [m for m in graph if not m.startswith(("cudalink.tools", "cudalink.__main__"))]
    assert not [m for m in library if any(d.startswith("cudalink.tools") for d in graph[m])], (
        "the library imports a tool"
    )
    for m in ("cudalink.frames", "cudalink.frames.spec", "cudalink.frames.frame"):
        assert not {d for d in graph[m] if d.startswith(("cudalink.transport", "cudalink.link"))}, m
    glue = [m for m in graph if m == "cudalink.cuda" or m.startswith("cudalink.cuda.")]
    assert len(glue) >= 5, glue
    for m in glue:
        outside = {d for d in graph[m] if not d.startswith("cudalink.cuda")}
        assert outside <= {"cudalink", "cudalink.errors", "cudalink._native"}, (m, outside)


def test_the_os_is_asked_about_only_in_platform() -> None:
    """What differs between operating systems lives in ``cudalink/_platform.py`` (one file to port and to review):
    nowhere else asks which OS this is. The CUDA glue may not import ``_platform`` (see above); its one question,
    whether IPC pools can exist here, is asked again by ``_backends.resolve_handles`` through ``_platform``."""
    import re

    asks = re.compile(r"\bsys\.platform\b|\bos\.name\b|\bos\.uname\b|\bplatform\.(?:system|uname|release)\(")
    allowed = {"cudalink/_platform.py", "cudalink/cuda/devices.py"}
    found = [
        f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}"
        for path in sorted(PKG.rglob("*.py"))
        if str(path.relative_to(PKG.parent)) not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert not found, "ask _platform instead:\n" + "\n".join(found)


def test_every_import_from_cuda_cores_private_modules_sits_in_one_module() -> None:
    """cuda.core 1.x's traps (its private IPC descriptor constructors) are reached from one module only, so a
    cuda.core release that moves them breaks one file: ``cudalink/cuda/driver.py``."""
    import re

    private = re.compile(r"^\s*(?:from|import)\s+cuda\.(?:core|bindings)\._", re.M)
    found = sorted(
        str(path.relative_to(PKG.parent))
        for pattern in ("*.py", "*.pyx")
        for path in PKG.rglob(pattern)
        if private.search(path.read_text())
    )
    assert found == ["cudalink/cuda/driver.py"], found


class _TorchDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


class _Tensor:
    """What ``arrays._torch_info`` reads of a torch tensor (its C methods), without torch."""

    def __init__(self, dtype: str) -> None:
        self.dtype = _TorchDtype(dtype)
        self.shape = (2, 3)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return 4096

    def get_device(self) -> int:
        return 0


def test_torch_dtypes_map_to_numpy_by_name_and_the_rest_take_the_general_path() -> None:
    """The CUDA glue no longer imports cudalink.frames for its dtype table: numpy names the dtype."""
    import numpy as np

    from cudalink.cuda import arrays

    info = arrays._torch_info(_Tensor("float32"))
    assert info is not None and info.dtype == np.dtype("float32") and info.shape == (2, 3) and info.ptr == 4096
    assert arrays._torch_info(_Tensor("uint16")).dtype == np.dtype("uint16")  # type: ignore[union-attr]
    assert arrays._torch_info(_Tensor("bfloat16")).dtype.name == "bfloat16"  # type: ignore[union-attr]  # ml_dtypes'
    assert arrays._torch_info(_Tensor("qint8")) is None  # numpy has no such type: DLPack/CAI path decides


#: methods that test a message's words (a fold of whitespace or a first line, for display, tests nothing)
_TESTS_TEXT = {"startswith", "endswith", "find", "rfind", "index", "rindex", "count"}


def error_text_reads(tree: ast.AST) -> list[int]:
    """Lines where an ``except ... as NAME`` handler branches on NAME's message: ``x in str(exc)``,
    ``str(exc).startswith(...)``, also through a name assigned from ``str(exc)``."""
    found = []
    for handler in ast.walk(tree):
        if not isinstance(handler, ast.ExceptHandler) or not handler.name:
            continue
        exc_name = handler.name

        def is_text(node: ast.AST, aliases: set[str], exc_name: str = exc_name) -> bool:
            if isinstance(node, ast.Name):
                return node.id in aliases
            return (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "str"
                and len(node.args) == 1
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == exc_name
            )

        aliases: set[str] = set()
        for node in ast.walk(handler):
            if isinstance(node, ast.Assign) and is_text(node.value, set()):
                aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(handler):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                if any(is_text(side, aliases) for side in (node.left, *node.comparators)):
                    found.append(node.lineno)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _TESTS_TEXT
                and is_text(node.func.value, aliases)
            ):
                found.append(node.lineno)
    return sorted(found)


def test_no_code_branches_on_an_error_message() -> None:
    """Issue 15: code branches on structure (an exception's class, ``ProtocolError.reason``, an attribute), never
    on a message's words, which are for people and change freely. What this finds: a test of the text inside the
    ``except ... as exc`` handler that caught it (``in str(exc)``, ``str(exc).startswith``, through a name
    assigned from it); text passed on to a helper, or read through ``exc.args``, is not followed."""
    found = [
        f"{path.relative_to(PKG.parent)}:{line}"
        for path in sorted(PKG.rglob("*.py"))
        for line in error_text_reads(ast.parse(path.read_text()))
    ]
    assert not found, "branch on the exception's class or attributes, not its text:\n" + "\n".join(found)


def test_the_error_text_check_finds_what_it_looks_for() -> None:
    src = """
try:
    f()
except E as exc:
    if "x" in str(exc):
        pass
    text = str(exc)
    ok = "y" not in text
    if str(exc).startswith("cudalink: no"):
        pass
    shown = " ".join(str(exc).split())
"""
    assert error_text_reads(ast.parse(src)) == [5, 8, 9]  # not the whitespace fold for display
