"""Node components in containers: the simulated driver placed where a Pod would see the
host's (under /driver-root, or a driver container's /run/nvidia/driver under a mounted
host root), and every path nvctk writes for the host (CDI specs, the DRA plugin's forms,
their hooks' config) is the host's, never the container's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import config as nvconfig
from nvctk.sim import host as simhost
from nvctk.sim.host import SimHost
from nvctk.sim.topology import make_topology
from support.exe import nvctk_exe

HOOK = "/usr/local/nvctk/bin/nvctk-hook"
# (where the Pod sees the driver, below the test's dir; the host's driver root)
LAYOUTS = {"driver at /": ("driver-root", "/"),
           "driver container": ("host/run/nvidia/driver", "/run/nvidia/driver")}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def placed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[SimHost, str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    seen, on_host = LAYOUTS[request.param]
    base = tmp_path_factory.mktemp("placed")
    sim = simhost.init(str(base / seen), make_topology(gpus=2, mig={1: ["3g.40gb"]}))
    return sim, on_host


def _nvctk(sim: SimHost, *args: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*nvctk_exe(), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NVCTK_CONFIG": sim.config_path, **(env or {})})


def _strings(x: Any) -> list[str]:
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [s for v in x.values() for s in _strings(v)]
    if isinstance(x, list):
        return [s for v in x for s in _strings(v)]
    return []


def _host_paths(spec: dict[str, Any]) -> list[str]:
    edits = [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]
    return [x["hostPath"] for e in edits for k in ("mounts", "deviceNodes")
            for x in e.get(k, ()) if x.get("hostPath")]


def _check_host_spec(spec: dict[str, Any], sim: SimHost, on_host: str) -> None:
    paths = _host_paths(spec)
    assert paths
    assert not [s for s in _strings(spec) if sim.root in s], "a container path in the spec"
    nodes = [n["hostPath"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert os.path.join(on_host, "dev/nvidia0") in nodes
    assert all(p.startswith(on_host) for p in paths)
    hooks = [h for d in spec["devices"] for h in d["containerEdits"].get("hooks", ())]
    assert hooks and {h["path"] for h in hooks} == {HOOK}
    # the hooks load the host's config: the same file, where the host has it
    assert {e for h in hooks for e in h.get("env", ())} == {
        "NVCTK_CONFIG=" + os.path.join(on_host, "config.toml")}


def test_cdi_generate_writes_host_paths(placed: tuple[SimHost, str]) -> None:
    sim, on_host = placed
    r = _nvctk(sim, "cdi", "generate", "--format", "json",
               env={"NVCTK_DRIVER_ROOT": sim.root, "NVCTK_HOST_DRIVER_ROOT": on_host,
                    "NVCTK_HOOK_PATH": HOOK})
    assert r.returncode == 0, r.stderr
    _check_host_spec(json.loads(r.stdout), sim, on_host)


def test_options_as_env(placed: tuple[SimHost, str]) -> None:
    """The same through nvctk's options (what a Pod's args would say)."""
    sim, on_host = placed
    r = _nvctk(sim, "--driver-root", sim.root, "--host-driver-root", on_host,
               "--hook-path", HOOK, "cdi", "generate", "--format", "json")
    assert r.returncode == 0, r.stderr
    _check_host_spec(json.loads(r.stdout), sim, on_host)


def test_dra_forms_name_host_paths(placed: tuple[SimHost, str]) -> None:
    """The DRA plugin's claim specs are written from these forms."""
    from nvctk.cdi.generate import make_spec
    from nvctk.dra.node import cdi_forms
    from nvctk.host.nvml import query_host

    sim, on_host = placed
    cfg = nvconfig.overridden(nvconfig.load(sim.config_path), {
        "driver-root": sim.root, "host-driver-root": on_host, "hook-path": HOOK}, "test")
    forms = cdi_forms(cfg, query_host(sim.root), sim.config_path)
    spec = make_spec(forms.common, [([u], e) for u, e in forms.by_uuid.items()],
                     forms.hook_path, hook_env=list(forms.hook_env))
    _check_host_spec(spec, sim, on_host)


def test_host_config_moved_by_driver_root_alone(placed: tuple[SimHost, str],
                                                tmp_path: Path) -> None:
    """The host's config (driver-root: the host's path) read in a Pod that mounts the
    driver elsewhere: --driver-root alone makes the file's driver-root the host's."""
    sim, on_host = placed
    text = Path(sim.config_path).read_text().replace(
        f'driver-root = "{sim.root}"', f'driver-root = "{on_host}"', 1)
    hosts = tmp_path / "config.toml"
    hosts.write_text(text)
    r = subprocess.run([*nvctk_exe(), "--config", str(hosts), "--driver-root", sim.root,
                        "--hook-path", HOOK, "cdi", "generate", "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    paths = _host_paths(spec)
    assert paths and all(p.startswith(on_host) for p in paths)
    assert not [p for p in paths if sim.root in p]


@pytest.mark.parametrize("case", ["missing", "empty", "file"])
def test_wrong_driver_root_says_which_and_what_to_do(placed: tuple[SimHost, str],
                                                     tmp_path: Path, case: str) -> None:
    """A Pod on a node without the driver, or with the wrong hostPath: each node command
    fails naming the root as the Pod sees it and as the host does, and writes nothing."""
    sim, on_host = placed
    root = tmp_path / "driver-root"
    if case == "empty":
        root.mkdir()
    elif case == "file":
        root.write_text("")
    out = tmp_path / "spec.json"
    for cmd in (["cdi", "generate", "--output", str(out)], ["labels"],
                ["device-plugin", "--kubelet-dir", str(tmp_path)]):
        r = _nvctk(sim, *cmd, env={"NVCTK_DRIVER_ROOT": str(root),
                                   "NVCTK_HOST_DRIVER_ROOT": on_host})
        assert r.returncode == 1, (cmd, r.stderr)
        err = r.stderr
        assert f"driver root {root}" in err or f"at driver root {root}" in err, err
        assert f"(the host's {on_host})" in err, err
        assert "NVCTK_HOST_DRIVER_ROOT" in err and "nodeSelector" in err, err
        assert not out.exists()


def test_dra_plugin_says_when_its_cdi_dir_is_not_read(placed: tuple[SimHost, str],
                                                      tmp_path: Path) -> None:
    """A --cdi-dir none of the spec dirs names: the Pod's log says so at start."""
    sim, _ = placed
    bad = tmp_path / "kc"
    bad.write_text("not: [yaml")
    r = _nvctk(sim, "dra-plugin", "--node-name", "n", "--kubeconfig", str(bad),
               "--plugins-dir", str(tmp_path / "p"), "--registry-dir", str(tmp_path / "r"),
               "--cdi-dir", str(tmp_path / "cdi"))
    assert f"--cdi-dir {tmp_path / 'cdi'} is not among the CDI spec dirs" in r.stderr, r.stderr
    assert "prepared claims get no devices" in r.stderr
