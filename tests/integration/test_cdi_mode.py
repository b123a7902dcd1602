"""nvctk-runtime's CDI mode: qualified device names, or config
`mode = "cdi"`, get the named devices' containerEdits from the CDI spec dirs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nvctk.base.config import Config, parse
from nvctk.base.errors import ConfigError, RequestError
from nvctk.base.keyfile import EDITS_KEY_FILE, edits_key
from nvctk.cdi import check, load, resolve
from nvctk.edits import Edits
from nvctk.plan.cdi import cdi_edits
from nvctk.request.parse import cdi_names, parse_qualified, request_from_spec
from nvctk.runtime import earlier
from nvctk.sim.host import SimHost
from nvctk.spec import apply as spec_edits
from nvctk.spec.record import AppliedRecord, Seal
from support.records import apply_as_create
from support.runtime import RUNTIME, Env, create_argv, snapshot


def _with(text: str, **keys: str) -> str:
    """A config's text with keys (TOML values) set, replacing the rendered ones."""
    for key, value in keys.items():
        name = key.replace("_", "-")
        text = re.sub(rf"(?m)^{name} = .*\n", "", text) + f"{name} = {value}\n"
    return text


def _spec(env: list[str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"process": {"env": env}, "mounts": [], "linux": {}}
    if annotations:
        s["annotations"] = annotations
    return s


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


# --- through nvctk-runtime --------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path, sim_host: SimHost) -> Env:
    e = Env(tmp_path, sim_host)
    e.config.write_text(_with(e.config.read_text(), cdi_spec_dirs=f'["{tmp_path / "cdi"}"]'))
    return e


@pytest.fixture(scope="module")
def spec_dir(sim_host: SimHost, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from support.exe import nvctk_exe

    d = tmp_path_factory.mktemp("cdi-mode")
    r = subprocess.run([*nvctk_exe(), "cdi", "generate", "--output", str(d / "nvidia.yaml")],
                       env={**os.environ, "NVCTK_CONFIG": sim_host.config_path},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return d


def _bundle(tmp: Path, envvars: list[str], name: str = "bundle", rootfs: str = "") -> Path:
    b = tmp / name
    b.mkdir()
    if rootfs:
        shutil.move(rootfs, b / "rootfs")
    subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
    spec = json.loads((b / "config.json").read_text())
    spec["process"].update(terminal=False, args=["true"], env=["PATH=/bin", *envvars])
    (b / "config.json").write_text(json.dumps(spec, indent="\t"))
    return b


def _real_runc_in_both_modes(test: Callable[..., None]) -> Callable[..., None]:
    """Slow, needs root and runc, once with mode "cdi" and once "legacy"."""
    test = pytest.mark.parametrize("mode", ["cdi", "legacy"])(test)
    test = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                              reason="needs root and runc")(test)
    return pytest.mark.slow(test)


def _mode_setup(sim_host: SimHost, spec_dir: Path, tmp_path: Path, mode: str) -> str:
    """A rootfs under tmp_path (its path) and c.toml there: the host's config in
    `mode`, reading CDI specs from spec_dir."""
    from nvctk.sim.rootfs import build_rootfs

    rootfs = build_rootfs(str(tmp_path / "rootfs"))
    base = _with(Path(sim_host.config_path).read_text(), cdi_spec_dirs=f'["{spec_dir}"]')
    (tmp_path / "c.toml").write_text(_with(base, mode=f'"{mode}"'))
    return rootfs


def _runc_run(b: Path, config: Path, root: Path) -> subprocess.CompletedProcess[str]:
    """`runc run` of bundle b through nvctk-runtime with config, its state under root;
    the container is deleted after, whatever happened."""
    cid = "nvctk-cdi-mode-" + uuid.uuid4().hex[:8]
    try:
        return subprocess.run([RUNTIME, "--root", str(root), "run", "--bundle", str(b), cid],
                              env={**os.environ, "NVCTK_CONFIG": str(config)},
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    finally:
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid],
                       capture_output=True, timeout=60)


def _rootfs_bundle(b: Path, rootfs: str, args: list[str], env: list[str]) -> dict[str, Any]:
    """runc's default spec in a new bundle b, on rootfs (writable), running args with
    PATH and env; returned for the caller to add to and write."""
    b.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
    spec = json.loads((b / "config.json").read_text())
    spec["root"] = {"path": rootfs, "readonly": False}
    spec["process"].update(terminal=False, args=args, env=["PATH=/usr/bin:/bin:/sbin", *env])
    return spec


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


# --- nothing created on a host directory bound into the container ---

_LIB = "/usr/lib/x86_64-linux-gnu"


def _bind_host_dir(b: Path, host: Path, at: str, *, ro: bool = False, after: list[Any] | None = None
                   ) -> None:
    spec = json.loads((b / "config.json").read_text())
    opts = ["rbind", "ro" if ro else "rw"]
    spec["mounts"].append({"destination": at, "type": "bind", "source": str(host), "options": opts})
    spec["mounts"] += after or []
    (b / "config.json").write_text(json.dumps(spec))


def _host_dir(tmp: Path) -> Path:
    d = tmp / "host-dir"
    d.mkdir()
    (d / "keep").write_text("the host's\n")
    return d


@pytest.mark.parametrize(("at", "what"), [
    (_LIB, "mount /usr/lib/x86_64-linux-gnu/"),       # the libraries (40 files before)
    ("/usr", "mount /usr/"),                           # parents too: lib/x86_64-linux-gnu/...
    ("/usr/bin", "mount /usr/bin/"),                   # the binaries
    ("/usr/share", "mount /usr/share/"),               # ICD and EGL files
    ("/run", "mount /run/"),                           # persistenced's and fabricmanager's sockets
    ("/dev", "deviceNode /dev/nvidia"),                # runc's mknod
], ids=["lib", "usr", "bin", "share", "run", "dev"])
@pytest.mark.parametrize("ro", [False, True], ids=["rw", "ro"])
def test_cdi_create_refuses_to_create_on_a_bound_host_dir(env: Env, spec_dir: Path, at: str,
                                                          what: str, ro: bool) -> None:
    """Before: runc made the CDI mounts' mount points (40 empty files at the library
    dir) in the host's directory; legacy mode's hook refuses the same start."""
    from support.fs import snapshot as tree
    from support.runtime import assert_clean_failure

    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])
    _bind_host_dir(b, host, at, ro=ro)
    before, spec_before = tree(host), snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"lies on the host directory {host}")
    assert what in r.stderr, r.stderr
    assert "nvctk creates nothing on a host directory bound into a container" in r.stderr
    assert tree(host) == before
    assert snapshot(b / "config.json") == spec_before


def test_cdi_create_refuses_a_link_on_a_bound_host_dir(env: Env, spec_dir: Path) -> None:
    """Every mount target already in the host's directory: the links hook would still
    create libcuda.so there."""
    from support.runtime import assert_clean_failure

    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    spec = load.load_spec_file(str(spec_dir / "nvidia.yaml"))
    edits = [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]
    for e in edits:
        for m in e.get("mounts", ()):
            if m["containerPath"].startswith(_LIB + "/"):
                (host / os.path.relpath(m["containerPath"], _LIB)).touch()
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])
    _bind_host_dir(b, host, _LIB)
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"link {_LIB}/libcuda.so lies on the host directory {host}")
    for e in edits:  # nothing left to create there: the create goes ahead
        for h in e.get("hooks", ()):
            for link in check._link_paths(h):
                if link.startswith(_LIB + "/"):
                    (host / os.path.relpath(link, _LIB)).touch()
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("at", ["/lib/x86_64-linux-gnu", "/lib", "/usr/../usr/lib//x86_64-linux-gnu/"])
def test_a_bind_reached_through_the_images_links_is_found(env: Env, spec_dir: Path,
                                                          rootfs: Callable[..., str],
                                                          at: str) -> None:
    """A merged-/usr image: /lib is a link to usr/lib, so a bind at /lib/x86_64-linux-gnu
    is where runc puts the CDI mounts of /usr/lib/x86_64-linux-gnu."""
    from support.fs import snapshot as tree
    from support.runtime import assert_clean_failure

    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"], rootfs=rootfs())
    assert os.path.islink(b / "rootfs/lib")
    _bind_host_dir(b, host, at)
    before = tree(host)
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"lies on the host directory {host}")
    assert tree(host) == before


@pytest.mark.parametrize("cover", ["tmpfs", "bind-of-a-fresh-dir"])
def test_cdi_create_is_fine_when_something_else_covers_the_bind(env: Env, spec_dir: Path,
                                                                cover: str) -> None:
    """A later mount at the same place hides the host's directory: runc creates the
    mount points on that one."""
    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    fresh = env.tmp / "fresh"
    fresh.mkdir()
    over: dict[str, Any] = ({"destination": _LIB, "type": "tmpfs", "source": "tmpfs"}
                            if cover == "tmpfs" else
                            {"destination": "/usr", "type": "tmpfs", "source": "tmpfs"})
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])
    _bind_host_dir(b, host, _LIB, after=[over])
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(host)) == ["keep"]


@_real_runc_in_both_modes
def test_real_runc_creates_nothing_on_a_bound_host_dir(sim_host: SimHost, spec_dir: Path,
                                                       tmp_path: Path, mode: str) -> None:
    """Both modes, end to end: the start is refused and the host directory holds what
    it held."""
    from support.fs import snapshot as tree

    rootfs = _mode_setup(sim_host, spec_dir, tmp_path, mode)
    host = _host_dir(tmp_path)
    b = tmp_path / "b"
    spec = _rootfs_bundle(b, rootfs, ["true"], ["NVIDIA_VISIBLE_DEVICES=0"])
    spec["mounts"].append({"destination": _LIB, "type": "bind", "source": str(host),
                           "options": ["rbind", "rw"]})
    (b / "config.json").write_text(json.dumps(spec))
    before = tree(host)
    r = _runc_run(b, tmp_path / "c.toml", tmp_path / "runc-root")
    assert r.returncode != 0, r.stdout + r.stderr
    assert tree(host) == before


# --- CDI vendors a container may name ---------------------------------

_NET = {"cdiVersion": "0.5.0", "kind": "example.com/net",
        "devices": [{"name": "eth", "containerEdits": {"mounts": [
            {"hostPath": "/", "containerPath": "/host", "options": ["rbind", "rw"]}]}}]}


def _net_spec(env: Env, spec_dir: Path) -> None:
    shutil.copytree(spec_dir, env.tmp / "cdi")
    (env.tmp / "cdi" / "net.json").write_text(json.dumps(_NET))


@pytest.mark.parametrize(("envvars", "annotations", "mounts", "source"), [
    (["NVIDIA_VISIBLE_DEVICES=example.com/net=eth"], {}, [], "NVIDIA_VISIBLE_DEVICES"),
    (["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0,example.com/net=eth"], {}, [],
     "NVIDIA_VISIBLE_DEVICES"),
    (["NVIDIA_VISIBLE_DEVICES=NVIDIA.COM/gpu=0"], {}, [], "NVIDIA_VISIBLE_DEVICES"),
    (["NVIDIA_VISIBLE_DEVICES=nvidia.com.example.com/gpu=0"], {}, [], "NVIDIA_VISIBLE_DEVICES"),
    ([], {"cdi.k8s.io/x": "example.com/net=eth"}, [], "annotation cdi.k8s.io/x"),
    ([], {}, ["example.com/net=eth"], "/var/run/nvidia-container-devices mounts"),
], ids=["env", "env-mixed", "env-case", "env-lookalike", "annotation", "device-mount"])
def test_another_vendors_device_is_refused(env: Env, spec_dir: Path, envvars: list[str],
                                           annotations: dict[str, str], mounts: list[str],
                                           source: str) -> None:
    """Before: example.com/net=eth from the env bound the host's / read-write."""
    from support.runtime import assert_clean_failure

    _net_spec(env, spec_dir)
    if mounts:
        env.config.write_text(_with(env.config.read_text(), accept_volume_mount_devices="true"))
    b = _bundle(env.tmp, envvars)
    spec = json.loads((b / "config.json").read_text())
    spec["annotations"] = annotations
    spec["mounts"] += [{"destination": f"/var/run/nvidia-container-devices/{m}", "type": "bind",
                        "source": "/dev/null", "options": ["bind"]} for m in mounts]
    (b / "config.json").write_text(json.dumps(spec))
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"(from {source}): vendor ")
    assert "is not one nvctk applies devices of (cdi-vendors = ['nvidia.com', 'nvctk.io']" \
        in r.stderr, r.stderr
    assert snapshot(b / "config.json") == before


def test_an_operator_can_allow_another_vendor(env: Env, spec_dir: Path) -> None:
    _net_spec(env, spec_dir)
    env.config.write_text(_with(env.config.read_text(),
                                cdi_vendors='["nvidia.com", "example.com"]'))
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=example.com/net=eth"])
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    mounts = json.loads((b / "config.json").read_text())["mounts"]
    assert {"destination": "/host", "source": "/", "options": ["rbind", "rw"],
            "type": "bind"} in mounts


@pytest.mark.parametrize("value", ['["nvidia.com/gpu"]', '[""]', '["a b"]', '"nvidia.com"'])
def test_cdi_vendors_key_is_checked(value: str) -> None:
    with pytest.raises(ConfigError, match="cdi-vendors"):
        parse(f"cdi-vendors = {value}\n", "c.toml")


# --- the driver's configuration files in both modes ---------------------------

_CONFIG_FILES = ("/etc/OpenCL/vendors/nvidia.icd", "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json",
                 "/usr/share/egl/egl_external_platform.d/09_nvidia_wayland2.json",
                 "/usr/share/egl/egl_external_platform.d/20_nvidia_xcb.json",
                 "/usr/share/egl/egl_external_platform.d/20_nvidia_xlib.json",
                 "/usr/share/X11/xorg.conf.d/10-nvidia.conf",
                 "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf")


@_real_runc_in_both_modes
def test_config_files_reach_the_container_in_both_modes(sim_host: SimHost, spec_dir: Path,
                                                        tmp_path: Path, mode: str) -> None:
    """NVIDIA's spec mounts these seven; nvctk's did not (OpenCL found no platform)."""
    rootfs = _mode_setup(sim_host, spec_dir, tmp_path, mode)
    b = tmp_path / "b"
    script = "; ".join(f"test -s {f} && echo present {f}" for f in _CONFIG_FILES) + "; true"
    spec = _rootfs_bundle(b, rootfs, ["sh", "-c", script],
                          ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"])
    (b / "config.json").write_text(json.dumps(spec))
    r = _runc_run(b, tmp_path / "c.toml", tmp_path / "runc-root")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [x.split()[1] for x in r.stdout.splitlines() if x.startswith("present ")] == \
        list(_CONFIG_FILES)
