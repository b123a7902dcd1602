"""`nvctk configure` against broken inputs: bad, special, immutable, read-only or odd
files are refused untouched with a clear error; dry runs write nothing (real files, no
daemons; the rest: test_cli_configure_containerd.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import support.configure as _configure
from support.configure import COMMENTED, RUNTIME, V2, Run, cri_runtime, toml

nv = _configure.nv  # fixture

try:
    import tomllib  # an independent parser checks tomlkit's output
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


# --- broken inputs ------------------------------------------------------------------


@pytest.mark.parametrize("engine,text,where", [
    ("containerd", 'version = 2\n[grpc]\n  address = \n', "line 3"),
    ("containerd", 'version = 7\n', "unknown containerd config version 7"),
    ("containerd", 'version = 2\n[plugins]\n"io.containerd.grpc.v1.cri" = 5\n', "not a table"),
    ("docker", '{\n  "debug": true,\n  "runtimes": {\n}\n,}\n', "line 5 column 2"),
    ("docker", '["not", "an", "object"]\n', "not a JSON object"),
    ("docker", '{"runtimes": []}', "'runtimes' is not a JSON object"),
])
def test_bad_file_is_refused_untouched(nv: Run, tmp_path: Path, engine: str, text: str,
                                       where: str) -> None:
    cfg = tmp_path / "cfg"
    cfg.write_text(text)
    res = nv("--runtime", engine, "--config", str(cfg))
    assert res.returncode == 1
    assert where in res.stderr and str(cfg) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert cfg.read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["cfg"]


@pytest.mark.parametrize("engine", ["containerd", "docker", "crio"])
def test_directory_is_refused(nv: Run, tmp_path: Path, engine: str) -> None:
    flag = "--drop-in" if engine == "crio" else "--config"
    res = nv("--runtime", engine, flag, str(tmp_path))
    assert res.returncode == 1
    assert f"{tmp_path}: is a directory" in res.stderr, res.stderr


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    if os.geteuid() != 0 or not shutil.which("chattr"):
        pytest.skip("needs root and chattr")
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable flag")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("engine,text", [("containerd", COMMENTED), ("docker", '{"debug": true}\n')])
def test_immutable_file_gives_clear_error(nv: Run, tmp_path: Path, engine: str, text: str) -> None:
    cfg = tmp_path / "cfg"
    cfg.write_text(text)
    with immutable(cfg):
        res = nv("--runtime", engine, "--config", str(cfg))
    assert res.returncode == 1
    assert f"cannot write {cfg}: Operation not permitted" in res.stderr, res.stderr
    assert cfg.read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["cfg"]


def test_read_only_mount_gives_clear_error(nv: Run, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    d = tmp_path / "ro"
    d.mkdir()
    cfg = d / "daemon.json"
    cfg.write_text('{"debug": true}\n')
    subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True)
        res = nv("--runtime", "docker", "--config", str(cfg))
        assert res.returncode == 1
        assert f"cannot write {cfg}: Read-only file system" in res.stderr, res.stderr
        assert cfg.read_text() == '{"debug": true}\n'
    finally:
        subprocess.run(["umount", str(d)], check=True)
    assert os.listdir(d) == ["daemon.json"]


def test_unwritable_directory_as_user() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    import tempfile

    from support.exe import nvctk_exe

    # pytest's tmp dirs are root-only (0700): a directory the user can read, not write
    d = Path(tempfile.mkdtemp(prefix="nvctk-cfg-", dir="/tmp"))
    try:
        d.chmod(0o755)
        cfg = d / "daemon.json"
        cfg.write_text("{}\n")
        cfg.chmod(0o644)
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              *nvctk_exe(), "configure", "--runtime", "docker", "--config",
                              str(cfg), "--runtime-path", RUNTIME],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 1
        assert f"cannot write {cfg}: Permission denied" in res.stderr, res.stderr
        assert cfg.read_text() == "{}\n" and os.listdir(d) == ["daemon.json"]
    finally:
        shutil.rmtree(d)


def test_dry_run_prints_and_writes_nothing(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(COMMENTED)
    res = nv("--runtime", "containerd", "--config", str(cfg), "--dry-run", "--set-as-default")
    assert res.returncode == 0, res.stderr
    assert os.listdir(tmp_path) == ["config.toml"] and cfg.read_text() == COMMENTED
    assert cri_runtime(tomllib.loads(res.stdout))["options"]["BinaryName"] == RUNTIME
    assert "nothing written" in res.stderr
    res = nv("--runtime", "docker", "--config", str(tmp_path / "none.json"), "--dry-run")
    assert json.loads(res.stdout) == {"runtimes": {"nvidia": {"path": RUNTIME, "runtimeArgs": []}}}
    assert not (tmp_path / "none.json").exists()


def test_runtime_path_default_and_checks(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.json"
    res = nv("--runtime", "docker", "--config", str(cfg), "--runtime-path", "/nonexistent/rt")
    assert res.returncode == 1 and "--runtime-path /nonexistent/rt: no such file" in res.stderr
    plain = tmp_path / "plain"
    plain.write_text("")
    res = nv("--runtime", "docker", "--config", str(cfg), "--runtime-path", str(plain))
    assert res.returncode == 1 and "not executable" in res.stderr
    # the default: the nvctk-runtime beside the nvctk that runs, absolute
    assert nv("--runtime", "docker", "--config", str(cfg)).returncode == 0
    assert json.loads(cfg.read_text())["runtimes"]["nvidia"]["path"] == RUNTIME


@pytest.mark.parametrize("engine", ["containerd", "docker", "crio"])
@pytest.mark.parametrize("kind", ["chardev", "fifo", "link-to-chardev"])
def test_special_file_is_refused_untouched(nv: Run, tmp_path: Path, engine: str,
                                           kind: str) -> None:
    """A device or FIFO as the config: a clear error, nothing written (configure's
    rename used to turn /dev/null into a regular file; a FIFO hung the read)."""
    special = tmp_path / "special"
    if kind == "fifo":
        os.mkfifo(special)
    else:
        os.mknod(special, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    path = special
    if kind == "link-to-chardev":
        path = tmp_path / "link"
        path.symlink_to(special)
    flag = "--drop-in" if engine == "crio" else "--config"
    res = subprocess.run(  # a hang is a failure, not a stuck suite
        [os.path.join(os.path.dirname(sys.executable), "nvctk"), "configure", "--runtime", engine,
         flag, str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert "not a regular file" in res.stderr and str(path) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    st = os.stat(special)
    assert stat.S_ISFIFO(st.st_mode) if kind == "fifo" else stat.S_ISCHR(st.st_mode)
    assert sorted(os.listdir(tmp_path)) == sorted(["special"] + (["link"] if path != special else []))


@pytest.mark.parametrize("text,why", [
    ("[" * 100000, "nested too deeply"),
    ('{"a": ' + "1" * 5000 + "}", "invalid JSON"),
    ('{"a": NaN}', "NaN is not JSON"),
    ('{"a": -Infinity}', "-Infinity is not JSON"),
    # numbers Python reads and dockerd (Go: a float64) does not: written back, they were
    # Infinity / -Infinity (no JSON), or digits dockerd refuses to start on
    ('{"a": [[1, [1e400]]]}', "the number 1e400 is beyond a 64-bit float"),
    ('{"log-opts": {"x": [{"y": [-1e400]}]}}', "the number -1e400 is beyond"),
    ('{"a": [[1E+309]]}', "the number 1E+309 is beyond"),
    ('{"a": [[' + "9" * 400 + "]]}", "is beyond a 64-bit float"),
    ('{"a": [-' + "1" * 310 + "]}", "is beyond a 64-bit float"),
    ('{"a": [[NaN]]}', "NaN is not JSON"),
])
def test_docker_odd_json_is_refused_untouched(nv: Run, tmp_path: Path, text: str, why: str) -> None:
    cfg = tmp_path / "daemon.json"
    cfg.write_text(text)
    res = nv("--runtime", "docker", "--config", str(cfg))
    assert res.returncode == 1, res.stderr
    assert why in res.stderr and str(cfg) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert cfg.read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["daemon.json"]


@pytest.mark.parametrize("number", ["1e400", "-1e400", "9" * 400])
def test_docker_remove_never_writes_back_a_number_dockerd_refuses(
        nv: Run, tmp_path: Path, number: str) -> None:
    """configure replaced someone else's runtime "nvidia" (kept in daemon.json.bak);
    remove puts it back, but not a value dockerd would refuse: a .bak whose entry holds
    one is no help, and only nvctk's entry goes."""
    cfg = tmp_path / "daemon.json"
    cfg.write_text(json.dumps({"runtimes": {"nvidia": {"path": "/usr/bin/other"}}}) + "\n")
    assert nv("--runtime", "docker", "--config", str(cfg)).returncode == 0
    bak = tmp_path / "daemon.json.bak"
    bak.write_text('{"runtimes": {"nvidia": {"path": "/usr/bin/other", '
                   f'"runtimeArgs": [[{number}]]}}}}}}\n')
    res = nv("--runtime", "docker", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    text = cfg.read_text()
    assert "Infinity" not in text and number not in text
    assert json.loads(text) == {}


def test_docker_remove_keeps_a_hand_written_file(nv: Run, tmp_path: Path) -> None:
    """A daemon.json configure did not create (no .bak) loses only nvctk's entries."""
    cfg = tmp_path / "daemon.json"
    cfg.write_text(json.dumps({"default-runtime": "nvidia",
                               "runtimes": {"nvidia": {"path": RUNTIME}}}) + "\n")
    res = nv("--runtime", "docker", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert json.loads(cfg.read_text()) == {}


def test_containerd_remove_keeps_a_hand_written_file(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'version = 2\n[{V2}.containerd.runtimes.nvidia]\n'
                   '  runtime_type = "io.containerd.runc.v2"\n'
                   f'[{V2}.containerd.runtimes.nvidia.options]\n  BinaryName = "{RUNTIME}"\n')
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert toml(cfg) == {"version": 2}
