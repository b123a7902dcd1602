"""`nvctk dra-plugin` as a process: its flags, the API server through a kubeconfig (the
official client against the API-server double), registration with the fake kubelet, a
claim prepared and unprepared, a second plugin refused, SIGTERM ends it leaving no
socket."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost
from support.apiserver import kubeconfig, running
from support.drakubelet import FakeDraKubelet
from support.exe import nvctk_exe

pytestmark = pytest.mark.slow

DRIVER = "gpu.nvctk.io"


def test_the_plugin_process(sim_host: SimHost, tmp_path_factory: pytest.TempPathFactory) -> None:
    top = tmp_path_factory.mktemp("dcli")  # short: socket paths are limited to 107 bytes
    dirs = {k: str(top / k) for k in ("plugins", "registry", "cdi")}
    env = {**os.environ, **sim_host.env, "NODE_NAME": "node-a"}
    with running() as api:
        obj = api.add_claim({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "ns", "name": "c"}, "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-1"}]}}}})
        uid = obj["metadata"]["uid"]
        argv = [*nvctk_exe(), "dra-plugin", "--kubeconfig", str(kubeconfig(top / "kc", api.url)),
                "--plugins-dir", dirs["plugins"], "--registry-dir", dirs["registry"],
                "--cdi-dir", dirs["cdi"]]
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        kl = FakeDraKubelet(dirs["registry"])
        try:
            info = kl.register(DRIVER, timeout=60)
            assert info.endpoint == f"{dirs['plugins']}/{DRIVER}/dra.sock"
            ans = kl.prepare([("ns", "c", uid)])[uid]
            assert ans.error == "" and [d.device_name for d in ans.devices] == ["gpu-1"]
            assert os.listdir(dirs["cdi"]) == [f"k8s.{DRIVER}-claim_{uid}.json"]
            # a second plugin for the driver on this node: refused, the first untouched
            two = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            assert two.returncode == 1
            assert f"another DRA plugin for {DRIVER} runs on this node (pid {proc.pid}" \
                in two.stderr and "Traceback" not in two.stderr
            assert kl.unprepare([("ns", "c", uid)]) == {uid: ""}
            assert os.listdir(dirs["cdi"]) == []
        finally:
            kl.close()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "DRA plugin stopped" in err and "Traceback" not in err
        assert not os.path.exists(f"{dirs['registry']}/{DRIVER}-reg.sock")
        assert not os.path.exists(info.endpoint)


def test_no_node_name_is_a_usage_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    r = subprocess.run([*nvctk_exe(), "dra-plugin"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "no node name: set --node-name or $NODE_NAME" in r.stderr


def test_a_bad_kubeconfig_is_a_clear_error(sim_host: SimHost, tmp_path: Path) -> None:
    bad = tmp_path / "kc"
    bad.write_text("not: [yaml")
    r = subprocess.run([*nvctk_exe(), "dra-plugin", "--node-name", "n", "--kubeconfig", str(bad),
                        "--plugins-dir", str(tmp_path / "p"), "--registry-dir",
                        str(tmp_path / "r"), "--cdi-dir", str(tmp_path / "c")],
                       env={**os.environ, **sim_host.env}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and f"cannot load the kubeconfig {bad}" in r.stderr
    assert "Traceback" not in r.stderr
