"""nvctk's import layering: imports go only downward, nvctk has no import
cycle, and every package __init__.py is empty (an eager import there would put the
whole package on the create path). AST only: nothing of nvctk is imported.

    base (+ _sys) <- oci <- edits (the form) <- request <- host <- plan
        <- spec, cdi, vgpu (beside each other) <- hook <- runtime (it serves the hook)
        <- engines, k8s, sim, monitor (beside: each on the layers below it)
        <- dra (the DRA plugin: it reuses k8s's health) <- cli

nvctk.vgpu.limits and nvctk.vgpu.authority read what a container asks for (its limit
variables, the node's share annotations) and sit with request.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import nvctk
from support.astimports import imports_of

PKG = Path(nvctk.__file__).parent
LAYERS: dict[str, int] = {
    "base": 0, "oci": 1, "edits": 2, "request": 3, "host": 4, "plan": 5,
    "spec": 6, "cdi": 6, "vgpu": 6, "hook": 7, "runtime": 8,
    "engines": 9, "k8s": 9, "sim": 9, "monitor": 9, "dra": 10, "cli": 11,
}
# packages of one layer that may import each other (the cycle test still holds them)
SIBLINGS = frozenset({"spec", "cdi", "vgpu"})
# the compiled syscalls sit with base (base.mounts wraps them)
MODULE_LAYER = {"nvctk.vgpu.limits": "request", "nvctk.vgpu.authority": "request",
                "nvctk._sys": "base", "nvctk.edits_file": "edits"}
def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
PACKAGES = {module_name(p) for p in PKG.rglob("__init__.py")}
KNOWN = set(MODULES) | {"nvctk._sys"}


def layer_of(module: str) -> str:
    if module in MODULE_LAYER:
        return MODULE_LAYER[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def nvctk_imports(tree: ast.AST, top_only: bool) -> list[tuple[int, str]]:
    """(line, module) of the nvctk modules this one imports; `if TYPE_CHECKING:`
    blocks aside (no run-time edge), function bodies aside with top_only. A package
    (its __init__ is empty) is no edge: `from nvctk.vgpu import limits` is on limits."""
    return [(line, m) for line, m in imports_of(tree, top_only) if m in KNOWN and m not in PACKAGES]


def upward(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    if a == b or (a in SIBLINGS and b in SIBLINGS):
        return False
    return LAYERS.get(b, 99) > LAYERS.get(a, 99) or LAYERS[a] == LAYERS.get(b)


def upward_edges() -> set[tuple[str, str]]:
    out = set()
    for name, path in MODULES.items():
        for _, dep in nvctk_imports(ast.parse(path.read_text()), top_only=False):
            if upward(name, dep):
                out.add((name, dep))
    return out


def test_every_module_has_a_layer() -> None:
    assert sorted(m for m in MODULES if m != "nvctk" and layer_of(m) not in LAYERS) == []


def test_imports_go_only_downward() -> None:
    """No exceptions: an upward edge, at the top or in a function, fails."""
    assert sorted(f"{a} -> {b}" for a, b in upward_edges()) == []


def import_graph(top_only: bool) -> dict[str, set[str]]:
    return {name: {d for _, d in nvctk_imports(ast.parse(path.read_text()), top_only=top_only)}
            for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph.get(v, ()):
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


@pytest.mark.parametrize("top_only", [True, False], ids=["top-level", "function-level too"])
def test_nvctk_has_no_import_cycle(top_only: bool) -> None:
    """Nor through an import a function makes when it runs (deferred for start time):
    that is an edge of the design all the same."""
    assert cycles(import_graph(top_only)) == []


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_a_package_init_is_empty(name: str) -> None:
    """No statement but a docstring: importing nvctk.x.y runs nvctk/x/__init__.py."""
    path = PKG.parent.joinpath(*name.split("."), "__init__.py")
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    assert body == []


# --- the checks themselves can fail --------------------------------------------------------


@pytest.mark.parametrize(("importer", "imported", "up"), [
    ("nvctk.plan.make", "nvctk.host.discover", False),  # downward
    ("nvctk.host.discover", "nvctk.plan.select", True),
    ("nvctk.base.config", "nvctk.oci.spec", True),
    ("nvctk.spec.apply", "nvctk.vgpu.state", False),  # siblings
    ("nvctk.hook.worker", "nvctk.runtime.create", True),  # same layer, other package
    ("nvctk.request.parse", "nvctk.vgpu.limits", False),  # limits sits with request
    ("nvctk.monitor.containers", "nvctk.k8s.server", True),  # beside: not each other
    ("nvctk.cli.main", "nvctk.monitor.server", False),
])
def test_upward_is_what_the_layers_say(importer: str, imported: str, up: bool) -> None:
    assert upward(importer, imported) is up


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_read_at_every_level_but_type_checking() -> None:
    src = ("import nvctk.base.errors\nTYPE_CHECKING = False\nif TYPE_CHECKING:\n"
           "    from nvctk.host import discover\n"
           "def f():\n    from nvctk.plan import make\n")
    tree = ast.parse(src)
    assert [m for _, m in nvctk_imports(tree, top_only=False)] == ["nvctk.base.errors",
                                                                   "nvctk.plan.make"]
    assert [m for _, m in nvctk_imports(tree, top_only=True)] == ["nvctk.base.errors"]


# --- no private CPython module ----------------------------------------------------------------

# Any import of a module whose name (or a part of it) starts with "_" fails the test: an
# interpreter's implementation detail may change under the project. nvctk's own C
# extension (nvctk._sys) is not the standard library's, so it is allowed.


def private_imports(tree: ast.AST) -> list[str]:
    """The private modules of the standard library (a dotted part starting with "_") a
    module imports, at every level, `if TYPE_CHECKING:` included."""
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module]
    return sorted({m for m in names if m.split(".")[0] in sys.stdlib_module_names
                   and m != "__future__" and any(p.startswith("_") for p in m.split("."))})


def test_no_private_cpython_module_is_imported() -> None:
    found = {(name, mod) for name, path in MODULES.items()
             for mod in private_imports(ast.parse(path.read_text()))}
    assert sorted(found) == []


def test_private_imports_are_found() -> None:
    src = ("import _signal\nfrom _blake2 import blake2b\nimport os\nfrom nvctk import _sys\n"
           "def f():\n    from _operator import _compare_digest\n"
           "    from importlib._bootstrap import x\n")
    assert private_imports(ast.parse(src)) == ["_blake2", "_operator", "_signal",
                                               "importlib._bootstrap"]
