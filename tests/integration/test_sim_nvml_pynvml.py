"""The simulated driver: real pynvml over the mock NVML (values, errors, MIG devices) and
the /dev rule (which GPUs a process sees by its device nodes). How everything is built and
each check runs: tests/support/simnvml.py. nvidia-smi and the build:
test_sim_nvml_smi.py; the state shared between processes: test_sim_nvml_state.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import support.simnvml as _simnvml
from support.devnodes import make_dev
from support.simnvml import GPU0, GPU1, GPU_MIB, MIB, MIG0, MIG1, TOPO, Sim, run_py, smi

sim, state_file = _simnvml.sim, _simnvml.state_file  # fixtures

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


# ---- pynvml over the mock ----

PYNVML_ALL = """
out = {}
def s(v):  # pynvml's structs turn char arrays into str, plain ctypes gives bytes
    return v.decode() if isinstance(v, bytes) else v
h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
out["driver"] = pynvml.nvmlSystemGetDriverVersion()
out["nvml_version"] = pynvml.nvmlSystemGetNVMLVersion()
out["cuda"] = pynvml.nvmlSystemGetCudaDriverVersion()
out["cuda_v2"] = pynvml.nvmlSystemGetCudaDriverVersion_v2()
out["count"] = pynvml.nvmlDeviceGetCount()
out["names"] = [pynvml.nvmlDeviceGetName(h) for h in (h0, h1)]
out["uuids"] = [pynvml.nvmlDeviceGetUUID(h) for h in (h0, h1)]
out["minors"] = [pynvml.nvmlDeviceGetMinorNumber(h) for h in (h0, h1)]
out["index"] = [pynvml.nvmlDeviceGetIndex(h) for h in (h0, h1)]
pci = pynvml.nvmlDeviceGetPciInfo(h1)
out["pci"] = [s(pci.busId), s(pci.busIdLegacy), pci.domain, pci.bus, pci.device]
out["cc"] = list(pynvml.nvmlDeviceGetCudaComputeCapability(h0))
out["brand"] = pynvml.nvmlDeviceGetBrand(h0)
m = pynvml.nvmlDeviceGetMemoryInfo(h0)
out["mem"] = [m.total, m.used, m.free]
m = pynvml.nvmlDeviceGetMemoryInfo(h0, version=pynvml.nvmlMemory_v2)
out["mem_v2"] = [m.total, m.reserved, m.used, m.free]
out["by_uuid"] = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(out["uuids"][1]))
out["by_uuid_lower"] = pynvml.nvmlDeviceGetIndex(
    pynvml.nvmlDeviceGetHandleByUUID(out["uuids"][1].lower()))
out["by_pci"] = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(out["pci"][0]))
out["by_pci_short"] = pynvml.nvmlDeviceGetIndex(
    pynvml.nvmlDeviceGetHandleByPciBusId(out["pci"][1].lower()))
out["mig_mode"] = [list(pynvml.nvmlDeviceGetMigMode(h)) for h in (h0, h1)]
out["max_mig"] = [pynvml.nvmlDeviceGetMaxMigDeviceCount(h) for h in (h0, h1)]
out["is_mig"] = int(pynvml.nvmlDeviceIsMigDeviceHandle(h0).value)
migs = []
for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h0)):
    try:
        mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, i)
    except pynvml.NVMLError_NotFound:
        continue
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mh)
    mm = pynvml.nvmlDeviceGetMemoryInfo(mh)
    migs.append({
        "uuid": pynvml.nvmlDeviceGetUUID(mh),
        "name": pynvml.nvmlDeviceGetName(mh),
        "gi": pynvml.nvmlDeviceGetGpuInstanceId(mh),
        "ci": pynvml.nvmlDeviceGetComputeInstanceId(mh),
        "is_mig": int(pynvml.nvmlDeviceIsMigDeviceHandle(mh).value),
        "parent_uuid": pynvml.nvmlDeviceGetUUID(parent),
        "mem_total": mm.total,
        "by_uuid": pynvml.nvmlDeviceGetUUID(
            pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(mh))),
        "pci": s(pynvml.nvmlDeviceGetPciInfo(mh).busId),
    })
out["migs"] = migs
p = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h0, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE)
out["profile_v2"] = [p.id, p.sliceCount, p.instanceCount, p.memorySizeMB, s(p.name)]
p = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
    h0, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, version=1)
out["profile_v1"] = [p.id, p.sliceCount, p.memorySizeMB]
u = pynvml.nvmlDeviceGetUtilizationRates(h1)
out["util"] = [u.gpu, u.memory]
out["procs"] = [len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)) for h in (h0, h1)]
out["gfx"] = len(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h0))
out["err"] = pynvml.nvmlErrorString(pynvml.NVML_ERROR_NOT_FOUND)
errs = {}
for key, fn in {
    "index_out_of_range": lambda: pynvml.nvmlDeviceGetHandleByIndex(2),
    "unknown_uuid": lambda: pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-0"),
    "unknown_pci": lambda: pynvml.nvmlDeviceGetHandleByPciBusId("00000000:99:00.0"),
    "mig_on_non_mig_gpu": lambda: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h1, 0),
    "gi_of_gpu": lambda: pynvml.nvmlDeviceGetGpuInstanceId(h0),
    "minor_of_mig": lambda: pynvml.nvmlDeviceGetMinorNumber(
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)),
    "parent_of_gpu": lambda: pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h0),
    "unexported": lambda: pynvml.nvmlDeviceGetDriverModel_v2(h0),  # after driver 550
    "stub": lambda: pynvml.nvmlDeviceGetFanSpeed(h0),  # an SXM board has no fan to report
    "process_util_idle": lambda: pynvml.nvmlDeviceGetProcessUtilization(h1, 0),
}.items():
    try:
        fn()
        errs[key] = None
    except pynvml.NVMLError as e:
        errs[key] = e.value
out["errors"] = errs
"""


@pytest.fixture(scope="module")
def nvml_all(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    st = tmp_path_factory.mktemp("nvml_all") / "state"
    result: dict[str, Any] = run_py(sim, PYNVML_ALL, st)
    return result


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("driver", TOPO.driver_version),
        ("nvml_version", f"12.{TOPO.driver_version}"),
        ("cuda", TOPO.cuda_version_int),
        ("cuda_v2", TOPO.cuda_version_int),
        ("count", 2),
        ("names", [GPU0.name, GPU1.name]),
        ("uuids", [GPU0.uuid, GPU1.uuid]),
        ("minors", [GPU0.minor, GPU1.minor]),
        ("index", [0, 1]),
        ("pci", [GPU1.pci_bus_id, GPU1.pci_bus_id[4:], 0, int(GPU1.pci_bus_id[9:11], 16), 0]),
        ("cc", list(GPU0.compute_capability)),
        ("brand", 14),  # NVML_BRAND_NVIDIA
        ("mem", [GPU_MIB * MIB, 0, GPU_MIB * MIB]),
        ("mem_v2", [GPU_MIB * MIB, 0, 0, GPU_MIB * MIB]),
        ("by_uuid", 1),
        ("by_uuid_lower", 1),
        ("by_pci", 1),
        ("by_pci_short", 1),
        ("mig_mode", [[1, 1], [0, 0]]),
        ("max_mig", [7, 7]),
        ("is_mig", 0),
        ("profile_v2", [14, 2, 3, 19968, "MIG 2g.20gb"]),
        ("profile_v1", [19, 1, 9856]),
        ("util", [0, 0]),
        ("procs", [0, 0]),
        ("gfx", 0),
        ("err", "Not Found"),
    ],
)
def test_pynvml_values(nvml_all: dict[str, Any], key: str, expected: Any) -> None:
    assert nvml_all[key] == expected


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ("index_out_of_range", 2),  # INVALID_ARGUMENT
        ("unknown_uuid", 6),  # NOT_FOUND
        ("unknown_pci", 6),
        ("mig_on_non_mig_gpu", 2),  # MIG mode off
        ("gi_of_gpu", 3),  # NOT_SUPPORTED
        ("minor_of_mig", 3),
        ("parent_of_gpu", 2),
        ("unexported", 13),  # FUNCTION_NOT_FOUND: pynvml's own, not in 550's NVML
        ("stub", 3),  # in NVML 550, not simulated: a stub's NOT_SUPPORTED
        ("process_util_idle", 6),  # no samples: NOT_FOUND, as real NVML
    ],
)
def test_pynvml_errors(nvml_all: dict[str, Any], call: str, error: int) -> None:
    assert nvml_all["errors"][call] == error


def test_pynvml_mig_devices(nvml_all: dict[str, Any]) -> None:
    assert nvml_all["migs"] == [
        {
            "uuid": m.uuid,
            "name": f"{GPU0.name} MIG {m.profile}",
            "gi": m.gpu_instance,
            "ci": m.compute_instance,
            "is_mig": 1,
            "parent_uuid": GPU0.uuid,
            "mem_total": m.memory_mib * MIB,
            "by_uuid": m.uuid,
            "pci": GPU0.pci_bus_id,
        }
        for m in (MIG0, MIG1)
    ]


# ---- the /dev rule ----

DEV_CASES = {
    # name: (GPUs with a node, MIG caps present, expected UUIDs by index, MIG UUIDs of GPU 0)
    "all": ([0, 1], True, [GPU0.uuid, GPU1.uuid], [MIG0.uuid, MIG1.uuid]),
    "gpu1_removed": ([0], True, [GPU0.uuid], [MIG0.uuid, MIG1.uuid]),
    "gpu0_removed": ([1], True, [GPU1.uuid], None),
    "no_caps": ([0, 1], False, [GPU0.uuid, GPU1.uuid], []),
    "none": ([], True, [], None),
}

DEV_PROBE = """
out = {"uuids": [], "migs": None}
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    out["uuids"].append(pynvml.nvmlDeviceGetUUID(h))
    if pynvml.nvmlDeviceGetMigMode(h)[0]:
        out["migs"] = []
        for k in range(7):
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except pynvml.NVMLError_NotFound:
                continue
            out["migs"].append(pynvml.nvmlDeviceGetUUID(m))
"""


@pytest.mark.parametrize("case", DEV_CASES)
def test_dev_rule(sim: Sim, tmp_path: Path, state_file: Path, case: str) -> None:
    gpus, caps, uuids, migs = DEV_CASES[case]
    dev = make_dev(tmp_path / "dev", TOPO, gpus, caps=caps)
    out = run_py(sim, DEV_PROBE, state_file, dev)
    assert out == {"uuids": uuids, "migs": migs}


def test_removing_node_hides_gpu_from_smi(sim: Sim, tmp_path: Path, state_file: Path) -> None:
    dev = make_dev(tmp_path / "dev", TOPO, [1])
    out = smi(sim, "-L", state_file=state_file, dev=dev)
    assert out == f"GPU 0: {GPU1.name} (UUID: {GPU1.uuid})\n"


def test_host_dev_dir_shows_mig_without_caps(sim: Sim, state_file: Path) -> None:
    """Without NVSIM_DEV_DIR the mock looks at <sim_root>/dev: the host, where
    MIG devices need no nvidia-caps nodes."""
    host_dev = make_dev(sim.root / "dev", TOPO, [0, 1], caps=False)
    try:
        env = sim.env(state_file)
        del env["NVSIM_DEV_DIR"]
        r = subprocess.run([str(sim.smi), "-L"], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert MIG1.uuid in r.stdout
    finally:
        shutil.rmtree(host_dev)
