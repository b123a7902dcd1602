"""Containers through real runc on a simulated host: a bundle whose prestart hook is
nvctk-hook with a given plan (runc_bundle + the `runc` fixture, containers deleted
afterwards), and Runc: nvctk-runtime as runc's front end, with the container's output
split into sections."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.host import SimHost
from nvctk.sim.rootfs import build_rootfs
from support.canary.harness import HOOK, make_plan


# --- through real runc --------------------------------------------------------------
def runc_bundle(tmp: Path, root: Path, sim: SimHost, args: list[str], env: list[str],
                extra: dict | None = None) -> Path:
    bundle = tmp / "rbundle"
    bundle.mkdir()
    plan = make_plan(sim)
    (bundle / "nvctk-edits.json").write_text(plan.to_json())
    cfg = bundle / "config.toml"
    cfg.write_text(f'log-file = "{bundle}/nvctk.log"\nlog-level = "debug"\n')
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": os.path.relpath(root, bundle), "readonly": False}
    spec["process"].update(terminal=False, args=args, env=["PATH=/usr/bin:/bin", *env])
    spec["hooks"] = {"prestart": [{
        "path": HOOK, "args": ["nvctk-hook", "prestart"],
        "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                f"NVCTK_CONFIG={cfg}"],
        "timeout": 60,
    }]}
    spec.update(extra or {})
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


@pytest.fixture
def runc(tmp_path: Path) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    state = tmp_path / "runc-root"
    ids: list[str] = []

    def run(bundle: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cid = "nvctk-hostile-" + uuid.uuid4().hex[:8]
        ids.append(cid)
        return subprocess.run(["runc", "--root", str(state), "run", "--bundle", str(bundle), cid],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    yield run
    for cid in ids:
        subprocess.run(["runc", "--root", str(state), "delete", "--force", cid],
                       capture_output=True)


RUNTIME = os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _sections(stdout: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        m = re.fullmatch(r"== (\w+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    assert "end" in out, f"the probe did not finish:\n{stdout}"
    return out


@dataclass
class Result:
    proc: subprocess.CompletedProcess[str]
    bundle: Path
    spec_before: bytes

    @property
    def out(self) -> dict[str, list[str]]:
        assert self.proc.returncode == 0, self.proc.stderr
        return _sections(self.proc.stdout)

    def spec_untouched(self) -> bool:
        return (self.bundle / "config.json").read_bytes() == self.spec_before


@dataclass
class Runc:
    """Bundles and containers of one test; every container id is force-deleted after."""

    sim: SimHost
    tmp: Path
    root: Path
    ids: list[str] = field(default_factory=list)

    def bundle(self, rootfs: str | None, args: list[str], env: list[str], *,
               readonly: bool = False, name: str = "bundle") -> Path:
        """rootfs None: build one at <bundle>/rootfs and use the relative root.path."""
        b = self.tmp / f"{name}-{len(self.ids)}-{uuid.uuid4().hex[:6]}"
        b.mkdir()
        subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
        if rootfs is None:
            build_rootfs(str(b / "rootfs"), with_sample=self.sim.sample)
            root_path = "rootfs"
        else:
            root_path = rootfs
        spec = json.loads((b / "config.json").read_text())
        spec["root"] = {"path": root_path, "readonly": readonly}
        spec["process"].update(terminal=False, args=args, env=[PATH_ENV, *env])
        (b / "config.json").write_text(json.dumps(spec, indent=2))
        return b

    def run(self, bundle: Path, *, bundle_flag: bool = True) -> Result:
        """bundle_flag False: no --bundle, the bundle is the working directory."""
        cid = "nvctk-e2e-" + uuid.uuid4().hex[:10]
        self.ids.append(cid)
        before = (bundle / "config.json").read_bytes()
        env = {**os.environ, "NVCTK_CONFIG": self.sim.config_path}
        where = ["--bundle", str(bundle)] if bundle_flag else []
        proc = subprocess.run(
            [RUNTIME, "--root", str(self.root), "--log", str(bundle / "runc-log.json"),
             "--log-format", "json", "run", *where, cid],
            env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
            cwd=bundle,
        )
        return Result(proc, bundle, before)

    def listed(self) -> list[str]:
        r = subprocess.run(["runc", "--root", str(self.root), "list", "-q"],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.split()

    def cleanup(self) -> None:
        for cid in self.ids:
            subprocess.run(["runc", "--root", str(self.root), "delete", "--force", cid],
                           capture_output=True, timeout=60)


@contextmanager
def containers(sim: SimHost, tmp: Path) -> Iterator[Runc]:
    """A Runc whose containers (root tmp/runc-root) are force-deleted at the end."""
    r = Runc(sim, tmp, tmp / "runc-root")
    try:
        yield r
    finally:
        r.cleanup()


def gpu_bundle(b: Path, base: str | None, script: str, gpu: str, env: dict[str, str],
               edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Bundle dir b (made here) from runc's default spec: a writable copy of rootfs `base`
    (None: b/rootfs is already there), `sh -c script` with GPU(s) `gpu` and env; edit(spec)
    last. What the vGPU, leak and monitor tests start their containers from."""
    b.mkdir(exist_ok=base is None)
    if base is not None:
        shutil.copytree(base, b / "rootfs", symlinks=True)
    subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
    spec = json.loads((b / "config.json").read_text())
    spec["root"] = {"path": "rootfs", "readonly": False}
    spec["process"].update(
        terminal=False, args=["/bin/sh", "-c", script],
        env=["PATH=/usr/local/bin:/usr/bin:/bin", f"NVIDIA_VISIBLE_DEVICES={gpu}",
             *(f"{k}={v}" for k, v in env.items())],
    )
    if edit is not None:
        edit(spec)
    (b / "config.json").write_text(json.dumps(spec, indent="\t"))
    return b
