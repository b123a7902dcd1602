"""Capped containers on a simulated host of their own (2 GPUs of 4 GiB): the fixtures
(sim, config, base_rootfs with vgpu_probe, bundles, runc through nvctk-runtime) and
helpers shared by the libvgpu runtime, escape and user-namespace tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import config as nvconfig
from nvctk.base import mounts
from nvctk.base.errors import NvctkError
from nvctk.runtime.create import Created, prepare_bundle
from nvctk.sim import host
from nvctk.sim.rootfs import build_rootfs
from nvctk.sim.state import read_state, state_path
from nvctk.vgpu import gc as vgpu_gc
from nvctk.vgpu import state as vgpu_state
from support import wait
from support.runc import gpu_bundle
from support.sim import own_sim

BIN = os.path.dirname(sys.executable)
RUNTIME = os.path.join(BIN, "nvctk-runtime")
HOOK = os.path.join(BIN, "nvctk-hook")
REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "libvgpu" / "build" / "vgpu_probe"
MIB = 1 << 20
GPU_MIB = 4096
NVD = "NVIDIA_VISIBLE_DEVICES"
MEM = "CUDA_DEVICE_MEMORY_LIMIT"


# --- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> host.SimHost:
    """A host of its own: 2 GPUs of 4 GiB (so the neighbours test can fill one)."""
    return own_sim(tmp_path_factory, "vgpusim", gpus=2, memory_mib=GPU_MIB)


@pytest.fixture(scope="module")
def config(sim: host.SimHost) -> nvconfig.Config:
    return nvconfig.load(sim.config_path)


@pytest.fixture(scope="module")
def base_rootfs(sim: host.SimHost, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One glibc rootfs with cuda-vectoradd and vgpu_probe, copied for each bundle."""
    root = build_rootfs(str(tmp_path_factory.mktemp("vgpurootfs") / "rootfs"),
                        with_sample=sim.sample)
    # built here, not skipped when absent: the end-to-end cases need it
    subprocess.run(["make", "-s", "-C", str(REPO / "libvgpu")], check=True, capture_output=True)
    shutil.copy(PROBE, os.path.join(root, "usr/local/bin/vgpu_probe"))
    return root


class Bundles:
    def __init__(self, tmp: Path, base: str) -> None:
        self.tmp = tmp
        self.base = base
        self.n = 0

    def make(self, env: dict[str, str], script: str = "true", rootfs: str | None = None,
             gpu: str = "0") -> Path:
        self.n += 1
        b = self.tmp / f"bundle{self.n}"
        if rootfs is not None:
            b.mkdir()
            shutil.move(rootfs, b / "rootfs")
        return gpu_bundle(b, self.base if rootfs is None else None, script, gpu, env)


@pytest.fixture
def bundles(tmp_path: Path, base_rootfs: str) -> Bundles:
    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    return Bundles(tmp_path, base_rootfs)


def prep(b: Path, config: nvconfig.Config, cid: str, root: str) -> Created:
    """The shim's create, in-process."""
    return prepare_bundle(str(b), config, argv0=RUNTIME, container_id=cid, runtime_root=root)


def spec_of(b: Path) -> dict[str, Any]:
    return json.loads((b / "config.json").read_text())


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    return dict(e.partition("=")[::2] for e in spec["process"]["env"])


def mounts_at(path: str | Path) -> list[mounts.MountInfo]:
    """The host's mounts on path (a state dir: its tmpfs, or none)."""
    return [i for i in mounts.read_mountinfo() if i.mount_point == str(path)]


def mounts_under(top: str | Path) -> list[mounts.MountInfo]:
    return [i for i in mounts.read_mountinfo() if i.mount_point.startswith(f"{top}/")]


def cleanup_state(config: nvconfig.Config, d: str | Path) -> None:
    """What poststop does (the tmpfs, then the dir), for a test that ran no poststop."""
    with contextlib.suppress(OSError, NvctkError):
        vgpu_gc.remove_state_dir(str(d), config, only_ours=False)


# --- through nvctk-runtime + runc ---------------------------------------------------------------
class Runc:
    def __init__(self, tmp: Path, sim: host.SimHost) -> None:
        self.root = tmp / "runc-root"
        self.sim = sim
        self.ids: list[str] = []

    def argv(self, b: Path, cid: str) -> list[str]:
        return [RUNTIME, "--root", str(self.root), "run", "--bundle", str(b), cid]

    def new_id(self) -> str:
        cid = "nvctk-vgpu-" + uuid.uuid4().hex[:8]
        self.ids.append(cid)
        return cid

    def run(self, b: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(b, self.new_id()), env={**os.environ, **self.sim.env},
                              capture_output=True, text=True, timeout=90,
                              stdin=subprocess.DEVNULL)

    def start(self, b: Path) -> tuple[str, subprocess.Popen[str]]:
        cid = self.new_id()
        p = subprocess.Popen(self.argv(b, cid), env={**os.environ, **self.sim.env},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             stdin=subprocess.DEVNULL)
        return cid, p

    def kill(self, cid: str) -> None:
        subprocess.run(["runc", "--root", str(self.root), "kill", cid, "KILL"],
                       capture_output=True)


@pytest.fixture
def runc(tmp_path: Path, sim: host.SimHost) -> Iterator[Runc]:
    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    r = Runc(tmp_path, sim)
    yield r
    for cid in r.ids:
        subprocess.run(["runc", "--root", str(r.root), "delete", "--force", cid],
                       capture_output=True)
    for cid in r.ids:  # poststop ran for every container that got as far as runc
        cfg = nvconfig.load(sim.config_path)
        cleanup_state(cfg, vgpu_state.state_dir_for(cfg, str(r.root), cid))


def lines(out: str, prefix: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith(prefix)]


def used_on_gpu1(sim: host.SimHost) -> int:
    return read_state(state_path(sim.root), live_only=True).gpus[1].mem_used


def wait_used(sim: host.SimHost, at_least: int, p: subprocess.Popen[str]) -> None:
    """Until GPU 1 holds at_least bytes; the holder p must not exit meanwhile."""
    def holds() -> bool:
        assert p.poll() is None, p.communicate()[0]
        return used_on_gpu1(sim) >= at_least

    wait.until(holds, 30, f"the holder to allocate ({at_least} bytes on GPU 1)")


def stop(runc: Runc, cid: str, p: subprocess.Popen[str]) -> None:
    runc.kill(cid)
    p.communicate(timeout=60)


def create_logged(tmp_path: Path, b: Path, sim: host.SimHost) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`nvctk-runtime create` of bundle b with runc's JSON log: (its result, the log)."""
    log = tmp_path / "runc-log.json"
    r = subprocess.run(
        [RUNTIME, "--root", str(tmp_path / "runc-root"), "--log", str(log), "--log-format",
         "json", "create", "--bundle", str(b), "cid"],
        env={**os.environ, **sim.env}, capture_output=True, text=True, timeout=60)
    return r, log
