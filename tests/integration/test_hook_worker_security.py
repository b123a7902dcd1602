"""The host side against hostile images and containers (the hook worker, the state files).

Each test fails on the code before its fix:
- CUDA_MPS_PIPE_DIRECTORY in the image's env chose the *host* directory bound
  writable into the container (any host dir: /etc, /).
- The image's /etc/ld.so.preload was opened O_RDONLY before its type was checked:
  a FIFO hung nvctk-runtime create for ever (a device node would be opened).
- read_usage followed a link (or opened a FIFO/device) that a container put in
  its writable accounting dir in place of `cache`.
- A GPU container whose rootfs holds its own bundle could rewrite nvctk-edits.json
  (the host paths the hook binds, the dir poststop deletes).
- The chrooted ldconfig had no effective time limit: an image whose
  /etc/ld.so.conf is a FIFO kept the hook waiting for ever.
- The vGPU state dir (per-container dirs a container can write) was open to
  every host user.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import support.sim as _sim
from nvctk.base import config as nvconfig
from nvctk.base.errors import SpecError
from nvctk.base.log import HookLog, Logger
from nvctk.edits import MAX_PRELOAD_BYTES, Edits, Vgpu
from nvctk.edits_file import EDITS_FILE
from nvctk.hook import children as hook_children
from nvctk.hook import ldconfig
from nvctk.hook.entry import HookRun
from nvctk.hook.inputs import parse_state
from nvctk.hook.poststop import poststop
from nvctk.host import image as host_image
from nvctk.host.inventory import HostInfo
from nvctk.request.parse import request_from_spec
from nvctk.runtime.create import prepare_bundle
from nvctk.sim.host import SimHost
from nvctk.vgpu import gc as vgpu_gc
from nvctk.vgpu import ledger
from nvctk.vgpu import limits as vgpu
from nvctk.vgpu import state as vgpu_state
from nvctk.vgpu.limits import VgpuLimits
from support import wait
from support.planning import make_plan
from support.procs import in_private_ns

NVD = "NVIDIA_VISIBLE_DEVICES"
BIN = os.path.dirname(sys.executable)
RUNTIME = os.path.join(BIN, "nvctk-runtime")


cfg, host = _sim.cfg, _sim.host  # fixtures


def _spec(env: dict[str, str]) -> dict[str, object]:
    return {"process": {"env": [f"{k}={v}" for k, v in env.items()]}, "root": {"path": "rootfs"}}


# --- MPS pipe dir ------------------------------------------------------------------------------
def test_mps_pipe_env_never_picks_the_host_dir(cfg: nvconfig.Config, host: HostInfo,
                                               sim_host: SimHost) -> None:
    secret = os.path.join(sim_host.root, "review-host-secret")
    os.makedirs(secret, exist_ok=True)
    try:
        for value in ("/review-host-secret", "/tmp/../review-host-secret", "/"):
            p = make_plan(request_from_spec(_spec({NVD: "0", "CUDA_MPS_PIPE_DIRECTORY": value}), cfg),  # type: ignore[arg-type]
                          cfg, host)
            assert p is not None
            bad = [x for x in p.mounts
                   if os.path.realpath(x.host_path) in (os.path.realpath(secret),
                                                        os.path.realpath(sim_host.root))]
            assert bad == [], bad
            assert all(x.container_path != "/" for x in p.mounts)
    finally:
        os.rmdir(secret)


def test_mps_host_dir_that_is_a_link_is_not_bound(cfg: nvconfig.Config, host: HostInfo,
                                                  sim_host: SimHost, tmp_path: Path) -> None:
    os.makedirs(os.path.join(sim_host.root, "tmp"), exist_ok=True)
    link = os.path.join(sim_host.root, "tmp/nvidia-mps")
    os.symlink(str(tmp_path), link)
    try:
        p = make_plan(request_from_spec(_spec({NVD: "0"}), cfg), cfg, host)  # type: ignore[arg-type]
        assert p is not None
        assert all(x.host_path != link for x in p.mounts)
    finally:
        os.unlink(link)



def _execed(pid: int, prog: str) -> bool:
    """Whether pid runs prog now: unshare(1) has set up its namespace and exec'd."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")) == prog
    except OSError:
        return False

def _opens_for_reading(fifo: str, call: Callable[[], object]) -> bool:
    """Run call() and tell whether it opened the FIFO for reading.

    A non-blocking writer can open a FIFO only while it has a reader; the watcher's
    open both proves the reader and lets a reader blocked in open() go on."""
    done, opened = threading.Event(), threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                opened.set()
            except OSError:  # ENXIO: nobody has it open for reading
                pass
            time.sleep(0.005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        call()
    finally:
        done.set()
        t.join()
    return opened.is_set()


@pytest.mark.parametrize("where", ["image ld.so.preload", "accounting cache"])
def test_a_fifo_planted_by_the_container_is_never_opened(where: str, tmp_path: Path) -> None:
    """A FIFO (or device) where a regular file is read would hang the runtime or be
    opened on the host as root: it is refused from its type alone."""
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    if where == "image ld.so.preload":
        fifo, error, read = root / "etc/ld.so.preload", SpecError, \
            lambda: host_image.image_preload(str(root))
    else:
        fifo, error, read = tmp_path / "cache", ValueError, lambda: ledger.read_usage(fifo)
    os.mkfifo(fifo)

    def refused() -> None:
        with pytest.raises(error, match="regular file"):
            read()

    assert not _opens_for_reading(str(fifo), refused)


# --- the image's /etc/ld.so.preload ---------------------------------------------------------------
def test_image_preload_still_reads_a_file_and_a_link_inside(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "opt").mkdir()
    (root / "opt/preload").write_text("/usr/lib/libfoo.so # comment\n/lib/libbar.so:/x.so\n")
    os.symlink("/opt/preload", root / "etc/ld.so.preload")  # absolute: resolved in the rootfs
    assert host_image.image_preload(str(root)) == ["/usr/lib/libfoo.so", "/lib/libbar.so",
                                                   "/x.so"]


def test_image_preload_size_bound(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/ld.so.preload").write_bytes(b"a" * (MAX_PRELOAD_BYTES + 10))
    with pytest.raises(SpecError, match="larger than"):
        host_image.image_preload(str(root))


# --- read_usage on a container-writable dir ------------------------------------------------------
def _valid_cache(path: Path) -> None:
    data = bytearray(ledger.SHM_SIZE)
    data[0:8] = (ledger.SHM_MAGIC).to_bytes(4, "little") + (ledger.SHM_VERSION).to_bytes(4, "little")
    data[ledger.DEVS_OFFSET:ledger.DEVS_OFFSET + 8] = b"GPU-host"
    path.write_bytes(bytes(data))


def test_read_usage_refuses_a_link(tmp_path: Path) -> None:
    target = tmp_path / "host-file"
    _valid_cache(target)
    assert "GPU-host" in ledger.read_usage(target)  # the real thing is read
    d = tmp_path / "state"
    d.mkdir()
    os.symlink(target, d / "cache")  # what a container can do in its accounting dir
    with pytest.raises(ValueError, match="regular file"):
        ledger.read_usage(d / "cache")


def test_read_usage_garbage_uuid_is_not_a_crash(tmp_path: Path) -> None:
    p = tmp_path / "cache"
    _valid_cache(p)
    data = bytearray(p.read_bytes())
    data[ledger.DEVS_OFFSET:ledger.DEVS_OFFSET + 4] = b"\xff\xfe\x80G"
    p.write_bytes(bytes(data))
    assert len(ledger.read_usage(p)) == 1


# --- a rootfs that holds its own bundle -----------------------------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.parametrize("root_path", [".", ".."])
def test_shim_refuses_rootfs_holding_the_bundle(root_path: str, cfg: nvconfig.Config,
                                                tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    b = outer / "bundle"
    b.mkdir(parents=True)
    spec = {"ociVersion": "1.0.2", "root": {"path": root_path},
            "process": {"args": ["true"], "env": [f"{NVD}=0"], "cwd": "/"}}
    (b / "config.json").write_text(json.dumps(spec))
    before = (b / "config.json").read_bytes()
    with pytest.raises(SpecError, match="contains the bundle"):
        prepare_bundle(str(b), cfg, argv0=RUNTIME, container_id="cid", runtime_root="/r")
    assert not (b / EDITS_FILE).exists()
    assert (b / "config.json").read_bytes() == before


def test_bundle_in_rootfs() -> None:
    from nvctk.oci.spec import bundle_in_rootfs

    assert bundle_in_rootfs("/b", "/b") and bundle_in_rootfs("/a/b", "/a")
    assert bundle_in_rootfs("/a/b", "/")
    assert not bundle_in_rootfs("/a/b", "/a/b/rootfs") and not bundle_in_rootfs("/a/bc", "/a/b")


# --- ldconfig is bounded in time -------------------------------------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, mount namespaces)")
def test_ldconfig_fifo_conf_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's own path: its ldconfig child becomes ldconfig, the hook's process kills it."""
    ld = shutil.which("ldconfig", path="/sbin:/usr/sbin")
    if ld is None:
        pytest.skip("no host ldconfig")
    root = tmp_path / "rootfs"
    for d in ("etc", "proc", "usr/lib/x86_64-linux-gnu"):
        (root / d).mkdir(parents=True)
    fifo = root / "etc/ld.so.conf"
    os.mkfifo(fifo)
    monkeypatch.setattr(ldconfig, "LDCONFIG_TIMEOUT", 2.0)
    log = HookLog(str(tmp_path / "hook.log"), "debug")
    plan = Edits("1", ("compute",), (), ldconfig=ld)
    done = threading.Event()

    def rescue() -> None:  # without the limit: fail (no kill logged) instead of hanging
        if not done.wait(20):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    # a mount namespace for the worker to enter, as a container's
    ns = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "60"])
    threading.Thread(target=rescue, daemon=True).start()
    try:
        wait.until(lambda: _execed(ns.pid, "sleep"), 10, "unshare to exec sleep in its namespace")
        hook_children.apply_edits(plan, str(root), ns.pid, log)
    finally:
        done.set()
        ns.kill()
        ns.wait()
        log.close()
    assert "killed after 2s" in (tmp_path / "hook.log").read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespaces)")
def test_ldconfig_runs_only_in_the_rootfs_the_worker_mounted_into(tmp_path: Path) -> None:
    """The ldconfig child opens the rootfs by path in its own namespace: a directory
    other than the one the worker mounted into (its st_dev, st_ino, sent with the
    signal) is refused before the chroot, and nothing is exec'd."""
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (tmp_path / "not-a-program").write_bytes(b"")
    st = os.stat(root)

    def become() -> None:
        devnull = os.open(os.devnull, os.O_RDWR)
        prog = os.open(tmp_path / "not-a-program", os.O_RDONLY)  # an exec of it would fail
        with pytest.raises(OSError) as e:
            ldconfig.become_ldconfig(Edits("1", ("compute",), ()), str(root),
                                     (st.st_dev, st.st_ino + 1), prog, devnull,
                                     HookLog("", "debug"))
        assert str(e.value) == f"{root} is not the directory the worker mounted into"

    in_private_ns(become)


# --- the state dir ------------------------------------------------------------------------------------
def test_new_state_dir_is_root_only(tmp_path: Path) -> None:
    top = tmp_path / "state"
    cfg = nvconfig.Config(state_dir=str(top))
    lib = tmp_path / "libvgpu.so"
    lib.write_bytes(b"")
    d = vgpu_state.state_dir_for(cfg, "/r", "cid")
    v = Vgpu(str(lib), vgpu_state.CONTAINER_LIBRARY, d, vgpu.VGPU_DIR,
                 VgpuLimits(memory=(1 << 30,), sm=(0,)).values())
    vgpu_state.install(v, cfg)
    try:
        assert stat.S_IMODE(os.stat(top).st_mode) == 0o700
        # ro/ and rw/ are reached through their bind mounts; nothing else is
        for sub, mode in (("ro", 0o755), ("rw", 0o755), ("rw/cache", 0o666),
                          ("ro/limits", 0o444), ("ro/ld.so.preload", 0o444)):
            assert stat.S_IMODE(os.stat(os.path.join(d, sub)).st_mode) == mode, sub
    finally:
        vgpu_gc.remove_state_dir(d, cfg)  # its tmpfs too


def test_poststop_never_leaves_state_dir(tmp_path: Path) -> None:
    top = tmp_path / "state"
    top.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    cfg = nvconfig.Config(state_dir=str(top))
    # a symlinked container dir and links planted inside a real one are removed, not followed
    link = top / ("0" * 16 + "-evil")
    os.symlink(victim, link)
    real = top / ("1" * 16 + "-c")
    real.mkdir()
    os.symlink(victim, real / "planted")
    os.symlink(victim / "keep", real / "cache")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for d in (str(link), str(real), str(top / ".."), str(victim),
              str(top / ("2" * 16 + "-x") / ".." / ".." / "victim")):
        plan = Edits("1", (), (), vgpu=Vgpu("/l", "/c", d, "/v", {}))
        (bundle / EDITS_FILE).write_text(plan.to_json())
        state = json.dumps({"id": "c", "pid": 0, "bundle": str(bundle), "status": "stopped"})
        hook = HookRun("poststop", None, parse_state(state), HookLog(""), config=cfg)
        try:
            poststop(hook)
        except SpecError:
            pass
    assert (victim / "keep").read_text() == "x"
    assert not os.path.lexists(link) and not os.path.lexists(real)


def test_hook_log_is_opened_on_the_host(tmp_path: Path) -> None:
    """Logger lines never carry a raw newline (ids, annotations are hostile)."""
    path = tmp_path / "log"
    Logger(str(path), "info", "x").info("a\nERROR: forged")
    assert len(path.read_text().splitlines()) == 1

