"""CRI nodes for tests/e2e/test_k8s_cri_*.py: one engine (containerd 1.6 or 2.3, CRI-O
1.36) serving the CRI on a private socket, configured by `nvctk configure`, over a sim of
its own, with the images a kubelet would have pulled; a CRI client on it, a Pod run."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.host import SimHost
from support import wait
from support.cri import (
    Allocation,
    CriClient,
    PodResult,
    containerd2_cri_config,
    containerd_cri_config,
    image_archive,
    pass_cdi_annotations,
    pause_image,
    run_pod,
)
from support.daemons import (
    CONTAINERD_2_TAR,
    CRIO_TAR,
    containerd,
    crio,
    crio_config,
    import_images,
    peer_env,
    short_dir,
    unpack_peer,
)
from support.daemons import need as _need
from support.monitor import PROBE

PAUSE = "nvctk.test/pause:1"
GPU_IMAGE = "nvctk.test/gpu:1"
MIG_LAYOUT = {0: ["3g.40gb", "2g.20gb", "1g.10gb"]}
CDI_KEY = "cdi.k8s.io/nvctk-device-plugin_main"

ENGINES = ["containerd-1.6", "containerd-2.3", "crio-1.36"]


@dataclass
class Node:
    """One engine serving the CRI on a private socket."""

    engine: str
    socket: Path
    dir: Path
    applies_cdi_devices: bool  # the CRI's CDI_devices field (containerd 1.6 drops it)
    leftovers: Callable[[], list[str]]  # its containers or tasks still there
    runtime_root: str  # the `nvidia` handler's runc state, as `nvctk monitor --runtime-root`


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root: starts container engines")
    _need("runc")
    with short_dir("nvctk-k-") as d:
        yield d


@pytest.fixture(scope="module")
def sim(work: Path) -> SimHost:
    """A sim of its own (the Pods' processes share its state file): GPU 0 split into
    MIG devices, GPU 1 whole; its config names a CDI spec dir with a generated spec."""
    from nvctk.sim import host
    from nvctk.sim.topology import make_topology
    from support.exe import nvctk_exe

    s = host.init(str(work / "sim"), make_topology(gpus=2, mig=MIG_LAYOUT))
    cdi = work / "cdi"
    cdi.mkdir()
    r = subprocess.run([*nvctk_exe(), "cdi", "generate", "--output", str(cdi / "nvidia.yaml")],
                       env={**os.environ, **s.env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = Path(s.config_path)
    text = re.sub(r"(?m)^cdi-spec-dirs = .*\n", "", cfg.read_text())
    cfg.write_text(text + f'cdi-spec-dirs = ["{cdi}"]\n')
    return s


@pytest.fixture(scope="module")
def images(work: Path, sim: SimHost) -> dict[str, Path]:
    """The images as a node has them after the kubelet pulled them (no registry here)."""
    from nvctk.sim.rootfs import build_rootfs

    pause = pause_image(work, PAUSE)
    root = Path(build_rootfs(str(work / "gpu"), with_sample=sim.sample))
    # libvgpu's probe: holds memory in a Pod while another Pod asks (the DRA share tests)
    subprocess.run(["make", "-s", "-C", str(PROBE.parents[1]), "build/vgpu_probe"], check=True,
                   capture_output=True)
    (root / "usr/local/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(PROBE, root / "usr/local/bin/vgpu_probe")
    gpu = image_archive(root, GPU_IMAGE, work / "gpu.tar",
                        # as CUDA base images do: the Allocate answer must override it
                        env={"PATH": "/usr/local/bin:/usr/bin:/bin",
                             "NVIDIA_VISIBLE_DEVICES": "all"})
    return {PAUSE: pause, GPU_IMAGE: gpu}


def _configure(*args: str, env: dict[str, str] | None = None) -> None:
    from support.exe import nvctk_exe

    r = subprocess.run([*nvctk_exe(), "configure", *args], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr


@contextlib.contextmanager
def _containerd_node(d: Path, sim: SimHost, images: dict[str, Path],
                     bin_dir: Path | None) -> Iterator[Node]:
    d.mkdir()
    cfg = d / "config.toml"
    if bin_dir is None:  # Debian's 1.6: a version 2 config
        cfg.write_text(containerd_cri_config(d, PAUSE))
    else:  # 2.3.4: its own `config default`, version 4, with CDI from the sim's spec dir
        default = subprocess.run([str(bin_dir / "containerd"), "config", "default"],
                                 capture_output=True, text=True, check=True).stdout
        cfg.write_text(containerd2_cri_config(d, PAUSE, default, [d.parent / "cdi"]))
    _configure("--runtime", "containerd", "--config", str(cfg),
               env=peer_env(bin_dir) if bin_dir else None)
    # containerd's CRI passes a container's annotations to the runtime only when its
    # runtime table lists them: without it the cdi-annotations strategy gives no
    # device, silently (the image's own NVIDIA_VISIBLE_DEVICES=all then wins)
    assert not pass_cdi_annotations(cfg), "nvctk configure must list cdi.k8s.io/*"
    with containerd(d, env=sim.env, config=cfg, bin_dir=bin_dir) as daemon:
        import_images(daemon, *images.values())

        def leftovers() -> list[str]:
            return (daemon.ctr("tasks", "ls", "-q", namespace="k8s.io").stdout.split()
                    + daemon.ctr("containers", "ls", "-q", namespace="k8s.io").stdout.split())

        yield Node("containerd-1.6" if bin_dir is None else "containerd-2.3", daemon.socket, d,
                   bin_dir is not None, leftovers, f"containerd={d / 'runc' / '*'}")


@contextlib.contextmanager
def _crio_node(d: Path, sim: SimHost, images: dict[str, Path], bin_dir: Path) -> Iterator[Node]:
    from nvctk.engines.common import RUNTIME_BINARY

    d.mkdir()
    cfg = crio_config(d, PAUSE, bin_dir)
    # CDI from the sim's spec dir
    cfg.write_text(cfg.read_text().replace(
        "[crio.runtime]\n", f'[crio.runtime]\ncdi_spec_dirs = ["{d.parent / "cdi"}"]\n', 1))
    # CRI-O gives a handler none of its own env: a wrapper sets the sim's
    wrap = d / "wrap" / RUNTIME_BINARY
    wrap.parent.mkdir()
    runtime = Path(sys.executable).with_name(RUNTIME_BINARY)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sim.env.items())
    wrap.write_text(f'#!/bin/sh\nexec env {env} {runtime} "$@"\n')
    wrap.chmod(0o755)
    drop = d / "conf.d" / "99-nvctk.toml"
    _configure("--runtime", "crio", "--config", str(cfg), "--drop-in", str(drop),
               "--runtime-path", str(wrap), env=peer_env(bin_dir))
    # runc's state for the handler under d, as crio.conf does for runc's
    drop.write_text(drop.read_text() + f'runtime_root = "{d}/nvidia-runc"\n')
    for tar in images.values():
        r = subprocess.run(["podman", "--root", f"{d}/root", "--runroot", f"{d}/runroot",
                            "--storage-driver", "overlay", "load", "-i", str(tar)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    with crio(d, bin_dir) as daemon:
        def leftovers() -> list[str]:
            out = []
            for root in (d / "runc", d / "nvidia-runc"):
                r = subprocess.run(["runc", "--root", str(root), "list", "-q"],
                                   capture_output=True, text=True)
                out += r.stdout.split()
            return out

        yield Node("crio-1.36", daemon.socket, d, True, leftovers, f"crio={d / 'nvidia-runc'}")


@pytest.fixture(scope="module", params=ENGINES)
def node(request: pytest.FixtureRequest, work: Path, sim: SimHost,
         images: dict[str, Path]) -> Iterator[Node]:
    engine = request.param
    d = work / engine
    if engine == "containerd-1.6":
        _need("containerd", "ctr", "containerd-shim-runc-v2")
        with _containerd_node(d, sim, images, None) as n:
            yield n
        return
    tar = CONTAINERD_2_TAR if engine == "containerd-2.3" else CRIO_TAR
    bin_dir = unpack_peer(tar, work / f"bin-{engine}")
    if bin_dir is None:
        pytest.skip(f"{tar} is absent (../shared/peers): {engine} not tried")
    if engine == "containerd-2.3":
        with _containerd_node(d, sim, images, bin_dir) as n:
            yield n
    else:
        _need("conmon", "podman")
        with _crio_node(d, sim, images, bin_dir) as n:
            yield n


@pytest.fixture(scope="module")
def cri(node: Node) -> Iterator[CriClient]:
    client = CriClient(node.socket)
    assert client.version().runtime_name == ("cri-o" if node.engine.startswith("crio")
                                             else "containerd")
    for ref in (PAUSE, GPU_IMAGE):  # containerd 2.x's CRI learns of imports by events
        wait.until(lambda ref=ref: client.image_id(ref), 60, f"the CRI to see {ref}")
    yield client
    client.close()


def run(cri: CriClient, work: Path, alloc: Allocation, script: str,
        handler: str = "nvidia", runtime_default_seccomp: bool = False) -> PodResult:
    """A Pod whose one container runs `script` in the GPU image, with `alloc`."""
    return run_pod(cri, handler, alloc, image=GPU_IMAGE, command=["sh", "-c", script],
                   log_root=work / "logs", runtime_default_seccomp=runtime_default_seccomp)


def _dra_claim(sim: SimHost, work: Path, device: str, uid: str = "",
               **result: Any) -> tuple[Any, list[str]]:
    """The DRA plugin's driver (in-process, as its NodePrepareResources runs it) with a
    claim allocated `device` (`result`: the allocation result's other fields, e.g. a
    share's), prepared into the engines' CDI dir: (driver, CDI ids)."""
    from nvctk.base import config as nvconfig
    from nvctk.dra.claims import MemoryClaims
    from nvctk.dra.node import make_driver
    from nvctk.k8s.health import Health

    uid = uid or f"uid-{device}"
    src = MemoryClaims({("ns", uid): {
        "metadata": {"namespace": "ns", "name": uid, "uid": uid},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvctk.io", "pool": "node-a", "device": device,
             **result}]}}}}})
    driver, _, _ = make_driver("gpu.nvctk.io", "node-a", src, str(work / "dra-plugins"),
                               str(work / "cdi"), Health(),
                               cfg=nvconfig.load(sim.config_path), config_path=sim.config_path)
    (dev,) = driver.prepare("ns", uid, uid)
    return driver, list(dev.cdi_ids)


SHARE = {"shareID": "5d2a", "consumedCapacity": {"memory": "2Gi"}}


@contextlib.contextmanager
def _node_config(sim: SimHost, shipped: bool) -> Iterator[None]:
    """The node's nvctk config for the block: as the installer writes it for Kubernetes
    (nvctk.base.config.KUBERNETES_NODE: a container's env selects no GPU) when shipped,
    else the defaults (open: a container's NVIDIA_VISIBLE_DEVICES is honoured). The
    runtime reads it afresh at each create (an edited config is no cached one)."""
    from nvctk.base import config as nvconfig

    cfg = Path(sim.config_path)
    before = cfg.read_text()
    text = before
    for name, value in nvconfig.KUBERNETES_NODE.items():
        key = name.replace("_", "-")
        want = str(value if shipped else getattr(nvconfig.Config(), name)).lower()
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {want}", text)
        assert n == 1, key
    cfg.write_text(text)
    try:
        yield
    finally:
        cfg.write_text(before)


def _plugin_allocation(sim: SimHost, config: dict[str, object], resource: str,
                       pick: Callable[[list[str]], list[str]]) -> Allocation:
    """What the kubelet would hand the CRI after the device plugin's Allocate: the
    plugin's resources for this host and config, its answer for the picked ids, as the
    v1beta1 message and back (the kubelet's mapping)."""
    from nvctk.host.nvml import query_host
    from nvctk.k8s import allocate, resources, server
    from nvctk.k8s import config as dpconfig

    cfg = dpconfig.parse(config, "test")
    host = query_host(sim.root)
    (res,) = [r for r in resources.build(cfg, host) if r.name == resource]
    ids = pick(sorted(res.devices))
    return Allocation.from_response(server.to_pb(allocate.allocate(res, cfg, ids, sim.root)))
