"""deployments/: the node DaemonSets as a cluster schedules and starts them (issue 35):
one image (make image's name and version) with a pull policy, GPU nodes selected by labels
that exist (NFD's PCI vendor label, or nvidia.com/gpu.present, which `nvctk labels` sets),
the host's driver mounted where the env says nvctk sees it, and the env naming options
nvctk has; every manifest valid for a 1.36 API server."""

from __future__ import annotations

from typing import Any

import pytest

from nvctk.cli.main import cli
from nvctk.host.inventory import GpuInfo, HostInfo
from nvctk.k8s import config as dpconfig
from nvctk.k8s.labels import PRESENT, node_labels
from support.apiserver import schema_problems
from support.deployments import DEPLOY, manifests
from support.packages import IMAGE

NFD = "feature.node.kubernetes.io/pci-10de.present"
FILES = sorted(p.name for p in DEPLOY.glob("*.yaml"))


def daemonsets() -> list[tuple[str, dict[str, Any]]]:
    return [(f, d) for f in FILES for d in manifests(f) if d["kind"] == "DaemonSet"]


IDS = [d["metadata"]["name"] for _, d in daemonsets()]


def test_every_node_role_has_a_daemonset() -> None:
    assert set(IDS) == {"nvctk-installer", "nvctk-device-plugin", "nvctk-dra-plugin",
                        "nvctk-monitor", "nvctk-labels"}


@pytest.mark.parametrize("name, ds", daemonsets(), ids=IDS)
def test_one_image_with_a_pull_policy(name: str, ds: dict[str, Any]) -> None:
    pod = ds["spec"]["template"]["spec"]
    for c in pod.get("initContainers", []) + pod["containers"]:
        assert c["image"] == IMAGE, (name, c["name"])
        assert c["imagePullPolicy"] in ("IfNotPresent", "Never"), (name, c["name"])
        assert c.get("command"), (name, c["name"])  # the image has no role of its own


@pytest.mark.parametrize("name, ds", daemonsets(), ids=IDS)
def test_gpu_nodes_by_labels_that_exist(name: str, ds: dict[str, Any]) -> None:
    pod = ds["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    keys = [(e["key"], e["operator"], e["values"]) for t in terms for e in t["matchExpressions"]]
    assert keys == [(NFD, "In", ["true"]), (PRESENT, "In", ["true"])]
    # nvctk's label is one `nvctk labels` sets, with that value, on a GPU node
    host = HostInfo("550.54.15", "12.4", (GpuInfo(0, "GPU-0", "NVIDIA H100 80GB HBM3", 0,
                                                  "00000000:01:00.0", 81920, "9.0", "nvidia", False),))
    assert node_labels(host, dpconfig.PluginConfig())[PRESENT] == "true"


NVCTK_ENV = {"NVCTK_DRIVER_ROOT": "--driver-root", "NVCTK_HOST_DRIVER_ROOT": "--host-driver-root",
             "NVCTK_HOOK_PATH": "--hook-path", "NVCTK_VGPU_LIBRARY": "--vgpu-library"}


@pytest.mark.parametrize("name, ds", daemonsets(), ids=IDS)
def test_the_driver_where_the_env_says(name: str, ds: dict[str, Any]) -> None:
    """Each container that names NVCTK_DRIVER_ROOT mounts the driver-root volume there,
    and that volume's host path is NVCTK_HOST_DRIVER_ROOT (the pair a driver container's
    node changes together); the env names options nvctk has (click's envvar)."""
    envvars = {p.envvar for p in cli.params if p.envvar}
    assert set(NVCTK_ENV) <= envvars
    pod = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert "NVCTK_CONFIG" not in env  # the host's config at its own path instead
        if "NVCTK_DRIVER_ROOT" not in env:
            continue
        (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == env["NVCTK_DRIVER_ROOT"]]
        assert m["readOnly"] is True and m["mountPropagation"] == "HostToContainer"
        assert vols[m["name"]]["hostPath"]["path"] == env["NVCTK_HOST_DRIVER_ROOT"]
        etc = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/nvctk"]
        assert etc and vols[etc[0]["name"]]["hostPath"]["path"] == "/etc/nvctk"


@pytest.mark.parametrize("doc", [d for f in ("labels.yaml", "device-plugin.yaml",
                                             "nvctk-installer.yaml", "monitor.yaml")
                                 for d in manifests(f) if d["apiVersion"] != "monitoring.coreos.com/v1"],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_valid_for_a_1_36_api_server(doc: dict[str, Any]) -> None:
    assert schema_problems(doc) == []
