"""The legacy form on the simulated hosts: DRM nodes (graphics, display) and the
driver's configuration files per capability. (The rest: test_plan_on_sim_devices.py,
test_plan_on_sim_host.py; shared: tests/support/plan_on_sim.py.)"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import support.sim as _sim
from nvctk.base import config as nvconfig
from nvctk.base.errors import DriverError
from nvctk.edits import Symlink
from nvctk.host import driver
from nvctk.host.inventory import proc_bus_id
from nvctk.host.nvml import HostInfo, query_host
from nvctk.plan.devices import plan_drm_links
from nvctk.sim.host import SimHost
from nvctk.spec import apply as spec_edits
from support.plan_on_sim import plan
from support.runtime import NVD

cfg, host = _sim.cfg, _sim.host  # fixtures


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
