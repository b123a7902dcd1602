"""One rule for value classes (docs/decisions.md, "Start time"): on the
container-start path nvctk.base.record.Record (dataclasses cost every GPU start its
import); elsewhere the standard library's dataclasses. This test keeps dataclasses
off the packages the runtime's create and the hook import."""

from __future__ import annotations

import ast
from pathlib import Path

NVCTK = Path(__file__).resolve().parents[2] / "nvctk"
# imported by nvctk-runtime create or nvctk-hook: Record only
START_PATH = ("base", "oci", "request", "host", "plan", "spec", "cdi", "vgpu", "runtime",
              "hook", "edits.py")
# long-running daemons and operator commands, which import click/grpc/tomlkit (and with
# them dataclasses) anyway: the standard library's dataclasses
DATACLASSES_OK = ("engines", "k8s", "dra", "sim", "monitor", "cli")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_every_package_is_in_one_list() -> None:
    tops = {p.name for p in NVCTK.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or p.name == "edits.py"}
    assert tops == set(START_PATH) | set(DATACLASSES_OK)


def test_no_dataclasses_on_the_start_path() -> None:
    bad = []
    for top in START_PATH:
        root = NVCTK / top
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            if "dataclasses" in _imports(path):
                bad.append(str(path.relative_to(NVCTK)))
    assert bad == []


def test_the_rule_sees_a_dataclass(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from dataclasses import dataclass\n")
    assert "dataclasses" in _imports(p)
