"""bench/container_start.py runs end to end (one sample per case) and leaves nothing.

No timing is asserted: only that every case ran, NVIDIA's toolkit is skipped with a
message when absent (and measured when present), and no temp dir or mount remains.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "container_start.py"
NCT = REPO.parent / "shared" / "peers" / "nct"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.exclusive,  # a benchmark; compares the host's whole mount table
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (containers, mounts)"),
]


def _mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    out = tmp_path / "report.txt"
    work = tmp_path / "work"
    work.mkdir()
    # the bench's temp dir goes under work/ (TMPDIR), so leftovers are its own
    res = subprocess.run([sys.executable, str(BENCH), "-n", "1", "--out", str(out), *args],
                         env={**os.environ, "TMPDIR": str(work)},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    # (nvctk.sim.build keeps its compiled mocks in $TMPDIR/nvsim-cache: not the bench's)
    assert [p.name for p in work.iterdir() if p.name != "nvsim-cache"] == []
    assert str(work) not in _mounts()
    report = out.read_text()
    assert report.strip() == res.stdout.strip()
    return res, report


def test_bench_runs_and_skips_an_absent_nct(tmp_path: Path) -> None:
    _, report = _bench(tmp_path, "--nct", str(tmp_path / "no-such-nct"))
    assert f"NVIDIA Container Toolkit not found in {tmp_path / 'no-such-nct'}" in report
    for label in ("runc list", "nvctk-runtime list", "runc, no GPU", "nvctk-runtime, 1 GPU",
                  "nvctk-runtime, 1 GPU, caps=all", "nvctk-runtime, 8 GPUs",
                  "nvctk-runtime cdi mode, 1 GPU", "start nvctk 8 GPUs / 1 GPU",
                  "GPU start overhead nvctk cdi mode / legacy mode", "cdi mode minus legacy mode",
                  "every bundle (every case) carries a kubelet's binds"):
        assert label in report
    if shutil.which("podman"):
        assert "podman run, nvctk's CDI spec, 1 GPU" in report
    assert "NCT" not in report and "nvidia-container-runtime" not in report


@pytest.mark.skipif(not (NCT / "bin" / "nvidia-container-runtime").exists(),
                    reason=f"no NVIDIA Container Toolkit build in {NCT}")
def test_bench_measures_nct(tmp_path: Path) -> None:
    _, report = _bench(tmp_path, "--nct", str(NCT))
    for label in ("nvidia-container-runtime list", "NCT cdi, 1 GPU", "NCT jit-cdi, 1 GPU",
                  "GPU start overhead nvctk / NCT cdi", "passthrough overhead nvctk / NCT",
                  "GPU start overhead nvctk cdi mode / NCT cdi"):
        assert label in report
    assert "not found" not in report
    if shutil.which("podman"):
        assert "podman run with nvctk spec / with NCT spec" in report
