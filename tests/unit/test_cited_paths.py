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


# --- modules and source files ----------------------------------------------------------------

# a dotted name of nvctk's (`nvctk.vgpu.ledger.read_usage`): a module, then attributes
MODULE = re.compile(r"(?<![\w./-])(nvctk(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# a source file of the tree by its path (`nvctk/hook/worker.py`, `libvgpu/src/shm.h`)
SOURCE = re.compile(r"(?<![\w/.-])((?:nvctk|libvgpu|bench|hooks|runtime_shim|cli)/[\w./-]*"
                    r"\.(?:py|c|h))\b")
# words of that shape that are not modules: domains, file names, and the tests' own examples
NOT_MODULES = frozenset({"nvctk.io", "nvctk.log", "nvctk.json", "nvctk.toml",
                         "nvctk.test", "nvctk.new", "nvctk.invalid", "nvctk.x.y", "nvctk.__file__",
                         # a module named as gone (docs/decisions.md; test_sys asserts it stays so)
                         "nvctk.ffi"})
NOT_SOURCES = frozenset({"nvctk/x/__init__.py"})  # test_layers.py's example of a path


def _resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_cited_module_and_source_file_exists() -> None:
    """Modules, functions and source files named in the texts (module docstrings, comments,
    READMEs, C files) are there: a rename leaves no citation behind."""
    missing: set[str] = set()
    seen = 0
    for pattern in TEXTS:
        for f in sorted(REPO.glob(pattern)):
            if "__pycache__" in f.parts or f == Path(__file__):
                continue
            text = f.read_text(errors="replace")
            where = str(f.relative_to(REPO))
            for name in set(MODULE.findall(text)) - NOT_MODULES:
                seen += 1
                if not _resolves(name.rstrip(".")):
                    missing.add(f"{where}: {name}")
            for path in set(SOURCE.findall(text)) - NOT_SOURCES:
                seen += 1
                # from the root, the citing file's dir, or nvctk's (`cli/common.py`)
                if not any((d / path).exists() for d in (REPO, f.parent, REPO / "nvctk")):
                    missing.add(f"{where}: {path}")
    assert seen > 100  # the scan reads what it should
    assert sorted(missing) == []


# --- libvgpu's own texts -----------------------------------------------------------------------

LIBVGPU = REPO / "libvgpu"
LIBVGPU_TEXTS = ("README.md", "src/*.c", "src/*.h", "include/*.h", "tests/*.c", "tests/*.py")
# a path inside libvgpu, as its texts write it (`src/shm.h`, `tests/vgpu_layout.c`)
LIBVGPU_SOURCE = re.compile(r"(?<![\w/.-])((?:src|include|tests)/[\w.-]+\.(?:c|h|py))\b")
# an nvctk source file cited, and a name in backquotes that nvctk defines at module level
NVCTK_SOURCE = re.compile(r"(?<![\w/.-])(nvctk/[\w/]+\.py)\b")
QUOTED_NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?`")


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^(?:def |class )?{name}\b(?:\s*[:=(]|\[)", path.read_text(), re.M) is not None


def _module_names() -> set[str]:
    """Names some nvctk module defines at module level (def, class, NAME = )."""
    out: set[str] = set()
    for f in (REPO / "nvctk").rglob("*.py"):
        out |= set(re.findall(r"^(?:def |class )?([A-Za-z_]\w*)\s*[:=(]", f.read_text(), re.M))
    return out


def test_libvgpu_texts_cite_what_is_there() -> None:
    """libvgpu's README and its C comments: the files they name relative to libvgpu/
    exist, and a name of nvctk's in backquotes (`SHM_LAYOUT`) is defined by a module the
    same paragraph cites (`nvctk/vgpu/ledger.py`): the layouts' and limits' other side is
    named where it is."""
    defined = _module_names()
    missing: list[str] = []
    seen = 0
    for pattern in LIBVGPU_TEXTS:
        for f in sorted(LIBVGPU.glob(pattern)):
            text = f.read_text(errors="replace")
            where = str(f.relative_to(REPO))
            for path in sorted(set(LIBVGPU_SOURCE.findall(text))):
                seen += 1
                if not any((d / path).exists() for d in (LIBVGPU, f.parent, REPO)):
                    missing.append(f"{where}: {path}")
            for para in re.split(r"\n\s*\n|\n\s*\*\s*\n", text):
                modules = [REPO / m for m in NVCTK_SOURCE.findall(para)]
                if not modules:
                    continue
                for name in set(QUOTED_NAME.findall(para)) & defined:
                    seen += 1
                    if not any(m.exists() and _defines(m, name) for m in modules):
                        missing.append(f"{where}: `{name}` is in none of "
                                       f"{', '.join(str(m.relative_to(REPO)) for m in modules)}")
    assert seen >= 3  # the scan reads what it should
    assert missing == []
