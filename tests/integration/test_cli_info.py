"""NVML at a driver root (real pynvml over the mock NVML), driver file discovery,
and `nvctk info`."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from nvctk.base import inroot
from nvctk.base.config import ALL_CAPABILITIES
from nvctk.base.errors import DriverError
from nvctk.host import driver, nvml
from nvctk.sim import host
from nvctk.sim.topology import Topology

RunNvctk = Callable[..., subprocess.CompletedProcess[str]]
VER = "550.54.15"


def expected_gpus(topo: Topology) -> list[dict[str, object]]:
    return [
        {
            "index": g.index,
            "uuid": g.uuid,
            "name": g.name,
            "minor": g.minor,
            "pci_bus_id": g.pci_bus_id,
            "memory_mib": g.memory_mib,
            "compute_capability": "{}.{}".format(*g.compute_capability),
            "brand": g.brand,
            "mig_enabled": g.mig_enabled,
            "mig_devices": [
                {
                    "index": m.index,
                    "uuid": m.uuid,
                    "gpu_instance": m.gpu_instance,
                    "compute_instance": m.compute_instance,
                    "profile": m.profile,
                    "memory_mib": m.memory_mib,
                }
                for m in g.mig_devices
            ],
        }
        for g in topo.gpus
    ]


@pytest.mark.parametrize("which", ["sim_host", "sim_host_mig"])
def test_query_host_matches_topology(which: str, request: pytest.FixtureRequest) -> None:
    sim: host.SimHost = request.getfixturevalue(which)
    info = nvml.query_host(sim.root)
    assert info.driver_version == sim.topology.driver_version
    assert info.cuda_version == sim.topology.cuda_version
    assert info.to_dict()["gpus"] == expected_gpus(sim.topology)
    g0 = sim.topology.gpus[0]
    assert info.gpu(g0.uuid.lower()) == info.gpus[0] == info.gpu("0") == info.gpu(g0.pci_bus_id)


def test_query_two_roots_in_one_process(
    sim_host: host.SimHost, make_sim: Callable[..., host.SimHost]
) -> None:
    other = make_sim(gpus=1, driver_version="535.104.05", cuda_version="12.2", product="Tesla T4",
                     memory_mib=15360, compute_capability=(7, 5), brand="tesla")
    a = nvml.query_host(sim_host.root)
    b = nvml.query_host(other.root)
    c = nvml.query_host(sim_host.root)
    assert a == c
    assert (b.driver_version, b.cuda_version, len(b.gpus)) == ("535.104.05", "12.2", 1)
    assert (b.gpus[0].name, b.gpus[0].brand, b.gpus[0].compute_capability) == ("Tesla T4", "tesla", "7.5")
    assert b.gpus[0].memory_mib == 15360
    assert "NVSIM_DEV_DIR" not in os.environ or os.environ["NVSIM_DEV_DIR"] != other.dev_dir


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("empty", "etc/ld.so.cache"),
        ("cache-without-nvml", "libnvidia-ml.so.1 is not in"),
        ("dangling", "does not exist"),
    ],
)
def test_no_driver_says_where_it_looked(tmp_path: Path, setup: str, needle: str) -> None:
    if setup != "empty":
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc/ld.so.conf").write_text("/usr/lib/x86_64-linux-gnu\n")
        lib = tmp_path / "usr/lib/x86_64-linux-gnu"
        lib.mkdir(parents=True)
        if setup == "dangling":
            (lib / f"libnvidia-ml.so.{VER}").write_bytes(host.elf_stub("libnvidia-ml.so.1"))
        subprocess.run(["/sbin/ldconfig", "-r", str(tmp_path)], check=True)
        if setup == "dangling":
            (lib / f"libnvidia-ml.so.{VER}").unlink()
    with pytest.raises(DriverError) as e:
        nvml.query_host(str(tmp_path))
    assert needle in str(e.value) and str(tmp_path) in str(e.value)


# capability -> library names (REFERENCE §4)
CAPS = {
    "utility": {"libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq"},
    "compute": set(driver.COMPUTE_LIBS),
    "video": set(driver.COMPUTE_LIBS) | {"libvdpau_nvidia", "libnvidia-encode",
                                         "libnvidia-opticalflow", "libnvcuvid"},
    "graphics": set(driver.GRAPHICS_LIBS),
    "display": set(driver.GRAPHICS_LIBS),
    "ngx": {"libnvidia-ngx"},
}


@pytest.mark.parametrize("cap", sorted(CAPS))
def test_discover_libraries(sim_host: host.SimHost, cap: str) -> None:
    files = driver.discover_files(sim_host.root, VER)
    paths = files.libraries[cap]
    names = {os.path.basename(p).removesuffix(f".so.{VER}") for p in paths}
    assert names == set(CAPS[cap])
    for p in paths:
        assert p.startswith(sim_host.lib_dir + "/") and p.endswith(f".so.{VER}")
        assert os.path.isfile(p) and not os.path.islink(p)


def test_discover_other_files(sim_host: host.SimHost) -> None:
    r = sim_host.root
    files = driver.discover_files(r, VER)
    assert {os.path.basename(p) for p in files.libraries32} == {
        f"{n}.so.{VER}" for n in host.STUB_LIBRARIES_32
    }
    assert all(p.startswith(sim_host.lib32_dir) for p in files.libraries32)
    assert files.binaries["utility"] == tuple(
        f"{r}/usr/bin/{b}" for b in ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced",
                                     "nv-fabricmanager")
    )
    assert files.binaries["compute"] == (
        f"{r}/usr/bin/nvidia-cuda-mps-control", f"{r}/usr/bin/nvidia-cuda-mps-server",
    )
    cfgs = dict(files.config_files["graphics"])
    assert cfgs[f"{r}/usr/share/glvnd/egl_vendor.d/10_nvidia.json"] == (
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"
    )
    assert cfgs[f"{r}/usr/share/vulkan/icd.d/nvidia_icd.json"] == "/usr/share/vulkan/icd.d/nvidia_icd.json"
    # display: the graphics files and X's configuration snippets
    assert files.config_files["display"][:len(files.config_files["graphics"])] == \
        files.config_files["graphics"]
    assert [c for _, c in files.config_files["display"][len(files.config_files["graphics"]):]] == [
        "/usr/share/X11/xorg.conf.d/10-nvidia.conf",
        "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"]
    assert files.config_files["compute"] == (
        (f"{r}/etc/OpenCL/vendors/nvidia.icd", "/etc/OpenCL/vendors/nvidia.icd"),)
    assert files.firmware == tuple(f"{r}/lib/firmware/nvidia/{VER}/{f}" for f in host.FIRMWARE)
    assert files.sockets["utility"] == (
        f"{r}/run/nvidia-persistenced/socket", f"{r}/run/nvidia-fabricmanager/socket",
    )
    assert files.proc_dir == f"{r}/proc/driver/nvidia"
    assert files.dev_dir == f"{r}/dev"
    assert set(files.for_capabilities(["compat32"])) == set(files.libraries32)


def test_discover_wrong_version_finds_no_libraries(sim_host: host.SimHost) -> None:
    files = driver.discover_files(sim_host.root, "999.1.2")
    assert not any(files.libraries.values()) and not files.libraries32 and not files.firmware


def test_discover_without_cache(tmp_path: Path) -> None:
    with pytest.raises(DriverError, match=str(tmp_path)):
        driver.discover_files(str(tmp_path), VER)


def test_resolve_in_root_keeps_absolute_links_inside(tmp_path: Path) -> None:
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/libx.so.9").write_text("")
    (tmp_path / "lib").symlink_to("/usr/lib")
    (tmp_path / "usr/lib/libx.so.1").symlink_to("/lib/../../../lib/libx.so.9")
    assert inroot.resolve_in_root(str(tmp_path), "/lib/libx.so.1") == f"{tmp_path}/usr/lib/libx.so.9"
    (tmp_path / "loop").symlink_to("/loop")
    with pytest.raises(DriverError, match="symlinks"):
        inroot.resolve_in_root(str(tmp_path), "/loop")


@pytest.mark.parametrize(
    ("gi", "ci", "mib", "gpu_mib", "name"),
    [
        (1, 1, 9856, 81920, "1g.10gb"),
        (3, 3, 40192, 81920, "3g.40gb"),
        (7, 7, 80896, 81920, "7g.80gb"),
        (1, 1, 4864, 40960, "1g.5gb"),
        (4, 2, 40192, 81920, "2c.4g.40gb"),
    ],
)
def test_mig_profile_name(gi: int, ci: int, mib: int, gpu_mib: int, name: str) -> None:
    assert nvml.mig_profile_name(gi, ci, mib, gpu_mib * nvml.MIB) == name


def test_cli_info_json_matches_topology(sim_host_mig: host.SimHost, run_nvctk: RunNvctk) -> None:
    r = run_nvctk("info", "--json", config=sim_host_mig.config_path)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    t = sim_host_mig.topology
    assert (d["driver_version"], d["cuda_version"]) == (t.driver_version, t.cuda_version)
    assert d["gpus"] == expected_gpus(t)
    assert set(d["files"]) == set(ALL_CAPABILITIES)
    assert f"{sim_host_mig.lib_dir}/libnvidia-ml.so.{VER}" in d["files"]["utility"]
    assert f"{sim_host_mig.root}/usr/bin/nvidia-smi" in d["files"]["utility"]
    for paths in d["files"].values():
        assert all(os.path.exists(p) for p in paths)


def test_cli_info_human(sim_host: host.SimHost, run_nvctk: RunNvctk) -> None:
    r = run_nvctk("info", config=sim_host.config_path)
    assert r.returncode == 0, r.stderr
    assert f"driver version: {VER}" in r.stdout
    for g in sim_host.topology.gpus:
        assert g.uuid in r.stdout
    libcuda = os.path.join(sim_host.lib_dir, f"libcuda.so.{VER}")
    assert "  compute: " in r.stdout and libcuda not in r.stdout
    r = run_nvctk("info", "--files", config=sim_host.config_path)
    assert f"    {libcuda}" in r.stdout.splitlines()


def test_cli_info_no_driver(tmp_path: Path, run_nvctk: RunNvctk) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'driver-root = "{tmp_path}/nothing"\n')
    r = run_nvctk("info", "--json", config=str(cfg))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvctk: no NVIDIA driver found")
    assert f"{tmp_path}/nothing/etc/ld.so.cache" in lines[0]
    assert r.stdout == ""
