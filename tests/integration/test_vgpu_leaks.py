"""vGPU state never outlives its container.

Every failure that used to leave the per-container tmpfs mounted on the host (and
its directory) is run here through the real nvctk-runtime launcher and real runc
on a simulated host. After each: no tmpfs under state-dir in /proc/self/mountinfo
and no state dir; either at once (nvctk-runtime creates as runc's parent and
cleans up when runc fails) or after the collection the next vGPU create runs
(what a SIGKILL or a killed poststop leaves). The collector's rules, the
signal forwarding and the fd inheritance of the create are tested with a fake
runtime where runc cannot show them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
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
from support import wait
from support.procs import run_to_files
from support.runc import gpu_bundle
from support.sim import own_sim

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim device nodes, runc)")

BIN = os.path.dirname(sys.executable)
RUNTIME = os.path.join(BIN, "nvctk-runtime")
NVCTK = os.path.join(BIN, "nvctk")
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


def _relative_cwd(spec: dict[str, Any]) -> None:
    spec["process"]["cwd"] = "relative/dir"


def _hostname_without_uts(spec: dict[str, Any]) -> None:
    spec["hostname"] = "box"
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "uts"]


def _non_object_mount(spec: dict[str, Any]) -> None:
    spec["mounts"].append("/tmp")


# --- runc fails before the container exists: removed at once ----------------------------------
@pytest.mark.parametrize("edit", [_relative_cwd, _hostname_without_uts, _non_object_mount],
                         ids=["relative-cwd", "hostname-without-uts", "non-object-mount"])
def test_spec_runc_refuses_leaves_nothing(h: Host, edit: Any) -> None:
    r = h.create(h.bundle(edit=edit))
    assert r.returncode != 0
    assert r.stderr.strip(), "the failure is reported"
    h.assert_clean()  # at once: nvctk-runtime removed what it made when runc failed


@pytest.mark.parametrize("cid", ["a/b", "", "x" * 300], ids=["slash", "empty", "too-long"])
def test_bad_id_leaves_nothing(h: Host, cid: str) -> None:
    r = h.create(h.bundle(), cid)
    assert r.returncode != 0
    h.assert_clean()


def test_unknown_global_flag_leaves_nothing(h: Host) -> None:
    r = h.create(h.bundle(), flags=("--no-such-flag",))
    assert r.returncode != 0 and "no-such-flag" in r.stderr, r.stderr
    h.assert_clean()


def test_absurd_hook_timeout_leaves_nothing(h: Host) -> None:
    h.with_config(**{"hook-timeout": "hook-timeout = 1000000000000000"})
    r = h.create(h.bundle())
    assert r.returncode != 0
    assert "hook-timeout" in r.stderr, r.stderr  # refused as the config's error
    h.assert_clean()


@pytest.mark.parametrize("edit", [_relative_cwd, _hostname_without_uts, _non_object_mount],
                         ids=["relative-cwd", "hostname-without-uts", "non-object-mount"])
@pytest.mark.parametrize("flags", [(), ("--detach",)], ids=["foreground", "detach"])
def test_failed_run_leaves_nothing(h: Host, edit: Any, flags: tuple[str, ...]) -> None:
    """`run` on a spec runc refuses, after nvctk prepared a vGPU container: before, the
    state stayed until the next vGPU create (create cleaned up at once, run did not)."""
    b = h.bundle(edit=edit)
    cid = h.new_id()
    r = run_to_files([*h.argv(b, cid, "run")[:-1], *flags, cid], h.env(), h.tmp)
    assert r.returncode != 0
    assert r.stderr.strip(), "the failure is reported"
    h.assert_clean()  # at once


def test_run_that_succeeds_leaves_nothing_and_keeps_the_exit_status(h: Host) -> None:
    def edit(spec: dict[str, Any]) -> None:
        spec["process"]["args"] = ["/bin/sh", "-c", "test -s /run/nvctk/limits && exit 3"]

    r = h.create(h.bundle(edit=edit), sub="run")
    assert r.returncode == 3, r.stderr  # the container's own status, passed on
    h.assert_clean()


def test_detached_run_keeps_its_state_until_delete(h: Host) -> None:
    cid = h.new_id()
    b = h.bundle()
    r = run_to_files([*h.argv(b, cid, "run")[:-1], "--detach", cid], h.env(), h.tmp)
    assert r.returncode == 0, r.stderr
    assert os.path.isdir(h.state_dir(cid))
    assert h.runc("delete", "--force", cid).returncode == 0
    h.assert_clean()


# --- the collector ---------------------------------------------------------------------------
def _fake_state(cfg: nvconfig.Config, name: str, owner: dict[str, Any] | str | None,
                age: float = 0, ours: bool = True) -> str:
    """A state dir as nvctk makes one (ours: its tmpfs mounted on it, the proof that it
    is nvctk's), or a directory that only looks like one."""
    d = os.path.join(cfg.state_dir, name)
    os.makedirs(d, 0o700)
    if ours:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m",
                        vgpu_state.TMPFS_OPTIONS["source"], d], check=True)
    if owner is not None:
        Path(d, "owner").write_text(owner if isinstance(owner, str) else json.dumps(owner))
    if age:
        t = time.time() - age
        os.utime(d, (t, t))
    return d


def test_collect_rules(h: Host, tmp_path: Path) -> None:
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    root = str(tmp_path / "rt")
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = {"pid": os.getpid(), "start": vgpu_gc.proc_start_time(os.getpid())}
    dead = {"pid": gone.pid, "start": 1}
    os.makedirs(f"{root}/alive", 0o700)
    Path(f"{root}/alive/state.json").write_text("{}")
    os.makedirs(f"{root}/half", 0o700)  # a runc killed during create: dir, no state.json
    stale = [
        _fake_state(cfg, "0000000000000001-gone", {**dead, "runtime_root": root, "id": "gone"}),
        _fake_state(cfg, "0000000000000002-half", {**dead, "runtime_root": root, "id": "half"}),
        _fake_state(cfg, "0000000000000003-old", None, age=vgpu_gc.GC_GRACE_S + 60),
        # a reused pid is not the creator
        _fake_state(cfg, "0000000000000004-reuse", {"pid": os.getpid(), "start": -1,
                                                     "runtime_root": root, "id": "reuse"}),
        _fake_state(cfg, "0000000000000005-junk", "{not json", age=vgpu_gc.GC_GRACE_S + 60),
        # an install killed between its mkdir and its owner file (it holds the lock then)
        _fake_state(cfg, "0000000000000006-killed", None),
        # ... or while it wrote the owner file: cut short, nothing else yet (found by the
        # reliability suite's SIGKILL loop, which then left the dir to the grace period)
        _fake_state(cfg, "0000000000000007-cut", '{"pid": 4'),
    ]
    kept = [
        _fake_state(cfg, "0000000000000011-alive", {**dead, "runtime_root": root, "id": "alive"}),
        _fake_state(cfg, "0000000000000012-busy", {**me, "runtime_root": root, "id": "busy"}),
        # no owner but files (an nvctk that wrote none): only after the grace period
        _fake_state(cfg, "0000000000000013-young", None),
    ]
    Path(kept[-1], "limits").write_text("")
    os.utime(kept[-1], (time.time() - 10, time.time() - 10))
    others = [os.path.join(cfg.state_dir, n) for n in ("not-a-key-dir", "0000000000000014")]
    for o in others:
        os.makedirs(o)
        os.utime(o, (0, 0))
    try:
        assert sorted(vgpu_gc.collect(cfg)) == sorted(stale)
        for d in stale:
            assert not os.path.exists(d)
        for d in kept + others:
            assert os.path.isdir(d)
        assert vgpu_gc.collect(cfg) == []
        # the CLI: a shorter grace takes the young one too
        r = subprocess.run([NVCTK, "vgpu", "gc", "--grace", "1"], env=h.env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [f"removed {kept[2]}",
                                         f"1 stale vGPU state dir(s) removed from {cfg.state_dir}"]
    finally:
        for d in others:
            os.rmdir(d)


def test_failed_create_keeps_a_dir_made_anew_by_another(h: Host) -> None:
    """A create's clean-up removes only the dir it made (same id, created again meanwhile)."""
    cfg = h.config
    d = _fake_state(cfg, "0000000000000021-again", {
        "pid": os.getpid(), "start": vgpu_gc.proc_start_time(os.getpid()),
        "runtime_root": h.root, "id": "again"})
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert not vgpu_state.remove_if_owner(d, cfg, pid=other.pid)
        assert os.path.isdir(d)
        assert vgpu_state.remove_if_owner(d, cfg)
        assert not os.path.exists(d)
    finally:
        other.kill()
        other.wait()


# --- the create as runc's parent (a fake runtime shows what it got) ---------------------------
FAKE = """#!/bin/sh
# a runtime that reports what it got, then waits to be told to stop
out={out}
# the shell's own signal state, read with builtins only (dash blocks signals while it waits)
{{ echo "pid $$"; echo /proc/$$/fd/*
  while read -r l; do case $l in SigBlk*|SigIgn*) echo "$l";; esac; done < /proc/$$/status
}} > $out.tmp
# the trap before the report: the test signals once it sees the report
trap 'echo "got TERM" >> {out}; exit 7' TERM
mv $out.tmp $out
i=0
while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
exit 3
"""


def _fake_runtime(h: Host) -> Path:
    out = h.tmp / "fake.out"
    fake = h.tmp / "fake-runc"
    fake.write_text(FAKE.format(out=out))
    fake.chmod(0o755)
    h.with_config(runtimes=f'runtimes = ["{fake}"]')
    return out


def _wait_for(path: Path, p: subprocess.Popen[Any], timeout: float = 60) -> str:
    def there() -> bool:
        assert p.poll() is None, f"nvctk-runtime exited {p.returncode} before the runtime ran"
        return path.exists()

    wait.until(there, timeout, f"{path} to appear")
    return path.read_text()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_create_forwards_signals_and_cleans_up(h: Host) -> None:
    out = _fake_runtime(h)
    b = h.bundle()
    cid = h.new_id()
    r, w = os.pipe()  # an inherited fd, as --preserve-fds passes them
    try:
        p = subprocess.Popen(h.argv(b, cid), env=h.env(), stdin=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, pass_fds=(w,))
        report = _wait_for(out, p)
        assert os.path.isdir(h.state_dir(cid))  # made before the runtime started
        runtime_pid = int(report.split()[1])
        assert runtime_pid != p.pid  # a child, not an exec
        assert f"/proc/{runtime_pid}/fd/{w}" in report.splitlines()[1].split()  # inherited
        assert "SigBlk:\t0000000000000000" in report  # nothing left blocked
        p.send_signal(signal.SIGTERM)  # a supervisor stopping the runtime
        _, err = p.communicate(timeout=30)
        assert p.returncode == 7, err  # runc's own status
        assert "got TERM" in out.read_text()
        h.assert_clean()  # it failed: what this create made is gone
    finally:
        os.close(r)
        os.close(w)


def test_sigkill_of_the_runtime_takes_runc_with_it(h: Host) -> None:
    out = _fake_runtime(h)
    cid = h.new_id()
    p = subprocess.Popen(h.argv(h.bundle(), cid), env=h.env(), stdin=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    child = int(_wait_for(out, p).split()[1])
    p.kill()
    p.wait()
    wait.until(lambda: not _alive(child), 10, "the runtime to end with nvctk-runtime")
    assert len(h.key_dirs()) == 1  # a SIGKILL cleans nothing up ...
    h.config_path = h.sim.config_path
    h.a_vgpu_create()  # ... the next vGPU create does
    h.assert_clean()


def test_successful_create_exits_zero_and_keeps_the_state(h: Host, tmp_path: Path) -> None:
    ok = tmp_path / "ok-runc"
    ok.write_text("#!/bin/sh\nexit 0\n")
    ok.chmod(0o755)
    h.with_config(runtimes=f'runtimes = ["{ok}"]')
    cid = h.new_id()
    r = h.create(h.bundle(), cid)
    assert r.returncode == 0, r.stderr
    d = h.state_dir(cid)
    assert os.path.isdir(d) and [m for m in h.mounts_under_state_dir() if m == d]
    vgpu_gc.remove_state_dir(d, h.config)


# --- through real runc ------------------------------------------------------------------------
def _procs() -> Iterator[tuple[int, list[bytes], bytes]]:
    """(pid, argv, cgroup file) of every process still there to be read."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{name}/cgroup", "rb") as f:
                cgroup = f.read()
        except OSError:
            continue
        yield int(name), argv, cgroup


def _runc_procs(h: Host) -> list[int]:
    """runc processes working on this test's root, and the container inits of its ids
    (runc puts each in a cgroup named after the id)."""
    ids = [f"/{cid}\n".encode() for cid in h.ids]
    return [pid for pid, argv, cgroup in _procs()
            if h.root.encode() in argv or any(i in cgroup for i in ids)]


@pytest.mark.slow
def test_sigkill_during_create(h: Host) -> None:
    """SIGKILL of nvctk-runtime at random points of a real create, 20 times; then one more
    vGPU create: no state, no mount, no runc left."""
    b = h.bundle()
    cid = h.new_id()
    t0 = time.monotonic()
    r = h.create(b, cid)  # how long a create takes here
    span = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert h.runc("delete", "--force", cid).returncode == 0
    rng = random.Random(8)
    killed = []
    for _ in range(20):
        cid = h.new_id()
        p = subprocess.Popen(h.argv(b, cid), env=h.env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0, span))
        p.kill()
        p.wait()
        killed.append(cid)
    existing = [c for c in killed if vgpu_gc.runtime_has(h.root, c)]
    deadline = time.monotonic() + 10
    # the only processes left: the inits of containers created before their kill
    while set(_runc_procs(h)) - set(_init_pids(h, existing)):
        assert time.monotonic() < deadline, "a runc outlived its nvctk-runtime"
        time.sleep(0.05)
    h.a_vgpu_create()  # collects what the kills left
    for cid in killed:
        if cid not in existing:  # no container: the collector took its state
            assert not os.path.exists(h.state_dir(cid)), (cid, _describe(h.state_dir(cid)))
    for cid in existing:  # created before the kill: a container its supervisor deletes
        r = h.runc("delete", "--force", cid)
        assert r.returncode == 0, r.stderr
    h.assert_clean()
    assert _runc_procs(h) == []


def _init_pids(h: Host, ids: list[str]) -> list[int]:
    out = []
    for cid in ids:
        with contextlib.suppress(OSError, ValueError, KeyError):
            out.append(json.loads(h.runc("state", cid).stdout)["pid"])
    return out


def _find_hook(h: Host, what: str, timeout: float = 30) -> int:
    def found() -> int:
        return next((pid for pid, argv, _ in _procs()
                     if what.encode() in argv and h.root.encode() in argv), 0)

    return wait.until(found, timeout, f"a {what} hook to run")


@pytest.mark.slow
def test_killed_poststop_is_collected_by_the_next_create(h: Host) -> None:
    cid = h.new_id()
    r = h.create(h.bundle(), cid)
    assert r.returncode == 0, r.stderr
    d = h.state_dir(cid)
    assert os.path.isdir(d)
    with vgpu_gc.StateLock(h.config):  # the poststop blocks on it, and is killed there
        delete = subprocess.Popen(["runc", "--root", h.root, "delete", "--force", cid],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        hook = _find_hook(h, "poststop")
        os.kill(hook, signal.SIGKILL)
        delete.communicate(timeout=60)
    assert os.path.isdir(d) and h.mounts_under_state_dir() == [d]  # the leak, as it was
    assert not vgpu_gc.runtime_has(h.root, cid)
    h.a_vgpu_create()
    h.assert_clean()


@pytest.mark.slow
def test_two_containers_from_one_bundle(h: Host) -> None:
    b = h.bundle()
    c1, c2 = h.new_id(), h.new_id()
    for cid in (c1, c2):
        r = h.create(b, cid)
        assert r.returncode == 0, r.stderr
    d1, d2 = h.state_dir(c1), h.state_dir(c2)
    assert os.path.isdir(d1) and os.path.isdir(d2)
    r = h.runc("delete", "--force", c1)  # its poststop: its own dir, not the plan's (c2's)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(d1) and os.path.isdir(d2)
    r = h.runc("delete", "--force", c2)
    assert r.returncode == 0, r.stderr
    h.assert_clean()


def _describe(d: str) -> str:
    """What a leftover state dir holds (for a failure message)."""
    try:
        return f"{sorted(os.listdir(d))} owner={vgpu_gc.read_owner(d)} mounted={os.path.ismount(d)}"
    except OSError as e:
        return str(e)


def test_gc_never_deletes_through_a_mount_nested_in_a_state_dir(h: Host, tmp_path: Path) -> None:
    """A host dir bound below a stale state dir: gc detaches it and removes the dir
    without deleting the host's files (shutil.rmtree crossed into the mount)."""
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    d = _fake_state(cfg, "0123456789abcdef-bind", {"runtime_root": "/nonexistent", "id": "gone",
                                                   "pid": 999999, "start": 1})
    sub = Path(d, "sub")
    sub.mkdir()
    subprocess.run(["mount", "--bind", str(victim), str(sub)], check=True)
    try:
        r = subprocess.run([NVCTK, "vgpu", "gc", "--grace", "0"], env=h.env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert (victim / "precious").read_text() == "keep me"
        assert not os.path.exists(d)
        assert f"removed {d}" in r.stdout.splitlines()
        assert not [m for m in mounts.read_mountinfo() if m.mount_point.startswith(d)]
    finally:
        with contextlib.suppress(OSError):
            mounts.umount2(str(sub), mounts.MNT_DETACH)


def test_remove_tree_never_enters_another_mount(h: Host, tmp_path: Path) -> None:
    """The walk itself stops at a mount point it finds (one bound after the detach
    looked): the dir is left, the host's file kept."""
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    d = _fake_state(cfg, "0123456789abcdef-walk", None)
    sub = Path(d, "a", "sub")
    sub.mkdir(parents=True)
    Path(d, "a", "file").write_text("")
    os.symlink(str(victim), Path(d, "link"))
    subprocess.run(["mount", "--bind", str(victim), str(sub)], check=True)
    try:
        with pytest.raises(NvctkError, match="another file system"):
            vgpu_gc.remove_tree(d)
        assert (victim / "precious").read_text() == "keep me"
        assert os.path.isdir(sub) and not os.path.exists(Path(d, "a", "file"))
        assert not os.path.lexists(Path(d, "link"))
    finally:
        mounts.umount2(str(sub), mounts.MNT_DETACH)
    vgpu_gc.remove_state_dir(d, cfg)
    assert not os.path.exists(d) and (victim / "precious").exists()


@pytest.mark.parametrize("owner", [
    "[" * 8000,  # RecursionError in json.loads
    '{"id": "x", "pid": 1' + " " * 9000 + "}",  # too big
    '{"id": "x", "pid": true, "runtime_root": null}',
    '{"id": "x", "pid": "1"}',
    '{"id": 5, "pid": 1}',
    "[1, 2]",
    "\xff\xfe",
])
def test_odd_owner_is_no_owner(h: Host, owner: str) -> None:
    """An owner file nvctk did not write is "no readable owner": neither gc nor the
    collection every create runs fails on it."""
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    d = _fake_state(cfg, "0123456789abcdef-odd", owner, age=vgpu_gc.GC_GRACE_S + 60)
    assert vgpu_gc.read_owner(d) is None
    r = subprocess.run([NVCTK, "vgpu", "gc"], env=h.env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(d)  # old, ownerless: collected


def test_owner_that_is_a_fifo_is_no_owner(h: Host) -> None:
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    d = _fake_state(cfg, "0123456789abcdef-fifo", None)
    os.mkfifo(os.path.join(d, "owner"))
    try:
        assert vgpu_gc.read_owner(d) is None
    finally:
        vgpu_gc.remove_state_dir(d, cfg)


def test_deep_owner_does_not_break_poststop_or_create(h: Host) -> None:
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    d = _fake_state(cfg, "0123456789abcdef-deep", "[" * 8000, age=vgpu_gc.GC_GRACE_S + 60)
    vgpu_gc.collect_quietly(cfg)  # what every vGPU create and poststop runs
    assert not os.path.exists(d)


# --- gc removes only what it can prove is its own -------------------------

_DEAD_OWNER = {"runtime_root": "/nonexistent", "id": "gone", "pid": 999999, "start": 1}


def _lookalikes(cfg: nvconfig.Config, tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    """Things in the state dir named like nvctk's state dirs that nvctk did not make
    (name -> path), and the mounts to undo afterwards."""
    old = vgpu_gc.GC_GRACE_S + 60
    made: dict[str, str] = {}
    made_mounts: list[str] = []
    d = _fake_state(cfg, "00000000000000a1-files", None, ours=False)
    Path(d, "precious").write_text("the operator's")
    made["ownerless-with-files"] = d
    made["ownerless-empty"] = _fake_state(cfg, "00000000000000a2-empty", None, age=old, ours=False)
    d = _fake_state(cfg, "00000000000000a3-forged", _DEAD_OWNER, ours=False)
    Path(d, "precious").write_text("the operator's")
    made["forged-owner"] = d
    d = os.path.join(cfg.state_dir, "00000000000000a4-tmpfs")
    os.makedirs(d)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "other", d], check=True)
    Path(d, "owner").write_text(json.dumps(_DEAD_OWNER))
    made_mounts.append(d)
    made["another-tmpfs"] = d
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    (host_dir / "precious").write_text("the host's")
    (host_dir / "owner").write_text(json.dumps(_DEAD_OWNER))
    d = os.path.join(cfg.state_dir, "00000000000000a5-bind")
    os.makedirs(d)
    subprocess.run(["mount", "--bind", str(host_dir), d], check=True)
    made_mounts.append(d)
    made["host-bind"] = d
    (tmp_path / "target").mkdir()
    d = os.path.join(cfg.state_dir, "00000000000000a6-link")
    os.symlink(tmp_path / "target", d)
    made["symlink"] = d
    d = os.path.join(cfg.state_dir, "00000000000000a7-file")
    Path(d).write_text("the operator's")
    made["file"] = d
    for p in made.values():
        if not os.path.islink(p):
            os.utime(p, (time.time() - old, time.time() - old))
    return made, made_mounts


def _tree(path: str) -> list[tuple[str, bytes]]:
    if os.path.islink(path) or not os.path.isdir(path):
        return [(path, os.readlink(path).encode() if os.path.islink(path) else
                 Path(path).read_bytes())]
    return sorted((os.path.join(r, f), Path(r, f).read_bytes()) for r, _, fs in os.walk(path)
                  for f in fs)


def test_gc_removes_only_what_it_can_prove_is_its_own(h: Host, tmp_path: Path) -> None:
    """Before: `nvctk vgpu gc` removed any ownerless dir whose name looked like nvctk's
    (and one with a forged owner whose pid is gone), with the files in it."""
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    made, made_mounts = _lookalikes(cfg, tmp_path)
    before = {k: _tree(p) for k, p in made.items()}
    real = _fake_state(cfg, "00000000000000b1-real", _DEAD_OWNER)  # nvctk's: goes
    try:
        r = subprocess.run([NVCTK, "vgpu", "gc", "--grace", "0"], env=h.env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert r.stdout.splitlines() == [f"removed {real}",
                                         f"1 stale vGPU state dir(s) removed from {cfg.state_dir}"]
        for k, p in made.items():
            assert os.path.lexists(p), k
            assert _tree(p) == before[k], k
        assert "nvctk removes only its own state dirs" in r.stderr, r.stderr
        # nor the collection every vGPU create and poststop runs
        vgpu_gc.collect_quietly(cfg)
        assert {k: _tree(p) for k, p in made.items()} == before
    finally:
        for m in made_mounts:
            mounts.umount2(m, mounts.MNT_DETACH)
        for p in made.values():
            if os.path.islink(p) or not os.path.isdir(p):
                os.unlink(p)
            else:
                shutil.rmtree(p)


def test_an_install_cut_short_is_still_collected(h: Host) -> None:
    """What an install killed between its mkdir and its tmpfs leaves (an empty dir and
    its marker), or before its mkdir (the marker alone), is nvctk's and goes; while
    the installing process lives, it stays."""
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    dead = json.dumps(_DEAD_OWNER)
    killed = _fake_state(cfg, "00000000000000c1-killed", None, ours=False)
    Path(vgpu_gc.marker_path(killed)).write_text(dead)
    alone = os.path.join(cfg.state_dir, "00000000000000c2-alone")
    Path(vgpu_gc.marker_path(alone)).write_text(dead)
    live = _fake_state(cfg, "00000000000000c3-live", None, ours=False)
    Path(vgpu_gc.marker_path(live)).write_text(vgpu_gc.owner_text(None, "live"))
    try:
        assert vgpu_gc.collect(cfg, grace=0) == [killed]
        assert not os.path.lexists(killed)
        assert not os.path.lexists(vgpu_gc.marker_path(killed))
        assert not os.path.lexists(vgpu_gc.marker_path(alone))
        assert os.path.isdir(live) and os.path.exists(vgpu_gc.marker_path(live))
    finally:
        os.unlink(vgpu_gc.marker_path(live))
        os.rmdir(live)


def test_a_removal_cut_short_is_still_collected(h: Host) -> None:
    """A remover killed between the unmount and the rmdir (the reliability suite's SIGKILL
    loop found it) leaves an empty dir: the marker the remover wrote proves it nvctk's,
    and the next collection takes it."""
    cfg = h.config
    os.makedirs(cfg.state_dir, 0o700, exist_ok=True)
    d = _fake_state(cfg, "00000000000000c4-cut", None, ours=False)
    script = (
        "import sys\n"
        "from nvctk.base import config\n"
        "from nvctk.vgpu import gc\n"
        "cfg = config.load()\n"
        "def die(path): raise SystemExit(9)  # killed once the mounts are gone\n"
        "gc.remove_tree = die\n"
        f"gc.remove_state_dir({d!r}, cfg, only_ours=False)\n")
    r = subprocess.run([sys.executable, "-c", script], env=h.env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 9, r.stderr
    assert os.path.isdir(d) and os.listdir(d) == []
    assert vgpu_gc.read_owner(cfg.state_dir, os.path.basename(vgpu_gc.marker_path(d)))
    assert vgpu_gc.collect(cfg, grace=0) == [d]
    assert not os.path.lexists(d) and not os.path.lexists(vgpu_gc.marker_path(d))


def test_create_never_removes_someone_elses_dir_at_its_path(h: Host) -> None:
    """A directory that is not nvctk's at the container's own state path: the create
    fails naming it, and the directory keeps its files; an empty one is taken over."""
    b = h.bundle()
    cid = h.new_id()
    d = h.state_dir(cid)
    os.makedirs(d)
    Path(d, "precious").write_text("the operator's")
    try:
        r = h.create(b, cid)
        assert r.returncode != 0
        assert f"vGPU state dir {d}: something that is not nvctk's is in the way" in r.stderr, \
            r.stderr
        assert Path(d, "precious").read_text() == "the operator's"
        os.unlink(Path(d, "precious"))  # empty now: a create takes it over
        r = h.create(b, cid)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(vgpu_gc.marker_path(d))
    finally:
        h.runc("delete", "--force", cid)
    assert not os.path.exists(d)
