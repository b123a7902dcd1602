"""nvctk-runtime against reused bundles (a second create gets only the current request, the
user's own rules and devices stay), errors that could mislead (wrong field types, the state
dir, OS errors name the part), and container ids and runc roots that are not UTF-8.
(The rest of the bad-input suite: test_runtime_bad_input_config.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import support.runtime as _runtime
from nvctk.base import config as nvconfig
from nvctk.base import fileio
from nvctk.base.errors import SpecError
from nvctk.edits import DeviceNode, Hook
from nvctk.edits_file import EDITS_FILE
from nvctk.oci import spec as oci
from nvctk.runtime import create
from nvctk.spec import apply as spec_edits
from support.records import undo_as_create
from support.runtime import NVD, Env, assert_clean_failure, create_argv, snapshot

env = _runtime.env  # fixtures


# --- a reused bundle ----------------------------------------------------------------


def _set_env(b: Path, name: str, value: str | None) -> None:
    spec = json.loads((b / "config.json").read_text())
    envs = [e for e in spec["process"]["env"] if not e.startswith(name + "=")]
    if value is not None:
        envs.append(f"{name}={value}")
    spec["process"]["env"] = envs
    (b / "config.json").write_text(json.dumps(spec))


def _nvidia_paths(spec: dict[str, Any]) -> list[str]:
    return [d["path"] for d in spec["linux"].get("devices") or []]


def test_reused_bundle_gets_only_the_current_request(env: Env, bundle: Callable[..., Path]
                                                     ) -> None:
    b = bundle({NVD: "0,1", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    original = json.loads((b / "config.json").read_text())
    argv = create_argv(env, b)
    assert env.run(*argv).returncode == 0
    spec = json.loads((b / "config.json").read_text())
    assert "/dev/nvidia0" in _nvidia_paths(spec) and "/dev/nvidia1" in _nvidia_paths(spec)
    assert [h["args"][1] for h in spec["hooks"]["poststop"]] == ["poststop"]
    numbers = {d["path"]: (d["major"], d["minor"]) for d in spec["linux"]["devices"]}

    _set_env(b, NVD, "1")  # another GPU, no longer a vGPU limit
    _set_env(b, "CUDA_DEVICE_MEMORY_LIMIT", None)
    r = env.run(*create_argv(env, b, "c2"))
    assert r.returncode == 0, r.stderr
    spec = json.loads((b / "config.json").read_text())
    assert "/dev/nvidia0" not in _nvidia_paths(spec) and "/dev/nvidia1" in _nvidia_paths(spec)
    allowed = {(r["major"], r["minor"]) for r in spec["linux"]["resources"]["devices"]
               if r.get("allow")}
    assert numbers["/dev/nvidia0"] not in allowed and numbers["/dev/nvidia1"] in allowed
    assert [h["args"][:2] for h in spec["hooks"]["prestart"]] == [["nvctk-hook", "prestart"]]
    assert spec["hooks"].get("poststop") == []
    assert not any(e.startswith("CUDA_DEVICE_MEMORY_SHARED_CACHE=") for e in spec["process"]["env"])

    _set_env(b, NVD, "void")
    r = env.run(*create_argv(env, b, "c3"))
    assert r.returncode == 0, r.stderr
    spec = json.loads((b / "config.json").read_text())
    assert not (b / EDITS_FILE).exists()
    assert spec_edits.EDITS_ANNOTATION not in (spec.get("annotations") or {})
    assert spec["hooks"] == {"prestart": [], "poststop": []}
    assert _nvidia_paths(spec) == _nvidia_paths(original)
    assert spec["linux"]["resources"] == original["linux"]["resources"]
    # and once clean, a no-GPU create does not touch the file again
    before = snapshot(b / "config.json")
    assert env.run(*create_argv(env, b, "c4")).returncode == 0
    assert snapshot(b / "config.json") == before


def test_a_user_rule_that_equals_ours_stays(env: Env, bundle: Callable[..., Path]) -> None:
    own = {"allow": True, "type": "c", "major": 195, "minor": 255, "access": "rwm"}

    def edit(spec: dict[str, Any]) -> None:
        spec["linux"]["resources"]["devices"].append(own)

    b = bundle({NVD: "0"}, edit=edit)
    assert env.run(*create_argv(env, b)).returncode == 0
    _set_env(b, NVD, "void")
    assert env.run(*create_argv(env, b)).returncode == 0
    spec = json.loads((b / "config.json").read_text())
    assert own in spec["linux"]["resources"]["devices"]


def test_a_user_device_that_equals_ours_stays(env: Env, bundle: Callable[..., Path]) -> None:
    """A linux.devices entry the user had before the first GPU create, identical to the
    one nvctk would add, is the user's: a later create without GPU leaves it."""
    first = bundle({NVD: "0"}, name="first")
    assert env.run(*create_argv(env, first)).returncode == 0
    ours = [d for d in json.loads((first / "config.json").read_text())["linux"]["devices"]
            if d["path"] == "/dev/nvidiactl"]
    assert len(ours) == 1

    def edit(spec: dict[str, Any]) -> None:
        spec["linux"].setdefault("devices", []).append(dict(ours[0]))

    b = bundle({NVD: "0"}, edit=edit)
    assert env.run(*create_argv(env, b)).returncode == 0
    _set_env(b, NVD, "void")
    assert env.run(*create_argv(env, b)).returncode == 0
    devices = json.loads((b / "config.json").read_text())["linux"]["devices"]
    assert [d for d in devices if d["path"].startswith("/dev/nvidia")] == ours


def test_edit_record_can_only_take_nvidia_access_away() -> None:
    deny = {"allow": False, "access": "rwm"}
    spec: dict[str, Any] = {
        "process": {"env": ["LD_PRELOAD=/x.so", "CUDA_DEVICE_X=1"]},
        "linux": {"devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}],
                  "resources": {"devices": [deny]}},
        "annotations": {spec_edits.EDITS_ANNOTATION: json.dumps({
            "devices": [["/dev/fuse", "c", 10, 229]], "rules": [[None, None, None]],
            "env": ["LD_PRELOAD=/x.so", "CUDA_DEVICE_X=1"]})},
    }
    undo_as_create(spec, "/", None)
    assert spec["linux"]["devices"][0]["path"] == "/dev/fuse"
    assert spec["linux"]["resources"]["devices"] == [deny]
    # a record without nvctk's MAC takes no variable out (only what nvctk
    # provably added goes, but for NVIDIA nodes and rules, whose removal only takes access)
    assert spec["process"]["env"] == ["LD_PRELOAD=/x.so", "CUDA_DEVICE_X=1"]


def test_real_runc_runs_a_vgpu_bundle_reused_as_void(
        bundle: Callable[..., Path], real_runc: Callable[..., subprocess.CompletedProcess[str]]
        ) -> None:
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    r = real_runc(b, "nvctk-hostile-vgpu")
    assert r.returncode == 0, r.stderr
    assert (b / EDITS_FILE).exists()
    _set_env(b, NVD, "void")
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["args"] = ["sh", "-c", "ls /dev | grep -c nvidia; cat /etc/ld.so.preload"]
    (b / "config.json").write_text(json.dumps(spec))
    r = real_runc(b, "nvctk-hostile-void")
    assert r.returncode == 1 or r.returncode == 0, r.stderr  # cat fails: no preload file
    assert r.stdout.split()[0] == "0", r.stdout  # no NVIDIA device nodes
    assert "libvgpu" not in r.stdout
    assert not (b / EDITS_FILE).exists()


@pytest.mark.parametrize("unparsable", [False, True], ids=["not-utf8", "unparsable"])
def test_real_runc_runs_a_vgpu_bundle_reused_unreadable_without_gpu(
        bundle: Callable[..., Path], real_runc: Callable[..., subprocess.CompletedProcess[str]],
        unparsable: bool) -> None:
    """Hostile retest: the vGPU create's hooks stay in a spec nvctk cannot read
    (it will not rewrite it); its plan goes, and the hooks, reading the spec as runc
    does (U+FFFD) or not at all, find no plan: the no-GPU container runs."""
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    r = real_runc(b, "nvctk-hostile-vgpu2")
    assert r.returncode == 0, r.stderr
    assert (b / EDITS_FILE).exists()
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["env"] = [e for e in spec["process"]["env"]
                              if not e.startswith((f"{NVD}=", "CUDA_DEVICE_MEMORY_LIMIT="))]
    # (its linux.devices entries stay: nvctk does not rewrite bytes it cannot read)
    spec["process"]["args"] = ["sh", "-c", "echo no-gpu-ran; echo \"preload:$(cat /etc/ld.so.preload "
                               "2>/dev/null)\""]
    spec["annotations"] = {**spec.get("annotations", {}), "x": "MARK"}
    data = json.dumps(spec).encode().replace(b"MARK", b"\xff")
    if unparsable:  # nested deeper than Python's JSON parser goes; Go's reads it
        data = data[:-1] + b', "y": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    (b / "config.json").write_bytes(data)
    r = real_runc(b, "nvctk-hostile-void2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["no-gpu-ran", "preload:"], r.stdout + r.stderr  # no libvgpu
    assert not (b / EDITS_FILE).exists()
    assert (b / "config.json").read_bytes() == data  # handed on as it was


# --- errors that mislead ------------------------------------------------------------


def _userns(spec: dict[str, Any]) -> None:
    spec["linux"]["namespaces"].append({"type": "user"})
    spec["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    spec["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]


def test_gpu_container_with_user_namespace_is_refused(env: Env,
                                                      bundle: Callable[..., Path]) -> None:
    g = bundle({NVD: "0"}, edit=_userns)
    before = snapshot(g / "config.json")
    r = env.run(*create_argv(env, g))
    assert_clean_failure(env, r, "user namespaces are not supported by nvctk's GPU containers")
    assert snapshot(g / "config.json") == before
    b = bundle({}, name="plain", edit=_userns)  # no GPU: not nvctk's business
    argv = create_argv(env, b)
    assert env.run(*argv).returncode == 0 and env.recorded() == argv


def _hooks_object(spec: dict[str, Any]) -> None:
    spec["hooks"] = {"prestart": {"path": "/usr/bin/mine", "args": ["mine"]}}


def _devices_object(spec: dict[str, Any]) -> None:
    spec["linux"]["devices"] = {"path": "/dev/fuse"}


def _rules_object(spec: dict[str, Any]) -> None:
    spec["linux"]["resources"]["devices"] = {"allow": False, "access": "rwm"}


def _resources_list(spec: dict[str, Any]) -> None:
    spec["linux"]["resources"] = []


@pytest.mark.parametrize(("edit", "needle"), [
    (_hooks_object, "hooks.prestart must be an array, not an object"),
    (_devices_object, "linux.devices must be an array, not an object"),
    (_rules_object, "linux.resources.devices must be an array, not an object"),
    (_resources_list, "linux.resources must be an object, not an array"),
])
def test_wrong_field_types_are_not_repaired(env: Env, bundle: Callable[..., Path],
                                            edit: Callable[[dict[str, Any]], None],
                                            needle: str) -> None:
    g = bundle({NVD: "0"}, edit=edit)
    before = snapshot(g / "config.json")
    assert_clean_failure(env, env.run(*create_argv(env, g)), needle)
    assert snapshot(g / "config.json") == before
    b = bundle({}, name="plain", edit=edit)  # no GPU: runc judges it, untouched
    before = snapshot(b / "config.json")
    argv = create_argv(env, b)
    assert env.run(*argv).returncode == 0 and env.recorded() == argv
    assert snapshot(b / "config.json") == before


def test_oci_edits_refuse_wrong_types() -> None:
    node = DeviceNode("/dev/nvidia0", "/dev/nvidia0", 195, 0)
    with pytest.raises(SpecError, match=re.escape("linux.devices must be an array")):
        spec_edits.add_devices({"linux": {"devices": {}}}, [node])
    hook = Hook("prestart", "/h", ("nvctk-hook", "prestart"), (), 5).entry()
    with pytest.raises(SpecError, match=re.escape("hooks.prestart must be an array")):
        spec_edits.set_hook({"hooks": {"prestart": {"path": "/x"}}}, hook)
    with pytest.raises(SpecError, match="hooks must be an object"):
        spec_edits.set_hook({"hooks": []}, hook)
    with pytest.raises(SpecError, match=re.escape("process.env must be an array")):
        spec_edits.set_env({"process": {"env": "A=1"}}, {"B": "2"})
    spec: dict[str, Any] = {"linux": {"devices": None}, "hooks": {"prestart": None}}
    spec_edits.add_devices(spec, [node])  # null is absent, as Go reads it
    spec_edits.set_hook(spec, hook)
    assert spec["linux"]["devices"][0]["path"] == "/dev/nvidia0"


def test_state_dir_problems_name_the_state_dir(env: Env, bundle: Callable[..., Path]) -> None:
    blocker = env.tmp / "state-file"
    blocker.write_text("not a directory")
    text = re.sub(r"(?m)^state-dir = .*\n", "", env.config.read_text())
    env.config.write_text(text + f'state-dir = "{blocker}"\n')
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    r = env.run(*create_argv(env, b))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"state dir {blocker}" in r.stderr or f"state-dir {blocker}" in r.stderr, r.stderr
    assert not r.stderr.startswith(f"nvctk-runtime: bundle {b}"), r.stderr


def test_os_error_message_names_the_part() -> None:
    cfg = nvconfig.Config(state_dir="/run/nvctk")
    assert create.os_error_message(OSError(28, "No space left on device", "/run/nvctk/c/limits"),
                                 "/b", cfg) == ("vGPU state dir /run/nvctk: No space left on "
                                                "device: /run/nvctk/c/limits")
    assert create.os_error_message(OSError(13, "Permission denied", "/b/config.json"), "/b",
                                 cfg) == "bundle /b: Permission denied: /b/config.json"
    assert create.os_error_message(OSError(2, "No such file", "/etc/x"), "/b", cfg) == \
        "/etc/x: No such file"


def test_atomic_write_names_the_file_on_write_errors(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(oci.os, "write", full)
    target = tmp_path / "f"
    with pytest.raises(OSError) as exc:
        fileio.atomic_write(str(target), b"x")
    assert exc.value.filename == str(target) and exc.value.errno == 28
    assert os.listdir(tmp_path) == []


# --- container ids and runc roots that are not UTF-8 ---------------------


def _key_dirs(env: Env) -> list[str]:
    top = nvconfig.load(str(env.config)).state_dir
    return [n for n in os.listdir(top) if os.path.isdir(os.path.join(top, n))] \
        if os.path.isdir(top) else []


@pytest.mark.parametrize("cid", ["a\udcff", ".", "..", "a b", "a/b", "é"],
                         ids=["not-utf8", "dot", "dotdot", "space", "slash", "non-ascii"])
def test_gpu_create_refuses_an_id_runc_refuses(env: Env, bundle: Callable[..., Path],
                                               cid: str) -> None:
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "512m"})
    r = env.run(*create_argv(env, b, cid))
    shown_id = os.fsencode(cid).decode("ascii", "backslashreplace")
    assert_clean_failure(env, r, f"invalid container id '{shown_id}'")
    assert _key_dirs(env) == []  # no state made for it
    assert not (b / EDITS_FILE).exists()


def test_no_gpu_create_leaves_the_id_to_runc(env: Env, bundle: Callable[..., Path]) -> None:
    b = bundle({})
    argv = create_argv(env, b, "a\udcff")
    r = env.run(*argv)
    assert r.returncode == 0, r.stderr
    assert env.record.read_bytes().splitlines()[-1] == b"a\xff"  # runc got it as it was


def test_runc_root_that_is_not_utf8(env: Env, bundle: Callable[..., Path]) -> None:
    from nvctk.vgpu import state as vgpu_state

    assert vgpu_state.state_key("/tmp/x\udcffroot", "c1") != vgpu_state.state_key("/tmp/x", "c1")
    root = str(env.tmp / "x\udcffroot")
    b = bundle({NVD: "0"})  # a GPU without a vGPU limit: the root is not written anywhere
    argv = create_argv(env, b)
    argv[1] = root
    r = env.run(*argv)
    assert r.returncode == 0, r.stderr
    env.record.unlink()
    shutil.rmtree(b)
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "512m"})
    argv = create_argv(env, b)
    argv[1] = root
    r = env.run(*argv)
    assert_clean_failure(env, r, "runc's --root '" + os.fsencode(root).decode(
        "ascii", "backslashreplace") + "' is not UTF-8")
    assert _key_dirs(env) == []
