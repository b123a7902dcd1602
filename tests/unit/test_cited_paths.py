"""Every test file the README, the docs, libvgpu's README and the docstrings and comments
of the tree cite (`tests/....py`) exists: a renamed or moved test leaves no reference
behind. A path is taken from the repository root; one under another directory
(`libvgpu/tests/harness.py`) is that directory's, and checked as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXTS = ("README.md", "tests/README.md", "libvgpu/README.md", "docs/**/*.md", "nvctk/**/*.py",
         "nvctk/**/*.c", "nvctk/**/*.h", "libvgpu/**/*.c", "libvgpu/**/*.h", "tests/**/*.py",
         "bench/**/*.py", "hooks/*.c", "runtime_shim/*.c", "cli/*.c")
# a path that starts a name: not the tail of another path (libvgpu/tests/x.py)
CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*tests/[\w./-]+\.py)\b")


def cited_paths(text: str) -> list[str]:
    return CITED.findall(text)


def citations() -> list[tuple[str, str]]:
    out = []
    for pattern in TEXTS:
        for f in sorted(REPO.glob(pattern)):
            if "__pycache__" in f.parts or f == Path(__file__):
                continue
            for p in cited_paths(f.read_text(errors="replace")):
                out.append((str(f.relative_to(REPO)), p))
    return out


def test_every_cited_test_path_exists() -> None:
    found = citations()
    assert len(found) > 20  # the scan reads the texts it should
    missing = sorted({f"{where}: {p}" for where, p in found if not (REPO / p).exists()})
    assert missing == []


@pytest.mark.parametrize(("text", "want"), [
    ("see tests/unit/test_x.py for it", ["tests/unit/test_x.py"]),
    ("(libvgpu/tests/harness.py: the library)", ["libvgpu/tests/harness.py"]),
    ("`tests/integration/test_y.py::test_z`", ["tests/integration/test_y.py"]),
    ("tests/README.md and tests/ alone", []),
])
def test_citations_are_found(text: str, want: list[str]) -> None:
    assert cited_paths(text) == want
