"""One edits form for all three paths: for the same GPUs, legacy mode's form
(nvctk.plan) equals CDI mode's form (nvctk.cdi.resolve) fed with nvctk's own
generated spec, hooks aside; `cdi generate`'s spec read back gives the form again;
applying either (nvctk.spec.apply) gives the same config.json, hooks aside.

The legitimate differences are encoded, not hidden:
- provenance (driver version, capabilities, GPU uuids) and the hooks are not compared;
- a CDI device carries every capability but compat32 (a spec names no image): its
  mounts, links and DRM nodes are those of legacy mode with those capabilities, plus
  the extra NVIDIA files NVIDIA's spec also mounts (generate.EXTRA_*); a row asking for
  fewer capabilities gets a subset;
- `required` (the container does not start without the file) is legacy's only: a CDI
  spec cannot say it; the /proc/driver/nvidia mask is legacy's only (it needs the
  selected GPUs' bus ids, which a spec's common edits do not know).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import config as nvconfig
from nvctk.base.config import ALL_CAPABILITIES
from nvctk.cdi import generate, load, resolve
from nvctk.edits import Edits, Mount
from nvctk.host.image import ImageFacts
from nvctk.host.nvml import query_host
from nvctk.plan.cdi import cdi_edits
from nvctk.request.parse import request_from_spec
from nvctk.sim.host import SimHost
from support.planning import make_plan
from support.records import apply_as_create

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the simulated host)")

HOOK = "/usr/bin/nvctk-hook"
CDI_CAPS = ",".join(c for c in ALL_CAPABILITIES if c != "compat32")

# (row, NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES or None, CDI names)
ROWS = [
    ("gpu 0", "0", None, ["nvidia.com/gpu=0"]),
    ("gpu 1", "1", None, ["nvidia.com/gpu=1"]),
    ("all", "all", None, ["nvidia.com/gpu=all"]),
    ("a MIG device", "0:0", None, ["nvidia.com/gpu=0:0"]),
    ("compute+utility", "1", "compute,utility", ["nvidia.com/gpu=1"]),
    ("all capabilities", "1", CDI_CAPS, ["nvidia.com/gpu=1"]),
    ("graphics with DRM links", "1", "graphics,display", ["nvidia.com/gpu=1"]),
]


@pytest.fixture(scope="module")
def setup(sim_host_mig: SimHost, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Any, Any, Path, Edits]:
    cfg = nvconfig.load(sim_host_mig.config_path)
    host = query_host(sim_host_mig.root)
    common, devices = generate.host_edits(cfg, host, ("index", "uuid"), HOOK)
    d = tmp_path_factory.mktemp("edits-modes")
    spec = generate.make_spec(common, devices, HOOK)
    generate.write_spec(str(d / "nvidia.yaml"), generate.dump(spec, "yaml"))
    return cfg, host, d, common


def _legacy(cfg: Any, host: Any, visible: str, caps: str | None) -> Edits:
    env = [f"NVIDIA_VISIBLE_DEVICES={visible}"]
    if caps:
        env.append(f"NVIDIA_DRIVER_CAPABILITIES={caps}")
    request = request_from_spec({"process": {"env": env}}, cfg)
    assert request is not None
    return make_plan(request, cfg, host, ImageFacts(debian=True), hook_path=HOOK)


def _cdi_form(cfg: Any, d: Path, names: list[str]) -> Edits:
    return cdi_edits(resolve.read_devices(load.resolve(tuple(names), (str(d),))), cfg.ldconfig)


def _mount_key(m: Mount) -> tuple[Any, ...]:
    return (m.host_path, m.container_path, m.kind, m.read_only, m.noexec)


def _extra_paths(cfg: Any, host: Any, common: Edits) -> set[str]:
    from nvctk.host import driver as nvdriver

    files = nvdriver.discover_files(cfg.driver_root, host.driver_version, ())
    return {m.container_path for m in generate._extra_mounts(files, common.lib_dir)}


@pytest.mark.parametrize(("row", "visible", "caps", "names"), ROWS, ids=[r[0] for r in ROWS])
def test_legacy_and_cdi_give_one_form(setup: tuple[Any, Any, Path, Edits], row: str,
                                      visible: str, caps: str | None, names: list[str]) -> None:
    cfg, host, d, common = setup
    legacy = _legacy(cfg, host, visible, caps)
    form = _cdi_form(cfg, d, names)
    # a CDI device's capabilities: every one but compat32
    full = _legacy(cfg, host, visible, CDI_CAPS)
    extras = _extra_paths(cfg, host, common)

    # devices: exactly full's; the row's own are a subset (fewer capabilities, no DRM)
    assert {n.to_dict().__repr__() for n in form.devices} == \
        {n.to_dict().__repr__() for n in full.devices}
    assert {n.path for n in legacy.devices} <= {n.path for n in form.devices}
    # mounts: full's (without `required`) plus the extra NVIDIA files
    cdi_mounts = {_mount_key(m) for m in form.mounts}
    assert {_mount_key(m) for m in full.mounts} <= cdi_mounts
    assert {k[1] for k in cdi_mounts - {_mount_key(m) for m in full.mounts}} <= extras
    assert {_mount_key(m) for m in legacy.mounts} <= cdi_mounts
    assert all(m.options is None for m in form.mounts)  # all the hook's, as legacy's
    # links and the ldconfig step: full's
    assert {(s.container_path, s.target) for s in form.symlinks} == \
        {(s.container_path, s.target) for s in full.symlinks}
    assert (form.ldconfig, form.lib_dir) == (legacy.ldconfig, legacy.lib_dir)
    assert form.env == legacy.env
    assert form.proc_mask is None and legacy.proc_mask is not None
    assert form.vgpu is None and legacy.vgpu is None
    assert (form.remove_hooks, form.seccomp_block_userns, form.pins) == \
        (legacy.remove_hooks, legacy.seccomp_block_userns, legacy.pins)
    if caps == CDI_CAPS:  # the same capabilities: the same form, hooks aside
        assert {_mount_key(m) for m in legacy.mounts} == cdi_mounts - {
            k for k in cdi_mounts if k[1] in extras}


def _union(parts: list[Edits]) -> tuple[set[str], set[tuple[Any, ...]], set[tuple[str, str]]]:
    return ({repr(n.to_dict()) for p in parts for n in p.devices},
            {_mount_key(m) for p in parts for m in p.mounts},
            {(s.container_path, s.target) for p in parts for s in p.symlinks})


def test_generate_read_back_gives_the_form(setup: tuple[Any, Any, Path, Edits],
                                           sim_host_mig: SimHost) -> None:
    """`cdi generate`'s forms, written and read back, are the forms again: per device the
    common edits and the device's own."""
    cfg, host, d, common = setup
    _, devices = generate.host_edits(cfg, host, ("index", "uuid"), HOOK)
    for names, dev in devices:
        back = _cdi_form(cfg, d, [f"nvidia.com/gpu={names[0]}"])
        assert _union([back]) == _union([common, dev])
        assert (back.ldconfig, back.lib_dir) == (common.ldconfig, common.lib_dir)
        assert back.hooks == ()  # nvctk's own hooks all decoded into the form


def _base_spec() -> dict[str, Any]:
    return {"ociVersion": "1.0.2", "process": {"env": ["PATH=/bin"], "args": ["true"]},
            "root": {"path": "rootfs"},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"devices": [], "resources": {"devices": [{"allow": False,
                                                                 "access": "rwm"}]}}}


@pytest.mark.parametrize(("row", "visible", "caps", "names"), ROWS, ids=[r[0] for r in ROWS])
def test_applying_either_gives_one_config(setup: tuple[Any, Any, Path, Edits], tmp_path: Path,
                                          row: str, visible: str, caps: str | None,
                                          names: list[str]) -> None:
    cfg, host, d, _ = setup
    full = _legacy(cfg, host, visible, CDI_CAPS)  # the CDI device's capabilities
    form = _cdi_form(cfg, d, names)
    a, b = _base_spec(), _base_spec()
    apply_as_create(a, full, tmp_path, tmp_path / "a")
    apply_as_create(b, form, tmp_path, tmp_path / "b")
    for s in (a, b):
        s.pop("hooks", None)  # hooks aside (the CDI facts have none of ours: plan_container adds it)
        s.pop("annotations")  # the records: a CDI one says so, and their MACs differ
        # the order of nodes and rules may differ (a spec's common nodes come first)
        s["linux"]["devices"].sort(key=repr)
        s["linux"]["resources"]["devices"].sort(key=repr)
    assert a == b


@pytest.mark.parametrize("visible", ["1", "0:0", "all"])
def test_a_create_in_either_mode_writes_one_config(setup: tuple[Any, Any, Path, Edits],
                                                   tmp_path: Path, visible: str) -> None:
    """Through nvctk-runtime's create (in-process): legacy mode with a CDI device's
    capabilities, and CDI mode with nvctk's own spec, write the same config.json, hooks
    included (one `nvctk-hook prestart`), and the hook reads the same mounts, links and
    ldconfig step from the form beside it."""
    from nvctk.runtime import create

    cfg, _, d, _ = setup
    cfg = cfg.replace(hook_path=HOOK, state_dir=str(tmp_path / "state"))
    out = {}
    for mode in ("legacy", "cdi"):
        b = tmp_path / mode
        (b / "rootfs" / "etc").mkdir(parents=True)
        (b / "rootfs" / "etc" / "debian_version").write_text("12\n")
        env = [f"NVIDIA_VISIBLE_DEVICES={visible}"]
        if mode == "legacy":
            env.append(f"NVIDIA_DRIVER_CAPABILITIES={CDI_CAPS}")
        spec = {**_base_spec(), "process": {"env": ["PATH=/bin", *env], "args": ["true"]}}
        (b / "config.json").write_text(json.dumps(spec))
        c = cfg if mode == "legacy" else cfg.replace(mode="cdi", cdi_spec_dirs=(str(d),))
        create.prepare_bundle(str(b), c, container_id=f"c-{mode}")
        s = json.loads((b / "config.json").read_text())
        s.pop("annotations")
        s["process"]["env"] = [e for e in s["process"]["env"]
                               if not e.startswith("NVIDIA_DRIVER_CAPABILITIES=")]
        s["linux"]["devices"].sort(key=repr)
        s["linux"]["resources"]["devices"].sort(key=repr)
        out[mode] = (s, Edits.from_json((b / "nvctk-edits.json").read_bytes()))
    (legacy, lform), (cdi_spec, cform) = out["legacy"], out["cdi"]
    assert cdi_spec == legacy
    assert [h["args"] for h in legacy["hooks"]["prestart"]] == [["nvctk-hook", "prestart"]]
    extras = {m.container_path for m in cform.mounts} - {m.container_path for m in lform.mounts}
    assert {_mount_key(m) for m in lform.mounts} <= {_mount_key(m) for m in cform.mounts}
    assert extras <= _extra_paths(cfg, setup[1], setup[3])
    assert {(x.container_path, x.target) for x in lform.symlinks} == \
        {(x.container_path, x.target) for x in cform.symlinks}
    assert (cform.ldconfig, cform.lib_dir) == (lform.ldconfig, lform.lib_dir)


def test_every_consumer_plans_with_plan_container(setup: tuple[Any, Any, Path, Edits],
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One planner: a legacy create, a CDI-mode create and `cdi generate` each call
    nvctk.plan.make.plan_container (seen through a recording wrapper around the real
    one), and differ only in what they ask for."""
    from nvctk.plan import make
    from nvctk.runtime import create

    cfg, host, d, _ = setup
    cfg = cfg.replace(hook_path=HOOK, state_dir=str(tmp_path / "state"))
    calls: list[str] = []
    real = make.plan_container

    def recording(request: Any, *args: Any) -> Edits:
        calls.append("cdi" if request.cdi_devices is not None else "legacy")
        return real(request, *args)

    monkeypatch.setattr(make, "plan_container", recording)
    for mode in ("legacy", "cdi"):
        b = tmp_path / mode
        (b / "rootfs").mkdir(parents=True)
        spec = {**_base_spec(), "process": {"env": ["NVIDIA_VISIBLE_DEVICES=1"], "args": ["true"]}}
        (b / "config.json").write_text(json.dumps(spec))
        c = cfg if mode == "legacy" else cfg.replace(mode="cdi", cdi_spec_dirs=(str(d),))
        assert create.prepare_bundle(str(b), c, container_id=f"c-{mode}").edits is not None
    assert calls == ["legacy", "cdi"]
    calls.clear()
    spec = generate.cdi_spec(cfg, host, HOOK)
    # the common edits, then one form per GPU and MIG device of the host
    assert calls == ["legacy"] * (1 + len(host.gpus) + sum(len(g.mig_devices) for g in host.gpus))
    assert spec["kind"] == "nvidia.com/gpu"
    calls.clear()
    claim = generate.cdi_spec(cfg, host, HOOK, devices=(host.gpus[1].uuid,))  # a DRA claim's
    assert calls == ["legacy", "legacy"]
    assert [x["name"] for x in claim["devices"]] == ["1", host.gpus[1].uuid, "all"]
