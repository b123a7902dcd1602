"""Helpers for tests/test_vgpu_*.py: build libvgpu, a small simulated driver
(mock libcuda + libnvidia-ml, device nodes), and run the probe programs."""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

LIBVGPU = Path(__file__).resolve().parents[1]
BUILD = LIBVGPU / "build"
# VGPU_TEST_LIB: another build of the library under test (e.g. main's, to see a new test fail there)
LIB = Path(os.environ.get("VGPU_TEST_LIB") or BUILD / "libvgpu.so")
PROBE = BUILD / "vgpu_probe"
STRESS = BUILD / "vgpu_stress"
PARSE = BUILD / "vgpu_parse"
MIB = 1 << 20


def build() -> None:
    subprocess.run(["make", "-s", "-C", str(LIBVGPU)], check=True, capture_output=True)


@dataclass
class Driver:
    root: Path
    uuids: list[str]
    memory: int  # bytes per GPU

    @property
    def libdir(self) -> str:
        return str(self.root / "lib")

    @property
    def devdir(self) -> str:
        return str(self.root / "dev")

    def env(self, state: Path, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CUDA_", "NVSIM_", "LD_PRELOAD", "NVCTK_VGPU", "LIBVGPU"))
        }
        env.update(
            LD_LIBRARY_PATH=self.libdir,
            NVSIM_DEV_DIR=self.devdir,
            NVSIM_STATE=str(state),
            NVSIM_CONTEXT_RESERVE_MIB="64",
        )
        env.update(extra)
        return env


def make_driver(root: Path, gpus: int = 2, memory_mib: int = 4096) -> Driver:
    from nvctk.sim.build import build_driver
    from nvctk.sim.topology import make_topology

    topo = make_topology(gpus=gpus, memory_mib=memory_mib)
    lib = root / "lib"
    build_driver(topo, str(root), str(lib), str(root / "bin"))
    make_devdir(root / "dev", [g.minor for g in topo.gpus])
    return Driver(root, [g.uuid for g in topo.gpus], memory_mib * MIB)


def make_devdir(path: Path, minors: list[int]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    # nvidiactl: without it the mock NVML, like the real one, says the driver is not loaded
    for name, m in (("nvidiactl", 255), *((f"nvidia{m}", m) for m in minors)):
        os.mknod(path / name, stat.S_IFCHR | 0o666, os.makedev(195, m))
    return path


def parse(out: str) -> dict[str, list[list[str]]]:
    """probe output -> {cmd: [[rc, values...], ...]}"""
    res: dict[str, list[list[str]]] = {}
    for line in out.splitlines():
        parts = line.split()
        if parts:
            res.setdefault(parts[0], []).append(parts[1:])
    return res


def probe(
    env: dict[str, str], *args: str, preload: bool = True, mode: str = "--proc", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = dict(env)
    if preload:
        env["LD_PRELOAD"] = str(LIB)
    return subprocess.run(
        [str(PROBE), mode, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
