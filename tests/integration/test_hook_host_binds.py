"""Nothing nvctk-hook or its ldconfig creates lands on a host directory bound into
the container.

A host directory bound read-write into the rootfs (a volume, extra-mounts, the
MPS pipe dir) is the host's: the hook creates mount targets, parent dirs and
links only on the rootfs's own mounts (skipping optional ones, refusing
required ones, naming the mount), and the chrooted ldconfig sees every such
bind read-only in its private namespace. Each case: the host directory holds
exactly what it held before.

The "container" is canary.harness's fake one: its `pre` command binds the host
directory into the rootfs in the container's namespace, as runc does for the
spec's mounts before prestart hooks.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from nvctk.edits import Mount, Symlink
from nvctk.sim.host import SimHost
from support.canary.harness import cpath, fake_container, make_bundle, make_plan, run_hook
from support.fs import snapshot

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespaces)")

LIB = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture
def host_dir(tmp_path: Path) -> Path:
    d = tmp_path / "host-dir"
    d.mkdir()
    (d / "keep").write_text("the host's\n")
    return d


def _bind(host: Path, root: str, cpath_: str) -> str:
    return f"mount --bind {host} {root}/{cpath_.lstrip('/')}"


def test_host_dir_at_etc(sim_host: SimHost, rootfs: Callable[..., str], host_dir: Path,
                         tmp_path: Path) -> None:
    """ldconfig would write /etc/ld.so.cache into the host's directory."""
    root = rootfs()
    bundle = make_bundle(str(tmp_path / "bundle"), root, make_plan(sim_host))
    before = snapshot(host_dir)
    with fake_container(pre=_bind(host_dir, root, "/etc")) as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
        assert os.path.exists(cpath(pid, root, "/etc/keep"))  # the bind is there
    assert snapshot(host_dir) == before
    log = bundle.log_text()
    assert "read-only in its namespace (not the container's rootfs): /etc" in log, log
    assert "step ldconfig" in log and "Read-only file system" in log, log


def _mps_at_etc_then_smi(sim_host: SimHost, root: str, host_dir: Path, tmp_path: Path,
                         before: tuple[str, ...]) -> tuple[str, str]:
    """The hook on a plan that mounts nvidia-smi at each of `before`, binds the host's
    host_dir at /etc (as CUDA_MPS_PIPE_DIRECTORY=/etc does), then nvidia-smi below it:
    the last is skipped, the host dir unchanged. (bundle dir, the hook's log)"""
    smi = os.path.join(sim_host.bin_dir, "nvidia-smi")
    mps = Mount(str(host_dir), "/etc", "dir", read_only=False, noexec=True)
    plan = make_plan(sim_host, extra=[*(Mount(smi, p) for p in before), mps,
                                      Mount(smi, "/etc/nvidia/nvidia-smi")])
    bundle = make_bundle(str(tmp_path / "bundle"), root, plan)
    unchanged = snapshot(host_dir)
    with fake_container() as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
    assert snapshot(host_dir) == unchanged
    log = bundle.log_text()
    assert "skip /etc/nvidia/nvidia-smi: not created: its directory is on " in log, log
    return bundle.path, log


def test_mps_dir_bound_over_etc_by_the_plan(sim_host: SimHost, rootfs: Callable[..., str],
                                            host_dir: Path, tmp_path: Path) -> None:
    """CUDA_MPS_PIPE_DIRECTORY=/etc: the hook itself binds the host's MPS dir at /etc."""
    _, log = _mps_at_etc_then_smi(sim_host, rootfs(), host_dir, tmp_path, before=())
    assert "a mount that is not the container's own rootfs" in log


def test_a_dir_mount_is_seen_by_the_mounts_after_it(sim_host: SimHost,
                                                    rootfs: Callable[..., str],
                                                    host_dir: Path, tmp_path: Path) -> None:
    """The hook remembers the parent dirs it resolved (one lookup per lib dir); a
    directory it mounts (the MPS dir at /etc) must end that: a later mount below it
    is on the host's directory, never in the rootfs's /etc/nvidia it hides."""
    root = rootfs()
    _mps_at_etc_then_smi(sim_host, root, host_dir, tmp_path, before=("/etc/nvidia/first",))
    assert os.path.isfile(os.path.join(root, "etc/nvidia/first"))  # made before the bind
    assert not os.path.exists(os.path.join(root, "etc/nvidia/nvidia-smi"))


def test_host_dir_at_the_lib_dir_refuses_required_libraries(
        sim_host: SimHost, rootfs: Callable[..., str], host_dir: Path, tmp_path: Path) -> None:
    root = rootfs()
    bundle = make_bundle(str(tmp_path / "bundle"), root, make_plan(sim_host))
    before = snapshot(host_dir)
    with fake_container(pre=_bind(host_dir, root, LIB)) as pid:
        r = run_hook(bundle, pid)
    assert r.returncode == 1
    assert r.stderr.startswith(f"nvctk-hook: prestart: step mount: {LIB}/libnvidia-ml.so."), r.stderr
    assert f"not created: its directory is on {root}{LIB} (" in r.stderr, r.stderr
    assert snapshot(host_dir) == before


def test_optional_files_and_links_are_skipped(sim_host: SimHost, rootfs: Callable[..., str],
                                              host_dir: Path, tmp_path: Path) -> None:
    """No required library there: the optional targets and links are skipped, the rest
    of the container is set up."""
    root = rootfs()
    smi = os.path.join(sim_host.bin_dir, "nvidia-smi")
    plan = make_plan(sim_host, extra=[Mount(smi, "/vol/bin/nvidia-smi"),
                                      Mount(smi, "/vol/nvidia-smi")])
    plan = plan.replace(symlinks=(*plan.symlinks, Symlink("/vol/libfoo.so", "libfoo.so.1")))
    os.makedirs(os.path.join(root, "vol"))
    bundle = make_bundle(str(tmp_path / "bundle"), root, plan)
    before = snapshot(host_dir)
    with fake_container(pre=_bind(host_dir, root, "/vol")) as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
        assert os.path.exists(cpath(pid, root, "/usr/bin/nvidia-smi"))
    assert snapshot(host_dir) == before
    log = bundle.log_text()
    for skipped in ("skip /vol/bin/nvidia-smi: not created", "skip /vol/nvidia-smi: not created",
                    "skip link /vol/libfoo.so: not created"):
        assert skipped in log, log


def test_image_symlinks_onto_a_host_dir(sim_host: SimHost, rootfs: Callable[..., str],
                                        host_dir: Path, tmp_path: Path) -> None:
    """The image's links lead the hook's targets, and its ld.so.conf leads ldconfig's
    SONAME links, into a volume: neither writes there."""
    root = rootfs()
    v = sim_host.topology.driver_version
    # a library with a SONAME in the volume: ldconfig would add libcuda.so.1 beside it
    shutil.copy(os.path.join(sim_host.lib_dir, f"libcuda.so.{v}"), host_dir / f"libcuda.so.{v}")
    (host_dir / "opt").mkdir()
    os.makedirs(os.path.join(root, "vol"))
    os.symlink("/vol/opt", os.path.join(root, "opt"))
    Path(root, "etc/ld.so.conf.d/vol.conf").write_text("/vol\n")
    smi = os.path.join(sim_host.bin_dir, "nvidia-smi")
    plan = make_plan(sim_host, extra=[Mount(smi, "/opt/nvidia/bin/nvidia-smi")])
    bundle = make_bundle(str(tmp_path / "bundle"), root, plan)
    before = snapshot(host_dir)
    with fake_container(pre=_bind(host_dir, root, "/vol")) as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
    assert snapshot(host_dir) == before
    log = bundle.log_text()
    assert "skip /opt/nvidia/bin/nvidia-smi: not created" in log, log
    assert "read-only in its namespace (not the container's rootfs): /vol" in log, log


def test_own_tmpfs_and_self_binds_are_the_rootfs(sim_host: SimHost, rootfs: Callable[..., str],
                                                 tmp_path: Path) -> None:
    """A file system only the container has (podman's /run tmpfs) and a bind of the
    rootfs's own directory onto itself are the container's: targets are made there."""
    root = rootfs()
    plan = make_plan(sim_host)  # /run/nvidia-persistenced/socket: created under /run
    bundle = make_bundle(str(tmp_path / "bundle"), root, plan)
    pre = (f"mount -t tmpfs run {root}/run && mount --bind {root}{LIB} {root}{LIB}")
    with fake_container(pre=pre) as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
        assert os.path.exists(cpath(pid, root, "/run/nvidia-persistenced/socket"))
        assert os.readlink(cpath(pid, root, f"{LIB}/libcuda.so")) == "libcuda.so.1"
    log = bundle.log_text()
    assert "not created" not in log and "ldconfig refreshed" in log, log
