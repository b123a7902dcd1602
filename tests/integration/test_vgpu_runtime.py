"""vGPU installation by the runtime (issue C §2) and its end-to-end tests (§3).

Planner/shim level: limits validated at create (the message names the variable,
config.json untouched), the accounting dir keyed by (runc --root, id) and
recreated on every create, `nvctk-hook poststop` removing it, musl images refused.
Through nvctk-runtime + real runc (slow): the cap seen by nvidia-smi and
cuMemGetInfo, CUDA_ERROR_OUT_OF_MEMORY at the cap, processes of one container
sharing it, env escapes that get nothing, and neighbours on one simulated GPU.
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
from support import wait
from support.vgpu import (
    GPU_MIB,
    HOOK,
    MEM,
    MIB,
    RUNTIME,
    Bundles,
    Runc,
    cleanup_state,
    create_logged,
    env_of,
    lines,
    mounts_at,
    mounts_under,
    prep,
    spec_of,
    stop,
    used_on_gpu1,
    wait_used,
)

base_rootfs, bundles, config, runc, sim = _vgpu.base_rootfs, _vgpu.bundles, _vgpu.config, _vgpu.runc, _vgpu.sim  # fixtures

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


WAIT_USED = """
# wait until the container's other processes hold more than $1 bytes
i=0
while :; do
  free=$(cuda-vectoradd --info | sed -n 's/.* free \\([0-9]*\\) total.*/\\1/p')
  [ -n "$free" ] && [ $((536870912 - free)) -gt $1 ] && break
  i=$((i+1)); [ $i -gt 200 ] && { echo "TIMEOUT waiting"; exit 9; }
  sleep 0.05
done
"""


@pytest.mark.slow
def test_capped_container_end_to_end(runc: Runc, bundles: Bundles, config: nvconfig.Config
                                     ) -> None:
    script = f"""
wait_used() {{ {WAIT_USED} }}
echo "preload: $(cat /etc/ld.so.preload | tr '\\n' ' ')"
echo "smi: $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)"
cuda-vectoradd --info | sed 's/^/info: /'
cuda-vectoradd --alloc-mib 600 | sed 's/^/big: /'
cuda-vectoradd --alloc-mib 400 | sed 's/^/fits: /'
echo x > /run/nvctk/vgpu/limits 2>/dev/null && echo "limits: WRITABLE" || echo "limits: ro"
echo x > /etc/ld.so.preload 2>/dev/null && echo "preload-file: WRITABLE" || echo "preload-file: ro"
ls /run/nvctk/vgpu/cache >/dev/null && echo "cache: present"
# two processes share the cap: one holds 300 MiB (+ its context), the other cannot
# get another 300, but 64 MiB still fit
vgpu_probe init ctx 0 alloc {300 * MIB} sleep 20000 >/dev/null &
holder=$!
wait_used {300 * MIB}
cuda-vectoradd --alloc-mib 300 | sed 's/^/second: /'
cuda-vectoradd --alloc-mib 64 | sed 's/^/small: /'
kill $holder
"""
    b = bundles.make({MEM: "512m"}, script)
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "preload:") == [f"preload: {vgpu_state.CONTAINER_LIBRARY} "]
    assert lines(out, "smi:") == ["smi: 512"]
    info = lines(out, "info: device 0:")
    assert len(info) == 1 and info[0].endswith(f"total {512 * MIB}"), out
    assert lines(out, "big:") == ["big: alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]
    assert lines(out, "fits:") == ["fits: alloc 400 MiB: OK"]
    assert lines(out, "limits:") == ["limits: ro"]
    assert lines(out, "preload-file:") == ["preload-file: ro"]
    assert lines(out, "cache:") == ["cache: present"]
    assert "TIMEOUT" not in out
    assert lines(out, "second:") == ["second: alloc 300 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]
    assert lines(out, "small:") == ["small: alloc 64 MiB: OK"]
    # poststop removed the accounting dir
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(runc.root), runc.ids[-1]))


@pytest.mark.exclusive  # free space of a shared file system
@pytest.mark.slow
def test_accounting_dir_is_a_bounded_tmpfs(runc: Runc, bundles: Bundles,
                                           config: nvconfig.Config) -> None:
    """A container cannot fill the host's /run through its writable accounting dir."""
    script = """
dd if=/dev/zero of=/run/nvctk/vgpu/fill bs=1M count=64 2>/tmp/dd.err \
  && echo "dd: OK" || echo "dd: FAILED $(grep -o 'No space left on device' /tmp/dd.err)"
echo "fill: $(stat -c %s /run/nvctk/vgpu/fill)"
i=0; while [ $i -lt 100 ] && touch /run/nvctk/vgpu/f$i 2>/dev/null; do i=$((i+1)); done
echo "files: $i"
rm -f /run/nvctk/vgpu/fill /run/nvctk/vgpu/f*
cuda-vectoradd --alloc-mib 600 | sed 's/^/big: /'
cuda-vectoradd --alloc-mib 400 | sed 's/^/fits: /'
"""
    b = bundles.make({MEM: "512m"}, script)
    free_before = os.statvfs(config.state_dir) if os.path.isdir(config.state_dir) else None
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "dd:") == ["dd: FAILED No space left on device"], out
    (filled,) = lines(out, "fill:")
    assert int(filled.split()[1]) <= vgpu_state.TMPFS_SIZE
    (files,) = lines(out, "files:")
    assert int(files.split()[1]) < vgpu_state.TMPFS_INODES
    # still capped after its dir was full
    assert lines(out, "big:") == ["big: alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]
    assert lines(out, "fits:") == ["fits: alloc 400 MiB: OK"]
    if free_before is not None:  # the host's file system under state-dir lost nothing
        after = os.statvfs(config.state_dir)
        # (a decrease: other work on the machine may free space meanwhile)
        assert (free_before.f_bavail - after.f_bavail) * after.f_frsize < 16 * MIB
    # poststop: the tmpfs is gone from the host, and the dir with it
    d = vgpu_state.state_dir_for(config, str(runc.root), runc.ids[-1])
    assert not mounts_at(d) and not os.path.exists(d)
    assert not mounts_under(config.state_dir)


@pytest.mark.slow
def test_state_dir_under_a_shared_mount(runc: Runc, bundles: Bundles, sim: host.SimHost,
                                        config: nvconfig.Config) -> None:
    """/run is shared on systemd hosts: nothing mounted in the container (the limits file
    on the accounting dir) propagates back, and nothing stays mounted afterwards."""
    top = config.state_dir
    os.makedirs(top, 0o700, exist_ok=True)
    subprocess.run(["mount", "--bind", top, top], check=True)
    try:
        subprocess.run(["mount", "--make-shared", top], check=True)
        assert mounts_at(top)[-1].shared
        b = bundles.make({MEM: "512m"}, "echo started; sleep 600")
        cid, p = runc.start(b)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "started"
        try:
            d = vgpu_state.state_dir_for(config, str(runc.root), cid)
            under = mounts_under(top)
            assert [(i.mount_point, i.fstype) for i in under] == [(d, "tmpfs")], under
            assert not under[0].shared
        finally:
            stop(runc, cid, p)
        assert not mounts_under(top) and not os.path.exists(d)
    finally:
        subprocess.run(["umount", "-l", top], check=True)


@pytest.mark.slow
def test_escapes_get_no_more_memory(runc: Runc, bundles: Bundles) -> None:
    script = """
try() { out=$("$@" cuda-vectoradd --alloc-mib 600); echo "$1 ${2%%=*}: $out"; }
try env -u CUDA_DEVICE_MEMORY_LIMIT
try env CUDA_DEVICE_MEMORY_LIMIT=0
try env CUDA_DEVICE_MEMORY_LIMIT=4g
try env CUDA_DEVICE_MEMORY_LIMIT_0=4g
try env CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/elsewhere
try env -u CUDA_DEVICE_MEMORY_SHARED_CACHE
try env LD_PRELOAD=
try env NVCTK_VGPU_LIMITS_FILE=/tmp/nolimits
: > /tmp/nolimits
rm -f /etc/ld.so.preload 2>/dev/null && echo "rm preload: DONE" || echo "rm preload: refused"
umount /etc/ld.so.preload 2>/dev/null && echo "umount: DONE" || echo "umount: refused"
try env
"""
    b = bundles.make({MEM: "512m"}, script)
    r = runc.run(b)
    assert r.returncode == 0, r.stdout + r.stderr
    tries = [x for x in r.stdout.splitlines() if x.startswith("env ")]
    assert len(tries) == 9, r.stdout
    for line in tries:
        assert line.endswith("alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"), r.stdout
    assert "rm preload: refused" in r.stdout and "umount: refused" in r.stdout


@pytest.mark.slow
def test_uncapped_container_has_no_interposer(runc: Runc, bundles: Bundles) -> None:
    script = """
[ -e /etc/ld.so.preload ] && echo "preload: PRESENT" || echo "preload: none"
[ -e /run/nvctk ] && echo "run-nvctk: PRESENT" || echo "run-nvctk: none"
echo "smi: $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)"
cuda-vectoradd --info | sed 's/^/info: /'
cuda-vectoradd --alloc-mib 3000 | sed 's/^/big: /'
"""
    b = bundles.make({}, script)
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "preload:") == ["preload: none"]
    assert lines(out, "run-nvctk:") == ["run-nvctk: none"]
    assert lines(out, "smi:") == [f"smi: {GPU_MIB}"]
    assert lines(out, "info: device 0:")[0].endswith(f"total {GPU_MIB * MIB}"), out
    assert lines(out, "big:") == ["big: alloc 3000 MiB: OK"]
    assert vgpu.CACHE_VAR not in env_of(spec_of(b))
    assert not (b / "rootfs/etc/ld.so.preload").exists()


def _hold(runc: Runc, bundles: Bundles, sim: host.SimHost, env: dict[str, str], mib: int
          ) -> tuple[str, subprocess.Popen[str]]:
    """A container on GPU 1 holding 2 x `mib` MiB (or what it can get) until killed."""
    b = bundles.make(env, f"vgpu_probe init ctx 0 alloc {mib * MIB} alloc {mib * MIB} "
                     "sleep 60000", gpu="1")
    return runc.start(b)


@pytest.mark.slow
def test_neighbours_on_one_gpu(runc: Runc, bundles: Bundles, sim: host.SimHost) -> None:
    victim = bundles.make({}, "cuda-vectoradd --alloc-mib 1500", gpu="1")
    base = used_on_gpu1(sim)

    # without caps the greedy one starves its neighbour
    cid, p = _hold(runc, bundles, sim, {}, GPU_MIB // 2 - 256)
    try:
        wait_used(sim, base + (GPU_MIB - 512) * MIB, p)
        r = runc.run(victim)
        assert r.returncode == 2 and "FAILED CUDA_ERROR_OUT_OF_MEMORY" in r.stdout, r.stdout
    finally:
        stop(runc, cid, p)

    # capped at 1 GiB it cannot take more than its cap, and the neighbour gets its memory
    cid, p = _hold(runc, bundles, sim, {MEM: "1g"}, 600)  # the second 600 MiB is refused
    try:
        assert p.stdout is not None
        # the probe answers each alloc: the first granted, the second refused at the cap
        out = wait.line(p.stdout, "alloc ", 60) + wait.line(p.stdout, "alloc ", 60)
        assert [x for x in out if x.startswith("alloc ")] == ["alloc 0", "alloc 2"], out
        assert base + 600 * MIB <= used_on_gpu1(sim) <= base + 1024 * MIB
        r = runc.run(victim)
        assert r.returncode == 0 and "alloc 1500 MiB: OK" in r.stdout, r.stdout
    finally:
        stop(runc, cid, p)
    capped = bundles.make({MEM: "1g"}, "cuda-vectoradd --alloc-mib 900; "
                          "cuda-vectoradd --alloc-mib 1100", gpu="1")
    r = runc.run(capped)
    assert r.stdout.splitlines() == ["alloc 900 MiB: OK",
                                     "alloc 1100 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]


def test_state_dir_removed_when_the_runtime_cannot_start(bundles: Bundles, sim: host.SimHost,
                                                         config: nvconfig.Config,
                                                         tmp_path: Path) -> None:
    broken = tmp_path / "broken-runc"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    cfg = tmp_path / "config.toml"
    text = Path(sim.config_path).read_text()
    cfg.write_text(text.replace('runtimes = ["runc", "crun"]', f'runtimes = ["{broken}"]'))
    b = bundles.make({MEM: "1g"})
    root = str(tmp_path / "runc-root")
    r = subprocess.run([RUNTIME, "--root", root, "create", "--bundle", str(b), "gone"],
                       env={**os.environ, "NVCTK_CONFIG": str(cfg)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "cannot exec" in r.stderr, r.stderr
    assert (b / EDITS_FILE).exists()  # the create got as far as the exec
    d = vgpu_state.state_dir_for(config, root, "gone")
    assert not os.path.exists(d) and not mounts_at(d)


# --- the container's env can only tighten; the node's share holds -------------------
SM = "CUDA_DEVICE_SM_LIMIT"
FILL = ("vgpu_probe init totalmem 0 totalmem 1 ctx 0 fill 16777216 ctx 1 fill 16777216; "
        "grep -E '^(CUDA_DEVICE|NVCTK)' /run/nvctk/vgpu/limits")


def _judge_512(out: str) -> None:
    """libvgpu's cap in the container: 512 MiB on both GPUs, of which the 64 MiB context
    reserve is charged first (so at most 448 MiB of 16 MiB allocations fit)."""
    assert lines(out, "totalmem") == [f"totalmem 0 {512 * MIB}"] * 2, out
    fills = [int(x.split()[2]) for x in lines(out, "fill")]
    assert len(fills) == 2 and all(256 * MIB <= f <= (512 - 64) * MIB for f in fills), out


@pytest.mark.slow
def test_env_cannot_loosen_another_variable(runc: Runc, bundles: Bundles) -> None:
    """An image's ENV and `docker run -e` land in one merged env: a per-device 0 or a
    larger per-device value, an SM share of 100 against 25 and a context reserve of 0
    each try to loosen what another variable set; the strictest value holds, in the
    limits file and in what libvgpu lets the container allocate."""
    env = {MEM: "512m", f"{MEM}_0": "0", f"{MEM}_1": "2g", SM: "25", f"{SM}_0": "100",
           vgpu.RESERVE_VAR: "0"}
    r = runc.run(bundles.make(env, FILL, gpu="0,1"))
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    _judge_512(out)
    file = dict(x.split("=", 1) for x in lines(out, "CUDA_DEVICE") + lines(out, "NVCTK"))
    file.pop(vgpu.CACHE_VAR)
    uuids = {k: file.pop(k) for k in list(file) if k.startswith(vgpu.UUID_VAR)}
    assert file == {f"{MEM}_0": str(512 * MIB), f"{MEM}_1": str(512 * MIB),
                    f"{SM}_0": "25", f"{SM}_1": "25", vgpu.RESERVE_VAR: str(vgpu.DEFAULT_RESERVE)}
    assert sorted(uuids) == [f"{vgpu.UUID_VAR}_0", f"{vgpu.UUID_VAR}_1"]  # libvgpu's device map


def _annotate(b: Path, annotations: dict[str, object]) -> None:
    spec = spec_of(b)
    spec.setdefault("annotations", {}).update(annotations)
    (b / "config.json").write_text(json.dumps(spec, indent="\t"))


def _grant(config: nvconfig.Config, devices: list[tuple[str, int, int]], key: bytes | None = None,
           resource: str = "nvidia.com/vgpu") -> tuple[str, str]:
    from nvctk.vgpu import authority

    if key is None:
        key = authority.load_key(config.authority_key, create=True)
        assert key is not None
    return authority.make(resource, devices, key)


@pytest.mark.slow
def test_node_share_holds_against_the_pod_env(runc: Runc, bundles: Bundles, sim: host.SimHost,
                                              config: nvconfig.Config) -> None:
    """The device plugin's share in its nvctk.io/vgpu.* annotation: a Pod env that replaced
    the plugin's CUDA_DEVICE_MEMORY_LIMIT with 0 and an image's per-device 0 leave the
    container at the share the node granted."""
    g0, g1 = (g.uuid for g in sim.topology.gpus)
    k, v = _grant(config, [(g0, 512 * MIB, 25), (g1, 512 * MIB, 25)])
    b = bundles.make({MEM: "0", f"{MEM}_0": "0", SM: "0"}, FILL, gpu="0,1")
    _annotate(b, {k: v})
    r = runc.run(b)
    assert r.returncode == 0, r.stdout + r.stderr
    _judge_512(r.stdout)
    assert f"{SM}_0=25" in r.stdout


def _refused(b: Path, config: nvconfig.Config, tmp_path: Path, match: str) -> None:
    before = (b / "config.json").read_bytes()
    with pytest.raises(RequestError, match=match):
        prep(b, config, "cid", str(tmp_path / "runc-root"))
    assert (b / "config.json").read_bytes() == before
    assert not (b / EDITS_FILE).exists()
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(tmp_path / "runc-root"), "cid"))


def _edited(k: str, v: str, **change: object) -> tuple[str, str]:
    rec = json.loads(v)
    rec.update(change)
    return k, json.dumps(rec)


@pytest.mark.parametrize("case", ["forged", "other-node", "loosened", "moved", "stale-device",
                                  "not-a-string", "garbage"])
def test_bad_share_annotation_is_refused(case: str, bundles: Bundles, sim: host.SimHost,
                                         config: nvconfig.Config, tmp_path: Path) -> None:
    """An annotation the node's key does not verify, or one for other GPUs than the
    container's, refuses the container (a share that cannot be read must never become
    no share), and changes nothing."""
    g0, g1 = (g.uuid for g in sim.topology.gpus)
    k, v = _grant(config, [(g0, 512 * MIB, 25)])
    match = "MAC does not verify"
    ann: dict[str, object]
    if case == "forged":  # made up, with a MAC of no key
        ann = dict([_edited(k, v, mac="0" * 64)])
    elif case == "other-node":  # a genuine annotation of another node's plugin
        ann = dict([_grant(config, [(g0, 4096 * MIB, 100)], key=os.urandom(32))])
    elif case == "loosened":  # a genuine one, with its share raised
        ann = dict([_edited(k, v, devices=[[g0, 4096 * MIB, 100]])])
    elif case == "moved":  # a genuine value under another resource's key
        ann = {k + "-big": v}
    elif case == "stale-device":  # genuine, but for GPU 1, while the container gets GPU 0
        ann = dict([_grant(config, [(g1, 512 * MIB, 25)])])
        match = "would not hold there"
    elif case == "not-a-string":
        ann, match = {k: 7}, "not a string"
    else:
        ann, match = {k: "{not json"}, "not JSON"
    b = bundles.make({MEM: "0"})
    _annotate(b, ann)
    _refused(b, config, tmp_path, match)


def test_share_annotation_needs_the_node_key(bundles: Bundles, sim: host.SimHost,
                                             config: nvconfig.Config, tmp_path: Path) -> None:
    """No key, or a key file another user could have written: refused, never uncapped."""

    g0 = sim.topology.gpus[0].uuid
    k, v = _grant(config, [(g0, 512 * MIB, 25)])
    fields = {f: getattr(config, f) for f in ("driver_root", "ldconfig", "log_file",
                                              "state_dir", "extra_mounts")}
    missing = nvconfig.Config(**fields, authority_key=str(tmp_path / "none.key"))
    b = bundles.make({})
    _annotate(b, {k: v})
    _refused(b, missing, tmp_path, "no authority key")
    loose = tmp_path / "loose.key"
    loose.write_bytes(os.urandom(32))
    loose.chmod(0o644)
    _refused(b, nvconfig.Config(**fields, authority_key=str(loose)), tmp_path, "refuses it")


def test_cdi_routes_cannot_drop_the_share(bundles: Bundles, sim: host.SimHost,
                                          config: nvconfig.Config, tmp_path: Path) -> None:
    """CDI mode applies no vGPU limit, so a container with the node's share is refused
    there (cdi-annotations strategy); a GPU the engine put in by CDI itself (cdi-cri:
    NVIDIA_VISIBLE_DEVICES=void, /dev/nvidia0 in the spec) is refused too."""
    g0 = sim.topology.gpus[0].uuid
    k, v = _grant(config, [(g0, 512 * MIB, 25)])
    b = bundles.make({}, gpu=f"nvidia.com/gpu={g0}")
    _annotate(b, {k: v})
    _refused(b, config, tmp_path, "not supported in CDI mode")
    b = bundles.make({}, gpu="void")
    spec = spec_of(b)
    spec["linux"].setdefault("devices", []).append(
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0})
    (b / "config.json").write_text(json.dumps(spec))
    _annotate(b, {k: v})
    _refused(b, config, tmp_path, "a route nvctk cannot cap")
    # without the share, such a container is none of nvctk's business (as before)
    spec = spec_of(b)
    del spec["annotations"][k]
    (b / "config.json").write_text(json.dumps(spec))
    assert prep(b, config, "cid", str(tmp_path / "runc-root")).edits is None


def test_forged_share_fails_the_create_in_runcs_log(bundles: Bundles, sim: host.SimHost,
                                                    config: nvconfig.Config,
                                                    tmp_path: Path) -> None:
    """Through nvctk-runtime: the refusal is an error in runc's log naming the annotation,
    config.json is untouched and no state is made."""
    g0 = sim.topology.gpus[0].uuid
    _grant(config, [])  # the node has its key (the device plugin made it)
    k, v = _grant(config, [(g0, 512 * MIB, 25)], key=os.urandom(32))
    b = bundles.make({MEM: "0"})
    _annotate(b, {k: v})
    before = (b / "config.json").read_bytes()
    r, log = create_logged(tmp_path, b, sim)
    assert r.returncode != 0
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(k in e["msg"] and "MAC does not verify" in e["msg"] and e["level"] == "error"
               for e in entries), entries
    assert (b / "config.json").read_bytes() == before
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(tmp_path / "runc-root"), "cid"))
