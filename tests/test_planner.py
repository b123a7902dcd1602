"""make_plan on the simulated hosts: device resolution, nodes, mounts, requirements."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from nvctk import config as nvconfig
from nvctk import driver
from nvctk.errors import RequestError, RequirementError, SpecError
from nvctk.mount import exists_in_rootfs
from nvctk.nvml import HostInfo, query_host
from nvctk.plan import Plan
from nvctk.planner import container_lib_dirs, make_plan, proc_bus_id
from nvctk.sim.host import SimHost

NVD = "NVIDIA_VISIBLE_DEVICES"


@pytest.fixture(scope="module")
def cfg(sim_host: SimHost) -> nvconfig.Config:
    return nvconfig.load(sim_host.config_path)


@pytest.fixture(scope="module")
def host(sim_host: SimHost) -> HostInfo:
    return query_host(sim_host.root)


def spec(env: dict[str, str], **extra: Any) -> dict[str, Any]:
    proc: dict[str, Any] = {"env": [f"{k}={v}" for k, v in env.items()]}
    proc.update(extra)
    return {"process": proc, "root": {"path": "rootfs"}}


def plan(cfg: nvconfig.Config, host: HostInfo, env: dict[str, str], **kw: Any) -> Plan:
    p = make_plan(spec(env), cfg, host, **kw)
    assert p is not None
    return p


def nodes(p: Plan) -> list[str]:
    return [d.path for d in p.devices]


def test_no_gpu(cfg: nvconfig.Config, host: HostInfo) -> None:
    assert make_plan(spec({}), cfg, host) is None
    assert make_plan(spec({NVD: "void"}), cfg, host) is None


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
    assert container_lib_dirs(deb)[0] == "/usr/lib/x86_64-linux-gnu"
    assert container_lib_dirs(other)[0] == "/usr/lib64"
    p = plan(cfg, host, {NVD: "0"}, rootfs=other)
    assert p.lib_dir == "/usr/lib64"
    assert all(not m.container_path.startswith("/usr/lib/x86_64") for m in p.mounts)
    with pytest.raises(SpecError, match="rootfs"):  # bundle/x/rootfs does not exist
        make_plan(spec({NVD: "0"}), cfg, host, bundle=os.path.dirname(deb) + "/x")


def test_rootfs_lookup_never_leaves_root(tmp_path: Any) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "debian_version").write_text("12\n")
    os.symlink(str(outside / "debian_version"), root / "etc/debian_version")
    assert not exists_in_rootfs(str(root), "/etc/debian_version")
    os.unlink(root / "etc/debian_version")
    os.symlink("../../outside/debian_version", root / "etc/debian_version")
    assert not exists_in_rootfs(str(root), "/etc/debian_version")
    os.unlink(root / "etc/debian_version")
    (root / "usr").mkdir()
    (root / "usr/dv").write_text("12\n")
    os.symlink("/usr/dv", root / "etc/debian_version")  # absolute, inside the root
    assert exists_in_rootfs(str(root), "/etc/debian_version")


def test_mig(sim_host_mig: SimHost) -> None:
    cfg = nvconfig.load(sim_host_mig.config_path)
    host = query_host(sim_host_mig.root)
    g0 = host.gpus[0]
    assert len(g0.mig_devices) == 3, g0  # MIG_LAYOUT in conftest
    topo = {m.uuid: m for m in sim_host_mig.topology.gpus[0].mig_devices}
    m1 = g0.mig_devices[1]
    for ident in (m1.uuid, m1.uuid.lower(), "0:1"):
        p = plan(cfg, host, {NVD: ident})
        caps = [d for d in p.devices if d.path.startswith("/dev/nvidia-caps/")]
        t = topo[m1.uuid]
        assert [c.minor for c in caps] == [t.gi_cap_minor, t.ci_cap_minor]
        assert all(c.major == sim_host_mig.caps_major for c in caps)
        assert "/dev/nvidia0" in nodes(p)  # the parent GPU
        assert p.gpu_uuids == (g0.uuid,)
    priv = make_plan(
        spec({NVD: "0", "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"},
             capabilities={"bounding": ["CAP_SYS_ADMIN"]}), cfg, host)
    assert priv is not None
    assert {"/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"} <= set(nodes(priv))
