"""A real CDI consumer: Debian's podman runs a GPU container from nvctk's CDI spec.

podman (4.3 in Debian 12) resolves `--device vendor/class=name` against the specs in
/etc/cdi and /var/run/cdi, and no flag or containers.conf key of that version moves
them: the spec goes to /var/run/cdi under a file name and a vendor of this test's own,
so it can neither replace nor clash with a real spec, and is removed afterwards.
Everything else of podman's is private: storage, run and tmp dirs under a temp dir,
its own containers.conf and storage.conf, no network, and (for the image import, which
caches blob digests under /var/lib/containers) a /var/lib of its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.host import SimHost
from support import wait
from support.daemons import umount_below
from support.podman import private_podman

# exclusive: podman reads every spec in the host's /var/run/cdi
pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.exclusive]

SPEC_DIR = Path("/var/run/cdi")
IMAGE = "localhost/nvctk-cdi-test:latest"
Podman = Callable[..., subprocess.CompletedProcess[str]]

@pytest.fixture
def podman() -> Iterator[Podman]:
    """`podman` with private storage and config; removes its containers, images and
    mounts afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: runs podman as root")
    exe = shutil.which("podman")
    if exe is None:
        pytest.skip("podman is not installed (make setup installs it: apt-get install podman)")
    # a short path: podman refuses a runroot longer than 50 characters
    work = Path(tempfile.mkdtemp(prefix="nvctk-p-", dir="/tmp"))
    _, env, base = private_podman(exe, work)

    def run(*args: str, timeout: float = 120, input: bytes | None = None,
            private_var_lib: bool = False) -> subprocess.CompletedProcess[str]:
        argv = [*base, *args]
        if private_var_lib:
            # image copies write containers/image's blob-info cache to
            # /var/lib/containers/cache for root, and podman 4.3 has no setting for it:
            # give the command a /var/lib of its own, in a mount namespace of its own
            (work / "varlib").mkdir(exist_ok=True)
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                    'mount --bind "$0" /var/lib; exec "$@"', str(work / "varlib"), *argv]
        res = subprocess.run(argv, env=env, capture_output=True, timeout=timeout, input=input)
        return subprocess.CompletedProcess(res.args, res.returncode,
                                           res.stdout.decode(errors="replace"),
                                           res.stderr.decode(errors="replace"))

    try:
        yield run
    finally:
        run("rm", "--all", "--force", timeout=60)
        run("rmi", "--all", "--force", timeout=60)
        umount_below(work)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def cdi_kind(sim_host: SimHost, run_nvctk: Callable[..., subprocess.CompletedProcess[str]],
             ) -> Iterator[str]:
    """nvctk's spec for sim_host in /var/run/cdi, under a vendor of this test's own."""
    tag = uuid.uuid4().hex[:12]
    vendor, cls = f"t{tag}.nvctk.test", "gpu"
    made_dir = not SPEC_DIR.exists()
    spec = SPEC_DIR / f"nvctk-test-{tag}.yaml"
    try:
        res = run_nvctk("cdi", "generate", "--output", str(spec), "--vendor", vendor,
                        "--class", cls, config=sim_host.config_path)
        assert res.returncode == 0, res.stderr
        yield f"{vendor}/{cls}"
    finally:
        spec.unlink(missing_ok=True)
        if made_dir:
            try:
                SPEC_DIR.rmdir()
            except OSError:  # someone else's spec landed there meanwhile
                pass


def test_podman_runs_cdi_device_from_nvctk_spec(podman: Podman, cdi_kind: str,
                                                sim_host: SimHost,
                                                rootfs: Callable[..., str]) -> None:
    tar = subprocess.run(["tar", "-C", rootfs(), "-c", "."], capture_output=True, check=True)
    res = podman("import", "-", IMAGE, input=tar.stdout, private_var_lib=True)
    assert res.returncode == 0, res.stderr
    gpu0 = sim_host.topology.gpus[0]
    res = podman("run", "--rm", "--network", "none", "--device", f"{cdi_kind}=0", IMAGE,
                 "nvidia-smi", "-L")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines() == [f"GPU 0: {gpu0.name} (UUID: {gpu0.uuid})"]


def _dra_driver(sim_host: SimHost, tmp: Path, tag: str, **result: object) -> tuple[object, str]:
    """The DRA plugin's driver (in-process) writing a claim on GPU 1 into /var/run/cdi,
    under a driver name of this test's own: (driver, the claim's CDI id)."""
    from nvctk.base import config as nvconfig
    from nvctk.dra.claims import MemoryClaims
    from nvctk.dra.node import make_driver
    from nvctk.k8s.health import Health

    driver_name = f"t{tag}.nvctk.test"
    src = MemoryClaims({("ns", "c"): {
        "metadata": {"namespace": "ns", "name": "c", "uid": f"uid-{tag}"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": driver_name, "pool": "n", "device": "gpu-1",
             **result}]}}}}})
    driver, _, _ = make_driver(driver_name, "n", src, str(tmp / "plugins"), str(SPEC_DIR),
                               Health(), cfg=nvconfig.load(sim_host.config_path),
                               config_path=sim_host.config_path)
    (dev,) = driver.prepare("ns", "c", f"uid-{tag}")
    return driver, dev.cdi_ids[0]


def _nvctk_runtime(sim_host: SimHost, tmp: Path) -> list[str]:
    """podman's --runtime for nvctk-runtime: podman gives its runtime none of its env,
    so a wrapper sets the sim's config."""
    wrap = tmp / "wrap" / "nvctk-runtime"
    wrap.parent.mkdir()
    wrap.write_text(f"#!/bin/sh\nexec env NVCTK_CONFIG={sim_host.config_path} "
                    f"{Path(sys.executable).with_name('nvctk-runtime')} \"$@\"\n")
    wrap.chmod(0o755)
    return ["--runtime", str(wrap)]


@contextlib.contextmanager
def _claim(sim_host: SimHost, tmp: Path, **result: object) -> Iterator[tuple[Any, str, str]]:
    """A claim on GPU 1 prepared into /var/run/cdi for the block: (driver, CDI id, uid);
    unprepared after it, when nothing of it may be left."""
    from nvctk.base import mounts as mount
    from nvctk.dra.driver import Driver

    tag = uuid.uuid4().hex[:12]
    made_dir = not SPEC_DIR.exists()
    driver, cdi_id = _dra_driver(sim_host, tmp, tag, **result)
    assert isinstance(driver, Driver)
    uid = f"uid-{tag}"
    ledger = driver.ledger_path(uid)
    try:
        yield driver, cdi_id, uid
    finally:
        driver.unprepare("ns", "c", uid)
        if made_dir:
            try:
                SPEC_DIR.rmdir()
            except OSError:
                pass
    assert not os.path.exists(driver.spec_path(uid)) and driver.prepared_uids() == []
    assert not os.path.exists(ledger)
    assert not any(m.mount_point.startswith(ledger) for m in mount.read_mountinfo())


def _no_userns(tmp: Path) -> list[str]:
    """podman's --security-opt for a seccomp profile that refuses new user namespaces
    (nvctk's own rules, all else allowed): podman's default profile lets unshare through,
    and a share's hook then refuses the start (in a user namespace the container could
    mount over its preload)."""
    import json

    from nvctk.spec.seccomp import userns_rules

    path = tmp / "no-userns.json"
    path.write_text(json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": userns_rules()}))
    return ["--security-opt", f"seccomp={path}"]


def _image(podman: Podman, rootfs: Callable[..., str]) -> None:
    """The test image: the CUDA sample, and libvgpu's probe (holds memory as asked)."""
    from support.monitor import PROBE

    root = Path(rootfs(with_sample=True))
    subprocess.run(["make", "-s", "-C", str(PROBE.parents[1]), "build/vgpu_probe"], check=True,
                   capture_output=True)
    (root / "usr/local/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(PROBE, root / "usr/local/bin/vgpu_probe")
    tar = subprocess.run(["tar", "-C", str(root), "-c", "."], capture_output=True, check=True)
    res = podman("import", "-", IMAGE, input=tar.stdout, private_var_lib=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("share, runtime", [(False, "default"), (True, "default"),
                                            (True, "nvctk-runtime")],
                         ids=["whole", "share", "share-nvctk-runtime"])
def test_podman_runs_a_dra_claims_device(podman: Podman, sim_host: SimHost, share: bool,
                                         runtime: str, rootfs: Callable[..., str],
                                         tmp_path: Path) -> None:
    """A DRA claim's spec, as nvctk's DRA driver writes it into /var/run/cdi: podman
    applies it with its own runtime (no --runtime), a 2 GiB share included: the spec
    carries the GPU and libvgpu bound to the claim's ledger. The container sees GPU 1
    only and a share stops at its cap; under nvctk-runtime the same. After unprepare
    nothing of the claim is left."""
    _image(podman, rootfs)
    extra = {"shareID": "s", "consumedCapacity": {"memory": "2Gi"}} if share else {}
    gpu1 = sim_host.topology.gpus[1]
    with _claim(sim_host, tmp_path, **extra) as (_, cdi_id, _):
        flags = (_nvctk_runtime(sim_host, tmp_path) if runtime == "nvctk-runtime" else
                 _no_userns(tmp_path) if share else [])
        res = podman("run", "--rm", "--network", "none", *flags, "--device", cdi_id,
                     IMAGE, "sh", "-c",
                     "nvidia-smi -L; cuda-vectoradd --alloc-mib 1500; "
                     "cuda-vectoradd --alloc-mib 2100 || true")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0] == f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})", res.stdout
    assert lines[1] == "alloc 1500 MiB: OK"
    if share:
        assert lines[2].startswith("alloc 2100 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY"), res.stdout
    else:
        assert lines[2] == "alloc 2100 MiB: OK"


# what a container's root (no CAP_SYS_ADMIN) may try against its share's cap; each runs,
# whether it fails or not, before the container fills the GPU
TAMPER = {
    "rewrite-preload": "echo > /etc/ld.so.preload",
    "remove-preload": "rm -f /etc/ld.so.preload",
    "move-etc": "mv /etc /etc.x && mkdir /etc && touch /etc/ld.so.preload",
    "move-run": "mv /run /run.x && mkdir -p /run/nvctk/vgpu "
                "&& echo CUDA_DEVICE_MEMORY_LIMIT_0=0 > /run/nvctk/vgpu/limits",
    "write-limits": "echo CUDA_DEVICE_MEMORY_LIMIT_0=0 > /run/nvctk/vgpu/limits",
    "replace-limits": "rm -f /run/nvctk/vgpu/limits; echo CUDA_DEVICE_MEMORY_LIMIT_0=0 "
                      "> /run/nvctk/vgpu/limits.new && mv /run/nvctk/vgpu/limits.new "
                      "/run/nvctk/vgpu/limits",
    "write-ledger-cache": "dd if=/dev/zero of=/run/nvctk/vgpu/cache bs=4096 count=1 conv=notrunc",
    "remove-library": "rm -f /run/nvctk/libvgpu.so; : > /run/nvctk/libvgpu.so",
    # in a user namespace of its own it could mount over the preload: refused by seccomp
    "user-namespace": "unshare -Urm sh -c 'mount --bind /dev/null /etc/ld.so.preload "
                      "&& echo escaped'",
}


@pytest.mark.parametrize("runtime", ["default", "nvctk-runtime"])
def test_a_dra_shares_cap_holds_against_its_containers_env_and_files(
        podman: Podman, sim_host: SimHost, runtime: str, rootfs: Callable[..., str],
        tmp_path: Path) -> None:
    """A 2 GiB share run by podman's own runtime: after every tampering above, with
    LD_PRELOAD unset and CUDA_DEVICE_MEMORY_LIMIT set far above the cap, a process that
    allocates until refused holds at most 2 GiB on GPU 1, as the simulated driver's NVML
    counts it (not libvgpu); the preload still names libvgpu."""
    from nvctk.sim.state import read_state, state_path

    _image(podman, rootfs)
    mib = 1 << 20
    script = "; ".join(f"({cmd}) 2>/dev/null" for cmd in TAMPER.values()) + (
        "; echo preload: $(cat /etc/ld.so.preload); "
        "exec env -u LD_PRELOAD CUDA_DEVICE_MEMORY_LIMIT=80g CUDA_DEVICE_MEMORY_LIMIT_0=0 "
        "NVCTK_VGPU_LIMITS_FILE=/tmp/none vgpu_probe init ctx 0 fill 67108864 sleep 600000")
    with _claim(sim_host, tmp_path, shareID="s", consumedCapacity={"memory": "2Gi"}) as (
            _, cdi_id, _):
        flags = (_nvctk_runtime(sim_host, tmp_path) if runtime == "nvctk-runtime" else
                 _no_userns(tmp_path))
        res = podman("run", "-d", "--network", "none", *flags, "--device", cdi_id, IMAGE,
                     "sh", "-c", script)
        assert res.returncode == 0, res.stderr
        cid = res.stdout.strip()
        try:
            def logs() -> str:
                return podman("logs", cid).stdout

            wait.until(lambda: "fill " in logs(), 90, "the container to fill its share")
            used = sum(p.mem_used for p in read_state(state_path(sim_host.root),
                                                      live_only=True).procs_on(1))
            out = logs()
        finally:
            podman("rm", "--force", cid, timeout=60)
    assert "preload: /run/nvctk/libvgpu.so" in out and "escaped" not in out, out
    fill = next(li for li in out.splitlines() if li.startswith("fill "))
    assert fill.split()[1] == "2", out  # CUDA_ERROR_OUT_OF_MEMORY: refused at the cap
    assert 1500 * mib <= used <= 2 << 30, (used, out)


def test_a_dra_share_that_could_leave_its_cap_is_refused(
        podman: Podman, sim_host: SimHost, rootfs: Callable[..., str], tmp_path: Path) -> None:
    """Under podman's own runtime and default seccomp profile (which lets unshare through)
    a share's container could make a user namespace and mount over its preload: the
    claim's hook refuses the start, saying what to set; no container is left."""
    for path, off in (("/proc/sys/user/max_user_namespaces", "0"),
                      ("/proc/sys/kernel/unprivileged_userns_clone", "0")):
        if os.path.exists(path) and Path(path).read_text().strip() == off:
            pytest.skip(f"{path} is {off}: no user namespace to refuse")
    _image(podman, rootfs)
    with _claim(sim_host, tmp_path, shareID="s", consumedCapacity={"memory": "2Gi"}) as (
            _, cdi_id, _):
        res = podman("run", "--rm", "--network", "none", "--device", cdi_id, IMAGE, "true")
    assert res.returncode != 0
    assert "may make a user namespace (unshare is allowed" in res.stderr, res.stderr
    assert podman("ps", "--all", "--quiet").stdout.strip() == ""


def test_a_dra_share_in_an_image_without_glibc_is_refused(
        podman: Podman, sim_host: SimHost, tmp_path: Path) -> None:
    """An image whose loader ignores /etc/ld.so.preload (no glibc loader: musl's, or a
    static one) would run a share uncapped: the claim's hook refuses the start."""
    root = tmp_path / "static"  # a static busybox, no dynamic loader at all
    (root / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox") or "/bin/busybox", root / "bin/busybox")
    for applet in ("sh", "true"):
        (root / "bin" / applet).symlink_to("busybox")
    tar = subprocess.run(["tar", "-C", str(root), "-c", "."], capture_output=True, check=True)
    res = podman("import", "-", IMAGE, input=tar.stdout, private_var_lib=True)
    assert res.returncode == 0, res.stderr
    with _claim(sim_host, tmp_path, shareID="s", consumedCapacity={"memory": "2Gi"}) as (
            _, cdi_id, _):
        res = podman("run", "--rm", "--network", "none", *_no_userns(tmp_path),
                     "--device", cdi_id, IMAGE, "true")
    assert res.returncode != 0
    assert "the DRA claim's share is set but GPU limits cannot be enforced" in res.stderr, \
        res.stderr
    assert podman("ps", "--all", "--quiet").stdout.strip() == ""

