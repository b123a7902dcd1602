"""`nvctk monitor --compat hami,dcgm`: the series HAMi's vGPU monitor and dcgm-exporter
export, under their names, units and label names, rendered from the same snapshot as
nvctk's own, so dashboards and alerts written for them work unchanged.

HAMi (Project-HAMi/HAMi, cmd/vGPUmonitor/metrics.go; every series has zone="vGPU"):
  per GPU  hami_host_gpu_memory_used_bytes (bytes), hami_host_gpu_utilization_ratio
           (0-100, NVML's percent: not a 0-1 ratio despite the name), labels node,
           device_index, device_uuid, device_type ("NVIDIA-" + the model);
           legacy HostGPUMemoryUsage, HostCoreUtilization: nodeid, deviceidx,
           deviceuuid, devicetype.
  per Pod container and device  hami_vgpu_memory_used_bytes,
           hami_container_device_memory_bytes (its memory), hami_vgpu_memory_limit_bytes
           (its cap; the device's size when uncapped: what it may use),
           hami_container_device_utilization_ratio (0-100 of the GPU),
           hami_container_last_kernel_elapsed_seconds (once a kernel was seen); labels
           namespace, pod, container, vdevice_index (the device's index in the container),
           device_uuid (the physical GPU's); legacy vGPU_device_memory_usage_in_bytes,
           vGPU_device_memory_limit_in_bytes, Device_utilization_desc_of_container,
           Device_last_kernel_of_container, Device_memory_desc_of_container (+ context,
           module, data, offset: HAMi's split of the memory, which NVML does not give:
           all of it is "data"), labels podnamespace, podname, ctrname, vdeviceid,
           deviceuuid.
  HAMi reports Pods only: containers outside Kubernetes have no HAMi series.

dcgm-exporter (NVIDIA/dcgm-exporter, etc/default-counters.csv, etc/dcp-metrics-included.csv):
  DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_FB_FREE (MiB), DCGM_FI_DEV_GPU_UTIL (0-100),
  DCGM_FI_PROF_GR_ENGINE_ACTIVE (0-1; NVML's busy fraction: NVML has no profiling
  counters), DCGM_FI_DEV_XID_ERRORS (the last XID, 0 for none); labels gpu, UUID,
  pci_bus_id, device ("nvidia" + index), modelName, Hostname, DCGM_FI_DRIVER_VERSION,
  and namespace, pod, container for a GPU a Pod holds: one series per Pod container on a
  shared GPU, each with the whole GPU's figures, as dcgm-exporter's shared-GPU mode does;
  a GPU no Pod holds has one series without them. A MIG slice a Pod holds also gets
  FB_USED, FB_FREE and GR_ENGINE_ACTIVE of its own with GPU_I_ID and GPU_I_PROFILE.
  Temperature, power, clocks, ECC and tensor-pipe series are not exported: the snapshot
  does not hold them.
"""

from __future__ import annotations

from nvctk.host.inventory import HostInfo
from nvctk.monitor.exposition import Writer, label_set
from nvctk.monitor.model import ContainerSample, DeviceUse, Snapshot

FORMATS = ("dcgm", "hami")
MIB = 1 << 20
HAMI_ZONE = "vGPU"  # HAMi's monitor registers its collector under zone="vGPU"

HAMI_HOST = ("zone", "node", "device_index", "device_uuid", "device_type")
HAMI_HOST_LEGACY = ("zone", "nodeid", "deviceidx", "deviceuuid", "devicetype")
HAMI_CTR = ("zone", "namespace", "pod", "container", "vdevice_index", "device_uuid")
HAMI_CTR_LEGACY = ("zone", "podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid")
HAMI_MEMORY_DESC = ("context", "module", "data", "offset")

DCGM_GPU = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
DCGM_POD = ("container", "namespace", "pod")
DCGM_MIG = ("GPU_I_PROFILE", "GPU_I_ID")

HAMI_HELP = {
    "hami_host_gpu_memory_used_bytes": "GPU device memory usage in bytes",
    "hami_host_gpu_utilization_ratio": "GPU core utilization ratio (0-100)",
    "hami_vgpu_memory_used_bytes": "vGPU device memory usage in bytes",
    "hami_vgpu_memory_limit_bytes": "vGPU device memory limit in bytes",
    "hami_container_device_memory_bytes": "Container device memory usage in bytes",
    "hami_container_device_utilization_ratio": "Container device SM utilization ratio (0-100)",
    "hami_container_last_kernel_elapsed_seconds": "Seconds since last kernel execution in container",
    "HostGPUMemoryUsage": "GPU device memory usage",
    "HostCoreUtilization": "GPU core utilization",
    "vGPU_device_memory_usage_in_bytes": "vGPU device usage",
    "vGPU_device_memory_limit_in_bytes": "vGPU device limit",
    "Device_memory_desc_of_container": "Container device memory description",
    "Device_utilization_desc_of_container": "Container device utilization description",
    "Device_last_kernel_of_container": "Container device last kernel description",
}
DCGM_HELP = {
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "Ratio of time the graphics engine is active.",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
}


def parse_formats(value: str) -> tuple[str, ...]:
    """'hami,dcgm' -> ('dcgm', 'hami'); ValueError names what is not one of FORMATS."""
    asked = [f.strip().lower() for f in value.split(",") if f.strip()]
    bad = [f for f in asked if f not in FORMATS]
    if bad or not asked:
        raise ValueError(f"{value!r}: not a list of {', '.join(FORMATS)}")
    return tuple(sorted(set(asked)))


def render(fmt: str, snap: Snapshot, host: HostInfo | None) -> str:
    if fmt == "hami":
        return hami(snap)
    if fmt == "dcgm":
        return dcgm(snap, host)
    raise ValueError(f"unknown compat format {fmt!r}")


def _pod_devices(snap: Snapshot) -> list[tuple[ContainerSample, int, DeviceUse]]:
    """(container, index in the container, device) for Pod containers, each Pod container
    once (a restarted one can briefly be listed twice: two series with one label set
    would make Prometheus refuse the whole scrape)."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for c in snap.containers:
        key = (c.namespace, c.pod, c.container)
        if not c.pod or key in seen:
            continue
        seen.add(key)
        out += [(c, i, d) for i, d in enumerate(c.devices)]
    return out


def hami(snap: Snapshot) -> str:
    w = Writer()
    for name in HAMI_HELP:
        w.family(name, HAMI_HELP[name])
    for g in snap.gpus:
        values = [HAMI_ZONE, snap.hostname, str(g.index), g.uuid, f"NVIDIA-{g.name}"]
        new, old = label_set(HAMI_HOST, values), label_set(HAMI_HOST_LEGACY, values)
        for name, labels, value in (
            ("hami_host_gpu_memory_used_bytes", new, g.memory_used),
            ("hami_host_gpu_utilization_ratio", new, round(g.utilization * 100)),
            ("HostGPUMemoryUsage", old, g.memory_used),
            ("HostCoreUtilization", old, round(g.utilization * 100)),
        ):
            w.add(name, HAMI_HELP[name], labels, value)
    for c, i, d in _pod_devices(snap):
        values = [HAMI_ZONE, c.namespace, c.pod, c.container, str(i), d.gpu_uuid]
        new, old = label_set(HAMI_CTR, values), label_set(HAMI_CTR_LEGACY, values)
        limit = d.memory_limit if d.memory_limit is not None else d.memory_total
        util = round(d.sm_utilization * 100)  # HAMi's is a whole percent
        for name, labels, figure in (
            ("hami_vgpu_memory_used_bytes", new, d.memory_used),
            ("hami_container_device_memory_bytes", new, d.memory_used),
            ("hami_vgpu_memory_limit_bytes", new, limit),
            ("hami_container_device_utilization_ratio", new, util),
            ("vGPU_device_memory_usage_in_bytes", old, d.memory_used),
            ("vGPU_device_memory_limit_in_bytes", old, limit),
            ("Device_utilization_desc_of_container", old, util),
        ):
            w.add(name, HAMI_HELP[name], labels, figure)
        desc = label_set(HAMI_CTR_LEGACY + HAMI_MEMORY_DESC, [*values, "0", "0", str(d.memory_used), "0"])
        w.add("Device_memory_desc_of_container", HAMI_HELP["Device_memory_desc_of_container"], desc,
              d.memory_used)
        if d.last_kernel_seconds is not None:
            secs = int(d.last_kernel_seconds)  # HAMi's are whole seconds
            w.add("hami_container_last_kernel_elapsed_seconds",
                  HAMI_HELP["hami_container_last_kernel_elapsed_seconds"], new, secs)
            w.add("Device_last_kernel_of_container", HAMI_HELP["Device_last_kernel_of_container"], old, secs)
    return w.text()


def dcgm(snap: Snapshot, host: HostInfo | None) -> str:
    gpus = {g.index: g for g in host.gpus} if host is not None else {}
    mig = {m.uuid: m for g in gpus.values() for m in g.mig_devices}
    pods_on: dict[int, list[list[str]]] = {}  # GPU index -> Pod label values, whole-GPU holders
    slices: list[tuple[ContainerSample, DeviceUse]] = []
    for c, _i, d in _pod_devices(snap):
        if d.device_uuid in mig:
            slices.append((c, d))
        else:
            pods_on.setdefault(d.gpu_index, []).append([c.container, c.namespace, c.pod])
    w = Writer()
    for name in DCGM_HELP:
        w.family(name, DCGM_HELP[name])
    base_of: dict[int, list[str]] = {}
    for g in snap.gpus:
        info = gpus.get(g.index)
        base = base_of[g.index] = [
            str(g.index), g.uuid, info.pci_bus_id if info else "",
            f"nvidia{info.minor if info else g.index}", g.name, snap.hostname, snap.driver_version]
        used = g.memory_used // MIB
        holders = pods_on.get(g.index)
        for labels in ([label_set(DCGM_GPU + DCGM_POD, base + pod) for pod in holders] if holders
                       else [label_set(DCGM_GPU, base)]):
            for name, value in (
                ("DCGM_FI_DEV_FB_USED", used),
                ("DCGM_FI_DEV_FB_FREE", max(0, g.memory_total // MIB - used)),
                ("DCGM_FI_DEV_GPU_UTIL", round(g.utilization * 100)),
                ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", g.utilization),
                ("DCGM_FI_DEV_XID_ERRORS", g.last_xid),
            ):
                w.add(name, DCGM_HELP[name], labels, value)
    for c, d in slices:
        m = mig[d.device_uuid]
        if d.gpu_index not in base_of:
            continue
        base = base_of[d.gpu_index]
        labels = label_set(DCGM_GPU + DCGM_MIG + DCGM_POD, [*base, m.profile, str(m.gpu_instance), c.container, c.namespace, c.pod])
        used = d.memory_used // MIB
        for name, value in (
            ("DCGM_FI_DEV_FB_USED", used),
            ("DCGM_FI_DEV_FB_FREE", max(0, d.memory_total // MIB - used)),
            ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", d.sm_utilization),
        ):
            w.add(name, DCGM_HELP[name], labels, value)
    return w.text()
