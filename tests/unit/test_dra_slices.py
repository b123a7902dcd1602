"""nvctk.dra.slices on plain host records: what each host publishes, slice by slice,
and every slice as a 1.36 API server checks it (tests/support/apiserver.slice_problems:
the resource.k8s.io/v1 schema and the limits its descriptions state)."""

from __future__ import annotations

from typing import Any

import pytest

from nvctk.dra import claims
from nvctk.dra.devices import DEFAULT_DRIVER, node_devices
from nvctk.dra.slices import (
    ALL,
    MAX_STRING,
    Features,
    TaintPolicy,
    architecture,
    chunk_devices,
    node_pool,
    semver,
    slice_name,
    slices,
    taint,
    xid_of,
)
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from support.apiserver import pool_problems, quantity, slice_problems

D = DEFAULT_DRIVER
GIB = 1 << 30
MIG_MIB = {"1g.10gb": 9856, "2g.20gb": 19968, "3g.40gb": 40192, "7g.80gb": 80896}


def gpu(i: int, migs: tuple[str, ...] = (), memory_mib: int = 81920) -> GpuInfo:
    return GpuInfo(
        index=i, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", name="NVIDIA H100 80GB HBM3",
        minor=i, pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", memory_mib=memory_mib,
        compute_capability="9.0", brand="nvidia", mig_enabled=bool(migs),
        mig_devices=tuple(MigInfo(index=m, uuid=f"MIG-{i}-{m}", gpu_instance=m + 1,
                                  compute_instance=0, profile=p, memory_mib=MIG_MIB[p])
                          for m, p in enumerate(migs)))


def host(*gpus: GpuInfo, driver: str = "550.54.15", cuda: str = "12.4") -> HostInfo:
    return HostInfo(driver_version=driver, cuda_version=cuda, gpus=gpus)


def publish(h: HostInfo, unhealthy: dict[str, str] | None = None,
            features: Features = ALL, generation: int = 1) -> list[dict[str, Any]]:
    """The slices, each checked as the API server would, and the pool as a whole."""
    out = slices(node_pool(h, D, unhealthy or {}, features), "node-a", D, generation)
    for s in out:
        assert slice_problems(s) == [], s["metadata"]["name"]
    assert pool_problems(out) == []
    return out


def devices(out: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in out for d in s["spec"].get("devices") or ()}


def shape(out: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(what, how many) per slice: ("devices", n) or ("counters", n)."""
    return [("counters", len(s["spec"]["sharedCounters"])) if "sharedCounters" in s["spec"]
            else ("devices", len(s["spec"]["devices"])) for s in out]


EIGHT_BY_SEVEN = host(*(gpu(i, ("1g.10gb",) * 7) for i in range(8)))

# host, features, unhealthy -> the slices' shape, the devices' names in order
CASES: list[tuple[str, HostInfo, Features, dict[str, str], list[tuple[str, int]], list[str]]] = [
    ("one GPU", host(gpu(0)), Features(), {}, [("devices", 1)], ["gpu-0"]),
    ("eight GPUs", host(*(gpu(i) for i in range(8))), Features(), {}, [("devices", 8)],
     [f"gpu-{i}" for i in range(8)]),
    ("no GPU", host(), Features(), {}, [("devices", 0)], []),
    ("a MIG layout", host(gpu(0, ("3g.40gb", "2g.20gb", "1g.10gb")), gpu(1)), Features(), {},
     [("counters", 1), ("devices", 5)],
     ["gpu-0", "gpu-0-mig-0", "gpu-0-mig-1", "gpu-0-mig-2", "gpu-1"]),
    ("8 GPUs x 7 MIG devices", EIGHT_BY_SEVEN, Features(), {},
     [("counters", 8), ("devices", 64)],
     [n for i in range(8) for n in (f"gpu-{i}", *(f"gpu-{i}-mig-{m}" for m in range(7)))]),
    ("9 MIG GPUs: two counter slices", host(*(gpu(i, ("7g.80gb",)) for i in range(9))),
     Features(), {}, [("counters", 8), ("counters", 1), ("devices", 18)],
     [n for i in range(9) for n in (f"gpu-{i}", f"gpu-{i}-mig-0")]),
    ("130 GPUs: over 128 devices", host(*(gpu(i) for i in range(130))), Features(), {},
     [("devices", 128), ("devices", 2)], [f"gpu-{i}" for i in range(130)]),
    ("130 GPUs, one tainted: 64 beside it", host(*(gpu(i) for i in range(130))), Features(),
     {gpu(100).uuid: "XID 79"}, [("devices", 100), ("devices", 30)],
     [f"gpu-{i}" for i in range(130)]),
    ("an unhealthy GPU is tainted", host(gpu(0), gpu(1)), Features(), {gpu(1).uuid: "XID 48"},
     [("devices", 2)], ["gpu-0", "gpu-1"]),
    ("without taints an unhealthy GPU is left out", host(gpu(0), gpu(1)),
     Features(taints=False), {gpu(1).uuid: "XID 48"}, [("devices", 1)], ["gpu-0"]),
    ("without counters: MIG devices, never their GPU", host(gpu(0, ("3g.40gb",)), gpu(1)),
     Features(counters=False), {}, [("devices", 2)], ["gpu-0-mig-0", "gpu-1"]),
]


@pytest.mark.parametrize(("h", "features", "unhealthy", "want_shape", "want_names"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_pool_each_host_publishes(h: HostInfo, features: Features,
                                      unhealthy: dict[str, str],
                                      want_shape: list[tuple[str, int]],
                                      want_names: list[str]) -> None:
    out = publish(h, unhealthy, features, generation=3)
    assert shape(out) == want_shape
    assert list(devices(out)) == want_names
    assert {(s["spec"]["pool"]["name"], s["spec"]["pool"]["generation"],
             s["spec"]["pool"]["resourceSliceCount"], s["spec"]["nodeName"])
            for s in out} == {("node-a", 3, len(out), "node-a")}
    assert [s["metadata"]["name"] for s in out] == [slice_name("node-a", D, i)
                                                    for i in range(len(out))]


def test_the_published_names_are_the_ones_prepare_looks_up() -> None:
    """nvctk.dra.devices names what NodePrepareResources finds; the slices publish those."""
    h = host(gpu(0, ("3g.40gb", "1g.10gb")), gpu(1))
    assert list(devices(publish(h))) == list(node_devices(h))


def test_a_gpu_is_shareable_by_memory_and_sm_share() -> None:
    dev = devices(publish(host(gpu(0))))["gpu-0"]
    mem = 81920 * (1 << 20)
    assert dev["allowMultipleAllocations"] is True
    assert dev["capacity"] == {
        "memory": {"value": str(mem), "requestPolicy": {
            "default": str(mem), "validRange": {"min": str(1 << 20), "step": str(1 << 20)}}},
        "smShare": {"value": "100", "requestPolicy": {
            "default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}},
    }
    assert "consumesCounters" not in dev and "taints" not in dev


def test_a_gpu_has_nvidias_attribute_names() -> None:
    h = host(gpu(3), driver="535.104.05", cuda="12.2")
    assert devices(publish(h))["gpu-3"]["attributes"] == {
        "type": {"string": "gpu"},
        "uuid": {"string": gpu(3).uuid},
        "index": {"int": 3},
        "minor": {"int": 3},
        "migEnabled": {"bool": False},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "brand": {"string": "nvidia"},
        "pcieBusID": {"string": "0000:1b:00.0"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "535.104.5"},
        "cudaDriverVersion": {"version": "12.2.0"},
        "architecture": {"string": "Hopper"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:1b:00.0"},
    }


def test_gpus_and_their_mig_devices_carry_the_pcie_root_that_aligns_them_with_nics() -> None:
    g0, g1 = gpu(0, ("3g.40gb",)), gpu(1)
    roots = {"0000:18:00.0": "pci0000:17", "0000:19:00.0": "pci0000:3a"}
    out = slices(node_pool(host(g0, g1), D, {}, pcie_roots=roots), "node-a", D, 1)
    assert all(slice_problems(s) == [] for s in out)
    attrs = {n: d["attributes"] for n, d in devices(out).items()}
    assert attrs["gpu-0"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:17"}
    assert attrs["gpu-0-mig-0"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:17"}
    assert attrs["gpu-1"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:3a"}
    assert "resource.kubernetes.io/pciBusID" not in attrs["gpu-0-mig-0"]  # not a PCI device
    # sysfs that does not show a GPU: no attribute rather than a wrong one
    bare = devices(publish(host(gpu(0))))["gpu-0"]["attributes"]
    assert "resource.kubernetes.io/pcieRoot" not in bare


@pytest.mark.parametrize(("cc", "arch"), [("9.0", "Hopper"), ("8.0", "Ampere"), ("8.6", "Ampere"),
                                          ("8.9", "Ada Lovelace"), ("7.5", "Turing"),
                                          ("7.0", "Volta"), ("10.0", "Blackwell"),
                                          ("12.0", "Blackwell"), ("6.1", "Pascal"), ("99.0", None)])
def test_architecture_names(cc: str, arch: str | None) -> None:
    assert architecture(cc) == arch


def test_a_mig_gpu_and_its_mig_devices_share_one_counter_set() -> None:
    out = publish(host(gpu(0, ("3g.40gb", "2g.20gb", "1g.10gb"))))
    counters = out[0]["spec"]["sharedCounters"]
    total = 81920 * (1 << 20)
    assert counters == [{"name": "gpu-0", "counters": {"memory": {"value": str(total)}}}]
    devs = devices(out)
    used = {n: [(c["counterSet"], quantity(c["counters"]["memory"]["value"]))
                for c in d["consumesCounters"]] for n, d in devs.items()}
    assert used == {"gpu-0": [("gpu-0", total)],
                    "gpu-0-mig-0": [("gpu-0", 40192 << 20)],
                    "gpu-0-mig-1": [("gpu-0", 19968 << 20)],
                    "gpu-0-mig-2": [("gpu-0", 9856 << 20)]}
    # the GPU takes the whole set (no MIG device fits beside it); the MIG devices together fit
    migs = [u[0][1] for n, u in used.items() if n != "gpu-0"]
    assert used["gpu-0"] == [("gpu-0", total)] and min(migs) > 0 and sum(migs) <= total
    # a MIG parent is not shared: its CUDA devices are the MIG devices
    assert "allowMultipleAllocations" not in devs["gpu-0"]
    assert devs["gpu-0-mig-1"]["attributes"]["profile"] == {"string": "2g.20gb"}
    assert devs["gpu-0-mig-1"]["attributes"]["parentUUID"] == {"string": gpu(0).uuid}
    assert devs["gpu-0-mig-1"]["attributes"]["gpuInstance"] == {"int": 2}


def test_mig_devices_bigger_than_their_gpu_still_fit_their_counter_set() -> None:
    """The sim's (or a driver's) MIG memory may add up past the GPU's: the set holds both."""
    g = gpu(0, ("7g.80gb",), memory_mib=40960)  # 80896 MiB of MIG on a 40 GiB GPU
    out = publish(host(g))
    assert out[0]["spec"]["sharedCounters"][0]["counters"]["memory"]["value"] == str(80896 << 20)


@pytest.mark.parametrize(("reason", "effect", "value"), [
    ("XID 79", "NoSchedule", "XID-79"),  # fell off the bus: no new claim; pods not evicted
    ("XID 95", "NoSchedule", "XID-95"),
    ("cannot register XID events: Not Supported", "NoSchedule",
     "cannot-register-XID-events-Not-Supported"),
    ("XID 48 " + "x" * 100, "NoSchedule", ("XID-48-" + "x" * 100)[:63]),
    ("!!!", "NoSchedule", ""),
])
def test_an_unhealthy_device_is_tainted_with_its_reason(reason: str, effect: str,
                                                         value: str) -> None:
    assert taint(D, reason, effect) == {"key": f"{D}/unhealthy", "value": value,
                                        "effect": effect}
    out = publish(host(gpu(0)), {gpu(0).uuid: reason})
    assert devices(out)["gpu-0"]["taints"] == [taint(D, reason, effect)]


@pytest.mark.parametrize("xid", [63, 92, 94])
def test_a_non_fatal_xid_taints_nothing(xid: int) -> None:
    """A contained or corrected error (XID 94 on one MIG instance): the device goes on
    serving; no taint, so no pod is evicted nor any claim refused."""
    g = gpu(0, ("3g.40gb", "1g.10gb"))
    devs = devices(publish(host(g), {g.mig_devices[1].uuid: f"XID {xid}"}))
    assert [n for n, d in devs.items() if d.get("taints")] == []


def test_a_fatal_xid_on_a_mig_device_taints_that_device_only() -> None:
    g = gpu(0, ("3g.40gb", "1g.10gb"))
    devs = devices(publish(host(g), {g.mig_devices[1].uuid: "XID 95"}))
    assert [n for n, d in devs.items() if d.get("taints")] == ["gpu-0-mig-1"]


@pytest.mark.parametrize(("items", "reason", "effect"), [
    (["79=NoExecute"], "XID 79", "NoExecute"),
    (["94=NoSchedule"], "XID 94", "NoSchedule"),
    (["48=None"], "XID 48", None),
    (["48=None"], "XID 79", "NoSchedule"),  # others keep the default
    ([], "cannot register XID events: x", "NoSchedule"),
])
def test_the_operator_maps_xids_to_effects(items: list[str], reason: str,
                                           effect: str | None) -> None:
    policy = TaintPolicy.parse(items)
    assert policy.effect(reason) == effect
    out = slices(node_pool(host(gpu(0)), D, {gpu(0).uuid: reason}, ALL, policy), "n", D, 1)
    got = devices(out)["gpu-0"].get("taints")
    assert got == (None if effect is None else [taint(D, reason, effect)])


@pytest.mark.parametrize("item", ["79", "x=NoSchedule", "79=Evict", "=None", "79:NoExecute",
                                  "\u0667\u0669=NoExecute", "\u00b2=None"])  # other scripts' digits
def test_a_bad_xid_mapping_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match="want XID=EFFECT"):
        TaintPolicy.parse([item])


@pytest.mark.parametrize(("reason", "xid"), [("XID 79", 79), ("XID 79 on gpu-0", 79),
                                             ("XID \u0667\u0669", None), ("no XID", None)])
def test_the_xid_a_reason_names(reason: str, xid: int | None) -> None:
    assert xid_of(reason) == xid


def test_without_shares_a_gpu_is_whole() -> None:
    dev = devices(publish(host(gpu(0)), features=Features(shares=False)))["gpu-0"]
    assert "allowMultipleAllocations" not in dev
    assert all("requestPolicy" not in c for c in dev["capacity"].values())


def test_a_long_product_name_is_cut_to_the_api_limit() -> None:
    g = GpuInfo(index=0, uuid="GPU-x", name="N" * 100, minor=0, pci_bus_id="00000000:01:00.0",
                memory_mib=1024, compute_capability="8.0", brand="nvidia", mig_enabled=False)
    dev = devices(publish(host(g)))["gpu-0"]
    assert dev["attributes"]["productName"] == {"string": "N" * MAX_STRING}


@pytest.mark.parametrize(("version", "want"), [
    ("550.54.15", "550.54.15"), ("535.104.05", "535.104.5"), ("12.4", "12.4.0"),
    ("9", "9.0.0"), ("", None), ("1.2.3.4", None), ("12.4-rc1", None), ("v12", None),
])
def test_versions_become_semver(version: str, want: str | None) -> None:
    assert semver(version) == want


def test_an_unparsable_version_is_left_out() -> None:
    dev = devices(publish(host(gpu(0), driver="r550")))["gpu-0"]
    assert "driverVersion" not in dev["attributes"]


def test_chunks_never_exceed_the_limit_of_what_they_hold() -> None:
    plain = {"name": "p"}
    counting = {"name": "c", "consumesCounters": [{}]}
    seq = (plain,) * 100 + (counting,) + (plain,) * 200 + (counting,) * 70
    chunks = chunk_devices(seq)
    assert [d for c in chunks for d in c] == list(seq)
    for c in chunks:
        assert len(c) <= (64 if any(d.get("consumesCounters") for d in c) else 128)


def test_a_long_node_name_still_makes_a_valid_slice_name() -> None:
    node = ".".join(["n" * 60] * 4)  # 243 characters, a valid node name
    out = slices(node_pool(host(gpu(0)), D, {}), node, D, 1)
    assert slice_problems(out[0]) == []
    assert len(out[0]["metadata"]["name"]) <= 253


def _result(consumed: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"uid": "u"}, "status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": D, "pool": "node-a", "device": "gpu-0",
         "shareID": "s1", "consumedCapacity": consumed}]}}}}


def test_what_the_policy_defaults_consume_prepare_reads_as_the_whole_gpu() -> None:
    """A claim that asks for no capacity consumes each policy's default (all memory,
    smShare 0): NodePrepareResources must read that as the whole GPU, uncapped."""
    h = host(gpu(0))
    caps = devices(publish(h))["gpu-0"]["capacity"]
    defaults = {k: c["requestPolicy"]["default"] for k, c in caps.items()}
    (r,) = claims.results(_result(defaults), D, "node-a", node_devices(h))
    assert not r.partial


def test_a_memory_only_share_is_capped_by_memory_alone() -> None:
    h = host(gpu(0))
    (r,) = claims.results(_result({"memory": "2Gi", "smShare": "0"}), D, "node-a",
                          node_devices(h))
    assert r.partial and r.consumed == {"memory": 2 * GIB, "smShare": 0}
    with pytest.raises(claims.ClaimError, match=r"smShare 101 is outside 0\.\.100"):
        claims.results(_result({"memory": "2Gi", "smShare": "101"}), D, "node-a",
                       node_devices(h))


def test_pcie_roots_are_read_from_sysfs_and_never_guessed(tmp_path: Any) -> None:
    """A GPU's PCIe root complex is the pciDDDD:BB its sysfs device resolves under; a GPU
    sysfs does not show (a driver container without /sys) is left out."""
    from nvctk.dra.node import pcie_roots

    devices = tmp_path / "sys/bus/pci/devices"
    devices.mkdir(parents=True)
    real = tmp_path / "sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0"  # behind a bridge
    real.mkdir(parents=True)
    (devices / "0000:18:00.0").symlink_to(real)
    assert pcie_roots(str(tmp_path), host(gpu(0), gpu(1))) == {"0000:18:00.0": "pci0000:17"}
