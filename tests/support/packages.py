"""The Debian package built from this tree, once per test run.

test_deb.py and test_packaging.py both need it, and pytest-xdist runs a session fixture
once per worker: the first worker to ask builds it, under a lock in the run's temp dir
(every worker's basetemp is a subdir of it), and the others take that build.
NVCTK_TEST_DEB names one built already (e.g. by `make deb`) instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = next(
    line.split('"')[1] for line in (REPO / "pyproject.toml").read_text().splitlines()
    if line.startswith("version = ")
)


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
    out = shared / "deb"
    with open(shared / "deb.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = list(out.glob("nvctk_*.deb"))
        if done:  # another worker built it (a failed build leaves no .deb: see below)
            return done[0]
        work = shared / "deb.build"
        shutil.rmtree(work, ignore_errors=True)
        r = _run(["bash", str(REPO / "packaging" / "deb" / "build.sh"), str(work)])
        assert r.returncode == 0, r.stdout + r.stderr
        (path,) = work.glob("nvctk_*.deb")
        assert r.stdout.strip() == str(path)
        arch = _run(["dpkg", "--print-architecture"]).stdout.strip()
        assert path.name == f"nvctk_{VERSION}_{arch}.deb"
        work.rename(out)  # whole or not at all
        return out / path.name
