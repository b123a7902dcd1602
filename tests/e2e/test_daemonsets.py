"""Each shipped DaemonSet runs from its manifest, unedited (issue 35): the Pod template read
from deployments/ is run by podman as a kubelet would run it (support/podkubelet.py:
hostPath volumes, mount propagation, downward-API env, securityContext, command and args,
the in-cluster config), from `make image`'s image, on a simulated node whose / is a dir
of the test's with the simulated driver at that /:
- the installer checks the driver, installs nvctk, configures containerd 2.3.4 and
  restarts it (SIGHUP; a supervisor starts it again, as systemd does) until its CRI lists
  the `nvidia` handler; deleted (SIGTERM), it undoes all of it;
- the DRA plugin publishes slices to the API-server double and prepares a claim for the
  fake kubelet, its CDI spec naming the node's paths (never the container's);
- the device plugin registers with the fake kubelet;
- `nvctk labels` sets nvidia.com/gpu.present and the GFD labels on its Node;
- the monitor (through the node's nvidia handler, nvctk-runtime) serves metrics.
Runs in the parallel phase: its mounts are under its own dir (no test observing the host's
whole mount table runs then), and the monitor's fixed port 9400 (the manifest's, on the
node's network) is no other test's; the image is the run's one build (built_image)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.engines import restart
from nvctk.sim import host as simhost
from nvctk.sim.topology import make_topology
from support import wait
from support.apiserver import ApiServer, running
from support.cri import containerd2_cri_config
from support.daemons import (
    CONTAINERD_2_TAR,
    peer_bin,
    short_dir,
    supervised_containerd,
    umount_below,
)
from support.deployments import manifests
from support.drakubelet import FakeDraKubelet
from support.kubelet import FakeKubelet
from support.packages import IMAGE
from support.podkubelet import (
    Node,
    private_node,
    remove_all,
    run_daemonset,
    shared_root,
    stop,
    wrapper_runtime,
)

pytestmark = [pytest.mark.slow]

NODE = "node-a"
DRIVER = "gpu.nvctk.io"
HOOK = "/usr/local/nvctk/bin/nvctk-hook"
RUNTIME = os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")


def daemonset(file: str) -> dict[str, Any]:
    (ds,) = [d for d in manifests(file) if d["kind"] == "DaemonSet"]
    return ds


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """The API-server double over HTTPS, as a Pod's in-cluster config reaches it."""
    with running(tls_dir=tmp_path_factory.mktemp("tls")) as server:
        yield server


@pytest.fixture(scope="module")
def node(built_image: Path, api: ApiServer) -> Iterator[Node]:
    if os.geteuid() != 0:
        pytest.skip("needs root: podman, mounts")
    with short_dir("nvctk-ds-") as d:
        root = d / "n"
        simhost.init(str(root), make_topology(gpus=2))
        for p in ("var/lib/kubelet/device-plugins", "var/lib/kubelet/plugins_registry",
                  "var/lib/kubelet/plugins", "var/lib/kubelet/pod-resources",
                  "run/containerd/runc", "run/containerd/io.containerd.runtime.v2.task",
                  "etc/containerd"):
            (root / p).mkdir(parents=True, exist_ok=True)
        shared_root(root)
        n = private_node(root, d / "pm", NODE)
        n.api_port, n.ca_file = api.port, api.ca_file
        api.add_node(NODE)
        n.configmaps = {cm["metadata"]["name"]: cm["data"]
                        for cm in manifests("device-plugin.yaml") if cm["kind"] == "ConfigMap"}
        # the node's `nvidia` handler: nvctk-runtime with the node's config
        n.runtime = wrapper_runtime(d / "rt" / "nvctk-runtime", RUNTIME,
                                    {"NVCTK_CONFIG": str(root / "config.toml")})
        try:
            n.run("load", "-i", str(built_image), timeout=600)
            yield n
        finally:
            remove_all(n)
            umount_below(root)


def test_device_plugin_registers(node: Node, tmp_path: Path) -> None:
    kubelet = FakeKubelet(str(node.host("/var/lib/kubelet/device-plugins"))).start()
    try:
        (name,) = run_daemonset(node, daemonset("device-plugin.yaml"), IMAGE, tmp_path)
        try:
            # the ConfigMap's sharing: 4 vGPU shares of each GPU
            kubelet.wait_for(["nvidia.com/vgpu"], timeout=120)
        except TimeoutError as e:
            raise AssertionError(f"{e}; the Pod's log:\n{node.logs(name)}")
        devices = kubelet.plugins["nvidia.com/vgpu"].wait_list(lambda d: len(d) == 8, 60)
        assert set(devices.values()) == {"Healthy"}
        assert stop(node, name) == 0, node.logs(name)
    finally:
        kubelet.stop()


def test_dra_plugin_publishes_and_prepares(node: Node, api: ApiServer, tmp_path: Path) -> None:
    kl = FakeDraKubelet(str(node.host("/var/lib/kubelet/plugins_registry")), str(node.root))
    (name,) = run_daemonset(node, daemonset("dra-plugin.yaml"), IMAGE, tmp_path)
    try:
        try:
            kl.register(DRIVER, timeout=120)
        except AssertionError as e:
            raise AssertionError(f"{e}; the Pod's log:\n{node.logs(name)}")
        wait.until(lambda: api.pool(DRIVER, NODE), 60, "the node's ResourceSlices")
        devices = {d["name"] for s in api.pool(DRIVER, NODE) for d in s["spec"].get("devices", [])}
        assert {"gpu-0", "gpu-1"} <= devices
        claim = api.add_claim({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "ns", "name": "c"}, "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}]}}}})
        uid = claim["metadata"]["uid"]
        ans = kl.prepare([("ns", "c", uid)])[uid]
        assert ans.error == "", ans.error
        (spec_file,) = node.host("/var/run/cdi").glob(f"*{uid}*")
        spec = json.loads(spec_file.read_text())
        text = json.dumps(spec)
        assert str(node.root) not in text and "/driver-root" not in text, text
        edits = [spec["containerEdits"], *(x["containerEdits"] for x in spec["devices"])]
        hosts = [m["hostPath"] for e in edits for k in ("mounts", "deviceNodes")
                 for m in e.get(k, ()) if m.get("hostPath")]
        assert "/dev/nvidia1" in hosts
        assert all(node.host(h).exists() for h in hosts), hosts  # the node's own paths
        assert {h["path"] for e in edits for h in e.get("hooks", ())} == {HOOK}
        assert kl.unprepare([("ns", "c", uid)]) == {uid: ""}
        assert not spec_file.exists()
        assert stop(node, name) == 0, node.logs(name)
    finally:
        kl.close()


def test_labels_set_on_the_node(node: Node, api: ApiServer, tmp_path: Path) -> None:
    (name,) = run_daemonset(node, daemonset("labels.yaml"), IMAGE, tmp_path)
    try:
        wait.until(lambda: api.node_labels(NODE).get("nvidia.com/gpu.present") == "true", 120,
                   "nvidia.com/gpu.present on the node")
    except AssertionError as e:
        raise AssertionError(f"{e}; the Pod's log:\n{node.logs(name)}")
    got = api.node_labels(NODE)
    assert got["nvidia.com/gpu.count"] == "2"
    assert stop(node, name) == 0, node.logs(name)


def test_monitor_serves_metrics(node: Node, tmp_path: Path) -> None:
    (name,) = run_daemonset(node, daemonset("monitor.yaml"), IMAGE, tmp_path)

    def metrics() -> str:
        try:
            with urllib.request.urlopen("http://127.0.0.1:9400/metrics", timeout=5) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    try:
        text = wait.until(lambda: "nvctk_gpu" in metrics() and metrics(), 120, "/metrics")
    except AssertionError as e:
        raise AssertionError(f"{e}; the Pod's log:\n{node.logs(name)}")
    assert "nvctk_gpu_memory_total_bytes" in text
    assert stop(node, name, 90) == 0, node.logs(name)


def test_installer_restarts_containerd_and_undoes_it(node: Node, tmp_path: Path) -> None:
    with peer_bin(CONTAINERD_2_TAR, "nvctk-dsc-") as bin2, node_containerd(node, bin2) as sock:
        original = node.host("/etc/containerd/config.toml").read_bytes()
        (name,) = run_daemonset(node, daemonset("nvctk-installer.yaml"), IMAGE, tmp_path)
        try:
            restart.wait_for(restart.Restart("containerd", socket=sock, timeout=180), "nvidia",
                             True)
        except restart.EngineError as e:
            raise AssertionError(f"{e}; the Pod's log:\n{node.logs(name)}")
        prefix = node.host("/usr/local/nvctk")
        assert (prefix / "bin/nvctk-runtime").is_file() and (prefix / "bin/nvctk-hook").is_file()
        config = node.host("/etc/nvctk/config.toml").read_text()
        assert 'driver-root = "/"' in config and f'hook-path = "{HOOK}"' in config
        wait.until(lambda: "containerd answers with runtime 'nvidia'" in node.logs(name), 60,
                   "the installer's word that containerd serves the runtime")
        # the Pod deleted: everything undone, containerd restarted without the runtime
        assert stop(node, name) == 0, node.logs(name)
        assert "nvidia" not in restart.handlers("containerd", sock)
        assert not prefix.exists() and not node.host("/etc/nvctk/config.toml").exists()
        assert node.host("/etc/containerd/config.toml").read_bytes() == original


@contextlib.contextmanager
def node_containerd(node: Node, bin2: Path) -> Iterator[str]:
    """containerd 2.3.4 as the node's (its config at the node's /etc/containerd, its
    socket at /run/containerd/containerd.sock), started again when it exits; its socket."""
    work = node.host("/var/lib/containerd-test")
    work.mkdir(parents=True, exist_ok=True)
    default = subprocess.run([str(bin2 / "containerd"), "config", "default"],
                             capture_output=True, text=True, check=True).stdout
    sock = str(node.host("/run/containerd/containerd.sock"))
    cfg = node.host("/etc/containerd/config.toml")
    cfg.write_text(containerd2_cri_config(work, "nvctk.test/pause:1", default).replace(
        f'"{work}/containerd.sock"', f'"{sock}"'))
    with supervised_containerd(work, bin2, cfg, sock):
        yield sock
