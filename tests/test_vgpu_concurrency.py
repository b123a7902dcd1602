"""One cap shared by many processes: concurrency and faults (SIGKILL mid
allocation, death while holding the accounting lock)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libvgpu" / "tests"))
import harness as H

from nvctk import vgpu
from nvctk.sim.state import read_state

MIB = H.MIB


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    H.build()
    return H.make_driver(tmp_path_factory.mktemp("vgpu-conc"), gpus=1, memory_mib=8192)


def churn_env(driver: H.Driver, tmp_path: Path, cap: str = "256m") -> dict[str, str]:
    return {
        **driver.env(tmp_path / "state", NVSIM_CONTEXT_RESERVE_MIB="1"),
        "NVCTK_VGPU_CONTEXT_RESERVE": "1m",
        "CUDA_DEVICE_MEMORY_LIMIT": cap,
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache"),
        "LD_PRELOAD": str(H.LIB),
    }


def container_used(tmp_path: Path) -> int:
    return sum(u.used for u in vgpu.read_usage(tmp_path / "cache").values())


def test_32_processes_x_1000_never_exceed_the_cap(driver: H.Driver, tmp_path: Path) -> None:
    env = churn_env(driver, tmp_path)
    cap = 256 * MIB
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        # the GPU memory the container's live processes hold, as the mock counts
        # it (an exited process's context stays charged until the mock reaps it)
        while not stop.is_set():
            try:
                live = read_state(tmp_path / "state", live_only=True).procs
                peak[0] = max(peak[0], sum(p.mem_used for p in live))
            except (OSError, ValueError):
                pass
            time.sleep(0.001)

    t = threading.Thread(target=watch)
    t.start()
    procs = [
        subprocess.Popen([str(H.STRESS), "churn", "1000", "16", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(32)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    stop.set()
    t.join()
    assert [p.returncode for p in procs] == [0] * 32, outs
    refused = sum(int(o.split()[2]) for o in outs)
    assert refused > 0, "the cap was never reached: the test proves nothing"
    assert 0 < peak[0] <= cap
    assert container_used(tmp_path) == 0
    assert sum(p.mem_used for p in read_state(tmp_path / "state", live_only=True).procs) == 0


def test_sigkill_mid_allocation_leaks_nothing(driver: H.Driver, tmp_path: Path) -> None:
    env = churn_env(driver, tmp_path)
    rnd = random.Random(7)
    procs = [
        subprocess.Popen([str(H.STRESS), "churn", "100000000", "16", str(i)], env=env, stdout=subprocess.DEVNULL)
        for i in range(8)
    ]
    time.sleep(0.5)
    for p in procs:
        time.sleep(rnd.random() * 0.05)
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
    # the dead members' usage is reclaimed: a newcomer gets the whole cap
    env.pop("LD_PRELOAD")
    r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB)).stdout)
    assert int(r["fill"][0][1]) == 255 * MIB
    assert container_used(tmp_path) == 0


def test_death_holding_the_lock_hangs_nobody(driver: H.Driver, tmp_path: Path) -> None:
    env = churn_env(driver, tmp_path)
    env.pop("LD_PRELOAD")
    assert H.probe(env, "init").returncode == 0  # creates the accounting file
    holder = subprocess.Popen([str(H.STRESS), "churn", "100000000", "16", "1"], env={**env, "LD_PRELOAD": str(H.LIB)},
                              stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    out = subprocess.run([str(H.STRESS), "lockdie", str(tmp_path / "cache")], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "locked" and out.returncode == -signal.SIGKILL
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    t0 = time.monotonic()
    r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB), timeout=20).stdout)
    assert time.monotonic() - t0 < 10
    assert int(r["fill"][0][1]) == 255 * MIB
