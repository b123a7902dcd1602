"""vGPU installation by the runtime (issue C §2), planner/shim level: limits validated at
create (the message names the variable, config.json untouched), the accounting dir keyed by
(runc --root, id) and recreated on every create, `nvctk-hook poststop` removing it, musl
images refused. End to end through real runc: test_vgpu_runtime_e2e.py; the env can only
tighten and the node's share holds: test_vgpu_runtime_share.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

import support.vgpu as _vgpu
from nvctk.base import config as nvconfig
from nvctk.base.errors import RequestError
from nvctk.edits import Edits
from nvctk.edits_file import EDITS_FILE
from nvctk.host import image as host_image
from nvctk.oci import spec as oci
from nvctk.sim import host
from nvctk.vgpu import gc as vgpu_gc
from nvctk.vgpu import ledger
from nvctk.vgpu import limits as vgpu
from nvctk.vgpu import state as vgpu_state
from support.vgpu import (
    HOOK,
    MEM,
    MIB,
    RUNTIME,
    Bundles,
    cleanup_state,
    env_of,
    mounts_at,
    prep,
    spec_of,
)

base_rootfs, bundles, config, sim = (  # fixtures
    _vgpu.base_rootfs, _vgpu.bundles, _vgpu.config, _vgpu.sim)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim device nodes, runc)")


# --- validation at create ---------------------------------------------------------------------
@pytest.mark.parametrize(("env", "gpu", "culprit"), [
    ({MEM: "12x"}, "0", f"{MEM}='12x': not a memory size"),
    ({MEM: "-1"}, "0", f"{MEM}='-1': not a memory size"),
    ({"CUDA_DEVICE_SM_LIMIT": "150"}, "0", "CUDA_DEVICE_SM_LIMIT='150': not a percentage"),
    ({MEM: "8g"}, "0", f"{MEM}=8g: above the memory of the container's GPU 0"),
    ({f"{MEM}_1": "5g"}, "0,1", f"{MEM}_1=5g: above the memory of the container's GPU 1"),
    ({f"{MEM}_1": "1g"}, "0", f"{MEM}_1: the container has 1 GPU(s)"),
    ({"CUDA_DEVICE_SM_LIMIT_X": "10"}, "0", "CUDA_DEVICE_SM_LIMIT_X: not CUDA_DEVICE_SM_LIMIT"),
])
def test_bad_limits_fail_the_create(env: dict[str, str], gpu: str, culprit: str,
                                    bundles: Bundles, sim: host.SimHost, config: nvconfig.Config,
                                    tmp_path: Path) -> None:
    b = bundles.make(env, gpu=gpu)
    before = (b / "config.json").read_bytes()
    log = tmp_path / "runc-log.json"
    r = subprocess.run(
        [RUNTIME, "--root", str(tmp_path / "runc-root"), "--log", str(log), "--log-format",
         "json", "create", "--bundle", str(b), "cid"],
        env={**os.environ, **sim.env}, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode != 0
    assert culprit in r.stderr, r.stderr
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(culprit in e["msg"] and e["level"] == "error" for e in entries), entries
    assert (b / "config.json").read_bytes() == before
    assert not (b / EDITS_FILE).exists()
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(tmp_path / "runc-root"), "cid"))


def test_no_limit_installs_nothing(bundles: Bundles, config: nvconfig.Config) -> None:
    for env in ({}, {MEM: "0", "CUDA_DEVICE_SM_LIMIT": "0"},
                {vgpu.CACHE_VAR: "relative/ignored/without/limits"}):
        b = bundles.make(env)
        plan = prep(b, config, "plain", "/r").edits
        assert plan is not None and plan.vgpu is None and plan.env == {}
        spec = spec_of(b)
        assert not spec["hooks"].get("poststop")
        assert env_of(spec).get(vgpu.CACHE_VAR) == env.get(vgpu.CACHE_VAR)
        assert not os.path.exists(vgpu_state.state_dir_for(config, "/r", "plain"))


def test_state_dir_keying(config: nvconfig.Config) -> None:
    a = vgpu_state.state_dir_for(config, "/run/containerd/runc/k8s.io", "web")
    b = vgpu_state.state_dir_for(config, "/run/containerd/runc/moby", "web")
    c = vgpu_state.state_dir_for(config, None, "web")
    assert len({a, b, c}) == 3
    assert c == vgpu_state.state_dir_for(config, "/run/runc", "web")  # runc's default root
    assert a == vgpu_state.state_dir_for(config, "/run/containerd/runc/k8s.io/", "web")
    for d in (a, b, c):
        assert os.path.dirname(d) == config.state_dir
        assert os.path.basename(d).endswith("-web")
    odd = vgpu_state.state_dir_for(config, None, "../../etc/x y")
    assert os.path.dirname(odd) == config.state_dir and "/" not in os.path.basename(odd)
    assert os.path.basename(odd)[17:] == "_.._etc_x_y"


def _assert_state_dir_files(d: Path, p1: Edits) -> None:
    """A vGPU create's state dir: its files, their modes and contents, its owner."""
    assert p1.vgpu is not None
    # the state dir (/work/brief/vgpu_layout.md): ro/ for /run/nvctk, rw/ for
    # /run/nvctk/vgpu, the owner beside them
    assert (d.stat().st_mode & 0o777) == 0o755
    assert sorted(os.listdir(d)) == ["owner", "ro", "rw"]
    assert sorted(os.listdir(d / "ro")) == ["ld.so.preload", "libvgpu.so", "limits", "vgpu"]
    assert sorted(os.listdir(d / "rw")) == ["cache", "limits"]
    assert sorted(os.listdir(d / "ro/vgpu")) == []
    modes = {n: (d / n).lstat().st_mode for n in (
        "ro", "ro/limits", "ro/ld.so.preload", "ro/libvgpu.so", "ro/vgpu", "rw", "rw/cache",
        "rw/limits", "owner")}
    assert {n: (stat.S_IFMT(m), m & 0o7777) for n, m in modes.items()} == {
        "ro": (stat.S_IFDIR, 0o755), "ro/limits": (stat.S_IFREG, 0o444),
        "ro/ld.so.preload": (stat.S_IFREG, 0o444), "ro/libvgpu.so": (stat.S_IFREG, 0o444),
        "ro/vgpu": (stat.S_IFDIR, 0o755), "rw": (stat.S_IFDIR, 0o755),
        "rw/cache": (stat.S_IFREG, 0o666), "rw/limits": (stat.S_IFREG, 0o444),
        "owner": (stat.S_IFREG, 0o600)}
    lim = vgpu.read_limits_file(d / "ro/limits", 1)
    assert (lim.memory, lim.sm, lim.shared_cache) == ((512 * MIB,), (30,), vgpu.CACHE_FILE)
    assert vgpu.CACHE_FILE == "/run/nvctk/vgpu/cache"
    assert (p1.vgpu.container_state_dir, p1.vgpu.container_library) == (
        "/run/nvctk/vgpu", "/run/nvctk/libvgpu.so")
    assert (d / "ro/ld.so.preload").read_text() == (
        f"{vgpu_state.CONTAINER_LIBRARY}\n/usr/lib/libimage.so\n")
    for n in ("ro/libvgpu.so", "rw/limits"):
        assert (d / n).stat().st_size == 0
    # the accounting file: every page allocated at create (a full tmpfs never
    # turns libvgpu's first touch of a page into SIGBUS)
    cache = (d / "rw/cache").stat()
    assert cache.st_size == ledger.SHM_SIZE
    assert cache.st_blocks * 512 >= ledger.SHM_SIZE
    owner = json.loads((d / "owner").read_text())
    assert (owner["runtime_root"], owner["id"], owner["pid"]) == ("/tmp/rr", "box", os.getpid())
    assert owner["start"] == vgpu_gc.proc_start_time(os.getpid())


def test_create_installs_state_and_is_idempotent(bundles: Bundles,
                                                 config: nvconfig.Config) -> None:
    b = bundles.make({MEM: "512m", "CUDA_DEVICE_SM_LIMIT_0": "30",
                      vgpu.CACHE_VAR: "/tmp/mine"})
    (b / "rootfs/etc/ld.so.preload").write_text("/usr/lib/libimage.so\n# x\n")
    d = Path(vgpu_state.state_dir_for(config, "/tmp/rr", "box"))
    try:
        p1 = prep(b, config, "box", "/tmp/rr").edits
        assert p1 is not None and p1.vgpu is not None
        assert p1.vgpu.state_dir == str(d)
        first = spec_of(b)
        (d / "stale").write_text("from the previous run")
        assert len(mounts_at(d)) == 1
        # a second create without poststop (a crashed container): the stale tmpfs is
        # detached, a fresh one mounted
        p2 = prep(b, config, "box", "/tmp/rr").edits
        assert [i.fstype for i in mounts_at(d)] == ["tmpfs"]
        assert p2 == p1
        spec = spec_of(b)
        assert spec == first  # a second create changes nothing
        assert not (d / "stale").exists()  # the dir was recreated
        assert Edits.from_json((b / EDITS_FILE).read_text()) == p1
        hooks = spec["hooks"]
        assert [h["args"] for h in hooks["prestart"]] == [["nvctk-hook", "prestart"]]
        assert [h["args"] for h in hooks["poststop"]] == [
            ["nvctk-hook", "poststop", "--runtime-root", "/tmp/rr"]]
        assert hooks["poststop"][0]["env"] == hooks["prestart"][0]["env"]
        envs = [e for e in spec["process"]["env"] if e.startswith(vgpu.CACHE_VAR + "=")]
        assert envs == [f"{vgpu.CACHE_VAR}={vgpu.CACHE_FILE}"]
        _assert_state_dir_files(d, p1)
        # the image's own file was never touched
        assert (b / "rootfs/etc/ld.so.preload").read_text() == "/usr/lib/libimage.so\n# x\n"
        # its own small tmpfs: nosuid, nodev, noexec, bounded, private
        info = os.statvfs(d)
        assert info.f_blocks * info.f_frsize == vgpu_state.TMPFS_SIZE
        assert ledger.SHM_SIZE * 2 <= vgpu_state.TMPFS_SIZE <= 2 * MIB
        assert info.f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC) == (
            os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)
        assert not mounts_at(d)[0].shared
    finally:
        cleanup_state(config, d)
    assert not mounts_at(d) and not d.exists()


def test_stacked_stale_mounts_are_all_detached(bundles: Bundles,
                                               config: nvconfig.Config) -> None:
    b = bundles.make({MEM: "256m"})
    d = Path(vgpu_state.state_dir_for(config, "/tmp/st", "stack"))
    try:
        prep(b, config, "stack", "/tmp/st")
        # somebody mounted over it again (or a crash left more than one)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "stale", str(d)], check=True)
        assert len(mounts_at(d)) == 2
        prep(b, config, "stack", "/tmp/st")
        assert len(mounts_at(d)) == 1 and (d / "ro/limits").exists()
    finally:
        cleanup_state(config, d)
    assert not mounts_at(d) and not d.exists()


def test_shim_failure_after_install_leaves_no_mount(bundles: Bundles, config: nvconfig.Config,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    b = bundles.make({MEM: "256m"})
    d = vgpu_state.state_dir_for(config, "/tmp/sf", "fail")
    before = (b / "config.json").read_bytes()

    def no_spec(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        with monkeypatch.context() as mp:  # the spec cannot be written: after install
            mp.setattr(oci, "save_spec", no_spec)
            with pytest.raises(OSError, match="No space"):
                prep(b, config, "fail", "/tmp/sf")
        assert not mounts_at(d) and not os.path.exists(d)
        assert (b / "config.json").read_bytes() == before

        real_write = vgpu_state._write

        def half_write(path: str, text: str, mode: int, size: int = 0) -> None:
            if path.endswith("/cache"):
                raise OSError(errno.EIO, "I/O error")
            real_write(path, text, mode, size)

        with monkeypatch.context() as mp:  # install itself fails with its tmpfs mounted
            mp.setattr(vgpu_state, "_write", half_write)
            with pytest.raises(OSError, match="I/O error"):
                prep(b, config, "fail", "/tmp/sf")
        assert not mounts_at(d) and not os.path.exists(d)
    finally:
        cleanup_state(config, d)


def test_image_preload_never_leaves_the_rootfs(bundles: Bundles, tmp_path: Path) -> None:
    secret = tmp_path / "host-preload"
    secret.write_text("/host/only.so\n")
    b = bundles.make({})
    (b / "rootfs/etc/ld.so.preload").symlink_to(str(secret))  # absolute: resolves inside
    assert host_image.image_preload(str(b / "rootfs")) == []
    (b / "rootfs/etc/ld.so.preload").unlink()
    (b / "rootfs/etc/ld.so.preload").symlink_to("../../../../../../.." + str(secret))
    assert host_image.image_preload(str(b / "rootfs")) == []


def test_hook_refuses_a_state_dir_without_its_tmpfs(bundles: Bundles, config: nvconfig.Config,
                                                    tmp_path: Path) -> None:
    """The hook never binds a directory of the host's file system writable into a container."""
    from nvctk.base.errors import MountError
    from nvctk.base.log import HookLog
    from nvctk.hook import worker as hook_worker

    b = bundles.make({MEM: "256m"})
    plan = prep(b, config, "plain-dir", "/tmp/pd").edits
    assert plan is not None and plan.vgpu is not None
    d = plan.vgpu.state_dir
    log = HookLog(str(tmp_path / "hook.log"))
    try:
        assert hook_worker.check_vgpu_state(plan, log)
        saved = tmp_path / "saved"
        shutil.copytree(d, saved, symlinks=True)
        assert vgpu_gc.detach_mounts(d) == 1
        shutil.copytree(saved, d, symlinks=True, dirs_exist_ok=True)  # the same files, on
        # the host's file system
        with pytest.raises(MountError, match="not a tmpfs of its own"):
            hook_worker.check_vgpu_state(plan, log)
    finally:
        log.close()
        cleanup_state(config, d)
    assert not os.path.exists(d)


def _poststop(b: Path, sim: host.SimHost, cid: str = "box") -> subprocess.CompletedProcess[str]:
    state = {"ociVersion": "1.0.2", "id": cid, "status": "stopped", "bundle": str(b)}
    return subprocess.run([HOOK, "poststop"], input=json.dumps(state), capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **sim.env})


def test_poststop_removes_only_the_state_dir(bundles: Bundles, sim: host.SimHost,
                                             config: nvconfig.Config, tmp_path: Path) -> None:
    b = bundles.make({MEM: "1g"})
    plan = prep(b, config, "box", "/tmp/pp").edits
    assert plan is not None and plan.vgpu is not None
    d = Path(plan.vgpu.state_dir)
    assert (d / "ro/limits").exists() and len(mounts_at(d)) == 1
    r = _poststop(b, sim)
    assert r.returncode == 0, r.stderr
    assert not d.exists() and not mounts_at(d)
    assert _poststop(b, sim).returncode == 0  # again: nothing left, still fine

    # a plan naming anything but a state dir under state-dir is refused
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    text = (b / EDITS_FILE).read_text().replace(str(d), str(victim))
    (b / EDITS_FILE).write_text(text)
    r = _poststop(b, sim)
    assert r.returncode == 1 and "refusing to remove" in r.stderr, r.stderr
    assert (victim / "keep").exists()

    # no plan (not a GPU container): nothing to do
    (b / EDITS_FILE).unlink()
    assert _poststop(b, sim).returncode == 0


def _libcless_rootfs(path: Path, musl: bool) -> str:
    for d in ("bin", "lib", "etc", "proc", "dev", "sys", "tmp"):
        (path / d).mkdir(parents=True)
    shutil.copy("/bin/busybox", path / "bin/busybox")
    (path / "bin/sh").symlink_to("busybox")
    if musl:
        (path / "lib/ld-musl-x86_64.so.1").write_bytes(b"\x7fELF fake musl loader")
        (path / "lib/libc.musl-x86_64.so.1").symlink_to("ld-musl-x86_64.so.1")
    return str(path)


@pytest.mark.parametrize(("musl", "why"), [(True, "musl"), (False, "no glibc dynamic loader")])
def test_non_glibc_rootfs_with_limits_fails(musl: bool, why: str, bundles: Bundles,
                                            config: nvconfig.Config, tmp_path: Path) -> None:
    b = bundles.make({"CUDA_DEVICE_SM_LIMIT": "50"},
                     rootfs=_libcless_rootfs(tmp_path / "alpine", musl))
    before = (b / "config.json").read_bytes()
    with pytest.raises(RequestError, match=f"CUDA_DEVICE_SM_LIMIT is set.*{why}"):
        prep(b, config, "alp", "/tmp/aa")
    assert (b / "config.json").read_bytes() == before
    assert not os.path.exists(vgpu_state.state_dir_for(config, "/tmp/aa", "alp"))
    # without limits the same image is an ordinary GPU container
    spec = spec_of(b)
    spec["process"]["env"] = [e for e in spec["process"]["env"] if "SM_LIMIT" not in e]
    (b / "config.json").write_text(json.dumps(spec))
    plan = prep(b, config, "alp", "/tmp/aa").edits
    assert plan is not None and plan.vgpu is None


def test_glibc_detection_follows_links_inside_only(tmp_path: Path, base_rootfs: str) -> None:
    assert host_image.libc_kind(base_rootfs) == "glibc"  # /lib64 -> usr/lib64 -> ... (links)
    root = Path(_libcless_rootfs(tmp_path / "r", musl=False))
    (root / "lib64").symlink_to("/lib/x86_64-linux-gnu")  # exists on the host, not inside
    assert host_image.libc_kind(str(root)) == "none"
