"""GPU containers through real containerd and dockerd, started by the tests.

containerd: `ctr run --runc-binary nvctk-runtime` (the runc.v2 shim calls our
binary with runc's argv). dockerd: a runtime "nvidia" in daemon.json, an image
imported from the test rootfs. Both daemons inherit NVCTK_CONFIG, as they would
from a systemd drop-in on a real host, so the shim sees the simulated host.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost
from support.daemons import Containerd, Dockerd, containerd, dockerd, import_rootfs, need

pytestmark = [pytest.mark.slow, pytest.mark.root]

RUNTIME = os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")
_ids = itertools.count()



def _need(*tools: str) -> None:
    need(*tools, starts="containerd/dockerd")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> SimHost:
    """A sim of its own: these tests' containers use its shared state file."""
    from nvctk.sim import host
    from nvctk.sim.topology import make_topology

    _need("containerd")
    return host.init(str(tmp_path_factory.mktemp("engsim") / "host"), make_topology(gpus=2))


@pytest.fixture(scope="module")
def ctd(tmp_path_factory: pytest.TempPathFactory, sim: SimHost) -> Iterator[Containerd]:
    _need("containerd", "ctr", "runc")
    # a short path: containerd's socket paths must fit in sun_path
    work = Path(tempfile_dir()) / "ctd"
    with containerd(work, env=sim.env) as daemon:
        yield daemon
    shutil.rmtree(work.parent, ignore_errors=True)


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="nvctk-e-", dir="/tmp")


@pytest.fixture(scope="module")
def image_rootfs(tmp_path_factory: pytest.TempPathFactory, sim: SimHost) -> str:
    from nvctk.sim.rootfs import build_rootfs

    return build_rootfs(str(tmp_path_factory.mktemp("engrootfs") / "r"), with_sample=sim.sample)


def ctr_run(ctd: Containerd, rootfs: str, env: list[str], *cmd: str):
    cid = f"nvctk-ctr-{os.getpid()}-{next(_ids)}"
    # runc's state and the I/O fifos under the test's own dir, not /run/containerd
    args = ["run", "--rm", "--runc-binary", RUNTIME, "--runc-root", str(ctd.dir / "runc"),
            "--fifo-dir", str(ctd.dir / "fifo")]
    # without an image there is no image config, hence no PATH
    for e in ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *env]:
        args += ["--env", e]
    # --rootfs is a switch: the first positional is then the rootfs dir, and
    # flags after a positional are not parsed
    return ctd.ctr(*args, "--rootfs", rootfs, cid, *cmd, timeout=90)


def test_ctr_run_gpu_container(ctd: Containerd, sim: SimHost, image_rootfs: str) -> None:
    gpu1 = sim.topology.gpus[1]
    res = ctr_run(ctd, image_rootfs, [f"NVIDIA_VISIBLE_DEVICES={gpu1.uuid}"], "nvidia-smi", "-L")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines() == [f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})"]


def test_ctr_run_cuda_sample(ctd: Containerd, image_rootfs: str) -> None:
    res = ctr_run(ctd, image_rootfs, ["NVIDIA_VISIBLE_DEVICES=0"], "cuda-vectoradd")
    assert res.returncode == 0, res.stderr
    assert "Test PASSED" in res.stdout


def test_ctr_run_without_gpu_request_passes_through(ctd: Containerd, image_rootfs: str) -> None:
    res = ctr_run(ctd, image_rootfs, [], "ls", "/dev")
    assert res.returncode == 0, res.stderr
    assert "nvidiactl" not in res.stdout.split()


def test_ctr_shows_nvctk_error_for_unknown_device(ctd: Containerd, image_rootfs: str) -> None:
    res = ctr_run(ctd, image_rootfs, ["NVIDIA_VISIBLE_DEVICES=GPU-does-not-exist"], "true")
    assert res.returncode != 0
    assert "GPU-does-not-exist" in res.stderr, res.stderr


@pytest.fixture(scope="module")
def docker(ctd: Containerd, image_rootfs: str) -> Iterator[Dockerd]:
    _need("dockerd")
    work = Path(tempfile_dir()) / "dk"
    # Docker's --gpus needs a hook binary named nvidia-container-runtime-hook on
    # its PATH; this one fails loudly, so a test passes only if nvctk replaced it.
    fake = work.parent / "fakebin"
    fake.mkdir(parents=True)
    hook = fake / "nvidia-container-runtime-hook"
    hook.write_text("#!/bin/sh\necho 'NVIDIA hook ran: nvctk did not replace it' >&2\nexit 1\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    with dockerd(work, ctd, {"nvidia": RUNTIME}, path_prepend=str(fake)) as daemon:
        import_rootfs(daemon, Path(image_rootfs), "nvctk-test:latest")
        yield daemon
    shutil.rmtree(work.parent, ignore_errors=True)


def docker_run(d: Dockerd, *args: str):
    return d.docker("run", "--rm", "--network", "none", "--runtime", "nvidia", *args,
                    timeout=120)


def test_docker_run_gpu_container(docker: Dockerd, sim: SimHost) -> None:
    gpu0 = sim.topology.gpus[0]
    res = docker_run(docker, "-e", "NVIDIA_VISIBLE_DEVICES=0", "nvctk-test:latest",
                     "nvidia-smi", "-L")
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().strip() == f"GPU 0: {gpu0.name} (UUID: {gpu0.uuid})"


def test_docker_gpus_flag_is_served_by_nvctk(docker: Dockerd, sim: SimHost) -> None:
    res = docker_run(docker, "--gpus", "all", "nvctk-test:latest", "nvidia-smi", "-L")
    assert res.returncode == 0, res.stderr.decode()
    assert len(res.stdout.decode().strip().splitlines()) == len(sim.topology.gpus)


def test_docker_shows_nvctk_error_for_unknown_device(docker: Dockerd) -> None:
    res = docker_run(docker, "-e", "NVIDIA_VISIBLE_DEVICES=7", "nvctk-test:latest", "true")
    assert res.returncode != 0
    err = res.stderr.decode()
    assert "nvctk" in err and "unknown device '7'" in err, err


def test_ctr_shows_nvctk_error_for_bad_limit(ctd: Containerd, image_rootfs: str) -> None:
    res = ctr_run(ctd, image_rootfs,
                  ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_DEVICE_MEMORY_LIMIT=12x"], "true")
    assert res.returncode != 0
    assert "CUDA_DEVICE_MEMORY_LIMIT" in res.stderr and "12x" in res.stderr, res.stderr


def test_docker_shows_nvctk_error_for_bad_limit(docker: Dockerd) -> None:
    res = docker_run(docker, "-e", "NVIDIA_VISIBLE_DEVICES=0", "-e", "CUDA_DEVICE_SM_LIMIT=150",
                     "nvctk-test:latest", "true")
    assert res.returncode != 0
    err = res.stderr.decode()
    assert "CUDA_DEVICE_SM_LIMIT" in err and "150" in err, err


def test_docker_capped_container_sees_its_cap(docker: Dockerd) -> None:
    res = docker_run(docker, "-e", "NVIDIA_VISIBLE_DEVICES=0", "-e", "CUDA_DEVICE_MEMORY_LIMIT=1g",
                     "nvctk-test:latest", "nvidia-smi", "--query-gpu=memory.total",
                     "--format=csv,noheader,nounits")
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().strip() == "1024"


# --- `docker run --gpus all` with nvctk as the default runtime (issue 35) ---------------


@pytest.fixture(scope="module")
def docker_default(ctd: Containerd, image_rootfs: str) -> Iterator[Dockerd]:
    """dockerd whose daemon.json is `nvctk configure --set-as-default`'s and whose PATH
    holds only nvctk's nvidia-container-runtime-hook (what nvctk-installer links into
    /usr/local/bin): no NVIDIA toolkit."""
    import subprocess

    from support.exe import nvctk_exe

    _need("dockerd")
    work = Path(tempfile_dir()) / "dkd"
    work.mkdir(parents=True)
    cfg = work / "daemon.json"
    r = subprocess.run([*nvctk_exe(), "configure", "--runtime", "docker", "--config", str(cfg),
                        "--set-as-default"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    stub_dir = work.parent / "nvctk-bin"
    stub_dir.mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "packaging/image/nvidia-container-runtime-hook",
                stub_dir)
    with dockerd(work, ctd, {}, path_prepend=str(stub_dir), config=cfg) as daemon:
        import_rootfs(daemon, Path(image_rootfs), "nvctk-test:latest")
        yield daemon
    shutil.rmtree(work.parent, ignore_errors=True)


def test_docker_gpus_all_with_nvctk_as_default(docker_default: Dockerd, sim: SimHost) -> None:
    res = docker_default.docker("run", "--rm", "--network", "none", "--gpus", "all",
                                "nvctk-test:latest", "nvidia-smi", "-L", timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().strip().splitlines() == [
        f"GPU {g.index}: {g.name} (UUID: {g.uuid})" for g in sim.topology.gpus]


def test_docker_gpus_under_another_runtime_is_refused_saying_why(docker_default: Dockerd) -> None:
    """Plain runc runs the hook Docker put in: nvctk's refuses the container instead of
    letting it start without its GPUs."""
    res = docker_default.docker("run", "--rm", "--network", "none", "--runtime", "runc",
                                "--gpus", "all", "nvctk-test:latest", "true", timeout=120)
    assert res.returncode != 0
    err = res.stderr.decode()
    assert "--gpus needs nvctk-runtime as the container's runtime" in err, err
