"""The DRA kubelet plugin over its real gRPC sockets, driven by a fake kubelet
(tests/support/drakubelet.py) on the simulated host: registration, NodePrepareResources (v1
and v1beta1) writing one CDI spec per claim that resolves as an engine resolves it,
NodeUnprepareResources from nvctk's record, a MIG claim, a MIG layout changed at run time,
two claims, the driver without gRPC. (The rest: test_dra_grpc_shares.py,
test_dra_grpc_hostile.py, test_dra_grpc_health.py; shared: tests/support/dranode.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import support.dranode as _dranode
from nvctk.base.config import Config
from nvctk.dra.claims import MemoryClaims
from nvctk.dra.driver import Driver
from nvctk.dra.kube import NotFound
from nvctk.dra.node import make_driver
from nvctk.k8s.health import Health
from nvctk.sim import host
from nvctk.sim.host import SimHost
from nvctk.sim.topology import make_topology
from support.dranode import (
    DRIVER,
    HOOK,
    NODE,
    Start,
    _query_in_a_new_process,
    _resolve,
    claim,
    result,
)

pytestmark = pytest.mark.slow

start = _dranode.start  # fixtures


def test_registration(start: Start, sim_host: SimHost) -> None:
    n = start(sim_host, MemoryClaims())
    info = n.kubelet.info
    assert (info.type, info.name) == ("DRAPlugin", DRIVER)
    assert info.endpoint == os.path.join(n.plugins_dir, DRIVER, "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin",
                                             "v1alpha1.DRAResourceHealth"]
    assert n.plugin.registration.notified.wait(5)
    assert n.plugin.registration.status.plugin_registered
    assert os.path.basename(n.plugin.reg_path) == f"{DRIVER}-reg.sock"


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_prepare_whole_gpu_then_unprepare(start: Start, sim_host: SimHost, version: str) -> None:
    g0, g1 = sim_host.topology.gpus
    src = MemoryClaims({("ns1", "c1"): claim("c1", "uid-1", [
        result("gpu-1"),
        result("gpu-0", driver="other.example.com", pool="elsewhere")])})  # not ours: ignored
    n = start(sim_host, src)
    got = n.kubelet.prepare([("ns1", "c1", "uid-1")], version)
    ans = got["uid-1"]
    assert ans.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name) for d in ans.devices] == [
        (["gpu"], NODE, "gpu-1")]
    ids = list(ans.devices[0].cdi_device_ids)
    assert ids == [f"k8s.{DRIVER}/claim=uid-1-gpu-1"]
    if version == "v1":
        assert not ans.devices[0].HasField("share_id")
    # the spec resolves as a CDI engine resolves it: GPU 1's node, not GPU 0's
    (r,) = _resolve(n, ids)
    nodes = [d["path"] for d in r.device["containerEdits"]["deviceNodes"]]
    assert nodes[0] == "/dev/nvidia1" and "/dev/nvidia0" not in nodes
    common = [d["path"] for d in r.spec["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidiactl" in common and "/dev/nvidia0" not in common
    assert [d["name"] for d in r.spec["devices"]] == ["uid-1-gpu-1"]
    assert r.spec["containerEdits"]["mounts"], "the driver's files are mounted"
    assert r.spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    # as `nvctk cdi generate`'s spec: the driver's links and the ld cache by nvctk's hook
    (hook,) = r.device["containerEdits"]["hooks"]
    assert hook["hookName"] == "createRuntime" and hook["args"][:2] == ["nvctk-hook", "cdi-edits"]
    assert "--folder" in hook["args"] and "--link" in hook["args"], hook["args"]

    # the kubelet retries: the same answer, from the record, with the API server empty
    src.claims.clear()
    again = n.kubelet.prepare([("ns1", "c1", "uid-1")], version)["uid-1"]
    assert again == ans
    assert n.kubelet.unprepare([("ns1", "c1", "uid-1")], version) == {"uid-1": ""}
    assert n.specs() == []
    assert n.driver.prepared_uids() == []
    # unprepared already: done
    assert n.kubelet.unprepare([("ns1", "c1", "uid-1")], version) == {"uid-1": ""}
    del g0, g1


def test_mig_claim_gets_its_mig_device(start: Start, sim_host_mig: SimHost) -> None:
    g0 = sim_host_mig.topology.gpus[0]
    m = g0.mig_devices[1]
    name = f"gpu-0-mig-{m.index}"
    n = start(sim_host_mig, MemoryClaims({("ns", "m"): claim("m", "uid-m", [result(name)])}))
    ans = n.kubelet.prepare([("ns", "m", "uid-m")])["uid-m"]
    assert ans.error == "" and ans.devices[0].device_name == name
    (r,) = _resolve(n, list(ans.devices[0].cdi_device_ids))
    nodes = [d["path"] for d in r.device["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidia0" in nodes and any("nvidia-cap" in p for p in nodes)
    (hook,) = r.device["containerEdits"]["hooks"]
    assert "--folder" in hook["args"] and "--link" in hook["args"], hook["args"]
    # it is that MIG device's own capability nodes: another MIG device's differ
    other = f"gpu-0-mig-{g0.mig_devices[0].index}"
    n.source.claims[("ns", "o")] = claim("o", "uid-o", [result(other)])
    ans2 = n.kubelet.prepare([("ns", "o", "uid-o")])["uid-o"]
    (r2,) = _resolve(n, list(ans2.devices[0].cdi_device_ids))
    assert r2.device["containerEdits"]["deviceNodes"] != r.device["containerEdits"]["deviceNodes"]


def test_a_mig_layout_changed_at_run_time_is_prepared_without_a_restart(
        start: Start, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A MIG device made after the plugin started (the simulated host rebuilt with a
    second MIG device on GPU 0): a claim naming it is prepared by the running plugin,
    which asks NVML again (the publisher's query, through the same driver), and its spec
    has the new device's own capability nodes; before the change the same claim is an
    unknown device."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    root = str(tmp_path_factory.mktemp("drasim") / "h")
    before = make_topology(gpus=1, mig={0: ["3g.40gb"]}, seed="relayout")
    sim = host.init(root, before)
    src = MemoryClaims({("ns", "m"): claim("m", "uid-m", [result("gpu-0-mig-1")])})
    n = start(sim, src)
    n.driver.inventory.query = _query_in_a_new_process(root)  # type: ignore[union-attr]
    err = n.kubelet.prepare([("ns", "m", "uid-m")])["uid-m"].error
    assert "unknown device 'gpu-0-mig-1'" in err, err
    after = make_topology(gpus=1, mig={0: ["3g.40gb", "2g.20gb"]}, seed="relayout")
    host.init(root, after, force=True)
    new = next(m for m in after.gpus[0].mig_devices if m.index == 1)
    ans = n.kubelet.prepare([("ns", "m", "uid-m")])["uid-m"]
    assert ans.error == "" and ans.devices[0].device_name == "gpu-0-mig-1"
    (r,) = _resolve(n, list(ans.devices[0].cdi_device_ids))
    nodes = [d["path"] for d in r.device["containerEdits"]["deviceNodes"]]
    assert f"/dev/nvidia-caps/nvidia-cap{new.ci_cap_minor}" in nodes, nodes
    assert "gpu-0-mig-1" in n.driver.devices
    assert n.driver.devices["gpu-0-mig-1"].uuid == new.uuid
    assert n.kubelet.unprepare([("ns", "m", "uid-m")]) == {"uid-m": ""}


def test_two_claims_specs_do_not_conflict(start: Start, sim_host: SimHost) -> None:
    src = MemoryClaims({("a", "x"): claim("x", "uid-x", [result("gpu-0")], ns="a"),
                        ("b", "y"): claim("y", "uid-y", [result("gpu-1")], ns="b")})
    n = start(sim_host, src)
    got = n.kubelet.prepare([("a", "x", "uid-x"), ("b", "y", "uid-y")])
    ids = [i for a in got.values() for d in a.devices for i in d.cdi_device_ids]
    assert len(ids) == 2 and len(_resolve(n, ids)) == 2
    assert len(n.specs()) == 2


def test_driver_needs_no_grpc(sim_host: SimHost, tmp_path: Path) -> None:
    """The logic is plain Python (what bench/dra_prepare.py drives too)."""
    src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-0")])})
    d, _, _ = make_driver(DRIVER, NODE, src, str(tmp_path / "p"), str(tmp_path / "cdi"),
                          Health(), cfg=Config(driver_root=sim_host.root, hook_path=HOOK))
    assert isinstance(d, Driver)
    assert [x.device for x in d.prepare("ns", "c", "uid-c")] == ["gpu-0"]
    with pytest.raises(NotFound):
        src.get_claim("ns", "nope", 1)
