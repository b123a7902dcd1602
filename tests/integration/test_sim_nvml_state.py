"""The simulated driver's shared state: NVML's API list and exports, the state layout
against C's offsetof(), memory charged across processes, racing initialisation, kernels
and utilization, board readings and GPM moving with load. How everything is built and
each check runs: tests/support/simnvml.py; the rest: test_sim_nvml_pynvml.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import support.simnvml as _simnvml
from nvctk.sim import apilist, state
from nvctk.sim.topology import make_topology
from support import wait
from support.devnodes import make_dev
from support.simdriver import build_sim_driver
from support.simnvml import GPU1, GPU_MIB, MIB, Helper, Sim, run_py

sim, state_file, helpers = _simnvml.sim, _simnvml.state_file, _simnvml.helpers  # fixtures

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


# ---- shared state ----


# go-nvml looks these up on every host (NVIDIA's toolkit, the device plugin)
GO_NVML_NAMES = (
    "nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetGridLicensableFeatures_v2",
    "nvmlDeviceGetGridLicensableFeatures_v3", "nvmlDeviceGetGridLicensableFeatures_v4",
    # (nvmlEventSetWait_v2 was here until the sim implemented event sets)
    "nvmlGpuInstanceGetComputeInstancePossiblePlacements", "nvmlDeviceGetAttributes_v2",
    "nvmlComputeInstanceGetInfo_v2",
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2", "nvmlVgpuInstanceGetLicenseInfo_v2",
)


def test_api_list_is_nvml_of_driver_550() -> None:
    names = apilist.names("nvml")
    assert list(names) == sorted(set(names)) and len(names) > 340
    for n in (*GO_NVML_NAMES, "nvmlInit", "nvmlInit_v2", "nvmlDeviceGetCount_v2", "nvmlErrorString"):
        assert n in names, n
    assert "nvmlDeviceGetDriverModel_v2" not in names  # after driver 550


def test_every_nvml_name_is_exported(sim: Sim, state_file: Path) -> None:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(sim.lib / "libnvidia-ml.so.1")],
        capture_output=True, text=True, check=True,
    ).stdout
    exports = {f[2]: f[1] for f in (line.split() for line in out.splitlines()) if len(f) == 3}
    missing = set(apilist.names("nvml")) - exports.keys()
    assert not missing, sorted(missing)[:20]
    for n in ("nvmlInit_v2", "nvmlDeviceGetCount_v2", "nvmlDeviceGetMemoryInfo", "nvmlErrorString"):
        assert exports[n] == "T", n  # implemented, not replaced by a stub
    # a stub answers NOT_SUPPORTED (3), through plain dlsym as go-nvml calls it
    got = run_py(
        sim,
        f"""
        import ctypes
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        out = [getattr(lib, n)(None, None, None) for n in {GO_NVML_NAMES!r}]
        out.append(lib.nvmlDeviceGetFanSpeed(None, None))
        """,
        state_file,
    )
    assert got == [3] * (len(GO_NVML_NAMES) + 1)


def test_state_layout_matches_c(sim: Sim) -> None:
    out = subprocess.run([str(sim.offsets)], capture_output=True, text=True, check=True).stdout
    c = {k: int(v) for k, v in (line.rsplit(" ", 1) for line in out.splitlines())}
    assert c == state.OFFSETS


PROCS = """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
m = pynvml.nvmlDeviceGetMemoryInfo(h)
out = {
    "used": m.used,
    "procs": sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId]
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
}
"""


def test_state_shared_between_processes(sim: Sim, state_file: Path, helpers: list[Helper]) -> None:
    a = Helper(sim, state_file, "charge", 0, 100 * MIB, "charge", 1, 7 * MIB)
    b = Helper(sim, state_file, "charge", 0, 200 * MIB, "credit", 0, 50 * MIB)
    helpers += [a, b]
    na = 0xFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE: not a MIG device
    out = run_py(sim, PROCS, state_file)
    assert out == {
        "used": 250 * MIB,
        "procs": sorted([[a.pid, 100 * MIB, na], [b.pid, 150 * MIB, na]]),
    }
    s = state.read_state(state_file)
    assert [g.mem_used for g in s.gpus] == [250 * MIB, 7 * MIB]
    assert [g.mem_total for g in s.gpus] == [GPU_MIB * MIB] * 2
    assert {(p.pid, p.gpu, p.mem_used) for p in s.procs} == {
        (a.pid, 0, 100 * MIB),
        (a.pid, 1, 7 * MIB),
        (b.pid, 0, 150 * MIB),
    }
    assert s.proc(a.pid, 1) is not None
    # a process that dies (no clean-up at all) has its memory credited back
    a.kill()
    s = state.read_state(state_file)
    assert {p.pid for p in s.procs} == {a.pid, b.pid}  # not reaped yet
    assert {p.pid for p in state.read_state(state_file, live_only=True).procs} == {b.pid}
    out = run_py(sim, PROCS, state_file)
    assert out == {"used": 150 * MIB, "procs": [[b.pid, 150 * MIB, na]]}
    s = state.read_state(state_file)
    assert [g.mem_used for g in s.gpus] == [150 * MIB, 0]
    assert [p.pid for p in s.procs] == [b.pid]
    assert b.close() == 0


def test_charge_beyond_total_fails(sim: Sim, state_file: Path, helpers: list[Helper]) -> None:
    helpers.append(Helper(sim, state_file, "charge", 0, (GPU_MIB - 10) * MIB))
    r = subprocess.run(
        [str(sim.helper), "charge", "0", str(20 * MIB)],
        env=sim.env(state_file),
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )
    assert r.returncode == 4
    ok = Helper(sim, state_file, "charge", 0, 10 * MIB)  # exactly full is fine
    helpers.append(ok)
    assert state.read_state(state_file).gpus[0].mem_used == GPU_MIB * MIB


def test_racing_initialisation(sim: Sim, state_file: Path) -> None:
    """Many processes open a fresh state file at once: one initialises, none
    wipes another's charge."""
    n = 12
    procs = [
        subprocess.Popen(
            [str(sim.helper), "charge", "1", str(MIB)],
            env=sim.env(state_file),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        s = state.read_state(state_file)
        assert s.gpus[1].mem_used == n * MIB
        assert len(s.procs_on(1)) == n
    finally:
        for p in procs:
            p.kill()
            p.wait()


UTIL = """
h = pynvml.nvmlDeviceGetHandleByIndex(1)
samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
out = {"util": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
       "samples": [[s.pid, s.smUtil] for s in samples]}
"""


def test_kernels_counted_and_utilization(sim: Sim, state_file: Path, helpers: list[Helper]) -> None:
    # 1 ms kernels back to back for ~0.8 s, sampled while they run
    n = 800
    h = Helper(sim, state_file, "kernels", 1, n, wait=False)
    helpers.append(h)
    # sampled once 150 of them (150 ms of busy time) are done
    def kernels() -> int:  # no state file (or an empty one) before the helper's first call
        try:
            return state.read_state(state_file).gpus[1].kernels
        except (OSError, state.StateError):
            return 0

    wait.until(lambda: kernels() >= 150, 30, "the helper's first 150 kernels")
    out = run_py(sim, UTIL, state_file)
    assert out["util"] >= 60
    assert [pid for pid, _ in out["samples"]] == [h.pid]
    h.wait_ready()
    s = state.read_state(state_file)
    assert (s.gpus[1].kernels, s.gpus[1].busy_ns) == (n, n * 1_000_000)
    slot = s.proc(h.pid, 1)
    assert slot is not None and (slot.kernels, slot.busy_ns) == (n, n * 1_000_000)
    assert s.gpus[0].kernels == 0
    # idle: the window decays towards zero
    wait.until(lambda: run_py(sim, UTIL, state_file)["util"] <= 40, 30, "utilization to decay")


BOARD = """
import time
h = pynvml.nvmlDeviceGetHandleByIndex(1)
def board():
    return {"temp": pynvml.nvmlDeviceGetTemperature(h, 0), "power": pynvml.nvmlDeviceGetPowerUsage(h),
            "energy": pynvml.nvmlDeviceGetTotalEnergyConsumption(h),
            "sm_clock": pynvml.nvmlDeviceGetClockInfo(h, 1), "mem_clock": pynvml.nvmlDeviceGetClockInfo(h, 2),
            "max_sm": pynvml.nvmlDeviceGetMaxClockInfo(h, 1),
            "tx": pynvml.nvmlDeviceGetPcieThroughput(h, 0), "rx": pynvml.nvmlDeviceGetPcieThroughput(h, 1),
            "replays": pynvml.nvmlDeviceGetPcieReplayCounter(h),
            "ecc": [pynvml.nvmlDeviceGetTotalEccErrors(h, e, 0) for e in (0, 1)],
            "rows": list(pynvml.nvmlDeviceGetRemappedRows(h)),
            "enc": list(pynvml.nvmlDeviceGetEncoderUtilization(h))}
a = pynvml.nvmlGpmSampleAlloc()
b = pynvml.nvmlGpmSampleAlloc()
pynvml.nvmlGpmSampleGet(h, a)
first = board()
time.sleep(SPAN)  # the span GPM's rates cover, not a synchronisation
pynvml.nvmlGpmSampleGet(h, b)
m = pynvml.c_nvmlGpmMetricsGet_t()
m.version = pynvml.NVML_GPM_METRICS_GET_VERSION
ids = [1, 2, 3, 5, 10, 20, 21, 7]
m.numMetrics = len(ids)
m.sample1, m.sample2 = a, b
for i, mid in enumerate(ids):
    m.metrics[i].metricId = mid
pynvml.nvmlGpmMetricsGet(m)
mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(0), 0)
errors = {}
for name, call in (("temp", lambda: pynvml.nvmlDeviceGetTemperature(mig, 0)),
                   ("power", lambda: pynvml.nvmlDeviceGetPowerUsage(mig)),
                   ("clock", lambda: pynvml.nvmlDeviceGetClockInfo(mig, 1))):
    try:
        call()
    except pynvml.NVMLError as e:
        errors[name] = e.value
out = {"first": first, "last": board(), "errors": errors,
       "gpm": pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice,
       "metrics": {ids[i]: [m.metrics[i].nvmlReturn, m.metrics[i].value] for i in range(len(ids))}}
pynvml.nvmlGpmSampleFree(a)
pynvml.nvmlGpmSampleFree(b)
"""


@pytest.mark.exclusive  # a busy fraction over wall time
def test_board_readings_move_with_load(sim: Sim, state_file: Path, helpers: list[Helper]) -> None:
    """Temperature, power, energy, SM clock, PCIe traffic and GPM's metrics of an idle
    GPU, then of one running kernels back to back and holding half its memory: each one
    higher under load (energy always growing), the error counters zero, the memory clock
    steady; MIG device handles answer NOT_SUPPORTED, as NVML's do."""
    idle = run_py(sim, BOARD.replace("SPAN", "0.3"), state_file)
    helpers.append(Helper(sim, state_file, "charge", 1, GPU1.memory_mib * MIB // 2,
                          "kernels", 1, 3000, wait=False))
    wait.until(lambda: state.read_state(state_file).gpus[1].kernels >= 100, 30, "kernels running")
    busy = run_py(sim, BOARD.replace("SPAN", "0.3"), state_file)
    i, b = idle["last"], busy["first"]
    assert i["temp"] < b["temp"] <= 80 and i["power"] < b["power"] <= 700_000
    assert i["sm_clock"] < b["sm_clock"] == i["max_sm"] and i["mem_clock"] == b["mem_clock"]
    assert i["tx"] < b["tx"] and i["rx"] < b["rx"]
    assert idle["first"]["energy"] <= i["energy"] < b["energy"] <= busy["last"]["energy"]
    assert (b["replays"], b["ecc"], b["rows"], b["enc"][0]) == (0, [0, 0], [0, 0, 0, 0], 0)
    assert idle["gpm"] == 1
    im, bm = idle["metrics"], busy["metrics"]
    for mid in ("1", "2", "3", "5", "10"):  # percentages: none idle, some busy
        assert im[mid] == [0, 0.0] and bm[mid][0] == 0 and 5 < bm[mid][1] <= 100, (mid, bm[mid])
    assert bm["21"][1] > im["21"][1] > 0  # PCIe rx, MiB/s
    assert bm["7"][0] == 3  # a metric the sim does not model: NOT_SUPPORTED
    assert idle["errors"] == {"temp": 3, "power": 3, "clock": 3}


GPM_ABSENT = """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
s = pynvml.nvmlGpmSampleAlloc()
try:
    pynvml.nvmlGpmSampleGet(h, s)
    got = 0
except pynvml.NVMLError as e:
    got = e.value
out = {"supported": pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice, "sample": got,
       "temp": pynvml.nvmlDeviceGetTemperature(h, 0)}
"""


def test_gpm_only_from_hopper_on(tmp_path: Path) -> None:
    """An Ampere GPU (cc 8.0) has the board readings but no GPM: support says 0 and a
    sample is NOT_SUPPORTED, as on a real A100."""
    topo = make_topology(1, product="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), seed="ampere")
    _, lib, _ = build_sim_driver(tmp_path, topo)
    dev = make_dev(tmp_path / "dev", topo, [0])
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "NVSIM_DEV_DIR": str(dev),
           "NVSIM_STATE": str(tmp_path / "state")}
    script = "import json, pynvml\npynvml.nvmlInit()\n" + GPM_ABSENT + "\nprint(json.dumps(out))\n"
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["supported"] == 0 and out["sample"] == 3 and out["temp"] >= 30
