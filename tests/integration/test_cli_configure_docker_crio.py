"""`nvctk configure` on Docker's daemon.json and CRI-O's drop-ins, run through the
installed `nvctk` command (real files, no daemons; the rest: test_cli_configure_containerd.py).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

import support.configure as _configure
from support.configure import COMMENTED, RUNTIME, Run, snapshot, toml

nv = _configure.nv  # fixture


# --- Docker -------------------------------------------------------------------------

DAEMON_JSON = """{
    "log-driver": "json-file",
    "log-opts": {
        "max-size": "10m"
    },
    "runtimes": {
        "crun": {
            "path": "/usr/bin/crun"
        }
    },
    "features": {
        "buildkit": true
    }
}
"""


def test_docker_keeps_other_keys_and_layout(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.json"
    cfg.write_text(DAEMON_JSON)
    args = ["--runtime", "docker", "--config", str(cfg), "--set-as-default", "--cdi"]
    res = nv(*args)
    assert res.returncode == 0, res.stderr
    assert "systemctl restart docker" in res.stdout
    got = json.loads(cfg.read_text())
    assert list(got) == ["log-driver", "log-opts", "runtimes", "features", "default-runtime"]
    assert got["runtimes"] == {"crun": {"path": "/usr/bin/crun"},
                               "nvidia": {"path": RUNTIME, "runtimeArgs": []}}
    assert got["features"] == {"buildkit": True, "cdi": True}
    assert got["default-runtime"] == "nvidia" and got["log-opts"] == {"max-size": "10m"}
    assert '\n    "log-driver"' in cfg.read_text()  # its 4-space indentation
    first = snapshot(cfg)
    assert nv(*args).returncode == 0 and snapshot(cfg) == first
    res = nv("--runtime", "docker", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == DAEMON_JSON


def test_docker_remove_refuses_foreign_runtime(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.json"
    text = '{"runtimes": {"nvidia": {"path": "nvidia-container-runtime", "args": []}}}'
    cfg.write_text(text)
    res = nv("--runtime", "docker", "--config", str(cfg), "--remove")
    assert res.returncode == 1 and "not nvctk's" in res.stderr
    assert cfg.read_text() == text


@pytest.mark.parametrize(("runtime", "name", "old", "edit"), [
    ("containerd", "config.toml", "pause:3.9", "pause:3.10"),
    ("docker", "daemon.json", "10m", "20m"),
])
def test_remove_after_user_edit_keeps_the_edit(nv: Run, tmp_path: Path, runtime: str, name: str,
                                               old: str, edit: str) -> None:
    text = COMMENTED if runtime == "containerd" else DAEMON_JSON
    cfg = tmp_path / name
    cfg.write_text(text)
    assert nv("--runtime", runtime, "--config", str(cfg), "--set-as-default").returncode == 0
    cfg.write_text(cfg.read_text().replace(old, edit))
    res = nv("--runtime", runtime, "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    # not byte-exact any more (no .bak matches): nvctk's runtime goes, the edit stays
    assert cfg.read_text() == text.replace(old, edit)


# --- CRI-O --------------------------------------------------------------------------

CRIO_CONF = """[crio]
[crio.runtime]
default_runtime = "runc"

[crio.runtime.runtimes.runc]
runtime_path = "/usr/libexec/crio/runc"
runtime_type = "oci"
runtime_root = "/run/runc"
monitor_path = "/usr/libexec/crio/conmon"
allowed_annotations = ["io.kubernetes.cri-o.Devices"]
"""


def test_crio_drop_in_has_the_documented_format(nv: Run, tmp_path: Path) -> None:
    """CRI-O is not in Debian 12: the drop-in is checked against CRI-O's documented
    crio.conf(5) keys, not loaded into a crio."""
    main = tmp_path / "crio.conf"
    main.write_text(CRIO_CONF)
    drop = tmp_path / "crio.conf.d" / "99-nvctk.toml"
    args = ["--runtime", "crio", "--config", str(main), "--drop-in", str(drop), "--set-as-default"]
    res = nv(*args)
    assert res.returncode == 0, res.stderr
    assert "systemctl restart crio" in res.stdout
    assert main.read_text() == CRIO_CONF
    assert toml(drop) == {"crio": {"runtime": {
        "default_runtime": "nvidia",
        "runtimes": {"nvidia": {
            "runtime_path": RUNTIME, "runtime_type": "oci",
            "monitor_path": "/usr/libexec/crio/conmon",
            "allowed_annotations": ["io.kubernetes.cri-o.Devices"]}}}}}
    first = snapshot(drop)
    assert nv(*args).returncode == 0 and snapshot(drop) == first
    res = nv("--runtime", "crio", "--config", str(main), "--drop-in", str(drop), "--remove")
    assert res.returncode == 0, res.stderr
    assert not drop.exists() and main.read_text() == CRIO_CONF


def test_crio_default_runtime_from_other_drop_ins(nv: Run, tmp_path: Path) -> None:
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    (d / "10-crun.toml").write_text('[crio.runtime]\ndefault_runtime = "crun"\n'
                                    '[crio.runtime.runtimes.crun]\nmonitor_env = ["A=1"]\n')
    drop = d / "99-nvctk.toml"
    res = nv("--runtime", "crio", "--config", str(tmp_path / "none.conf"), "--drop-in", str(drop))
    assert res.returncode == 0, res.stderr
    assert toml(drop)["crio"]["runtime"]["runtimes"]["nvidia"] == {
        "runtime_path": RUNTIME, "runtime_type": "oci", "monitor_env": ["A=1"]}


def test_crio_default_runtime_settings_come_whole_from_the_last_file_defining_it(
        nv: Run, tmp_path: Path) -> None:
    """CRI-O takes a runtime's table whole from the last file that defines it (the real
    CRI-O 1.36.3: a drop-in with only runc's monitor_env leaves its runtime_path empty),
    so nvctk's runtime copies the drop-in's settings of runc, not crio.conf's as well."""
    main = tmp_path / "crio.conf"
    main.write_text('[crio.runtime]\ndefault_runtime = "runc"\n[crio.runtime.runtimes.runc]\n'
                    'runtime_path = "/usr/bin/runc"\nmonitor_path = "/usr/libexec/conmon"\n')
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    (d / "10-runc.toml").write_text('[crio.runtime.runtimes.runc]\nmonitor_env = ["A=1"]\n')
    drop = d / "99-nvctk.toml"
    res = nv("--runtime", "crio", "--config", str(main), "--drop-in", str(drop))
    assert res.returncode == 0, res.stderr
    assert toml(drop)["crio"]["runtime"]["runtimes"]["nvidia"] == {
        "runtime_path": RUNTIME, "runtime_type": "oci", "monitor_env": ["A=1"]}


# drop-ins that CRI-O reads after nvctk's 99-nvctk.toml and that win its merge
CRIO_OVERRIDES = {
    "runtime_path": ("zz-other.toml",
                     '[crio.runtime.runtimes.nvidia]\nruntime_path = "/usr/bin/runc"\n', []),
    "runtime_type": ("99-remote.toml",  # "99-r" sorts after "99-n"
                     '[crio.runtime.runtimes.nvidia]\nruntime_type = "vm"\n', []),
    "default_runtime": ("zz-default.toml", '[crio.runtime]\ndefault_runtime = "runc"\n',
                        ["--set-as-default"]),
}


@pytest.mark.parametrize("key", list(CRIO_OVERRIDES))
@pytest.mark.parametrize("present", [False, True])
def test_crio_drop_in_overridden_by_a_later_one_fails_naming_it(
        nv: Run, tmp_path: Path, key: str, present: bool) -> None:
    """Before: configure said "created" and exited 0 while CRI-O ran another runtime
    under nvctk's name (it only asked whether the files load). Now it reads the merged
    result (`crio config` where CRI-O is installed, the files key by key otherwise), and
    fails naming the file that wins, nvctk's drop-in as it was; also when nvctk's own
    drop-in is already in place and nothing would be written."""
    name, text, extra = CRIO_OVERRIDES[key]
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    drop = d / "99-nvctk.toml"
    args = ["--runtime", "crio", "--config", str(tmp_path / "none.conf"), "--drop-in", str(drop),
            *extra]
    if present:
        assert nv(*args).returncode == 0
    before = drop.read_bytes() if present else None
    (d / name).write_text(text)
    res = nv(*args)
    assert res.returncode == 1, res.stdout
    assert str(d / name) in res.stderr and key in res.stderr and "Traceback" not in res.stderr, \
        res.stderr
    assert (drop.read_bytes() if drop.exists() else None) == before
    # the same drop-in read before nvctk's loses to it: fine
    (d / name).rename(d / f"00-{name}")
    res = nv(*args)
    assert res.returncode == 0, res.stderr


def test_main_py_registers_configure(run_nvctk: Run) -> None:
    res = run_nvctk("configure", "--help")
    assert res.returncode == 0 and "--set-as-default" in res.stdout and "--remove" in res.stdout


def test_written_file_keeps_mode(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.json"
    cfg.write_text("{}\n")
    cfg.chmod(0o600)
    assert nv("--runtime", "docker", "--config", str(cfg)).returncode == 0
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "daemon.json.bak").stat().st_mode) == 0o600
