"""The container lifecycle a shim drives, timed through a runtime under test:
create --bundle --pid-file -> start -> waitpid(init) -> delete, each container on a
fresh bundle and rootfs overlay (untimed) with the binds a kubelet gives it; the cases'
samples, interleaved round-robin. Used by bench/container_start.py."""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SA_NAMESPACE = "nvctk-bench"


def validate_cmd(smi: bool) -> list[str]:
    """The validation run's command: the GPU device nodes, nvidia-smi's GPU list, and
    the namespace file of the service account the kubelet's binds bring in."""
    return ["/bin/sh", "-c", "ls -d /dev/nvidia[0-9]* 2>/dev/null; "
            + ("nvidia-smi -L; " if smi else "") + f"echo; cat {SA_DIR}/namespace"]


def kubelet_binds(d: Path) -> list[dict]:
    """The binds a kubelet gives every container (containerd's CRI writes them so):
    the pod's hosts, resolv.conf and hostname files, the container's termination log,
    and the service account's token directory (read-only), their sources made in d."""
    d.mkdir()
    for name, text in (("hosts", "127.0.0.1 localhost\n"),
                       ("resolv.conf", "nameserver 10.96.0.10\nsearch svc.cluster.local\n"),
                       ("hostname", "bench-pod\n"), ("termination-log", "")):
        (d / name).write_text(text)
    sa = d / "serviceaccount"
    sa.mkdir()
    for name, text in (("token", "x" * 900), ("ca.crt", "-----BEGIN CERTIFICATE-----\n"),
                       ("namespace", SA_NAMESPACE)):
        (sa / name).write_text(text)
    rw, ro = ["rbind", "rprivate", "rw"], ["rbind", "rprivate", "ro"]
    return [{"destination": at, "type": "bind", "source": str(d / name), "options": opts}
            for at, name, opts in (("/etc/hosts", "hosts", rw),
                                   ("/etc/resolv.conf", "resolv.conf", rw),
                                   ("/etc/hostname", "hostname", rw),
                                   ("/dev/termination-log", "termination-log", rw),
                                   (SA_DIR, "serviceaccount", ro))]


@dataclass(frozen=True)
class Runtime:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]


@dataclass
class Case:
    """One timed case: `timed()` makes what it needs untimed and returns seconds taken."""

    label: str
    timed: Callable[[], float]
    samples: list[float] = field(default_factory=list)


def set_subreaper() -> None:
    # orphaned container inits (runc create exits, leaving the container's init
    # behind) are re-parented to us, so we can waitpid() them as a shim does
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_strays() -> None:
    """Reap re-parented orphans nobody waits for (e.g. a hook's double-forked child)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pctl(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def interleave(cases: list[Case], n: int) -> None:
    for c in cases:  # warm-up: page cache, pyc files
        c.timed()
    for _ in range(n):
        for c in cases:
            c.samples.append(c.timed())
        reap_strays()


class Bench:
    def __init__(self, run_dir: Path, lower: Path) -> None:
        self.run_dir = run_dir
        self.root = run_dir / "state"  # the runtimes' --root
        self.log = run_dir / "runtime-log.json"
        self.lower = lower
        self.count = 0
        self.errfile = run_dir / "stderr"

    def _run(self, argv: list[str], env: dict[str, str], what: str) -> None:
        # never a pipe: the container inherits create's stdio and would hold it open
        with open(self.errfile, "wb") as err:
            rc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err).returncode
        if rc != 0:
            raise RuntimeError(f"{what}: {' '.join(argv)} exited {rc}: "
                               f"{self.errfile.read_text(errors='replace').strip()[-2000:]}")

    def rt(self, rt: Runtime, *args: str) -> list[str]:
        return [*rt.argv, "--root", str(self.root), "--log", str(self.log),
                "--log-format", "json", *args]

    def new_bundle(self, spec: dict) -> tuple[str, Path]:
        """A fresh bundle dir and rootfs overlay for one container (untimed)."""
        self.count += 1
        cid = f"c{self.count}"
        b = self.run_dir / "b" / cid
        for d in ("rootfs", "upper", "work"):
            (b / d).mkdir(parents=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={self.lower},upperdir={b / 'upper'},workdir={b / 'work'}",
                        str(b / "rootfs")], check=True)
        s = json.loads(json.dumps(spec))
        s["root"] = {"path": str(b / "rootfs"), "readonly": False}
        (b / "config.json").write_text(json.dumps(s))
        return cid, b

    def drop_bundle(self, b: Path) -> None:
        subprocess.run(["umount", str(b / "rootfs")], check=True)
        shutil.rmtree(b)

    def lifecycle(self, rt: Runtime, cid: str, b: Path, out: Path | None = None) -> float:
        """create -> start -> waitpid -> delete, all through `rt`; seconds taken."""
        pid_file = b / "init.pid"
        t0 = time.perf_counter()
        if out is None:
            self._run(self.rt(rt, "create", "--bundle", str(b), "--pid-file", str(pid_file),
                              cid), rt.env, f"{rt.name} create")
        else:  # validation: the container's stdout goes to a file
            with open(out, "wb") as f:
                rc = subprocess.run(self.rt(rt, "create", "--bundle", str(b), "--pid-file",
                                            str(pid_file), cid),
                                    env=rt.env, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RuntimeError(f"{rt.name} create exited {rc}: {out.read_text()[-2000:]}")
        pid = int(pid_file.read_text())
        try:
            self._run(self.rt(rt, "start", cid), rt.env, f"{rt.name} start")
            _, status = os.waitpid(pid, 0)
        except BaseException:
            self.force_delete(cid)
            raise
        self._run(self.rt(rt, "delete", cid), rt.env, f"{rt.name} delete")
        dt = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise RuntimeError(f"{rt.name}: the container exited {code}")
        return dt

    def force_delete(self, cid: str) -> None:
        subprocess.run(["runc", "--root", str(self.root), "delete", "--force", cid],
                       capture_output=True)

    def cleanup(self) -> None:
        if self.root.is_dir():
            ids = subprocess.run(["runc", "--root", str(self.root), "list", "-q"],
                                 capture_output=True, text=True).stdout.split()
            for cid in ids:
                self.force_delete(cid)
        reap_strays()


def plain_spec(env: list[str], args: list[str], mounts: list[dict] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:  # `runc spec` writes <d>/config.json
        subprocess.run(["runc", "spec", "--bundle", d], check=True)
        spec = json.loads((Path(d) / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] = ["PATH=/usr/local/bin:/usr/bin:/bin", *env]
    spec["mounts"] = [*spec["mounts"], *(mounts or [])]
    return spec
