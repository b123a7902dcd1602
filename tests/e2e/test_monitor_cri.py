"""The monitor with Pods the way the kubelet runs them: the real containerd (Debian's 1.6) and
its CRI plugin, configured by `nvctk configure`, Pods on the `nvidia` handler (as in
tests/e2e/test_k8s_cri_pods.py, whose daemon set-up, tests/support/crinode.py, this
repeats). The monitor finds their containers in containerd's runc state and labels their
series with the Pod's namespace, name and container name from the annotations
containerd's CRI puts in the OCI spec; their memory is the simulated GPU's own count.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost

pytestmark = [pytest.mark.slow, pytest.mark.root]

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")

from support.cri import Allocation, CriClient, pod  # noqa: E402
from support.daemons import Containerd, containerd_workdir, gpu_containerd  # noqa: E402
from support.monitor import MIB, PROBE, REPO, sim_mem_of  # noqa: E402
from support.sim import sim_in  # noqa: E402
from support.wait import until as wait_until  # noqa: E402

PAUSE = "nvctk.test/pause:1"
GPU_IMAGE = "nvctk.test/gpu-monitor:1"


work = containerd_workdir("nvctk-m-")


@pytest.fixture(scope="module")
def sim(work: Path) -> SimHost:
    return sim_in(work, gpus=3, mig={2: ["3g.40gb"]}, seed="monitor-cri")


@pytest.fixture(scope="module")
def ctd(work: Path, sim: SimHost) -> Iterator[Containerd]:
    subprocess.run(["make", "-s", "-C", str(REPO / "libvgpu")], check=True, capture_output=True)
    with gpu_containerd(work, sim, PAUSE, GPU_IMAGE, {"PATH": "/usr/local/bin:/usr/bin:/bin"},
                        add_files=lambda root: shutil.copy(PROBE, root / "usr/local/bin/vgpu_probe")
                        ) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def cri(ctd: Containerd) -> Iterator[CriClient]:
    with CriClient(ctd.socket) as client:
        yield client


def _samples_text(text: str) -> str:
    """Prometheus text as one `name{labels} value` line a sample (labels as a dict's repr)."""
    from prometheus_client.parser import text_string_to_metric_families

    return "".join(f"{s.name}{s.labels} {s.value}\n"
                   for m in text_string_to_metric_families(text) for s in m.samples)


def test_pod_series_carry_namespace_pod_and_container(cri: CriClient, work: Path,
                                                        sim: SimHost) -> None:
    from nvctk.monitor.collect import Collector
    from nvctk.monitor.prom import render_text

    g0, g1, g2 = sim.topology.gpus
    mig = g2.mig_devices[0]
    hold = "vgpu_probe init ctx 0 alloc {} sleep 600000"
    col = Collector(sim.root, [f"containerd={work / 'ctd' / 'runc' / '*'}"])
    try:
        with pod(cri, "nvidia", work / "logs", name="trainer-a") as pa, \
                pod(cri, "nvidia", work / "logs", name="trainer-b") as pb_:
            want = {}
            for p, cname, env, mem in (
                (pa, "share", {"NVIDIA_VISIBLE_DEVICES": g0.uuid,
                               "CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_SM_LIMIT": "25"}, 300),
                (pa, "whole", {"NVIDIA_VISIBLE_DEVICES": g1.uuid}, 200),
                (pb_, "slice", {"NVIDIA_VISIBLE_DEVICES": mig.uuid}, 100),
            ):
                cid = p.container(cname, GPU_IMAGE, ["sh", "-c", hold.format(mem * MIB)],
                                  Allocation(envs=env))
                p.start(cid)
                want[cid] = (p.config.metadata.name, cname, mem * MIB)

            def all_hold() -> bool:
                snap = col.collect()
                got = {c.id: c.devices[0].memory_used for c in snap.containers if c.devices}
                return all(got.get(cid, 0) >= m for cid, (_, _, m) in want.items())

            wait_until(all_hold, 90, "the Pods' processes to hold their memory")
            snap = col.collect()
            # the sim's own count for each container's processes (its pid namespace)
            sim_mem = sim_mem_of(snap, sim.root)
            metrics = _samples_text(render_text(snap, {}))
    finally:
        col.close()
    by_id = {c.id: c for c in snap.containers}
    assert set(by_id) == set(want), "the pause containers (no GPU) are not listed"
    for cid, (pod_name, cname, mem) in want.items():
        c = by_id[cid]
        assert (c.namespace, c.pod, c.container) == ("default", pod_name, cname)
        assert c.pod_uid
        d = c.devices[0]
        assert d.processes
        assert abs(d.memory_used - sim_mem[cid]) <= MIB and sim_mem[cid] >= mem
        assert f"'pod': '{pod_name}'" in metrics and f"'container': '{cname}'" in metrics
    kinds = {by_id[c].container: by_id[c].kind for c in want}
    assert kinds == {"share": "vgpu", "whole": "gpu", "slice": "mig"}
    assert by_id[next(c for c in want if want[c][1] == "slice")].devices[0].device_uuid == mig.uuid
    # once the Pods are gone, so are their containers
    col2 = Collector(sim.root, [f"containerd={work / 'ctd' / 'runc' / '*'}"])
    try:
        assert col2.collect().containers == []
    finally:
        col2.close()
