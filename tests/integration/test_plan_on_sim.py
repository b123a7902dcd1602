"""The legacy form (plan_container, tests/support/planning.py) on the simulated hosts: device resolution, nodes, mounts, requirements."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import support.sim as _sim
from nvctk.base import config as nvconfig
from nvctk.base.config import ALL_CAPABILITIES
from nvctk.base.errors import (
    DriverError,
    RequestError,
    RequirementError,
    SpecError,
    UnknownDeviceError,
)
from nvctk.edits import DeviceNode, Edits, Mount, ProcMask, Symlink, Vgpu
from nvctk.host import cache as nvhost
from nvctk.host import driver
from nvctk.host.image import image_facts
from nvctk.host.inventory import proc_bus_id
from nvctk.host.nvml import HostInfo, query_host
from nvctk.oci.rootfs import exists_in_rootfs
from nvctk.plan.devices import plan_drm_links
from nvctk.plan.mounts import container_lib_dirs
from nvctk.request.parse import VGPU_ENV_PREFIXES, request_from_spec
from nvctk.sim.host import SimHost
from nvctk.spec import apply as spec_edits
from nvctk.vgpu import limits as vgpu
from support.planning import make_plan
from support.procs import open_fds

NVD = "NVIDIA_VISIBLE_DEVICES"


cfg, host = _sim.cfg, _sim.host  # fixtures


def spec(env: dict[str, str], **extra: Any) -> dict[str, Any]:
    proc: dict[str, Any] = {"env": [f"{k}={v}" for k, v in env.items()]}
    proc.update(extra)
    return {"process": proc, "root": {"path": "rootfs"}}


def plan_of(s: dict[str, Any], cfg: nvconfig.Config, host: HostInfo | None = None, *,
            bundle: str | None = None, rootfs: str | None = None, **kw: Any) -> Edits | None:
    """The shim's way: the request, the image's facts (from a rootfs or a bundle), the plan."""
    request = request_from_spec(s, cfg)
    if request is None:
        return None
    image = None
    if rootfs is not None:
        image = image_facts({"root": {"path": rootfs}}, "/", vgpu=True)
    elif bundle is not None:
        image = image_facts(s, bundle, vgpu=True)
    return make_plan(request, cfg, host, image, **kw)


def lib_dir(rootfs: str) -> str:
    return container_lib_dirs(image_facts({"root": {"path": rootfs}}, "/"))[0]


def plan(cfg: nvconfig.Config, host: HostInfo, env: dict[str, str], **kw: Any) -> Edits:
    p = plan_of(spec(env), cfg, host, **kw)
    assert p is not None
    return p


def nodes(p: Edits) -> list[str]:
    return [d.path for d in p.devices]


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


# --- the host: cache first, NVML when the cache does not know a device ----------------------


class FakeLoad:
    """nvctk.host.cache.load_host serving `cached` (as from the cache) unless fresh=True."""

    def __init__(self, cached: HostInfo, fresh: HostInfo, from_cache: bool = True) -> None:
        self.cached, self.fresh, self.from_cache = cached, fresh, from_cache
        self.calls: list[tuple[str, str, bool]] = []

    def __call__(self, driver_root: str, state_dir: str, *,
                 fresh: bool = False) -> tuple[HostInfo, bool]:
        self.calls.append((driver_root, state_dir, fresh))
        if fresh:
            return self.fresh, False
        return self.cached, self.from_cache


def test_cached_host_is_used(cfg: nvconfig.Config, host: HostInfo,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    load = FakeLoad(host, host)
    monkeypatch.setattr(nvhost, "load_host", load)
    p = plan_of(spec({NVD: "1"}), cfg)
    assert p is not None and p.gpu_uuids == (host.gpus[1].uuid,)
    assert load.calls == [(cfg.driver_root, cfg.state_dir, False)]


def test_device_unknown_to_cache_asks_nvml(cfg: nvconfig.Config, host: HostInfo,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU (or MIG device) made since the cache was written is found by NVML."""
    stale = host.replace(gpus=host.gpus[:1])
    load = FakeLoad(stale, host)
    monkeypatch.setattr(nvhost, "load_host", load)
    for ident in ("1", host.gpus[1].uuid):
        load.calls.clear()
        p = plan_of(spec({NVD: f"0,{ident}"}), cfg)
        assert p is not None and p.gpu_uuids == (host.gpus[0].uuid, host.gpus[1].uuid)
        assert [c[2] for c in load.calls] == [False, True]
    # unknown to NVML too: the error, after one retry
    load.calls.clear()
    with pytest.raises(UnknownDeviceError, match="'7'"):
        plan_of(spec({NVD: "7"}), cfg)
    assert [c[2] for c in load.calls] == [False, True]


def test_no_retry_when_nvml_answered(cfg: nvconfig.Config, host: HostInfo,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    load = FakeLoad(host, host, from_cache=False)
    monkeypatch.setattr(nvhost, "load_host", load)
    with pytest.raises(RequestError, match="unknown device '7'"):
        plan_of(spec({NVD: "7"}), cfg)
    assert [c[2] for c in load.calls] == [False]


def test_other_request_errors_are_not_retried(cfg: nvconfig.Config, host: HostInfo,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    load = FakeLoad(host, host)
    monkeypatch.setattr(nvhost, "load_host", load)
    with pytest.raises(RequirementError):
        plan_of(spec({NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99"}), cfg)
    assert [c[2] for c in load.calls] == [False]


def test_real_host_cache(sim_host: SimHost, tmp_path: Path) -> None:
    """make_plan through nvctk.host.cache: the first plan fills the cache under state-dir, the
    second is served from it; both plans are the same."""
    cfg = nvconfig.load(sim_host.config_path).replace(state_dir=str(tmp_path / "state"))
    s = spec({NVD: "all"})
    first = plan_of(s, cfg)
    assert os.listdir(tmp_path / "state")  # the cache
    assert nvhost.load_host(cfg.driver_root, cfg.state_dir)[1]  # served from it now
    assert plan_of(s, cfg) == first


# --- driver discovery limited to the request's capabilities ------------------------------


def test_discovery_for_capabilities_matches_full(sim_host: SimHost, host: HostInfo) -> None:
    full = driver.discover_files(sim_host.root, host.driver_version)
    assert full.libraries32 and all(full.libraries.values())
    caps = ALL_CAPABILITIES
    for n in (1, 2, len(caps)):
        for sub in itertools.combinations(caps, n):
            f = driver.discover_files(sim_host.root, host.driver_version, sub)
            for c in sub:
                assert f.libraries.get(c) == full.libraries.get(c), (sub, c)
                assert f.binaries.get(c) == full.binaries.get(c)
                assert f.config_files.get(c) == full.config_files.get(c)
                assert f.sockets.get(c) == full.sockets.get(c)
            wanted = {x for c in sub for x in driver.LIBRARIES.get(c, ())}
            want32 = [h for h in full.libraries32
                      if os.path.basename(h).split(".so", 1)[0] in wanted]
            assert list(f.libraries32) == (want32 if "compat32" in sub else [])
            assert (f.firmware, f.proc_dir, f.dev_dir) == (full.firmware, full.proc_dir,
                                                           full.dev_dir)


@pytest.mark.parametrize("caps", ["all", "utility", "compute", "video", "display",
                                  "video,compat32", "graphics,compat32,utility"])
def test_plan_mounts_as_with_full_discovery(cfg: nvconfig.Config, host: HostInfo,
                                            monkeypatch: pytest.MonkeyPatch, caps: str) -> None:
    """The mounts are those the planner made when it discovered every capability."""
    env = {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": caps}
    p = plan(cfg, host, env)
    real = driver.discover_files
    monkeypatch.setattr(driver, "discover_files",
                        lambda root, version, capabilities=None: real(root, version))
    assert plan(cfg, host, env) == p


# --- the plan file -------------------------------------------------------------------------


def test_plan_json_round_trip() -> None:
    p = Edits(
        driver_version="550.54.15",
        capabilities=("compute", "utility"),
        gpu_uuids=("GPU-a", "GPU-b"),
        devices=(DeviceNode("/dev/nvidia0", "/h/dev/nvidia0", 195, 0),),
        mounts=(Mount("/h/libcuda.so.1", "/usr/lib/libcuda.so.1"),
                Mount("/h/run/sock", "/run/sock", "socket", read_only=False, noexec=True)),
        symlinks=(Symlink("/usr/lib/libcuda.so", "libcuda.so.1"),),
        proc_mask=ProcMask("/h/proc/driver/nvidia", ("0000:1b:00.0",)),
        env={"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/run/nvctk/vgpu/cache"},
        vgpu=Vgpu("/h/libvgpu.so", "/run/nvctk/libvgpu.so", "/run/nvctk/x", "/run/nvctk/vgpu",
                      {"CUDA_DEVICE_MEMORY_LIMIT_0": "1073741824"}),
    )
    text = p.to_json()
    assert Edits.from_json(text) == p
    assert Edits.from_json(text.encode()) == p
    assert json.loads(text) == p.to_dict()  # plain JSON, readable by any tool
    bare = Edits("1", (), ())
    assert Edits.from_json(bare.to_json()) == bare and bare.env == {} and bare.vgpu is None
    assert Edits("1", (), ()).env is not bare.env  # no shared default


def test_vgpu_env_prefixes_cover_vgpu_variables() -> None:
    """plan_vgpu skips nvctk.vgpu.limits when no variable starts with these prefixes."""
    for name in (vgpu.MEMORY_VAR, vgpu.SM_VAR, vgpu.CACHE_VAR, vgpu.RESERVE_VAR):
        assert name.startswith(VGPU_ENV_PREFIXES), name


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
    priv = plan_of(
        spec({NVD: "0", "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"},
             capabilities={"bounding": ["CAP_SYS_ADMIN"]}), cfg, host)
    assert priv is not None
    assert {"/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"} <= set(nodes(priv))


# --- DRM nodes (graphics, display) ------------------------------------------------------------


def _sysfs_drm(root: Path, bus: str, names: list[str]) -> None:
    d = root / "sys/bus/pci/devices" / bus / "drm"
    d.mkdir(parents=True)
    for n in names:
        (d / n).mkdir()


@pytest.mark.parametrize(("names", "want"), [
    (["card1", "renderD129"], ["card1", "renderD129"]),
    (["renderD128", "card0"], ["card0", "renderD128"]),
    (["card10", "card2", "renderD130"], ["card2", "card10", "renderD130"]),
    (["controlD64", "card0", "cardx", "card", "renderD", "card\u0661", "version"], ["card0"]),
    ([], []),
])
def test_drm_node_names(tmp_path: Path, names: list[str], want: list[str]) -> None:
    _sysfs_drm(tmp_path, "0000:1b:00.0", names)
    assert driver.drm_node_names(str(tmp_path), "0000:1b:00.0") == want


def test_drm_node_names_without_nvidia_drm(tmp_path: Path) -> None:
    assert driver.drm_node_names(str(tmp_path), "0000:1b:00.0") == []


def test_drm_links_are_udev_by_path_names() -> None:
    links = plan_drm_links([("0000:1b:00.0", "card1"), ("0000:1b:00.0", "renderD129")])
    assert links == [Symlink("/dev/dri/by-path/pci-0000:1b:00.0-card", "../card1"),
                     Symlink("/dev/dri/by-path/pci-0000:1b:00.0-render", "../renderD129")]


@pytest.mark.parametrize(("caps", "gets_drm"), [
    ("graphics", True), ("display", True), ("compute,utility,graphics", True),
    ("compute,utility", False), ("video", False), ("all", True),
])
def test_drm_nodes_by_capability(cfg: nvconfig.Config, host: HostInfo, sim_host: SimHost,
                                 caps: str, gets_drm: bool) -> None:
    p = plan(cfg, host, {NVD: "1", "NVIDIA_DRIVER_CAPABILITIES": caps})
    g1 = sim_host.topology.gpus[1]
    bus = proc_bus_id(g1.pci_bus_id)
    card, render = f"card{g1.minor}", f"renderD{128 + g1.minor}"
    drm = [d for d in p.devices if d.path.startswith("/dev/dri/")]
    links = [s for s in p.symlinks if s.container_path.startswith("/dev/dri/")]
    if not gets_drm:
        assert drm == [] and links == []
        return
    assert [(d.path, d.major, d.minor) for d in drm] == [
        (f"/dev/dri/{card}", sim_host.drm_major, g1.minor),
        (f"/dev/dri/{render}", sim_host.drm_major, 128 + g1.minor),
    ]
    assert all(d.host_path == os.path.join(sim_host.root, "dev/dri", os.path.basename(d.path))
               for d in drm)
    assert links == [Symlink(f"/dev/dri/by-path/pci-{bus}-card", f"../{card}"),
                     Symlink(f"/dev/dri/by-path/pci-{bus}-render", f"../{render}")]
    # GPU 0's nodes are not the container's
    assert not any(d.path.endswith((f"card{sim_host.topology.gpus[0].minor}",)) for d in drm)


def test_drm_nodes_get_cgroup_rules(cfg: nvconfig.Config, host: HostInfo,
                                    sim_host: SimHost) -> None:

    p = plan(cfg, host, {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "graphics"})
    s: dict[str, Any] = {"linux": {}}
    spec_edits.add_devices(s, p.devices)
    rules = {(r["type"], r["major"], r["minor"], r["access"])
             for r in s["linux"]["resources"]["devices"]}
    minor = sim_host.topology.gpus[0].minor
    assert ("c", sim_host.drm_major, minor, "rwm") in rules
    assert ("c", sim_host.drm_major, 128 + minor, "rwm") in rules


def test_drm_nodes_for_all_gpus_but_not_mig_devices(sim_host_mig: SimHost) -> None:
    cfg = nvconfig.load(sim_host_mig.config_path)
    host = query_host(sim_host_mig.root)
    p = plan(cfg, host, {NVD: "0:1", "NVIDIA_DRIVER_CAPABILITIES": "graphics"})
    assert not [d for d in p.devices if d.path.startswith("/dev/dri/")]
    p = plan(cfg, host, {NVD: "all", "NVIDIA_DRIVER_CAPABILITIES": "graphics"})
    drm = sorted(d.path for d in p.devices if d.path.startswith("/dev/dri/"))
    assert drm == sorted(f"/dev/dri/{n}" for g in sim_host_mig.topology.gpus
                         for n in (f"card{g.minor}", f"renderD{128 + g.minor}"))


def test_drm_listed_node_missing_in_dev_is_a_clear_error(make_sim: Callable[..., SimHost]) -> None:
    sim = make_sim(gpus=1)
    os.unlink(os.path.join(sim.root, "dev/dri/card0"))
    cfg = nvconfig.load(sim.config_path)
    with pytest.raises(DriverError, match=r"dev/dri/card0 is missing"):
        plan(cfg, query_host(sim.root), {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "graphics"})


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                    reason="needs root and runc")
def test_runc_graphics_container_sees_its_drm_nodes(sim_host: SimHost, tmp_path: Path) -> None:
    """A real runc container with NVIDIA_DRIVER_CAPABILITIES=graphics: its GPU's card and
    render nodes, the by-path links to them, and the device cgroup lets it open them
    (ENXIO from the simulated major, never EPERM from the cgroup)."""
    from support.runc import containers

    g1 = sim_host.topology.gpus[1]
    bus = proc_bus_id(g1.pci_bus_id)
    card, render = f"card{g1.minor}", f"renderD{128 + g1.minor}"
    script = (f"ls /dev/dri; echo ==; readlink /dev/dri/by-path/pci-{bus}-card"
              f"; readlink /dev/dri/by-path/pci-{bus}-render; echo ==; "
              f"for n in {card} {render}; do head -c1 /dev/dri/$n >/dev/null; done 2>&1")
    with containers(sim_host, tmp_path) as r:
        b = r.bundle(None, ["sh", "-c", script],
                     ["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=graphics"])
        res = r.run(b)
    assert res.proc.returncode in (0, 1), res.proc.stderr
    nodes_, links, opened = (part.split() if i < 2 else part
                             for i, part in enumerate(res.proc.stdout.split("==\n")))
    assert sorted(nodes_) == sorted(["by-path", card, render])
    assert links == [f"../{card}", f"../{render}"]
    assert "not permitted" not in opened, opened


# --- configuration files per capability (parity with NVIDIA's CDI spec) -----------

OPENCL_ICD = "/etc/OpenCL/vendors/nvidia.icd"
VULKAN_X86_64 = "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json"
EGL_PLATFORMS = tuple(f"/usr/share/egl/egl_external_platform.d/{n}" for n in (
    "09_nvidia_wayland2.json", "10_nvidia_wayland.json", "15_nvidia_gbm.json",
    "20_nvidia_xcb.json", "20_nvidia_xlib.json"))
X_CONFIGS = ("/usr/share/X11/xorg.conf.d/10-nvidia.conf",
             "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf")


@pytest.mark.parametrize(("caps", "present", "absent"), [
    ("compute", (OPENCL_ICD,), (VULKAN_X86_64, *EGL_PLATFORMS, *X_CONFIGS)),
    ("utility", (), (OPENCL_ICD, VULKAN_X86_64, *X_CONFIGS)),
    ("graphics", (VULKAN_X86_64, *EGL_PLATFORMS), (OPENCL_ICD, *X_CONFIGS)),
    ("display", (VULKAN_X86_64, *EGL_PLATFORMS, *X_CONFIGS), (OPENCL_ICD,)),
    ("all", (OPENCL_ICD, VULKAN_X86_64, *EGL_PLATFORMS, *X_CONFIGS), ()),
])
def test_config_files_follow_capabilities(cfg: nvconfig.Config, host: HostInfo, sim_host: SimHost,
                                          caps: str, present: tuple[str, ...],
                                          absent: tuple[str, ...]) -> None:
    """Before: no OpenCL ICD (OpenCL in a container found no platform), no .x86_64 Vulkan
    ICD, two of five EGL platform files and no X configuration."""
    p = plan(cfg, host, {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": caps})
    by = {m.container_path: m for m in p.mounts}
    for path in present:
        m = by[path]
        assert m.host_path == os.path.join(sim_host.root, path.lstrip("/")) and m.read_only
        assert os.path.isfile(m.host_path)
    assert [path for path in absent if path in by] == []
    assert len(p.mounts) == len({m.container_path for m in p.mounts})  # each once
