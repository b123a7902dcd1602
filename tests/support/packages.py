"""The Debian package and the node image built from this tree, once per test run.

test_deb.py, test_packaging.py and test_daemonsets.py need them, and pytest-xdist runs a
session fixture once per worker: the first worker to ask builds each, under a lock in the
run's temp dir (every worker's basetemp is a subdir of it), and the others take that
build. NVCTK_TEST_DEB / NVCTK_TEST_IMAGE name ones built already (`make deb`, `make
image`) instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = next(
    line.split('"')[1] for line in (REPO / "pyproject.toml").read_text().splitlines()
    if line.startswith("version = ")
)
IMAGE = f"localhost/nvctk:{VERSION}"  # what `make image` names the one image


def run_dir(factory: pytest.TempPathFactory) -> Path:
    """The temp dir every process of this run (each xdist worker) shares."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def built_deb(shared: Path) -> Path:
    """packaging/deb/build.sh's .deb, built at most once under `shared`. Callers copy it
    before they write beside it."""
    given = os.environ.get("NVCTK_TEST_DEB")
    if given:
        return Path(given)
    for tool in ("dpkg-deb", "make"):
        if not shutil.which(tool):
            pytest.skip(f"needs {tool}")
    if _run(["/usr/bin/python3", "-m", "pip", "--version"]).returncode != 0:
        pytest.skip("needs pip for /usr/bin/python3 (python3-pip)")

    def build(work: Path) -> Path:
        r = _run(["bash", str(REPO / "packaging" / "deb" / "build.sh"), str(work)])
        assert r.returncode == 0, r.stdout + r.stderr
        (path,) = work.glob("nvctk_*.deb")
        assert r.stdout.strip() == str(path)
        arch = _run(["dpkg", "--print-architecture"]).stdout.strip()
        assert path.name == f"nvctk_{VERSION}_{arch}.deb"
        return path

    return _once(shared, "deb", "nvctk_*.deb", build)


def built_image(shared: Path) -> Path:
    """packaging/image/build.sh's OCI archive (localhost/nvctk:VERSION), built at most
    once under `shared` from built_deb's package; skips, saying why, where the Debian
    mirror (debootstrap's base) cannot be reached."""
    given = os.environ.get("NVCTK_TEST_IMAGE")
    if given:
        return Path(given)
    if not shutil.which("umoci"):
        pytest.skip("needs umoci (make apt)")
    deb = built_deb(shared)

    def build(work: Path) -> Path:
        work.mkdir(parents=True)
        shutil.copy(deb, work)
        base = _run(["bash", str(REPO / "packaging" / "debian-base.sh"), "base"], timeout=900)
        if base.returncode == 3:
            pytest.skip(f"no Debian mirror: {base.stderr.strip()}")
        r = _run(["bash", str(REPO / "packaging" / "image" / "build.sh"), str(work)],
                 timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (work / "nvctk-image.name").read_text().strip() == IMAGE
        return Path(r.stdout.strip())

    return _once(shared, "image", "nvctk-image.tar", build)


def _once(shared: Path, what: str, pattern: str, build: Callable[[Path], Path]) -> Path:
    """build(work dir) once per run under `shared`/what (a lock; the dir renamed into
    place whole, so a failed build leaves nothing another worker would take)."""
    out = shared / what
    with open(shared / f"{what}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = list(out.glob(pattern))
        if done:  # another worker built it
            return done[0]
        work = shared / f"{what}.build"
        shutil.rmtree(work, ignore_errors=True)
        path = build(work)
        work.rename(out)  # whole or not at all
        return out / path.name
