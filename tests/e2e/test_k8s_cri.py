"""Pods the way the kubelet runs them: the real containerd (Debian's 1.6)
with its CRI plugin, configured by `nvctk configure --runtime containerd`, a CRI
client (tests/support/cri.py) doing RunPodSandbox with the `nvidia` runtime handler
(host network, so no CNI), CreateContainer with what a device plugin's Allocate
returns, StartContainer, and the container's CRI log read back.

Until the device plugin lands, the Allocate answers are built here in the shapes it
returns (support.cri.Allocation): NVIDIA_VISIBLE_DEVICES, `cdi.k8s.io/` annotations,
a vGPU share's CUDA_DEVICE_MEMORY_LIMIT / CUDA_DEVICE_SM_LIMIT.
"""

from __future__ import annotations

import contextlib
import json
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
from nvctk.sim.state import read_state, state_path

pytestmark = [pytest.mark.slow, pytest.mark.root]

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")

from support import wait  # noqa: E402
from support.cri import (  # noqa: E402
    Allocation,
    CriClient,
    CriError,
    PodResult,
    containerd2_cri_config,
    containerd_cri_config,
    image_archive,
    parse_cri_log,
    pass_cdi_annotations,
    pause_image,
    pod,
    run_pod,
)
from support.daemons import (  # noqa: E402
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
from support.daemons import need as _need  # noqa: E402
from support.monitor import PROBE  # noqa: E402
from support.sim import assert_mig_view  # noqa: E402

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


def test_whole_gpu_by_index(cri: CriClient, work: Path, sim: SimHost) -> None:
    gpu1 = sim.topology.gpus[1]
    res = run(cri, work, Allocation(envs={"NVIDIA_VISIBLE_DEVICES": "1"}), "nvidia-smi -L")
    assert res.exit_code == 0, res.logs
    assert res.logs.splitlines() == [f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})"]


def test_whole_gpu_by_uuid_through_cdi_annotation(cri: CriClient, work: Path, sim: SimHost) -> None:
    """The cdi-annotations strategy: the device is named only in a `cdi.k8s.io/`
    annotation, which containerd passes through to the OCI spec; the image's
    NVIDIA_VISIBLE_DEVICES=all must not widen it."""
    gpu1 = sim.topology.gpus[1]
    alloc = Allocation(annotations={CDI_KEY: f"nvidia.com/gpu={gpu1.uuid}"})
    res = run(cri, work, alloc, "nvidia-smi -L")
    assert res.exit_code == 0, res.logs
    assert res.logs.splitlines() == [f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})"]


def test_mig_device(cri: CriClient, work: Path, sim: SimHost) -> None:
    gpu0 = sim.topology.gpus[0]
    mig = gpu0.mig_devices[1]
    res = run(cri, work, Allocation(envs={"NVIDIA_VISIBLE_DEVICES": mig.uuid}),
              "nvidia-smi -L; echo '== caps'; ls /dev/nvidia-caps; "
              "echo '== sample'; cuda-vectoradd | grep Test")
    assert res.exit_code == 0, res.logs
    smi, rest = res.logs.split("== caps\n")
    caps, sample = rest.split("== sample\n")
    assert_mig_view(smi, caps, gpu0, mig)
    assert sample.strip() == "Test PASSED"


def test_vgpu_share_sees_its_caps(cri: CriClient, work: Path, sim: SimHost) -> None:
    """One of 4 vGPU shares of GPU 1: a quarter of its memory and of its SMs,
    enforced by libvgpu from the read-only limits file nvctk put in the container."""
    from nvctk.vgpu import limits as vgpu

    gpu1 = sim.topology.gpus[1]
    share_mib = gpu1.memory_mib // 4
    alloc = Allocation(envs={"NVIDIA_VISIBLE_DEVICES": gpu1.uuid,
                             "CUDA_DEVICE_MEMORY_LIMIT": f"{share_mib}m",
                             "CUDA_DEVICE_SM_LIMIT": "25"})
    res = run(cri, work, alloc,
              "nvidia-smi --query-gpu=uuid,memory.total --format=csv,noheader,nounits; "
              "echo '== limits'; grep '^CUDA_DEVICE_' /run/nvctk/limits; "
              "echo '== sample'; cuda-vectoradd | grep Test")
    assert res.exit_code == 0, res.logs
    smi, rest = res.logs.split("== limits\n")
    limits, sample = rest.split("== sample\n")
    assert smi.splitlines() == [f"{gpu1.uuid}, {share_mib}"]
    env = dict(line.split("=", 1) for line in limits.splitlines())
    got = vgpu.limits_from_env(env, 1)
    assert (got.memory, got.sm) == ((share_mib << 20,), (25,)), limits
    assert sample.strip() == "Test PASSED"


def test_cri_cdi_devices_from_the_plugins_cdi_cri_answer(cri: CriClient, work: Path,
                                                          sim: SimHost, node: Node) -> None:
    """The device plugin's cdi-cri strategy: its answer names the GPU only in the
    CRI's CDI_devices field (the kubelet's route for cdi_devices), with
    NVIDIA_VISIBLE_DEVICES=void so the image's own `all` cannot widen it. containerd 2.3
    and CRI-O apply the device from the spec dirs they are configured with: the
    container sees exactly that GPU. containerd 1.6 drops the field without a word
    (checked, so the limit is not forgotten): the container gets no GPU at all, so on
    1.6 a device plugin must name devices by env or `cdi.k8s.io/` annotation."""
    gpu1 = sim.topology.gpus[1]
    config = {"version": "v1", "flags": {"migStrategy": "mixed",
                                         "deviceListStrategy": ["cdi-cri"]}}
    try:
        alloc = _plugin_allocation(sim, config, "nvidia.com/gpu",
                                   lambda ids: [i for i in ids if i == gpu1.uuid])
    except ImportError as e:  # the plugin's generated gRPC code is built by `make setup`
        pytest.skip(f"device plugin not available: {e}")
    assert alloc.cdi_devices == [f"nvidia.com/gpu={gpu1.uuid}"], alloc
    res = run(cri, work, alloc, "nvidia-smi -L 2>&1 || true; ls /dev | grep -c '^nvidia[0-9]' || true")
    assert res.exit_code == 0, res.logs
    gpus = [li for li in res.logs.splitlines() if li.startswith("GPU ")]
    if node.applies_cdi_devices:
        assert gpus == [f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})"], res.logs
        assert res.logs.splitlines()[-1] == "1", res.logs  # that GPU's device node alone
    else:
        assert gpus == [] and res.logs.splitlines()[-1] == "0", res.logs


def test_unknown_cdi_device_fails_clearly_and_leaves_nothing(cri: CriClient, work: Path,
                                                             node: Node) -> None:
    """A CDI device no spec dir knows: the engine (or nvctk, where the engine ignores
    the field) says which, and no container of it is left."""
    if not node.applies_cdi_devices:
        pytest.skip(f"{node.engine} ignores the CRI's CDI devices (see test_cri_cdi_devices_from_the_plugins_cdi_cri_answer)")
    with pytest.raises(CriError) as e:
        run(cri, work, Allocation(cdi_devices=["nvidia.com/gpu=GPU-not-there"]), "true")
    assert e.value.call in ("CreateContainer", "StartContainer"), e.value
    assert "nvidia.com/gpu=GPU-not-there" in e.value.details, e.value
    assert node.leftovers() == []


def test_unknown_runtime_handler_fails_clearly(cri: CriClient, work: Path) -> None:
    with pytest.raises(CriError) as e:
        run(cri, work, Allocation(envs={"NVIDIA_VISIBLE_DEVICES": "1"}), "true",
            handler="nvidia-missing")
    assert e.value.call == "RunPodSandbox"
    assert "nvidia-missing" in e.value.details, e.value


@pytest.mark.parametrize("alloc, culprit", [
    (Allocation(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-does-not-exist"}),
     "unknown device 'GPU-does-not-exist'"),
    (Allocation(annotations={CDI_KEY: "nvidia.com/gpu=7"}), "nvidia.com/gpu=7"),
    (Allocation(envs={"NVIDIA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_SM_LIMIT": "150"}),
     "CUDA_DEVICE_SM_LIMIT='150': not a percentage"),
], ids=["unknown-uuid", "unknown-cdi-device", "bad-sm-cap"])
def test_bad_allocation_fails_clearly(cri: CriClient, work: Path, node: Node,
                                      alloc: Allocation, culprit: str) -> None:
    """The runtime's own message reaches the kubelet through the failing call's error
    (containerd creates the task at StartContainer, CRI-O at CreateContainer), and
    nothing of the failed container is left running."""
    with pytest.raises(CriError) as e:
        run(cri, work, alloc, "true")
    assert e.value.call in ("CreateContainer", "StartContainer"), e.value
    # a `cdi.k8s.io/` device is resolved by containerd 2.3 and CRI-O themselves (their
    # words), by nvctk on containerd 1.6
    assert culprit in e.value.details, e.value
    assert "nvctk" in e.value.details or "CDI device injection failed" in e.value.details, e.value
    assert node.leftovers() == []


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


# "": the engine's default handler (runc), as a DRA Pod without runtimeClassName gets
HANDLERS = pytest.mark.parametrize("handler", ["", "nvidia"], ids=["default-handler", "nvidia"])


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


# what a share's container tries in a user namespace of its own: the preload gone, then
# past the cap
USERNS_ESCAPE = ("unshare -Urm sh -c 'mount --bind /dev/null /etc/ld.so.preload "
                 "&& cuda-vectoradd --alloc-mib 2100 | grep -q OK'")


@pytest.mark.parametrize("handler, shipped", [("", False), ("nvidia", False), ("nvidia", True)],
                         ids=["default-handler", "nvidia", "nvidia-shipped"])
def test_dra_share_sees_its_gpu_and_cannot_pass_its_cap(cri: CriClient, work: Path,
                                                         sim: SimHost, node: Node,
                                                         handler: str, shipped: bool) -> None:
    """A claim holding a 2 GiB share of GPU 1 (consumable capacity): under the engine's
    default handler (no RuntimeClass) as under nvctk's, on a node configured as shipped
    for Kubernetes too, the container sees that GPU only (the image's
    NVIDIA_VISIBLE_DEVICES=all widens nothing), and libvgpu, which the claim's CDI spec
    binds to the claim's ledger, refuses an allocation past 2 GiB; within it the
    allocation is the driver's (OK)."""
    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    gpu1 = sim.topology.gpus[1]
    uid = f"uid-share-a{handler}{int(shipped)}"
    driver, ids = _dra_claim(sim, work, "gpu-1", uid, **SHARE)
    try:
        with _node_config(sim, shipped):
            res = run(cri, work, Allocation(cdi_devices=ids),
                      "nvidia-smi -L; cuda-vectoradd --alloc-mib 1500; "
                      "cuda-vectoradd --alloc-mib 2100; ls /dev | grep -c '^nvidia[0-9]'; "
                      # a user namespace of its own, where it could mount over the preload
                      f"{USERNS_ESCAPE} >/dev/null 2>&1; echo userns=$?",
                      handler=handler, runtime_default_seccomp=not handler)
    finally:
        driver.unprepare("ns", uid, uid)
    lines = res.logs.splitlines()
    assert lines[0] == f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})", res.logs
    assert lines[1] == "alloc 1500 MiB: OK", res.logs
    assert lines[2].startswith("alloc 2100 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY"), res.logs
    assert lines[3] == "1", res.logs
    assert lines[4] != "userns=0", res.logs  # refused: RuntimeDefault, or nvctk-runtime's rule
    assert driver.prepared_uids() == [] and not os.path.exists(driver.ledger_path(uid))
    assert not os.path.exists(driver.spec_path(uid))


def test_dra_two_pods_of_one_claim_hold_one_cap(cri: CriClient, work: Path, sim: SimHost,
                                                node: Node) -> None:
    """Two Pods sharing one 2 GiB claim, A under the engine's default handler (no
    RuntimeClass), B under nvctk's: one ledger for both, so while Pod A holds 1200 MiB,
    Pod B gets 600 MiB more but not 1200; what the simulated driver's NVML counts for
    both together stays under 2 GiB. After unprepare nothing of the claim is left."""
    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    mib = 1 << 20
    driver, ids = _dra_claim(sim, work, "gpu-1", "uid-share-b", **SHARE)
    hold = "vgpu_probe init ctx 0 alloc {} sleep 600000"
    try:
        with pod(cri, "", work / "logs") as pa, pod(cri, "nvidia", work / "logs") as pb_:
            a = pa.container("a", GPU_IMAGE, ["sh", "-c", hold.format(1200 * mib)],
                             Allocation(cdi_devices=ids), runtime_default_seccomp=True)
            pa.start(a)
            wait.until(lambda: "alloc 0" in pa.logs("a"), 60, "Pod A to hold 1200 MiB")
            b = pb_.container("b", GPU_IMAGE, ["sh", "-c", (
                f"vgpu_probe init ctx 0 alloc {1200 * mib} alloc {600 * mib} sleep 600000")],
                Allocation(cdi_devices=ids))
            pb_.start(b)
            wait.until(lambda: pb_.logs("b").count("alloc ") >= 2, 60, "Pod B's two allocations")
            allocs = [li for li in pb_.logs("b").splitlines() if li.startswith("alloc ")]
            assert allocs == ["alloc 2", "alloc 0"], pb_.logs("b")  # 2: out of memory
            used = sum(p.mem_used for p in read_state(state_path(sim.root), live_only=True)
                       .procs_on(1))
            assert 1800 * mib <= used <= 2 << 30, used
    finally:
        driver.unprepare("ns", "uid-share-b", "uid-share-b")
    assert driver.prepared_uids() == [] and not os.path.exists(driver.ledger_path("uid-share-b"))
    assert not os.path.exists(driver.spec_path("uid-share-b"))


def test_a_dra_share_that_could_leave_its_cap_is_refused(cri: CriClient, work: Path,
                                                        sim: SimHost, node: Node) -> None:
    """A share Pod under the engine's default handler with no seccomp profile (Unconfined,
    a Pod's default without the kubelet's seccompDefault) could make a user namespace and
    mount over its preload: the claim's hook refuses the start, saying what to set, and
    nothing of the container is left."""
    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    for path, off in (("/proc/sys/user/max_user_namespaces", "0"),
                      ("/proc/sys/kernel/unprivileged_userns_clone", "0")):
        if os.path.exists(path) and Path(path).read_text().strip() == off:
            pytest.skip(f"{path} is {off}: no user namespace to refuse")
    driver, ids = _dra_claim(sim, work, "gpu-1", "uid-share-u", **SHARE)
    try:
        with pytest.raises(CriError) as e:
            run(cri, work, Allocation(cdi_devices=ids), "true", handler="")
    finally:
        driver.unprepare("ns", "uid-share-u", "uid-share-u")
    assert e.value.call in ("CreateContainer", "StartContainer"), e.value
    assert "may make a user namespace" in e.value.details, e.value
    assert "seccompProfile type RuntimeDefault" in e.value.details, e.value
    assert node.leftovers() == []
    assert driver.prepared_uids() == [] and not os.path.exists(driver.ledger_path("uid-share-u"))


@HANDLERS
def test_dra_whole_gpu_claim_sees_its_gpu_only(cri: CriClient, work: Path, sim: SimHost,
                                               node: Node, handler: str) -> None:
    """A claim on GPU 1, prepared by the DRA driver: the kubelet hands its CDI ids to the
    engine in CDI_devices, the engine applies the claim's spec, and the container sees
    that GPU alone (the image's NVIDIA_VISIBLE_DEVICES=all widens nothing). After
    unprepare, nothing of the claim is left."""
    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    gpu1 = sim.topology.gpus[1]
    driver, ids = _dra_claim(sim, work, "gpu-1")
    try:
        res = run(cri, work, Allocation(cdi_devices=ids),
                  "nvidia-smi -L; ls /dev | grep -c '^nvidia[0-9]'", handler=handler)
    finally:
        driver.unprepare("ns", "gpu-1", "uid-gpu-1")
    assert res.exit_code == 0, res.logs
    assert res.logs.splitlines() == [f"GPU 0: {gpu1.name} (UUID: {gpu1.uuid})", "1"], res.logs
    assert not os.path.exists(driver.spec_path("uid-gpu-1"))
    assert driver.prepared_uids() == []


def test_dra_mig_claim_sees_its_mig_device(cri: CriClient, work: Path, sim: SimHost,
                                           node: Node) -> None:
    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    gpu0 = sim.topology.gpus[0]
    mig = gpu0.mig_devices[1]
    device = f"gpu-0-mig-{mig.index}"
    driver, ids = _dra_claim(sim, work, device)
    try:
        res = run(cri, work, Allocation(cdi_devices=ids),
                  "nvidia-smi -L; echo '== caps'; ls /dev/nvidia-caps; "
                  "echo '== sample'; cuda-vectoradd | grep Test")
    finally:
        driver.unprepare("ns", device, f"uid-{device}")
    assert res.exit_code == 0, res.logs
    smi, rest = res.logs.split("== caps\n")
    caps, sample = rest.split("== sample\n")
    assert_mig_view(smi, caps, gpu0, mig)
    assert sample.strip() == "Test PASSED"
    assert driver.prepared_uids() == []


def test_dra_whole_gpu_and_mig_claims_are_in_the_monitor(cri: CriClient, work: Path,
                                                         sim: SimHost, node: Node) -> None:
    """Containers that got a whole GPU or a MIG device by a DRA claim have no record of
    nvctk-runtime's (the claim's CDI spec gives the GPU): the monitor finds them by the
    GPU nodes in their OCI spec, with kind gpu / mig, their device, no cap, the memory
    the simulated driver counts for them, and the claim the kubelet names; the sandbox
    (no GPU) is not listed."""
    from nvctk.monitor.collect import Collector
    from nvctk.monitor.prom import render_text
    from support.daemons import short_dir
    from support.monitor import MIB, FakePodResources, pidns

    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    gpu0, gpu1 = sim.topology.gpus
    mig = gpu0.mig_devices[1]
    claims = {"whole": ("gpu-1", "uid-mon-whole", 300), "slice":
              (f"gpu-0-mig-{mig.index}", "uid-mon-mig", 200)}
    drivers = {k: _dra_claim(sim, work, dev, uid) for k, (dev, uid, _) in claims.items()}
    hold = "vgpu_probe init ctx 0 alloc {} sleep 600000"
    try:
        with short_dir("nvctk-pr-") as d, \
                pod(cri, "nvidia", work / "logs", name="dra-monitored") as p:
            sock = d / "kubelet.sock"
            kubelet = FakePodResources(sock, [{"name": "dra-monitored", "namespace": "default",
                                               "containers": [
                {"name": k, "dynamic_resources": [{
                    "claim_name": uid, "claim_namespace": "ns", "claim_resources": [{
                        "driver_name": "gpu.nvctk.io", "pool_name": "node-a", "device_name": dev,
                        "cdi_devices": [{"name": drivers[k][1][0]}]}]}]}
                for k, (dev, uid, _) in claims.items()]}])
            col = Collector(sim.root, [node.runtime_root], pod_resources=str(sock))
            try:
                ids = {}
                for k, (_, _, mib) in claims.items():
                    ids[k] = p.container(k, GPU_IMAGE, ["sh", "-c", hold.format(mib * MIB)],
                                         Allocation(cdi_devices=drivers[k][1]))
                    p.start(ids[k])

                def holding() -> bool:
                    got = {c.id: c.devices[0].memory_used
                           for c in col.collect().containers if c.devices}
                    return all(got.get(ids[k], 0) >= m * MIB for k, (_, _, m) in claims.items())

                wait.until(holding, 90, "the claims' containers to hold their memory")
                snap = col.collect()
                st = read_state(state_path(sim.root), live_only=True)
                sim_mem = {c.id: sum(s.mem_used for s in st.procs if s.pidns in {
                    pidns(pid) for pid in c.devices[0].processes}) for c in snap.containers}
                metrics = render_text(snap, {})
            finally:
                col.close()
                kubelet.stop()
    finally:
        for k, (_, uid, _) in claims.items():
            drivers[k][0].unprepare("ns", uid, uid)
    by_id = {c.id: c for c in snap.containers}
    assert set(by_id) == set(ids.values()), "the sandbox (no GPU) is not listed"
    for k, dev_uuid, kind in (("whole", gpu1.uuid, "gpu"), ("slice", mig.uuid, "mig")):
        c = by_id[ids[k]]
        assert c.kind == kind and f'kind="{kind}"' in metrics
        (dev,) = c.devices
        assert dev.device_uuid == dev_uuid and dev.processes
        assert dev.memory_limit is None and dev.sm_limit is None  # a whole device: no cap
        assert abs(dev.memory_used - sim_mem[c.id]) <= MIB
        assert sim_mem[c.id] >= claims[k][2] * MIB
        assert (c.namespace, c.pod, c.container, c.claim) == (
            "default", "dra-monitored", k, f"ns/{claims[k][1]}"), c
        assert f'claim="ns/{claims[k][1]}"' in metrics
    g0, g1 = snap.gpus
    assert (g0.shares, g1.shares) == (1, 1)
    assert g1.memory_promised == gpu1.memory_mib * MIB  # the whole GPU, as nvctk's whole GPUs
    assert g0.memory_promised == mig.memory_mib * MIB


def test_a_dra_shares_container_is_in_the_monitor_with_its_cap(
        cri: CriClient, work: Path, sim: SimHost, node: Node) -> None:
    """A 2 GiB share's container under the engine's default handler (no nvctk record in
    its bundle): the monitor lists it by its GPU node, kind vgpu, with the claim's cap
    read from the claim's ledger, the memory the simulated driver counts, and its claim."""
    from nvctk.monitor.collect import Collector
    from support.daemons import short_dir
    from support.monitor import MIB, FakePodResources

    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    gpu1 = sim.topology.gpus[1]
    driver, ids = _dra_claim(sim, work, "gpu-1", "uid-mon-share", **SHARE)
    try:
        with short_dir("nvctk-pr-") as d, pod(cri, "", work / "logs", name="share-mon") as p:
            sock = d / "kubelet.sock"
            kubelet = FakePodResources(sock, [{"name": "share-mon", "namespace": "default",
                                               "containers": [{"name": "s", "dynamic_resources": [{
                "claim_name": "uid-mon-share", "claim_namespace": "ns", "claim_resources": [{
                    "driver_name": "gpu.nvctk.io", "pool_name": "node-a", "device_name": "gpu-1",
                    "cdi_devices": [{"name": ids[0]}]}]}]}]}])
            # the default handler's runc state: CRI-O's runc root (containerd's covers both)
            roots = [node.runtime_root, *([f"crio={node.dir / 'runc'}"]
                                          if node.engine.startswith("crio") else [])]
            col = Collector(sim.root, roots, pod_resources=str(sock))
            try:
                cid = p.container("s", GPU_IMAGE, ["sh", "-c", (
                    f"vgpu_probe init ctx 0 alloc {300 * MIB} sleep 600000")],
                    Allocation(cdi_devices=ids), runtime_default_seccomp=True)
                p.start(cid)

                def holding() -> bool:
                    got = {c.id: c for c in col.collect().containers}
                    return cid in got and got[cid].devices[0].memory_used >= 300 * MIB

                wait.until(holding, 90, "the share's container to hold its memory")
                (c,) = [c for c in col.collect().containers if c.id == cid]
            finally:
                col.close()
                kubelet.stop()
    finally:
        driver.unprepare("ns", "uid-mon-share", "uid-mon-share")
    assert c.kind == "vgpu" and c.claim == "ns/uid-mon-share" and not c.outside_allocations
    (dev,) = c.devices
    assert dev.device_uuid == gpu1.uuid and dev.memory_limit == 2 << 30 and dev.sm_limit is None


def test_the_monitor_flags_a_gpu_outside_the_kubelets_allocations(
        cri: CriClient, work: Path, sim: SimHost, node: Node) -> None:
    """On a node left open (nvctk's defaults), three containers of a Pod under the nvidia
    handler hold GPU memory: `hole` asked the kubelet for nothing (its image's
    NVIDIA_VISIBLE_DEVICES=all gave it every GPU), `plugin` got GPU 1 from the device
    plugin, `claim` by a DRA claim. With the kubelet's pod-resources answer the monitor
    flags `hole` alone (nvctk_container_outside_allocations, snapshot, top)."""
    from rich.console import Console

    from nvctk.monitor.allocation import FLAG, METRIC
    from nvctk.monitor.collect import Collector
    from nvctk.monitor.prom import render_text
    from nvctk.monitor.top import render as top
    from support.daemons import short_dir
    from support.monitor import MIB, FakePodResources

    if not node.applies_cdi_devices:
        pytest.skip("containerd 1.6 drops the CRI's CDI_devices: DRA needs containerd 1.7+")
    gpu1 = sim.topology.gpus[1]
    driver, claim_ids = _dra_claim(sim, work, "gpu-1", "uid-mon-open")
    allocs = {"hole": Allocation(),
              "plugin": Allocation(envs={"NVIDIA_VISIBLE_DEVICES": gpu1.uuid}),
              "claim": Allocation(cdi_devices=claim_ids)}
    hold = f"vgpu_probe init ctx 0 alloc {64 * MIB} sleep 600000"
    try:
        with _node_config(sim, False), short_dir("nvctk-pr-") as d, \
                pod(cri, "nvidia", work / "logs", name="open-node") as p:
            sock = d / "kubelet.sock"
            kubelet = FakePodResources(sock, [{"name": "open-node", "namespace": "default",
                                               "containers": [
                {"name": "hole"},
                {"name": "plugin", "devices": [{"resource_name": "nvidia.com/gpu",
                                                "device_ids": [gpu1.uuid]}]},
                {"name": "claim", "dynamic_resources": [{
                    "claim_name": "uid-mon-open", "claim_namespace": "ns", "claim_resources": [{
                        "driver_name": "gpu.nvctk.io", "pool_name": "node-a",
                        "device_name": "gpu-1", "cdi_devices": [{"name": claim_ids[0]}]}]}]}]}])
            col = Collector(sim.root, [node.runtime_root], pod_resources=str(sock))
            try:
                ids = {}
                for k, a in allocs.items():
                    ids[k] = p.container(k, GPU_IMAGE, ["sh", "-c", hold], a)
                    p.start(ids[k])

                def listed() -> bool:
                    got = {c.id: c for c in col.collect().containers if c.devices and c.pod}
                    return set(ids.values()) <= set(got)

                wait.until(listed, 90, "the three containers in the monitor")
                snap = col.collect()
                metrics = render_text(snap, {})
            finally:
                col.close()
                kubelet.stop()
    finally:
        driver.unprepare("ns", "uid-mon-open", "uid-mon-open")
    by_id = {c.id: c for c in snap.containers}
    flagged = {k for k, i in ids.items() if by_id[i].outside_allocations}
    assert flagged == {"hole"}, [(by_id[i].container, by_id[i].resource, by_id[i].claim)
                                 for i in ids.values()]
    series = [li for li in metrics.splitlines() if li.startswith(METRIC + "{")]
    assert series and all('container="hole"' in li and li.endswith(" 1") for li in series), series
    console = Console(width=120, file=open(os.devnull, "w"), markup=False, emoji=False,  # noqa: SIM115
                      record=True)
    console.print(top(snap, 120))
    assert FLAG in console.export_text()


def test_nothing_left_behind(cri: CriClient, node: Node) -> None:
    """After the Pods above went (stopped and removed as the kubelet does): no
    container, task, shim or mount of theirs is left while the engine still runs."""
    pb = cri.pb
    assert list(cri.call("ListContainers", pb.ListContainersRequest()).containers) == []
    assert node.leftovers() == []
    # a shim (conmon) exits on its own shortly after its last container is deleted
    wait.until(lambda: not _shims(node.dir), 10, f"the shims to exit: {_shims(node.dir)}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f
                  if str(node.dir) in line.split()[4] and "/root/overlay" not in line.split()[4]
                  and not line.split()[4].endswith("/root")]
    assert mounts == []


def test_which_annotations_reach_the_runtime(cri: CriClient, work: Path, node: Node) -> None:
    """The device plugin's nvctk.io/ limits travel as container annotations, which only
    the kubelet sets: they must reach nvctk-runtime's OCI spec. A Pod's own annotations
    (its author's) must never carry nvctk.io/ there. Recorded per engine: containerd
    passes what its runtime's container_annotations / pod_annotations list (nvctk
    configure lists nvctk.io/* only in the first); CRI-O passes every container
    annotation and the Pod's annotations too, so on CRI-O an nvctk.io/ key counts only
    where `io.kubernetes.cri-o.Annotations` (CRI-O's JSON of the container's own
    annotations, which a Pod annotation of that name does not replace) lists it."""
    sync = work / f"sync-{node.engine}"
    sync.mkdir()
    with pod(cri, "nvidia", work / "logs", annotations={"nvctk.io/from-pod": "pod",
                                                        "nvctk.io/both": "pod",
                                                        "io.kubernetes.cri-o.Annotations": "{\"nvctk.io/forged\":\"x\"}",
                                                        "example.com/pod": "p"}) as p:
        alloc = Allocation(envs={"NVIDIA_VISIBLE_DEVICES": "none"},
                           annotations={"nvctk.io/from-container": "ctr",
                                        "nvctk.io/both": "ctr"},
                           mounts=[("/sync", str(sync), False)])
        # runs until the test has read its spec (containerd drops it when the task ends)
        cid = p.container("main", GPU_IMAGE,
                          ["sh", "-c", "while [ ! -e /sync/go ]; do sleep 0.05; done"], alloc)
        p.start(cid)
        # the spec the runtime got: containerd's task dir, CRI-O's userdata dirs
        # os.walk, not rglob: the engine removes snapshot dirs while the tree is walked
        found = [Path(d) / "config.json" for d, _, files in os.walk(node.dir)
                 if "config.json" in files]
        specs = [json.loads(f.read_text()) for f in found
                 if cid in f.parts or (f.parent.name == "userdata" and f.parent.parent.name == cid)]
        (sync / "go").touch()
        assert p.wait(cid) == 0
        cri.call("RemoveContainer", cri.pb.RemoveContainerRequest(container_id=cid))
    assert specs
    for spec in specs:
        got = spec.get("annotations", {})
        assert got.get("nvctk.io/from-container") == "ctr", got
        if node.engine.startswith("containerd"):
            assert "nvctk.io/from-pod" not in got and "example.com/pod" not in got, got
        else:
            # CRI-O: the Pod's annotations are in the container's spec too (the
            # container's win a clash); only CRI-O's own record of the container's
            # annotations tells them apart, and a Pod cannot forge that record
            assert got.get("nvctk.io/from-pod") == "pod", got
            assert got["nvctk.io/both"] == "ctr", got
            assert json.loads(got["io.kubernetes.cri-o.Annotations"]) == {
                "nvctk.io/from-container": "ctr", "nvctk.io/both": "ctr"}, got


def test_the_monitor_names_the_kubelets_pod_not_one_its_author_wrote(
        cri: CriClient, work: Path, sim: SimHost, node: Node) -> None:
    """A GPU container's namespace, Pod, container and Pod uid in the monitor are the
    kubelet's (its CRI metadata and labels), even when the Pod's own annotations, which
    its author writes and CRI-O copies into every container's spec, spell the keys an
    engine records the identity under, or CRI-O's record of the container's labels."""
    from nvctk.monitor.collect import Collector

    forged = {"io.kubernetes.pod.namespace": "kube-system", "io.kubernetes.pod.name": "forged",
              "io.kubernetes.container.name": "forged", "io.kubernetes.pod.uid": "forged",
              "io.kubernetes.cri.sandbox-namespace": "kube-system",
              "io.kubernetes.cri.sandbox-name": "forged",
              "io.kubernetes.cri.container-name": "forged",
              "io.kubernetes.cri.sandbox-uid": "forged",
              "io.kubernetes.cri-o.Labels": json.dumps({"io.kubernetes.pod.namespace":
                                                        "kube-system"})}
    sync = work / f"sync-id-{node.engine}"
    sync.mkdir()
    with pod(cri, "nvidia", work / "logs", name="named-by-kubelet", annotations=forged) as p:
        cid = p.container("gpu", GPU_IMAGE,
                          ["sh", "-c", "while [ ! -e /sync/go ]; do sleep 0.05; done"],
                          Allocation(envs={"NVIDIA_VISIBLE_DEVICES": "0"},
                                     mounts=[("/sync", str(sync), False)]))
        p.start(cid)
        col = Collector(sim.root, [node.runtime_root])
        try:
            c = wait.until(lambda: next((c for c in col.collect().containers if c.id == cid),
                                        None), 30, "the monitor to list the container")
        finally:
            col.close()
            (sync / "go").touch()
        assert p.wait(cid) == 0
        meta = p.config.metadata
    assert c is not None
    assert (c.namespace, c.pod, c.container, c.pod_uid) == (
        "default", "named-by-kubelet", "gpu", meta.uid), c


def _shims(root: Path) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"containerd-shim" in argv[0] or argv[0].endswith(b"conmon")) \
                and any(str(root).encode() in a for a in argv):
            out.append(pid)
    return out


# --- the client's pieces, without a daemon ------------------------------------------------------


def test_parse_cri_log_joins_partial_lines() -> None:
    text = ("2026-01-01T00:00:00.000000001Z stdout P abc\n"
            "2026-01-01T00:00:00.000000002Z stdout F def\n"
            "2026-01-01T00:00:00.000000003Z stderr F \n"
            "2026-01-01T00:00:00.000000004Z stdout F x y  z\n")
    assert parse_cri_log(text) == "abcdef\n\nx y  z\n"


def test_allocation_from_a_device_plugin_response() -> None:
    """The kubelet's mapping of a v1beta1 ContainerAllocateResponse, on the device
    plugin's own generated message class."""
    try:
        from nvctk.k8s import proto
        pb, _ = proto.load()
    except Exception as e:  # the plugin's generated code is built by `make setup`
        pytest.skip(f"device plugin proto not available: {e}")
    resp = pb.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": "GPU-a", "CUDA_DEVICE_SM_LIMIT": "25"},
        mounts=[pb.Mount(container_path="/var/run/nvidia-container-devices/GPU-a",
                         host_path="/dev/null", read_only=True)],
        devices=[pb.DeviceSpec(container_path="/dev/nvidia0", host_path="/dev/nvidia0",
                               permissions="rw")],
        annotations={CDI_KEY: "nvidia.com/gpu=GPU-a"},
        cdi_devices=[pb.CDIDevice(name="nvidia.com/gpu=GPU-a")],
    )
    a = Allocation.from_response(resp)
    assert a == Allocation(
        envs={"NVIDIA_VISIBLE_DEVICES": "GPU-a", "CUDA_DEVICE_SM_LIMIT": "25"},
        annotations={CDI_KEY: "nvidia.com/gpu=GPU-a"},
        mounts=[("/var/run/nvidia-container-devices/GPU-a", "/dev/null", True)],
        devices=[("/dev/nvidia0", "/dev/nvidia0", "rw")],
        cdi_devices=["nvidia.com/gpu=GPU-a"],
    )


# --- issue 39: a Pod that asks for no GPU gets none on a node configured as shipped ---
NO_GPU = "ls /dev | grep -c '^nvidia' || true; " \
    "ls /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib 2>/dev/null | grep -c 'libcuda\\|libnvidia' || true"


@pytest.mark.parametrize("env", ["image", "pod-all", "pod-uuid"])
@pytest.mark.parametrize("shipped", [True, False], ids=["shipped", "open"])
def test_a_pod_without_a_gpu_request_gets_no_gpu_on_a_shipped_node(
        cri: CriClient, work: Path, sim: SimHost, env: str, shipped: bool) -> None:
    """A Pod under the nvidia handler that asks the kubelet for nothing, with
    NVIDIA_VISIBLE_DEVICES=all from its image (CUDA images have it) or its own env, or a
    GPU's UUID in its env: on a node configured as shipped for Kubernetes it sees no GPU
    node and no driver library; on an open node (nvctk's defaults, as for Docker) the
    same Pod gets the GPUs, uncapped: the hole the shipped config closes."""
    gpu1 = sim.topology.gpus[1]
    envs = {"pod-all": {"NVIDIA_VISIBLE_DEVICES": "all"},
            "pod-uuid": {"NVIDIA_VISIBLE_DEVICES": gpu1.uuid}}.get(env, {})
    with _node_config(sim, shipped):
        res = run(cri, work, Allocation(envs=envs), NO_GPU)
    assert res.exit_code == 0, res.logs
    nodes, libs = (int(x) for x in res.logs.split())
    if shipped:
        assert (nodes, libs) == (0, 0), res.logs
    else:
        assert nodes > 0 and libs > 0, res.logs


def test_a_pods_own_cdi_annotation_gets_no_gpu_on_a_shipped_node(
        cri: CriClient, work: Path, sim: SimHost) -> None:
    """A Pod's own annotation `cdi.k8s.io/...` naming a GPU (its author writes it; CRI-O
    copies a Pod's annotations into every container's spec): on a shipped node the Pod
    gets no GPU from it."""
    gpu1 = sim.topology.gpus[1]
    with _node_config(sim, True), pod(cri, "nvidia", work / "logs", annotations={
            CDI_KEY: f"nvidia.com/gpu={gpu1.uuid}"}) as p:
        cid = p.container("main", GPU_IMAGE, ["sh", "-c", NO_GPU], Allocation())
        p.start(cid)
        assert p.wait(cid) == 0, p.logs("main")
        logs = p.logs("main")
    assert [int(x) for x in logs.split()] == [0, 0], logs


def test_a_device_plugin_vgpu_share_on_a_shipped_node(cri: CriClient, work: Path,
                                                      sim: SimHost) -> None:
    """The device plugin's vGPU share with its default device list (volume-mounts) on a
    node configured as shipped: the container sees its GPU only, capped at a quarter,
    though the Pod's env says NVIDIA_VISIBLE_DEVICES=all (it comes after the plugin's
    in the CRI config, so it wins there: the shipped node does not read it)."""
    gpu1 = sim.topology.gpus[1]
    try:
        alloc = _plugin_allocation(sim, {"version": "v1", "flags": {"migStrategy": "mixed"},
                                         "sharing": {"vgpu": {"replicas": 4}}},
                                   "nvidia.com/vgpu", lambda ids: ids[:1])
    except ImportError as e:  # the plugin's generated gRPC code is built by `make setup`
        pytest.skip(f"device plugin not available: {e}")
    assert alloc.mounts and alloc.envs["NVIDIA_VISIBLE_DEVICES"] != gpu1.uuid  # not by env
    alloc.envs["NVIDIA_VISIBLE_DEVICES"] = "all"  # the Pod's own, last
    with _node_config(sim, True):
        res = run(cri, work, alloc,
                  "nvidia-smi --query-gpu=uuid,memory.total --format=csv,noheader,nounits; "
                  "ls /dev | grep -c '^nvidia[0-9]'")
    assert res.exit_code == 0, res.logs
    assert res.logs.splitlines() == [f"{gpu1.uuid}, {gpu1.memory_mib // 4}", "1"], res.logs


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


PLUGIN_CASES = [
    # (plugin config, resource, which ids, script, judge of its output)
    # (an open node, nvctk's defaults: the device list by env, as configured here)
    ({"version": "v1", "flags": {"migStrategy": "mixed", "deviceListStrategy": "envvar"}},
     "nvidia.com/mig-2g.20gb",
     lambda ids: ids[:1], "nvidia-smi -L | grep -c MIG", "1"),
    ({"version": "v1", "flags": {"migStrategy": "mixed", "deviceListStrategy": ["cdi-annotations"]}},
     "nvidia.com/gpu", lambda ids: ids[:1], "nvidia-smi -L | grep -c '^GPU'", "1"),
    ({"version": "v1", "flags": {"migStrategy": "mixed", "deviceListStrategy": "envvar"},
      "sharing": {"vgpu": {"replicas": 4}}},
     "nvidia.com/vgpu", lambda ids: ids[:2],  # two shares of one GPU add up: half of it
     "nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits", "half"),
    # a share with the cdi-cri strategy beside envvar: the engine injects the CDI device,
    # nvctk-runtime caps it from the env
    ({"version": "v1", "flags": {"migStrategy": "mixed",
                                 "deviceListStrategy": ["envvar", "cdi-cri"]},
      "sharing": {"vgpu": {"replicas": 4}}},
     "nvidia.com/vgpu", lambda ids: ids[:1],
     "nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits", "quarter"),
]


@pytest.mark.parametrize(("config", "resource", "pick", "script", "want"), PLUGIN_CASES,
                         ids=["mig-envvar", "whole-cdi-annotations", "vgpu-two-shares",
                              "vgpu-envvar-and-cdi-cri"])
def test_pods_get_what_the_device_plugin_allocated(
        cri: CriClient, work: Path, sim: SimHost, config: dict[str, object], resource: str,
        pick: Callable[[list[str]], list[str]], script: str, want: str) -> None:
    try:
        alloc = _plugin_allocation(sim, config, resource, pick)
    except ImportError as e:  # the plugin's generated gRPC code is built by `make setup`
        pytest.skip(f"device plugin not available: {e}")
    res = run(cri, work, alloc, script)
    assert res.exit_code == 0, res.logs
    if want == "half":
        want = str(sim.topology.gpus[1].memory_mib // 2)
    if want == "quarter":
        want = str(sim.topology.gpus[1].memory_mib // 4)
    assert res.logs.strip() == want, (alloc, res.logs)


@pytest.mark.parametrize("strategies", [["cdi-cri"], ["cdi-annotations"],
                                        ["cdi-annotations", "cdi-cri"]])
def test_a_vgpu_share_cannot_ride_cdi_strategies_alone(strategies: list[str]) -> None:
    """With only CDI strategies the engine (containerd 2.x, CRI-O) injects the GPU from
    its CDI spec and nvctk-runtime never sets up the cap: a Pod of a 1/4 share got the
    whole 80 GiB on containerd 2.3.4 and CRI-O 1.36.3. The plugin refuses the config."""
    from nvctk.base.errors import ConfigError
    from nvctk.k8s import config as dpconfig

    with pytest.raises(ConfigError, match=r"sharing\.vgpu needs deviceListStrategy envvar"):
        dpconfig.parse({"version": "v1", "flags": {"deviceListStrategy": strategies},
                        "sharing": {"vgpu": {"replicas": 4}}}, "test")
