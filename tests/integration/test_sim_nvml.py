"""The simulated driver: real pynvml over the mock NVML, nvidia-smi, the shared state.

Everything is built once into a module tmp dir from a 2-GPU topology (GPU 0 with
MIG). Each check runs in a subprocess, since the mock reads NVSIM_DEV_DIR and
enumerates devices once per process and the loader finds it by LD_LIBRARY_PATH.
A small C helper linked with nvsim_state.c stands in for the mock libcuda's
users (charging memory, running kernels) so these tests need only this part.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim import apilist, build, state
from nvctk.sim.topology import make_topology
from support import wait
from support.devnodes import make_dev
from support.procs import kill_left
from support.simdriver import build_sim_driver

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

MIB = 1 << 20
TOPO = make_topology(2, mig={0: ["1g.10gb", "2g.20gb"]}, seed="test_sim_nvml")
GPU0, GPU1 = TOPO.gpus
MIG0, MIG1 = GPU0.mig_devices

# Charges/credits memory and runs kernels through nvsim_state.c, as libcuda does;
# prints "ready" and then holds its slot until stdin closes (or it is killed).
HELPER_C = r"""
#include "nvsim_state.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    struct nvsim_state *st = nvsim_state_open();
    char buf[16];
    if (!st)
        return 3;
    for (int i = 1; i + 2 < argc; i += 3) {
        unsigned gpu = (unsigned)atoi(argv[i + 1]);
        unsigned long long n = strtoull(argv[i + 2], NULL, 10);
        if (!strcmp(argv[i], "charge") && nvsim_mem_charge(st, gpu, n) != 0)
            return 4;
        if (!strcmp(argv[i], "credit"))
            nvsim_mem_credit(st, gpu, n);
        if (!strcmp(argv[i], "kernels"))
            for (unsigned long long k = 0; k < n; k++)
                nvsim_run_kernel(st, gpu, 1000000);
    }
    printf("ready\n");
    fflush(stdout);
    while (read(0, buf, sizeof buf) > 0)
        ;
    return 0;
}
"""

# offsetof() of every field state.py reads, compared with state.OFFSETS
OFFSETS_C_HEAD = (
    '#include "nvsim_state.h"\n#include <stddef.h>\n#include <stdio.h>\nint main(void)\n{\n'
)


@dataclass(frozen=True)
class Sim:
    root: Path
    lib: Path
    smi: Path
    dev: Path
    helper: Path
    offsets: Path
    tmp: Path

    def env(self, state_file: Path, dev: Path | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "LD_LIBRARY_PATH": str(self.lib),
            "NVSIM_DEV_DIR": str(dev or self.dev),
            "NVSIM_STATE": str(state_file),
        }


def _gcc(*args: str) -> None:
    subprocess.run(["gcc", *build.CFLAGS, *args, "-lpthread"], check=True)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Sim:
    tmp = tmp_path_factory.mktemp("simnvml")
    root, lib, bindir = build_sim_driver(tmp, TOPO)
    inc = tmp / "inc"
    inc.mkdir()
    (inc / "nvsim_topology.h").write_text(build.generate_topology_header(TOPO, str(root)))
    (tmp / "helper.c").write_text(HELPER_C)
    _gcc(
        f"-I{inc}",
        f"-I{build.CSRC}",
        "-o",
        str(tmp / "helper"),
        str(tmp / "helper.c"),
        str(build.CSRC / "nvsim_state.c"),
    )
    lines = [OFFSETS_C_HEAD]
    for key in state.OFFSETS:
        expr = (
            key if key.startswith("sizeof") else "offsetof(struct {}, {})".format(*key.split("."))
        )
        lines.append(f'    printf("%s %zu\\n", "{key}", {expr});\n')
    (tmp / "offsets.c").write_text("".join([*lines, "    return 0;\n}\n"]))
    _gcc(f"-I{build.CSRC}", "-o", str(tmp / "offsets"), str(tmp / "offsets.c"))
    dev = make_dev(tmp / "dev", TOPO, [0, 1])
    return Sim(root, lib, bindir / "nvidia-smi", dev, tmp / "helper", tmp / "offsets", tmp)


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "state"


def run_py(sim: Sim, code: str, state_file: Path, dev: Path | None = None) -> Any:
    """Runs `code` (which sets `out`) under pynvml in a subprocess; returns out."""
    script = "import json, pynvml\npynvml.nvmlInit()\n" + textwrap.dedent(code)
    script += "\npynvml.nvmlShutdown()\nprint(json.dumps(out))\n"
    r = subprocess.run(
        [sys.executable, "-c", script],
        env=sim.env(state_file, dev),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def smi(sim: Sim, *args: str, state_file: Path, dev: Path | None = None) -> str:
    r = subprocess.run(
        [str(sim.smi), *args], env=sim.env(state_file, dev), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


class Helper:
    """A process holding GPU memory through the shared state."""

    def __init__(self, sim: Sim, state_file: Path, *ops: str | int, wait: bool = True) -> None:
        self.proc = subprocess.Popen(
            [str(sim.helper), *map(str, ops)],
            env=sim.env(state_file),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"helper exited {self.proc.wait()}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def helpers() -> Iterator[list[Helper]]:
    started: list[Helper] = []
    yield started
    kill_left((h.proc for h in started), 10)


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


GPU_MIB = GPU0.memory_mib


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


# ---- nvidia-smi ----


def test_smi_list(sim: Sim, state_file: Path) -> None:
    assert smi(sim, "-L", state_file=state_file) == (
        f"GPU 0: {GPU0.name} (UUID: {GPU0.uuid})\n"
        f"  MIG 1g.10gb     Device  0: (UUID: {MIG0.uuid})\n"
        f"  MIG 2g.20gb     Device  1: (UUID: {MIG1.uuid})\n"
        f"GPU 1: {GPU1.name} (UUID: {GPU1.uuid})\n"
    )


def test_no_nvidiactl_is_no_driver(sim: Sim, state_file: Path, tmp_path: Path) -> None:
    """As the real library: without /dev/nvidiactl (the module unloaded) init fails with
    Driver Not Loaded, and nvidia-smi says it cannot reach the driver."""
    dev = make_dev(tmp_path / "dev", TOPO, [0, 1])
    (dev / "nvidiactl").unlink()
    script = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n" \
             "    print(e.value, e)\n"
    r = subprocess.run([sys.executable, "-c", script], env=sim.env(state_file, dev),
                       capture_output=True, text=True, timeout=30)
    assert r.stdout == "9 Driver Not Loaded\n", r.stdout + r.stderr
    r = subprocess.run([str(sim.smi), "-L"], env=sim.env(state_file, dev), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 9 and r.stdout == "", r
    assert "couldn't communicate with the NVIDIA driver" in r.stderr, r.stderr


QUERY = "index,uuid,name,memory.total,memory.used,memory.free"


@pytest.mark.parametrize(
    ("fmt", "header", "unit"),
    [
        (
            "csv",
            "index, uuid, name, memory.total [MiB], memory.used [MiB], memory.free [MiB]",
            " MiB",
        ),
        ("csv,nounits", "index, uuid, name, memory.total, memory.used, memory.free", ""),
        ("csv,noheader", None, " MiB"),
        ("csv,noheader,nounits", None, ""),
    ],
)
def test_smi_query_gpu(
    sim: Sim, state_file: Path, helpers: list[Helper], fmt: str, header: str | None, unit: str
) -> None:
    helpers.append(Helper(sim, state_file, "charge", 1, 300 * MIB))
    out = smi(sim, f"--query-gpu={QUERY}", f"--format={fmt}", state_file=state_file)
    rows = [
        f"{g.index}, {g.uuid}, {g.name}, {g.memory_mib}{unit}, {used}{unit}, "
        f"{g.memory_mib - used}{unit}"
        for g, used in ((GPU0, 0), (GPU1, 300))
    ]
    assert out.splitlines() == ([header] if header else []) + rows


def test_smi_query_apps_and_table(sim: Sim, state_file: Path, helpers: list[Helper]) -> None:
    h = Helper(sim, state_file, "charge", 0, 512 * MIB)
    helpers.append(h)
    out = smi(
        sim,
        "--query-compute-apps=pid,gpu_uuid,used_memory",
        "--format=csv,noheader",
        state_file=state_file,
    )
    assert out == f"{h.pid}, {GPU0.uuid}, 512 MiB\n"
    table = smi(sim, state_file=state_file)
    assert f"Driver Version: {TOPO.driver_version}" in table
    assert "  512/81920MiB" in table
    assert f"    0 {h.pid:>10}   512 MiB" in table


def test_smi_rejects_unknown_field(sim: Sim, state_file: Path) -> None:
    r = subprocess.run(
        [str(sim.smi), "--query-gpu=bogus", "--format=csv"],
        env=sim.env(state_file),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert '"bogus" is not a valid field' in r.stderr


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


# ---- building ----


def test_stub_libraries(tmp_path: Path) -> None:
    names = [f"libnvidia-stub{i}.so.1" for i in range(40)]
    for n in names:
        build.build_stub_library(str(tmp_path / n.replace(".so.1", ".so.550.54.15")), n)
    for n in (names[0], names[-1]):
        r = subprocess.run(
            ["readelf", "-d", str(tmp_path / n.replace(".so.1", ".so.550.54.15"))],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"Library soname: [{n}]" in r.stdout
    # and it is a loadable library
    import ctypes

    ctypes.CDLL(str(tmp_path / "libnvidia-stub0.so.550.54.15")).nvsim_stub_library()


def test_driver_libs_need_only_libc(sim: Sim) -> None:
    lib = sim.lib / f"libnvidia-ml.so.{TOPO.driver_version}"
    r = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True)
    needed = {
        line.split("[")[1].rstrip("]") for line in r.stdout.splitlines() if "(NEEDED)" in line
    }
    assert needed <= {"libc.so.6", "libpthread.so.0", "libdl.so.2"}
    assert "Library soname: [libnvidia-ml.so.1]" in r.stdout


def test_topology_header_escapes_strings() -> None:
    topo = make_topology(1, product='Odd "GPU" \\ name')
    header = build.generate_topology_header(topo, "/sim/root")
    assert r'"Odd \"GPU\" \\ name"' in header
    assert '"/sim/root"' in header
