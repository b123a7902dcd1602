"""Spec load/edit/atomic save and hook-state parsing."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import fileio
from nvctk.base.errors import SpecError
from nvctk.edits import DeviceNode
from nvctk.oci import spec as oci
from nvctk.plan.hooks import plan_hooks
from nvctk.spec import apply as spec_edits
from nvctk.spec.apply import HOOK_PATH_ENV

NODES = (
    DeviceNode("/dev/nvidiactl", "/h/dev/nvidiactl", 195, 255),
    DeviceNode("/dev/nvidia1", "/h/dev/nvidia1", 195, 1),
    DeviceNode("/dev/nvidia-uvm", "/h/dev/nvidia-uvm", 508, 0),
)


def base_spec() -> dict[str, Any]:
    return {
        "ociVersion": "1.0.2",
        "process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=1"], "args": ["sh"]},
        "root": {"path": "rootfs"},
        "x-vendor": {"keep": [1, 2, {"deep": True}]},
        "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]},
                  "unknownLinuxField": "kept"},
        "hooks": {"poststart": [{"path": "/bin/true"}]},
    }


def write_bundle(tmp_path: Path, spec: dict[str, Any], mode: int = 0o640) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(spec, indent=2))
    p.chmod(mode)
    return p


def test_atomic_save_keeps_unknown_fields_and_mode(tmp_path: Path) -> None:
    p = write_bundle(tmp_path, base_spec(), 0o640)
    ino = p.stat().st_ino
    spec = oci.load_spec(str(tmp_path))
    spec_edits.add_devices(spec, NODES)
    oci.save_spec(str(tmp_path), spec)
    st = p.stat()
    assert st.st_mode & 0o7777 == 0o640
    assert st.st_ino != ino  # replaced by rename, not rewritten in place
    out = json.loads(p.read_text())
    assert out["x-vendor"] == {"keep": [1, 2, {"deep": True}]}
    assert out["linux"]["unknownLinuxField"] == "kept"
    assert list(out)[:4] == ["ociVersion", "process", "root", "x-vendor"]  # order kept
    assert [f.name for f in tmp_path.iterdir()] == ["config.json"]  # no temp file left


def test_atomic_write_failure_leaves_original(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write_bundle(tmp_path, base_spec())
    before = p.read_bytes()

    def boom(*a: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        fileio.atomic_write(str(p), b"{}")
    assert p.read_bytes() == before
    assert [f.name for f in tmp_path.iterdir()] == ["config.json"]


def test_devices_and_rules_idempotent() -> None:
    spec = base_spec()
    for _ in range(3):
        spec_edits.add_devices(spec, NODES)
    devs = spec["linux"]["devices"]
    assert [d["path"] for d in devs] == ["/dev/nvidiactl", "/dev/nvidia1", "/dev/nvidia-uvm"]
    assert devs[2] == {"path": "/dev/nvidia-uvm", "type": "c", "major": 508, "minor": 0,
                       "fileMode": 438, "uid": 0, "gid": 0}
    rules = spec["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}  # the deny-all stays first
    assert rules[1:] == [{"allow": True, "type": "c", "major": n.major, "minor": n.minor,
                          "access": "rwm"} for n in NODES]


def test_devices_on_empty_spec() -> None:
    spec: dict[str, Any] = {}
    spec_edits.add_devices(spec, NODES[:1])
    assert spec["linux"]["devices"][0]["path"] == "/dev/nvidiactl"
    assert len(spec["linux"]["resources"]["devices"]) == 1


def test_hook_replaces_nvidia_and_own() -> None:
    spec = base_spec()
    spec["hooks"]["prestart"] = [
        {"path": "/usr/bin/nvidia-container-runtime-hook",
         "args": ["nvidia-container-runtime-hook", "prestart"], "env": ["LD_PRELOAD=/evil.so"]},
        {"path": "/usr/bin/other-hook", "args": ["other-hook"]},
    ]
    spec["hooks"]["createRuntime"] = [
        {"path": "/usr/bin/nvidia-container-toolkit", "args": ["nvidia-container-toolkit"]}
    ]
    assert spec_edits.remove_nvidia_hooks(spec) == 2
    (hook,) = [h.entry() for h in plan_hooks("/opt/bin/nvctk-hook", 30, "/etc/x.toml",
                                                        False, "/run/runc")]
    spec_edits.set_hook(spec, hook)
    spec_edits.set_hook(spec, hook)
    pre = spec["hooks"]["prestart"]
    assert [h["path"] for h in pre] == ["/usr/bin/other-hook", "/opt/bin/nvctk-hook"]
    assert pre[1] == {"path": "/opt/bin/nvctk-hook", "args": ["nvctk-hook", "prestart"],
                      "env": [HOOK_PATH_ENV, "NVCTK_CONFIG=/etc/x.toml"], "timeout": 30}
    assert spec["hooks"]["createRuntime"] == []
    assert spec["hooks"]["poststart"] == [{"path": "/bin/true"}]
    assert [h.env for h in plan_hooks("/h", 60, None, False, "/run/runc")] == [(HOOK_PATH_ENV,)]


def test_set_env_replaces() -> None:
    spec = base_spec()
    spec_edits.set_env(spec, {"A": "1", "NVIDIA_VISIBLE_DEVICES": "x"})
    spec_edits.set_env(spec, {"A": "2"})
    assert spec["process"]["env"] == ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=x", "A=2"]


def test_spec_readers(tmp_path: Path) -> None:
    spec = base_spec()
    assert oci.spec_env(spec)["NVIDIA_VISIBLE_DEVICES"] == "1"
    assert oci.root_path(spec, "/b/x") == "/b/x/rootfs"
    spec["root"]["path"] = "/abs/root"
    assert oci.root_path(spec, "/b/x") == "/abs/root"
    assert not oci.is_privileged(spec)
    spec["process"]["capabilities"] = {"bounding": ["CAP_SYS_ADMIN"], "effective": []}
    assert oci.is_privileged(spec)
    spec["process"]["capabilities"] = {"effective": ["CAP_SYS_ADMIN"]}
    assert not oci.is_privileged(spec)  # NVIDIA's definition: the bounding set


@pytest.mark.parametrize(
    ("text", "match"),
    [("{", "invalid JSON"), ("[]", "JSON object"), ('{"process": []}', "process"),
     ('{"process": {"env": [1]}}', "process.env"), ('{"mounts": {}}', "mounts")],
)
def test_bad_spec(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SpecError, match=match) as e:
        oci.load_spec(str(tmp_path))
    assert "config.json" in str(e.value)


def test_missing_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        oci.load_spec(str(tmp_path))


def test_load_state() -> None:
    st = oci.load_state(json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating",
                                    "pid": 42, "bundle": "/b", "annotations": {"a": "b"}}))
    assert (st.id, st.pid, st.bundle, st.status, st.root, st.annotations) == (
        "c1", 42, "/b", "creating", None, {"a": "b"})
    assert oci.load_state('{"id":"c","pid":1,"bundle":"/b","root":"/r"}').root == "/r"  # crun


@pytest.mark.parametrize(
    "text", ["", "nope", "[]", '{"pid":1,"bundle":"/b"}', '{"id":"c","pid":1,"bundle":"rel"}',
             '{"id":"c","pid":-1,"bundle":"/b"}', '{"id":"c","pid":true,"bundle":"/b"}'],
)
def test_bad_state(text: str) -> None:
    with pytest.raises(SpecError):
        oci.load_state(text)


@pytest.mark.parametrize("hook_path", ["/usr/bin/nvctk-hook", "/opt/tools/gpu-hook-wrapper"])
def test_set_hook_twice_keeps_one_whatever_the_hook_file_is_called(hook_path: str) -> None:
    other = {"path": "/usr/bin/other", "args": ["other", "prestart"]}
    spec: dict[str, Any] = {"hooks": {"prestart": [other]}}
    (hook,) = plan_hooks(hook_path, 60, None, False, "/run/runc")
    for _ in range(2):
        spec_edits.set_hook(spec, hook.entry())
    assert spec["hooks"]["prestart"] == [other, hook.entry()]


def test_dump_spec_is_compact_json_keeping_non_ascii(tmp_path: Path) -> None:
    spec = base_spec()
    spec["annotations"] = {"é": "ünïcode ✓", "esc": "a\"b\\c\n\u2028", "n": 1.5e300}
    spec["process"]["env"].append("SURR=\udcff")  # os.fsdecode of a non-UTF-8 byte
    # a lone surrogate is not UTF-8: a message naming the variable, not a traceback
    with pytest.raises(SpecError, match=r"process\.env\[2\] \(SURR\) holds a lone UTF-16"):
        oci.dump_spec(spec)
    del spec["process"]["env"][-1]
    want = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    assert oci.dump_spec(spec) == want.encode()
    write_bundle(tmp_path, spec)
    oci.save_spec(str(tmp_path), oci.load_spec(str(tmp_path)))
    assert (tmp_path / "config.json").read_bytes() == want.encode()


def test_state_is_a_value() -> None:
    a = oci.load_state('{"id":"c","pid":1,"bundle":"/b","annotations":{"k":"v"}}')
    assert a == oci.State("c", 1, "/b", "", None, {"k": "v"})
    assert a != a.replace(pid=2)
    assert oci.State("c", 1, "/b").annotations == {}


def test_atomic_write_directory_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sync_dir=False leaves the directory's fsync to the next write in that directory."""
    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    fileio.atomic_write(str(tmp_path / "nvctk-edits.json"), b"{}", 0o644, sync_dir=False)
    fileio.atomic_write(str(tmp_path / "config.json"), b"{}")
    assert synced == ["file", "file", "dir"]
    assert (tmp_path / "nvctk-edits.json").stat().st_mode & 0o777 == 0o644
