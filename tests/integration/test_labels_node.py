"""`nvctk labels --node-name` as its DaemonSet runs it: the simulated node's GFD-style
labels, nvidia.com/gpu.present among them, set on the Node through the official client
and the API-server double, kept current (a stale label of nvctk's removed, nobody else's),
no write when nothing changed, and SIGTERM ends the loop."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from nvctk.k8s.labels import OWNED
from nvctk.sim.host import SimHost
from support import wait
from support.apiserver import kubeconfig, running
from support.exe import nvctk_exe

pytestmark = pytest.mark.slow


def _patches(api: object) -> int:
    return sum(m == "PATCH" for m, _ in api.requests)  # type: ignore[attr-defined]


def test_labels_the_node_once(sim_host: SimHost, tmp_path: Path) -> None:
    env = {**os.environ, **sim_host.env}
    with running() as api:
        api.add_node("node-a", {"kubernetes.io/hostname": "node-a",
                                "nvidia.com/mig-1g.10gb.count": "7",  # nvctk's, stale
                                "nvidia.com/gpu.deploy.operands": "false"})  # another's
        with api.lock:
            api.nodes["node-a"]["metadata"]["annotations"][OWNED] = "nvidia.com/mig-1g.10gb.count"
        argv = [*nvctk_exe(), "labels", "--node-name", "node-a",
                "--kubeconfig", kubeconfig(tmp_path / "kc", api.url)]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got = api.node_labels("node-a")
        assert got["nvidia.com/gpu.present"] == "true"
        assert got["nvidia.com/gpu.count"] == "2"
        assert got["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert "nvidia.com/mig-1g.10gb.count" not in got
        assert got["nvidia.com/gpu.deploy.operands"] == "false"
        assert got["kubernetes.io/hostname"] == "node-a"
        assert _patches(api) == 1
        # again: nothing changed, nothing written
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert _patches(api) == 1


def test_keeps_labels_current_until_sigterm(sim_host: SimHost, tmp_path: Path) -> None:
    env = {**os.environ, **sim_host.env}
    with running() as api:
        api.add_node("node-b")
        argv = [*nvctk_exe(), "labels", "--node-name", "node-b", "--interval", "0.2",
                "--kubeconfig", kubeconfig(tmp_path / "kc", api.url)]
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        try:
            wait.until(lambda: api.node_labels("node-b").get("nvidia.com/gpu.present"), 60,
                       "the labels on node-b")
            # someone removes one: the next round puts it back
            with api.lock:
                del api.nodes["node-b"]["metadata"]["labels"]["nvidia.com/gpu.count"]
            wait.until(lambda: api.node_labels("node-b").get("nvidia.com/gpu.count") == "2",
                       60, "gpu.count set again")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err


def test_unknown_node_is_a_clear_error(sim_host: SimHost, tmp_path: Path) -> None:
    with running() as api:
        r = subprocess.run([*nvctk_exe(), "labels", "--node-name", "nowhere",
                            "--kubeconfig", kubeconfig(tmp_path / "kc", api.url)],
                           env={**os.environ, **sim_host.env}, capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 1
    assert "reading Node nowhere" in r.stderr and "Traceback" not in r.stderr
