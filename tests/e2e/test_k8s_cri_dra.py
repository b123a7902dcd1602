"""DRA claims on a CRI node (tests/support/crinode.py; see test_k8s_cri_pods.py): a
share sees its GPU and cannot pass its cap, two Pods of one claim hold one cap, a share that
could leave its cap is refused, whole-GPU and MIG claims see their device only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost
from nvctk.sim.state import read_state, state_path

pytestmark = [pytest.mark.slow, pytest.mark.root]

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")

import support.crinode as _crinode  # noqa: E402
from support import wait  # noqa: E402
from support.cri import Allocation, CriClient, CriError, pod  # noqa: E402
from support.crinode import GPU_IMAGE, SHARE, Node, _dra_claim, _node_config, run  # noqa: E402
from support.sim import assert_mig_view  # noqa: E402

work, sim, images, node, cri = (  # fixtures
    _crinode.work, _crinode.sim, _crinode.images, _crinode.node, _crinode.cri)


# "": the engine's default handler (runc), as a DRA Pod without runtimeClassName gets
HANDLERS = pytest.mark.parametrize("handler", ["", "nvidia"], ids=["default-handler", "nvidia"])

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
