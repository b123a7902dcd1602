"""Shared parts of the reliability suite: scale, figures, host checks, a lab
that drives the real nvctk-runtime + runc on a simulated host.

Scale: NVCTK_RELIABILITY=full (set by `make reliability`) runs the full numbers; anything
else runs the short version that `make test` includes. Figures: every test calls
`record(...)`; with NVCTK_RELIABILITY_OUT set each record is appended there as one JSON
line (bench/reliability.py collects them into bench/results/reliability.json).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from support.procs import run_to_files

FULL = os.environ.get("NVCTK_RELIABILITY") == "full"
BIN = os.path.dirname(sys.executable)
RUNTIME = os.path.join(BIN, "nvctk-runtime")
HOOK = os.path.join(BIN, "nvctk-hook")
NVCTK = os.path.join(BIN, "nvctk")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_lock = threading.Lock()


def n(short: int, full: int) -> int:
    """How many of something this run does."""
    return full if FULL else short


def record(section: str, target: str, **figures: Any) -> None:
    """One row of the report (section: fuzz, hostile, fault, load)."""
    row = {"section": section, "target": target, "scale": "full" if FULL else "short",
           **figures}
    print("reliability:", json.dumps(row))
    out = os.environ.get("NVCTK_RELIABILITY_OUT")
    if out:
        with _lock, open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def tree_digest(path: str | Path) -> str:
    """sha256 over a tree's names, types, modes, sizes, mtimes, contents and link targets
    (never following a link): a decoy host dir must end with the digest it started with."""
    h = hashlib.sha256()
    root = str(path)
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(d, name)
            st = os.lstat(p)
            h.update(f"{os.path.relpath(p, root)}\0{st.st_mode}\0{st.st_size}\0"
                     f"{st.st_mtime_ns}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    h.update(f.read())
    st = os.lstat(root)
    h.update(f"{st.st_mode}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def make_decoy(path: Path) -> Path:
    """A host directory the hostile images aim at: files, a subdir, a lib-like name."""
    for sub in ("", "sub", "lib"):
        (path / sub).mkdir(parents=True, exist_ok=True)
        (path / sub / "keep").write_text(f"decoy {sub}\n")
    (path / "ld.so.cache").write_text("decoy cache\n")
    (path / "ld.so.preload").write_text("decoy preload\n")
    (path / "libcuda.so.1").write_text("decoy lib\n")
    return path


def mount_points() -> list[str]:
    """The mount points of this (the host's) mount namespace, in table order."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return [line.split()[4] for line in f]


def mounts_from(*dirs: str | Path) -> list[str]:
    """Mount points under, or mounts made from (the mount's root), any of dirs: on a
    machine shared with other test sessions, the part of the table that is ours."""
    prefixes = tuple(str(d).rstrip("/") for d in dirs)

    def ours(p: str) -> bool:
        return any(p == x or p.startswith(x + "/") for x in prefixes)

    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        rows = [line.split() for line in f]
    return [f"{r[4]} (root {r[3]})" for r in rows if ours(r[4]) or ours(r[3])]


def mounts_under(prefix: str) -> list[str]:
    prefix = prefix.rstrip("/")
    return [m for m in mount_points() if m == prefix or m.startswith(prefix + "/")]


def procs_mentioning(needle: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose argv mentions needle (ours: the runc root)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if needle.encode() in argv:
            out.append((int(name), argv.replace(b"\0", b" ").decode(errors="replace")))
    return out


def clean_failure(stderr: str) -> bool:
    """A refusal the way nvctk refuses: a line of its own, no traceback, no internal error."""
    return "Traceback" not in stderr and "internal error" not in stderr


def state_entries(state_dir: str) -> list[str]:
    """vGPU state dirs: <16 hex of sha256(root, id)>-<id> (docs/decisions.md, vGPU)."""
    import re

    if not os.path.isdir(state_dir):
        return []
    return sorted(x for x in os.listdir(state_dir) if re.match(r"[0-9a-f]{16}-", x))


def vgpu_gc(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`nvctk vgpu gc` with env (NVCTK_CONFIG names the state dir)."""
    return subprocess.run([NVCTK, "vgpu", "gc"], env=env, capture_output=True, text=True,
                          timeout=60)


class Lab:
    """Bundles and containers on one runc root, through the real nvctk-runtime.

    config: the sim's config.toml, with lines replaced (key -> line) where a test needs."""

    def __init__(self, tmp: Path, config_path: str, **replace: str) -> None:
        self.tmp = tmp
        self.root = str(tmp / "runc-root")
        self.ids: list[str] = []
        lines = Path(config_path).read_text().splitlines()
        out = []
        for line in lines:
            key = line.split("=", 1)[0].strip()
            out.append(replace.pop(key) if key in replace else line)
        out += replace.values()
        self.config = tmp / "config.toml"
        self.config.write_text("\n".join(out) + "\n")
        self.count = 0

    def env(self) -> dict[str, str]:
        return {**os.environ, "NVCTK_CONFIG": str(self.config)}

    @property
    def state_dir(self) -> str:
        for line in self.config.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "state-dir":
                return str(json.loads(value.strip()))
        return "/run/nvctk"

    def state_entries(self) -> list[str]:
        return state_entries(self.state_dir)

    def bundle(self, rootfs: str | None, env: list[str], args: list[str] | None = None,
               edit: Any = None, base: str | None = None) -> Path:
        """rootfs None: a copy of base at <bundle>/rootfs."""
        self.count += 1
        b = self.tmp / f"b{self.count}"
        b.mkdir()
        subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
        if rootfs is None:
            assert base is not None
            shutil.copytree(base, b / "rootfs", symlinks=True)
            rootfs = "rootfs"
        spec = json.loads((b / "config.json").read_text())
        spec["root"] = {"path": rootfs, "readonly": False}
        spec["process"].update(terminal=False, args=args or ["/bin/sh", "-c", "true"],
                               env=[PATH_ENV, *env])
        if edit is not None:
            edit(spec)
        (b / "config.json").write_text(json.dumps(spec, indent="\t"))
        return b

    def new_id(self, prefix: str = "rel") -> str:
        cid = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.ids.append(cid)
        return cid

    def argv(self, b: Path, cid: str, sub: str = "run") -> list[str]:
        return [RUNTIME, "--root", self.root, "--log", str(b / "runc-log.json"),
                "--log-format", "json", sub, "--bundle", str(b), cid]

    def run(self, b: Path, cid: str | None = None, sub: str = "run", timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
        cid = self.new_id() if cid is None else cid
        return run_to_files(self.argv(b, cid, sub), self.env(), b, timeout)

    def runc(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runc", "--root", self.root, *args], capture_output=True,
                              text=True, timeout=timeout)

    def start_ok(self, env: list[str], base: str, sees_gpu: bool = True) -> None:
        """A container with env (a copy of base) runs to exit 0; sees_gpu: and its /dev
        holds nvidia0. It is deleted after."""
        b = self.bundle(None, env, base=base,
                        args=["/bin/sh", "-c", "ls /dev | grep nvidia" if sees_gpu else "true"])
        cid = self.new_id()
        r = self.run(b, cid)
        assert r.returncode == 0, r.stderr + r.stdout
        if sees_gpu:
            assert "nvidia0" in r.stdout.split(), r.stdout
        self.delete(cid)

    def delete(self, cid: str) -> None:
        self.runc("delete", "--force", cid)

    def listed(self) -> list[str]:
        return self.runc("list", "-q").stdout.split()

    def gc(self) -> subprocess.CompletedProcess[str]:
        return vgpu_gc(self.env())

    def cleanup(self) -> None:
        for cid in self.ids:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.delete(cid)


@contextlib.contextmanager
def lab(tmp: Path, config_path: str, **replace: str) -> Iterator[Lab]:
    if shutil.which("runc") is None or os.geteuid() != 0:
        import pytest

        pytest.skip("needs root and runc")
    la = Lab(tmp, config_path, **replace)
    try:
        yield la
    finally:
        la.cleanup()


class Checked:
    """Runs starts and checks the host after each; counts attempts and escapes."""

    def __init__(self, la: Lab, decoy: Path, sim_root: str) -> None:
        self.la = la
        self.decoy = decoy
        self.digest = tree_digest(decoy)
        self.ours = (la.tmp, decoy, sim_root)
        self.mounts = mounts_from(*self.ours)
        self.attempts = self.started = self.refused = 0
        self.reasons: dict[str, int] = {}

    def start(self, b: Path, timeout: float = 60) -> str:
        cid = self.la.new_id()
        r = self.la.run(b, cid, timeout=timeout)  # TimeoutExpired: a hang fails the test
        self.attempts += 1
        assert clean_failure(r.stderr), r.stderr[-3000:]
        if r.returncode == 0:
            self.started += 1
        else:
            self.refused += 1
            line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "?"
            key = line[-110:]
            self.reasons[key] = self.reasons.get(key, 0) + 1
        self.la.delete(cid)
        assert tree_digest(self.decoy) == self.digest, "ESCAPE: the decoy changed"
        assert mounts_from(*self.ours) == self.mounts, "a host mount was left or made"
        return r.stderr
