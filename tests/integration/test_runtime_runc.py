"""End to end: real runc through nvctk-runtime on the simulated host.

Each test writes a bundle from `runc spec` (process.terminal false, root.path at a
busybox + glibc rootfs), runs `nvctk-runtime --root R run --bundle B ID` in the
foreground with NVCTK_CONFIG pointing at the 2-GPU sim, and reads what a probe
script printed inside the container: its /dev/nvidia* nodes, its mount points, the
sim's `nvidia-smi -L`, the CUDA sample's verdict. Environment semantics follow
REFERENCE §5. Containers are always deleted (`runc delete --force`), and the
host's mount table under this session's temp dirs must not change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nvctk.base.mounts import parse_mountinfo
from nvctk.host import ldcache
from nvctk.sim.host import SimHost
from nvctk.sim.rootfs import build_rootfs
from nvctk.sim.state import read_state, state_path
from support.runc import Runc, containers
from support.sim import assert_mig_view

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, device nodes)"),
    pytest.mark.skipif(shutil.which("runc") is None, reason="needs runc"),
]

LIB = "/usr/lib/x86_64-linux-gnu"
CANARY_SRC = Path(__file__).parents[1] / "support" / "canary" / "canary.c"
SECTIONS = ("dev", "smi", "mounts", "libs", "cache", "sample")
# One shell script, one section per fact; sections are read back by _sections().
PROBE = """
echo '== dev'; ls /dev | grep nvidia
echo '== smi'; if [ -e /usr/bin/nvidia-smi ]; then nvidia-smi -L 2>&1; echo "rc=$?"; \
else echo absent; fi
echo '== mounts'; cut -d' ' -f5 /proc/self/mountinfo | grep -e nvidia -e cuda | sort
echo '== libs'; ls {lib} | grep -e nvidia -e cuda
echo '== cache'; if grep -q libcuda.so.1 /etc/ld.so.cache; then echo libcuda; else echo none; fi
echo '== sample'; {sample}
echo '== end'
"""


def probe(sample: bool = False) -> list[str]:
    script = PROBE.format(lib=LIB, sample="cuda-vectoradd 2>&1" if sample else "true")
    return ["sh", "-c", script]


def _watched_mounts(prefixes: tuple[str, ...]) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [m.mount_point for m in parse_mountinfo(f.read())]
    return sorted(p for p in points if p.startswith(prefixes))


@pytest.fixture(scope="module")
def shared_rootfs(sim_host: SimHost, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One writable rootfs with the CUDA sample for the GPU cases that only read it
    (the hook leaves empty mount targets and ldconfig's links in it, so cases that
    check for the absence of driver files build their own)."""
    return build_rootfs(str(tmp_path_factory.mktemp("e2e") / "rootfs"),
                        with_sample=sim_host.sample)


@pytest.fixture
def runc(sim_host: SimHost, tmp_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runc]:
    prefixes = (str(tmp_path_factory.getbasetemp()), os.path.realpath(sim_host.root))
    before = _watched_mounts(prefixes)
    with containers(sim_host, tmp_path) as r:
        yield r
    assert _watched_mounts(prefixes) == before, "a mount stayed on the host"


@pytest.fixture
def fresh_rootfs(sim_host: SimHost, tmp_path: Path) -> Callable[[], str]:
    n = iter(range(100))

    def make() -> str:
        return build_rootfs(str(tmp_path / f"rootfs{next(n)}"), with_sample=sim_host.sample)

    return make


def _gpu_lines(smi: list[str]) -> list[str]:
    return [line for line in smi if line.startswith("GPU ")]


# --- one GPU by UUID ----------------------------------------------------------------------


def test_gpu1_by_uuid_gets_only_its_nodes(sim_host: SimHost, shared_rootfs: str,
                                          runc: Runc) -> None:
    gpu1 = sim_host.topology.gpus[1].uuid
    r = runc.run(runc.bundle(shared_rootfs, probe(), [f"NVIDIA_VISIBLE_DEVICES={gpu1}"]))
    dev = set(r.out["dev"])
    assert {"nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} <= dev, dev
    assert "nvidia0" not in dev
    assert not {d for d in dev if re.fullmatch(r"nvidia\d+", d)} - {"nvidia1"}, dev


def test_gpu1_by_uuid_nvidia_smi_lists_exactly_it(sim_host: SimHost, shared_rootfs: str,
                                                  runc: Runc) -> None:
    gpu1 = sim_host.topology.gpus[1].uuid
    r = runc.run(runc.bundle(shared_rootfs, probe(), [f"NVIDIA_VISIBLE_DEVICES={gpu1}"]))
    smi = r.out["smi"]
    assert smi[-1] == "rc=0", smi
    lines = _gpu_lines(smi)
    assert len(lines) == 1, smi
    assert lines[0].startswith("GPU 0: ") and f"(UUID: {gpu1})" in lines[0], lines


def test_gpu1_cuda_sample_passes_on_the_shared_gpu(sim_host: SimHost, shared_rootfs: str,
                                                   runc: Runc) -> None:
    gpu1 = sim_host.topology.gpus[1].uuid
    state = state_path(sim_host.root)
    before = read_state(state).gpus
    r = runc.run(runc.bundle(shared_rootfs, probe(sample=True),
                             [f"NVIDIA_VISIBLE_DEVICES={gpu1}"]))
    assert "Test PASSED" in r.out["sample"], r.out["sample"]
    after = read_state(state).gpus
    # the kernels ran on the host's (simulated) GPU 1, seen through the bound state file
    assert after[1].kernels > before[1].kernels
    assert after[0].kernels == before[0].kernels


# --- NVIDIA_VISIBLE_DEVICES / capabilities semantics --------------------------------------


@dataclass(frozen=True)
class Case:
    env: tuple[str, ...]
    gpus: tuple[int, ...]  # indexes of the sim's GPUs that must be visible (nodes, smi -L)
    utility: bool = True  # nvidia-smi mounted
    compute: bool = True  # libcuda mounted, /dev/nvidia-uvm*
    uid: int = 0  # process.user


# env values are formatted with {uuid1} and {bus1} (GPU 1's UUID and PCI bus id)
GPU_CASES: dict[str, Case] = {
    "none": Case(("NVIDIA_VISIBLE_DEVICES=none",), ()),
    "all": Case(("NVIDIA_VISIBLE_DEVICES=all",), (0, 1)),
    "utility-only": Case(("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility"),
                         (0, 1), compute=False),
    "legacy-image": Case(("CUDA_VERSION=12.0",), (0, 1)),
    "index": Case(("NVIDIA_VISIBLE_DEVICES=0",), (0,)),
    "uuid-upper-case": Case(("NVIDIA_VISIBLE_DEVICES={uuid1_upper}",), (1,)),
    "pci-bus-id": Case(("NVIDIA_VISIBLE_DEVICES={bus1}",), (1,)),
    "list-with-spaces": Case(("NVIDIA_VISIBLE_DEVICES= 1 , {uuid1} ,",), (1,)),
    "non-root-user": Case(("NVIDIA_VISIBLE_DEVICES={uuid1}",), (1,), uid=1000),
}


@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_container_cases(name: str, sim_host: SimHost, shared_rootfs: str,
                             runc: Runc) -> None:
    case = GPU_CASES[name]
    v = sim_host.topology.driver_version
    gpu1 = sim_host.topology.gpus[1]
    env = [e.format(uuid1=gpu1.uuid, uuid1_upper=gpu1.uuid.upper(), bus1=gpu1.pci_bus_id)
           for e in case.env]
    b = runc.bundle(shared_rootfs, probe(sample=case.compute), env)
    if case.uid:
        spec = json.loads((b / "config.json").read_text())
        spec["process"]["user"] = {"uid": case.uid, "gid": case.uid}
        (b / "config.json").write_text(json.dumps(spec, indent=2))
    r = runc.run(b)
    out = r.out
    dev = set(out["dev"])
    assert "nvidiactl" in dev, dev
    assert {d for d in dev if re.fullmatch(r"nvidia\d+", d)} == {
        f"nvidia{sim_host.topology.gpus[i].minor}" for i in case.gpus}, dev
    mounts = set(out["mounts"])
    assert ("/usr/bin/nvidia-smi" in mounts) == case.utility, mounts
    assert (f"{LIB}/libcuda.so.{v}" in mounts) == case.compute, mounts
    assert ({"nvidia-uvm", "nvidia-uvm-tools"} <= dev) == case.compute, dev
    if not case.compute:
        assert "nvidia-uvm" not in dev and not any("libcuda" in m for m in mounts), out
    if case.utility:
        uuids = [sim_host.topology.gpus[i].uuid for i in case.gpus]
        lines = _gpu_lines(out["smi"])
        assert len(lines) == len(uuids), out["smi"]
        for u in uuids:
            assert any(f"(UUID: {u})" in line for line in lines), (u, lines)
    if case.compute and case.gpus:
        assert "Test PASSED" in out["sample"], out["sample"]
    elif case.compute:  # none: the driver is there, but no GPU
        assert any("CUDA_ERROR_NO_DEVICE" in line for line in out["sample"]), out["sample"]
    assert (r.bundle / "nvctk-edits.json").exists()
    assert not r.spec_untouched()


@pytest.mark.parametrize("env", [["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="],
                                 ["NVIDIA_VISIBLE_DEVICES= , "], []],
                         ids=["void", "empty", "blank-list", "unset"])
def test_not_a_gpu_container(env: list[str], fresh_rootfs: Callable[[], str],
                             runc: Runc) -> None:
    root = fresh_rootfs()
    before = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))
    r = runc.run(runc.bundle(root, probe(), env))
    out = r.out
    assert out["dev"] == [], out["dev"]
    assert out["smi"] == ["absent"]
    assert out["mounts"] == [] and out["libs"] == []
    assert out["cache"] == ["none"]
    assert r.spec_untouched(), "config.json of a non-GPU container was rewritten"
    assert not (r.bundle / "nvctk-edits.json").exists()
    assert sorted(str(p.relative_to(root)) for p in Path(root).rglob("*")) == before


# --- failures before runc starts ----------------------------------------------------------


def _last_log_error(bundle: Path) -> str:
    errors = [json.loads(line) for line in (bundle / "runc-log.json").read_text().splitlines()
              if line.strip()]
    errors = [e for e in errors if e.get("level") == "error"]
    assert errors, "no error line in the --log file"
    return str(errors[-1]["msg"])


def test_unknown_id_fails_before_runc(shared_rootfs: str, runc: Runc) -> None:
    bogus = "GPU-00000000-dead-beef-0000-000000000000"
    b = runc.bundle(shared_rootfs, probe(), [f"NVIDIA_VISIBLE_DEVICES={bogus}"])
    r = runc.run(b)
    assert r.proc.returncode != 0
    assert bogus in r.proc.stderr, r.proc.stderr
    assert bogus in _last_log_error(b)
    assert r.proc.stdout == ""  # the container never ran
    assert runc.listed() == []
    assert r.spec_untouched()
    assert not (b / "nvctk-edits.json").exists()


def test_unmet_requirement_fails_naming_term_and_host_value(sim_host: SimHost,
                                                            shared_rootfs: str,
                                                            runc: Runc) -> None:
    b = runc.bundle(shared_rootfs, probe(),
                    ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"])
    r = runc.run(b)
    assert r.proc.returncode != 0
    msg = r.proc.stderr
    assert "cuda>=99.0" in msg and sim_host.topology.cuda_version in msg, msg
    assert "cuda>=99.0" in _last_log_error(b)
    assert r.proc.stdout == ""
    assert runc.listed() == []
    assert r.spec_untouched()


# --- rootfs variants ----------------------------------------------------------------------


def test_relative_root_path(sim_host: SimHost, runc: Runc) -> None:
    gpu1 = sim_host.topology.gpus[1].uuid
    b = runc.bundle(None, probe(sample=True), [f"NVIDIA_VISIBLE_DEVICES={gpu1}"])
    assert json.loads((b / "config.json").read_text())["root"]["path"] == "rootfs"
    out = runc.run(b).out
    assert "nvidia1" in out["dev"] and "nvidia0" not in out["dev"]
    assert f"{LIB}/libcuda.so.{sim_host.topology.driver_version}" in out["mounts"]
    assert "Test PASSED" in out["sample"], out["sample"]
    # the hook worked in <bundle>/rootfs: ldconfig's cache there now has the driver
    names = {e.name for e in ldcache.read(str(b / "rootfs"))}
    assert "libcuda.so.1" in names


def test_bundle_from_working_directory(sim_host: SimHost, runc: Runc) -> None:
    """No --bundle: runc and nvctk-runtime both take the working directory."""
    gpu1 = sim_host.topology.gpus[1].uuid
    b = runc.bundle(None, probe(sample=True), [f"NVIDIA_VISIBLE_DEVICES={gpu1}"])
    out = runc.run(b, bundle_flag=False).out
    assert "nvidia1" in out["dev"] and "nvidia0" not in out["dev"]
    assert "Test PASSED" in out["sample"], out["sample"]


def test_readonly_rootfs_gets_the_same_files(sim_host: SimHost,
                                             fresh_rootfs: Callable[[], str],
                                             runc: Runc) -> None:
    gpu1 = sim_host.topology.gpus[1].uuid
    env = [f"NVIDIA_VISIBLE_DEVICES={gpu1}"]
    rw_root, ro_root = fresh_rootfs(), fresh_rootfs()
    rw = runc.run(runc.bundle(rw_root, probe(sample=True), env, name="rw")).out
    ro_res = runc.run(runc.bundle(ro_root, probe(sample=True), env, readonly=True, name="ro"))
    ro = ro_res.out
    for key in ("dev", "smi", "mounts", "libs", "cache"):
        assert ro[key] == rw[key], (key, ro[key], rw[key])
    assert "nvidia1" in ro["dev"] and "nvidia0" not in ro["dev"]
    v = sim_host.topology.driver_version
    assert {f"{LIB}/libcuda.so.{v}", f"{LIB}/libnvidia-ml.so.{v}", "/usr/bin/nvidia-smi"} <= \
        set(ro["mounts"])
    assert {"libcuda.so.1", "libcuda.so", f"libcuda.so.{v}"} <= set(ro["libs"])
    assert ro["cache"] == ["libcuda"]
    assert "Test PASSED" in ro["sample"], ro["sample"]
    # and the container really was read-only
    assert ro_res.proc.returncode == 0
    check = runc.run(runc.bundle(ro_root, ["sh", "-c", "touch /x 2>&1; echo rc=$?"], env,
                                 readonly=True, name="ro-check"))
    assert check.proc.returncode == 0, check.proc.stderr
    assert "Read-only file system" in check.proc.stdout and "rc=1" in check.proc.stdout


# --- the hook is insulated from the container's environment -------------------------------


@pytest.fixture(scope="module")
def canary_so(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(canary .so, its log path): every process that loads it appends to the log."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the canary library")
    d = tmp_path_factory.mktemp("e2e-canary")
    log, so = str(d / "canary.log"), str(d / "canary.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f'-DCANARY_LOG="{log}"', "-o", so,
                    str(CANARY_SRC)], check=True)
    return so, log


def test_container_ld_preload_does_not_reach_the_hook(sim_host: SimHost,
                                                      fresh_rootfs: Callable[[], str],
                                                      canary_so: tuple[str, str],
                                                      runc: Runc) -> None:
    so, log = canary_so
    root = Path(fresh_rootfs())
    # the library sits at the same absolute path on the host and in the image, so a
    # host-side process that honoured the container's LD_PRELOAD would load it too
    inside_so = root / so.lstrip("/")
    inside_so.parent.mkdir(parents=True)
    shutil.copy(so, inside_so)
    gpu1 = sim_host.topology.gpus[1].uuid
    b = runc.bundle(str(root), ["/usr/local/bin/cuda-vectoradd"],
                    [f"NVIDIA_VISIBLE_DEVICES={gpu1}", f"LD_PRELOAD={so}"])
    r = runc.run(b)
    assert r.proc.returncode == 0, r.proc.stderr
    assert "Test PASSED" in r.proc.stdout
    assert not os.path.exists(log), "a host-side process loaded the container's LD_PRELOAD"
    records = (root / log.lstrip("/")).read_text().splitlines()
    assert records and all(rec.split()[1] == "/usr/local/bin/cuda-vectoradd" for rec in records)
    hooks = json.loads((b / "config.json").read_text())["hooks"]["prestart"]
    assert hooks and not any(e.startswith("LD_") for h in hooks for e in h.get("env", []))


# --- nothing stays mounted ----------------------------------------------------------------


def test_nothing_stays_mounted_on_the_host(sim_host: SimHost, shared_rootfs: str,
                                           runc: Runc) -> None:
    """Beyond the per-test check in `runc`: no mount at all under the rootfs or the sim."""
    r = runc.run(runc.bundle(shared_rootfs, probe(), ["NVIDIA_VISIBLE_DEVICES=all"]))
    assert r.out["mounts"]  # the container did have driver mounts
    assert _watched_mounts((shared_rootfs, os.path.realpath(sim_host.root))) == []
    assert runc.listed() == []  # `run` in the foreground removed it


# --- MIG ----------------------------------------------------------------------------------


@pytest.fixture
def mig_runc(sim_host_mig: SimHost, tmp_path: Path) -> Iterator[Runc]:
    with containers(sim_host_mig, tmp_path) as r:
        yield r


@pytest.mark.parametrize("form", ["uuid", "gpu:mig"])
def test_mig_device_gets_its_parent_and_its_caps_only(form: str, sim_host_mig: SimHost,
                                                      mig_runc: Runc, tmp_path: Path) -> None:
    gpu0 = sim_host_mig.topology.gpus[0]
    mig = gpu0.mig_devices[2]
    ident = mig.uuid if form == "uuid" else f"0:{mig.index}"
    rootfs = build_rootfs(str(tmp_path / "rootfs"), with_sample=sim_host_mig.sample)
    script = ("nvidia-smi -L; echo '== caps'; ls /dev/nvidia-caps; echo '== nodes'; "
              "ls /dev | grep '^nvidia[0-9]'; echo '== sample'; cuda-vectoradd | grep Test")
    r = mig_runc.run(mig_runc.bundle(rootfs, ["sh", "-c", script],
                                     [f"NVIDIA_VISIBLE_DEVICES={ident}"]))
    assert r.proc.returncode == 0, r.proc.stderr
    out = r.proc.stdout
    smi, rest = out.split("== caps\n")
    caps, rest = rest.split("== nodes\n")
    nodes, sample = rest.split("== sample\n")
    assert_mig_view(smi, caps, gpu0, mig)
    assert nodes.split() == [f"nvidia{gpu0.minor}"]
    assert sample.strip() == "Test PASSED"
