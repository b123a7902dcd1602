"""The device plugin's logic without gRPC: config validation, resources per mode,
Allocate per strategy and sharing mode, GetPreferredAllocation. The gRPC side, with
a fake kubelet, is tests/integration/test_k8s_grpc.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nvctk.base.errors import ConfigError
from nvctk.host.inventory import HostInfo
from nvctk.k8s import allocate as alloc
from nvctk.k8s import config as dpconfig
from nvctk.k8s import labels, resources
from nvctk.sim.topology import make_topology
from nvctk.vgpu import limits as vgpu
from support.k8s import host_of

TWO = host_of(make_topology(gpus=2))
MIG = host_of(make_topology(gpus=2, mig={0: ["3g.40gb", "2g.20gb", "1g.10gb"]}))
ALL_MIG = host_of(make_topology(gpus=2, mig={0: ["1g.10gb"] * 2, 1: ["1g.10gb"]}))
G0, G1 = TWO.gpus[0].uuid, TWO.gpus[1].uuid


def cfg(**kw: Any) -> dpconfig.PluginConfig:
    """A config; its device list envvar unless given (the answers these tests read are
    env's; the default, volume-mounts, is test_config_defaults_and_full's)."""
    flags = {"deviceListStrategy": "envvar", **kw.pop("flags", {})}
    return dpconfig.parse({"version": "v1", "flags": flags, **kw})


def res_of(host: HostInfo, c: dpconfig.PluginConfig) -> dict[str, resources.Resource]:
    return {r.name: r for r in resources.build(c, host)}


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, field", [
    ("version: v2\n", "version"),
    ("version: v1\nflags: {migStrategy: half}\n", "flags.migStrategy"),
    ("version: v1\nflags: {deviceListStrategy: [envvar, bogus]}\n", "flags.deviceListStrategy"),
    ("version: v1\nflags: {mpsPipeDirectory: relative/dir}\n", "flags.mpsPipeDirectory"),
    ("version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 1}]}}\n",
     "sharing.timeSlicing.resources[0].replicas"),
    ("version: v1\nsharing: {timeSlicing: {resources: [{name: 'bad name', replicas: 2}]}}\n",
     "sharing.timeSlicing.resources[0].name"),
    ("version: v1\nsharing: {vgpu: {replicas: 0}}\n", "sharing.vgpu.replicas"),
    ("version: v1\nsharing: {vgpu: {replicas: 2}, mps: {}}\n", "only one of"),
    ("version: v1\nsharing: {vgpu: {replicas: 2, memory: 3}}\n", "sharing.vgpu: unknown field"),
    ("version: v1\nsharing: {mps: {coreResource: a.b/x, memoryResource: a.b/x}}\n", "must differ"),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
     "    - {name: nvidia.com/gpu, replicas: 2}\n    - {name: nvidia.com/gpu, replicas: 3}\n",
     "listed twice"),
    ("[1, 2\n", "not valid YAML"),
    ("- 1\n", "(top level)"),
])
def test_bad_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    p = tmp_path / "dp.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        dpconfig.load(str(p))
    assert str(e.value).startswith(f"{p}: ")
    assert field in str(e.value)


def test_config_missing_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        dpconfig.load(str(tmp_path / "nope.yaml"))


def test_config_defaults_and_full() -> None:
    assert dpconfig.load(None).strategies == ("volume-mounts",)  # a Pod cannot forge it
    c = cfg(flags={"migStrategy": "mixed", "deviceListStrategy": ["envvar", "cdi-cri"]},
            sharing={"timeSlicing": {"renameByDefault": True, "failRequestsGreaterThanOne": True,
                                     "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}})
    assert (c.mig_strategy, c.strategies, c.sharing, c.fail_gt_one) == (
        "mixed", ("envvar", "cdi-cri"), "time-slicing", True)


# --- resources --------------------------------------------------------------------------------


def test_whole_gpus_and_mig_strategies() -> None:
    assert list(res_of(TWO, cfg())["nvidia.com/gpu"].devices) == [G0, G1]
    # none: MIG ignored, both GPUs whole
    assert len(res_of(MIG, cfg())["nvidia.com/gpu"].devices) == 2
    mixed = res_of(MIG, cfg(flags={"migStrategy": "mixed"}))
    assert sorted(mixed) == ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb",
                             "nvidia.com/mig-3g.40gb"]
    assert list(mixed["nvidia.com/gpu"].devices) == [MIG.gpus[1].uuid]
    assert list(mixed["nvidia.com/mig-2g.20gb"].devices) == [MIG.gpus[0].mig_devices[1].uuid]
    single = res_of(ALL_MIG, cfg(flags={"migStrategy": "single"}))
    assert list(single) == ["nvidia.com/gpu"] and len(single["nvidia.com/gpu"].devices) == 3
    with pytest.raises(ConfigError, match=r"GPU\(s\) 1 do not"):
        resources.build(cfg(flags={"migStrategy": "single"}), MIG)


def test_time_slicing_nvidia_compatible() -> None:
    ts = {"resources": [{"name": "nvidia.com/gpu", "replicas": 3}]}
    r = res_of(TWO, cfg(sharing={"timeSlicing": ts}))["nvidia.com/gpu"]
    assert list(r.devices)[:4] == [f"{G0}::0", f"{G0}::1", f"{G0}::2", f"{G1}::0"]
    renamed = res_of(TWO, cfg(sharing={"timeSlicing": {**ts, "renameByDefault": True}}))
    assert list(renamed) == ["nvidia.com/gpu.shared"]
    mixed = res_of(MIG, cfg(flags={"migStrategy": "mixed"}, sharing={"timeSlicing": {
        "resources": [{"name": "nvidia.com/mig-1g.10gb", "replicas": 2}]}}))
    assert len(mixed["nvidia.com/mig-1g.10gb"].devices) == 2
    assert mixed["nvidia.com/gpu"].kind == "gpu"
    with pytest.raises(ConfigError, match=r"mig-7g\.80gb is not a resource"):
        resources.build(cfg(sharing={"timeSlicing": {"resources": [
            {"name": "nvidia.com/mig-7g.80gb", "replicas": 2}]}}), TWO)


def test_vgpu_and_mps_resources() -> None:
    v = res_of(MIG, cfg(flags={"migStrategy": "mixed"}, sharing={"vgpu": {"replicas": 16}}))
    # only the whole GPU is split; MIG devices stay
    assert len(v["nvidia.com/vgpu"].devices) == 16 and "nvidia.com/gpu" not in v
    assert "nvidia.com/mig-3g.40gb" in v
    m = res_of(TWO, cfg(sharing={"mps": {}}))
    assert len(m["nvidia.com/mps-core"].devices) == 200
    assert len(m["nvidia.com/mps-memory"].devices) == 160  # 80 GiB per GPU


# --- Allocate ---------------------------------------------------------------------------------


def test_allocate_strategies() -> None:
    r = res_of(TWO, cfg())["nvidia.com/gpu"]
    a = alloc.allocate(r, cfg(), [G1, G0], "/")
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": f"{G0},{G1}"} and not a.mounts
    c = cfg(flags={"deviceListStrategy": "volume-mounts"})
    a = alloc.allocate(r, c, [G1], "/")
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert a.mounts == [(f"/var/run/nvidia-container-devices/{G1}", "/dev/null", True)]
    c = cfg(flags={"deviceListStrategy": ["cdi-annotations", "cdi-cri"]})
    a = alloc.allocate(r, c, [G0], "/")
    assert a.annotations == {"cdi.k8s.io/nvctk-device-plugin_gpu": f"nvidia.com/gpu={G0}"}
    assert a.cdi_devices == [f"nvidia.com/gpu={G0}"]
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": "void"}  # an image's `all` cannot widen it


def test_allocate_mig_device_by_uuid() -> None:
    r = res_of(MIG, cfg(flags={"migStrategy": "mixed"}))["nvidia.com/mig-1g.10gb"]
    m = MIG.gpus[0].mig_devices[2]
    assert alloc.allocate(r, cfg(), [m.uuid], "/").envs["NVIDIA_VISIBLE_DEVICES"] == m.uuid


def test_allocate_rejects_unknown_and_unhealthy() -> None:
    r = res_of(TWO, cfg())["nvidia.com/gpu"]
    with pytest.raises(alloc.AllocateError, match=r"unknown device id.*GPU-nope") as e:
        alloc.allocate(r, cfg(), [G0, "GPU-nope"], "/")
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(alloc.AllocateError, match=f"unhealthy device id.*{G1}") as e:
        alloc.allocate(r, cfg(), [G1], "/", {G1})
    assert e.value.code == "FAILED_PRECONDITION"
    # a GPU's XID also takes down its replicas
    ts = cfg(sharing={"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}})
    rt = res_of(TWO, ts)["nvidia.com/gpu"]
    with pytest.raises(alloc.AllocateError, match="unhealthy"):
        alloc.allocate(rt, ts, [f"{G0}::1"], "/", {G0})


def test_time_slicing_allocate_and_fail_greater_than_one() -> None:
    ts = {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}
    c = cfg(sharing={"timeSlicing": ts})
    r = res_of(TWO, c)["nvidia.com/gpu"]
    a = alloc.allocate(r, c, [f"{G0}::0", f"{G0}::3"], "/")
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == G0  # two replicas, one GPU
    c1 = cfg(sharing={"timeSlicing": {**ts, "failRequestsGreaterThanOne": True}})
    r1 = res_of(TWO, c1)["nvidia.com/gpu"]
    assert alloc.allocate(r1, c1, [f"{G1}::2"], "/").envs["NVIDIA_VISIBLE_DEVICES"] == G1
    with pytest.raises(alloc.AllocateError, match="failRequestsGreaterThanOne"):
        alloc.allocate(r1, c1, [f"{G0}::0", f"{G0}::1"], "/")


def test_vgpu_limits_add_up_and_span_gpus() -> None:
    c = cfg(sharing={"vgpu": {"replicas": 4}})
    r = res_of(TWO, c)["nvidia.com/vgpu"]
    one = alloc.allocate(r, c, [f"{G0}::1"], "/").envs
    assert one == {"NVIDIA_VISIBLE_DEVICES": G0, "CUDA_DEVICE_MEMORY_LIMIT": "20480m",
                   "CUDA_DEVICE_SM_LIMIT": "25"}
    two = alloc.allocate(r, c, [f"{G0}::1", f"{G0}::3"], "/").envs
    assert (two["CUDA_DEVICE_MEMORY_LIMIT"], two["CUDA_DEVICE_SM_LIMIT"]) == ("40960m", "50")
    span = alloc.allocate(r, c, [f"{G1}::0", f"{G0}::2", f"{G1}::3"], "/").envs
    assert span["NVIDIA_VISIBLE_DEVICES"] == f"{G0},{G1}"
    assert span["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20480m" and span["CUDA_DEVICE_SM_LIMIT_0"] == "25"
    assert span["CUDA_DEVICE_MEMORY_LIMIT_1"] == "40960m" and span["CUDA_DEVICE_SM_LIMIT_1"] == "50"
    # the runtime's own parser takes exactly this syntax
    lim = vgpu.limits_from_env(span, 2)
    assert lim.memory == (20480 << 20, 40960 << 20) and lim.sm == (25, 50)


def test_mps_env_and_pipe_mount(tmp_path: Path) -> None:
    c = cfg(sharing={"mps": {}})
    rs = res_of(TWO, c)
    core, mem = rs["nvidia.com/mps-core"], rs["nvidia.com/mps-memory"]
    pipe = tmp_path / "tmp/nvidia-mps"
    with pytest.raises(alloc.AllocateError, match=r"MPS pipe directory .* is missing") as e:
        alloc.allocate(core, c, [f"{G0}::{i}" for i in range(50)], str(tmp_path))
    assert e.value.code == "FAILED_PRECONDITION"
    (tmp_path / "tmp").mkdir()
    os.symlink("/etc", pipe)  # a planted link is refused, never bound
    with pytest.raises(alloc.AllocateError, match="not a directory"):
        alloc.allocate(mem, c, [f"{G0}::0"], str(tmp_path))
    pipe.unlink()
    pipe.mkdir()
    a = alloc.allocate(core, c, [f"{G0}::{i}" for i in range(50)], str(tmp_path))
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": G0, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
                      "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}
    assert a.mounts == [("/tmp/nvidia-mps", str(pipe), False)]
    # a plugin in a container sees the driver root at tmp_path, the host has it at /: the
    # kubelet is given the host's path (nvctk host-driver-root)
    import dataclasses

    on = alloc.allocate(core, dataclasses.replace(c, host_driver_root="/"),
                        [f"{G0}::{i}" for i in range(50)], str(tmp_path))
    assert on.mounts == [("/tmp/nvidia-mps", "/tmp/nvidia-mps", False)]
    m = alloc.allocate(mem, c, [f"{G0}::{i}" for i in range(8)], str(tmp_path))
    assert m.envs == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G",
                      "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}
    even = alloc.allocate(core, c, [f"{g}::{i}" for g in (G0, G1) for i in range(30)],
                          str(tmp_path))
    assert even.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    with pytest.raises(alloc.AllocateError, match="uneven shares"):
        alloc.allocate(core, c, [f"{G0}::1", f"{G1}::1", f"{G1}::2"], str(tmp_path))
    with pytest.raises(alloc.AllocateError, match="must lie on one GPU"):
        alloc.allocate(mem, c, [f"{G0}::1", f"{G1}::1"], str(tmp_path))


# --- GetPreferredAllocation -------------------------------------------------------------------


def test_preferred_packs_vgpu_shares() -> None:
    c = cfg(sharing={"vgpu": {"replicas": 4}})
    r = res_of(TWO, c)["nvidia.com/vgpu"]
    # GPU 0 has 2 free shares, GPU 1 all 4: 2 shares go to the fuller GPU 0 (best fit)
    avail = [f"{G1}::{i}" for i in range(4)] + [f"{G0}::2", f"{G0}::3"]
    got = alloc.preferred(r, avail, [], 2)
    assert {r.devices[i].unit.uuid for i in got} == {G0}
    # 3 fit only on GPU 1
    assert {r.devices[i].unit.uuid for i in alloc.preferred(r, avail, [], 3)} == {G1}
    # 5: as few GPUs as possible (GPU 1 whole, then 1 from GPU 0)
    five = alloc.preferred(r, avail, [], 5)
    assert len(five) == 5 and sum(1 for i in five if i.startswith(G1)) == 4
    # must_include is kept, and the rest joins its GPU
    got = alloc.preferred(r, [*avail, f"{G0}::0"], [f"{G1}::0"], 3)
    assert got[0] == f"{G1}::0" and all(i.startswith(G1) for i in got)


def test_preferred_spreads_time_slices() -> None:
    c = cfg(sharing={"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}})
    r = res_of(TWO, c)["nvidia.com/gpu"]
    got = alloc.preferred(r, list(r.devices), [], 2)
    assert {r.devices[i].unit.uuid for i in got} == {G0, G1}


# --- labels -----------------------------------------------------------------------------------


def test_labels() -> None:
    lb = labels.node_labels(TWO, cfg(sharing={"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 4}]}}))
    assert lb["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
    assert (lb["nvidia.com/gpu.count"], lb["nvidia.com/gpu.memory"]) == ("2", "81920")
    assert (lb["nvidia.com/gpu.family"], lb["nvidia.com/gpu.compute.major"]) == ("hopper", "9")
    assert lb["nvidia.com/cuda.driver-version.full"] == "550.54.15"
    assert (lb["nvidia.com/gpu.sharing-strategy"], lb["nvidia.com/gpu.replicas"]) == (
        "time-slicing", "4")
    assert lb["nvidia.com/mig.capable"] == "true"
    assert lb["nvidia.com/gpu.present"] == "true"  # what nvctk's DaemonSets select
    v = labels.node_labels(TWO, cfg(sharing={"vgpu": {"replicas": 16}}))
    assert (v["nvidia.com/gpu.sharing-strategy"], v["nvidia.com/gpu.replicas"]) == ("vgpu", "16")
    assert v["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    s = labels.node_labels(ALL_MIG, cfg(flags={"migStrategy": "single"}))
    assert s["nvidia.com/gpu.product"].endswith("-MIG-1g.10gb") and s["nvidia.com/gpu.count"] == "3"
    m = labels.node_labels(MIG, cfg(flags={"migStrategy": "mixed"}))
    assert m["nvidia.com/mig-2g.20gb.count"] == "1"
    assert m["nvidia.com/gpu.sharing-strategy"] == "none"


@pytest.mark.parametrize("strategies", [["envvar"], ["volume-mounts"], ["envvar", "volume-mounts"],
                                        ["envvar", "cdi-annotations"], ["envvar", "cdi-cri"]])
def test_vgpu_share_travels_in_a_verifiable_annotation(tmp_path: Path,
                                                       strategies: list[str]) -> None:
    """Every strategy carries the share in nvctk.io/vgpu.<name> as well as in the env
    (unchanged); the runtime's check (nvctk.vgpu.authority.shares) reads back exactly the
    share, per GPU uuid, with the node's key, and nothing with another key."""
    import dataclasses

    from nvctk.base.errors import RequestError
    from nvctk.vgpu import authority

    key_path = str(tmp_path / "keys" / "authority.key")
    c = dataclasses.replace(cfg(flags={"deviceListStrategy": strategies},
                                sharing={"vgpu": {"replicas": 4}}), authority_key=key_path)
    r = res_of(TWO, c)["nvidia.com/vgpu"]
    a = alloc.allocate(r, c, [f"{G1}::0", f"{G0}::2", f"{G1}::3"], "/")
    assert a.envs["CUDA_DEVICE_MEMORY_LIMIT_1"] == "40960m"  # the env as before
    (name,) = [k for k in a.annotations if k.startswith(authority.PREFIX)]
    assert name == "nvctk.io/vgpu.vgpu"
    assert os.stat(key_path).st_mode & 0o777 == 0o600  # made by the first Allocate
    key = authority.load_key(key_path)
    got = authority.shares({name: a.annotations[name]}, key, key_path)
    assert got == {G0: (20480 << 20, 25), G1: (40960 << 20, 50)}
    with pytest.raises(RequestError, match="MAC does not verify"):
        authority.shares({name: a.annotations[name]}, os.urandom(32), key_path)
    # without a key configured (PluginConfig's default): the env only, as before
    plain = alloc.allocate(r, dataclasses.replace(c, authority_key=None), [f"{G0}::1"], "/")
    assert not any(k.startswith(authority.PREFIX) for k in plain.annotations)


def test_vgpu_allocate_refuses_a_bad_key_file(tmp_path: Path) -> None:
    """A key file another user could have written is no key: Allocate fails with
    FAILED_PRECONDITION rather than hand out a share anyone could forge."""
    import dataclasses

    key_path = tmp_path / "authority.key"
    key_path.write_bytes(os.urandom(32))
    key_path.chmod(0o666)
    c = dataclasses.replace(cfg(sharing={"vgpu": {"replicas": 4}}), authority_key=str(key_path))
    r = res_of(TWO, c)["nvidia.com/vgpu"]
    with pytest.raises(alloc.AllocateError, match="refuses it") as e:
        alloc.allocate(r, c, [f"{G0}::1"], "/")
    assert e.value.code == "FAILED_PRECONDITION"


# --- colliding resource names --------------------------------------------

_MIXED = {"migStrategy": "mixed"}
_TS = "sharing.timeSlicing.resources"


@pytest.mark.parametrize(("flags", "sharing", "fields"), [
    # a vGPU resource named like a MIG one: the MIG devices were never advertised
    (_MIXED, {"vgpu": {"replicas": 2, "resourceName": "nvidia.com/mig-1g.10gb"}},
     ["sharing.vgpu.resourceName", "MIG resource"]),
    ({}, {"vgpu": {"replicas": 2, "resourceName": "nvidia.com/mig-3g.40gb"}},
     ["sharing.vgpu.resourceName", "MIG resource"]),
    (_MIXED, {"mps": {"coreResource": "nvidia.com/mig-2g.20gb"}},
     ["sharing.mps.coreResource", "MIG resource"]),
    (_MIXED, {"mps": {"memoryResource": "nvidia.com/mig-1g.10gb"}},
     ["sharing.mps.memoryResource", "MIG resource"]),
    # two renames to one name
    (_MIXED, {"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 2, "rename": "example.com/shared"},
        {"name": "nvidia.com/mig-1g.10gb", "replicas": 2, "rename": "example.com/shared"}]}},
     [f"{_TS}[1].rename", f"{_TS}[0].rename"]),
    # a rename onto another entry that keeps its name
    (_MIXED, {"timeSlicing": {"resources": [
        {"name": "nvidia.com/mig-1g.10gb", "replicas": 2},
        {"name": "nvidia.com/mig-2g.20gb", "replicas": 2, "rename": "nvidia.com/mig-1g.10gb"}]}},
     [f"{_TS}[1].rename", f"{_TS}[0].name"]),
    # time-slicing names colliding with mig-*
    (_MIXED, {"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 2, "rename": "nvidia.com/mig-3g.40gb"}]}},
     [f"{_TS}[0].rename", "MIG resource"]),
    # onto the whole GPUs, which keep their name
    (_MIXED, {"timeSlicing": {"resources": [
        {"name": "nvidia.com/mig-1g.10gb", "replicas": 2, "rename": "nvidia.com/gpu"}]}},
     [f"{_TS}[0].rename", "whole GPUs"]),
    # renameByDefault's name taken by an explicit rename
    (_MIXED, {"timeSlicing": {"renameByDefault": True, "resources": [
        {"name": "nvidia.com/gpu", "replicas": 2},
        {"name": "nvidia.com/mig-1g.10gb", "replicas": 2, "rename": "nvidia.com/gpu.shared"}]}},
     [f"{_TS}[1].rename", f"{_TS}[0].name (renameByDefault"]),
], ids=["vgpu-as-mig-mixed", "vgpu-as-mig-none", "mps-core-as-mig", "mps-memory-as-mig",
        "two-renames", "rename-onto-kept", "ts-as-mig", "ts-onto-gpu", "ts-onto-default"])
def test_colliding_resource_names_are_refused_at_load(tmp_path: Path, flags: dict[str, Any],
                                                      sharing: dict[str, Any],
                                                      fields: list[str]) -> None:
    """Before: accepted, and one of the two resources' devices was never advertised."""
    import yaml

    p = tmp_path / "dp.yaml"
    p.write_text(yaml.safe_dump({"version": "v1", "flags": flags, "sharing": sharing}))
    with pytest.raises(ConfigError) as e:
        dpconfig.load(str(p))
    assert str(e.value).startswith(f"{p}: "), e.value
    for f in fields:
        assert f in str(e.value), e.value


@pytest.mark.parametrize("sharing", [
    {"vgpu": {"replicas": 2, "resourceName": "nvidia.com/gpu"}},
    {"mps": {"coreResource": "nvidia.com/gpu"}},
    {"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 2, "rename": "nvidia.com/gpu2"},
        {"name": "nvidia.com/mig-1g.10gb", "replicas": 2, "rename": "nvidia.com/gpu"}]}},
    {"timeSlicing": {"resources": [
        {"name": "nvidia.com/mig-1g.10gb", "replicas": 2,
         "rename": "nvidia.com/mig-1g.10gb.shared"}]}},
], ids=["vgpu-takes-gpu", "mps-takes-gpu", "swap", "mig-shared"])
def test_names_that_replace_what_they_share_are_fine(sharing: dict[str, Any]) -> None:
    c = cfg(flags=_MIXED, sharing=sharing)
    names = [r.name for r in resources.build(c, MIG)]
    assert len(names) == len(set(names)), names
