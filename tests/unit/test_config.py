"""nvctk.base.config file handling (pyfakefs) and `nvctk config default|show`."""

from __future__ import annotations

import copy
import pickle
import re
import sys
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
REPO = Path(__file__).resolve().parents[2]


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


def test_the_table_is_the_class() -> None:
    """Config's class body is its one table: a slot for every annotated field, in
    order, each default of its annotated type, a doc for every file key."""
    import typing

    settings = nvconfig._SETTINGS
    hints = typing.get_type_hints(nvconfig.Config, vars(nvconfig))
    assert tuple(hints) == fields(nvconfig.Config) == tuple(settings)
    for name, s in settings.items():
        hint = hints[name]
        origin = typing.get_origin(hint) or hint
        assert isinstance(s.default, origin), name
        if origin is tuple:
            (item, _) = typing.get_args(hint)
            assert all(isinstance(v, item) for v in s.default), name
        assert bool(s.doc) == (name != "path"), name
        assert s.check in ("", "absolute", "absolute-or-empty"), name
        assert (s.high > 0) == (name == "hook_timeout"), name


def test_config_takes_fields_by_position_or_name() -> None:
    cfg = nvconfig.Config("/d", hook_timeout=5)
    assert (cfg.driver_root, cfg.hook_timeout, cfg.path) == ("/d", 5, "")
    for args, kw in (((), {"drver_root": "/"}), (("/",), {"driver_root": "/"}),
                     (tuple(range(len(fields(nvconfig.Config)) + 1)), {})):
        with pytest.raises(TypeError):
            nvconfig.Config(*args, **kw)
