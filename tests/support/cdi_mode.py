"""What the CDI mode tests (tests/integration/test_cdi_mode_*.py) share: a config's
text with keys set, a spec of env and annotations, the `env` fixture reading CDI specs
from its own dir, `nvctk cdi generate`'s spec of the simulated host (`spec_dir`), and
the bundles they run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.host import SimHost
from support.runtime import Env


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


def _rootfs_bundle(b: Path, rootfs: str, args: list[str], env: list[str]) -> dict[str, Any]:
    """runc's default spec in a new bundle b, on rootfs (writable), running args with
    PATH and env; returned for the caller to add to and write."""
    b.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
    spec = json.loads((b / "config.json").read_text())
    spec["root"] = {"path": rootfs, "readonly": False}
    spec["process"].update(terminal=False, args=args, env=["PATH=/usr/bin:/bin:/sbin", *env])
    return spec
