"""The SM share is the container's, not a process's (issue 25, family 1): processes
that each make one launch of a long kernel and exit, one or two at a time, stay within
the share. Debt outlives the process that made it (the next process of the container
takes it over), and a launch of unknown cost is never free (a shape never seen
complete is waited for and charged before the launch call returns). Judged by the
simulated GPU's own busy counter over the run."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.sim.state import read_state
from support.libvgpu import driver_of

# shares measured over wall-clock windows: run alone (tests/README.md)
pytestmark = pytest.mark.exclusive

LIMIT = 25


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    return driver_of(tmp_path_factory, "vgpu-procshare")


def one_launch_each(env: dict[str, str], state: Path, parallel: int, seconds: float) -> tuple[float, int]:
    """`parallel` loops, each starting one process after another that makes one
    launch and exits, for `seconds`; returns the GPU's busy share (%) over the
    run and the number of processes that launched."""
    launched = [0] * parallel

    def loop(k: int) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            cp = subprocess.run([str(H.PROBE), "init", "ctx", "0", "launch", "1"], env=env,
                                capture_output=True, text=True, timeout=60)
            assert cp.returncode == 0, cp.stderr
            assert H.parse(cp.stdout)["launch"] == [["0", "1"]], cp.stdout
            launched[k] += 1

    # one process first, so the state file exists and the busy count starts from it
    subprocess.run([str(H.PROBE), "init", "ctx", "0"], env=env, check=True, capture_output=True)
    b0, t0 = read_state(state).gpus[0].busy_ns, time.monotonic()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b1, t1 = read_state(state).gpus[0].busy_ns, time.monotonic()
    return 100 * (b1 - b0) / ((t1 - t0) * 1e9), sum(launched)


@pytest.mark.slow
@pytest.mark.parametrize(("kernel_us", "parallel"), [(50000, 1), (50000, 2), (2000, 1), (2000, 2)])
def test_a_process_per_launch_stays_within_the_share(kernel_us: int, parallel: int, driver: H.Driver,
                                                     tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = driver.env(state, NVSIM_KERNEL_US=str(kernel_us), CUDA_DEVICE_SM_LIMIT=str(LIMIT),
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), LD_PRELOAD=str(H.LIB))
    if os.environ.get("NVSIM_ASYNC"):
        env["NVSIM_ASYNC"] = os.environ["NVSIM_ASYNC"]
    share, n = one_launch_each(env, state, parallel, seconds=4.0)
    assert n >= 4, n
    assert share <= LIMIT + 5, (f"{share:.1f} % of the GPU under a {LIMIT} % limit: {n} processes, one "
                                f"{kernel_us} us launch each, {parallel} at a time")
