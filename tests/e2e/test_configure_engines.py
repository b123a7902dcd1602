"""`nvctk configure`'s output loaded into the real containerd (Debian's 1.6) and dockerd,
started by the tests on private sockets and state dirs.

containerd 1.6 cannot load a version-3 or -4 config: test_configure_containerd2.py
loads those into the real containerd 2.3.4, and test_configure_crio.py CRI-O's drop-in
into the real CRI-O 1.36.3 (both from ../shared/peers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomlkit

from nvctk.sim.host import SimHost
from support.daemons import containerd, dockerd, import_rootfs, need, private_paths, short_dir

pytestmark = [pytest.mark.slow, pytest.mark.root]

RUNTIME = os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")
REPO = Path(__file__).resolve().parents[2]
Run = Callable[..., subprocess.CompletedProcess[str]]



def _need(*tools: str) -> None:
    need(*tools, starts="containerd/dockerd")


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir("nvctk-c-") as d:
        yield d


def user_config(work: Path, text: str) -> Path:
    """`text` (a containerd config) with root, state and sockets moved under work."""
    doc = tomlkit.parse(text)
    for k, v in private_paths(work).items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                doc.setdefault(k, tomlkit.table())[kk] = vv
        else:
            doc[k] = v
    cfg = work / "config.toml"
    cfg.write_text(tomlkit.dumps(doc))
    return cfg


def dump(cfg: Path) -> dict:
    res = subprocess.run(["containerd", "--config", str(cfg), "config", "dump"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return tomlkit.parse(res.stdout).unwrap()


def cri(doc: dict) -> dict:
    return doc["plugins"]["io.containerd.grpc.v1.cri"]


def cri_plugin_ok(work: Path) -> None:
    with containerd(work, config=work / "config.toml") as ctd:
        res = ctd.ctr("plugins", "ls")
        assert res.returncode == 0, res.stderr
        # TYPE ID PLATFORMS STATUS
        rows = [li.split() for li in res.stdout.splitlines()]
        assert ["io.containerd.grpc.v1", "cri"] in [r[:2] for r in rows], res.stdout
        assert next(r for r in rows if r[:2] == ["io.containerd.grpc.v1", "cri"])[-1] == "ok"


def test_containerd_loads_configured_default_config(run_nvctk: Run, work: Path) -> None:
    _need("containerd", "ctr")
    default = subprocess.run(["containerd", "config", "default"], capture_output=True,
                             text=True, check=True).stdout
    default = default.replace("SystemdCgroup = false", "SystemdCgroup = true")
    cfg = user_config(work, "# this host's containerd\n" + default)
    before = cfg.read_bytes()
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg), "--set-as-default")
    assert res.returncode == 0, res.stderr
    d = cri(dump(cfg))
    assert d["containerd"]["default_runtime_name"] == "nvidia"
    rt = d["containerd"]["runtimes"]["nvidia"]
    assert rt["runtime_type"] == "io.containerd.runc.v2"
    assert rt["options"]["BinaryName"] == RUNTIME
    assert rt["options"]["SystemdCgroup"] is True
    assert d["containerd"]["runtimes"]["runc"]["options"]["BinaryName"] == ""
    # the daemon starts with it and its CRI plugin takes it
    cri_plugin_ok(work)
    after = cfg.read_bytes()
    assert run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg),
                     "--set-as-default").returncode == 0
    assert cfg.read_bytes() == after
    assert run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg),
                     "--remove").returncode == 0
    assert cfg.read_bytes() == before


def test_containerd_drop_in_keeps_main_cri_settings(run_nvctk: Run, work: Path) -> None:
    """containerd 1.6 replaces the main file's CRI table with an imported one: the
    drop-in nvctk writes must keep the main file's CRI settings alive."""
    _need("containerd", "ctr")
    cfg = user_config(work, """version = 2
# pinned pause image
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.example/pause:9"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
""")
    before = cfg.read_bytes()
    drop = work / "conf.d" / "99-nvctk.toml"
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg),
                    "--drop-in", str(drop))
    assert res.returncode == 0, res.stderr
    d = cri(dump(cfg))
    assert d["sandbox_image"] == "registry.example/pause:9"
    assert d["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert d["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == RUNTIME
    cri_plugin_ok(work)
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg),
                    "--drop-in", str(drop), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_bytes() == before and not drop.exists()


def test_containerd_loads_the_example(work: Path) -> None:
    _need("containerd", "ctr")
    example = REPO / "containerd-config.toml.example"
    cfg = user_config(work, f'version = 2\nimports = ["{example}"]\n')
    d = cri(dump(cfg))
    assert d["containerd"]["runtimes"]["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
    assert d["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == "/usr/bin/nvctk-runtime"
    cri_plugin_ok(work)


DAEMON_JSON = {"debug": True, "log-level": "warn", "features": {"buildkit": False}}


def test_dockerd_lists_configured_runtime(run_nvctk: Run, work: Path) -> None:
    _need("containerd", "ctr", "dockerd", "docker")
    cfg = work / "daemon.json"
    cfg.write_text(json.dumps(DAEMON_JSON, indent=2) + "\n")
    before = cfg.read_bytes()
    res = run_nvctk("configure", "--runtime", "docker", "--config", str(cfg), "--set-as-default")
    assert res.returncode == 0, res.stderr
    with containerd(work / "ctd") as ctd, dockerd(work / "dk", ctd, {}, config=cfg) as dk:
        res_info = dk.docker("info", "--format", "{{json .}}")
        assert res_info.returncode == 0, res_info.stderr
        info = json.loads(res_info.stdout)
        assert info["Runtimes"]["nvidia"]["path"] == RUNTIME
        assert info["DefaultRuntime"] == "nvidia"
        assert info["Debug"] is True
    assert run_nvctk("configure", "--runtime", "docker", "--config", str(cfg),
                     "--remove").returncode == 0
    assert cfg.read_bytes() == before


def test_dockerd_runs_gpu_container_with_configured_runtime(
        run_nvctk: Run, work: Path, sim_host: SimHost, rootfs: Callable[..., str]) -> None:
    """The daemon.json nvctk configure writes, loaded by the real dockerd: a container
    run with its runtime gets exactly the GPU it asks for."""
    _need("containerd", "ctr", "dockerd", "docker")
    cfg = work / "daemon.json"
    cfg.write_text(json.dumps(DAEMON_JSON, indent=2) + "\n")
    res = run_nvctk("configure", "--runtime", "docker", "--config", str(cfg),
                    "--runtime-path", RUNTIME)
    assert res.returncode == 0, res.stderr
    assert json.loads(cfg.read_text())["runtimes"]["nvidia"]["path"] == RUNTIME
    gpu1 = sim_host.topology.gpus[1]
    # containerd's shims (so nvctk-runtime) inherit NVCTK_CONFIG, as from a systemd
    # drop-in on a real host: the runtime reads its config from its own environment
    with containerd(work / "ctd", env=sim_host.env) as ctd, \
            dockerd(work / "dk", ctd, {}, config=cfg) as dk:
        res_info = dk.docker("info", "--format", "{{json .Runtimes}}")
        assert res_info.returncode == 0, res_info.stderr
        assert json.loads(res_info.stdout)["nvidia"]["path"] == RUNTIME
        import_rootfs(dk, Path(rootfs()), "nvctk-configured:latest")
        res = dk.docker("run", "--rm", "--network", "none", "--runtime", "nvidia",
                        "-e", "NVIDIA_VISIBLE_DEVICES=1", "nvctk-configured:latest",
                        "nvidia-smi", "-L")
        assert res.returncode == 0, res.stderr.decode()
        assert res.stdout.decode().strip().splitlines() == [
            f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})"]


def test_containerd_cri_plugin_loads_after_configuring_a_file_without_runtimes(
        run_nvctk: Run, work: Path) -> None:
    """A file that names no runtime relies on containerd's built-in runc, which goes
    once any runtime is named: configure adds runc, or the CRI plugin fails to load."""
    _need("containerd", "ctr")
    cfg = user_config(work, 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n'
                            '  sandbox_image = "registry.example/pause:9"\n')
    res = run_nvctk("configure", "--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    d = cri(dump(cfg))
    assert d["sandbox_image"] == "registry.example/pause:9"
    assert set(d["containerd"]["runtimes"]) == {"runc", "nvidia"}
    cri_plugin_ok(work)
