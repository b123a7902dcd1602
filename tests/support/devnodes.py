"""Device nodes for a simulated host's dev dir (the mocks only stat them)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from nvctk.sim.topology import Topology


def make_node(path: Path, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
    else:  # the mocks only stat the nodes, so a plain file stands in
        path.touch()


def make_dev(path: Path, topo: Topology, gpus: list[int], caps: bool = True) -> Path:
    """nvidiactl (without it NVML's init fails: no driver), nvidia<minor> for the listed
    GPU indexes, and (caps) their MIG devices' cap nodes."""
    path.mkdir(parents=True, exist_ok=True)
    make_node(path / "nvidiactl", 255)
    for g in topo.gpus:
        if g.index in gpus:
            make_node(path / f"nvidia{g.minor}", g.minor)
            for m in g.mig_devices if caps else ():
                make_node(path / "nvidia-caps" / f"nvidia-cap{m.ci_cap_minor}", m.ci_cap_minor)
    return path
