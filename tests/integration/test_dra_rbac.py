"""The DRA plugin's ClusterRole (deployments/dra-plugin.yaml) grants exactly what the
plugin asks of the API server: the requests the official client sends to the API
double while the plugin publishes, changes and shrinks its pool and reads a claim,
each mapped to its RBAC (resource, verb)."""

from __future__ import annotations

import urllib.parse

from nvctk.dra.devices import DEFAULT_DRIVER
from nvctk.dra.kube import Kube
from nvctk.dra.publish import Publisher
from nvctk.host.inventory import GpuInfo, HostInfo
from support.apiserver import client_for, running
from support.deployments import manifests

VERB = {"POST": "create", "PUT": "update", "DELETE": "delete"}


def rbac(method: str, path: str) -> tuple[str, str, str]:
    """(apiGroup, resource, verb) of a request to /apis/<group>/<version>/..."""
    parts = urllib.parse.urlsplit(path).path.strip("/").split("/")
    group, rest = parts[1], parts[3:]
    if rest[0] == "namespaces":
        rest = rest[2:]
    if method == "GET":
        return group, rest[0], "get" if len(rest) > 1 else "list"
    return group, rest[0], VERB[method]


def granted() -> set[tuple[str, str, str]]:
    (role,) = [d for d in manifests("dra-plugin.yaml") if d["kind"] == "ClusterRole"]
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


def gpus(n: int) -> HostInfo:
    return HostInfo("550.54.15", "12.4", tuple(
        GpuInfo(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", i, f"00000000:{i % 200 + 1:02X}:00.0",
                81920, "9.0", "nvidia", False) for i in range(n)))


def test_the_cluster_role_grants_what_the_plugin_uses() -> None:
    with running() as api:
        api.add_claim({"metadata": {"namespace": "team", "name": "c1"}})
        kube = Kube(client_for(api))
        p = Publisher(kube, "node-a", DEFAULT_DRIVER)
        p.sync(gpus(130), {})  # create (two slices)
        p.sync(gpus(129), {})  # update
        p.sync(gpus(1), {})  # update and delete
        kube.get_claim("team", "c1")
        used = {rbac(m, path) for m, path in api.requests}
    assert used == granted()
