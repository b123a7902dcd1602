"""The DRA plugin's pure parts: quantities, a claim's results and parameters checked
(nvctk.dra.claims), the prepared-claims record read back (nvctk.dra.record)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from nvctk.dra import claims, record
from nvctk.dra.devices import node_devices
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo

MIG = MigInfo(1, "MIG-aaaa", 1, 0, "1g.10gb", 9856)
HOST = HostInfo("550.54.15", "12.4", (
    GpuInfo(0, "GPU-0000", "NVIDIA H100", 0, "00000000:17:00.0", 81559, "9.0", "nvidia", False),
    GpuInfo(1, "GPU-1111", "NVIDIA A100", 1, "00000000:2a:00.0", 40960, "8.0", "nvidia", True,
            (MIG,))))
DEVICES = node_devices(HOST)
DRIVER = "gpu.nvctk.io"


@pytest.mark.parametrize("text, value", [
    ("2Gi", 2 << 30), ("2147483648", 2 << 30), ("1.5Gi", 3 << 29), ("500m", Decimal("0.5")),
    ("1e3", 1000), ("2k", 2000), ("25", 25), (7, 7), ("+3Mi", 3 << 20),
])
def test_quantities(text: Any, value: Any) -> None:
    assert claims.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["lots", "", "1.2.3", "2GiB", "Gi", True, None, 1.5, "--1"])
def test_not_quantities(text: Any) -> None:
    with pytest.raises(ValueError, match="is not a quantity"):
        claims.parse_quantity(text)


@pytest.mark.parametrize("text", ["1e999999999", "1e-999999999", "1e99999999999", "1e41",
                                  "1e-41", "9" * 65, 10 ** 70])
def test_quantities_out_of_range_are_value_errors(text: Any) -> None:
    """Past 1e±40 (or 64 characters): a ValueError saying so, never decimal's own
    exceptions or a number too large to use."""
    with pytest.raises(ValueError, match="is not a quantity"):
        claims.parse_quantity(text)


def test_device_names_and_capacities() -> None:
    assert list(DEVICES) == ["gpu-0", "gpu-1", "gpu-1-mig-1"]
    assert DEVICES["gpu-1-mig-1"].capacity == {"memory": 9856 << 20, "smShare": 100}


def a_claim(*results: dict[str, Any], config: list[Any] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"results": list(results)}
    if config is not None:
        devices["config"] = config
    return {"metadata": {"uid": "u"}, "status": {"allocation": {"devices": devices}}}


def r(device: str, **kw: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": "n", "device": device, **kw}


def test_results_of_this_driver_only_with_their_shares() -> None:
    got = claims.results(a_claim(
        r("gpu-0", shareID="s", consumedCapacity={"memory": "2Gi", "smShare": "30"}),
        {"request": "nic", "driver": "nic.example.com", "pool": "x", "device": "eth0"},
        r("gpu-1-mig-1")), DRIVER, "n", DEVICES)
    assert [(x.device.name, x.share_id, x.consumed, x.partial) for x in got] == [
        ("gpu-0", "s", {"memory": 2 << 30, "smShare": 30}, True),
        ("gpu-1-mig-1", None, {}, False)]


def test_the_whole_device_consumed_is_no_share() -> None:
    (x,) = claims.results(a_claim(r("gpu-0", consumedCapacity={"memory": "81559Mi"})),
                          DRIVER, "n", DEVICES)
    assert not x.partial


EXCLUSIVE = [{"opaque": {"driver": DRIVER, "parameters": {
    "apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig", "sharing": {"strategy": "Exclusive"}}}}]


@pytest.mark.parametrize("consumed", [{"memory": "81559Mi"}, {"memory": "81559Mi", "smShare": "0"},
                                      {"memory": "81559Mi", "smShare": "100"}])
def test_exclusive_takes_a_1_36_allocation_of_the_whole_device(consumed: dict[str, str]) -> None:
    """1.36 gives every allocation of a shareable device a shareID; one consuming all of
    its memory (the class's default request) is exclusive: nothing else fits beside it."""
    (x,) = claims.results(a_claim(r("gpu-0", shareID="a1", consumedCapacity=consumed),
                                  config=EXCLUSIVE), DRIVER, "n", DEVICES)
    assert x.strategy == "Exclusive" and x.share_id == "a1"


@pytest.mark.parametrize("consumed", [{"memory": "2Gi"}, {"memory": "81558Mi"}, None,
                                      {"smShare": "100"}])
def test_exclusive_refuses_a_share_of_the_device(consumed: dict[str, str] | None) -> None:
    kw = {"consumedCapacity": consumed} if consumed is not None else {}
    with pytest.raises(claims.ClaimError, match="Exclusive, but device gpu-0 is allocated as share"):
        claims.results(a_claim(r("gpu-0", shareID="a1", **kw), config=EXCLUSIVE),
                       DRIVER, "n", DEVICES)


def test_a_claims_config_applies_per_request_and_later_wins() -> None:
    p = {"apiVersion": claims.PARAMS_API_VERSION, "kind": claims.PARAMS_KIND}
    got = claims.strategies(a_claim(config=[
        {"opaque": {"driver": DRIVER, "parameters": {**p, "sharing": {"strategy": "Exclusive"}}}},
        {"requests": ["gpu"], "opaque": {"driver": DRIVER,
                                         "parameters": {**p, "sharing": {"strategy": "VGpu"}}}},
        {"opaque": {"driver": "other", "parameters": "anything"}}]), DRIVER)
    assert got == {None: "Exclusive", "gpu": "VGpu"}


@pytest.mark.parametrize("params, why", [
    ("x", "parameters must be an object"),
    ({"apiVersion": "v1", "kind": "GpuConfig"}, "want apiVersion gpu.nvctk.io/v1"),
    ({"apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig", "extra": 1}, "unknown field 'extra'"),
    ({"apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig", "sharing": "VGpu"},
     "sharing must be"),
])
def test_bad_parameters(params: Any, why: str) -> None:
    with pytest.raises(claims.ClaimError, match=why):
        claims.strategies(a_claim(config=[{"opaque": {"driver": DRIVER, "parameters": params}}]),
                          DRIVER)


def test_record_round_trip() -> None:
    rec = record.Prepared("ns", "c", "u-1", "/var/run/cdi/x.json", (
        record.PreparedDevice(("gpu",), "n", "gpu-0", ("k/claim=u-1-gpu-0",), "s"),),
        "boot", "/run/nvctk/dra/u-1")
    assert record.parse(rec.to_json(), "f") == rec


@pytest.mark.parametrize("data, why", [
    (b"{", r"corrupt \(not JSON\)"),
    (b'{"v": 2}', "not a version 1 record"),
    (b'[1]', "not a version 1 record"),
    (b'{"v": 1, "devices": []}', "fields missing"),
    (b'{"v": 1}', "no device list"),
])
def test_corrupt_records(data: bytes, why: str) -> None:
    with pytest.raises(record.RecordError, match=why):
        record.parse(data, "f")


@pytest.mark.parametrize("uid", ["", "../x", "a/b", ".hidden", "x" * 200, "x\n", "x\ny",
                                 "\nx", "x\x00", "x y"])
def test_a_uid_that_is_no_file_name(uid: str) -> None:
    with pytest.raises(record.RecordError):
        record.check_uid(uid)


def test_the_health_record_is_restored_for_this_boot_and_present_devices_only(
        tmp_path: Any) -> None:
    from nvctk.dra import health as health_record
    from nvctk.k8s.health import Health

    path = str(tmp_path / "health.json")
    h = Health()
    h.mark({"GPU-a"}, "XID 79")
    h.mark({"GPU-gone"}, "XID 48")
    health_record.save(path, h, boot="boot-1")
    again = Health()
    assert health_record.restore(path, again, {"GPU-a", "GPU-b"}, boot="boot-1") == {
        "GPU-a": "XID 79"}
    assert again.reasons == {"GPU-a": "XID 79"}
    assert health_record.restore(path, Health(), {"GPU-a"}, boot="boot-2") == {}  # rebooted
    for bad in (b"{", b"[]", b'{"v": 2, "unhealthy": {}}', b'{"v": 1, "unhealthy": {"a": 1}}'):
        (tmp_path / "health.json").write_bytes(bad)
        assert health_record.restore(path, Health(), {"a"}, boot="boot-1") == {}


@pytest.mark.parametrize("strategy", ["Exclusive", "VGpu", "MPS", "TimeSlicing"])
def test_admin_access_is_the_whole_device_without_a_share_of_its_own(strategy: str) -> None:
    """adminAccess (monitoring a device others hold): the whole device, whatever the
    class's strategy, consuming nothing: no cap, no ledger, no MPS; never refused as a
    share (Exclusive) nor for want of one (VGpu)."""
    cfg = [{"opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig", "sharing": {"strategy": strategy}}}}]
    (x,) = claims.results(a_claim(r("gpu-0", adminAccess=True, shareID="s",
                                    consumedCapacity={"memory": "2Gi"}), config=cfg),
                          DRIVER, "n", DEVICES)
    assert x.admin and not x.partial and x.consumed == {} and x.strategy == "TimeSlicing"
    with pytest.raises(claims.ClaimError, match="adminAccess must be true or false"):
        claims.results(a_claim(r("gpu-0", adminAccess="yes")), DRIVER, "n", DEVICES)
