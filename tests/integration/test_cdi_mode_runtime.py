"""nvctk-runtime's CDI mode through nvctk-runtime (a failing name, vGPU limits refused,
a reused bundle, runc seeing the same GPU in both modes) and a CDI record honoured only
with nvctk's MAC. (The rest: test_cdi_mode_names.py, test_cdi_mode_host_dirs.py; shared:
tests/support/cdi_mode.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import support.cdi_mode as _cdi_mode
from nvctk.base.keyfile import EDITS_KEY_FILE, edits_key
from nvctk.edits import Edits
from nvctk.runtime import earlier
from nvctk.sim.host import SimHost
from nvctk.spec import apply as spec_edits
from nvctk.spec.record import AppliedRecord, Seal
from support.cdi_mode import _bundle, _rootfs_bundle, _spec, _with
from support.runtime import RUNTIME, Env, create_argv, snapshot

env, spec_dir = _cdi_mode.env, _cdi_mode.spec_dir  # fixtures


# --- through nvctk-runtime --------------------------------------------------------------------


def _set_env(b: Path, envvars: list[str]) -> None:
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["env"] = ["PATH=/bin", *envvars]
    (b / "config.json").write_text(json.dumps(spec))


def test_unresolvable_name_fails_cleanly(env: Env, spec_dir: Path) -> None:
    shutil.copytree(spec_dir, env.tmp / "cdi")
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=7"])
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    from support.runtime import assert_clean_failure

    assert_clean_failure(env, r, "unresolvable CDI device nvidia.com/gpu=7: not in the CDI specs "
                         f"of {env.tmp / 'cdi'}; nvidia.com/gpu has: 0, GPU-")
    assert snapshot(b / "config.json") == before


def test_vgpu_limit_is_refused_in_cdi_mode(env: Env, spec_dir: Path) -> None:
    shutil.copytree(spec_dir, env.tmp / "cdi")
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0",
                          "CUDA_DEVICE_MEMORY_LIMIT=1g"])
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    from support.runtime import assert_clean_failure

    assert_clean_failure(env, r, "CUDA_DEVICE_MEMORY_LIMIT: vGPU limits are not supported in "
                         "CDI mode")
    assert snapshot(b / "config.json") == before


def test_reused_bundle_cdi_then_void_then_legacy(env: Env, spec_dir: Path,
                                                 rootfs: Callable[..., str]) -> None:
    """Every create makes nvctk's part of the spec from its own request only."""
    shutil.copytree(spec_dir, env.tmp / "cdi")
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=1"], rootfs=rootfs())
    original = json.loads((b / "config.json").read_text())
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    s = json.loads((b / "config.json").read_text())
    # nvctk's own spec becomes the form legacy mode makes: its mounts, links and
    # ldconfig are the one prestart hook's (the form beside the spec), not runc's
    assert s["mounts"] == original["mounts"]
    assert any(d["path"] == "/dev/nvidia1" for d in s["linux"]["devices"])
    assert not any(d["path"] == "/dev/nvidia0" for d in s["linux"]["devices"])
    assert s["hooks"].get("createRuntime", []) == []
    assert [h["args"][:3] for h in s["hooks"]["prestart"]] == [["nvctk-hook", "prestart", "--served"]]
    form = Edits.from_json((b / "nvctk-edits.json").read_bytes())
    assert any(m.container_path.endswith("/libcuda.so.1") or "libcuda.so." in m.container_path
               for m in form.mounts)
    assert form.ldconfig and any(x.container_path.endswith("/libcuda.so") for x in form.symlinks)

    _set_env(b, ["NVIDIA_VISIBLE_DEVICES=void"])
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    s = json.loads((b / "config.json").read_text())
    assert s["mounts"] == original["mounts"]
    assert s["linux"]["devices"] == []
    assert s["linux"]["resources"] == original["linux"]["resources"]
    assert all(v == [] for v in s["hooks"].values())
    assert spec_edits.EDITS_ANNOTATION not in s.get("annotations", {})
    assert not (b / "nvctk-edits.json").exists()

    # cdi again, then legacy: the legacy create has none of the CDI edits left
    _set_env(b, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=1"])
    assert env.run(*create_argv(env, b)).returncode == 0
    _set_env(b, ["NVIDIA_VISIBLE_DEVICES=0"])
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    s = json.loads((b / "config.json").read_text())
    assert s["mounts"] == original["mounts"]
    assert s["hooks"].get("createRuntime", []) == []
    assert [d["path"] for d in s["linux"]["devices"] if d["path"] == "/dev/nvidia1"] == []
    assert len(s["hooks"]["prestart"]) == 1
    assert (b / "nvctk-edits.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                    reason="needs root and runc")
def test_runc_sees_the_same_gpu_in_cdi_and_legacy_mode(sim_host: SimHost, spec_dir: Path,
                                                       tmp_path: Path) -> None:
    from nvctk.sim.rootfs import build_rootfs

    rootfs = build_rootfs(str(tmp_path / "rootfs"))
    base = _with(Path(sim_host.config_path).read_text(), cdi_spec_dirs=f'["{spec_dir}"]')
    (tmp_path / "legacy.toml").write_text(base)
    (tmp_path / "cdi.toml").write_text(_with(base, mode='"cdi"'))
    root = tmp_path / "runc-root"
    ids: list[str] = []

    def run(name: str, config: str, value: str) -> str:
        b = tmp_path / name
        spec = _rootfs_bundle(b, rootfs, ["sh", "-c", "nvidia-smi -L"],
                              [f"NVIDIA_VISIBLE_DEVICES={value}"])
        (b / "config.json").write_text(json.dumps(spec))
        cid = "nvctk-cdi-mode-" + uuid.uuid4().hex[:8]
        ids.append(cid)
        r = subprocess.run([RUNTIME, "--root", str(root), "run", "--bundle", str(b), cid],
                           env={**os.environ, "NVCTK_CONFIG": str(tmp_path / config)},
                           capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    try:
        g1 = sim_host.topology.gpus[1]
        cdi_out = run("cdi", "legacy.toml", "nvidia.com/gpu=1")
        assert [x for x in cdi_out.splitlines() if x.startswith("GPU ")] == [
            f"GPU 0: {g1.name} (UUID: {g1.uuid})"]
        assert run("legacy", "legacy.toml", "1") == cdi_out
        assert run("cdi-mode", "cdi.toml", "1") == cdi_out
    finally:
        for cid in ids:
            subprocess.run(["runc", "--root", str(root), "delete", "--force", cid],
                           capture_output=True, timeout=60)


# --- a CDI record is honoured only with nvctk's MAC ----------------------------------------

_USER_HOOK = {"path": "/usr/bin/security-hook", "args": ["security-hook", "--strict"]}
_PROC = {"destination": "/proc", "type": "proc", "source": "proc"}
_FORGED = json.dumps({"cdi": True, "hooks": [["prestart", _USER_HOOK]], "mounts": [_PROC],
                      "env": ["SECRET_POLICY=strict"], "devices": [["/dev/fuse", "c", 10, 229]],
                      "rules": [["c", 10, 229]]})


def _user_spec(envvars: list[str], record: str | None) -> dict[str, Any]:
    s = _spec(["PATH=/bin", "SECRET_POLICY=strict", *envvars],
              {spec_edits.EDITS_ANNOTATION: record} if record is not None else None)
    s["mounts"] = [dict(_PROC)]
    s["hooks"] = {"prestart": [dict(_USER_HOOK)]}
    s["linux"] = {"devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}],
                  "resources": {"devices": [{"allow": True, "type": "c", "major": 10,
                                             "minor": 229, "access": "rwm"}]}}
    return s


def _users_entries_stay(s: dict[str, Any]) -> None:
    assert _USER_HOOK in s["hooks"]["prestart"]
    assert _PROC in s["mounts"]
    assert "SECRET_POLICY=strict" in s["process"]["env"]
    assert {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229} in s["linux"]["devices"]
    assert {"allow": True, "type": "c", "major": 10, "minor": 229, "access": "rwm"} \
        in s["linux"]["resources"]["devices"]


@pytest.mark.parametrize("mac", [None, "0" * 64, "bad"])
def test_forged_cdi_record_removes_nothing(tmp_path: Path, mac: str | None) -> None:
    """A spec author's own nvctk.io/edits with "cdi": true (no MAC, or a wrong one)
    is never acted on, with or without a key."""
    state = str(tmp_path / "state")
    rec = json.loads(_FORGED)
    if mac is not None:
        rec["mac"] = mac
    for key_exists in (False, True):
        if key_exists:
            edits_key(state, create=True)
        s = _user_spec([], json.dumps(rec))
        record = earlier.earlier_record(str(tmp_path), s, state)
        assert record is not None and "nothing of it is taken out" in (record.problem or "")
        spec_edits.remove_our_edits(s, record)
        _users_entries_stay(s)


def test_record_mac_is_keyed_per_host(tmp_path: Path) -> None:
    """A genuine record made with another host's key is refused; the key file is 0600."""
    s = _spec(["PATH=/bin", "A=1"])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    spec_edits.record_edits(s, AppliedRecord(env=["A=1"], cdi=True),
                            Seal(edits_key(a, create=True), earlier.bundle_binding(str(tmp_path))))
    key = tmp_path / "a" / EDITS_KEY_FILE
    assert key.stat().st_mode & 0o7777 == 0o600 and key.stat().st_size == 32
    record = earlier.earlier_record(str(tmp_path), s, a)
    assert record is not None and record.trusted
    edits_key(b, create=True)
    record = earlier.earlier_record(str(tmp_path), s, b)
    assert record is not None and "is not nvctk's for this bundle" in (record.problem or "")
    key.chmod(0o644)
    record = earlier.earlier_record(str(tmp_path), s, a)
    assert record is not None and "0600" in (record.problem or "")


def _hostile_bundle(env: Env, envvars: list[str], rootfs: str = "") -> Path:
    b = _bundle(env.tmp, envvars, rootfs=rootfs)
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["env"].append("SECRET_POLICY=strict")
    spec.setdefault("hooks", {})["prestart"] = [dict(_USER_HOOK)]
    spec["linux"]["devices"] = [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}]
    spec["linux"]["resources"]["devices"].append(
        {"allow": True, "type": "c", "major": 10, "minor": 229, "access": "rwm"})
    spec["annotations"] = {spec_edits.EDITS_ANNOTATION: _FORGED}
    (b / "config.json").write_text(json.dumps(spec))
    return b


@pytest.mark.parametrize("envvars", [[], ["NVIDIA_VISIBLE_DEVICES=0"],
                                     ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"]],
                         ids=["no-gpu", "legacy-gpu", "cdi-gpu"])
def test_forged_cdi_record_in_a_create(env: Env, spec_dir: Path, envvars: list[str]) -> None:
    """The hostile record removes nothing in any create; a no-GPU create leaves the
    spec byte for byte, and says why in nvctk's log."""
    shutil.copytree(spec_dir, env.tmp / "cdi")
    b = _hostile_bundle(env, envvars)
    before = (b / "config.json").read_bytes()
    env.run(*create_argv(env, b))  # runc may then fail on the made-up hook: not the point
    after = (b / "config.json").read_bytes()
    if not envvars:
        assert after == before
    s = json.loads(after)
    _users_entries_stay(s)
    assert "not written by nvctk" in Path(env.sim.root, "nvctk.log").read_text()
