"""nvctk-runtime's CDI mode: qualified device names, or config
`mode = "cdi"`, get the named devices' containerEdits from the CDI spec dirs. Here the
names, the config keys, and resolution and edits on plain data; through nvctk-runtime and
the record's MAC: test_cdi_mode_runtime.py; host directories, vendors and the driver's
config files: test_cdi_mode_host_dirs.py (shared: tests/support/cdi_mode.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from nvctk.base.config import Config, parse
from nvctk.base.errors import ConfigError, RequestError
from nvctk.cdi import load, resolve
from nvctk.plan.cdi import cdi_edits
from nvctk.request.parse import cdi_names, parse_qualified, request_from_spec
from nvctk.runtime import earlier
from nvctk.spec import apply as spec_edits
from support.cdi_mode import _spec
from support.records import apply_as_create

# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, want", [
    ("nvidia.com/gpu=0", ("nvidia.com", "gpu", "0")),
    ("nvidia.com/gpu=GPU-0a1b", ("nvidia.com", "gpu", "GPU-0a1b")),
    ("nvidia.com/gpu=0:1", ("nvidia.com", "gpu", "0:1")),
    ("vendor.io/class_x=all", ("vendor.io", "class_x", "all")),
    ("0", None), ("GPU-0a1b", None), ("all", None),
])
def test_parse_qualified(name: str, want: tuple[str, str, str] | None) -> None:
    assert parse_qualified(name) == want


@pytest.mark.parametrize("name", ["nvidia.com=0", "nvidia.com/gpu=", "/gpu=0", "nvidia.com/=0",
                                  "nvidia.com/gpu=0/1", "nvidia.com/g.pu=0", "nvidia.com/gpu=-0",
                                  "nvidia.com/gpu=\u0660"])
def test_malformed_qualified_name_is_a_clear_error(name: str) -> None:
    with pytest.raises(RequestError, match=r"invalid CDI device name .* vendor/class=name"):
        parse_qualified(name)


@pytest.mark.parametrize("tokens, want", [
    (["0"], ("nvidia.com/gpu=0",)),
    (["all"], ("nvidia.com/gpu=all",)),
    (["GPU-ab", "vendor.io/x=1"], ("nvidia.com/gpu=GPU-ab", "vendor.io/x=1")),
    (["0", "nvidia.com/gpu=0"], ("nvidia.com/gpu=0",)),
    (["none"], ()),
    (["void"], None),
])
def test_cdi_names(tokens: list[str], want: tuple[str, ...] | None) -> None:
    assert cdi_names(tokens) == want


LEGACY, CDI = Config(), Config(mode="cdi")


@pytest.mark.parametrize("env, annotations, config, want", [
    (["NVIDIA_VISIBLE_DEVICES=1"], None, LEGACY, None),  # legacy: no CDI
    (["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=1"], None, LEGACY, ("nvidia.com/gpu=1",)),
    (["NVIDIA_VISIBLE_DEVICES=1"], None, CDI, ("nvidia.com/gpu=1",)),
    (["NVIDIA_VISIBLE_DEVICES=all"], None, CDI, ("nvidia.com/gpu=all",)),
    (["NVIDIA_VISIBLE_DEVICES=none"], None, CDI, ()),
    # annotations come first (REFERENCE §5), in either mode
    (["NVIDIA_VISIBLE_DEVICES=0"], {"cdi.k8s.io/plugin": "nvidia.com/gpu=1, nvidia.com/gpu=0"},
     LEGACY, ("nvidia.com/gpu=1", "nvidia.com/gpu=0")),
    ([], {"cdi.k8s.io/a": "x.io/c=1", "cdi.k8s.io/b": "x.io/c=2", "other": "x"}, LEGACY,
     ("x.io/c=1", "x.io/c=2")),
    # an empty annotation names nothing: the env decides
    (["NVIDIA_VISIBLE_DEVICES=0"], {"cdi.k8s.io/a": ""}, LEGACY, None),
])
def test_request_names(env: list[str], annotations: dict[str, str] | None, config: Config,
                       want: tuple[str, ...] | None) -> None:
    r = request_from_spec(_spec(env, annotations), config)
    assert r is not None and r.cdi_devices == want


@pytest.mark.parametrize("env, config", [
    (["NVIDIA_VISIBLE_DEVICES=void"], CDI), ([], CDI), (["NVIDIA_VISIBLE_DEVICES="], CDI),
])
def test_no_gpu_stays_no_gpu_in_cdi_mode(env: list[str], config: Config) -> None:
    assert request_from_spec(_spec(env), config) is None


def test_unqualified_annotation_is_a_clear_error() -> None:
    with pytest.raises(RequestError, match=r"annotation 'cdi\.k8s\.io/p': '0' is not a qualified"):
        request_from_spec(_spec([], {"cdi.k8s.io/p": "0"}), LEGACY)


@pytest.mark.parametrize("text, msg", [
    ('mode = "auto"\n', "mode must be one of legacy, cdi, not 'auto'"),
    ('cdi-spec-dirs = ["etc/cdi"]\n', "cdi-spec-dirs must be an absolute path"),
    ("cdi-spec-dirs = 1\n", "cdi-spec-dirs must be a list"),
])
def test_config_keys_are_checked(text: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        parse(text, "c.toml")


def test_config_keys_parse() -> None:
    c = parse('mode = "cdi"\ncdi-spec-dirs = ["/a", "/b"]\n', "c.toml")
    assert (c.mode, c.cdi_spec_dirs) == ("cdi", ("/a", "/b"))
    assert (Config().mode, Config().cdi_spec_dirs) == ("legacy", ("/etc/cdi", "/var/run/cdi"))


# --- resolution and edits on plain data ------------------------------------------------------


def _write(d: Path, name: str, spec: dict[str, Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(json.dumps(spec))
    return p


def _cdi(kind: str, devices: dict[str, dict[str, Any]], **common: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"cdiVersion": "0.5.0", "kind": kind,
                         "devices": [{"name": n, "containerEdits": e} for n, e in devices.items()]}
    if common:
        s["containerEdits"] = common
    return s


def test_resolve(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "x.json", _cdi("x.io/c", {"0": {"env": ["A=0"]}, "1": {}}))
    _write(a, "y.json", _cdi("y.io/c", {"0": {}}))
    (a / "y.yaml").write_text("kind: y.io/d\ncdiVersion: 0.5.0\ndevices:\n- name: '9'\n"
                              "  containerEdits: {env: [Y=9]}\n")
    r = load.resolve(("x.io/c=1", "y.io/d=9", "x.io/c=0"), (str(a), str(b)))
    assert [(x.name, x.path) for x in r] == [("x.io/c=1", str(a / "x.json")),
                                             ("y.io/d=9", str(a / "y.yaml")),
                                             ("x.io/c=0", str(a / "x.json"))]
    # a later dir's file of the same name replaces the earlier one
    _write(b, "x.json", _cdi("x.io/c", {"5": {}}))
    with pytest.raises(load.CdiError, match=r"unresolvable CDI device x.io/c=0: not in the CDI "
                       r"specs of .*; x.io/c has: 5"):
        load.resolve(("x.io/c=0",), (str(a), str(b)))


def test_unresolvable_names_say_why(tmp_path: Path) -> None:
    d = tmp_path / "d"
    _write(d, "x.json", _cdi("x.io/c", {"0": {}}))
    (d / "bad.yaml").write_text("kind: [\n")
    with pytest.raises(load.CdiError, match=r"no spec defines kind nvidia.com/gpu; unreadable "
                       r"specs: .*bad.yaml: not a CDI spec: not valid YAML"):
        load.resolve(("nvidia.com/gpu=0",), (str(d), str(tmp_path / "missing")))


def test_duplicate_name_in_two_files_names_both(tmp_path: Path) -> None:
    d = tmp_path / "d"
    one = _write(d, "one.json", _cdi("x.io/c", {"0": {}, "1": {}}))
    two = _write(d, "two.json", _cdi("x.io/c", {"0": {}}))
    assert [x.path for x in load.resolve(("x.io/c=1",), (str(d),))] == [str(one)]
    with pytest.raises(load.CdiError, match=f"x.io/c=0 is defined by more than one spec file: "
                       f"{one} and {two}"):
        load.resolve(("x.io/c=0",), (str(d),))


HOOK = {"hookName": "createRuntime", "path": "/usr/bin/h", "args": ["h", "x"], "env": ["P=1"]}


def _apply(spec: dict[str, Any], names: tuple[str, ...], d: Path, state: str) -> None:
    """CDI mode's edits: the devices as the form (nvctk.cdi.resolve reads them,
    nvctk.plan.cdi decides), applied by nvctk.spec.apply as legacy mode's form is (the
    bundle: d)."""
    edits = cdi_edits(resolve.read_devices(load.resolve(names, (str(d),)), spec=spec),
                      "/sbin/ldconfig")
    apply_as_create(spec, edits, d, state)


def test_apply_and_remove_edits(tmp_path: Path) -> None:
    """Every kind of edit goes in, is recorded, and the next create's removal takes
    exactly it out again (the user's own entries stay)."""
    d = tmp_path / "d"
    _write(d, "x.json", _cdi(
        "x.io/c",
        {"0": {"deviceNodes": [{"path": "/dev/xnull", "hostPath": "/dev/null",
                                "permissions": "rw"}],
               "env": ["X_DEV=0"], "hooks": [HOOK]},
         "1": {"deviceNodes": [{"path": "/dev/x1", "type": "c", "major": 240, "minor": 1}]}},
        env=["X_COMMON=1"], mounts=[{"hostPath": "/lib", "containerPath": "/xlib",
                                     "options": ["ro", "rbind"]}]))
    spec: dict[str, Any] = {
        "process": {"env": ["PATH=/bin", "X_DEV=user"]},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "hooks": {"createRuntime": [{"path": "/user/hook"}]},
        "linux": {"devices": [], "resources": {"devices": [{"allow": False, "access": "rwm"}]}},
    }
    before = json.loads(json.dumps(spec))
    state = str(tmp_path / "state")
    _apply(spec, ("x.io/c=0", "x.io/c=1"), d, state)
    assert spec["process"]["env"] == ["PATH=/bin", "X_COMMON=1", "X_DEV=0"]
    null = os.stat("/dev/null")
    assert spec["linux"]["devices"] == [
        {"path": "/dev/xnull", "type": "c", "major": os.major(null.st_rdev),
         "minor": os.minor(null.st_rdev), "fileMode": 0o666, "uid": 0, "gid": 0},
        {"path": "/dev/x1", "type": "c", "major": 240, "minor": 1, "fileMode": 0o666, "uid": 0,
         "gid": 0}]
    assert spec["linux"]["resources"]["devices"][1:] == [
        {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rw"},
        {"allow": True, "type": "c", "major": 240, "minor": 1, "access": "rwm"}]
    assert spec["mounts"][1:] == [{"destination": "/xlib", "source": "/lib", "type": "bind",
                                   "options": ["ro", "rbind"]}]
    assert spec["hooks"]["createRuntime"] == [{"path": "/user/hook"},
                                              {k: v for k, v in HOOK.items() if k != "hookName"}]
    record = earlier.earlier_record(str(d), spec, state)
    assert record is not None and record.trusted and record.problem is None
    spec_edits.remove_our_edits(spec, record)
    before["process"]["env"] = ["PATH=/bin"]  # set_env replaced the user's X_DEV
    before["annotations"] = {}  # emptied objects stay (spec_edits.remove_our_edits)
    for stage in ("prestart", "poststop"):
        spec["hooks"].pop(stage, None)
    assert spec == before


@pytest.mark.parametrize("edits, msg", [
    ({"intelRdt": {}}, "containerEdits.intelRdt is not supported by nvctk"),
    ({"env": ["NOVALUE"]}, "env entry 'NOVALUE' is not NAME=VALUE"),
    ({"deviceNodes": [{"path": "/dev/nope-cdi"}]}, "cannot stat /dev/nope-cdi"),
    ({"deviceNodes": [{"path": "/etc/passwd"}]}, "/etc/passwd is not a device node"),
    ({"deviceNodes": [{"path": "/dev/x", "major": -1}]}, "major must be a non-negative"),
    ({"mounts": [{"hostPath": "rel", "containerPath": "/x"}]}, "hostPath 'rel' must be an absolute"),
    ({"hooks": [{**HOOK, "hookName": "prestop"}]}, "hookName 'prestop' is not one of"),
    # values runc (Go) would refuse only after nvctk had rewritten config.json
    ({"deviceNodes": [{"path": "/dev/x", "type": "c", "major": 2**70, "minor": 0}]},
     "major is larger than 4294967295"),
    ({"deviceNodes": [{"path": "/dev/x", "type": "c", "major": 1, "minor": 3,
                       "fileMode": 2**40}]}, "fileMode is larger than 0o7777"),
    ({"hooks": [{**HOOK, "timeout": 2**70}]}, "timeout must be an integer from 1 to"),
    ({"env": ["A=\0b"]}, "env entry 'A' contains a NUL byte"),
    ({"mounts": [{"hostPath": "/l\0ib", "containerPath": "/x"}]}, "contains a NUL byte"),
])
def test_bad_edits_are_clear_errors(tmp_path: Path, edits: dict[str, Any], msg: str) -> None:
    d = tmp_path / "d"
    p = _write(d, "x.json", _cdi("x.io/c", {"0": edits}))
    spec: dict[str, Any] = {"process": {"env": []}}
    with pytest.raises(load.CdiError, match=f"{p}: device 0: .*{msg}"):
        _apply(spec, ("x.io/c=0",), d, str(tmp_path / "state"))
    assert spec == {"process": {"env": []}}


def test_unbuffered_char_device_gets_a_c_rule(tmp_path: Path) -> None:
    """CDI allows type "u"; a cgroup rule knows only c and b (runc refused "u")."""
    d = tmp_path / "d"
    _write(d, "x.json", _cdi("x.io/c", {"0": {"deviceNodes": [
        {"path": "/dev/x", "type": "u", "major": 1, "minor": 3}]}}))
    spec: dict[str, Any] = {"process": {"env": []}}
    _apply(spec, ("x.io/c=0",), d, str(tmp_path / "state"))
    assert spec["linux"]["devices"][0]["type"] == "u"
    assert [r["type"] for r in spec["linux"]["resources"]["devices"]] == ["c"]
