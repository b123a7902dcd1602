"""Issue 13 §2, the host's faults: NVML that cannot initialise (the driver unloaded:
/dev/nvidiactl gone, as during a driver upgrade) and a read-only vGPU state dir, each
through the real nvctk-runtime + runc on a simulated host of its own.

While the fault lasts: a container that asks for what the fault breaks is refused with
an error naming the cause in runc's log (what docker/ctr show), its config.json is the
original byte for byte, and nothing is left (state, mounts, runc processes); a
container that does not need the broken part starts as usual, and one that asks for
no GPU is never touched. Once the fault is lifted the next GPU container starts (no
error was cached).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from support import reliability as relkit

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, mounts)")]

GPU = "NVIDIA_VISIBLE_DEVICES=0"
CAP = "CUDA_DEVICE_MEMORY_LIMIT=512m"
LIST_GPUS = ["/bin/sh", "-c", "ls /dev | grep nvidia"]


def _log_errors(b: Path) -> str:
    """The error lines nvctk-runtime left in runc's JSON log (what containerd shows)."""
    path = b / "runc-log.json"
    lines = path.read_text().splitlines() if path.exists() else []
    return "\n".join(e["msg"] for e in map(json.loads, lines) if e.get("level") == "error")


def _refused(la: relkit.Lab, env: list[str], base: str, *words: str) -> None:
    b = la.bundle(None, env, base=base, args=LIST_GPUS)
    original = (b / "config.json").read_bytes()
    mounts = relkit.mounts_under(str(la.tmp))  # the test's own read-only bind, if any
    r = la.run(b)
    assert r.returncode != 0, r.stdout
    logged = _log_errors(b)
    assert all(w in logged for w in words), (words, logged, r.stderr)
    assert relkit.clean_failure(r.stderr) and relkit.clean_failure(logged), r.stderr
    assert (b / "config.json").read_bytes() == original
    assert la.listed() == [] and relkit.procs_mentioning(la.root) == []
    assert la.state_entries() == []
    assert relkit.mounts_under(str(la.tmp)) == mounts


def test_nvml_init_failure(make_sim: Any, tmp_path: Path, base: str) -> None:
    rounds = relkit.n(1, 10)
    sim = make_sim(gpus=1)
    ctl = Path(sim.dev_dir) / "nvidiactl"
    aside = tmp_path / "nvidiactl.aside"
    with relkit.lab(tmp_path, sim.config_path) as la:
        la.start_ok([GPU], base)  # fills the host cache: it must not hide the fault
        for _ in range(rounds):
            os.rename(ctl, aside)
            try:
                info = subprocess.run([relkit.NVCTK, "info"], env=la.env(),
                                      capture_output=True, text=True, timeout=60)
                assert info.returncode != 0, info.stdout
                assert "Driver Not Loaded" in info.stderr and "nvidiactl" in info.stderr
                assert relkit.clean_failure(info.stderr), info.stderr
                _refused(la, [GPU], base, "NVML", "Driver Not Loaded", "nvidiactl")
                _refused(la, [GPU, CAP], base, "NVML", "Driver Not Loaded")
                la.start_ok([], base, sees_gpu=False)
            finally:
                os.rename(aside, ctl)
            la.start_ok([GPU, CAP], base)
        la.gc()
        assert la.state_entries() == []
    relkit.record("fault", "NVML init fails (driver not loaded: no /dev/nvidiactl)",
                  injected=rounds, gpu_refused=2 * rounds, no_gpu_started=rounds,
                  started_after=rounds, leaks=0)


@contextmanager
def _read_only(path: str) -> Iterator[None]:
    subprocess.run(["mount", "--bind", path, path], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", path], check=True)
        yield
    finally:
        subprocess.run(["umount", path], check=True)


def test_read_only_state_dir(make_sim: Any, tmp_path: Path, base: str) -> None:
    rounds = relkit.n(1, 10)
    sim = make_sim(gpus=1)
    with relkit.lab(tmp_path, sim.config_path) as la:
        os.makedirs(la.state_dir, exist_ok=True)
        for _ in range(rounds):
            with _read_only(la.state_dir):
                # only a vGPU cap keeps state there; the host cache there is best effort
                _refused(la, [GPU, CAP], base, f"vGPU state dir {la.state_dir}",
                         "Read-only file system")
                la.start_ok([GPU], base)
                la.start_ok([], base, sees_gpu=False)
            assert relkit.mounts_under(la.state_dir) == []
            la.start_ok([GPU, CAP], base)
        la.gc()
        assert la.state_entries() == []
    relkit.record("fault", "vGPU state dir read-only", injected=rounds,
                  vgpu_refused=rounds, gpu_started=rounds, no_gpu_started=rounds,
                  started_after=rounds, leaks=0)
