"""The simulated driver built on its own (no host): its libraries and programs under
tmp/sim as a driver install lays them out."""

from __future__ import annotations

from pathlib import Path

from nvctk.sim import build
from nvctk.sim.topology import Topology


def build_sim_driver(tmp: Path, topo: Topology) -> tuple[Path, Path, Path]:
    """(root, lib dir, bin dir) of the driver of `topo` built under tmp/sim."""
    root = tmp / "sim"
    lib, bindir = root / "usr/lib/x86_64-linux-gnu", root / "usr/bin"
    build.build_driver(topo, str(root), str(lib), str(bindir))
    return root, lib, bindir
