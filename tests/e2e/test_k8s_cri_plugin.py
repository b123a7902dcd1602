"""The CRI client's pieces without a daemon, the device plugin's answers on a CRI node
(tests/support/crinode.py; see test_k8s_cri_pods.py), and issue 39: a Pod that asks for
no GPU gets none on a node configured as shipped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost

pytestmark = [pytest.mark.slow, pytest.mark.root]

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")

import support.crinode as _crinode  # noqa: E402
from support.cri import Allocation, CriClient, parse_cri_log, pod  # noqa: E402
from support.crinode import CDI_KEY, GPU_IMAGE, _node_config, _plugin_allocation, run  # noqa: E402

work, sim, images, node, cri = (  # fixtures
    _crinode.work, _crinode.sim, _crinode.images, _crinode.node, _crinode.cri)


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
