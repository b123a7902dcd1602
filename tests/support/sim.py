"""Simulated hosts for tests: module-scoped views of the session's (its nvctk config and
what NVML reports of it, re-bound by the files that use them: `cfg, host = _sim.cfg,
_sim.host`), and own_sim() for a module that needs a host of its own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import config as nvconfig
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
