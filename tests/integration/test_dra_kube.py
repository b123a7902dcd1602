"""nvctk.dra.kube through the official kubernetes client against the API-server double
(tests/support/apiserver.py): claims read, slices written and checked, a down or slow
API server retried with bounded back-off, answers retrying cannot change raised at once.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.dra.kube import (
    ApiUnavailable,
    Conflict,
    Kube,
    KubeError,
    NotFound,
    Retry,
    load_client,
)
from support.apiserver import ApiServer, client_for, kubeconfig, running

DRIVER = "gpu.nvctk.io"
FAST = Retry(attempts=4, base=0.001, cap=0.01, deadline=30, timeout=5)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with running() as a:
        yield a


@pytest.fixture
def kube(api: ApiServer) -> Kube:
    return Kube(client_for(api), FAST)


def a_slice(name: str = "node-a-gpu-0", node: str = "node-a", gen: int = 1,
            devices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": gen, "resourceSliceCount": 1},
                     "devices": devices if devices is not None else [
                         {"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-0"}},
                          "capacity": {"memory": {"value": "16Gi"}}}]}}


def a_claim(name: str = "c1", results: list[dict[str, Any]] | None = None,
            allocated: bool = True) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"namespace": "team", "name": name}, "spec": {}}
    if allocated:
        obj["status"] = {"allocation": {"devices": {
            "results": results if results is not None else [
                {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0",
                 "shareID": "2f0c", "consumedCapacity": {"memory": "2Gi", "smShare": "0"}},
                {"request": "nic", "driver": "nic.example.com", "pool": "node-a",
                 "device": "eth0"}],
            "config": [
                {"source": "FromClass", "requests": [],
                 "opaque": {"driver": DRIVER, "parameters": {"sharing": "timeSlicing"}}},
                {"source": "FromClaim", "requests": ["nic"],
                 "opaque": {"driver": "nic.example.com", "parameters": {}}}]}}}
    return obj


# --- claims -------------------------------------------------------------------------------


def test_a_claim_is_read_as_the_api_server_has_it(api: ApiServer, kube: Kube) -> None:
    stored = api.add_claim(a_claim())
    claim = kube.get_claim("team", "c1")
    assert claim == stored  # uid, status.allocation.devices.results and config, as sent
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert (result["shareID"], result["consumedCapacity"]) == (
        "2f0c", {"memory": "2Gi", "smShare": "0"})


def test_a_claim_that_is_gone_is_not_found_at_once(api: ApiServer, kube: Kube) -> None:
    with pytest.raises(NotFound, match="team/gone"):
        kube.get_claim("team", "gone")
    assert len(api.requests) == 1  # 404 is not retried


def test_the_callers_deadline_bounds_the_retries(api: ApiServer) -> None:
    now = [0.0]
    kube = Kube(client_for(api), Retry(attempts=50, base=1.0, cap=1.0, deadline=60),
                sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    api.fail(100)
    # the deadline is also each request's real read timeout: on a loaded machine an
    # answer can take longer than that (CI, 2026-11-28), and that ends the call too
    with pytest.raises(ApiUnavailable, match=r"HTTP 503|did not answer") as e:
        kube.get_claim("team", "c1", timeout=3.0)
    assert now[0] <= 3.0 and 1 <= len(api.requests) <= 7
    if "HTTP 503" in str(e.value):
        assert len(api.requests) >= 2  # retried, until the caller's deadline


# --- retry --------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["fail", "drop"])
def test_a_down_api_server_is_retried(api: ApiServer, kube: Kube, fault: str) -> None:
    api.add_claim(a_claim())
    getattr(api, fault)(FAST.attempts - 1)
    assert kube.get_claim("team", "c1")["metadata"]["name"] == "c1"
    assert len(api.requests) == FAST.attempts


def test_retries_are_bounded_and_name_the_call(api: ApiServer, kube: Kube) -> None:
    api.add_claim(a_claim())
    api.fail(FAST.attempts + 5)
    with pytest.raises(ApiUnavailable, match=r"reading ResourceClaim team/c1: .*HTTP 503"):
        kube.get_claim("team", "c1")
    assert len(api.requests) == FAST.attempts


def test_the_back_off_grows_and_stops_at_the_deadline(api: ApiServer) -> None:
    waits: list[float] = []
    retry = Retry(attempts=10, base=1.0, cap=4.0, deadline=6.0)
    kube = Kube(client_for(api), retry, sleep=waits.append, clock=lambda: sum(waits))
    api.fail(20)
    with pytest.raises(ApiUnavailable, match=r"after [0-6]\.\d+s"):
        kube.get_claim("team", "c1")
    assert len(waits) >= 2 and all(0.5 * min(4.0, 2.0 ** n) <= w <= min(4.0, 2.0 ** n)
                                   for n, w in enumerate(waits))
    assert sum(waits) <= retry.deadline  # no wait planned past the deadline
    assert len(api.requests) == len(waits) + 1


def test_a_slow_api_server_times_out_and_is_retried(api: ApiServer) -> None:
    api.add_claim(a_claim())
    kube = Kube(client_for(api), Retry(attempts=3, base=0.001, timeout=0.3))
    api.stall(1)
    try:
        assert kube.get_claim("team", "c1")["metadata"]["name"] == "c1"
        assert api.stalled.acquire(timeout=0)  # the first request did hang
    finally:
        api.release.set()
    assert len(api.requests) == 2


def _in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException | Any]]:
    out: list[BaseException | Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("pause", [0.01, 0.3])
def test_an_answer_that_trickles_for_ever_ends_at_the_callers_deadline(
        api: ApiServer, pause: float) -> None:
    """A body sent a byte at a time (each read well inside the read timeout) and never
    finished: the call's total deadline cuts it off, as ApiUnavailable naming the call."""
    kube = Kube(client_for(api), Retry(attempts=3, base=0.001, deadline=30, timeout=10))
    api.trickle(1, pause)
    try:
        t, out = _in_thread(lambda: kube.get_claim("team", "c1", timeout=1.0))
        t.join(20)  # a bound far past the deadline: only a reader without one reaches it
        assert not t.is_alive(), "the read did not end at its deadline"
    finally:
        api.release.set()
    assert isinstance(out[0], ApiUnavailable), out
    assert "reading ResourceClaim team/c1" in str(out[0]) and "did not end" in str(out[0])


@pytest.mark.parametrize("body, why", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
    (b"{" + b" " * (3 << 20) + b"}", "larger than 2 MiB"),
    (b"not json", "not JSON"),
    (b"[1]", "not an object"),
])
def test_an_answer_too_deep_or_too_large_is_a_clear_error(
        api: ApiServer, kube: Kube, monkeypatch: pytest.MonkeyPatch, body: bytes,
        why: str) -> None:
    import nvctk.dra.kube as kube_mod

    monkeypatch.setattr(kube_mod, "MAX_ANSWER_BYTES", 2 << 20)
    api.answer_raw(1, body)
    with pytest.raises(KubeError, match=why) as e:
        kube.get_claim("team", "c1")
    assert not isinstance(e.value, ApiUnavailable)  # not retried: it would not change
    assert len(api.requests) == 1


def test_an_unreachable_api_server_is_api_unavailable(tmp_path: Path) -> None:
    with running() as gone:
        url = gone.url
    kube = Kube(client_for(type("Gone", (), {"url": url})()),  # type: ignore[arg-type]
                Retry(attempts=2, base=0.001))
    with pytest.raises(ApiUnavailable, match=r"(?i)connection refused"):
        kube.get_claim("team", "c1")


# --- slices -------------------------------------------------------------------------------


def test_slices_are_created_listed_updated_and_deleted(api: ApiServer, kube: Kube) -> None:
    kube.create_slice(a_slice("node-a-gpu-0"))
    kube.create_slice(a_slice("node-b-gpu-0", node="node-b"))
    mine = kube.list_slices(DRIVER, "node-a")
    assert [s["metadata"]["name"] for s in mine] == ["node-a-gpu-0"]
    assert ("GET", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector="
            "spec.nodeName%3Dnode-a%2Cspec.driver%3Dgpu.nvctk.io&limit=500") in api.requests
    obj = mine[0]
    obj["spec"]["pool"]["generation"] = 2
    kube.update_slice(obj)
    assert api.slices["node-a-gpu-0"]["spec"]["pool"]["generation"] == 2
    kube.delete_slice("node-a-gpu-0")
    kube.delete_slice("node-a-gpu-0")  # gone already: no error
    assert sorted(api.slices) == ["node-b-gpu-0"]


def test_a_stale_update_is_a_conflict(api: ApiServer, kube: Kube) -> None:
    first = kube.create_slice(a_slice())
    kube.update_slice(copy.deepcopy(first))
    with pytest.raises(Conflict):
        kube.update_slice(first)


@pytest.mark.parametrize(("edit", "why"), [
    (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "not a unique DNS label"),
    (lambda s: s["spec"].update(devices=[{"name": f"d{i}"} for i in range(129)]), "129 devices > 128"),
    (lambda s: s["spec"].update(devices=[{"name": f"d{i}", "taints": [
        {"key": "k", "effect": "NoSchedule"}]} for i in range(65)]), "65 devices > 64"),
    (lambda s: s["spec"].update(sharedCounters=[{"name": "gpu-0", "counters": {
        "memory": {"value": "1Gi"}}}]), "only one of devices and sharedCounters"),
    (lambda s: s["spec"]["devices"][0]["capacity"]["memory"].update(
        requestPolicy={"default": "1Gi"}), "allowMultipleAllocations"),
    (lambda s: s["spec"].update(allNodes=True), "exactly one of nodeName"),
    # a capacity name is a C identifier (optionally domain/...): no '-'
    (lambda s: s["spec"]["devices"][0]["capacity"].update({"sm-share": {"value": "100"}}),
     "'sm-share' is not a qualified name"),
])
def test_an_invalid_slice_is_refused_with_the_reason(api: ApiServer, kube: Kube, edit: Any,
                                                     why: str) -> None:
    s = a_slice()
    edit(s)
    with pytest.raises(KubeError, match="HTTP 422") as e:
        kube.create_slice(s)
    assert why in str(e.value)
    assert api.slices == {}


def test_the_double_checks_the_strict_schema(api: ApiServer) -> None:
    """An unknown field (the client's model drops one before sending, so POST by hand)."""
    import json
    import urllib.error
    import urllib.request

    s = a_slice()
    s["spec"]["devices"][0]["bogus"] = 1
    req = urllib.request.Request(f"{api.url}/apis/resource.k8s.io/v1/resourceslices",
                                 data=json.dumps(s).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 422
    assert "spec.devices.0: Additional properties are not allowed ('bogus'" in e.value.read().decode()
    assert api.slices == {}


def test_the_driver_of_a_slice_is_immutable(api: ApiServer, kube: Kube) -> None:
    obj = kube.create_slice(a_slice())
    obj["spec"]["driver"] = "other.example.com"
    with pytest.raises(KubeError, match=r"spec\.driver: field is immutable"):
        kube.update_slice(obj)


def test_writes_from_threads_each_land_once(api: ApiServer, kube: Kube) -> None:
    """The client is shared by the publisher and prepare calls (one ApiClient)."""
    errors: list[BaseException] = []

    def make(i: int) -> None:
        try:
            kube.create_slice(a_slice(f"node-a-gpu-{i}"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(api.slices) == 8


# --- config -------------------------------------------------------------------------------


def test_a_kubeconfig_points_the_client_at_its_server(api: ApiServer, tmp_path: Path) -> None:
    api.add_claim(a_claim())
    cfg = kubeconfig(tmp_path / "kubeconfig", api.url)
    kube = Kube(load_client(cfg), FAST)
    assert kube.get_claim("team", "c1")["metadata"]["name"] == "c1"


@pytest.mark.parametrize("content", [None, "not: [yaml", "apiVersion: v1\nkind: Config\n"])
def test_a_bad_kubeconfig_is_a_clear_error(tmp_path: Path, content: str | None) -> None:
    cfg = tmp_path / "kubeconfig"
    if content is not None:
        cfg.write_text(content)
    with pytest.raises(KubeError, match=f"cannot load the kubeconfig {cfg}"):
        load_client(str(cfg))


def test_outside_a_cluster_the_in_cluster_config_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="cannot load the in-cluster config"):
        load_client(None)
