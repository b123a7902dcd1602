"""A Pod cannot loosen the vGPU share the node gave it, through the real
containerd CRI (Debian's 1.6) and nvctk-runtime, judged by the cap libvgpu enforces in
the container (the memory total it reports, what it lets the container allocate).

The device plugin's Allocate answer is the real one (nvctk.k8s.allocate with
the node's authority key); the kubelet's part is played as it does it: the plugin's
envs first, the Pod's own env after them (CRI applies them in order, so a Pod's value
replaces the plugin's), the plugin's annotations on the container, the Pod's
annotations on the sandbox.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost

pytestmark = [pytest.mark.slow, pytest.mark.root]

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")

from support import wait  # noqa: E402
from support.cri import Allocation, CriClient, CriError, parse_cri_log  # noqa: E402
from support.daemons import Containerd, containerd_workdir, gpu_containerd  # noqa: E402
from support.sim import sim_in  # noqa: E402

PAUSE = "nvctk.test/pause:1"
IMAGE = "nvctk.test/gpu-hostile:1"
GPU_MIB = 4096
REPLICAS = 4
SHARE_MIB = GPU_MIB // REPLICAS
# envvar: an open node's device list (nvctk's defaults), where a Pod's env is the threat
PLUGIN = {"version": "v1", "flags": {"deviceListStrategy": "envvar"},
          "sharing": {"vgpu": {"replicas": REPLICAS}}}
PODANN = "nvidia-podann"  # a runtime whose operator let Pod annotations through
SCRIPT = (f"nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits; "
          f"cuda-vectoradd --alloc-mib {SHARE_MIB + 64}; cuda-vectoradd --alloc-mib {SHARE_MIB // 2}; "
          "grep -h '^CUDA_DEVICE_SM' /run/nvctk/vgpu/limits 2>/dev/null; true")




work = containerd_workdir("nvctk-a-")


@pytest.fixture(scope="module")
def sim(work: Path) -> SimHost:
    return sim_in(work, gpus=2, memory_mib=GPU_MIB)


def _runtimes_table(cfg: Path) -> None:
    """nvctk.io/* in the nvidia runtime's container_annotations (what `nvctk configure`
    lists: added here where this branch's configure does not yet), and a second
    runtime, nvidia-podann, that also lists nvctk.io/* in pod_annotations (an operator's
    mistake: every Pod annotation with that prefix then reaches the container's spec)."""
    import tomlkit

    doc = tomlkit.parse(cfg.read_text())
    runtimes = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]  # type: ignore[index]
    nv = runtimes["nvidia"]  # type: ignore[index]
    have = list(nv.get("container_annotations", []))  # type: ignore[union-attr]
    assert not any(p.startswith("nvctk.io") for p in nv.get("pod_annotations", [])), \
        "nvctk configure must never pass Pod annotations under nvctk.io/"  # type: ignore[union-attr]
    if "nvctk.io/*" not in have:
        nv["container_annotations"] = [*have, "nvctk.io/*"]  # type: ignore[index]
    podann = copy.deepcopy(nv.unwrap())  # type: ignore[union-attr]
    podann["pod_annotations"] = ["nvctk.io/*"]
    runtimes[PODANN] = podann  # type: ignore[index]
    cfg.write_text(tomlkit.dumps(doc))


@pytest.fixture(scope="module")
def ctd(work: Path, sim: SimHost) -> Iterator[Containerd]:
    # a hostile image: it asks for every GPU and lifts the first GPU's limit
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES": "all",
           "CUDA_DEVICE_MEMORY_LIMIT_0": "0", "CUDA_DEVICE_SM_LIMIT_0": "100"}
    with gpu_containerd(work, sim, PAUSE, IMAGE, env, edit_config=_runtimes_table) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def cri(ctd: Containerd) -> Iterator[CriClient]:
    with CriClient(ctd.socket) as client:
        yield client


def _plugin(sim: SimHost, shares: int = 1, gpu: int = 1) -> Allocation:
    """The device plugin's answer for `shares` shares of GPU `gpu`, with the node's key
    (nvctk's config authority-key, as `nvctk device-plugin` sets it)."""
    from nvctk.base import config as nvconfig
    from nvctk.host.nvml import query_host
    from nvctk.k8s import allocate, resources, server
    from nvctk.k8s import config as dpconfig

    cfg = dataclasses.replace(dpconfig.parse(PLUGIN, "test"),
                              authority_key=nvconfig.load(sim.config_path).authority_key)
    (res,) = resources.build(cfg, query_host(sim.root))
    u = sim.topology.gpus[gpu].uuid
    ids = sorted(i for i in res.devices if i.startswith(u))[:shares]
    return Allocation.from_response(server.to_pb(allocate.allocate(res, cfg, ids, sim.root)))


def _run(cri: CriClient, work: Path, alloc: Allocation, *, pod_env: dict[str, str] | None = None,
         pod_annotations: dict[str, str] | None = None, handler: str = "nvidia") -> tuple[int, str]:
    """One Pod, one container running SCRIPT: (exit code, logs). CriError when a call
    fails; the Pod is stopped and removed either way."""
    pb = cri.pb
    name = f"auth-{uuid.uuid4().hex[:8]}"
    log_dir = work / "logs" / name
    log_dir.mkdir(parents=True)
    node = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
    sandbox = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=uuid.uuid4().hex, namespace="default"),
        log_directory=str(log_dir), annotations=pod_annotations or {},
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=node)))
    sid = cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sandbox,
                                                           runtime_handler=handler)).pod_sandbox_id
    try:
        # the kubelet's order: the device plugin's envs, then the Pod's
        envs = [*alloc.envs.items(), *(pod_env or {}).items()]
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="main"), image=pb.ImageSpec(image=IMAGE),
            command=["sh", "-c", SCRIPT],
            envs=[pb.KeyValue(key=k, value=v.encode()) for k, v in envs],
            mounts=[pb.Mount(container_path=c, host_path=h, readonly=ro) for c, h, ro in alloc.mounts],
            annotations=alloc.annotations, log_path="main.log",
            linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER))))
        cid = cri.call("CreateContainer", pb.CreateContainerRequest(
            pod_sandbox_id=sid, sandbox_config=sandbox, config=config)).container_id
        try:
            cri.call("StartContainer", pb.StartContainerRequest(container_id=cid))
            st = wait.until(lambda: (s := cri.container_state(cid)).state == pb.CONTAINER_EXITED
                            and s, 60, "the container to exit")
            return int(st.exit_code), parse_cri_log((log_dir / "main.log").read_text())
        finally:
            cri.call("RemoveContainer", pb.RemoveContainerRequest(container_id=cid))
    finally:
        cri.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sid))
        cri.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sid))


def _capped_at_the_share(logs: str) -> None:
    """libvgpu's cap: the share as the GPU's memory, an allocation above it refused."""
    lines = logs.splitlines()
    assert lines[0] == str(SHARE_MIB), logs
    assert lines[1].endswith(f"alloc {SHARE_MIB + 64} MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"), logs
    assert lines[2].endswith(f"alloc {SHARE_MIB // 2} MiB: OK"), logs
    # the SM share too: the image's CUDA_DEVICE_SM_LIMIT_0=100 does not lift 100/REPLICAS
    assert lines[3:] == [f"CUDA_DEVICE_SM_LIMIT_0={100 // REPLICAS}"], logs


@pytest.mark.parametrize("pod_env", [
    {},
    {"CUDA_DEVICE_MEMORY_LIMIT": "0", "CUDA_DEVICE_SM_LIMIT": "0"},
    {"CUDA_DEVICE_MEMORY_LIMIT": f"{GPU_MIB}m", "CUDA_DEVICE_MEMORY_LIMIT_0": f"{GPU_MIB}m"},
    {"NVCTK_VGPU_CONTEXT_RESERVE": "0"},
], ids=["image-env-only", "pod-env-zero", "pod-env-whole-gpu", "pod-env-reserve-zero"])
def test_pod_and_image_cannot_lift_the_share(cri: CriClient, work: Path, sim: SimHost,
                                             pod_env: dict[str, str]) -> None:
    """The image's ENV (_0=0) and the Pod's env (0, or the whole GPU) replace or
    override the plugin's CUDA_DEVICE_MEMORY_LIMIT; the share in the plugin's annotation
    holds: a quarter of the GPU, and an allocation above it fails."""
    code, logs = _run(cri, work, _plugin(sim), pod_env=pod_env)
    assert code == 0, logs
    _capped_at_the_share(logs)


def test_pod_env_can_tighten_the_share(cri: CriClient, work: Path, sim: SimHost) -> None:
    code, logs = _run(cri, work, _plugin(sim), pod_env={"CUDA_DEVICE_MEMORY_LIMIT": "512m"})
    assert code == 0, logs
    assert logs.splitlines()[0] == "512", logs


def test_pod_annotation_is_no_authority(cri: CriClient, work: Path, sim: SimHost) -> None:
    """A Pod's own nvctk.io/vgpu.* annotation: containerd's default (no pod_annotations)
    never puts it in the container's spec, so it neither caps nor refuses; where an
    operator lets it through, a forged one fails the MAC and the container is refused;
    a genuine but looser one copied from a two-share Pod loses to the container's own
    (containerd applies Pod annotations first, the container's after)."""
    from nvctk.vgpu import authority

    gpu1 = sim.topology.gpus[1].uuid
    forged = {authority.annotation_key("nvidia.com/vgpu"):
              authority.make("nvidia.com/vgpu", [(gpu1, 1 << 20, 1)], os.urandom(32))[1]}
    uncapped = Allocation(envs={"NVIDIA_VISIBLE_DEVICES": gpu1})
    code, logs = _run(cri, work, uncapped, pod_annotations=forged)
    assert code == 0 and logs.splitlines()[0] == str(GPU_MIB), logs  # never reached nvctk
    with pytest.raises(CriError) as e:
        _run(cri, work, uncapped, pod_annotations=forged, handler=PODANN)
    assert e.value.call == "StartContainer"
    assert "MAC does not verify" in e.value.details, e.value
    looser = _plugin(sim, shares=2).annotations
    code, logs = _run(cri, work, _plugin(sim), pod_annotations=looser, handler=PODANN,
                      pod_env={"CUDA_DEVICE_MEMORY_LIMIT": "0"})
    assert code == 0, logs
    _capped_at_the_share(logs)


def test_nothing_left_behind(cri: CriClient, ctd: Containerd) -> None:
    pb = cri.pb
    assert list(cri.call("ListContainers", pb.ListContainersRequest()).containers) == []
    assert ctd.ctr("tasks", "ls", "-q", namespace="k8s.io").stdout.split() == []
