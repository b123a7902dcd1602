"""What tests/integration/test_cli_configure_*.py share: the installed `nvctk configure`
run on real files (no daemons), a containerd config written by hand, TOML reads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
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
