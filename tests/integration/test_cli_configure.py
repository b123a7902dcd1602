"""`nvctk configure`: the edits to containerd's, Docker's and CRI-O's files, run
through the installed `nvctk` command (real files, no daemons: test_configure_engines.py
loads the results into the real containerd and dockerd)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    import tomllib  # an independent parser checks tomlkit's output
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

RUNTIME = os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")
V2 = 'plugins."io.containerd.grpc.v1.cri"'
Run = Callable[..., subprocess.CompletedProcess[str]]

COMMENTED = f"""# containerd config of this host (hand-written)
version = 2
root = "/var/lib/containerd" # state lives here

[grpc]
  address = "/run/containerd/containerd.sock"

# CRI settings
[{V2}]
  sandbox_image = "registry.k8s.io/pause:3.9"   # pinned

  [{V2}.containerd]
    default_runtime_name = "runc"  # the default

    [{V2}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [{V2}.containerd.runtimes.runc.options]
        SystemdCgroup = true  # cgroups through systemd

# trailing comment
[metrics]
  address = ""
"""


@pytest.fixture
def nv(run_nvctk: Run) -> Run:
    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run_nvctk("configure", *args, env=env)

    return run


def toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def cri_runtime(doc: dict, name: str = "nvidia", plugin: str = "io.containerd.grpc.v1.cri") -> dict:
    return doc["plugins"][plugin]["containerd"]["runtimes"][name]


def snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


# --- containerd ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_v2(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """`containerd config default` of the installed containerd (1.6: version 2)."""
    if not shutil.which("containerd"):
        pytest.skip("containerd not installed")
    return subprocess.run(["containerd", "config", "default"], capture_output=True,
                          check=True).stdout


def test_containerd_default_config_gets_runtime_with_copied_options(
        nv: Run, tmp_path: Path, default_v2: bytes) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_bytes(default_v2)
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert "systemctl restart containerd" in res.stdout
    doc = toml(cfg)
    rt = cri_runtime(doc)
    runc = cri_runtime(doc, "runc")
    assert rt["runtime_type"] == "io.containerd.runc.v2"
    assert rt["options"]["BinaryName"] == RUNTIME
    # every other option and runtime setting is runc's
    assert {k: v for k, v in rt["options"].items() if k != "BinaryName"} == \
        {k: v for k, v in runc["options"].items() if k != "BinaryName"}
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "runc"
    # the original text is untouched around the insertion, and kept as .bak
    assert (tmp_path / "config.toml.bak").read_bytes() == default_v2
    new = cfg.read_bytes()
    assert new.startswith(default_v2[: default_v2.index(b"[plugins.\"io.containerd.grpc.v1.cri\".containerd.untrusted")])
    assert len(new) > len(default_v2)


def test_containerd_second_run_changes_no_byte_and_remove_restores(
        nv: Run, tmp_path: Path, default_v2: bytes) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_bytes(default_v2)
    args = ["--runtime", "containerd", "--config", str(cfg), "--set-as-default", "--cdi"]
    assert nv(*args).returncode == 0
    doc = toml(cfg)
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "nvidia"
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["enable_cdi"] is True
    first, bak = snapshot(cfg), snapshot(tmp_path / "config.toml.bak")
    res = nv(*args)
    assert res.returncode == 0 and "nothing written" in res.stdout, res.stdout
    assert snapshot(cfg) == first and snapshot(tmp_path / "config.toml.bak") == bak
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_bytes() == default_v2


def test_containerd_keeps_comments_and_order(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(COMMENTED)
    assert nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default").returncode == 0
    new = cfg.read_text()
    # the original lines, in order, are all still there (one value changed)
    expected = COMMENTED.replace('default_runtime_name = "runc"', 'default_runtime_name = "nvidia"')
    it = iter(new.splitlines())
    assert all(line in it for line in expected.splitlines()), new
    rt = cri_runtime(tomllib.loads(new))
    assert rt["options"] == {"BinaryName": RUNTIME, "SystemdCgroup": True}
    # the new tables sit with the runtimes, indented like runc's
    assert f'\n    [{V2}.containerd.runtimes.nvidia]\n      runtime_type = "io.containerd.runc.v2"\n' in new
    assert new.index("runtimes.nvidia]") < new.index("# trailing comment")
    assert nv("--runtime", "containerd", "--config", str(cfg), "--remove").returncode == 0
    assert cfg.read_text() == COMMENTED


def test_containerd_remove_refuses_a_foreign_runtime_of_that_name(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    text = COMMENTED + (f'\n[{V2}.containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n'
                        f'[{V2}.containerd.runtimes.nvidia.options]\n'
                        '  BinaryName = "/usr/bin/nvidia-container-runtime"\n')
    cfg.write_text(text)
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 1
    assert "not nvctk's" in res.stderr and "nvidia-container-runtime" in res.stderr, res.stderr
    assert cfg.read_text() == text and not (tmp_path / "config.toml.bak").exists()


def test_containerd_replaces_a_foreign_runtime_and_says_so(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'version = 2\n[{V2}.containerd.runtimes.nvidia.options]\n'
                   '  BinaryName = "/usr/bin/nvidia-container-runtime" # old toolkit\n')
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert "nvidia-container-runtime" in res.stdout and "now runs" in res.stdout
    rt = cri_runtime(toml(cfg))
    assert rt == {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": RUNTIME},
                  "container_annotations": ["cdi.k8s.io/*", "nvctk.io/*"]}
    assert "# old toolkit" in cfg.read_text()


def test_containerd_version1_file_uses_plugin_cri(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[plugins.cri.containerd.runtimes.runc.options]\n  SystemdCgroup = true\n')
    assert nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default").returncode == 0
    doc = toml(cfg)
    assert "version" not in doc
    assert cri_runtime(doc, plugin="cri")["options"] == {"BinaryName": RUNTIME, "SystemdCgroup": True}
    assert doc["plugins"]["cri"]["containerd"]["default_runtime_name"] == "nvidia"


V3_KEYS_DOC = """version = 3
[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  SystemdCgroup = true
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
"""


def check_v3(doc: dict, default: str) -> None:
    """A v3 config as containerd 2.x documents it (containerd 1.6 here cannot load v3):
    runtimes and default_runtime_name under io.containerd.cri.v1.runtime's
    `containerd` table, enable_cdi on the plugin table, no v2 plugin key."""
    assert doc["version"] == 3
    plugin = doc["plugins"]["io.containerd.cri.v1.runtime"]
    assert "io.containerd.grpc.v1.cri" not in doc["plugins"]
    rt = plugin["containerd"]["runtimes"]["nvidia"]
    assert rt["runtime_type"] == "io.containerd.runc.v2"
    assert rt["options"]["BinaryName"] == RUNTIME
    assert plugin["containerd"]["default_runtime_name"] == default
    assert plugin["enable_cdi"] is True


def test_containerd_version3_file(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(V3_KEYS_DOC)
    assert nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default",
              "--cdi").returncode == 0
    doc = toml(cfg)
    check_v3(doc, "nvidia")
    assert doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["nvidia"][
        "options"]["SystemdCgroup"] is True
    assert doc["plugins"]["io.containerd.cri.v1.images"] == {"snapshotter": "overlayfs"}
    assert nv("--runtime", "containerd", "--config", str(cfg), "--remove").returncode == 0
    assert cfg.read_text() == V3_KEYS_DOC


def test_v3_example_has_the_documented_keys() -> None:
    text = (Path(__file__).parents[2] / "containerd-config.v3.toml.example").read_text()
    doc = tomllib.loads(text.replace("/usr/bin/nvctk-runtime", RUNTIME))
    uncommented = tomllib.loads(
        doc_text := "\n".join(line[2:] if line.startswith("# [") or line.startswith("#   ")
                              else line for line in text.splitlines())
        .replace("/usr/bin/nvctk-runtime", RUNTIME))
    assert doc_text
    check_v3(uncommented, "nvidia")
    assert doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["nvidia"] == {
        "runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": RUNTIME}}


@pytest.fixture
def fake_containerd(tmp_path: Path) -> Callable[[str], dict[str, str]]:
    """PATH with a `containerd` whose --version says `version` (the version detection
    runs the real binary when there is no fake)."""
    def make(version: str) -> dict[str, str]:
        d = tmp_path / f"bin-{version}"
        d.mkdir(exist_ok=True)
        exe = d / "containerd"
        exe.write_text(f"#!/bin/sh\necho 'containerd github.com/containerd/containerd/v2 "
                       f"v{version} 0000'\n")
        exe.chmod(0o755)
        return {**os.environ, "PATH": f"{d}:{os.environ['PATH']}"}
    return make


def test_containerd_missing_file_is_v2_on_containerd_1(nv: Run, tmp_path: Path,
                                                        fake_containerd: Callable) -> None:
    cfg = tmp_path / "sub" / "config.toml"
    res = nv("--runtime", "containerd", "--config", str(cfg), env=fake_containerd("1.7.2"))
    assert res.returncode == 0, res.stderr
    doc = toml(cfg)
    assert doc["version"] == 2 and cri_runtime(doc)["options"] == {"BinaryName": RUNTIME}
    assert "created" in res.stdout
    # remove: the file held nothing else, so it goes (kept as .bak)
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert not cfg.exists() and (tmp_path / "sub" / "config.toml.bak").exists()


def test_containerd_empty_file_is_v3_on_containerd_2(nv: Run, tmp_path: Path,
                                                      fake_containerd: Callable) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default", "--cdi",
             env=fake_containerd("2.0.4"))
    assert res.returncode == 0, res.stderr
    check_v3(toml(cfg), "nvidia")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove", "--set-as-default",
             "--cdi", env=fake_containerd("2.0.4"))
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == ""


def test_containerd_drop_in_carries_the_cri_table_before_2_1(nv: Run, tmp_path: Path) -> None:
    if not shutil.which("containerd"):
        pytest.skip("containerd not installed")
    cfg = tmp_path / "config.toml"
    cfg.write_text(COMMENTED)
    drop = tmp_path / "conf.d" / "99-nvctk.toml"
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop))
    assert res.returncode == 0, res.stderr
    assert "carries a copy" in res.stdout
    main = toml(cfg)
    assert main["imports"] == [f"{tmp_path}/conf.d/*.toml"]
    # the main file changed only by its imports line
    assert cfg.read_text().replace(f'imports = ["{tmp_path}/conf.d/*.toml"]\n', "") == COMMENTED
    di = toml(drop)
    assert di["version"] == 2
    cri = di["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.9"
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert cri["containerd"]["runtimes"]["nvidia"]["options"] == {
        "BinaryName": RUNTIME, "SystemdCgroup": True}
    again = (cfg.read_bytes(), drop.read_bytes())
    assert nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop)).returncode == 0
    assert (cfg.read_bytes(), drop.read_bytes()) == again
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == COMMENTED and not drop.exists()


def test_containerd_drop_in_only_runtime_from_2_1(nv: Run, tmp_path: Path,
                                                  fake_containerd: Callable) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(V3_KEYS_DOC)
    drop = tmp_path / "conf.d" / "nvctk.toml"
    env = fake_containerd("2.1.0")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop), env=env)
    assert res.returncode == 0, res.stderr
    di = toml(drop)
    assert di == {"version": 3, "plugins": {"io.containerd.cri.v1.runtime": {"containerd": {
        "runtimes": {"nvidia": {"runtime_type": "io.containerd.runc.v2",
                                "container_annotations": ["cdi.k8s.io/*", "nvctk.io/*"],
                                "options": {"BinaryName": RUNTIME, "SystemdCgroup": True}}}}}}}


def test_containerd_drop_in_refused_for_version1(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[plugins.cri]\n  sandbox_image = \"x\"\n")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(tmp_path / "d.toml"))
    assert res.returncode == 1 and "version 1" in res.stderr
    assert not (tmp_path / "d.toml").exists()


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


def _foreign_nvidia(engine: str, tmp_path: Path) -> tuple[Path, str]:
    """The engine's config file under tmp_path, written with a runtime "nvidia" of
    NVIDIA's toolkit (someone else's), and its text."""
    if engine == "containerd":
        cfg = tmp_path / "config.toml"
        text = (f'version = 2\n[{V2}.containerd.runtimes.nvidia]\n'
                '  runtime_type = "io.containerd.runc.v2"\n'
                f'[{V2}.containerd.runtimes.nvidia.options]\n'
                '  BinaryName = "/usr/bin/nvidia-container-runtime"\n')
    else:
        cfg = tmp_path / "daemon.json"
        text = '{"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}}}\n'
    cfg.write_text(text)
    return cfg, text


@pytest.mark.parametrize("engine", ["containerd", "docker"])
def test_remove_restores_the_foreign_runtime_configure_replaced(nv: Run, tmp_path: Path,
                                                                 engine: str) -> None:
    cfg, text = _foreign_nvidia(engine, tmp_path)
    res = nv("--runtime", engine, "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert RUNTIME in cfg.read_text()
    res = nv("--runtime", engine, "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == text


# --- remove puts back what configure replaced, even after a hand edit -------


def _edit_by_hand(cfg: Path, line: str) -> None:
    text = cfg.read_text()
    cfg.write_text(text + line if not text.rstrip().endswith("}") else text)


@pytest.mark.parametrize("cdi", [False, True])
def test_containerd_remove_after_edit_restores_the_previous_default(nv: Run, tmp_path: Path,
                                                                    cdi: bool) -> None:
    cfg = tmp_path / "config.toml"
    text = (f'version = 2\n[{V2}]\n  enable_cdi = false\n[{V2}.containerd]\n'
            '  default_runtime_name = "crun"\n'
            f'[{V2}.containerd.runtimes.crun]\n  runtime_type = "io.containerd.runc.v2"\n'
            f'[{V2}.containerd.runtimes.crun.options]\n  BinaryName = "/usr/bin/crun"\n')
    cfg.write_text(text)
    args = ["--runtime", "containerd", "--config", str(cfg), "--set-as-default"]
    assert nv(*args, *(["--cdi"] if cdi else [])).returncode == 0
    doc = toml(cfg)
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "nvidia"
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["enable_cdi"] is cdi
    # a hand edit: the .bak no longer matches, and a later configure run overwrote it
    cfg.write_text(cfg.read_text() + "# edited by hand\n")
    assert nv(*args, "--cdi").returncode == 0
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert "set back to 'crun'" in res.stdout, res.stdout
    # every key configure changed is as it was: only the hand edit remains
    assert toml(cfg) == tomllib.loads(text)
    assert cfg.read_text().endswith("# edited by hand\n")


def test_docker_remove_after_edit_restores_the_previous_default(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.json"
    orig = {"default-runtime": "crun", "runtimes": {"crun": {"path": "/usr/bin/crun"}}}
    cfg.write_text(json.dumps(orig, indent=2) + "\n")
    assert nv("--runtime", "docker", "--config", str(cfg), "--set-as-default").returncode == 0
    assert json.loads(cfg.read_text())["default-runtime"] == "nvidia"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "debug": True}, indent=2) + "\n")
    res = nv("--runtime", "docker", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert json.loads(cfg.read_text()) == {**orig, "debug": True}


def test_crio_remove_restores_a_default_it_replaced_in_the_drop_in(nv: Run, tmp_path: Path) -> None:
    main = tmp_path / "crio.conf"
    main.write_text("[crio.runtime]\ndefault_runtime = \"runc\"\n")
    drop = tmp_path / "crio.conf.d" / "50-site.toml"
    drop.parent.mkdir()
    text = '[crio.runtime]\ndefault_runtime = "kata"\n[crio.runtime.runtimes.kata]\n' \
           'runtime_path = "/usr/bin/kata-runtime"\n'
    drop.write_text(text)
    args = ["--runtime", "crio", "--config", str(main), "--drop-in", str(drop)]
    assert nv(*args, "--set-as-default").returncode == 0
    assert tomllib.loads(drop.read_text())["crio"]["runtime"]["default_runtime"] == "nvidia"
    drop.write_text(drop.read_text() + "# edited\n")
    res = nv(*args, "--remove")
    assert res.returncode == 0, res.stderr
    assert tomllib.loads(drop.read_text()) == tomllib.loads(text)


# --- every TOML shape: handled or refused clearly, never a traceback -------


@pytest.mark.parametrize("text,why", [
    ('version = 2\nplugins = {"io.containerd.grpc.v1.cri" = {sandbox_image = "x"}}\n',
     "plugins is an inline table"),
    (f'version = 2\n[{V2}]\ncontainerd = {{default_runtime_name = "runc"}}\n',
     "containerd is an inline table"),
    (f'version = 2\n[{V2}.containerd]\nruntimes = {{runc = {{runtime_type = "io.containerd.runc.v2"}}}}\n',
     "runtimes is an inline table"),
    ('version = 2\n[[plugins]]\nx = 1\n', "plugins is an array of tables"),
    (f'version = 2\n[{V2}.containerd]\n[[{V2}.containerd.runtimes]]\nx = 1\n',
     "runtimes is an array of tables"),
    # one table's parts split by another table: tomlkit cannot place a new one there
    (f'version = 2\n[{V2}.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n'
     f'[metrics]\naddress = ""\n[{V2}.containerd.runtimes.runc.options]\nSystemdCgroup = true\n',
     "cannot edit this layout"),
    # top-level dotted keys: the runtime's new table is fine (checked), but the default
    # would land in that table: refused, not written
    (f'version = 2\n{V2}.containerd.runtimes.runc.runtime_type = "io.containerd.runc.v2"\n',
     "cannot edit this layout safely"),
])
def test_containerd_unusual_toml_shapes_are_refused_clearly(nv: Run, tmp_path: Path, text: str,
                                                            why: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    for extra in ([] if "safely" in why else [[]]) + [["--set-as-default", "--cdi"]]:
        res = nv("--runtime", "containerd", "--config", str(cfg), *extra)
        assert res.returncode == 1, res.stdout
        assert why in res.stderr and str(cfg) in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        assert cfg.read_text() == text and os.listdir(tmp_path) == ["config.toml"]


@pytest.mark.parametrize("text", [
    # dotted keys inside a table, a runtime as an inline table
    f'version = 2\n[{V2}.containerd.runtimes]\nrunc.runtime_type = "io.containerd.runc.v2"\n'
    'runc.options.SystemdCgroup = true\n',
    f'version = 2\n[{V2}.containerd.runtimes]\nrunc = {{runtime_type = "io.containerd.runc.v2", '
    'options = {SystemdCgroup = true}}\n',
])
def test_containerd_other_shapes_are_handled(nv: Run, tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    args = ["--runtime", "containerd", "--config", str(cfg), "--set-as-default", "--cdi"]
    res = nv(*args)
    assert res.returncode == 0, res.stderr
    doc = toml(cfg)
    assert cri_runtime(doc)["options"] == {"BinaryName": RUNTIME, "SystemdCgroup": True}
    assert nv(*args).stdout.count("nothing written") == 1
    cfg.write_text(cfg.read_text() + "# edited\n")  # remove without the .bak's help
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert toml(cfg) == tomllib.loads(text)


def test_containerd_annotations_for_the_node_never_as_pod_annotations(nv: Run, tmp_path: Path) -> None:
    """The device plugin's nvctk.io/ limits travel as container annotations (only the
    kubelet sets those); a Pod's author writes Pod annotations, so no pattern that lets
    nvctk.io/ through is copied into nvctk's runtime, nor kept on an existing entry."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'version = 2\n[{V2}.containerd.runtimes.runc]\n'
                   '  runtime_type = "io.containerd.runc.v2"\n'
                   '  pod_annotations = ["nvctk.io/*", "*/*", "example.com/*", "*"]\n'
                   '  container_annotations = ["example.com/x"]\n')
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0 and "no longer passes nvctk's own annotations" in res.stdout
    rt = cri_runtime(toml(cfg))
    # Go's path.Match: * stops at /, so "*" passes no nvctk.io/ key (the edit record's
    # nvctk.io/edits included): kept
    assert rt["pod_annotations"] == ["example.com/*", "*"]
    assert rt["container_annotations"] == ["example.com/x", "cdi.k8s.io/*", "nvctk.io/*"]
    # an existing entry (an older nvctk's, or edited) gets the same
    text = cfg.read_text().replace('container_annotations = ["example.com/x", "cdi.k8s.io/*", '
                                   '"nvctk.io/*"]', 'pod_annotations = ["nvctk.io/*"]', 1)
    text = text.replace('pod_annotations = ["example.com/*", "*"]\n', "", 1)
    cfg.write_text(text)
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0 and "no longer passes nvctk's own annotations" in res.stdout, \
        res.stdout
    rt = cri_runtime(toml(cfg))
    assert rt["pod_annotations"] == [] and "nvctk.io/*" in rt["container_annotations"]


@pytest.mark.parametrize("pattern", ["*/*", "nvctk.*/*", "nvctk.io/*", "nvctk.io/edits",
                                     "nvctk.?o/edit?", "nvctk.io/other", "nvctk.io/vgpu.*"])
@pytest.mark.parametrize("existing", [False, True])
def test_containerd_pod_annotations_never_pass_nvctks_edit_record(
        nv: Run, tmp_path: Path, pattern: str, existing: bool) -> None:
    """runc's pod_annotations = ["*"] copied into nvctk's runtime let any Pod set
    nvctk.io/edits (another container's record, replayed): no pattern that passes one
    of nvctk's own annotations reaches nvctk's runtime, copied from runc or already on
    it, and configure says which it dropped."""
    cfg = tmp_path / "config.toml"
    nvidia = (f'[{V2}.containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n'
              f'  pod_annotations = ["example.com/*", "{pattern}"]\n'
              f'  [{V2}.containerd.runtimes.nvidia.options]\n    BinaryName = "{RUNTIME}"\n'
              if existing else "")
    cfg.write_text(f'version = 2\n[{V2}.containerd.runtimes.runc]\n'
                   '  runtime_type = "io.containerd.runc.v2"\n'
                   f'  pod_annotations = ["example.com/*", "{pattern}"]\n' + nvidia)
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert "no longer passes nvctk's own annotations" in res.stdout and pattern in res.stdout
    assert cri_runtime(toml(cfg))["pod_annotations"] == ["example.com/*"]
    assert toml(cfg)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"][
        "pod_annotations"] == ["example.com/*", pattern]  # runc's own: not nvctk's to judge


@pytest.mark.parametrize("engine", ["containerd", "docker"])
def test_remove_after_edit_restores_the_foreign_runtime_configure_replaced(
        nv: Run, tmp_path: Path, engine: str) -> None:
    """As above, but the file was edited by hand since: the .bak no longer matches, and
    the runtime configure replaced still comes back (not deleted with nvctk's)."""
    cfg, text = _foreign_nvidia(engine, tmp_path)
    parse = tomllib.loads if engine == "containerd" else json.loads
    assert nv("--runtime", engine, "--config", str(cfg)).returncode == 0
    edited = cfg.read_text().replace("{", '{"debug": true, ', 1) if engine == "docker" \
        else cfg.read_text() + "# edited\n"
    cfg.write_text(edited)
    res = nv("--runtime", engine, "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert "back to the one configure replaced" in res.stdout, res.stdout
    want = parse(text)
    if engine == "docker":
        want = {"debug": True, **want}
    assert parse(cfg.read_text()) == want
