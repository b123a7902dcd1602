"""The DRA kubelet plugin over gRPC across restarts and faults: a restart between prepare and
unprepare, a record from another boot, two plugins on one node, health on an injected XID
(fatal or not, across a restart, after a MIG layout change), a removed registration socket,
claims whose unprepare never comes. (The rest: test_dra_grpc_prepare.py,
test_dra_grpc_shares.py, test_dra_grpc_hostile.py; shared: tests/support/dranode.py.)"""

from __future__ import annotations

import os

import pytest

import support.dranode as _dranode
from nvctk.base.errors import NvctkError
from nvctk.dra.claims import MemoryClaims
from nvctk.dra.server import Plugin
from nvctk.k8s.health import Health
from nvctk.sim import events, host
from nvctk.sim.host import SimHost
from nvctk.sim.topology import make_topology
from support import wait
from support.drakubelet import FakeDraKubelet, pb
from support.dranode import DRIVER, Node, Start, _query_in_a_new_process, claim, result

pytestmark = pytest.mark.slow

start = _dranode.start  # fixtures


@pytest.mark.root
def test_restart_between_prepare_and_unprepare_loses_nothing(
        start: Start, sim_host: SimHost, tmp_path_factory: pytest.TempPathFactory) -> None:
    top = tmp_path_factory.mktemp("drarestart")
    src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-1")]),
                        ("ns", "s"): claim("s", "uid-s", [result(
                            "gpu-0", shareID="a", consumedCapacity={"memory": "2Gi"})])})
    refs = [("ns", "c", "uid-c"), ("ns", "s", "uid-s")]
    n = start(sim_host, src, top=top)
    first = n.kubelet.prepare(refs)
    ledger = n.driver.ledger_path("uid-s")
    n.stop()
    src.claims.clear()  # and the API server is gone too
    n2 = start(sim_host, MemoryClaims(), top=top)
    assert n2.kubelet.prepare(refs) == first
    assert os.path.isfile(os.path.join(ledger, "ro", "limits"))  # the share's ledger kept
    assert n2.kubelet.unprepare(refs) == {"uid-c": "", "uid-s": ""}
    assert n2.specs() == [] and n2.driver.prepared_uids() == []
    assert not os.path.exists(ledger)


def test_a_record_from_another_boot_is_prepared_again(start: Start, sim_host: SimHost) -> None:
    src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-1")])})
    n = start(sim_host, src)
    n.kubelet.prepare([("ns", "c", "uid-c")])
    rec = n.driver.records.load("uid-c")
    assert rec is not None and rec.boot_id == n.driver.boot_id != ""
    n.driver.boot_id = "another-boot"
    src.claims[("ns", "c")] = claim("c", "uid-c", [result("gpu-0")])  # reallocated since
    ans = n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"]
    assert ans.devices[0].device_name == "gpu-0"


def test_two_plugins_on_one_node(start: Start, sim_host: SimHost) -> None:
    n = start(sim_host, MemoryClaims())
    p2 = Plugin(n.driver, Health(), n.plugins_dir, n.registry_dir)
    with pytest.raises(NvctkError, match=r"another DRA plugin for gpu.nvctk.io runs on this "
                       rf"node \(pid {os.getpid()} holds"):
        p2.start()
    # the first is untouched: still answering
    assert n.kubelet.unprepare([("ns", "x", "uid-x")]) == {"uid-x": ""}


@pytest.fixture(scope="module")
def sim_xid(tmp_path_factory: pytest.TempPathFactory) -> SimHost:
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    return host.init(str(tmp_path_factory.mktemp("drasim") / "h"),
                     make_topology(gpus=2, mig={0: ["3g.40gb"]}))


def test_fatal_xid_makes_the_device_unhealthy(start: Start, sim_xid: SimHost) -> None:
    sim = sim_xid
    src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-1")])})
    n = start(sim, src, health=True)
    n.kubelet.watch_health()
    H = pb.health
    first = n.kubelet.wait_health(lambda h: True)
    assert set(first) == {"gpu-0", "gpu-0-mig-0", "gpu-1"}
    assert {v[0] for v in first.values()} == {H.HEALTHY}
    events.inject_xid(sim.root, 1, 13)  # an application's fault: ignored
    events.inject_xid(sim.root, 1, 79)  # fallen off the bus
    got = n.kubelet.wait_health(lambda h: h["gpu-1"][0] == H.UNHEALTHY)
    uuid = sim.topology.gpus[1].uuid
    assert got["gpu-1"] == (H.UNHEALTHY, f"XID 79 on {uuid}")
    assert got["gpu-0"] == (H.HEALTHY, "") and got["gpu-0-mig-0"] == (H.HEALTHY, "")
    err = n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error
    assert "device gpu-1 is unhealthy" in err


def test_a_non_fatal_xid_leaves_the_device_in_service(start: Start, sim_xid: SimHost) -> None:
    """XID 94 (a contained ECC error) on the GPU: recorded, but the device stays healthy
    for the kubelet and claims are prepared (NVIDIA's driver: no taint)."""
    src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-1")])})
    n = start(sim_xid, src, health=True)
    n.kubelet.watch_health()
    events.inject_xid(sim_xid.root, 1, 94)
    wait.until(lambda: n.health.reasons.get(sim_xid.topology.gpus[1].uuid) == "XID 94", 10,
               "the XID to be seen")
    got = n.kubelet.wait_health(lambda h: True)
    assert got["gpu-1"][0] == pb.health.HEALTHY
    assert n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""


def test_health_survives_a_restart_of_the_plugin(start: Start, sim_xid: SimHost,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """A GPU that fell off the bus stays unhealthy across a rollout of the plugin (NVML
    tells an XID once): the restarted plugin reports it, refuses it, and would taint it."""
    top = tmp_path_factory.mktemp("drahealth")
    src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-1")])})
    n = start(sim_xid, src, health=True, top=top)
    events.inject_xid(sim_xid.root, 1, 79)
    wait.until(lambda: "gpu-1" in _sick_names(n), 10, "XID 79 to be seen")
    n.stop()
    n2 = start(sim_xid, src, health=True, top=top)
    n2.kubelet.watch_health()
    got = n2.kubelet.wait_health(lambda h: h["gpu-1"][0] == pb.health.UNHEALTHY)
    assert got["gpu-0"][0] == pb.health.HEALTHY
    assert "device gpu-1 is unhealthy" in n2.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error


def _sick_names(n: Node) -> set[str]:
    sick = n.driver.unhealthy()
    return {name for name, d in n.driver.devices.items() if d.uuid in sick}


def test_a_removed_registration_socket_is_made_again(start: Start, sim_host: SimHost) -> None:
    """The kubelet's watcher registers a plugin by its socket: one removed from under the
    plugin (a kubelet cleaning its dir) is made again, and the plugin registers anew."""
    n = start(sim_host, MemoryClaims())
    for path in (n.plugin.reg_path, n.plugin.endpoint):
        os.unlink(path)
        wait.until(lambda p=path: os.path.exists(p), 10, f"{path} to be made again")
    n.kubelet.close()
    n.kubelet = FakeDraKubelet(n.registry_dir)
    assert n.kubelet.register(DRIVER).name == DRIVER
    assert n.kubelet.prepare([("ns", "x", "uid-x")])["uid-x"].error  # the service answers


def test_xids_after_a_mig_layout_change_name_the_new_devices(
        start: Start, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The MIG layout changes while the plugin runs: an XID on the new GPU instance marks
    the new MIG device (the watcher maps events with the host as it is now)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    root = str(tmp_path_factory.mktemp("drasim") / "h")
    sim = host.init(root, make_topology(gpus=1, mig={0: ["3g.40gb"]}, seed="xidmap"))
    n = start(sim, MemoryClaims(), health=True)
    n.driver.inventory.query = _query_in_a_new_process(root)  # type: ignore[union-attr]
    after = make_topology(gpus=1, mig={0: ["3g.40gb", "2g.20gb"]}, seed="xidmap")
    host.init(root, after, force=True)
    n.driver.rediscover()
    new = next(m for m in after.gpus[0].mig_devices if m.index == 1)
    events.inject_xid(root, 0, 95, new.gpu_instance, new.compute_instance)
    wait.until(lambda: new.uuid in n.health.unhealthy, 10, "the XID on the new MIG device")
    assert n.health.unhealthy == {new.uuid}


def test_claims_whose_unprepare_never_comes_are_swept_when_gone(
        start: Start, sim_host: SimHost, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A claim gone from the API server (or made again under another uid), held by no Pod
    the kubelet knows, for the grace period: unprepared (spec, ledger, record). One a Pod
    still holds, one the API server still has, and all of them while the kubelet cannot
    be asked, are kept."""
    from nvctk.dra.stale import Sweeper, kubelet_claims
    from support.monitor import FakePodResources

    top = tmp_path_factory.mktemp("drastale")
    src = MemoryClaims({
        ("ns", "gone"): claim("gone", "uid-gone", [result("gpu-0", shareID="a",
                                                         consumedCapacity={"memory": "2Gi"})]),
        ("ns", "held"): claim("held", "uid-held", [result("gpu-1")]),
        ("ns", "kept"): claim("kept", "uid-kept", [result("gpu-1")]),
        ("ns", "again"): claim("again", "uid-again", [result("gpu-1")])})
    n = start(sim_host, src, top=top)
    refs = [("ns", c, f"uid-{c}") for c in ("gone", "held", "kept", "again")]
    assert all(a.error == "" for a in n.kubelet.prepare(refs).values())
    ledger = n.driver.ledger_path("uid-gone")
    assert os.path.isdir(ledger)
    for name in ("gone", "held"):
        del src.claims[("ns", name)]
    src.claims[("ns", "again")] = claim("again", "uid-new", [result("gpu-1")])
    sock = top / "pr.sock"
    now = [1000.0]
    sweeper = Sweeper(n.driver, src, kubelet_claims(str(sock)), grace=300, clock=lambda: now[0])
    assert sweeper.sweep() == []  # no kubelet to ask: nothing swept
    kubelet = FakePodResources(sock, [{"name": "p", "namespace": "ns", "containers": [
        {"name": "c", "dynamic_resources": [{"claim_name": "held", "claim_namespace": "ns"}]}]}])
    try:
        assert sweeper.sweep() == []  # stale from now on: the grace starts
        now[0] += 299
        assert sweeper.sweep() == []
        now[0] += 2
        assert sorted(sweeper.sweep()) == ["uid-again", "uid-gone"]
        assert sorted(n.driver.prepared_uids()) == ["uid-held", "uid-kept"]
        assert not os.path.exists(ledger)
        assert n.specs() == sorted(f"k8s.{DRIVER}-claim_uid-{c}.json" for c in ("held", "kept"))
        # the Pod holding "held" is gone from the kubelet too: swept after its own grace
        kubelet.pods = []
        assert sweeper.sweep() == []
        now[0] += 301
        assert sweeper.sweep() == ["uid-held"]
    finally:
        kubelet.stop()
