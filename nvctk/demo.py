"""`python -m nvctk.demo`: build a 2-GPU simulated host in a temp dir and show
`nvctk info` for it, through the installed CLI as a user would run it.

Other parts extend this (running a GPU container on the sim); keep each step a
function that takes the SimHost so they can be chained.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from nvctk.sim import host
from nvctk.sim.topology import make_topology


def _nvctk() -> list[str]:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    exe = shutil.which("nvctk", path=path)
    return [exe] if exe else [sys.executable, "-m", "nvctk.cli.main"]


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(argv: list[str], env: dict[str, str] | None = None) -> int:
    print("$ " + " ".join(argv), flush=True)
    return subprocess.run(argv, env={**os.environ, **(env or {})}).returncode


def show_info(sim: host.SimHost) -> int:
    step("nvctk info on the simulated host")
    return run([*_nvctk(), "info"], env=sim.env)


def show_nvidia_smi(sim: host.SimHost) -> int:
    step("the simulated driver's nvidia-smi (host side: its libnvidia-ml via LD_LIBRARY_PATH)")
    return run([os.path.join(sim.bin_dir, "nvidia-smi"), "-L"], env={"LD_LIBRARY_PATH": sim.lib_dir})


def main() -> int:
    if os.geteuid() != 0:
        print("nvctk.demo: needs root (the simulated host has device nodes)", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="nvctk-demo-")
    try:
        step(f"building a simulated host with 2 GPUs in {tmp}/sim")
        sim = host.init(os.path.join(tmp, "sim"), make_topology(gpus=2))
        print(f"NVCTK_CONFIG={sim.config_path}")
        rc = show_info(sim)
        rc = rc or show_nvidia_smi(sim)
        return rc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
