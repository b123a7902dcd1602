"""Pods the way the kubelet runs them: the real containerd (Debian's 1.6 and 2.3) or
CRI-O with its CRI, configured by `nvctk configure`, a CRI client (tests/support/cri.py)
doing RunPodSandbox with the `nvidia` runtime handler (host network, so no CNI),
CreateContainer with what a device plugin's Allocate returns, StartContainer, and the
container's CRI log read back (the nodes: tests/support/crinode.py).

Here: whole GPUs, MIG devices, vGPU shares, CDI devices and annotations, what fails
clearly, which annotations reach the runtime. DRA claims: test_k8s_cri_dra.py; the
monitor on these nodes: test_k8s_cri_monitor.py; device plugin answers and a node
configured as shipped: test_k8s_cri_plugin.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost

pytestmark = [pytest.mark.slow, pytest.mark.root]

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")

import support.crinode as _crinode  # noqa: E402
from support.cri import Allocation, CriClient, CriError, pod  # noqa: E402
from support.crinode import CDI_KEY, GPU_IMAGE, Node, _plugin_allocation, run  # noqa: E402
from support.sim import assert_mig_view  # noqa: E402

work, sim, images, node, cri = (  # fixtures
    _crinode.work, _crinode.sim, _crinode.images, _crinode.node, _crinode.cri)


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
