"""vGPU through nvctk-runtime + real runc: the container's env can only tighten (strictest
wins), and the node's share (an annotation the node's key signs) holds against the Pod's
env, CDI routes and forgeries. (Installation: test_vgpu_runtime_install.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import support.vgpu as _vgpu
from nvctk.base import config as nvconfig
from nvctk.base.errors import RequestError
from nvctk.edits_file import EDITS_FILE
from nvctk.sim import host
from nvctk.vgpu import limits as vgpu
from nvctk.vgpu import state as vgpu_state
from support.vgpu import MEM, MIB, Bundles, Runc, create_logged, lines, prep, spec_of

base_rootfs, bundles, config, runc, sim = (  # fixtures
    _vgpu.base_rootfs, _vgpu.bundles, _vgpu.config, _vgpu.runc, _vgpu.sim)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim device nodes, runc)")


# --- the container's env can only tighten; the node's share holds -------------------
SM = "CUDA_DEVICE_SM_LIMIT"
FILL = ("vgpu_probe init totalmem 0 totalmem 1 ctx 0 fill 16777216 ctx 1 fill 16777216; "
        "grep -E '^(CUDA_DEVICE|NVCTK)' /run/nvctk/vgpu/limits")


def _judge_512(out: str) -> None:
    """libvgpu's cap in the container: 512 MiB on both GPUs, of which the 64 MiB context
    reserve is charged first (so at most 448 MiB of 16 MiB allocations fit)."""
    assert lines(out, "totalmem") == [f"totalmem 0 {512 * MIB}"] * 2, out
    fills = [int(x.split()[2]) for x in lines(out, "fill")]
    assert len(fills) == 2 and all(256 * MIB <= f <= (512 - 64) * MIB for f in fills), out


@pytest.mark.slow
def test_env_cannot_loosen_another_variable(runc: Runc, bundles: Bundles) -> None:
    """An image's ENV and `docker run -e` land in one merged env: a per-device 0 or a
    larger per-device value, an SM share of 100 against 25 and a context reserve of 0
    each try to loosen what another variable set; the strictest value holds, in the
    limits file and in what libvgpu lets the container allocate."""
    env = {MEM: "512m", f"{MEM}_0": "0", f"{MEM}_1": "2g", SM: "25", f"{SM}_0": "100",
           vgpu.RESERVE_VAR: "0"}
    r = runc.run(bundles.make(env, FILL, gpu="0,1"))
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    _judge_512(out)
    file = dict(x.split("=", 1) for x in lines(out, "CUDA_DEVICE") + lines(out, "NVCTK"))
    file.pop(vgpu.CACHE_VAR)
    uuids = {k: file.pop(k) for k in list(file) if k.startswith(vgpu.UUID_VAR)}
    assert file == {f"{MEM}_0": str(512 * MIB), f"{MEM}_1": str(512 * MIB),
                    f"{SM}_0": "25", f"{SM}_1": "25", vgpu.RESERVE_VAR: str(vgpu.DEFAULT_RESERVE)}
    assert sorted(uuids) == [f"{vgpu.UUID_VAR}_0", f"{vgpu.UUID_VAR}_1"]  # libvgpu's device map


def _annotate(b: Path, annotations: dict[str, object]) -> None:
    spec = spec_of(b)
    spec.setdefault("annotations", {}).update(annotations)
    (b / "config.json").write_text(json.dumps(spec, indent="\t"))


def _grant(config: nvconfig.Config, devices: list[tuple[str, int, int]], key: bytes | None = None,
           resource: str = "nvidia.com/vgpu") -> tuple[str, str]:
    from nvctk.vgpu import authority

    if key is None:
        key = authority.load_key(config.authority_key, create=True)
        assert key is not None
    return authority.make(resource, devices, key)


@pytest.mark.slow
def test_node_share_holds_against_the_pod_env(runc: Runc, bundles: Bundles, sim: host.SimHost,
                                              config: nvconfig.Config) -> None:
    """The device plugin's share in its nvctk.io/vgpu.* annotation: a Pod env that replaced
    the plugin's CUDA_DEVICE_MEMORY_LIMIT with 0 and an image's per-device 0 leave the
    container at the share the node granted."""
    g0, g1 = (g.uuid for g in sim.topology.gpus)
    k, v = _grant(config, [(g0, 512 * MIB, 25), (g1, 512 * MIB, 25)])
    b = bundles.make({MEM: "0", f"{MEM}_0": "0", SM: "0"}, FILL, gpu="0,1")
    _annotate(b, {k: v})
    r = runc.run(b)
    assert r.returncode == 0, r.stdout + r.stderr
    _judge_512(r.stdout)
    assert f"{SM}_0=25" in r.stdout


def _refused(b: Path, config: nvconfig.Config, tmp_path: Path, match: str) -> None:
    before = (b / "config.json").read_bytes()
    with pytest.raises(RequestError, match=match):
        prep(b, config, "cid", str(tmp_path / "runc-root"))
    assert (b / "config.json").read_bytes() == before
    assert not (b / EDITS_FILE).exists()
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(tmp_path / "runc-root"), "cid"))


def _edited(k: str, v: str, **change: object) -> tuple[str, str]:
    rec = json.loads(v)
    rec.update(change)
    return k, json.dumps(rec)


@pytest.mark.parametrize("case", ["forged", "other-node", "loosened", "moved", "stale-device",
                                  "not-a-string", "garbage"])
def test_bad_share_annotation_is_refused(case: str, bundles: Bundles, sim: host.SimHost,
                                         config: nvconfig.Config, tmp_path: Path) -> None:
    """An annotation the node's key does not verify, or one for other GPUs than the
    container's, refuses the container (a share that cannot be read must never become
    no share), and changes nothing."""
    g0, g1 = (g.uuid for g in sim.topology.gpus)
    k, v = _grant(config, [(g0, 512 * MIB, 25)])
    match = "MAC does not verify"
    ann: dict[str, object]
    if case == "forged":  # made up, with a MAC of no key
        ann = dict([_edited(k, v, mac="0" * 64)])
    elif case == "other-node":  # a genuine annotation of another node's plugin
        ann = dict([_grant(config, [(g0, 4096 * MIB, 100)], key=os.urandom(32))])
    elif case == "loosened":  # a genuine one, with its share raised
        ann = dict([_edited(k, v, devices=[[g0, 4096 * MIB, 100]])])
    elif case == "moved":  # a genuine value under another resource's key
        ann = {k + "-big": v}
    elif case == "stale-device":  # genuine, but for GPU 1, while the container gets GPU 0
        ann = dict([_grant(config, [(g1, 512 * MIB, 25)])])
        match = "would not hold there"
    elif case == "not-a-string":
        ann, match = {k: 7}, "not a string"
    else:
        ann, match = {k: "{not json"}, "not JSON"
    b = bundles.make({MEM: "0"})
    _annotate(b, ann)
    _refused(b, config, tmp_path, match)


def test_share_annotation_needs_the_node_key(bundles: Bundles, sim: host.SimHost,
                                             config: nvconfig.Config, tmp_path: Path) -> None:
    """No key, or a key file another user could have written: refused, never uncapped."""

    g0 = sim.topology.gpus[0].uuid
    k, v = _grant(config, [(g0, 512 * MIB, 25)])
    fields = {f: getattr(config, f) for f in ("driver_root", "ldconfig", "log_file",
                                              "state_dir", "extra_mounts")}
    missing = nvconfig.Config(**fields, authority_key=str(tmp_path / "none.key"))
    b = bundles.make({})
    _annotate(b, {k: v})
    _refused(b, missing, tmp_path, "no authority key")
    loose = tmp_path / "loose.key"
    loose.write_bytes(os.urandom(32))
    loose.chmod(0o644)
    _refused(b, nvconfig.Config(**fields, authority_key=str(loose)), tmp_path, "refuses it")


def test_cdi_routes_cannot_drop_the_share(bundles: Bundles, sim: host.SimHost,
                                          config: nvconfig.Config, tmp_path: Path) -> None:
    """CDI mode applies no vGPU limit, so a container with the node's share is refused
    there (cdi-annotations strategy); a GPU the engine put in by CDI itself (cdi-cri:
    NVIDIA_VISIBLE_DEVICES=void, /dev/nvidia0 in the spec) is refused too."""
    g0 = sim.topology.gpus[0].uuid
    k, v = _grant(config, [(g0, 512 * MIB, 25)])
    b = bundles.make({}, gpu=f"nvidia.com/gpu={g0}")
    _annotate(b, {k: v})
    _refused(b, config, tmp_path, "not supported in CDI mode")
    b = bundles.make({}, gpu="void")
    spec = spec_of(b)
    spec["linux"].setdefault("devices", []).append(
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0})
    (b / "config.json").write_text(json.dumps(spec))
    _annotate(b, {k: v})
    _refused(b, config, tmp_path, "a route nvctk cannot cap")
    # without the share, such a container is none of nvctk's business (as before)
    spec = spec_of(b)
    del spec["annotations"][k]
    (b / "config.json").write_text(json.dumps(spec))
    assert prep(b, config, "cid", str(tmp_path / "runc-root")).edits is None


def test_forged_share_fails_the_create_in_runcs_log(bundles: Bundles, sim: host.SimHost,
                                                    config: nvconfig.Config,
                                                    tmp_path: Path) -> None:
    """Through nvctk-runtime: the refusal is an error in runc's log naming the annotation,
    config.json is untouched and no state is made."""
    g0 = sim.topology.gpus[0].uuid
    _grant(config, [])  # the node has its key (the device plugin made it)
    k, v = _grant(config, [(g0, 512 * MIB, 25)], key=os.urandom(32))
    b = bundles.make({MEM: "0"})
    _annotate(b, {k: v})
    before = (b / "config.json").read_bytes()
    r, log = create_logged(tmp_path, b, sim)
    assert r.returncode != 0
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(k in e["msg"] and "MAC does not verify" in e["msg"] and e["level"] == "error"
               for e in entries), entries
    assert (b / "config.json").read_bytes() == before
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(tmp_path / "runc-root"), "cid"))
