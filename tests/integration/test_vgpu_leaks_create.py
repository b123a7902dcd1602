"""vGPU state never outlives its container: the create's failures.

Every failure that used to leave the per-container tmpfs mounted on the host (and its
directory) is run here through the real nvctk-runtime launcher and real runc on a
simulated host (tests/support/leaks.py). After each: no tmpfs under state-dir in
/proc/self/mountinfo and no state dir; either at once (nvctk-runtime creates as runc's
parent and cleans up when runc fails) or after the collection the next vGPU create runs
(what a SIGKILL or a killed poststop leaves). The signal forwarding and the fd
inheritance of the create are tested with a fake runtime where runc cannot show them.
The collector's rules: test_vgpu_leaks_gc.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import support.leaks as _leaks
from nvctk.vgpu import gc as vgpu_gc
from support import wait
from support.leaks import Host
from support.procs import run_to_files

sim, base_rootfs, h = _leaks.sim, _leaks.base_rootfs, _leaks.h  # fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim device nodes, runc)")


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
