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


# --- which tests run alone (the `exclusive` marker, tests/README.md) -----------------------------
# What reads host-wide state that a test running beside it changes: the whole mount table,
# every process, free space.
HOST_WIDE_STRINGS = ("/proc/self/mountinfo",)
HOST_WIDE_CALLS = ("statvfs", "read_mountinfo", "mountinfo")
# helpers that read host-wide state but keep only what is the test's own (its tmp dirs,
# its runc root, its sim): they see nothing of a test beside them
OWN_ONLY = {
    "integration/test_runtime_runc.py::_watched_mounts": "mount points under its own dirs",
    "integration/test_sys.py::test_mount_flags_and_propagation": "its own tmp dir's mounts",
    "integration/test_vgpu_leaks_create.py::_procs": "callers keep their own runc root's processes",
    "integration/test_hook_orphans.py::_pids": "callers keep their own hook's children",
    "e2e/test_k8s_cri_monitor.py::_shims": "shims naming its own node dir",
    "e2e/test_k8s_cri_monitor.py::test_nothing_left_behind": "mounts under its own node dir",
    "integration/test_hook_prestart.py::mounts_under": "its own container's mount table",
    "integration/test_vgpu_leaks_gc.py::test_gc_never_deletes_through_a_mount_nested_in_a_state_dir":
        "mounts under its own state dir",
    "integration/test_vgpu_runtime_install.py::test_create_installs_state_and_is_idempotent":
        "the size of its own tmpfs",
    "integration/test_dra_grpc_shares.py::test_a_shares_spec_is_plain_cdi_with_one_ledger_for_the_claim":
        "the mount at its own ledger path",
    "integration/test_dra_grpc_shares.py::test_200_prepare_unprepare_cycles_leak_nothing":
        "mounts under its own plugin dir",
    "integration/test_hook_served.py::_procs": "callers keep their own process's children, "
        "or processes naming their own container id",
    "reliability/test_rel_restart.py::_gpu_mounted": "its own container's mount table",
}


def _observes(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) \
                and n.value.startswith(HOST_WIDE_STRINGS):
            return True
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in HOST_WIDE_CALLS:
                return True
            if name == "listdir" and n.args and isinstance(n.args[0], ast.Constant) \
                    and n.args[0].value == "/proc":
                return True
    return False


def _names_used(node: ast.AST) -> set[str]:
    """Module-level names a definition calls or takes as fixtures (its parameters)."""
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        used |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    return used


def _marked_exclusive(decorators: list[ast.expr]) -> bool:
    return any("exclusive" in ast.unparse(d) for d in decorators)


def _unmarked_host_observers(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    rel = str(path.relative_to(TESTS))
    module_marked = any(
        isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in s.targets)
        and "exclusive" in ast.unparse(s.value) for s in tree.body)
    defs = {d.name: d for d in tree.body
            if isinstance(d, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    observing = {name for name, d in defs.items()
                 if _observes(d) and f"{rel}::{name}" not in OWN_ONLY}
    while True:  # what calls (or takes as a fixture) an observer observes
        more = {name for name, d in defs.items() if name not in observing
                and f"{rel}::{name}" not in OWN_ONLY and _names_used(d) & observing}
        if not more:
            break
        observing |= more
    return [f"{rel}::{name}" for name in sorted(observing)
            if name.startswith("test") and not module_marked
            and not _marked_exclusive(defs[name].decorator_list)]


def test_tests_that_observe_the_whole_host_are_exclusive() -> None:
    """`make test` runs tests two at a time: one that reads the host's whole mount table,
    every process, free space or the host's CDI dirs sees what the test beside it does, and
    runs alone (marked exclusive) unless it keeps only what is its own (OWN_ONLY, why)."""
    files = [p for kind in KINDS[1:] for p in sorted((TESTS / kind).glob("test_*.py"))]
    assert [t for p in files for t in _unmarked_host_observers(p)] == []


def test_the_host_observer_rule_sees_an_unmarked_test(tmp_path: Path) -> None:
    kind = tmp_path / "integration"
    kind.mkdir()
    src = ("import pytest\n\n\ndef _table():\n    return open('/proc/self/mountinfo').read()\n\n\n"
           "@pytest.fixture\ndef host_table():\n    yield _table()\n\n\n"
           "def test_a(host_table):\n    pass\n\n\n"
           "@pytest.mark.exclusive\ndef test_b(host_table):\n    pass\n\n\n"
           "def test_c():\n    pass\n")
    (kind / "test_x.py").write_text(src)
    global TESTS
    saved, TESTS = TESTS, tmp_path
    try:
        assert _unmarked_host_observers(kind / "test_x.py") == ["integration/test_x.py::test_a"]
    finally:
        TESTS = saved
