"""`nvctk dra-plugin` publishes its node's ResourceSlices: the real command on a
simulated host, the official client talking to the API-server double through a
kubeconfig; every slice checked against the 1.36 resource.k8s.io/v1 schema and limits."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nvctk.dra.devices import DEFAULT_DRIVER
from nvctk.host.nvml import query_host
from nvctk.sim.host import SimHost
from support import wait
from support.apiserver import kubeconfig, pool_problems, running
from support.exe import nvctk_exe


def complete(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """slices when they are a whole pool (one generation, all its slices), else []."""
    return slices if slices and pool_problems(slices) == [] else []


@pytest.mark.slow
def test_the_plugin_publishes_its_nodes_pool(sim_host_mig: SimHost, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host's device nodes)")
    h = query_host(sim_host_mig.root)
    want = [n for g in h.gpus for n in (f"gpu-{g.index}", *(f"gpu-{g.index}-mig-{m.index}"
                                                          for m in g.mig_devices))]
    with running() as api:
        cmd = [*nvctk_exe(), "dra-plugin", "--kubeconfig",
               kubeconfig(tmp_path / "kubeconfig", api.url), "--node-name", "node-a",
               "--plugins-dir", str(tmp_path / "plugins"),
               "--registry-dir", str(tmp_path / "registry"), "--cdi-dir", str(tmp_path / "cdi")]
        env = {**os.environ, "NVCTK_CONFIG": sim_host_mig.config_path}
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        try:
            slices = wait.until(lambda: complete(api.pool(DEFAULT_DRIVER, "node-a")), 60,
                                "the plugin's ResourceSlices, all of its pool")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert api.rejected() == []
        assert [d["name"] for s in slices for d in s["spec"].get("devices") or ()] == want
