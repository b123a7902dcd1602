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

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost
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


@pytest.mark.parametrize("share", [False, True], ids=["whole", "share"])
def test_podman_runs_a_dra_claims_device(podman: Podman, sim_host: SimHost, share: bool,
                                         rootfs: Callable[..., str], tmp_path: Path) -> None:
    """A DRA claim's spec, as nvctk's DRA driver writes it into /var/run/cdi: podman
    applies a whole-GPU claim itself (runc); a 2 GiB share needs nvctk-runtime, which
    caps the container at the claim's ledger. The container sees GPU 1 only; after
    unprepare the claim's spec is gone."""
    from nvctk.dra.driver import Driver

    tar = subprocess.run(["tar", "-C", rootfs(with_sample=True), "-c", "."],
                         capture_output=True, check=True)
    res = podman("import", "-", IMAGE, input=tar.stdout, private_var_lib=True)
    assert res.returncode == 0, res.stderr
    tag = uuid.uuid4().hex[:12]
    made_dir = not SPEC_DIR.exists()
    extra = {"shareID": "s", "consumedCapacity": {"memory": "2Gi"}} if share else {}
    driver, cdi_id = _dra_driver(sim_host, tmp_path, tag, **extra)
    assert isinstance(driver, Driver)
    gpu1 = sim_host.topology.gpus[1]
    try:
        runtime: list[str] = []
        if share:
            # podman gives its runtime none of its env: a wrapper sets the sim's config
            wrap = tmp_path / "wrap" / "nvctk-runtime"
            wrap.parent.mkdir()
            wrap.write_text(f"#!/bin/sh\nexec env NVCTK_CONFIG={sim_host.config_path} "
                            f"{Path(sys.executable).with_name('nvctk-runtime')} \"$@\"\n")
            wrap.chmod(0o755)
            runtime = ["--runtime", str(wrap)]
        res = podman("run", "--rm", "--network", "none", *runtime, "--device", cdi_id,
                     IMAGE, "sh", "-c",
                     "nvidia-smi -L; cuda-vectoradd --alloc-mib 1500; "
                     "cuda-vectoradd --alloc-mib 2100 || true")
    finally:
        driver.unprepare("ns", "c", f"uid-{tag}")
        if made_dir:
            try:
                SPEC_DIR.rmdir()
            except OSError:
                pass
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0] == f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})", res.stdout
    assert lines[1] == "alloc 1500 MiB: OK"
    if share:
        assert lines[2].startswith("alloc 2100 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY"), res.stdout
    else:
        assert lines[2] == "alloc 2100 MiB: OK"
    assert not os.path.exists(driver.spec_path(f"uid-{tag}"))
    assert driver.prepared_uids() == []
