"""deployments/ for DRA: every manifest valid for a 1.36 API server (the strict schema
kubernetes-validate ships), the DeviceClasses' CEL selecting the devices the driver
publishes (evaluated by a CEL implementation), the example claim fitting the published
request policy, the DaemonSet running the real command with its real flags, and the
admission policy letting the plugin write its own node's slices only."""

from __future__ import annotations

from typing import Any

import pytest

from nvctk.base.config import Config
from nvctk.cli.dra_plugin import dra_plugin
from nvctk.dra.devices import DEFAULT_DRIVER
from nvctk.dra.slices import node_pool
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from support.apiserver import quantity, schema_problems
from support.deployments import cel_device, cel_eval, manifests

D = DEFAULT_DRIVER
FILES = ("dra-deviceclasses.yaml", "dra-plugin.yaml", "pod-dra-share.yaml")


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [d for f in FILES for d in manifests(f)
              if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


@pytest.mark.parametrize("doc", [d for f in FILES for d in manifests(f)],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_valid_for_a_1_36_api_server(doc: dict[str, Any]) -> None:
    assert schema_problems(doc) == []


def test_the_schema_check_sees_a_misspelt_field() -> None:
    tmpl = one("ResourceClaimTemplate")
    req = tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    req["capacity"] = {"request": req["capacity"]["requests"]}  # "requests"
    assert schema_problems(tmpl) != []


# --- the DeviceClasses on what the driver publishes -------------------------------------------


def host() -> HostInfo:
    gpus = [GpuInfo(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", i, f"00000000:{i + 1:02X}:00.0",
                    81920, "9.0", "nvidia", i == 2,
                    tuple(MigInfo(m, f"MIG-{i}-{m}", m + 1, 0, "1g.10gb", 9856)
                          for m in range(2)) if i == 2 else ())
            for i in range(3)]
    return HostInfo("550.54.15", "12.4", tuple(gpus))


def selected(cls: dict[str, Any], devices: tuple[dict[str, Any], ...]) -> list[str]:
    exprs = [s["cel"]["expression"] for s in cls["spec"]["selectors"]]
    return [d["name"] for d in devices
            if all(cel_eval(e, device=cel_device(d, D)) for e in exprs)]


@pytest.mark.parametrize(("cls", "want"), [
    ("gpu.nvctk.io", ["gpu-0", "gpu-1"]),
    ("gpu-share.nvctk.io", ["gpu-0", "gpu-1"]),
    ("mig.nvctk.io", ["gpu-2-mig-0", "gpu-2-mig-1"]),
])
def test_each_device_class_selects_its_devices(cls: str, want: list[str]) -> None:
    pool = node_pool(host(), D, {})
    assert selected(one("DeviceClass", cls), pool.devices) == want


def test_another_drivers_devices_are_not_selected() -> None:
    dev = node_pool(host(), D, {}).devices[0]
    for cls in ("gpu.nvctk.io", "gpu-share.nvctk.io"):
        exprs = [s["cel"]["expression"] for s in one("DeviceClass", cls)["spec"]["selectors"]]
        assert not all(cel_eval(e, device=cel_device(dev, "gpu.nvidia.com")) for e in exprs)


def test_the_share_class_asks_for_a_capped_share() -> None:
    (cfg,) = one("DeviceClass", "gpu-share.nvctk.io")["spec"]["config"]
    assert cfg["opaque"]["driver"] == D
    assert cfg["opaque"]["parameters"] == {"apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig",
                                           "sharing": {"strategy": "VGpu"}}


def test_the_example_claim_fits_a_gpus_request_policy() -> None:
    tmpl = one("ResourceClaimTemplate")
    (req,) = tmpl["spec"]["spec"]["devices"]["requests"]
    asked = {k: quantity(v) for k, v in req["exactly"]["capacity"]["requests"].items()}
    assert asked == {"memory": 2 << 30}
    gpu = node_pool(host(), D, {}).devices[0]
    for name, amount in asked.items():
        cap = gpu["capacity"][name]
        rng = cap["requestPolicy"]["validRange"]
        assert quantity(rng["min"]) <= amount <= quantity(cap["value"])
        assert (amount - quantity(rng["min"])) % quantity(rng["step"]) == 0
    pod = one("Pod", "cuda-dra-share")
    (claim,) = pod["spec"]["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == tmpl["metadata"]["name"]
    assert [c["claims"] for c in (x["resources"] for x in pod["spec"]["containers"])] == [
        [{"name": claim["name"]}]]


# --- the plugin's DaemonSet and its rights ----------------------------------------------------


def test_the_daemonset_runs_the_plugin_with_its_flags() -> None:
    ds = one("DaemonSet", "nvctk-dra-plugin")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["nvctk", "dra-plugin"]
    flags = {o for p in dra_plugin.params for o in p.opts}
    given = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    assert set(given) <= flags
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    for flag in ("--plugins-dir", "--registry-dir", "--cdi-dir"):
        assert vols[mounts[given[flag]]] == given[flag]  # the host's dir, at its own path
    # nvctk's defaults: the state dir (shares' ledgers, seen by the host's runtime) and
    # the authority key's dir
    default = Config()
    state = next(m for m in c["volumeMounts"] if m["mountPath"] == default.state_dir)
    assert state["mountPropagation"] == "Bidirectional" and vols[state["name"]] == default.state_dir
    assert default.authority_key.rsplit("/", 1)[0] in mounts
    assert pod["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]


def test_the_service_account_is_bound_to_the_role() -> None:
    sa = one("ServiceAccount")
    binding = one("ClusterRoleBinding", "nvctk-dra-plugin")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    assert binding["roleRef"]["name"] == one("ClusterRole")["metadata"]["name"]


def _admit(op: str, writer_node: str | None, slice_node: str | None,
           user: str = "system:serviceaccount:kube-system:nvctk-dra-plugin") -> bool:
    """The ValidatingAdmissionPolicy's verdict on a write, evaluated by CEL."""
    vap = one("ValidatingAdmissionPolicy")["spec"]
    obj = {"spec": {"nodeName": slice_node} if slice_node else {}}
    extra = {"authentication.kubernetes.io/node-name": [writer_node]} if writer_node else {}
    request = {"operation": op, "userInfo": {"username": user, "extra": extra}}
    act: dict[str, Any] = {"request": request, "object": None if op == "DELETE" else obj,
                           "oldObject": obj if op != "CREATE" else None}
    if not all(cel_eval(m["expression"], **act) for m in vap["matchConditions"]):
        return True  # not the plugin: the policy does not apply
    act["variables"] = {v["name"]: cel_eval(v["expression"], **act) for v in vap["variables"]}
    return all(bool(cel_eval(v["expression"], **act)) for v in vap["validations"])


@pytest.mark.parametrize(("op", "writer", "node", "ok"), [
    ("CREATE", "node-a", "node-a", True),
    ("UPDATE", "node-a", "node-a", True),
    ("DELETE", "node-a", "node-a", True),
    ("CREATE", "node-a", "node-b", False),
    ("UPDATE", "node-a", "node-b", False),
    ("DELETE", "node-a", "node-b", False),
    ("CREATE", None, "node-a", False),  # a token that names no node
    ("CREATE", "node-a", None, False),  # a slice of no node
])
def test_the_plugin_writes_only_its_own_nodes_slices(op: str, writer: str | None,
                                                     node: str | None, ok: bool) -> None:
    assert _admit(op, writer, node) is ok


def test_the_policy_leaves_other_writers_alone() -> None:
    assert _admit("CREATE", "node-a", "node-b", user="system:serviceaccount:x:other")


def test_pods_asking_for_nvidia_gpu_are_served_by_the_whole_gpu_class() -> None:
    """`resources.limits: {nvidia.com/gpu: 1}` reaches DRA through the whole-GPU class's
    extendedResourceName (one class per name: the share and MIG classes have none)."""
    classes = [d for d in manifests("dra-deviceclasses.yaml") if d["kind"] == "DeviceClass"]
    named = {c["metadata"]["name"]: c["spec"].get("extendedResourceName") for c in classes}
    assert named == {"gpu.nvctk.io": "nvidia.com/gpu", "gpu-share.nvctk.io": None,
                     "mig.nvctk.io": None}
