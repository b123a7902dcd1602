"""nvctk.caps under the bounding sets runtimes really start hooks with."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvctk import caps

REPO = Path(__file__).resolve().parent.parent
KEEP = sorted(caps.needed(caps.STEP_CAPS))


def _in_bounding_set(keep: list[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run python code as root whose bounding set (so its permitted set) is just keep."""
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("capsh (libcap2-bin) is not installed")
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    drop = [f"cap_{n}" for n, num in caps.NUMBERS.items() if num <= last and n not in keep]
    script = f"import sys; sys.path.insert(0, {str(REPO)!r}); {code}"
    return subprocess.run(
        [capsh, f"--drop={','.join(drop)}", "--", "-c", 'exec "$0" -c "$1"', sys.executable,
         script], capture_output=True, text=True)


def test_restrict_within_an_already_reduced_bounding_set() -> None:
    """containerd run with CapabilityBoundingSet=: no CAP_SETPCAP, nothing left to drop;
    restricting to what is already there must not fail."""
    assert "setpcap" not in KEEP
    code = (f"from nvctk import caps; caps.restrict({KEEP!r}); "
            "print(','.join(caps.current(caps.CAP_PERMITTED)))")
    r = _in_bounding_set(KEEP, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(KEEP)


def test_restrict_cannot_keep_more_than_the_bounding_set_allows() -> None:
    code = (f"from nvctk import caps; caps.restrict({KEEP!r}); "
            "print(','.join(caps.current(caps.CAP_PERMITTED)))")
    r = _in_bounding_set(KEEP[:-1], code)  # one of them is not there to keep
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(KEEP[:-1])
