"""Simulated hosts for tests: module-scoped views of the session's (its nvctk config and
what NVML reports of it, re-bound by the files that use them: `cfg, host = _sim.cfg,
_sim.host`), and own_sim() for a module that needs a host of its own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nvctk import _sys
from nvctk.base import config as nvconfig
from nvctk.base import mounts
from nvctk.host.inventory import HostInfo
from nvctk.host.nvml import query_host
from nvctk.sim import host as simhost
from nvctk.sim.host import SimHost
from nvctk.sim.topology import make_topology


@pytest.fixture(scope="module")
def cfg(sim_host: SimHost) -> nvconfig.Config:
    return nvconfig.load(sim_host.config_path)


@pytest.fixture(scope="module")
def host(sim_host: SimHost) -> HostInfo:
    return query_host(sim_host.root)


def own_sim(factory: pytest.TempPathFactory, name: str, **topology: Any) -> SimHost:
    """A simulated host of a module's own (make_topology(**topology)); skips without root."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    return simhost.init(str(factory.mktemp(name) / "host"), make_topology(**topology))


def sim_in(work: Path, **topology: Any) -> SimHost:
    """A simulated host in work/sim (make_topology(**topology)), for a module's own
    daemons."""
    return simhost.init(str(work / "sim"), make_topology(**topology))


def assert_mig_view(smi: str, caps: str, gpu: Any, mig: Any) -> None:
    """A container given one MIG device: `nvidia-smi -L` lists its GPU and only that
    device, and /dev/nvidia-caps holds just its GPU and compute instance caps."""
    assert smi.splitlines() == [
        f"GPU 0: {gpu.name} (UUID: {gpu.uuid})",
        f"  MIG {mig.profile:<11} Device  0: (UUID: {mig.uuid})",
    ]
    assert sorted(caps.split()) == sorted(
        [f"nvidia-cap{mig.gi_cap_minor}", f"nvidia-cap{mig.ci_cap_minor}"])


def show_sim_pci(sim_root: str) -> None:
    """In the calling process (a test's preexec_fn, or a bench before it starts
    anything): a mount namespace of its own, nothing propagating to the host's, where
    /sys/bus/pci/devices and /sys/devices/pci* are the simulated host's.

    NVIDIA's toolkit reads each GPU's DRM nodes from the running kernel's /sys, never
    from its driver root, so on the simulated host it finds none and its spec does less
    than on a real host with nvidia-drm loaded; seen through this view, its spec holds
    the DRM nodes and by-path links a real host's would. A /sys/devices/pci* the host
    lacks is left out (sysfs takes no new directories): NCT then finds no DRM nodes.
    """
    _sys.unshare(mounts.CLONE_NEWNS)
    _sys.mount(None, "/", None, mounts.MS_REC | mounts.MS_SLAVE, None)
    sys_dir = Path(sim_root) / "sys"
    _sys.mount(sys_dir / "bus/pci/devices", "/sys/bus/pci/devices", None, mounts.MS_BIND, None)
    for d in sorted(sys_dir.glob("devices/pci*")):
        dst = Path("/sys/devices") / d.name
        if dst.is_dir():
            _sys.mount(d, dst, None, mounts.MS_BIND, None)
