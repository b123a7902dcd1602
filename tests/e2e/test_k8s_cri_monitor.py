"""The monitor on a CRI node (tests/support/crinode.py; see test_k8s_cri_pods.py): DRA
claims and shares are in it with their caps, a GPU outside the kubelet's allocations is
flagged, the Pod it names is the kubelet's; and nothing is left behind after the Pods.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.host import SimHost

pytestmark = [pytest.mark.slow, pytest.mark.root]

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")

import support.crinode as _crinode  # noqa: E402
from support import wait  # noqa: E402
from support.cri import Allocation, CriClient, pod  # noqa: E402
from support.crinode import GPU_IMAGE, SHARE, Node, _dra_claim, _node_config  # noqa: E402
from support.daemons import short_dir  # noqa: E402

work, sim, images, node, cri = (  # fixtures
    _crinode.work, _crinode.sim, _crinode.images, _crinode.node, _crinode.cri)


def _assert_whole_and_mig_listed(snap: Any, ids: dict[str, str],
                                 claims: dict[str, tuple[str, str, int]], sim_mem: dict[str, int],
                                 metrics: str, gpu1: Any, mig: Any) -> None:
    """What test_dra_whole_gpu_and_mig_claims_are_in_the_monitor's snapshot must show."""
    from support.monitor import MIB

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


def test_dra_whole_gpu_and_mig_claims_are_in_the_monitor(cri: CriClient, work: Path,
                                                         sim: SimHost, node: Node) -> None:
    """Containers that got a whole GPU or a MIG device by a DRA claim have no record of
    nvctk-runtime's (the claim's CDI spec gives the GPU): the monitor finds them by the
    GPU nodes in their OCI spec, with kind gpu / mig, their device, no cap, the memory
    the simulated driver counts for them, and the claim the kubelet names; the sandbox
    (no GPU) is not listed."""
    from nvctk.monitor.collect import Collector
    from nvctk.monitor.prom import render_text
    from support.monitor import MIB, FakePodResources, sim_mem_of

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
                sim_mem = sim_mem_of(snap, sim.root)
                metrics = render_text(snap, {})
            finally:
                col.close()
                kubelet.stop()
    finally:
        for k, (_, uid, _) in claims.items():
            drivers[k][0].unprepare("ns", uid, uid)
    _assert_whole_and_mig_listed(snap, ids, claims, sim_mem, metrics, gpu1, mig)


def test_a_dra_shares_container_is_in_the_monitor_with_its_cap(
        cri: CriClient, work: Path, sim: SimHost, node: Node) -> None:
    """A 2 GiB share's container under the engine's default handler (no nvctk record in
    its bundle): the monitor lists it by its GPU node, kind vgpu, with the claim's cap
    read from the claim's ledger, the memory the simulated driver counts, and its claim."""
    from nvctk.monitor.collect import Collector
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


def _assert_only_hole_flagged(snap: Any, ids: dict[str, str], metrics: str) -> None:
    """The monitor flags `hole` alone: in the snapshot, the metric and top."""
    from rich.console import Console

    from nvctk.monitor.allocation import FLAG, METRIC
    from nvctk.monitor.top import render as top

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


def test_the_monitor_flags_a_gpu_outside_the_kubelets_allocations(
        cri: CriClient, work: Path, sim: SimHost, node: Node) -> None:
    """On a node left open (nvctk's defaults), three containers of a Pod under the nvidia
    handler hold GPU memory: `hole` asked the kubelet for nothing (its image's
    NVIDIA_VISIBLE_DEVICES=all gave it every GPU), `plugin` got GPU 1 from the device
    plugin, `claim` by a DRA claim. With the kubelet's pod-resources answer the monitor
    flags `hole` alone (nvctk_container_outside_allocations, snapshot, top)."""
    from nvctk.monitor.collect import Collector
    from nvctk.monitor.prom import render_text
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
    _assert_only_hole_flagged(snap, ids, metrics)


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
