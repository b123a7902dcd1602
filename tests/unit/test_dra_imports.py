"""The `kubernetes` client (~0.2 s to import, with pydantic and urllib3) is the DRA
plugin's alone: no other nvctk module imports it, at any level, and importing the
runtime, the hook or the CLI's entry point does not load it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import nvctk
from support.astimports import imports_of

PKG = Path(nvctk.__file__).parent
# nvctk.dra.* (the plugin) and the CLI module that starts it
ALLOWED = ("nvctk/dra/", "nvctk/cli/dra")


def kubernetes_importers() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        mods = {m for _, m in imports_of(ast.parse(path.read_text()))}
        if any(m == "kubernetes" or m.startswith("kubernetes.") for m in mods):
            out.append(rel)
    return out


def test_only_the_dra_plugin_imports_the_kubernetes_client() -> None:
    found = kubernetes_importers()
    assert "nvctk/dra/kube.py" in found  # the check sees the one importer there is
    assert [p for p in found if not p.startswith(ALLOWED)] == []


def test_the_runtime_hook_and_cli_load_no_kubernetes_client() -> None:
    code = ("import sys; import nvctk.cli.runtime, nvctk.cli.hook, nvctk.cli.main, "
            "nvctk.dra.kube; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('kubernetes', 'pydantic', 'urllib3')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
