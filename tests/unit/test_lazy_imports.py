"""Imports sit at the top of a module; one inside a function is a start-time decision and
says so (`# start time: <what>` on its line or just above), or is listed here with its
reason. Checked for base's packages; AST and text only."""

from __future__ import annotations

import ast
from pathlib import Path

NVCTK = Path(__file__).resolve().parents[2] / "nvctk"
CHECKED = ["base", "engines", "k8s", "monitor", "sim/*.py", "cli/common.py",
           "cli/config_cmd.py", "cli/configure.py", "cli/device_plugin.py", "cli/info.py",
           "cli/labels.py", "cli/main.py", "cli/monitor_cmd.py", "cli/runtime.py", "cli/sim.py"]
# module -> why its function-level imports are not about start time
OTHER_REASONS = {
    "k8s/gen.py": "grpc_tools is a build dependency: `python -m nvctk.k8s.gen` only",
    "k8s/proto.py": "the generated gRPC code may be missing: a clear error, not an ImportError",
}


def _files() -> list[Path]:
    out: list[Path] = []
    for pattern in CHECKED:
        p = NVCTK / pattern
        out += sorted(p.rglob("*.py")) if p.is_dir() else sorted(NVCTK.glob(pattern))
    return out


def unexplained(path: Path, root: Path = NVCTK) -> list[str]:
    lines = path.read_text().splitlines()
    bad: list[str] = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        last_ok = -10
        for node in sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))),
                           key=lambda n: n.lineno):
            near = lines[max(node.lineno - 3, 0):node.lineno]
            if any("start time" in line for line in near) or node.lineno - last_ok <= 2:
                last_ok = node.end_lineno or node.lineno  # the rest of a group of imports
            else:
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return bad


def test_function_level_imports_say_why() -> None:
    files = [p for p in _files() if str(p.relative_to(NVCTK)) not in OTHER_REASONS]
    assert len(files) > 40
    assert [b for p in files for b in unexplained(p)] == []


def test_the_check_sees_an_unexplained_import(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("def f():\n    import json\n\n\ndef g():\n    # start time: yaml\n"
                 "    import yaml\n    import yaml.constructor\n")
    assert unexplained(p, tmp_path) == ["m.py:2: import json"]
