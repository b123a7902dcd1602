"""vGPU state never outlives its container: the collector's rules (what the next vGPU
create removes, and what it must never remove: through a mount, another owner's dir, what
it cannot prove is its own; an install or removal cut short is still collected), on a
simulated host (tests/support/leaks.py). The create's failures: test_vgpu_leaks_create.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import support.leaks as _leaks
from nvctk.base import config as nvconfig
from nvctk.base import mounts
from nvctk.base.errors import NvctkError
from nvctk.vgpu import gc as vgpu_gc
from nvctk.vgpu import state as vgpu_state
from support.leaks import BIN, Host

sim, base_rootfs, h = _leaks.sim, _leaks.base_rootfs, _leaks.h  # fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim device nodes, runc)")


NVCTK = os.path.join(BIN, "nvctk")


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
