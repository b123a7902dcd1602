"""`nvctk sim init`: the simulated host's files, nodes and config, end to end."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from nvctk.base import config as nvconfig
from nvctk.host import ldcache
from nvctk.sim import build, host
from nvctk.sim.rootfs import build_rootfs, container_lib_dir
from nvctk.sim.topology import MIG_PROFILES, Topology, make_topology

RunNvctk = Callable[..., subprocess.CompletedProcess[str]]
VER = "550.54.15"
ALL_64 = {**host.STUB_LIBRARIES, **host.MOCK_LIBRARIES}


def _soname(name: str) -> str:
    return ALL_64[name].format(v=VER)


@pytest.mark.parametrize("name", sorted(ALL_64))
def test_64bit_libraries_have_their_sonames(sim_host: host.SimHost, name: str) -> None:
    path = os.path.join(sim_host.lib_dir, f"{name}.so.{VER}")
    assert host.read_soname(path) == _soname(name)


@pytest.mark.parametrize("name", host.STUB_LIBRARIES_32)
def test_32bit_libraries_have_their_sonames(sim_host: host.SimHost, name: str) -> None:
    path = os.path.join(sim_host.lib32_dir, f"{name}.so.{VER}")
    with open(path, "rb") as f:
        assert f.read(5) == b"\x7fELF\x01"  # ELFCLASS32
    assert host.read_soname(path) == _soname(name)


def test_objdump_agrees(sim_host: host.SimHost) -> None:
    for path, soname, fmt in [
        (f"{sim_host.lib_dir}/libnvidia-ml.so.{VER}", "libnvidia-ml.so.1", "elf64-x86-64"),
        (f"{sim_host.lib_dir}/libGLX_nvidia.so.{VER}", "libGLX_nvidia.so.0", "elf64-x86-64"),
        (f"{sim_host.lib_dir}/libnvidia-glcore.so.{VER}", f"libnvidia-glcore.so.{VER}", "elf64-x86-64"),
        (f"{sim_host.lib32_dir}/libcuda.so.{VER}", "libcuda.so.1", "elf32-i386"),
    ]:
        out = subprocess.run(["objdump", "-p", path], capture_output=True, text=True, check=True).stdout
        assert fmt in out
        assert f"SONAME               {soname}" in out


def test_ld_cache_lists_every_library(sim_host: host.SimHost) -> None:
    cache = {(e.name, e.arch): e.path for e in ldcache.read(sim_host.root)}
    for name in ALL_64:
        assert cache[(_soname(name), "x86-64")] == f"/{host.LIB64}/{_soname(name)}"
    for name in host.STUB_LIBRARIES_32:
        assert cache[(_soname(name), "i386")] == f"/{host.LIB32}/{_soname(name)}"
    # the SONAME links ldconfig made resolve to the versioned files
    link = os.path.join(sim_host.lib_dir, "libnvidia-ml.so.1")
    assert os.readlink(link) == f"libnvidia-ml.so.{VER}"


def _node(path: str) -> tuple[int, int, int]:
    st = os.lstat(path)
    assert stat.S_ISCHR(st.st_mode), f"{path} is not a character device"
    return os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)


def _host_majors() -> set[int]:
    with open("/proc/devices") as f:
        text = f.read().split("Block devices:")[0]
    return {int(line.split()[0]) for line in text.splitlines() if line[:4].strip().isdigit()}


def test_device_nodes(sim_host: host.SimHost) -> None:
    dev = sim_host.dev_dir
    uvm, caps = sim_host.uvm_major, sim_host.caps_major
    expected = {
        "nvidia0": (195, 0, 0o666),
        "nvidia1": (195, 1, 0o666),
        "nvidiactl": (195, 255, 0o666),
        "nvidia-modeset": (195, 254, 0o666),
        "nvidia-uvm": (uvm, 0, 0o666),
        "nvidia-uvm-tools": (uvm, 1, 0o666),
        "nvidia-caps/nvidia-cap1": (caps, 1, 0o400),
        "nvidia-caps/nvidia-cap2": (caps, 2, 0o444),
    }
    for name, want in expected.items():
        assert _node(os.path.join(dev, name)) == want, name
    assert not os.path.exists(os.path.join(dev, "nvidia2"))
    assert uvm != caps
    assert not {uvm, caps} & _host_majors(), "the sim's majors must be unused on this host"
    with open(os.path.join(sim_host.root, "proc/devices")) as f:
        text = f.read()
    for line in ("195 nvidia-frontend", f"{uvm} nvidia-uvm", f"{caps} nvidia-caps"):
        assert line in text.splitlines()
    assert host.load(sim_host.root) == sim_host


def test_mig_capabilities(sim_host_mig: host.SimHost) -> None:
    proc = sim_host_mig.proc_dir
    g0 = sim_host_mig.topology.gpus[0]
    assert [m.profile for m in g0.mig_devices] == ["3g.40gb", "2g.20gb", "1g.10gb"]
    for m in g0.mig_devices:
        gi = f"{proc}/capabilities/gpu{g0.minor}/mig/gi{m.gpu_instance}"
        for path, minor in ((f"{gi}/access", m.gi_cap_minor),
                            (f"{gi}/ci{m.compute_instance}/access", m.ci_cap_minor)):
            with open(path) as f:
                assert f"DeviceFileMinor: {minor}\n" in f.read()
            node = f"{sim_host_mig.dev_dir}/nvidia-caps/nvidia-cap{minor}"
            assert _node(node)[:2] == (sim_host_mig.caps_major, minor)
    for name, minor in (("config", 1), ("monitor", 2)):
        with open(f"{proc}/capabilities/mig/{name}") as f:
            assert f"DeviceFileMinor: {minor}\n" in f.read()
    assert not os.path.exists(f"{proc}/capabilities/gpu1")


def test_proc_driver_files(sim_host: host.SimHost) -> None:
    proc = Path(sim_host.proc_dir)
    assert VER in (proc / "version").read_text()
    assert "ModifyDeviceFiles: 1" in (proc / "params").read_text().splitlines()
    assert (proc / "registry").is_file()
    buses = sorted(p.name for p in (proc / "gpus").iterdir())
    assert buses == ["0000:1b:00.0", "0000:2b:00.0"]
    for g in sim_host.topology.gpus:
        info = (proc / "gpus" / buses[g.index] / "information").read_text()
        assert g.uuid in info
        assert f"Device Minor: \t {g.minor}" in info


def test_other_driver_files(sim_host: host.SimHost) -> None:
    root = Path(sim_host.root)
    for fw in host.FIRMWARE:
        assert (root / "lib/firmware/nvidia" / VER / fw).is_file()
    assert stat.S_ISSOCK(os.stat(root / "run/nvidia-persistenced/socket").st_mode)
    assert (root / "run/nvidia-sim").is_dir()
    for p in ("usr/share/glvnd/egl_vendor.d/10_nvidia.json", "usr/share/vulkan/icd.d/nvidia_icd.json"):
        assert "library_path" in json.loads((root / p).read_text())["ICD"]
    smi = root / "usr/bin/nvidia-smi"
    assert smi.is_file() and os.access(smi, os.X_OK)
    assert not (root / "usr/bin/cuda-vectoradd").exists(), "the sample is not a driver file"
    for name in host.STUB_BINARIES:  # real ELF executables, as the driver's programs are
        prog = root / "usr/bin" / name
        assert prog.read_bytes()[:4] == b"\x7fELF" and os.access(prog, os.X_OK)
        r = subprocess.run([str(prog)], capture_output=True, text=True, timeout=10)
        assert r.returncode == 1 and r.stderr == f"{name}: not part of the simulated driver\n"
    assert not (root / "usr/bin" / build.STUB_PROGRAM).exists()


def test_a_script_is_not_the_drivers_program(tmp_path: Path) -> None:
    """A GPU host seen with driver 580 had /usr/bin/nvidia-smi as a shell script that execs
    /usr/local/nvidia/bin/nvidia-smi (the driver under its own prefix, its libraries in
    /usr/local/nvidia/lib64): mounted, the script failed in every container. A script is
    passed over, and the bin dir beside the driver's libraries is looked in."""
    from nvctk.host.driver import discover_files

    sim = host.init(str(tmp_path / "host"), make_topology(gpus=1))
    root = Path(sim.root)
    beside = root / os.path.dirname(host.LIB64) / "bin"  # <prefix>/bin for <prefix>/<libdir>
    beside.mkdir()
    os.replace(root / "usr/bin/nvidia-smi", beside / "nvidia-smi")
    (root / "usr/bin/nvidia-smi").write_text("#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi\n")
    (root / "usr/bin/nvidia-smi").chmod(0o755)
    (root / "usr/bin/nvidia-debugdump").write_text("#!/bin/sh\nexit 1\n")
    files = discover_files(sim.root, VER, ("utility",))
    assert str(beside / "nvidia-smi") in files.binaries["utility"]
    assert not any(p.endswith("/nvidia-debugdump") for p in files.binaries["utility"])


def test_drm_nodes_links_and_sysfs(sim_host: host.SimHost) -> None:
    root = Path(sim_host.root)
    drm = sim_host.drm_major
    assert drm == host.DRM_MAJOR or host.DRM_MAJOR in _host_majors()
    assert drm not in _host_majors() and drm not in (sim_host.uvm_major, sim_host.caps_major)
    for g in sim_host.topology.gpus:
        bus = f"0000:{g.pci_bus_id.split(':', 1)[1].lower()}"
        card, render = f"card{g.minor}", f"renderD{128 + g.minor}"
        assert _node(str(root / "dev/dri" / card)) == (drm, g.minor, 0o660)
        assert _node(str(root / "dev/dri" / render)) == (drm, 128 + g.minor, 0o666)
        # udev's links, relative as NCT resolves them
        for kind, node in (("card", card), ("render", render)):
            link = root / f"dev/dri/by-path/pci-{bus}-{kind}"
            assert os.readlink(link) == f"../{node}"
            assert link.resolve() == root / "dev/dri" / node
        # sysfs: the bus id's drm directory names the nodes, their dev files the numbers
        pci = root / "sys/bus/pci/devices" / bus
        assert sorted(p.name for p in (pci / "drm").iterdir()) == [card, render]
        assert (pci / "drm" / card / "dev").read_text() == f"{drm}:{g.minor}\n"
        assert (pci / "drm" / render / "dev").read_text() == f"{drm}:{128 + g.minor}\n"
        assert (pci / "vendor").read_text() == "0x10de\n"
        assert (root / "sys/class/drm" / card).resolve() == (pci / "drm" / card).resolve()
        # the proc file that ties the bus id to the nvidia minor
        info = (root / "proc/driver/nvidia/gpus" / bus / "information").read_text()
        assert f"Bus Location: \t {bus}" in info and f"Device Minor: \t {g.minor}" in info
    assert len(os.listdir(root / "dev/dri/by-path")) == 2 * len(sim_host.topology.gpus)
    assert f"{drm} drm" in (root / "proc/devices").read_text().splitlines()


def test_graphics_and_display_files(sim_host: host.SimHost) -> None:
    root = Path(sim_host.root)
    cache = {(e.name, e.arch): e.path for e in ldcache.read(sim_host.root)}
    for fname, soname in host.EXTRA_LIBRARIES.items():
        path = root / host.LIB64 / fname.format(v=VER)
        assert host.read_soname(str(path)) == soname.format(v=VER)
        assert cache[(soname.format(v=VER), "x86-64")] == f"/{host.LIB64}/{soname.format(v=VER)}"
    assert not list((root / host.LIB64).glob("libnvidia-sandboxutils*"))  # not in driver 550
    for path, soname in host.XORG_MODULES.items():
        assert host.read_soname(str(root / path.format(v=VER))) == soname.format(v=VER)
    for b in ("nvidia-xconfig", "nvidia-imex", "nvidia-imex-ctl"):
        assert os.access(root / "usr/bin" / b, os.X_OK)
    platform = root / "usr/share/egl/egl_external_platform.d"
    libs = {json.loads(p.read_text())["ICD"]["library_path"] for p in platform.iterdir()}
    assert libs == {
        so for so in host.EXTRA_LIBRARIES.values() if so.startswith("libnvidia-egl-")
    }
    for p in ("usr/share/vulkan/icd.d/nvidia_icd.x86_64.json", "usr/share/vulkan/icd.d/nvidia_layers.json"):
        assert json.loads((root / p).read_text())["file_format_version"] == "1.0.0"
    assert (root / "usr/share/nvidia/nvoptix.bin").stat().st_size > 0
    for conf in ("10-nvidia.conf", "nvidia-drm-outputclass.conf"):
        assert 'Driver "nvidia"' in (root / "usr/share/X11/xorg.conf.d" / conf).read_text()
    assert (root / "etc/OpenCL/vendors/nvidia.icd").read_text() == "libnvidia-opencl.so.1\n"
    assert stat.S_ISSOCK(os.stat(root / "run/nvidia-fabricmanager/socket").st_mode)


def test_config_toml_points_at_the_sim(sim_host: host.SimHost) -> None:
    cfg = nvconfig.load(sim_host.config_path)
    r = sim_host.root
    assert cfg.driver_root == r
    assert cfg.ldconfig == "/sbin/ldconfig"
    assert cfg.log_file == f"{r}/nvctk.log"
    assert cfg.log_level == "debug"
    assert cfg.state_dir == f"{r}/run/nvctk"
    assert cfg.extra_mounts == (nvconfig.ExtraMount(f"{r}/run/nvidia-sim", "/run/nvidia-sim"),)
    with open(os.path.join(r, "topology.json")) as f:
        assert Topology.from_json(f.read()) == sim_host.topology


def test_cli_init_refuse_force_and_options(tmp_path: Path, run_nvctk: RunNvctk) -> None:
    d = tmp_path / "sim"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    r = run_nvctk("sim", "init", str(d))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"nvctk: {d} is not empty (use --force to rebuild a simulated host there)"
    ]
    r = run_nvctk(
        "sim", "init", str(d), "--force", "--gpus", "3", "--mig", "2:1g.10gb,1g.10gb",
        "--mig", "0:7g.80gb", "--driver-version", "535.104.05", "--cuda-version", "12.2",
        "--memory-mib", "40960", "--product", "NVIDIA A100-SXM4-40GB",
    )
    assert r.returncode == 0, r.stderr
    assert (d / "keep.txt").read_text() == "mine", "--force only replaces the sim's entries"
    topo = host.load(str(d)).topology
    assert topo == make_topology(
        gpus=3, mig={2: ["1g.10gb", "1g.10gb"], 0: ["7g.80gb"]}, driver_version="535.104.05",
        cuda_version="12.2", memory_mib=40960, product="NVIDIA A100-SXM4-40GB",
    )
    assert (d / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.104.05").is_file()
    assert os.path.exists(d / "dev/nvidia2")
    # rebuilding with --force replaces the old driver's files
    r = run_nvctk("sim", "init", str(d), "--force", "--gpus", "1")
    assert r.returncode == 0, r.stderr
    assert not (d / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.104.05").exists()
    assert not os.path.exists(d / "dev/nvidia2")


@pytest.mark.parametrize(
    ("args", "rc", "needles"),
    [
        (["--mig", "0:3g.40gb,9g.99gb"], 1, ["'9g.99gb'", *MIG_PROFILES]),
        (["--mig", "5:1g.10gb"], 1, ["GPU 5"]),
        (["--mig", "0:4g.40gb,4g.40gb"], 1, ["7 slices"]),
        (["--mig", "zero"], 2, ["--mig", "GPU:PROFILE"]),
        (["--gpus", "-1"], 2, ["--gpus"]),
    ],
)
def test_cli_init_bad_options(
    tmp_path: Path, run_nvctk: RunNvctk, args: list[str], rc: int, needles: list[str]
) -> None:
    r = run_nvctk("sim", "init", str(tmp_path / "s"), *args)
    assert r.returncode == rc
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in r.stderr
    if rc == 1:
        assert len(r.stderr.strip().splitlines()) == 1
        assert r.stderr.startswith("nvctk: ")
    assert not (tmp_path / "s").exists() or not os.listdir(tmp_path / "s")


def test_elf_stub_loads_and_ldconfig_reads_it(tmp_path: Path) -> None:
    import ctypes

    p = tmp_path / "libx.so.1.2.3"
    p.write_bytes(host.elf_stub("libx.so.1"))
    ctypes.CDLL(str(p))  # the real dynamic loader accepts it
    assert host.read_soname(str(p)) == "libx.so.1"


@pytest.mark.parametrize("debian", [True, False])
def test_rootfs(tmp_path: Path, sim_host: host.SimHost, debian: bool) -> None:
    sample = sim_host.sample if os.path.exists(sim_host.sample) else "/bin/true"
    root = build_rootfs(str(tmp_path / "r"), debian=debian, with_sample=sample)
    lib = container_lib_dir(root)
    assert lib == ("/usr/lib/x86_64-linux-gnu" if debian else "/usr/lib64")
    assert os.path.exists(f"{root}/etc/debian_version") == debian
    assert os.path.isfile(f"{root}{lib}/libc.so.6")
    assert os.path.exists(f"{root}/lib64/ld-linux-x86-64.so.2")
    assert os.access(f"{root}/usr/local/bin/cuda-vectoradd", os.X_OK)
    names = {e.name for e in ldcache.read(root)}
    assert {"libc.so.6", "libm.so.6", "libdl.so.2"} <= names
    r = subprocess.run(
        ["chroot", root, "/bin/sh", "-c", "ls /usr/local/bin && cat /etc/passwd | head -1"],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "cuda-vectoradd" in r.stdout and r.stdout.endswith("root:x:0:0:root:/root:/bin/sh\n")
    with pytest.raises(host.NvctkError, match="not empty"):
        build_rootfs(root)


def test_rootfs_fixture(rootfs: Callable[..., str]) -> None:
    a, b = rootfs(), rootfs(debian=False, files={"/etc/extra": "/etc/hostname"})
    assert a != b
    assert os.path.isfile(f"{b}/etc/extra")
