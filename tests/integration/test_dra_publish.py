"""nvctk.dra.publish through the official kubernetes client against the API-server
double: the node's pool written, kept in sync as GPUs go, MIG layouts change and
devices turn unhealthy, repaired after someone else's edit, republished without the
fields a 1.34 server drops; every write checked against the 1.36 resource.k8s.io/v1
schema and limits (a refused write fails the test: `api.rejected()`)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.base.errors import DriverError
from nvctk.dra.devices import DEFAULT_DRIVER
from nvctk.dra.kube import ApiUnavailable, Kube, Retry
from nvctk.dra.publish import Publisher
from nvctk.dra.slices import Features
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from nvctk.host.nvml import query_host
from nvctk.k8s.health import Health
from nvctk.sim.host import SimHost
from support import wait
from support.apiserver import GATES, ApiServer, client_for, pool_problems, running

D = DEFAULT_DRIVER
NODE = "node-a"
FAST = Retry(attempts=4, base=0.001, cap=0.01, deadline=30, timeout=5)


def gpu(i: int, migs: int = 0) -> GpuInfo:
    return GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", minor=i,
                   pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", memory_mib=81920,
                   compute_capability="9.0", brand="nvidia", mig_enabled=migs > 0,
                   mig_devices=tuple(MigInfo(m, f"MIG-{i}-{m}", m + 1, 0, "1g.10gb", 9856)
                                     for m in range(migs)))


def host(*gpus: GpuInfo) -> HostInfo:
    return HostInfo("550.54.15", "12.4", gpus)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with running() as a:
        yield a


def publisher(api: ApiServer) -> Publisher:
    return Publisher(Kube(client_for(api), FAST), NODE, D)


def pool(api: ApiServer) -> list[dict[str, Any]]:
    """The node's slices as stored, checked as a consumer would see the pool."""
    out = api.pool(D, NODE)
    assert api.rejected() == []
    assert pool_problems(out) == []
    return out


def names(slices: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"].get("devices") or ()]


def generation(slices: list[dict[str, Any]]) -> int:
    (gen,) = {s["spec"]["pool"]["generation"] for s in slices}
    return gen


def writes(api: ApiServer) -> int:
    return sum(1 for w in api.writes if w.accepted)


def test_eight_gpus_by_seven_mig_devices_are_published(api: ApiServer) -> None:
    p = publisher(api)
    assert p.sync(host(*(gpu(i, 7) for i in range(8))), {})
    out = pool(api)
    assert len(names(out)) == 64 and len(out) == 2 and generation(out) == 1
    assert [len(s["spec"].get("sharedCounters") or ()) for s in out] == [8, 0]


def test_an_unchanged_pool_is_not_written_again(api: ApiServer) -> None:
    p = publisher(api)
    h = host(gpu(0), gpu(1))
    p.sync(h, {})
    n = writes(api)
    assert not p.sync(h, {})
    assert not p.sync(h, {}, check=True)  # listed: the slices are the ones written
    assert writes(api) == n


@pytest.mark.parametrize(("before", "after", "want"), [
    (host(gpu(0), gpu(1)), host(gpu(0)), ["gpu-0"]),  # a GPU disappears
    (host(gpu(0, 2)), host(gpu(0, 3)), ["gpu-0", "gpu-0-mig-0", "gpu-0-mig-1", "gpu-0-mig-2"]),
    (host(gpu(0, 7)), host(gpu(0)), ["gpu-0"]),  # MIG off
])
def test_a_changed_host_bumps_the_generation(api: ApiServer, before: HostInfo,
                                             after: HostInfo, want: list[str]) -> None:
    p = publisher(api)
    p.sync(before, {})
    assert p.sync(after, {})
    out = pool(api)
    assert names(out) == want and generation(out) == 2


def test_a_pool_that_needs_fewer_slices_deletes_the_rest(api: ApiServer) -> None:
    p = publisher(api)
    p.sync(host(*(gpu(i) for i in range(130))), {})
    assert len(pool(api)) == 2
    p.sync(host(gpu(0)), {})
    out = pool(api)
    assert len(out) == 1 and names(out) == ["gpu-0"]
    assert [w.verb for w in api.writes][-1] == "delete"


def test_an_unhealthy_gpu_is_tainted_in_a_new_generation(api: ApiServer) -> None:
    p = publisher(api)
    h = host(gpu(0), gpu(1))
    p.sync(h, {})
    p.sync(h, {"GPU-1": "XID 79"})
    out = pool(api)
    devs = {d["name"]: d for s in out for d in s["spec"]["devices"]}
    assert [(t["key"], t["value"], t["effect"]) for t in devs["gpu-1"]["taints"]] == [
        (f"{D}/unhealthy", "XID-79", "NoSchedule")]
    assert "taints" not in devs["gpu-0"] and generation(out) == 2


def test_a_slice_deleted_by_someone_else_is_written_again(api: ApiServer) -> None:
    p = publisher(api)
    h = host(gpu(0))
    p.sync(h, {})
    with api.lock:
        api.slices.clear()
    assert not p.sync(h, {})  # nothing changed here, and not listed
    assert p.sync(h, {}, check=True)
    out = pool(api)
    assert names(out) == ["gpu-0"] and generation(out) == 2


def test_slices_of_an_older_layout_are_taken_over(api: ApiServer) -> None:
    """A plugin restarted: the slices it wrote before are replaced, the generation
    continues from theirs."""
    publisher(api).sync(host(gpu(0), gpu(1)), {})
    assert publisher(api).sync(host(gpu(0)), {})
    out = pool(api)
    assert names(out) == ["gpu-0"] and generation(out) == 2


def test_a_down_api_server_leaves_the_pool_to_the_next_sync(api: ApiServer) -> None:
    p = publisher(api)
    p.sync(host(gpu(0)), {})
    api.fail(1000)
    with pytest.raises(ApiUnavailable):
        p.sync(host(gpu(0), gpu(1)), {})
    with api.lock:
        api._faults.clear()
    assert p.sync(host(gpu(0), gpu(1)), {})
    out = pool(api)
    assert names(out) == ["gpu-0", "gpu-1"] and generation(out) == 2


@pytest.mark.parametrize(("gate", "features", "want"), [
    # 1.34: no shares -> whole GPUs
    ("DRAConsumableCapacity", Features(shares=False), ["gpu-0", "gpu-1-mig-0", "gpu-1"]),
    # no counters -> MIG devices without their GPU
    ("DRAPartitionableDevices", Features(counters=False), ["gpu-0", "gpu-1-mig-0"]),
    # no taints -> the unhealthy MIG device left out
    ("DRADeviceTaints", Features(taints=False), ["gpu-0", "gpu-1"]),
])
def test_fields_a_server_drops_are_published_without(gate: str, features: Features,
                                                     want: list[str]) -> None:
    with running(frozenset({gate})) as api:
        p = publisher(api)
        p.sync(host(gpu(0), gpu(1, 1)), {"MIG-1-0": "XID 95"})
        assert p.features == features
        out = pool(api)
        assert sorted(names(out)) == sorted(want)
        # what the server kept is what was sent: nothing half-dropped
        for s in out:
            for d in s["spec"].get("devices") or ():
                assert features.shares or "allowMultipleAllocations" not in d
                assert features.counters or "consumesCounters" not in d


def test_a_1_34_server_gets_whole_gpus_and_mig_devices_only() -> None:
    with running(frozenset(GATES)) as api:
        p = publisher(api)
        p.sync(host(gpu(0), gpu(1, 2)), {"GPU-0": "XID 48"})
        assert p.features == Features(shares=False, counters=False, taints=False)
        out = pool(api)
        assert names(out) == ["gpu-1-mig-0", "gpu-1-mig-1"]
        assert not any(s["spec"].get("sharedCounters") for s in out)


def test_the_loop_follows_health_and_stops(api: ApiServer) -> None:
    p = publisher(api)
    health = Health()
    h = host(gpu(0), gpu(1))
    t = threading.Thread(target=p.run, args=(lambda: h, health, 60.0))
    t.start()
    try:
        wait.until(lambda: api.pool(D, NODE), 10, "the first publish")
        health.mark({"GPU-0"}, "XID 79")
        wait.until(lambda: any(d.get("taints") for s in api.pool(D, NODE)
                               for d in s["spec"]["devices"]), 10, "the taint")
    finally:
        p.stop(health)
        t.join(10)
    assert not t.is_alive()
    assert generation(pool(api)) == 2


def test_the_loop_outlives_nvml_and_the_api_server_failing(api: ApiServer) -> None:
    """NVML down at first, then an API server answering 503: the loop keeps going and
    publishes once both are back."""
    p = Publisher(Kube(client_for(api), Retry(attempts=1, timeout=5)), NODE, D)
    health = Health()
    tries: list[int] = []

    def host_source() -> HostInfo:
        tries.append(1)
        if len(tries) == 1:
            raise DriverError("NVML at /x: not loaded")
        return host(gpu(0))

    api.fail(1)  # the first sync's list
    t = threading.Thread(target=p.run, args=(host_source, health, 0.05))
    t.start()
    try:
        wait.until(lambda: api.pool(D, NODE), 10, "the publish after the failures")
    finally:
        p.stop(health)
        t.join(10)
    assert not t.is_alive() and len(tries) >= 3
    assert names(pool(api)) == ["gpu-0"]


def test_a_simulated_hosts_nvml_inventory_is_published(sim_host_mig: SimHost,
                                                        api: ApiServer) -> None:
    """From NVML (the simulated driver) through nvctk's inventory to the API server."""
    h = query_host(sim_host_mig.root)
    assert any(g.mig_devices for g in h.gpus)
    publisher(api).sync(h, {})
    out = pool(api)
    devs = {d["name"]: d for s in out for d in s["spec"].get("devices") or ()}
    assert {d["attributes"]["uuid"]["string"] for d in devs.values()} == {
        u for g in h.gpus for u in (g.uuid, *(m.uuid for m in g.mig_devices))}
    for g in h.gpus:
        assert devs[f"gpu-{g.index}"]["capacity"]["memory"]["value"] == str(g.memory_mib << 20)
        for m in g.mig_devices:
            assert devs[f"gpu-{g.index}-mig-{m.index}"]["attributes"]["profile"] == {
                "string": m.profile}


@pytest.mark.slow
def test_the_publish_bench_runs(tmp_path: Path) -> None:
    """bench/dra_publish.py end to end, one run (its figures are the bench's, not a test's)."""
    out = tmp_path / "dra_publish.txt"
    r = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "bench/dra_publish.py"),
                        "--runs", "1", "--output", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "64 devices, 8 counter sets, 2 ResourceSlices" in out.read_text()
