"""deployments/: well-formed manifests with the fields the kubelet needs, whose resource
names are ones the device plugin advertises and whose handler is `nvctk configure`'s."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from nvctk.engines.common import EngineRequest
from nvctk.k8s import config as dpconfig
from nvctk.k8s import resources
from nvctk.sim.topology import MIG_PROFILES, make_topology
from support.deployments import DEPLOY, grafana_queries

REPO = Path(__file__).resolve().parents[2]
API = {"Pod": "v1", "ConfigMap": "v1", "DaemonSet": "apps/v1", "RuntimeClass": "node.k8s.io/v1",
       "Service": "v1", "ServiceMonitor": "monitoring.coreos.com/v1",
       "PrometheusRule": "monitoring.coreos.com/v1",
       # the DRA plugin's (checked further by test_dra_deployments.py)
       "ServiceAccount": "v1", "ClusterRole": "rbac.authorization.k8s.io/v1",
       "ClusterRoleBinding": "rbac.authorization.k8s.io/v1",
       "ValidatingAdmissionPolicy": "admissionregistration.k8s.io/v1",
       "ValidatingAdmissionPolicyBinding": "admissionregistration.k8s.io/v1",
       "DeviceClass": "resource.k8s.io/v1", "ResourceClaimTemplate": "resource.k8s.io/v1"}


def docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d is not None:
                out.append((f.name, d))
    return out


def of_kind(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f, d) for f, d in docs() if d["kind"] == kind]


@pytest.mark.parametrize("name, doc", docs(), ids=[f"{f}:{d.get('kind')}" for f, d in docs()])
def test_well_formed(name: str, doc: dict[str, Any]) -> None:
    assert doc["kind"] in API, name
    assert doc["apiVersion"] == API[doc["kind"]], name
    assert doc["metadata"]["name"], name
    if doc["kind"] == "DaemonSet":
        spec = doc["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        vols = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
        for c in spec["template"]["spec"].get("initContainers", []) + \
                spec["template"]["spec"]["containers"]:
            assert c["image"]
            assert {m["name"] for m in c.get("volumeMounts", [])} <= vols, c["name"]


def test_runtimeclass_handler_is_configures() -> None:
    (_, rc), = of_kind("RuntimeClass")
    assert rc["handler"] == EngineRequest().name == "nvidia"
    for f, pod in of_kind("Pod"):
        if pod["spec"].get("resourceClaims"):
            # a DRA claim's CDI spec carries everything: the default handler runs it
            assert "runtimeClassName" not in pod["spec"], f
            continue
        assert pod["spec"]["runtimeClassName"] == rc["metadata"]["name"], f


def plugin_config() -> tuple[dpconfig.PluginConfig, dict[str, Any]]:
    (_, cm), = [(f, d) for f, d in of_kind("ConfigMap") if f == "device-plugin.yaml"]
    return dpconfig.parse(yaml.safe_load(cm["data"]["config.yaml"]), "configmap"), cm


def test_device_plugin_daemonset_uses_its_configmap() -> None:
    _, cm = plugin_config()
    ds = next(d for f, d in of_kind("DaemonSet") if f == "device-plugin.yaml")
    pod = ds["spec"]["template"]["spec"]
    plugin = pod["containers"][0]
    cmd = plugin["command"]
    assert cmd[:2] == ["nvctk", "device-plugin"]
    kdir = cmd[cmd.index("--kubelet-dir") + 1]
    assert kdir == "/var/lib/kubelet/device-plugins"
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["device-plugins"]["hostPath"]["path"] == kdir == mounts["device-plugins"]
    conf = cmd[cmd.index("--config") + 1]
    cm_vol = next(n for n, v in vols.items() if v.get("configMap", {}).get("name")
                  == cm["metadata"]["name"])
    assert conf == f"{mounts[cm_vol]}/config.yaml"


def test_installer_runs_the_images_entrypoint() -> None:
    """The installer image's entrypoint (packaging/image/install.sh): only options it
    knows, the host's / at /host (its default), and --wait (a DaemonSet's container)."""
    ds = next(d for f, d in of_kind("DaemonSet") if f == "nvctk-installer.yaml")
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["/usr/lib/nvctk/install.sh"]  # the image's installer role
    script = (REPO / "packaging" / "image" / "install.sh").read_text()
    known = set(re.findall(r"^\s+(--[a-z-]+)\)", script, re.M))
    flags = [a for a in c["args"] if a.startswith("--")]
    assert "--wait" in flags and set(flags) <= known, (flags, known)
    (m,) = c["volumeMounts"]
    (v,) = [v for v in spec["volumes"] if v["name"] == m["name"]]
    assert m["mountPath"] == "/host" and v["hostPath"]["path"] == "/"
    assert c["image"].rsplit(":", 1)[0] == "localhost/nvctk"  # the one image


def test_pod_resources_are_advertised() -> None:
    """Every extended resource a Pod asks for is one some plugin config advertises."""
    cfg, _ = plugin_config()
    host_mig = make_topology(gpus=2, mig={0: ["1g.10gb", "1g.10gb"]})
    from support.k8s import host_of

    names = {r.name for r in resources.build(cfg, host_of(host_mig))}
    for other in ({}, {"sharing": {"mps": {}}}):  # the default config, and MPS
        names |= {r.name for r in resources.build(dpconfig.parse(
            {"version": "v1", **other}), host_of(make_topology(gpus=1)))}
    assert {"nvidia.com/gpu", "nvidia.com/vgpu", "nvidia.com/mig-1g.10gb",
            "nvidia.com/mps-core", "nvidia.com/mps-memory"} <= names
    asked = {}
    for f, pod in of_kind("Pod"):
        for c in pod["spec"]["containers"]:
            for k, v in c.get("resources", {}).get("limits", {}).items():
                if k.startswith("nvidia.com/"):
                    asked[k] = (f, v)
    assert asked, "no example Pod asks for a GPU resource"
    for k, (f, v) in asked.items():
        assert k in names or k.removeprefix("nvidia.com/mig-") in MIG_PROFILES, (f, k)
        assert isinstance(v, int) and v > 0, (f, k)
    assert asked["nvidia.com/mps-core"][1] == 50 and asked["nvidia.com/mps-memory"][1] == 8


def test_monitor_daemonset_service_and_servicemonitor() -> None:
    """The monitor's port is the Service's target and the ServiceMonitor's endpoint; every
    host path it mounts is read-only and covers the runtime roots it is told to read."""
    ds = next(d for f, d in of_kind("DaemonSet") if f == "monitor.yaml")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["nvctk", "monitor"]
    port = int(cmd[cmd.index("--listen") + 1].rsplit(":", 1)[1])
    (cport,) = c["ports"]
    assert cport["containerPort"] == port
    assert pod["hostPID"] is True  # NVML's host pids must be this Pod's pids
    assert pod["runtimeClassName"] == of_kind("RuntimeClass")[0][1]["metadata"]["name"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = c["volumeMounts"]
    assert mounts and all(m.get("readOnly") is True for m in mounts), mounts
    assert all("hostPath" in vols[m["name"]] for m in mounts)
    paths = [m["mountPath"] for m in mounts]
    roots = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--runtime-root"]
    roots.append(cmd[cmd.index("--pod-resources-socket") + 1])
    assert roots and all(any(r == p or r.startswith(p + "/") for p in paths) for r in roots)
    # nothing made on the node; no runtime's API socket within reach; no privilege
    assert all(v["hostPath"].get("type") == "Directory" for v in pod["volumes"]), pod["volumes"]
    for sock in ("/run/containerd/containerd.sock", "/run/k3s/containerd/containerd.sock",
                 "/run/docker.sock", "/run/docker/containerd/containerd.sock",
                 "/run/crio/crio.sock"):
        assert not any(sock.startswith(p.rstrip("/") + "/") for p in paths), (sock, paths)
    sc = c["securityContext"]
    assert sc.get("privileged") is not True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["readOnlyRootFilesystem"] is True
    # the node's name for the Hostname label; a liveness probe on the stall-aware health check
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    (_, svc), = of_kind("Service")
    assert svc["spec"]["selector"].items() <= pod_labels(ds).items()
    (sport,) = svc["spec"]["ports"]
    assert sport["targetPort"] in (cport["name"], port)
    (_, sm), = of_kind("ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [sport["name"]]
    # the series' own namespace/pod/container, not the monitor Pod's (prometheus-operator)
    assert all(e["honorLabels"] is True for e in sm["spec"]["endpoints"])
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]


def test_monitor_ships_compat_and_alerts_on_its_own_series() -> None:
    """The DaemonSet turns --compat on (dcgm-exporter's and HAMi's series: their dashboards
    work unchanged); the PrometheusRule's alerts read only series the monitor exports,
    and its scrape-health alert names the job prometheus-operator gives the Service."""
    import re

    from nvctk.cli.monitor_cmd import monitor
    from nvctk.monitor.compat import parse_formats
    ds = next(d for f, d in of_kind("DaemonSet") if f == "monitor.yaml")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    opt = next(p for p in monitor.params if p.name == "compat")
    assert opt.envvar == "NVCTK_MONITOR_COMPAT"
    assert parse_formats(env["NVCTK_MONITOR_COMPAT"]) == ("dcgm", "hami")
    (_, rule), = of_kind("PrometheusRule")
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == {
        "NvctkContainerAtMemoryCap", "NvctkContainerSMShareSaturated", "NvctkGPUOverPromised",
        "NvctkGPUXid", "NvctkGPULost", "NvctkMonitorProblems", "NvctkMonitorStale", "NvctkMonitorDown"}
    known = monitor_series() | {"up"}
    for r in rules:
        names = set(re.findall(r"\b(nvctk_\w+|up)\b", r["expr"]))
        assert names and names <= known, (r["alert"], names - known)
        assert r["labels"]["severity"] in ("info", "warning", "critical")
    (_, svc), = of_kind("Service")
    down = next(r for r in rules if r["alert"] == "NvctkMonitorDown")
    assert f'job="{svc["metadata"]["name"]}"' in down["expr"]


def pod_labels(ds: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = ds["spec"]["template"]["metadata"]["labels"]
    return labels


def monitor_series() -> set[str]:
    """Every series name `nvctk monitor` serves (a counter's with its _total)."""
    from nvctk.monitor.prom import COUNTERS, METRICS

    return set(METRICS) | {f"{name}_total" for name in COUNTERS}


def test_grafana_dashboard_uses_only_the_monitors_metrics() -> None:
    known = monitor_series()
    queries = grafana_queries()
    assert len(queries) >= 10
    for q in queries:
        names = set(re.findall(r"\b(nvctk_[a-z_]+)\b", q))
        assert names and names <= known, q
