"""The device plugin over gRPC, driven by a fake kubelet (tests/support/kubelet.py)
on the simulated host: registration, ListAndWatch per mode, GetPreferredAllocation,
Allocate with gRPC errors, health on an injected XID, kubelet restart, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from nvctk.host import nvml
from nvctk.k8s import config as dpconfig
from nvctk.k8s import gen, resources
from nvctk.sim import events, host
from nvctk.sim.host import SimHost
from nvctk.sim.topology import make_topology

gen.ensure()  # the build's generator step, for a checkout that has not run it

from nvctk.cli import device_plugin as dpcli  # noqa: E402
from nvctk.cli import labels as lbcli  # noqa: E402
from nvctk.k8s.server import Manager  # noqa: E402
from support import wait  # noqa: E402
from support.kubelet import FakeKubelet, pb  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def kubelet_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # a short path: unix socket paths are limited to 107 bytes
    d = tmp_path_factory.mktemp("kl")
    yield str(d)


Start = Callable[..., tuple[FakeKubelet, Manager]]


@pytest.fixture(scope="module")
def sim_own(tmp_path_factory: pytest.TempPathFactory) -> SimHost:
    """This module's own sim (XIDs injected, MPS pipe dir made): GPU 0 with MIG
    devices 3g.40gb and 1g.10gb, GPU 1 whole."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    return host.init(str(tmp_path_factory.mktemp("dpsim") / "h"),
                     make_topology(gpus=2, mig={0: ["3g.40gb", "1g.10gb"]}))


@pytest.fixture
def start(kubelet_dir: str) -> Iterator[Start]:
    made: list[tuple[FakeKubelet, Manager, threading.Thread]] = []

    def go(sim: SimHost, conf: dict[str, Any], health: bool = False) -> tuple[FakeKubelet, Manager]:
        # the answers these tests read are env's (the default device list, volume-mounts,
        # is tests/unit/test_k8s_allocate.py's)
        flags = {"deviceListStrategy": "envvar", **conf.get("flags", {})}
        cfg = dpconfig.parse({"version": "v1", **conf, "flags": flags})
        host = nvml.query_host(sim.root)
        res = resources.build(cfg, host)
        kl = FakeKubelet(kubelet_dir).start()
        mgr = Manager(res, cfg, sim.root, host, kubelet_dir, health_events=health)
        t = threading.Thread(target=mgr.run, daemon=True)
        t.start()
        made.append((kl, mgr, t))
        kl.wait_for([r.name for r in res])
        # the kubelet records a Register before its answer reaches the plugin: a
        # round counts only once every answer came back (a restart before that
        # cancels it, and the manager rightly registers again)
        wait.until(lambda: mgr.registrations >= 1, 10, "the first registration round")
        if health and mgr.watcher:
            assert mgr.watcher.ready.wait(10)
        return kl, mgr

    yield go
    for kl, mgr, t in made:
        mgr.stop()
        t.join(10)
        kl.stop()
        assert not t.is_alive()
        # shutdown removes every plugin socket
        assert not [n for n in os.listdir(kubelet_dir) if n.startswith("nvctk-")]


def test_registration_and_whole_gpus(start: Start, sim_host: SimHost) -> None:
    kl, _ = start(sim_host, {})
    req = kl.registrations[0]
    assert (req.version, req.resource_name, req.endpoint) == (
        "v1beta1", "nvidia.com/gpu", "nvctk-nvidia.com_gpu.sock")
    assert req.options.get_preferred_allocation_available
    p = kl.plugins["nvidia.com/gpu"]
    uuids = [g.uuid for g in sim_host.topology.gpus]
    assert p.wait_list() == dict.fromkeys(uuids, "Healthy")
    opts = p.stub.GetDevicePluginOptions(pb.Empty())
    assert opts.get_preferred_allocation_available and not opts.pre_start_required
    resp = p.stub.Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[uuids[1]]),
        pb.ContainerAllocateRequest(devices_ids=uuids)]))
    assert [dict(r.envs) for r in resp.container_responses] == [
        {"NVIDIA_VISIBLE_DEVICES": uuids[1]}, {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids)}]
    with pytest.raises(grpc.RpcError) as e:
        p.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=["GPU-bogus"])]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-bogus" in (e.value.details() or "")
    assert p.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=uuids)) is not None


def test_mig_mixed_and_cdi_strategies(start: Start, sim_host_mig: SimHost) -> None:
    kl, _ = start(sim_host_mig, {"flags": {"migStrategy": "mixed", "deviceListStrategy": [
        "volume-mounts", "cdi-annotations", "cdi-cri"]}})
    migs = sim_host_mig.topology.gpus[0].mig_devices
    assert set(kl.plugins) == {"nvidia.com/gpu", "nvidia.com/mig-3g.40gb",
                               "nvidia.com/mig-2g.20gb", "nvidia.com/mig-1g.10gb"}
    p = kl.plugins["nvidia.com/mig-2g.20gb"]
    assert p.wait_list() == {migs[1].uuid: "Healthy"}
    r = p.stub.Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[migs[1].uuid])])).container_responses[0]
    assert [c.name for c in r.cdi_devices] == [f"nvidia.com/gpu={migs[1].uuid}"]
    assert dict(r.annotations) == {
        "cdi.k8s.io/nvctk-device-plugin_mig-2g.20gb": f"nvidia.com/gpu={migs[1].uuid}"}
    assert [(m.container_path, m.host_path, m.read_only) for m in r.mounts] == [
        (f"/var/run/nvidia-container-devices/{migs[1].uuid}", "/dev/null", True)]


def test_vgpu_shares_preferred_and_allocate(start: Start, sim_host: SimHost) -> None:
    kl, _ = start(sim_host, {"sharing": {"vgpu": {"replicas": 4}}})
    p = kl.plugins["nvidia.com/vgpu"]
    g0, g1 = (g.uuid for g in sim_host.topology.gpus)
    assert len(p.wait_list()) == 8
    avail = [f"{g0}::0", f"{g1}::0", f"{g1}::1", f"{g1}::2", f"{g0}::3"]
    pref = p.stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
        pb.ContainerPreferredAllocationRequest(available_deviceIDs=avail, allocation_size=3)]))
    ids = list(pref.container_responses[0].deviceIDs)
    assert len(ids) == 3 and all(i.startswith(g1) for i in ids)  # packed on one GPU
    envs = dict(p.stub.Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=ids)])).container_responses[0].envs)
    assert envs == {"NVIDIA_VISIBLE_DEVICES": g1, "CUDA_DEVICE_MEMORY_LIMIT": "61440m",
                    "CUDA_DEVICE_SM_LIMIT": "75"}


def test_time_slicing(start: Start, sim_own: SimHost) -> None:
    sim = sim_own
    kl, _ = start(sim, {"sharing": {"timeSlicing": {"renameByDefault": True,
                                                    "failRequestsGreaterThanOne": True,
                                                    "resources": [{"name": "nvidia.com/gpu",
                                                                   "replicas": 3}]}}})
    p = kl.plugins["nvidia.com/gpu.shared"]
    g0 = sim.topology.gpus[0].uuid  # migStrategy none: the MIG GPU is shared whole
    assert len(p.wait_list()) == 6 and f"{g0}::2" in p.wait_list()
    with pytest.raises(grpc.RpcError) as e:
        p.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[f"{g0}::0", f"{g0}::1"])]))
    assert "failRequestsGreaterThanOne" in (e.value.details() or "")


def test_mps_missing_pipe_is_an_error(start: Start, sim_own: SimHost) -> None:
    sim = sim_own
    kl, _ = start(sim, {"sharing": {"mps": {}}})
    core, mem = kl.plugins["nvidia.com/mps-core"], kl.plugins["nvidia.com/mps-memory"]
    g0 = sim.topology.gpus[1].uuid  # MPS splits whole GPUs only: not the MIG GPU 0
    assert len(core.wait_list()) == 100 and len(mem.wait_list()) == 80
    req = pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[f"{g0}::{i}" for i in range(50)])])
    pipe = Path(sim.root) / "tmp/nvidia-mps"
    if pipe.exists():
        pipe.rmdir()
    with pytest.raises(grpc.RpcError) as e:
        core.stub.Allocate(req)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "MPS pipe directory" in (e.value.details() or "")
    pipe.mkdir(parents=True)
    r = core.stub.Allocate(req).container_responses[0]
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert [(m.container_path, m.host_path) for m in r.mounts] == [("/tmp/nvidia-mps", str(pipe))]
    r = mem.stub.Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[f"{g0}::{i}" for i in range(8)])]))
    assert r.container_responses[0].envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G"


def test_fatal_xids_mark_unhealthy_application_ones_do_not(start: Start, sim_own: SimHost
                                                          ) -> None:
    """How fast an XID reaches the kubelet is bench/deviceplugin.py's figure (goal < 1 s);
    here: which XIDs take which devices down."""
    sim = sim_own
    kl, _ = start(sim, {"flags": {"migStrategy": "mixed"},
                        "sharing": {"vgpu": {"replicas": 2}}}, health=True)
    g0, g1 = sim.topology.gpus
    v = kl.plugins["nvidia.com/vgpu"]
    v.wait_list()
    for xid in sorted({13, 31, 43, 45, 68, 109}):  # application errors: ignored
        events.inject_xid(sim.root, 1, xid)
    # an XID on one MIG instance takes down that MIG device only; the events file is read
    # in order, so once it is down the application XIDs above have been handled too
    m = g0.mig_devices[1]
    events.inject_xid(sim.root, 0, 48, m.gpu_instance, m.compute_instance)
    p = kl.plugins["nvidia.com/mig-1g.10gb"]
    p.wait_list(lambda d: d[m.uuid] == "Unhealthy", timeout=10)
    assert kl.plugins["nvidia.com/mig-3g.40gb"].wait_list() == {
        g0.mig_devices[0].uuid: "Healthy"}
    assert set(v.wait_list().values()) == {"Healthy"}
    events.inject_xid(sim.root, 1, 79)  # fallen off the bus
    got = v.wait_list(lambda d: d[f"{g1.uuid}::0"] == "Unhealthy", timeout=10)
    assert got == {f"{g1.uuid}::0": "Unhealthy", f"{g1.uuid}::1": "Unhealthy"}
    with pytest.raises(grpc.RpcError) as e:
        v.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[f"{g1.uuid}::0"])]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_kubelet_restart_reregisters(start: Start, sim_host: SimHost) -> None:
    kl, mgr = start(sim_host, {})
    kl.restart()
    kl.wait_for(["nvidia.com/gpu"], count=2)
    wait.until(lambda: mgr.registrations >= 2, 5, "the plugin to register again")
    assert mgr.registrations == 2
    p = kl.plugins["nvidia.com/gpu"]
    assert len(p.wait_list()) == 2
    assert p.stub.GetDevicePluginOptions(pb.Empty()).get_preferred_allocation_available


def test_cli_bad_config_and_sigterm(sim_host: SimHost, kubelet_dir: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nsharing: {vgpu: {replicas: 500}}\n")
    r = CliRunner().invoke(dpcli.device_plugin, ["--kubelet-dir", kubelet_dir,
                                                 "--config", str(bad)], env=sim_host.env)
    assert r.exit_code == 1 and "sharing.vgpu.replicas" in r.output
    assert "Traceback" not in r.output
    kl = FakeKubelet(kubelet_dir).start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from nvctk.cli.device_plugin import device_plugin as d; d()",
             "--kubelet-dir", kubelet_dir], env={**os.environ, **sim_host.env},
            stderr=subprocess.PIPE, text=True)
        kl.wait_for(["nvidia.com/gpu"], timeout=30)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "device plugin stopped" in err
        assert not [n for n in os.listdir(kubelet_dir) if n.startswith("nvctk-")]
    finally:
        kl.stop()


@pytest.mark.parametrize(("doc", "where"), [
    ("sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2.0}]}}",
     "sharing.timeSlicing.resources[0].replicas"),
    ("sharing: {vgpu: {replicas: 2.0}}", "sharing.vgpu.replicas"),
    ("sharing: {vgpu: {replicas: 10.0}}", "sharing.vgpu.replicas"),
    ("sharing: {vgpu: {replicas: !!float 3}}", "sharing.vgpu.replicas"),
    ("sharing: {vgpu: {replicas: .nan}}", "sharing.vgpu.replicas"),
    ("sharing: {vgpu: {replicas: .inf}}", "sharing.vgpu.replicas"),
    ("sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4.0}]}}",
     "sharing.timeSlicing.resources[0].replicas"),
    ("sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: "
     "1000000000000000000000000}]}}", "sharing.timeSlicing.resources[0].replicas"),
])
def test_cli_config_numbers_the_plugin_cannot_count_with(
        sim_host: SimHost, kubelet_dir: str, tmp_path: Path, doc: str, where: str) -> None:
    """JSON Schema's integer takes 2.0: the plugin then died in range() with a traceback.
    Every value is checked to the type the plugin uses, naming the field."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"version: v1\nflags: {{deviceListStrategy: envvar}}\n{doc}\n")
    r = CliRunner().invoke(dpcli.device_plugin, ["--kubelet-dir", kubelet_dir,
                                                 "--config", str(bad)], env=sim_host.env)
    assert r.exit_code == 1 and where in r.output, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)


def test_labels_cli(sim_host: SimHost, tmp_path: Path) -> None:
    out = tmp_path / "features.d" / "nvctk"
    out.parent.mkdir()
    r = CliRunner().invoke(lbcli.labels, ["--output", str(out)], env=sim_host.env)
    assert r.exit_code == 0, r.output
    lines = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert lines["nvidia.com/gpu.count"] == "2"
    assert lines["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert lines["nvidia.com/gpu.sharing-strategy"] == "none"
    assert oct(out.stat().st_mode & 0o777) == "0o644"


def test_sim_nvml_event_set(sim_own: SimHost) -> None:
    """The simulated NVML's event sets, through real pynvml: a timeout is NVML's
    Timeout, only XIDs raised after the set was created arrive, with their instance ids."""
    events.inject_xid(sim_own.root, 1, 31)  # before the set: never reported
    with nvml.session(sim_own.root):
        p = nvml.pynvml
        s = p.nvmlEventSetCreate()
        try:
            h = p.nvmlDeviceGetHandleByIndex(1)
            assert p.nvmlDeviceGetSupportedEventTypes(h) & p.nvmlEventTypeXidCriticalError
            p.nvmlDeviceRegisterEvents(h, p.nvmlEventTypeXidCriticalError, s)
            with pytest.raises(p.NVMLError) as e:
                p.nvmlEventSetWait_v2(s, 50)
            assert e.value.value == p.NVML_ERROR_TIMEOUT
            events.inject_xid(sim_own.root, 0, 48)  # GPU 0 is not registered
            events.inject_xid(sim_own.root, 1, 79, 2, 0)
            d = p.nvmlEventSetWait_v2(s, 1000)
            assert (d.eventType, d.eventData, d.gpuInstanceId, d.computeInstanceId) == (
                p.nvmlEventTypeXidCriticalError, 79, 2, 0)
            assert p.nvmlDeviceGetUUID(d.device) == sim_own.topology.gpus[1].uuid
        finally:
            p.nvmlEventSetFree(s)
