"""`nvctk configure` against the real containerd 2.3.4 (../shared/peers/containerd):
configs of versions 2, 3 and 4 (Debian 1.6's and 2.3.4's own `containerd config
default` among them, with imports and drop-ins) are configured, loaded by 2.3.4
(`config dump`, and a private daemon whose CRI plugin must come up), and removed
byte for byte. Without ../shared these skip, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomlkit

from support.cri import private_v4_paths
from support.daemons import CONTAINERD_2_TAR, containerd, peer_bin, peer_env, short_dir

pytestmark = [pytest.mark.slow]

RUNTIME = os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")
RT = "io.containerd.cri.v1.runtime"
Run = Callable[..., subprocess.CompletedProcess[str]]

V3 = f"""version = 3
# a containerd 2.0 host, hand-written
[plugins."{RT}".containerd]
  default_runtime_name = "crun"   # the node's choice
[plugins."{RT}".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."{RT}".containerd.runtimes.runc.options]
  SystemdCgroup = true
[plugins."{RT}".containerd.runtimes.crun]
  runtime_type = "io.containerd.runc.v2"
[plugins."{RT}".containerd.runtimes.crun.options]
  BinaryName = "/usr/bin/crun"
  NoNewKeyring = true
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
"""


@pytest.fixture(scope="module")
def bin2() -> Iterator[Path]:
    """containerd 2.3.4's binaries, unpacked for this module."""
    with peer_bin(CONTAINERD_2_TAR, "nvctk-c2-") as got:
        yield got


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir("nvctk-c2w-") as d:
        yield d


def default_config(exe: str | Path) -> str:
    return subprocess.run([str(exe), "config", "default"], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def sources(bin2: Path) -> dict[str, str]:
    out = {"2.3.4-default-v4": default_config(bin2 / "containerd"), "hand-v3": V3}
    if shutil.which("containerd"):
        out["1.6-default-v2"] = default_config("containerd")
    return out


def dump(bin2: Path, cfg: Path) -> dict:
    res = subprocess.run([str(bin2 / "containerd"), "--config", str(cfg), "config", "dump"],
                         capture_output=True, text=True, timeout=60, env=peer_env(bin2))
    assert res.returncode == 0, res.stderr
    doc = tomlkit.parse(res.stdout).unwrap()
    assert doc["version"] == 4  # what 2.3.4 made of it (it migrates 2 and 3)
    return doc


def runtimes(doc: dict) -> dict:
    return doc["plugins"][RT]["containerd"]["runtimes"]


def check_nvidia(doc: dict) -> dict:
    rt = runtimes(doc)["nvidia"]
    assert rt["runtime_type"] == "io.containerd.runc.v2"
    assert rt["options"]["BinaryName"] == RUNTIME
    assert {"cdi.k8s.io/*", "nvctk.io/*"} <= set(rt["container_annotations"])
    assert not any(a.startswith("nvctk.io") for a in rt.get("pod_annotations", []))
    return rt


@pytest.mark.parametrize("mode", ["plain", "default-cdi", "drop-in"])
def test_every_config_version_loads_into_containerd_2_3(run_nvctk: Run, bin2: Path, work: Path,
                                                         mode: str) -> None:
    for name, text in sources(bin2).items():
        d = work / name
        d.mkdir()
        cfg = d / "config.toml"
        cfg.write_text(text)
        args = ["configure", "--runtime", "containerd", "--config", str(cfg)]
        if mode == "default-cdi":
            args += ["--set-as-default", "--cdi"]
        drop = d / "conf.d" / "99-nvctk.toml"
        if mode == "drop-in":
            args += ["--drop-in", str(drop)]
        # the installed containerd decides an empty file's version and the drop-in's
        # shape: 2.3.4 is the one on PATH here
        env = peer_env(bin2)
        res = run_nvctk(*args, env=env)
        assert res.returncode == 0, (name, res.stderr)
        first = {p: p.read_bytes() for p in (cfg, drop) if p.exists()}
        doc = dump(bin2, cfg)
        rt = check_nvidia(doc)
        ctd = doc["plugins"][RT]["containerd"]
        if mode == "default-cdi":
            assert ctd["default_runtime_name"] == "nvidia", name
            assert doc["plugins"][RT]["enable_cdi"] is True
        else:
            assert ctd["default_runtime_name"] == ("crun" if name == "hand-v3" else "runc"), name
        if name == "hand-v3":  # the default's settings came along, its binary did not
            assert rt["options"]["NoNewKeyring"] is True
        if mode == "drop-in":
            assert "nvidia" not in cfg.read_text()
            assert any(str(d / "conf.d") in i for i in doc["imports"]), doc["imports"]
        # a second run changes no byte
        res = run_nvctk(*args, env=env)
        assert res.returncode == 0 and "nothing written" in res.stdout, (name, res.stdout)
        assert {p: p.read_bytes() for p in first} == first
        res = run_nvctk(*args, "--remove", env=env)
        assert res.returncode == 0, (name, res.stderr)
        assert cfg.read_text() == text, name
        assert not drop.exists()
        assert "nvidia" not in runtimes(dump(bin2, cfg))


def test_v4_keeps_comments_order_and_quotes_round_trip(run_nvctk: Run, bin2: Path,
                                                       tmp_path: Path) -> None:
    text = default_config(bin2 / "containerd")
    text = text.replace("[plugins]\n", "# CRI and friends\n[plugins]\n")
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg),
                    "--set-as-default", env=peer_env(bin2))
    assert res.returncode == 0, res.stderr
    new = cfg.read_text()
    lines = iter(new.splitlines())
    want = text.replace("default_runtime_name = 'runc'", "default_runtime_name = 'nvidia'")
    assert all(line in lines for line in want.splitlines()), new
    assert (tmp_path / "config.toml.bak").read_text() == text
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == text


def test_empty_file_gets_version_4_from_containerd_2_3(run_nvctk: Run, bin2: Path,
                                                       tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg), "--cdi",
                    env=peer_env(bin2))
    assert res.returncode == 0, res.stderr
    assert tomlkit.parse(cfg.read_text())["version"] == 4
    doc = dump(bin2, cfg)
    check_nvidia(doc)
    assert doc["plugins"][RT]["enable_cdi"] is True


def test_newer_version_is_refused_untouched(run_nvctk: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    text = "version = 5\n[plugins]\n"
    cfg.write_text(text)
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 1
    assert "unknown containerd config version 5 (nvctk knows 1, 2, 3 and 4)" in res.stderr
    assert cfg.read_text() == text and os.listdir(tmp_path) == ["config.toml"]


def test_dry_run_of_a_v4_config(run_nvctk: Run, bin2: Path, tmp_path: Path) -> None:
    text = default_config(bin2 / "containerd")
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg), "--dry-run",
                    env=peer_env(bin2))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out.toml"
    out.write_text(res.stdout)
    check_nvidia(dump(bin2, out))
    assert cfg.read_text() == text and sorted(os.listdir(tmp_path)) == ["config.toml", "out.toml"]


def private_v4(work: Path, text: str) -> Path:
    """A version 4 config with root, state and the server sockets under work."""
    doc = tomlkit.parse(text)
    private_v4_paths(doc, work)
    cfg = work / "config.toml"
    cfg.write_text(tomlkit.dumps(doc))
    return cfg


@pytest.mark.root
def test_containerd_2_3_daemon_starts_its_cri_with_the_configured_v4_file(
        run_nvctk: Run, bin2: Path, work: Path) -> None:
    """Not only parsed: the daemon runs, its CRI plugin is up with the runtime."""
    if os.geteuid() != 0:
        pytest.skip("needs root: starts containerd")
    cfg = private_v4(work, default_config(bin2 / "containerd"))
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg),
                    "--set-as-default", "--cdi", env=peer_env(bin2))
    assert res.returncode == 0, res.stderr
    with containerd(work, config=cfg, bin_dir=bin2) as ctd:
        res = ctd.ctr("plugins", "ls")
        assert res.returncode == 0, res.stderr
        rows = {tuple(r.split()[:2]): r.split()[-1] for r in res.stdout.splitlines()[1:]}
        assert rows[("io.containerd.grpc.v1", "cri")] == "ok", res.stdout
        assert rows[("io.containerd.cri.v1", "runtime")] == "ok", res.stdout
        log = (work / "containerd.log").read_text()
        assert "nvidia" not in log or "error" not in log.lower().split("nvidia")[0][-200:]


def test_v4_drop_in_where_its_imports_already_look(run_nvctk: Run, bin2: Path,
                                                   tmp_path: Path) -> None:
    """2.3's config default imports conf.d/*.toml already: the drop-in goes there, the
    main file is not touched, a site's own drop-in beside it keeps working, and remove
    takes away nvctk's file alone."""
    confd = tmp_path / "conf.d"
    confd.mkdir()
    text = default_config(bin2 / "containerd").replace("/etc/containerd/conf.d", str(confd))
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    site = confd / "10-site.toml"
    site.write_text(f'version = 4\n[plugins."{RT}".containerd.runtimes.runc.options]\n'
                    "  SystemdCgroup = true\n")
    drop = confd / "99-nvctk.toml"
    args = ["configure", "--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop)]
    res = run_nvctk(*args, env=peer_env(bin2))
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == text and not (tmp_path / "config.toml.bak").exists()
    doc = dump(bin2, cfg)
    check_nvidia(doc)
    assert runtimes(doc)["runc"]["options"]["SystemdCgroup"] is True
    res = run_nvctk(*args, "--remove", env=peer_env(bin2))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in confd.iterdir()) == ["10-site.toml", "99-nvctk.toml.bak"]
    assert cfg.read_text() == text
    doc = dump(bin2, cfg)
    assert "nvidia" not in runtimes(doc) and runtimes(doc)["runc"]["options"]["SystemdCgroup"]
