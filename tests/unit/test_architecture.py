"""docs/architecture.md holds the contract the code reads: every config key, every
environment variable nvctk's Python or libvgpu reads or writes by name, every annotation
it owns. A name added to the code and not to the contract fails here (read as text: the
string literals of nvctk/ but the simulated driver's, libvgpu's getenv and K_ names)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nvctk.base import config

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
ENV = re.compile(r"(?:NVIDIA|CUDA|NVCTK|LIBVGPU)_[A-Z0-9_]*")
ANNOTATION = re.compile(r"(?:nvctk\.io/|cdi\.k8s\.io/)[A-Za-z0-9._/-]*")
# literals that look like env names and are none: CUDA's own constants the sim's and
# libvgpu's ABI name, and the containerd editor's probe keys
NOT_CONTRACT = re.compile(r"CUDA_(ERROR_|SUCCESS|API_|ARRAY|LAUNCH|KERNEL|MEM_)|.*_H$")
PROBES = {"nvctk.io/x", "nvctk.io/vgpu.x"}


def _literals() -> set[str]:
    out: set[str] = set()
    for f in (REPO / "nvctk").rglob("*.py"):
        if "sim" in f.relative_to(REPO / "nvctk").parts[:1]:
            continue  # the hardware boundary: NVSIM_* and CUDA's ABI, not nvctk's contract
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def _c_names() -> set[str]:
    out: set[str] = set()
    for f in (REPO / "libvgpu" / "src").glob("*.[ch]"):
        text = f.read_text()
        out |= set(re.findall(r'getenv\("([A-Z0-9_]+)"\)', text))
        out |= set(re.findall(r'#define K_\w+ "([A-Z0-9_]+)"', text))
    return out


def env_names() -> list[str]:
    names = {s for s in _literals() | _c_names() if ENV.fullmatch(s)}
    return sorted(n for n in names if not NOT_CONTRACT.match(n))


def annotations() -> list[str]:
    return sorted(s for s in _literals() if ANNOTATION.fullmatch(s) and s not in PROBES)


def test_the_scan_finds_what_the_code_reads() -> None:
    """The scan itself: names the code is known to read are among what it finds."""
    assert {"NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_MEMORY_LIMIT", "NVCTK_CONFIG",
            "LIBVGPU_LOG_LEVEL", "NVCTK_VGPU_CONTEXT_RESERVE"} <= set(env_names())
    assert "nvctk.io/edits" in annotations()
    assert "hook-timeout" in config._DOC


@pytest.mark.parametrize("key", sorted(config._DOC))
def test_every_config_key_is_in_the_contract(key: str) -> None:
    assert f"`{key}`" in DOC.read_text(), f"config key {key} is not in docs/architecture.md"


def documented(name: str) -> bool:
    """`name` in the contract, whole or with its index (`NVCTK_VGPU_UUID_<i>`); a prefix the
    code reads (NVCTK_, nvctk.io/vgpu.) as the start of a documented name."""
    text = DOC.read_text()
    if name.endswith(("_", "/", ".")):
        return f"`{name}" in text
    return f"`{name}`" in text or f"`{name}_<" in text


@pytest.mark.parametrize("name", env_names())
def test_every_environment_variable_is_in_the_contract(name: str) -> None:
    assert documented(name), f"environment variable {name} is not in docs/architecture.md"


@pytest.mark.parametrize("name", annotations())
def test_every_annotation_is_in_the_contract(name: str) -> None:
    assert documented(name), f"annotation {name} is not in docs/architecture.md"


def test_the_design_lives_in_the_repository() -> None:
    """The README and the docs point at docs/architecture.md, never at a design outside."""
    readme = (REPO / "README.md").read_text()
    assert "docs/architecture.md" in readme
    for f in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        assert "DESIGN.md" not in f.read_text(), f"{f.name} points at a design outside"


def test_the_hook_launcher_agrees_with_the_python_it_talks_to() -> None:
    """hooks/nvctk-hook.c keeps three of the served prestart's values as #defines: each
    must be the Python side's (a drift would make the launcher miss the server)."""
    from nvctk.base.fileio import MAX_HOOK_STATE
    from nvctk.edits import SERVED_FLAG
    from nvctk.hook.served import NAME_PREFIX

    text = (REPO / "hooks" / "nvctk-hook.c").read_text()
    defines = dict(re.findall(r"^#define (NAME_PREFIX|MAX_STATE|SERVED_FLAG) (.+)$", text, re.M))
    assert defines == {"NAME_PREFIX": f'"{NAME_PREFIX.decode()}"',
                       "MAX_STATE": "(4 << 20)", "SERVED_FLAG": f'"{SERVED_FLAG}"'}
    assert MAX_HOOK_STATE == 4 << 20
