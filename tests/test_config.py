"""nvctk.base.config file handling (pyfakefs) and `nvctk config default|show`."""

from __future__ import annotations

import copy
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from pyfakefs.fake_filesystem import FakeFilesystem

from nvctk.base import config as nvconfig
from nvctk.base.errors import ConfigError
from nvctk.base.record import fields
from nvctk.cli.main import cli
from nvctk.sim import host

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KEYS = [f.replace("_", "-") for f in fields(nvconfig.Config) if f != "path"]
REPO = Path(__file__).resolve().parent.parent


def test_missing_file_is_defaults(fs: FakeFilesystem) -> None:
    assert nvconfig.load("/etc/nvctk/config.toml") == nvconfig.Config()


def test_nvctk_config_overrides_default_path(
    fs: FakeFilesystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs.create_file("/etc/nvctk/config.toml", contents='driver-root = "/default"\n')
    fs.create_file("/x/my.toml", contents='driver-root = "/mine"\n')
    monkeypatch.delenv("NVCTK_CONFIG", raising=False)
    assert nvconfig.load().driver_root == "/default"
    monkeypatch.setenv("NVCTK_CONFIG", "/x/my.toml")
    cfg = nvconfig.load()
    assert cfg.driver_root == "/mine"
    assert cfg.path == "/x/my.toml"
    monkeypatch.delenv("NVCTK_CONFIG")
    assert nvconfig.load().driver_root == "/default"


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ('driver-rot = "/x"\n', ["unknown key", "driver-rot"]),
        ('driver-root = "/x"\nbogus = 1\n', ["unknown key", "bogus"]),
        ('driver-root = "/x"\nlog-level = \n', ["malformed TOML", "line 2"]),
        ('\n\n[unclosed\n', ["malformed TOML", "line 3"]),
        ("driver-root = 3\n", ["driver-root", "string"]),
        ('driver-root = "relative"\n', ["driver-root", "absolute"]),
        ('log-level = "loud"\n', ["log-level"]),
        ('supported-capabilities = ["compute", "warp"]\n', ["warp"]),
        ("accept-volume-mount-devices = 1\n", ["accept-volume-mount-devices", "true or false"]),
        ('extra-mounts = [{host-path = "/a"}]\n', ["container-path"]),
        ('extra-mounts = [{host-path = "/a", container-path = "/b", mode = 1}]\n', ["mode"]),
    ],
)
def test_bad_files_name_file_and_culprit(fs: FakeFilesystem, text: str, needles: list[str]) -> None:
    fs.create_file("/cfg/bad.toml", contents=text)
    with pytest.raises(ConfigError) as exc:
        nvconfig.load("/cfg/bad.toml")
    msg = str(exc.value)
    assert "/cfg/bad.toml" in msg
    for n in needles:
        assert n in msg


def test_values_are_read(fs: FakeFilesystem) -> None:
    fs.create_file(
        "/c.toml",
        contents='driver-root = "/run/nvidia/driver"\nruntimes = ["crun"]\nlog-level = "debug"\n'
        'extra-mounts = [{host-path = "/a", container-path = "/b", read-only = true}]\n',
    )
    cfg = nvconfig.load("/c.toml")
    assert cfg.driver_root == "/run/nvidia/driver"
    assert cfg.runtimes == ("crun",)
    assert cfg.log_level == "debug"
    assert cfg.extra_mounts == (nvconfig.ExtraMount("/a", "/b", True),)
    assert cfg.hook_timeout == nvconfig.Config().hook_timeout


def test_render_round_trips() -> None:
    cfg = nvconfig.Config(
        driver_root='/odd "path"\\x',
        runtimes=("/usr/bin/runc",),
        extra_mounts=(nvconfig.ExtraMount("/h", "/c"),),
        accept_volume_mount_devices=True,
    )
    for comments in (True, False):
        assert nvconfig.parse(nvconfig.render(cfg, comments), "x") == cfg


def _invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, args, env=env)
    return r.exit_code, r.stdout, r.stderr


def test_config_default_prints_every_key_commented() -> None:
    code, out, _ = _invoke(["config", "default"])
    assert code == 0
    assert nvconfig.parse(out, "stdout") == nvconfig.Config()
    lines = out.splitlines()
    for key in KEYS:
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{key} = "))
        assert lines[i - 1].startswith("# "), f"{key} has no comment"
    assert set(tomllib.loads(out)) == set(KEYS)


def test_config_show_effective(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('driver-root = "/drv"\nlog-level = "warning"\n')
    code, out, _ = _invoke(["config", "show"], env={"NVCTK_CONFIG": str(p)})
    assert code == 0
    assert str(p) in out.splitlines()[0]
    cfg = nvconfig.parse(out, "stdout")
    assert (cfg.driver_root, cfg.log_level, cfg.runtimes) == ("/drv", "warning", ("runc", "crun"))
    # --config beats NVCTK_CONFIG
    q = tmp_path / "d.toml"
    q.write_text('driver-root = "/other"\n')
    code, out, _ = _invoke(["--config", str(q), "config", "show"], env={"NVCTK_CONFIG": str(p)})
    assert nvconfig.parse(out, "stdout").driver_root == "/other"


def test_config_show_missing_file(tmp_path: Path) -> None:
    code, out, _ = _invoke(["config", "show"], env={"NVCTK_CONFIG": str(tmp_path / "none.toml")})
    assert code == 0
    assert "defaults" in out.splitlines()[0]
    assert nvconfig.parse(out, "stdout") == nvconfig.Config()


def test_config_show_bad_file_is_one_line_error(
    run_nvctk: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    p = tmp_path / "c.toml"
    p.write_text("nope = 1\n")
    r = run_nvctk("config", "show", config=str(p))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"nvctk: {p}: unknown key 'nope'"]
    assert "Traceback" not in r.stderr


def test_config_is_a_frozen_value() -> None:
    cfg = nvconfig.Config(driver_root="/d", extra_mounts=(nvconfig.ExtraMount("/h", "/c"),))
    # where it came from is not part of the value (the dataclass had compare=False)
    assert cfg == cfg.replace(path="/x.toml")
    assert hash(cfg) == hash(cfg.replace(path="/x.toml"))
    assert cfg != cfg.replace(log_level="debug")
    assert nvconfig.ExtraMount("/h", "/c") == nvconfig.ExtraMount("/h", "/c", False)
    assert nvconfig.ExtraMount("/h", "/c") != nvconfig.ExtraMount("/h", "/c", True)
    with pytest.raises(AttributeError):
        cfg.driver_root = "/other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.replace(no_such_field=1)
    for clone in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert clone == cfg
        assert clone.path == cfg.path
    assert "path=''" in repr(cfg)
    assert "driver_root='/d'" in repr(cfg)


def _sim_config_file(tmp_path: Path) -> Path:
    """A config as `nvctk sim init` writes it (nvctk.sim.host._build)."""
    root = str(tmp_path / "host")
    p = tmp_path / "config.toml"
    p.write_text(
        "# nvctk configuration of the simulated host built by `nvctk sim init`\n"
        f"# use it with: export NVCTK_CONFIG={p}\n" + nvconfig.render(host.sim_config(root))
    )
    return p


def _load_in_child(p: Path, cache: Path) -> tuple[set[str], nvconfig.Config]:
    """config.load(p) in a fresh `python -I -S` (as the runtime runs): the modules it
    imported, and the config it read."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from nvctk.base import config; "
        f"cfg = config.load({str(p)!r}); "
        "print(sorted(sys.modules)); print(repr(cfg.to_dict()))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env[nvconfig.CACHE_VAR] = str(cache)
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                       text=True, check=True, env=env)
    modules, values = r.stdout.splitlines()
    d = eval(values)
    d["extra_mounts"] = tuple(nvconfig.ExtraMount(**m) for m in d["extra_mounts"])
    return set(eval(modules)), nvconfig.Config(**{
        k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs written just now count as settled (the racy rule is tested in
    test_launcher.py): the cache is written at once."""
    monkeypatch.setattr(nvconfig, "RACY_NS", -(10**12))
    monkeypatch.setattr(nvconfig, "RACY_COARSE_NS", -(10**12))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root writes the parsed-config cache")
def test_a_cache_hit_imports_no_tomllib(tmp_path: Path, settled: None) -> None:
    """The runtime reads the config at every container start: from the second load on,
    the parsed-config cache serves it without tomllib (nor dataclasses, typing, re, json,
    enum, inspect)."""
    p = _sim_config_file(tmp_path)
    cache = tmp_path / "cache"
    slow = {"tomllib", "dataclasses", "typing", "re", "json", "enum", "inspect"}
    loaded, cold = _load_in_child(p, cache)  # a miss: parses (the child's load is racy)
    assert "tomllib" in loaded
    assert list(cache.glob("config-*.json")) == []
    with pytest.MonkeyPatch.context() as m:
        m.setenv(nvconfig.CACHE_VAR, str(cache))
        want = nvconfig.load(str(p))  # settled here: writes the cache
    entry = cache / f"config-{nvconfig.cache_name(str(p))}.json"
    assert entry.stat().st_mode & 0o777 == 0o600 and entry.stat().st_uid == 0
    loaded, warm = _load_in_child(p, cache)
    assert not slow & loaded, sorted(slow & loaded)
    assert warm == cold == want == host.sim_config(str(tmp_path / "host"))
    assert warm.extra_mounts and warm.log_level == "debug" and warm.path == str(p)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root writes the parsed-config cache")
def test_a_changed_config_is_read_again(tmp_path: Path, settled: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nvconfig.CACHE_VAR, str(tmp_path / "cache"))
    p = tmp_path / "c.toml"
    p.write_text('log-level = "debug"\n')
    assert nvconfig.load(str(p)).log_level == "debug"
    entry = Path(nvconfig.parsed_cache_path(str(p)))
    assert entry.exists()
    p.write_text('log-level = "error"\n')  # same size, same inode: the ctime moves
    assert nvconfig.load(str(p)).log_level == "error"
    p.write_text('log-level = "warning"\n')  # another size
    assert nvconfig.load(str(p)).log_level == "warning"
    q = tmp_path / "q.toml"
    q.write_text('log-level = "info"\n')
    os.replace(q, p)  # another inode
    assert nvconfig.load(str(p)).log_level == "info"
    p.write_text("log-level = 3\n")  # now broken: the cache does not hide it
    with pytest.raises(ConfigError, match="log-level must be a string"):
        nvconfig.load(str(p))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root writes the parsed-config cache")
def test_a_forged_or_unsafe_cache_is_ignored(tmp_path: Path, settled: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(nvconfig.CACHE_VAR, str(cache))
    p = tmp_path / "c.toml"
    p.write_text('runtimes = ["runc"]\n')
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    entry = Path(nvconfig.parsed_cache_path(str(p)))
    good = entry.read_text()
    forged = good.replace('"runc"', '"/tmp/evil"')
    assert forged != good

    def served(text: str, mode: int = 0o600, uid: int = 0) -> tuple[str, ...]:
        entry.unlink(missing_ok=True)
        entry.write_text(text)
        os.chmod(entry, mode)
        os.chown(entry, uid, 0)
        return nvconfig.load(str(p)).runtimes

    assert served(forged) == ("/tmp/evil",)  # a root-owned 0600 entry is the cache
    assert served(forged, 0o644) == ("runc",)  # others could have read or ... : ignored
    assert served(forged, 0o620) == ("runc",)
    assert served(forged, uid=65534) == ("runc",)  # not root's
    assert served(good.replace('"stamp":[', '"stamp":[1,')) == ("runc",)  # another stamp
    assert served(good.replace(str(p), str(p) + "x")) == ("runc",)  # another path
    assert served("{not json") == ("runc",)
    assert served(good.replace('"runc"', "5")) == ("runc",)  # fails the checks: a miss
    assert served(good.replace('"runtimes"', '"bogus"')) == ("runc",)
    # a link in the entry's place is not followed
    entry.unlink()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(forged)
    os.chmod(elsewhere, 0o600)
    entry.symlink_to(elsewhere)
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    # a cache dir others can write is not trusted (nor written)
    entry.unlink()
    entry.write_text(forged)
    os.chmod(entry, 0o600)
    os.chmod(cache, 0o777)
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    assert entry.read_text() == forged
    os.chmod(cache, 0o755)
    # and a miss writes the right entry back over a forged one
    entry.write_text(good.replace('"stamp":[', '"stamp":[1,'))
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    assert entry.read_text() == good


def test_hostile_keys_are_refused_before_the_parse(tmp_path: Path) -> None:
    """tomllib is quadratic in a key's dotted parts: structure no config has is refused
    by two linear counts, naming the file (what toml_subset's tests held)."""
    p = tmp_path / "c.toml"
    for text, needle in [
        (".".join(["a"] * 6000) + " = 1\n", "line 1 is longer than 8192 bytes"),
        ('s = """x"""\n' + ".".join(["a"] * 30000) + " = 1\n", "line 2 is longer than 8192"),
        ("[" + ".".join(["a"] * 3000) + "]\n", "more than 1024 '.' characters"),
        ("x = {" + ".".join(["a"] * 4000) + " = 1}\n", "more than 1024 '.' characters"),
        ("a.b.c = 1\n" * 600, "more than 1024 '.' characters"),
        ("a = " + "[" * 2000 + "]" * 2000 + "\n", "malformed TOML: arrays or tables nested"),
        ('runtimes = ["crun"]\nruntimes = ["runc"]\n', "malformed TOML: Cannot overwrite"),
        ("a = 1_" + "0" * 5000 + "\n", "malformed TOML"),
        ('driver-root = "/a\\u0000b"\n', "must not contain a NUL character"),
        ('"driver-root\\u0000" = "/x"\n', "unknown key"),
        ("\ufeffdriver-root = \"/x\"\n", "malformed TOML"),
    ]:
        p.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(needle)) as exc:
            nvconfig.load(str(p))
        assert str(exc.value).startswith(f"{p}: ") and len(str(exc.value)) < 400, text[:40]
    # dots inside strings are no structure: a real config with paths and vendors loads
    p.write_text('cdi-vendors = ["nvidia.com", "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r"]\n'
                 "driver-root = '/a.b'\n")
    assert nvconfig.load(str(p)).cdi_vendors[1].count(".") == 17
