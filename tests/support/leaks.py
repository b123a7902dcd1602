"""What tests/integration/test_vgpu_leaks_*.py share: a simulated host with a vGPU state
dir, the real nvctk-runtime and runc (Host), and what the tests look for after each
create: no tmpfs under state-dir in /proc/self/mountinfo and no state dir."""

from __future__ import annotations

import contextlib
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
from nvctk.sim import host
from nvctk.sim.rootfs import build_rootfs
from nvctk.vgpu import gc as vgpu_gc
from nvctk.vgpu import state as vgpu_state
from support.procs import run_to_files
from support.runc import gpu_bundle
from support.sim import own_sim

BIN = os.path.dirname(sys.executable)
RUNTIME = os.path.join(BIN, "nvctk-runtime")

MEM = "CUDA_DEVICE_MEMORY_LIMIT"


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> host.SimHost:
    return own_sim(tmp_path_factory, "leaksim", gpus=1, memory_mib=4096)


@pytest.fixture(scope="module")
def base_rootfs(sim: host.SimHost, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_rootfs(str(tmp_path_factory.mktemp("leakrootfs") / "rootfs"))


class Host:
    """Bundles, nvctk-runtime runs and checks on one runc root."""

    def __init__(self, tmp: Path, sim: host.SimHost, base: str) -> None:
        self.tmp = tmp
        self.sim = sim
        self.base = base
        self.root = str(tmp / "runc-root")
        self.config_path = sim.config_path
        self.n = 0
        self.ids: list[str] = []

    @property
    def config(self) -> nvconfig.Config:
        """The sim's config (a test's own config differs in other keys than state-dir)."""
        return nvconfig.load(self.sim.config_path)

    def env(self) -> dict[str, str]:
        return {**os.environ, "NVCTK_CONFIG": self.config_path}

    def with_config(self, **replace: str) -> None:
        """A config of this test's own: the sim's, with lines replaced (key -> new line)."""
        lines = Path(self.sim.config_path).read_text().splitlines()
        out = []
        for line in lines:
            key = line.split("=", 1)[0].strip()
            out.append(replace.pop(key) if key in replace else line)
        out += replace.values()
        path = self.tmp / "config.toml"
        path.write_text("\n".join(out) + "\n")
        self.config_path = str(path)

    def bundle(self, env: dict[str, str] | None = None, edit: Any = None) -> Path:
        self.n += 1
        return gpu_bundle(self.tmp / f"bundle{self.n}", self.base, "sleep 1000", "0",
                          env if env is not None else {MEM: "512m"}, edit)

    def new_id(self) -> str:
        cid = "leak-" + uuid.uuid4().hex[:10]
        self.ids.append(cid)
        return cid

    def argv(self, b: Path, cid: str, sub: str = "create", flags: tuple[str, ...] = ()
             ) -> list[str]:
        return [RUNTIME, "--root", self.root, *flags, sub, "--bundle", str(b), cid]

    def create(self, b: Path, cid: str | None = None, sub: str = "create",
               flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        cid = self.new_id() if cid is None else cid
        return run_to_files(self.argv(b, cid, sub, flags), self.env(), self.tmp)

    def runc(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runc", "--root", self.root, *args], capture_output=True,
                              text=True, timeout=timeout)

    def state_dir(self, cid: str) -> str:
        return vgpu_state.state_dir_for(self.config, self.root, cid)

    def key_dirs(self) -> list[str]:
        top = self.config.state_dir
        if not os.path.isdir(top):
            return []
        return sorted(n for n in os.listdir(top) if vgpu_gc._is_key_dir(n))

    def mounts_under_state_dir(self) -> list[str]:
        top = os.path.abspath(self.config.state_dir)
        return [i.mount_point for i in mounts.read_mountinfo()
                if i.mount_point.startswith(f"{top}/")]

    def assert_clean(self) -> None:
        assert self.mounts_under_state_dir() == []
        assert self.key_dirs() == []

    def a_vgpu_create(self) -> None:
        """The next vGPU create, as any user would make one (it collects): created, then
        deleted, and its own state gone with it."""
        b = self.bundle()
        cid = self.new_id()
        r = self.create(b, cid)
        assert r.returncode == 0, r.stderr
        assert os.path.isdir(self.state_dir(cid))
        r2 = self.runc("delete", "--force", cid)
        assert r2.returncode == 0, r2.stderr
        assert not os.path.exists(self.state_dir(cid))


@pytest.fixture
def h(tmp_path: Path, sim: host.SimHost, base_rootfs: str) -> Iterator[Host]:
    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    hh = Host(tmp_path, sim, base_rootfs)
    yield hh
    for cid in hh.ids:
        hh.runc("delete", "--force", cid)
    cfg = nvconfig.load(sim.config_path)
    for name in hh.key_dirs():  # whatever a failing test left, not to spill into the next
        with contextlib.suppress(OSError, NvctkError):
            vgpu_gc.remove_state_dir(os.path.join(cfg.state_dir, name), cfg, only_ours=False)
