"""What tests/e2e/test_monitor_e2e*.py share: a simulated node running capped, whole-GPU
and MIG containers, `nvctk monitor` on it and a real Prometheus server scraping it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.monitor import MIB, Node, standard_containers

REPO = Path(__file__).resolve().parents[2]

K8S = {"io.kubernetes.cri.sandbox-namespace": "team-a", "io.kubernetes.cri.sandbox-name": "trainer-0",
       "io.kubernetes.cri.container-name": "worker", "io.kubernetes.cri.sandbox-uid": "1234-5678"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("monitor-e2e"))
    try:
        standard_containers(n)
        g0 = n.sim.topology.gpus[0]
        # a container as containerd's CRI makes them: its Pod's identity in the annotations
        n.start({"CUDA_DEVICE_MEMORY_LIMIT": "3g", "CUDA_DEVICE_SM_LIMIT": "25"},
                f"vgpu_probe init ctx 0 alloc {700 * MIB} launchfor 100000", gpu="0",
                wait_mem=700 * MIB, annotations=K8S, kind="vgpu", device=g0.uuid,
                mem_cap=3 << 30, sm_cap=0.25, min_mem=700 * MIB, busy=True)
        yield n
    finally:
        n.cleanup()
