"""A forked child is a new process to libvgpu (issue 25, family 2): whether made by
glibc's fork() (atfork handlers run) or by the raw fork system call (none run), it
holds nothing of its parent's — no lease, no slot, no SM bucket — and its allocations
and SM-limited launches are refused, so parent and children never together exceed the
memory cap or the SM share. Judged by the simulated GPU's own counters."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.sim.state import read_state
from support.libvgpu import driver_of

# shares measured over wall-clock windows: run alone (tests/README.md)
pytestmark = pytest.mark.exclusive

MIB = H.MIB


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    return driver_of(tmp_path_factory, "vgpu-fork")


@pytest.mark.parametrize("how", ["glibc", "raw"])
def test_forked_children_never_exceed_the_memory_cap(how: str, driver: H.Driver, tmp_path: Path) -> None:
    """3 children + the parent each ask for 384 MiB under one 512 MiB cap (the
    parent's context holds 64 MiB): only the parent's is granted, and the GPU's own
    count of the container's memory stays within the cap while all of them hold."""
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_LIMIT="512m",
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), LD_PRELOAD=str(H.LIB))
    p = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "forkrun", how, "3", "0", str(384 * MIB), "wait"],
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout and p.stdin
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    used = read_state(tmp_path / "state").gpus[0].mem_used  # all of them hold now
    p.stdin.write("\n")
    out, err = p.communicate(timeout=30)
    r = H.parse("".join(lines) + out)
    assert p.returncode == 0, err
    assert r["forkrun"] == [["0"]], r  # the parent's own allocation
    assert [c[0] for c in r["childalloc"]] == ["2"] * 3, r  # CUDA_ERROR_OUT_OF_MEMORY
    assert used <= 512 * MIB, f"{used / MIB:.0f} MiB on the GPU under a 512 MiB cap ({how} fork)"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["glibc", "raw"])
def test_forked_children_never_exceed_the_sm_share(how: str, driver: H.Driver, tmp_path: Path) -> None:
    """A parent under a 25 % SM limit launches, then forks 3 children that launch
    greedily: the GPU's busy time over the children's run stays within the share
    (their launches are refused: ungated they keep the GPU fully busy)."""
    state = tmp_path / "state"
    env = driver.env(state, CUDA_DEVICE_SM_LIMIT="25", NVSIM_KERNEL_US="2000",
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), LD_PRELOAD=str(H.LIB))
    t0, b0 = time.monotonic(), read_state(state).gpus[0].busy_ns if state.exists() else 0
    cp = subprocess.run([str(H.PROBE), "init", "ctx", "0", "launch", "3", "forkrun", how, "3", "2", "0"],
                        env=env, capture_output=True, text=True, timeout=60)
    t1, b1 = time.monotonic(), read_state(state).gpus[0].busy_ns
    assert cp.returncode == 0, cp.stderr
    r = H.parse(cp.stdout)
    assert len(r["childlaunch"]) == 3, r
    share = 100 * (b1 - b0) / ((t1 - t0) * 1e9)
    assert share <= 30, f"{share:.1f} % of the GPU under a 25 % limit ({how} fork): {r['childlaunch']}"
    assert all(c[0] == "800" for c in r["childlaunch"]), r  # CUDA_ERROR_NOT_PERMITTED
