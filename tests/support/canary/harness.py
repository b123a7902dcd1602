"""Helpers for the prestart-hook tests (test_prestart, test_hostile_image).

A "container" is `unshare -m --propagation private sleep` (its pid plays the
container init's); a bundle is config.json + nvctk-edits.json + a config.toml
with a debug log; the hook runs as the real `nvctk-hook prestart` executable
with exactly the environment runc would give it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from nvctk.base.mounts import parse_mountinfo
from nvctk.edits import Edits, LogSettings, Mount, ProcMask, Symlink
from nvctk.sim.host import SimHost

HOOK = shutil.which("nvctk-hook", path=os.path.dirname(sys.executable)) or "nvctk-hook"
HOOK_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def mountinfo(pid: int | str = "self") -> str:
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as f:
        return f.read()


def mount_points(pid: int | str = "self") -> list[str]:
    return [m.mount_point for m in parse_mountinfo(mountinfo(pid))]


@contextmanager
def fake_container(propagation: str = "private", pre: str | None = None) -> Iterator[int]:
    """A process in a new mount namespace; yields its pid.

    pre: a shell command run in that namespace first (e.g. mounting a procfs in
    the rootfs, as runc does before prestart hooks).
    """
    own = os.stat("/proc/self/ns/mnt").st_ino
    cmd = ["sleep", "600"] if pre is None else ["sh", "-c", f"{pre} && exec sleep 600"]
    p = subprocess.Popen(["unshare", "-m", "--propagation", propagation, *cmd])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.stat(f"/proc/{p.pid}/ns/mnt").st_ino != own:
                    with open(f"/proc/{p.pid}/comm") as f:
                        if f.read().strip() == "sleep":
                            break
            except FileNotFoundError:
                pass
            time.sleep(0.02)
        else:
            raise RuntimeError("the fake container did not start")
        yield p.pid
    finally:
        p.kill()
        p.wait()


def cpath(pid: int, rootfs: str, path: str) -> str:
    """Host-side path of `path` in the container, as the container's mount ns sees it."""
    return f"/proc/{pid}/root{rootfs}/{path.lstrip('/')}"


def make_plan(
    sim: SimHost,
    *,
    lib_dir: str = "/usr/lib/x86_64-linux-gnu",
    capabilities: Sequence[str] = ("compute", "utility"),
    drop: Sequence[str] = (),
    extra: Sequence[Mount] = (),
    bus_ids: Sequence[str] | None = None,
) -> Edits:
    """A plan like the planner's, from the sim's files (drop: host basenames to leave out)."""
    v = sim.topology.driver_version
    libs = []
    if "utility" in capabilities:
        libs += [f"libnvidia-ml.so.{v}", f"libnvidia-cfg.so.{v}"]
    if "compute" in capabilities:
        libs += [f"libcuda.so.{v}", f"libnvidia-ptxjitcompiler.so.{v}", f"libnvidia-nvvm.so.{v}"]
    # required as the planner marks them (nvctk.plan.mounts.REQUIRED)
    mounts = [Mount(os.path.join(sim.lib_dir, n), f"{lib_dir}/{n}",
                    required=n.startswith(("libcuda.so", "libnvidia-ml.so"))) for n in libs]
    if "utility" in capabilities:
        mounts.append(Mount(os.path.join(sim.bin_dir, "nvidia-smi"), "/usr/bin/nvidia-smi"))
        mounts.append(
            Mount(os.path.join(sim.root, "run/nvidia-persistenced/socket"),
                  "/run/nvidia-persistenced/socket", "socket", read_only=False, noexec=True)
        )
    fw = os.path.join(sim.root, "lib/firmware/nvidia", v)
    for n in sorted(os.listdir(fw)):
        mounts.append(Mount(os.path.join(fw, n), f"/lib/firmware/nvidia/{v}/{n}"))
    mounts += list(extra)
    if bus_ids is None:
        bus_ids = sorted(os.listdir(os.path.join(sim.proc_dir, "gpus")))[:1]
    links = [Symlink(f"{lib_dir}/libcuda.so", "libcuda.so.1")] if "compute" in capabilities else []
    return Edits(
        driver_version=v,
        capabilities=tuple(capabilities),
        gpu_uuids=(sim.topology.gpus[0].uuid,),
        mounts=tuple(m for m in mounts if os.path.basename(m.host_path) not in drop),
        symlinks=tuple(links),
        proc_mask=ProcMask(sim.proc_dir, tuple(bus_ids)),
        lib_dir=lib_dir,
        ldconfig="/sbin/ldconfig",
    )


@dataclass
class Bundle:
    path: str
    rootfs: str
    config: str  # NVCTK_CONFIG
    log: str

    def log_text(self) -> str:
        try:
            with open(self.log, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return ""


def make_bundle(tmp: str, rootfs: str, plan: Edits | None, spec_extra: dict | None = None,
                driver_root: str = "/") -> Bundle:
    os.makedirs(tmp, exist_ok=True)
    log = os.path.join(tmp, "nvctk.log")
    cfg = os.path.join(tmp, "config.toml")
    with open(cfg, "w") as f:
        f.write(f'driver-root = "{driver_root}"\nlog-file = "{log}"\nlog-level = "debug"\n')
    spec = {
        "ociVersion": "1.0.2",
        "process": {"args": ["sh"], "cwd": "/", "env": [HOOK_PATH_ENV]},
        "root": {"path": os.path.relpath(rootfs, tmp)},
        "linux": {"namespaces": [{"type": "mount"}]},
    }
    spec.update(spec_extra or {})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(spec, f)
    if plan is not None:
        if plan.log is None:  # as nvctk-runtime saves it: the config's log settings in it
            plan = plan.replace(log=LogSettings(log, "debug"))
        with open(os.path.join(tmp, "nvctk-edits.json"), "w") as f:
            f.write(plan.to_json())
    return Bundle(tmp, rootfs, cfg, log)


def run_hook(bundle: Bundle, pid: int, cid: str = "c1", extra_env: Sequence[str] = (),
             state_extra: dict | None = None, timeout: float = 60
             ) -> subprocess.CompletedProcess[str]:
    state = {"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": pid,
             "bundle": bundle.path}
    state.update(state_extra or {})
    env = dict(e.split("=", 1) for e in [HOOK_PATH_ENV, f"NVCTK_CONFIG={bundle.config}",
                                         *extra_env])
    return subprocess.run([HOOK, "prestart"], input=json.dumps(state), env=env,
                          capture_output=True, text=True, timeout=timeout)
