"""The legacy form (plan_container, tests/support/planning.py) on the simulated hosts:
device resolution, nodes, mounts, requirements, the image's lib dir and lookups that never
leave its rootfs. (The rest: test_plan_on_sim_host.py, the host, discovery and the plan
file; test_plan_on_sim_drm.py, DRM nodes and config files; shared:
tests/support/plan_on_sim.py.)"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import support.sim as _sim
from nvctk.base import config as nvconfig
from nvctk.base.errors import RequestError, RequirementError, SpecError
from nvctk.host import driver
from nvctk.host.image import image_facts
from nvctk.host.inventory import proc_bus_id
from nvctk.host.nvml import HostInfo
from nvctk.oci.rootfs import exists_in_rootfs
from nvctk.plan.mounts import container_lib_dirs
from nvctk.sim.host import SimHost
from support.plan_on_sim import nodes, plan, plan_of, spec
from support.procs import open_fds
from support.runtime import NVD

cfg, host = _sim.cfg, _sim.host  # fixtures


def lib_dir(rootfs: str) -> str:
    return container_lib_dirs(image_facts({"root": {"path": rootfs}}, "/"))[0]


def test_no_gpu(cfg: nvconfig.Config, host: HostInfo) -> None:
    assert plan_of(spec({}), cfg, host) is None
    assert plan_of(spec({NVD: "void"}), cfg, host) is None


@pytest.mark.parametrize("form", ["index", "uuid", "uuid-lower", "pci", "pci-short"])
def test_device_forms(cfg: nvconfig.Config, host: HostInfo, form: str) -> None:
    g = host.gpus[1]
    ident = {
        "index": "1",
        "uuid": g.uuid,
        "uuid-lower": g.uuid.lower(),
        "pci": g.pci_bus_id,
        "pci-short": proc_bus_id(g.pci_bus_id),
    }[form]
    p = plan(cfg, host, {NVD: ident})
    assert p.gpu_uuids == (g.uuid,)
    assert nodes(p) == ["/dev/nvidiactl", "/dev/nvidia1", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert p.proc_mask is not None and p.proc_mask.gpu_bus_ids == (proc_bus_id(g.pci_bus_id),)


def test_order_and_duplicates(cfg: nvconfig.Config, host: HostInfo) -> None:
    g0, g1 = host.gpus
    p = plan(cfg, host, {NVD: f"1,{g0.uuid},0,{g1.pci_bus_id}"})
    assert p.gpu_uuids == (g1.uuid, g0.uuid)
    assert nodes(p)[:3] == ["/dev/nvidiactl", "/dev/nvidia1", "/dev/nvidia0"]


def test_all_and_none(cfg: nvconfig.Config, host: HostInfo) -> None:
    p = plan(cfg, host, {NVD: "all"})
    assert p.gpu_uuids == tuple(g.uuid for g in host.gpus)
    p = plan(cfg, host, {NVD: "none"})
    assert p.gpu_uuids == ()
    assert nodes(p) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert p.mounts  # driver files without a GPU
    assert p.proc_mask is not None and p.proc_mask.gpu_bus_ids == ()


@pytest.mark.parametrize("ident", ["7", "GPU-00000000-0000-0000-0000-000000000000",
                                   "0000:99:00.0", "MIG-nope", "0:0", "bogus"])
def test_unknown_device_named(cfg: nvconfig.Config, host: HostInfo, ident: str) -> None:
    with pytest.raises(RequestError, match=repr(ident).replace("[", r"\[")):
        plan(cfg, host, {NVD: f"0,{ident}"})


def test_node_numbers_from_host(cfg: nvconfig.Config, host: HostInfo, sim_host: SimHost) -> None:
    p = plan(cfg, host, {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "all"})
    by = {d.path: d for d in p.devices}
    assert (by["/dev/nvidiactl"].major, by["/dev/nvidiactl"].minor) == (195, 255)
    assert (by["/dev/nvidia-uvm"].major, by["/dev/nvidia-uvm"].minor) == (sim_host.uvm_major, 0)
    assert by["/dev/nvidia-uvm-tools"].minor == 1
    assert (by["/dev/nvidia-modeset"].major, by["/dev/nvidia-modeset"].minor) == (195, 254)
    assert by["/dev/nvidia0"].host_path == os.path.join(sim_host.root, "dev/nvidia0")


@pytest.mark.parametrize(
    "caps,modeset",
    [
        ("display", True),
        ("compute,display", True),
        ("all", True),
        ("graphics", False),
        ("utility", False),
        ("compute", False),
        ("compute,utility,video,graphics,ngx,compat32", False),  # all but display
        (None, False),  # unset: utility,compute
    ],
)
def test_modeset_node_iff_display(cfg: nvconfig.Config, host: HostInfo, caps: str | None,
                                  modeset: bool) -> None:
    """/dev/nvidia-modeset is planned where the display capability is asked
    for (`all` included), and nowhere else."""
    env = {NVD: "0"}
    if caps is not None:
        env["NVIDIA_DRIVER_CAPABILITIES"] = caps
    p = plan(cfg, host, env)
    assert ("/dev/nvidia-modeset" in nodes(p)) is modeset, (caps, nodes(p))
    assert "/dev/nvidia0" in nodes(p)  # the GPU itself either way


def test_utility_only(cfg: nvconfig.Config, host: HostInfo) -> None:
    p = plan(cfg, host, {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "utility"})
    assert nodes(p) == ["/dev/nvidiactl", "/dev/nvidia0"]  # no uvm without compute/video
    names = {os.path.basename(m.container_path) for m in p.mounts}
    assert "nvidia-smi" in names
    assert not any(n.startswith(("libcuda.", "libnvidia-opencl")) for n in names)
    assert "/run/nvidia-persistenced/socket" in {m.container_path for m in p.mounts}


def test_mounts_follow_capabilities(cfg: nvconfig.Config, host: HostInfo,
                                    sim_host: SimHost) -> None:
    files = driver.discover_files(sim_host.root, host.driver_version)
    p = plan(cfg, host, {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "all"})
    by = {m.container_path: m for m in p.mounts}
    for lib in files.libraries["compute"] + files.libraries["graphics"]:
        m = by[f"{p.lib_dir}/{os.path.basename(lib)}"]
        assert m.host_path == lib and m.read_only
    for fw in files.firmware:
        assert f"/lib/firmware/nvidia/{host.driver_version}/{os.path.basename(fw)}" in by
    sock = by["/run/nvidia-persistenced/socket"]
    assert (sock.kind, sock.read_only, sock.noexec) == ("socket", False, True)
    for _, container in files.config_files["graphics"]:
        assert container in by
    extra = by["/run/nvidia-sim"]  # the sim's config carries an extra mount
    assert extra.kind == "dir"
    links = {s.container_path: s.target for s in p.symlinks}
    # the sim has every capability's libraries: both links are always planned
    assert f"{p.lib_dir}/libGLX_nvidia.so.{host.driver_version}" in by
    assert links[f"{p.lib_dir}/libGLX_indirect.so.0"] == f"libGLX_nvidia.so.{host.driver_version}"
    assert f"{p.lib_dir}/libcuda.so.{host.driver_version}" in by
    assert links[f"{p.lib_dir}/libcuda.so"] == "libcuda.so.1"
    assert p.ldconfig == cfg.ldconfig and p.env == {} and p.vgpu is None


def test_mps_pipe_dir(cfg: nvconfig.Config, host: HostInfo, sim_host: SimHost) -> None:
    # the host side is always the host's /tmp/nvidia-mps; the variable names the container side
    pipe = os.path.join(sim_host.root, "tmp/nvidia-mps")
    os.makedirs(pipe, exist_ok=True)
    try:
        p = plan(cfg, host, {NVD: "0", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/test-mps"})
        m = {m.container_path: m for m in p.mounts}["/tmp/test-mps"]
        assert (m.host_path, m.kind, m.read_only, m.noexec) == (pipe, "dir", False, True)
    finally:
        os.rmdir(pipe)


def test_requirements(cfg: nvconfig.Config, host: HostInfo) -> None:
    plan(cfg, host, {NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.0 brand=tesla"})
    with pytest.raises(RequirementError, match=r"cuda>=12\.6.*12\.4"):
        plan(cfg, host, {NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.6"})
    with pytest.raises(RequirementError, match="brand=tesla"):
        plan(cfg, host, {NVD: "1", "NVIDIA_REQUIRE_BRAND": "brand=tesla"})
    plan(cfg, host, {NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=13", "NVIDIA_DISABLE_REQUIRE": "1"})
    with pytest.raises(RequirementError, match=r"cuda>=99\.1"):  # legacy image
        plan(cfg, host, {"CUDA_VERSION": "99.1.0"})


def test_lib_dir_by_distro(cfg: nvconfig.Config, host: HostInfo,
                           rootfs: Callable[..., str]) -> None:
    deb, other = rootfs(debian=True), rootfs(debian=False)
    assert lib_dir(deb) == "/usr/lib/x86_64-linux-gnu"
    assert lib_dir(other) == "/usr/lib64"
    p = plan(cfg, host, {NVD: "0"}, rootfs=other)
    assert p.lib_dir == "/usr/lib64"
    assert all(not m.container_path.startswith("/usr/lib/x86_64") for m in p.mounts)
    with pytest.raises(SpecError, match="rootfs"):  # bundle/x/rootfs does not exist
        plan_of(spec({NVD: "0"}), cfg, host, bundle=os.path.dirname(deb) + "/x")


@pytest.fixture
def hostile_root(tmp_path: Path) -> tuple[Path, Path]:
    """(root, outside): an image whose links try every way out to `outside`, a host
    directory holding the files the lookups ask for."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for d in ("etc", "usr/lib", "deep/a/b"):
        (root / d).mkdir(parents=True)
    outside.mkdir()
    (outside / "debian_version").write_text("12\n")
    (outside / "etc").mkdir()
    (outside / "etc/debian_version").write_text("12\n")
    (root / "usr/dv").write_text("12\n")
    links = {
        "etc/abs_out": str(outside / "debian_version"),  # absolute, to a host file
        "etc/rel_out": "../../outside/debian_version",  # `..` past the root
        "deep/a/b/rel_out": "../../../../../../outside/debian_version",
        "etc/abs_in": "/usr/dv",  # absolute, inside: fine
        "etc/rel_in": "../usr/dv",
        "etc/chain1": "chain2",  # a chain that ends inside
        "etc/chain2": "/etc/abs_in",
        "etc/chain_out1": "chain_out2",  # a chain that ends outside
        "etc/chain_out2": "../../outside/debian_version",
        "dir_out": str(outside),  # a link to a host directory
        "dir_rel_out": "../outside",
        "dir_in": "usr",
        "rootlink": "/",
        "proc_magic": f"/proc/self/root{outside}/debian_version",
        "etc/loop": "loop",
        "etc/loop_a": "loop_b",
        "etc/loop_b": "loop_a",
        "etc/dangling": "/nonexistent",
        "etc/through_file": "/usr/dv/x",
    }
    for name, target in links.items():
        os.symlink(target, root / name)
    return root, outside


HOSTILE_CASES: list[tuple[str, bool]] = [
    ("/usr/dv", True),
    ("usr/dv", True),
    ("/etc/abs_out", False),
    ("/etc/rel_out", False),
    ("/deep/a/b/rel_out", False),
    ("/etc/abs_in", True),
    ("/etc/rel_in", True),
    ("/etc/chain1", True),
    ("/etc/chain_out1", False),
    ("/dir_out/debian_version", False),
    ("/dir_out/etc/debian_version", False),
    ("/dir_rel_out/debian_version", False),
    ("/dir_in/dv", True),
    ("/dir_in/../usr/dv", True),
    ("/rootlink/usr/dv", True),
    ("/rootlink/../../outside/debian_version", False),
    ("/../../outside/debian_version", False),
    ("/etc/../../outside/debian_version", False),
    ("/proc_magic", False),
    ("/etc/loop", False),
    ("/etc/loop_a", False),
    ("/etc/dangling", False),
    ("/etc/through_file", False),
    ("/usr/dv/x", False),
    ("/usr/dv/..", False),
    ("/etc", True),
    ("/", True),
    ("/nope", False),
]


@pytest.mark.parametrize(("path", "exists"), HOSTILE_CASES)
def test_rootfs_lookup_never_leaves_root(hostile_root: tuple[Path, Path], path: str,
                                         exists: bool) -> None:
    root, _ = hostile_root
    assert exists_in_rootfs(str(root), path) is exists


def test_rootfs_lookup_follows_the_kernel_on_link_to_host_debian_version(
        hostile_root: tuple[Path, Path]) -> None:
    """The case that picks the lib dir: /etc/debian_version pointing at a host file."""
    root, outside = hostile_root
    for target in (str(outside / "debian_version"), "../../outside/debian_version",
                   "/proc/self/root" + str(outside / "debian_version")):
        os.symlink(target, root / "etc/debian_version")
        assert lib_dir(str(root)) == "/usr/lib64"
        os.unlink(root / "etc/debian_version")
    os.symlink("/usr/dv", root / "etc/debian_version")
    assert lib_dir(str(root)) == "/usr/lib/x86_64-linux-gnu"


def test_rootfs_lookup_closes_its_fds(hostile_root: tuple[Path, Path]) -> None:
    root, _ = hostile_root
    before = open_fds()
    for path, _exists in HOSTILE_CASES:
        exists_in_rootfs(str(root), path)
    assert open_fds() - before == set()
    with pytest.raises(SpecError, match="rootfs"):
        exists_in_rootfs(str(root / "absent"), "/etc")
