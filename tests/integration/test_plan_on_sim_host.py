"""The legacy form on the simulated hosts: the host (its cache first, NVML when the
cache does not know a device), driver discovery limited to the request's capabilities,
the plan file, MIG devices. (The rest: test_plan_on_sim_devices.py,
test_plan_on_sim_drm.py; shared: tests/support/plan_on_sim.py.)"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

import support.sim as _sim
from nvctk.base import config as nvconfig
from nvctk.base.config import ALL_CAPABILITIES
from nvctk.base.errors import RequestError, RequirementError, UnknownDeviceError
from nvctk.edits import DeviceNode, Edits, Mount, ProcMask, Symlink, Vgpu
from nvctk.host import cache as nvhost
from nvctk.host import driver
from nvctk.host.nvml import HostInfo, query_host
from nvctk.request.parse import VGPU_ENV_PREFIXES
from nvctk.sim.host import SimHost
from nvctk.vgpu import limits as vgpu
from support.plan_on_sim import nodes, plan, plan_of, spec
from support.runtime import NVD

cfg, host = _sim.cfg, _sim.host  # fixtures


# --- the host: cache first, NVML when the cache does not know a device ----------------------


class FakeLoad:
    """nvctk.host.cache.load_host serving `cached` (as from the cache) unless fresh=True."""

    def __init__(self, cached: HostInfo, fresh: HostInfo, from_cache: bool = True) -> None:
        self.cached, self.fresh, self.from_cache = cached, fresh, from_cache
        self.calls: list[tuple[str, str, bool]] = []

    def __call__(self, driver_root: str, state_dir: str, *,
                 fresh: bool = False) -> tuple[HostInfo, bool]:
        self.calls.append((driver_root, state_dir, fresh))
        if fresh:
            return self.fresh, False
        return self.cached, self.from_cache


def test_cached_host_is_used(cfg: nvconfig.Config, host: HostInfo,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    load = FakeLoad(host, host)
    monkeypatch.setattr(nvhost, "load_host", load)
    p = plan_of(spec({NVD: "1"}), cfg)
    assert p is not None and p.gpu_uuids == (host.gpus[1].uuid,)
    assert load.calls == [(cfg.driver_root, cfg.state_dir, False)]


def test_device_unknown_to_cache_asks_nvml(cfg: nvconfig.Config, host: HostInfo,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU (or MIG device) made since the cache was written is found by NVML."""
    stale = host.replace(gpus=host.gpus[:1])
    load = FakeLoad(stale, host)
    monkeypatch.setattr(nvhost, "load_host", load)
    for ident in ("1", host.gpus[1].uuid):
        load.calls.clear()
        p = plan_of(spec({NVD: f"0,{ident}"}), cfg)
        assert p is not None and p.gpu_uuids == (host.gpus[0].uuid, host.gpus[1].uuid)
        assert [c[2] for c in load.calls] == [False, True]
    # unknown to NVML too: the error, after one retry
    load.calls.clear()
    with pytest.raises(UnknownDeviceError, match="'7'"):
        plan_of(spec({NVD: "7"}), cfg)
    assert [c[2] for c in load.calls] == [False, True]


def test_no_retry_when_nvml_answered(cfg: nvconfig.Config, host: HostInfo,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    load = FakeLoad(host, host, from_cache=False)
    monkeypatch.setattr(nvhost, "load_host", load)
    with pytest.raises(RequestError, match="unknown device '7'"):
        plan_of(spec({NVD: "7"}), cfg)
    assert [c[2] for c in load.calls] == [False]


def test_other_request_errors_are_not_retried(cfg: nvconfig.Config, host: HostInfo,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    load = FakeLoad(host, host)
    monkeypatch.setattr(nvhost, "load_host", load)
    with pytest.raises(RequirementError):
        plan_of(spec({NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99"}), cfg)
    assert [c[2] for c in load.calls] == [False]


def test_real_host_cache(sim_host: SimHost, tmp_path: Path) -> None:
    """make_plan through nvctk.host.cache: the first plan fills the cache under state-dir, the
    second is served from it; both plans are the same."""
    cfg = nvconfig.load(sim_host.config_path).replace(state_dir=str(tmp_path / "state"))
    s = spec({NVD: "all"})
    first = plan_of(s, cfg)
    assert os.listdir(tmp_path / "state")  # the cache
    assert nvhost.load_host(cfg.driver_root, cfg.state_dir)[1]  # served from it now
    assert plan_of(s, cfg) == first


# --- driver discovery limited to the request's capabilities ------------------------------


def test_discovery_for_capabilities_matches_full(sim_host: SimHost, host: HostInfo) -> None:
    full = driver.discover_files(sim_host.root, host.driver_version)
    assert full.libraries32 and all(full.libraries.values())
    caps = ALL_CAPABILITIES
    for n in (1, 2, len(caps)):
        for sub in itertools.combinations(caps, n):
            f = driver.discover_files(sim_host.root, host.driver_version, sub)
            for c in sub:
                assert f.libraries.get(c) == full.libraries.get(c), (sub, c)
                assert f.binaries.get(c) == full.binaries.get(c)
                assert f.config_files.get(c) == full.config_files.get(c)
                assert f.sockets.get(c) == full.sockets.get(c)
            wanted = {x for c in sub for x in driver.LIBRARIES.get(c, ())}
            want32 = [h for h in full.libraries32
                      if os.path.basename(h).split(".so", 1)[0] in wanted]
            assert list(f.libraries32) == (want32 if "compat32" in sub else [])
            assert (f.firmware, f.proc_dir, f.dev_dir) == (full.firmware, full.proc_dir,
                                                           full.dev_dir)


@pytest.mark.parametrize("caps", ["all", "utility", "compute", "video", "display",
                                  "video,compat32", "graphics,compat32,utility"])
def test_plan_mounts_as_with_full_discovery(cfg: nvconfig.Config, host: HostInfo,
                                            monkeypatch: pytest.MonkeyPatch, caps: str) -> None:
    """The mounts are those the planner made when it discovered every capability."""
    env = {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": caps}
    p = plan(cfg, host, env)
    real = driver.discover_files
    monkeypatch.setattr(driver, "discover_files",
                        lambda root, version, capabilities=None: real(root, version))
    assert plan(cfg, host, env) == p


# --- the plan file -------------------------------------------------------------------------


def test_plan_json_round_trip() -> None:
    p = Edits(
        driver_version="550.54.15",
        capabilities=("compute", "utility"),
        gpu_uuids=("GPU-a", "GPU-b"),
        devices=(DeviceNode("/dev/nvidia0", "/h/dev/nvidia0", 195, 0),),
        mounts=(Mount("/h/libcuda.so.1", "/usr/lib/libcuda.so.1"),
                Mount("/h/run/sock", "/run/sock", "socket", read_only=False, noexec=True)),
        symlinks=(Symlink("/usr/lib/libcuda.so", "libcuda.so.1"),),
        proc_mask=ProcMask("/h/proc/driver/nvidia", ("0000:1b:00.0",)),
        env={"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/run/nvctk/vgpu/cache"},
        vgpu=Vgpu("/h/libvgpu.so", "/run/nvctk/libvgpu.so", "/run/nvctk/x", "/run/nvctk/vgpu",
                      {"CUDA_DEVICE_MEMORY_LIMIT_0": "1073741824"}),
    )
    text = p.to_json()
    assert Edits.from_json(text) == p
    assert Edits.from_json(text.encode()) == p
    assert json.loads(text) == p.to_dict()  # plain JSON, readable by any tool
    bare = Edits("1", (), ())
    assert Edits.from_json(bare.to_json()) == bare and bare.env == {} and bare.vgpu is None
    assert Edits("1", (), ()).env is not bare.env  # no shared default


def test_vgpu_env_prefixes_cover_vgpu_variables() -> None:
    """plan_vgpu skips nvctk.vgpu.limits when no variable starts with these prefixes."""
    for name in (vgpu.MEMORY_VAR, vgpu.SM_VAR, vgpu.CACHE_VAR, vgpu.RESERVE_VAR):
        assert name.startswith(VGPU_ENV_PREFIXES), name


def test_mig(sim_host_mig: SimHost) -> None:
    cfg = nvconfig.load(sim_host_mig.config_path)
    host = query_host(sim_host_mig.root)
    g0 = host.gpus[0]
    assert len(g0.mig_devices) == 3, g0  # MIG_LAYOUT in conftest
    topo = {m.uuid: m for m in sim_host_mig.topology.gpus[0].mig_devices}
    m1 = g0.mig_devices[1]
    for ident in (m1.uuid, m1.uuid.lower(), "0:1"):
        p = plan(cfg, host, {NVD: ident})
        caps = [d for d in p.devices if d.path.startswith("/dev/nvidia-caps/")]
        t = topo[m1.uuid]
        assert [c.minor for c in caps] == [t.gi_cap_minor, t.ci_cap_minor]
        assert all(c.major == sim_host_mig.caps_major for c in caps)
        assert "/dev/nvidia0" in nodes(p)  # the parent GPU
        assert p.gpu_uuids == (g0.uuid,)
    priv = plan_of(
        spec({NVD: "0", "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"},
             capabilities={"bounding": ["CAP_SYS_ADMIN"]}), cfg, host)
    assert priv is not None
    assert {"/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"} <= set(nodes(priv))
