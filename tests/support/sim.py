"""Module-scoped views of the session's simulated host: its nvctk config and what NVML
reports of it (re-bound by the files that use them: `cfg, host = _sim.cfg, _sim.host`)."""

from __future__ import annotations

import pytest

from nvctk.base import config as nvconfig
from nvctk.host.inventory import HostInfo
from nvctk.host.nvml import query_host
from nvctk.sim.host import SimHost


@pytest.fixture(scope="module")
def cfg(sim_host: SimHost) -> nvconfig.Config:
    return nvconfig.load(sim_host.config_path)


@pytest.fixture(scope="module")
def host(sim_host: SimHost) -> HostInfo:
    return query_host(sim_host.root)
