"""The DRA kubelet plugin over its real gRPC sockets, driven by a fake kubelet
(tests/support/drakubelet.py) on the simulated host: registration, NodePrepareResources
(v1 and v1beta1) writing one CDI spec per claim that resolves as an engine resolves it,
NodeUnprepareResources from nvctk's record, bad input per claim, the API server down,
a full or read-only CDI dir, a corrupt record, a restart between prepare and unprepare,
two plugins on one node, and health on an injected XID."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.base.config import Config
from nvctk.base.errors import NvctkError
from nvctk.cdi import load
from nvctk.dra.claims import MemoryClaims
from nvctk.dra.devices import DEFAULT_DRIVER
from nvctk.dra.driver import Driver
from nvctk.dra.kube import Kube, NotFound, Retry
from nvctk.dra.node import make_driver
from nvctk.dra.server import Plugin
from nvctk.host import nvml
from nvctk.host.inventory import HostInfo
from nvctk.k8s.health import Health, XidWatcher
from nvctk.sim import events, host
from nvctk.sim.host import SimHost
from nvctk.sim.topology import make_topology
from support import wait
from support.apiserver import client_for, running
from support.drakubelet import FakeDraKubelet, pb
from support.procs import open_fds

pytestmark = pytest.mark.slow

DRIVER = DEFAULT_DRIVER
NODE = "node-a"
HOOK = "/usr/bin/nvctk-hook"
FAST = Retry(attempts=4, base=0.001, cap=0.01, deadline=30, timeout=5)


def claim(name: str, uid: str, results: list[dict[str, Any]], ns: str = "default",
          config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) as the API server sends it, allocated."""
    devices: dict[str, Any] = {"results": results}
    if config is not None:
        devices["config"] = config
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": ns, "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu"}]}},
            "status": {"allocation": {"devices": devices}}}


def result(device: str, request: str = "gpu", driver: str = DRIVER, pool: str = NODE,
           **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


class Node:
    """One plugin with its fake kubelet and its dirs."""

    def __init__(self, top: Path, sim: SimHost, source: Any, health: bool) -> None:
        self.plugins_dir, self.registry_dir, self.cdi_dir = (
            str(top / d) for d in ("plugins", "registry", "cdi"))
        os.makedirs(self.cdi_dir, exist_ok=True)
        self.sim = sim
        self.source = source
        self.health = Health()
        self.state_dir = str(top / "state")
        cfg = Config(driver_root=sim.root, hook_path=HOOK, state_dir=self.state_dir,
                     authority_key=str(top / "authority.key"))
        self.cfg = cfg
        self.host = nvml.query_host(sim.root)
        self.driver, _, _ = make_driver(DRIVER, NODE, source, self.plugins_dir, self.cdi_dir,
                                        self.health, cfg=cfg, host=self.host)
        inventory = self.driver.inventory
        assert inventory is not None
        # as the plugin's command does: XIDs mapped to the devices as they are now
        watcher = XidWatcher(sim.root, lambda: inventory.host, self.health) if health else None
        self.plugin = Plugin(self.driver, self.health, self.plugins_dir, self.registry_dir,
                             watcher)
        self.plugin.start()
        if watcher is not None:
            assert watcher.ready.wait(10)
        self.kubelet = FakeDraKubelet(self.registry_dir)
        self.kubelet.register(DRIVER)

    def specs(self) -> list[str]:
        return sorted(os.listdir(self.cdi_dir))

    def stop(self) -> None:
        self.kubelet.close()
        self.plugin.stop()

    def unprepare_all(self) -> None:
        """What a test left prepared (a failed assert): no ledger tmpfs outlives it."""
        for uid in self.driver.prepared_uids():
            try:
                self.driver.unprepare("", "", uid)
            except NvctkError:
                pass


Start = Callable[..., Node]


@pytest.fixture
def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Start]:
    made: list[Node] = []

    def go(sim: SimHost, source: Any, health: bool = False, top: Path | None = None) -> Node:
        # a short path: unix socket paths are limited to 107 bytes
        n = Node(top or tmp_path_factory.mktemp("dra"), sim, source, health)
        made.append(n)
        return n

    yield go
    for n in made:
        n.stop()
        n.unprepare_all()
    for n in made:
        # shutdown removes both sockets
        assert not os.path.exists(n.plugin.endpoint)
        assert not os.path.exists(n.plugin.reg_path)


def _resolve(node: Node, ids: list[str]) -> list[load.Resolved]:
    return load.resolve(tuple(ids), (node.cdi_dir,))


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


def _sharing(strategy: str, request: str | None = None) -> dict[str, Any]:
    """This driver's opaque GpuConfig with that sharing strategy (for one request, or all)."""
    return {**({"requests": [request]} if request else {}), "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig",
                                         "sharing": {"strategy": strategy}}}}


def _mps(request: str | None = None) -> dict[str, Any]:
    return _sharing("MPS", request)


def _share(name: str, capacity: dict[str, str], device: str = "gpu-1") -> dict[str, Any]:
    """Claim `name` (uid-<name>) of one share of device (s1) consuming capacity."""
    return claim(name, f"uid-{name}", [result(device, shareID="s1", consumedCapacity=capacity)])


def test_an_mps_claim_is_an_mps_client_as_the_device_plugins(
        start: Start, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Sharing strategy MPS: the claim's spec gives its GPU and, as the device plugin's
    MPS shares, the host's MPS pipe directory with CUDA_MPS_PIPE_DIRECTORY, the share's
    smShare as the active thread percentage and its memory as the pinned memory limit (no
    vGPU ledger); without the MPS control daemon's pipe directory the claim is refused
    saying so, and nothing is written; MPS for some devices of a claim only, or uneven
    thread percentages, are refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    sim = host.init(str(tmp_path_factory.mktemp("drasim") / "h"), make_topology(gpus=2))
    g0, g1 = sim.topology.gpus
    share = {"shareID": "s1", "consumedCapacity": {"memory": "2Gi", "smShare": "30"}}
    src = MemoryClaims({
        ("ns", "m"): claim("m", "uid-m", [result("gpu-1", **share)], config=[_mps()]),
        ("ns", "w"): claim("w", "uid-w", [result("gpu-0")], config=[_mps()]),
        ("ns", "half"): claim("half", "uid-half", [result("gpu-0"), result("gpu-1", "b")],
                              config=[_mps("gpu")]),
        ("ns", "uneven"): claim("uneven", "uid-uneven", [
            result("gpu-0", **share), result("gpu-1", "b")], config=[_mps()]),
    })
    n = start(sim, src)
    # no MPS control daemon: refused, nothing written
    err = n.kubelet.prepare([("ns", "m", "uid-m")])["uid-m"].error
    assert "sharing strategy MPS: MPS pipe directory" in err and "nvidia-cuda-mps-control" in err
    assert n.specs() == [] and n.driver.prepared_uids() == []
    pipe = os.path.join(sim.root, "tmp/nvidia-mps")
    os.makedirs(pipe)
    got = n.kubelet.prepare([("ns", "m", "uid-m"), ("ns", "w", "uid-w"), ("ns", "half", "uid-half"),
                             ("ns", "uneven", "uid-uneven")])
    assert got["uid-m"].error == "" and got["uid-w"].error == ""
    assert "MPS for device(s) gpu-0 only" in got["uid-half"].error
    assert "uneven smShare" in got["uid-uneven"].error
    (r,) = _resolve(n, list(got["uid-m"].devices[0].cdi_device_ids))
    edits = r.spec["containerEdits"]
    assert next(d["path"] for d in r.device["containerEdits"]["deviceNodes"]) == "/dev/nvidia1"
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void", "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={g1.uuid}=2048M"]
    assert {"hostPath": pipe, "containerPath": "/tmp/nvidia-mps"}.items() <= edits["mounts"][-1].items()
    assert not os.path.exists(n.driver.ledger_path("uid-m")), "MPS limits it, not libvgpu"
    # a whole GPU as an MPS client: the pipe, no limits
    (w,) = _resolve(n, list(got["uid-w"].devices[0].cdi_device_ids))
    assert w.spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void",
                                               "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert sorted(n.driver.prepared_uids()) == ["uid-m", "uid-w"]
    assert n.kubelet.unprepare([("ns", "m", "uid-m"), ("ns", "w", "uid-w")]) == {
        "uid-m": "", "uid-w": ""}
    assert n.specs() == []
    del g0


def _query_in_a_new_process(root: str) -> Callable[[], HostInfo]:
    """NVML's answer for the driver root from a new process: a process keeps the
    simulated NVML library it loaded, built for the layout it was made with (the
    real driver answers a changed layout in the same process)."""
    import json
    import sys

    def query() -> HostInfo:
        out = subprocess.run([sys.executable, "-c", "import json, sys; from nvctk.host import nvml; "
                              "print(json.dumps(nvml.query_host(sys.argv[1]).to_dict()))", root],
                             capture_output=True, text=True, check=True, timeout=60).stdout
        return HostInfo.from_dict(json.loads(out))

    return query


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


BAD = [
    ("gone", None, "not found"),
    ("uid", claim("uid", "uid-other", [result("gpu-1")]), "has uid 'uid-other'"),
    ("unknown", claim("unknown", "uid-unknown", [result("gpu-9")]), "unknown device 'gpu-9'"),
    ("pool", claim("pool", "uid-pool", [result("gpu-1", pool="node-b")]), "pool 'node-b'"),
    ("unalloc", {"metadata": {"uid": "uid-unalloc"}}, "not allocated"),
    ("over", _share("over", {"memory": "1Ti"}), "consumedCapacity memory 1Ti is outside"),
    ("nan", _share("nan", {"memory": "lots"}), "'lots' is not a quantity"),
    # quantities outside the decimal range: a clear error naming the claim and field
    ("huge", _share("huge", {"memory": "1e999999999"}),
     "claim ns/huge: status.allocation.devices.results[0]: consumedCapacity memory: "
     "'1e999999999' is not a quantity within"),
    ("tiny", _share("tiny", {"memory": "1e-999999999"}), "'1e-999999999' is not a quantity within"),
    ("smhuge", _share("smhuge", {"smShare": "1e99999999999"}),
     "consumedCapacity smShare: '1e99999999999' is not a quantity within"),
    ("longq", _share("longq", {"memory": "9" * 5000}), "longer than 64 characters"),
    ("migshare", _share("migshare", {"memory": "1Gi"}, "gpu-0-mig-0"),
     "a share of MIG device gpu-0-mig-0"),
    ("smname", _share("smname", {"sm": "50"}),
     "consumedCapacity 'sm': device gpu-1 has no such capacity"),
    ("params", claim("params", "uid-params", [result("gpu-1")],
                     config=[_sharing("Everything", "gpu")]),
     "unknown sharing strategy 'Everything'"),
    ("vgpu", claim("vgpu", "uid-vgpu", [result("gpu-1")], config=[_sharing("VGpu")]),
     "consumes no part of device gpu-1"),
    ("mpsmig", claim("mpsmig", "uid-mpsmig", [result("gpu-0-mig-0")], config=[_mps()]),
     "MPS on MIG device gpu-0-mig-0"),
    ("excl", claim("excl", "uid-excl", [result("gpu-1", shareID="s1")],
                   config=[_sharing("Exclusive")]),
     "Exclusive, but device gpu-1"),
]


def test_bad_claims_each_get_their_error_and_touch_nothing(start: Start,
                                                           sim_host_mig: SimHost) -> None:
    src = MemoryClaims({("ns", name): c for name, c, _ in BAD if c is not None})
    src.claims[("ns", "good")] = claim("good", "uid-good", [result("gpu-0")], config=[
        {"opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}},  # not ours
        _sharing("TimeSlicing")])
    n = start(sim_host_mig, src)
    refs = [("ns", name, f"uid-{name}") for name, _, _ in BAD] + [("ns", "good", "uid-good")]
    got = n.kubelet.prepare(refs)
    for name, _, why in BAD:
        err = got[f"uid-{name}"].error
        assert why in err, (name, err)
        assert "Traceback" not in err and "internal error" not in err
        assert not got[f"uid-{name}"].devices
    assert got["uid-good"].error == "" and got["uid-good"].devices
    assert n.specs() == [f"k8s.{DRIVER}-claim_uid-good.json"]
    assert n.driver.prepared_uids() == ["uid-good"]
    # a uid that is no file name is refused, not used as a path; matched whole
    for uid in ("../../etc/passwd", "uid-good\n", "uid-good\nx", "\nuid-good", "uid good"):
        bad = n.kubelet.prepare([("ns", "good", uid)])[uid]
        assert "is not one" in bad.error, (uid, bad.error)
    assert n.specs() == [f"k8s.{DRIVER}-claim_uid-good.json"]
    assert sorted(os.listdir(n.driver.records.dir)) == ["uid-good.json"]


def test_api_server_down_or_slow_and_unprepare_still_works(start: Start,
                                                          sim_host: SimHost) -> None:
    """The official client against the API-server double: a server failing twice is
    retried (nvctk.dra.kube's back-off); one that stays down is that claim's error; a
    prepared claim is unprepared without it."""
    with running() as api:
        api.add_claim(claim("c", "uid-c", [result("gpu-0")], ns="ns"))
        api.add_claim(claim("d", "uid-d", [result("gpu-1")], ns="ns"))
        n = start(sim_host, Kube(client_for(api), FAST))
        api.fail(2)  # 503, 503, then the claim
        assert n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""
        assert n.kubelet.unprepare([("ns", "c", "uid-c")]) == {"uid-c": ""}
        # slow: the first read outlasts its timeout and is asked again
        n.driver.source = Kube(client_for(api), Retry(attempts=4, base=0.001, cap=0.01,
                                                      deadline=30, timeout=0.5))
        api.stall(1)
        assert n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""
        api.release.set()
        api.fail(100)  # down for good
        err = n.kubelet.prepare([("ns", "d", "uid-d")])["uid-d"].error
        assert "reading ResourceClaim ns/d" in err and "503" in err, err
        assert n.kubelet.unprepare([("ns", "c", "uid-c")]) == {"uid-c": ""}
        assert n.specs() == []
        api.release.set()


# alone: it holds a dozen trickling connections and their threads in this process, whose
# scheduling a second test on the other core disturbs
@pytest.mark.exclusive
def test_slow_api_answers_starve_no_other_claim(start: Start, sim_host: SimHost) -> None:
    """Claims whose API-server answers trickle for ever, more of them at once than the
    gRPC server used to have workers (8), and in one request beside a healthy claim:
    the healthy claims are prepared while the slow ones still wait, and each slow one
    ends as its own error at the driver's deadline."""
    import concurrent.futures as cf

    slow = 12
    with running() as api:
        api.add_claim(claim("ok", "uid-ok", [result("gpu-0")], ns="ns"))
        api.add_claim(claim("ok2", "uid-ok2", [result("gpu-1")], ns="ns"))
        # the slow ones outlast the test's healthy calls, however loaded the machine: a
        # total deadline and a per-read timeout (each byte of the trickle renews it) far
        # past the test's, so only the double's release ends them
        n = start(sim_host, Kube(client_for(api), Retry(attempts=4, base=0.001, cap=0.01,
                                                        deadline=600, timeout=300)))
        n.driver.api_timeout = 600
        api.trickle(slow, pause=0.5)  # a byte a claim every 0.5 s: slow, never done, and cheap
        with cf.ThreadPoolExecutor(slow + 1) as pool:
            try:
                # the slow calls' own gRPC deadline far past the test's: only the plugin
                # ends them
                pending = [pool.submit(n.kubelet.prepare, [("ns", f"s{i}", f"uid-s{i}")],
                                       "v1", 600) for i in range(slow - 1)]
                mixed = pool.submit(n.kubelet.prepare, [("ns", "sx", "uid-sx"),
                                                        ("ns", "ok2", "uid-ok2")], "v1", 600)
                for _ in range(slow):  # every slow answer has started
                    assert api.trickling.acquire(timeout=60)
                got = n.kubelet.prepare([("ns", "ok", "uid-ok")])
                assert got["uid-ok"].error == "" and got["uid-ok"].devices
                assert not any(f.done() for f in pending) and not mixed.done()
            finally:
                api.release.set()  # the double ends its bodies: the reads end
            errs = [f.result(timeout=60)[f"uid-s{i}"].error for i, f in enumerate(pending)]
            both = mixed.result(timeout=60)
        assert all("reading ResourceClaim ns/s" in e for e in errs), errs
        assert "reading ResourceClaim ns/sx" in both["uid-sx"].error
        assert both["uid-ok2"].error == "" and both["uid-ok2"].devices


def _mount_tmpfs(path: str, opts: str) -> None:
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)


@pytest.mark.root
def test_full_or_read_only_cdi_dir(start: Start, sim_host: SimHost,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    top = tmp_path_factory.mktemp("drafull")
    cdi = str(top / "cdi")
    _mount_tmpfs(cdi, "size=4k,nr_inodes=8")
    try:
        fd = os.open(os.path.join(cdi, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"x" * 1024):
                pass
        except OSError:  # full
            pass
        finally:
            os.close(fd)
        src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-0")])})
        n = start(sim_host, src, top=top)
        err = n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error
        assert "CDI spec for the claim: cannot write" in err and "No space left" in err
        assert sorted(os.listdir(cdi)) == ["filler"]  # no half-written spec, no temp file
        assert n.driver.prepared_uids() == []
        subprocess.run(["mount", "-o", "remount,ro", cdi], check=True)
        err = n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error
        assert "Read-only file system" in err
    finally:
        subprocess.run(["umount", cdi], check=True)


def test_corrupt_record_is_that_claims_error_only(start: Start, sim_host: SimHost) -> None:
    """A corrupt record: its unprepare says so (naming the file), removes what the claim
    can have by its uid alone and keeps the record aside; the kubelet's retry then finds
    the claim done; another claim is untouched; a prepare makes the claim anew."""
    src = MemoryClaims({("ns", "a"): claim("a", "uid-a", [result("gpu-0")]),
                        ("ns", "b"): claim("b", "uid-b", [result("gpu-1")])})
    n = start(sim_host, src)
    got = n.kubelet.prepare([("ns", "a", "uid-a"), ("ns", "b", "uid-b")])
    assert not got["uid-a"].error and not got["uid-b"].error
    rec = n.driver.records.path("uid-a")
    with open(rec, "wb") as f:
        f.write(b'{"v": 1, "uid": ')
    out = n.kubelet.unprepare([("ns", "a", "uid-a"), ("ns", "b", "uid-b")])
    assert out["uid-b"] == ""
    assert out["uid-a"] == (f"{rec}: corrupt (not JSON): the claim's CDI spec and vGPU ledger "
                            f"(named by its uid) are removed; the record is kept as "
                            f"{rec}.corrupt")
    assert n.specs() == [] and os.path.exists(rec + ".corrupt")
    assert n.kubelet.unprepare([("ns", "a", "uid-a")]) == {"uid-a": ""}
    # a prepare over a record of another version makes the claim anew
    with open(rec, "wb") as f:
        f.write(b'{"v": 7}')
    assert n.kubelet.prepare([("ns", "a", "uid-a")])["uid-a"].error == ""
    assert n.driver.records.load("uid-a") is not None


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


def test_driver_needs_no_grpc(sim_host: SimHost, tmp_path: Path) -> None:
    """The logic is plain Python (what bench/dra_prepare.py drives too)."""
    src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-0")])})
    d, _, _ = make_driver(DRIVER, NODE, src, str(tmp_path / "p"), str(tmp_path / "cdi"),
                          Health(), cfg=Config(driver_root=sim_host.root, hook_path=HOOK))
    assert isinstance(d, Driver)
    assert [x.device for x in d.prepare("ns", "c", "uid-c")] == ["gpu-0"]
    with pytest.raises(NotFound):
        src.get_claim("ns", "nope", 1)


@pytest.mark.root
def test_a_shares_spec_is_plain_cdi_with_one_ledger_for_the_claim(start: Start,
                                                                   sim_host: SimHost) -> None:
    """A 2 GiB, 25 % share of GPU 0: the claim's ledger (a tmpfs of its own, laid out as a
    container's state dir) holds its caps; the spec gives everything a container needs
    under any CDI runtime: the GPU's device node, the driver's files, libvgpu, the
    ledger's limits (read-only) and cache, /etc/ld.so.preload read-only, and the hook
    that pins /etc and /run; nothing in env but NVIDIA_VISIBLE_DEVICES=void (no grant a
    Pod could copy). Unprepare removes spec and ledger."""
    from nvctk.base import mounts as mount
    from nvctk.vgpu import ledger as ledger_layout
    from nvctk.vgpu import limits as vgpu

    src = MemoryClaims({("ns", "s"): claim("s", "uid-s", [result(
        "gpu-0", shareID="7c1e", consumedCapacity={"memory": "2Gi", "smShare": "25"})])})
    n = start(sim_host, src)
    ans = n.kubelet.prepare([("ns", "s", "uid-s")])["uid-s"]
    assert ans.error == ""
    (d,) = ans.devices
    assert (d.device_name, d.share_id) == ("gpu-0", "7c1e")
    (r,) = _resolve(n, list(d.cdi_device_ids))
    edits = r.device["containerEdits"]
    common = r.spec["containerEdits"]
    assert edits["deviceNodes"][0]["path"] == "/dev/nvidia0"  # then its DRM nodes
    assert "/dev/nvidia1" not in {x["path"] for x in edits["deviceNodes"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= {x["path"] for x in common["deviceNodes"]}
    env = dict(e.split("=", 1) for e in common["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert not any(k.startswith("NVCTK_") for k in env)
    ledger = os.path.join(n.state_dir, "dra", "uid-s")
    binds = {m["containerPath"]: (m["hostPath"], "ro" in m["options"]) for m in common["mounts"]}
    assert binds["/run/nvctk"] == (f"{ledger}/ro", True)
    assert binds["/run/nvctk/vgpu/limits"] == (f"{ledger}/ro/limits", True)
    assert binds["/run/nvctk/vgpu/cache"] == (f"{ledger}/rw/cache", False)
    assert binds["/etc/ld.so.preload"] == (f"{ledger}/ro/ld.so.preload", True)
    assert binds["/run/nvctk/libvgpu.so"][1] is True
    assert any(p.endswith("/libcuda.so.1") or "libcuda.so." in p for p in binds)
    (hook,) = edits["hooks"]
    assert hook["hookName"] == "createRuntime" and hook["args"][1:6] == [
        "cdi-edits", "--pin", "etc", "--pin", "run"]
    assert any(m.mount_point == ledger and m.fstype == "tmpfs"
               for m in mount.read_mountinfo())
    got = vgpu.read_limits_file(os.path.join(ledger, "ro", "limits"), 1)
    assert (got.memory, got.sm) == ((2 << 30,), (25,))
    assert os.path.getsize(os.path.join(ledger, "rw", "cache")) == ledger_layout.SHM_SIZE
    with open(os.path.join(ledger, "ro", "ld.so.preload")) as f:
        assert f.read() == "/run/nvctk/libvgpu.so\n"
    assert n.kubelet.unprepare([("ns", "s", "uid-s")]) == {"uid-s": ""}
    assert not os.path.exists(ledger) and n.specs() == []
    assert not any(m.mount_point == ledger for m in mount.read_mountinfo())


@pytest.mark.root
def test_200_prepare_unprepare_cycles_leak_nothing(start: Start, sim_host: SimHost) -> None:
    """A whole-GPU claim and a share (its ledger a tmpfs) prepared and unprepared 200
    times over the sockets: no file, mount, fd, thread or child process is left."""
    from nvctk.base import mounts as mount

    src = MemoryClaims({
        ("ns", "w"): claim("w", "uid-w", [result("gpu-1")]),
        ("ns", "s"): claim("s", "uid-s", [result("gpu-0", shareID="a", consumedCapacity={
            "memory": "2Gi"})])})
    n = start(sim_host, src)
    refs = [("ns", "w", "uid-w"), ("ns", "s", "uid-s")]
    # one round first: gRPC's and the key's one-time state is not a leak
    n.kubelet.prepare(refs)
    n.kubelet.unprepare(refs)
    top = os.path.dirname(n.cdi_dir)

    def mounts() -> list[str]:
        return [m.mount_point for m in mount.read_mountinfo() if m.mount_point.startswith(top)]

    fds, threads = open_fds(), len(os.listdir("/proc/self/task"))
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                              text=True).stdout.split()
    for _ in range(200):
        got = n.kubelet.prepare(refs)
        assert [a.error for a in got.values()] == ["", ""]
        assert len(mounts()) == 1  # the share's ledger while prepared
        assert n.kubelet.unprepare(refs) == {"uid-w": "", "uid-s": ""}
    assert n.specs() == [] and n.driver.prepared_uids() == []
    assert os.listdir(os.path.join(n.state_dir, "dra")) == []
    assert mounts() == []
    assert open_fds() - fds == set()  # nothing opened in the cycles is still open
    # gRPC's worker pools start threads as calls come, up to their bound (8 a server)
    assert len(os.listdir("/proc/self/task")) <= threads + 2 * 8
    assert subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                          text=True).stdout.split() == children


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
