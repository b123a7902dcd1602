"""Planning does no I/O: no module of nvctk/plan/ imports what reads the host.

The steps (select, devices, mounts, vgpu, hooks, make: plan_container) decide from plain records that
discovery (nvctk.host.discover, nvctk.host.image) filled; an AST scan of their
imports, at every level (top, function, TYPE_CHECKING aside), and of their calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nvctk
from support.astimports import imports_of

PLAN_DIR = Path(nvctk.__file__).parent / "plan"
# what reads files, directories, processes or the environment
FORBIDDEN = ("os", "io", "pathlib", "subprocess", "shutil", "glob", "stat", "socket",
             "ctypes", "nvctk._sys", "nvctk.host", "nvctk.base.fileio", "nvctk.base.config",
             "nvctk.hook", "nvctk.vgpu.state", "nvctk.oci.spec")
# records only, no I/O: the inventory's GpuInfo/MigInfo and proc_bus_id (a string function)
ALLOWED = ("nvctk.host.inventory",)
FORBIDDEN_CALLS = ("open", "exec", "eval", "__import__", "input")


def planning_modules() -> list[Path]:
    return sorted(PLAN_DIR.glob("*.py"))


def _matches(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def io_imports(source: str) -> list[str]:
    return [f"line {line}: {m}" for line, m in imports_of(ast.parse(source))
            if _matches(m, FORBIDDEN) and not _matches(m, ALLOWED)]


def io_calls(source: str) -> list[str]:
    return [f"line {n.lineno}: {n.func.id}()" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in FORBIDDEN_CALLS]


def test_the_planning_steps_are_there() -> None:
    names = {p.stem for p in planning_modules()}
    assert {"select", "devices", "mounts", "vgpu", "hooks", "make"} <= names


@pytest.mark.parametrize("path", planning_modules(), ids=lambda p: p.name)
def test_a_planning_module_imports_nothing_that_reads_the_host(path: Path) -> None:
    assert io_imports(path.read_text()) == []


@pytest.mark.parametrize("path", planning_modules(), ids=lambda p: p.name)
def test_a_planning_module_calls_no_open(path: Path) -> None:
    assert io_calls(path.read_text()) == []


def test_the_allowed_record_module_reads_nothing() -> None:
    """What planning may import from nvctk.host is records only."""
    for name in ALLOWED:
        path = Path(nvctk.__file__).parent.joinpath(*name.split(".")[1:]).with_suffix(".py")
        assert io_imports(path.read_text()) == [] and io_calls(path.read_text()) == []


@pytest.mark.parametrize(("source", "found"), [
    ("import os", ["line 1: os"]),
    ("import os.path as p", ["line 1: os.path"]),
    ("from os import path", ["line 1: os", "line 1: os.path"]),
    ("def f():\n    from nvctk.base import fileio", ["line 2: nvctk.base.fileio"]),
    ("from nvctk.host.driver import LIBRARIES", ["line 1: nvctk.host.driver",
                                                 "line 1: nvctk.host.driver.LIBRARIES"]),
    ("from nvctk import _sys", ["line 1: nvctk._sys"]),
    ("from nvctk.host.inventory import GpuInfo", []),
    ("TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from nvctk.host.discover import Facts", []),
    ("import posixpath\nfrom nvctk.edits import Mount", []),
])
def test_the_scan_finds_io_imports(source: str, found: list[str]) -> None:
    """The scan itself: it would catch each of these (a test that cannot fail is none)."""
    assert io_imports(source) == found


def test_the_scan_finds_open_calls() -> None:
    assert io_calls("def f(p):\n    return open(p).read()") == ["line 2: open()"]
