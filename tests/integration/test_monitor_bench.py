"""bench/monitor.py runs end to end (2 samples, 4 containers per GPU, a 4 s soak with
containers coming and going) and leaves nothing: no process, no cgroup, no temp dir. No
timing or memory figure is asserted (they go to bench/results/monitor.txt)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "monitor.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.exclusive,  # a benchmark (times and memory of the whole run)
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim device nodes, cgroups)"),
]


def test_bench_monitor_runs_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "report.txt"
    work = tmp_path / "work"
    work.mkdir()
    p = subprocess.Popen([sys.executable, str(BENCH), "-n", "2", "--per-gpu", "4", "--soak", "4",
                          "--out", str(out)],
                         env={**os.environ, "TMPDIR": str(work)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log
    text = out.read_text()
    assert "32 containers, 32 GPU processes" in text
    for what in ("collect (NVML", "render a new snapshot", "scrape of an unchanged snapshot",
                 "/metrics over HTTP", "resident memory", "containers ended and replaced",
                 "soak resident memory", "scrape as Prometheus asks (OpenMetrics, gzip)",
                 "gzip'd", "shipped arguments (deployments/monitor.yaml): --interval 5, --compat dcgm,hami"):
        assert what in text, what
    assert [p.name for p in work.iterdir() if p.name != "nvsim-cache"] == []
    left = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if "nvctk-bench" in line]
    assert not left
    name = f"nvctk-bench-{p.pid}"  # the bench's cgroup, in whichever hierarchy it used
    assert not (Path("/sys/fs/cgroup") / name).exists()
    assert not [d for d in Path("/sys/fs/cgroup").iterdir() if (d / name).exists()]
