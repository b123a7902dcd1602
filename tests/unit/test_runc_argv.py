"""runc command-line parsing (REFERENCE §1) and runtime lookup."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nvctk.oci import runc_argv

CTR = ["--root", "/run/containerd/runc/k8s.io", "--log", "/b/log.json", "--log-format", "json"]

# (argv, subcommand, bundle as parsed, container id, log)
CASES: list[tuple[list[str], str | None, str, str | None, str | None]] = [
    # containerd's runc v2 shim
    ([*CTR, "create", "--bundle", "/b", "--pid-file", "/b/init.pid", "id1"], "create", "/b", "id1",
     "/b/log.json"),
    ([*CTR, "--systemd-cgroup", "create", "--bundle", "/b", "--pid-file", "/b/init.pid",
      "--console-socket", "/tmp/s", "--no-pivot", "--no-new-keyring", "--preserve-fds", "2", "id1"],
     "create", "/b", "id1", "/b/log.json"),
    ([*CTR, "start", "id1"], "start", "", "id1", "/b/log.json"),
    ([*CTR, "state", "id1"], "state", "", "id1", "/b/log.json"),
    ([*CTR, "delete", "--force", "id1"], "delete", "", "id1", "/b/log.json"),
    ([*CTR, "kill", "--all", "id1", "9"], "kill", "", "id1", "/b/log.json"),
    ([*CTR, "exec", "--process", "/tmp/p.json", "--detach", "--pid-file", "/x", "id1"], "exec", "",
     "id1", "/b/log.json"),
    ([*CTR, "features"], "features", "", None, "/b/log.json"),
    ([*CTR, "ps", "--format", "json", "id1"], "ps", "", "id1", "/b/log.json"),
    ([*CTR, "update", "--resources=-", "id1"], "update", "", "id1", "/b/log.json"),
    # bundle flag forms
    (["create", "--bundle=/b", "id"], "create", "/b", "id", None),
    (["create", "-bundle", "/b", "id"], "create", "/b", "id", None),
    (["create", "-b", "/b", "id"], "create", "/b", "id", None),
    (["create", "-b=/b", "id"], "create", "/b", "id", None),
    (["create", "--bundle", "/b", "-b", "/c", "id"], "create", "/c", "id", None),  # last wins
    (["create", "id"], "create", "", "id", None),  # no flag: cwd
    (["create", "id", "--bundle", "/b"], "create", "/b", "id", None),  # urfave reorders
    # `create` as a flag value is not the subcommand
    (["--root", "create", "state", "create"], "state", "", "create", None),
    (["--log", "create", "--root=create", "delete", "x"], "delete", "", "x", "create"),
    (["-root", "create", "create", "--bundle", "create", "create"], "create", "create", "create",
     None),
    (["--root", "run", "kill", "run", "KILL"], "kill", "", "run", None),
    # docker (runtime v2 shim) and runc run
    (["--debug", "run", "-d", "--bundle", "/b", "id"], "run", "/b", "id", None),
    (["run", "--bundle", "/b", "--detach", "id"], "run", "/b", "id", None),
    (["run", "--", "id"], "run", "", "id", None),
    # Go's flag package drops a `--` that ends the global flags: the next is the subcommand
    (["--root", "/r", "--", "create", "--bundle", "/b", "id"], "create", "/b", "id", None),
    (["--", "--", "create"], "--", "", "create", None),
    (["--"], None, "", None, None),
    ([], None, "", None, None),
    (["--version"], None, "", None, None),
]


@pytest.mark.parametrize(("argv", "sub", "bundle", "cid", "log"), CASES)
def test_parse(argv: list[str], sub: str | None, bundle: str, cid: str | None,
               log: str | None) -> None:
    a = runc_argv.parse(argv)
    assert a.subcommand == sub
    assert a.bundle == bundle
    assert a.container_id == cid
    assert a.log == log
    assert a.creates == (sub in ("create", "run"))
    assert a.argv == argv  # passed on to runc untouched


def test_flags_details() -> None:
    a = runc_argv.parse([*CTR, "run", "-d", "--bundle", "/b", "id"])
    assert a.root == "/run/containerd/runc/k8s.io"
    assert a.log_format == "json"
    assert a.detach
    assert a.sub_index == len(CTR)
    assert not runc_argv.parse(["run", "--bundle", "/b", "id"]).detach


def test_bundle_dir() -> None:
    assert runc_argv.parse(["create", "id"]).bundle_dir("/x/y") == "/x/y"
    assert runc_argv.parse(["create", "-b", "rel", "id"]).bundle_dir("/x") == "/x/rel"
    assert runc_argv.parse(["create", "-b", "/abs/", "id"]).bundle_dir("/x") == "/abs"
    assert runc_argv.parse(["create", "-b", "create", "create"]).bundle_dir("/x") == "/x/create"


def test_passthrough_runtimes(tmp_path: Path) -> None:
    """What the Python passthrough (a launcher cache miss) runs: the config loader's
    answer, or the defaults with a warning naming the file."""
    from nvctk.runtime import passthrough

    cfg = tmp_path / "c.toml"
    env = {"NVCTK_CONFIG": str(cfg), "NVCTK_PASSTHROUGH_CACHE": str(tmp_path / "cache")}
    assert passthrough.runtimes(env) == (("runc", "crun"), None)  # absent: defaults
    cfg.write_text('runtimes = ["crun"]\n')
    assert passthrough.runtimes(env) == (("crun",), None)
    for broken in ("runtimes = [\n", 'runtimes = ["crun"]\nunknown-key = 1\n',
                   'runtimes = ["a"]\nruntimes = ["b"]\n'):
        cfg.write_text(broken)  # the loader refuses it: defaults and a warning
        rts, warning = passthrough.runtimes(env)
        assert rts == ("runc", "crun") and warning and str(cfg) in warning, broken
    cfg.write_text('runtimes = ["a\\tb"]\n')
    assert passthrough.runtimes(env) == (("a\tb",), None)


def _exe(p: Path) -> str:
    p.write_text("#!/bin/sh\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def test_find_runtime(tmp_path: Path) -> None:
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    me = _exe(d1 / "nvctk-runtime")
    os.symlink(me, d1 / "runc")  # "runc" that is really us: skipped
    real = _exe(d2 / "runc")
    crun = _exe(d2 / "crun")
    (d1 / "crun").write_text("not executable")
    path = f"{d1}:{d2}"
    own = runc_argv.self_paths(me)
    assert runc_argv.find_runtime(("runc", "crun"), path, own) == real
    assert runc_argv.find_runtime(("crun",), path, own) == crun
    assert runc_argv.find_runtime((str(d1 / "runc"), crun), path, own) == crun
    assert runc_argv.find_runtime(("nvctk-runtime",), path, own) is None
    assert runc_argv.find_runtime(("nope",), path, own) is None


@pytest.mark.parametrize("configured", [False, True])
def test_passthrough_imports_stay_light(tmp_path: Path, configured: bool) -> None:
    """The Python passthrough (a launcher cache miss) must not import
    json/tomllib/dataclasses (milliseconds each), neither without a config nor with one
    like the simulated host's (extra-mounts) that the config loader has parsed before
    (its parsed-config cache)."""
    import subprocess
    import sys

    from nvctk.base import config as nvconfig
    from nvctk.base import stamped
    from nvctk.base.config import Config, ExtraMount, render

    cfg = tmp_path / "config.toml"
    cfg.write_text(render(Config(runtimes=("crun",),
                                 extra_mounts=(ExtraMount("/a", "/b", True),))))
    with pytest.MonkeyPatch.context() as m:  # settled: the cache is written at once
        m.setattr(stamped, "RACY_NS", -(10**12))
        nvconfig.load_stat(str(cfg), {nvconfig.CACHE_VAR: str(tmp_path / "cache")})
    want = ("crun",) if configured else ("runc", "crun")
    code = (
        "import sys; import nvctk.cli.runtime as m; from nvctk.oci import runc_argv; from nvctk.runtime import passthrough;"
        "runc_argv.parse(['state','x']);"
        f"rts = passthrough.runtimes({{'NVCTK_CONFIG': {str(cfg if configured else '/nonexistent')!r},"
        f" 'NVCTK_PASSTHROUGH_CACHE': {str(tmp_path / 'cache')!r}}});"
        f"assert rts == ({want!r}, None), rts;"
        "bad=[n for n in ('json','tomllib','dataclasses','typing','click','re') "
        "if n in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
