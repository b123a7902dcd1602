"""The test suite's own rules: tests sorted by kind into tests/unit, integration, e2e and
reliability; what tests share lives in tests/support (no test module imports another, nor
conftest); unit tests need no root and start no nvctk executable (tests/unit/conftest.py
refuses it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from support.unitguard import SpawnsNvctk

TESTS = Path(__file__).resolve().parents[1]
KINDS = ("unit", "integration", "e2e", "reliability")


def _py_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_test_file_is_in_a_kind_dir() -> None:
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.relative_to(TESTS).parts[0] not in KINDS]
    assert misplaced == []


def test_no_test_module_imports_another_or_conftest() -> None:
    bad = []
    for p in _py_files():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top.startswith("test_") or top == "conftest":
                    bad.append(f"{p.relative_to(TESTS)}:{node.lineno}: {name}")
    assert bad == []


def test_unit_tests_need_no_root() -> None:
    asks = [str(p.relative_to(TESTS)) for p in (TESTS / "unit").glob("*.py")
            if "geteuid" in p.read_text() and p.name != Path(__file__).name]
    assert asks == []


@pytest.mark.parametrize("argv", [
    ["nvctk-runtime", "--version"],
    [str(Path(sys.executable).parent / "nvctk"), "--help"],
    ["/usr/bin/nvctk-hook", "prestart"],
    [sys.executable, "-m", "nvctk.cli.main", "--help"],
])
def test_unit_tests_cannot_start_nvctk(argv: list[str]) -> None:
    with pytest.raises(SpawnsNvctk, match="move it to tests/integration"):
        subprocess.run(argv, capture_output=True)


def test_other_processes_still_run() -> None:
    r = subprocess.run([sys.executable, "-c", "import nvctk; print('ok')"],
                       capture_output=True, text=True, check=True)
    assert r.stdout == "ok\n"
