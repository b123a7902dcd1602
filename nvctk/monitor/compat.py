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

HAMi's scheduler (cmd/scheduler/metrics.go), from what this node handed out, per GPU:
  hami_gpu_memory_limit_bytes (its size), hami_gpu_memory_allocated_bytes (the caps of its
  shares; a whole GPU or MIG slice counts whole; label device_cores: the SM percent
  promised), hami_gpu_shared_count (containers holding it), hami_gpu_core_allocated_ratio
  and hami_node_gpu_memory_allocated_ratio (0-100: SM and memory promised); labels node,
  device_uuid, device_index, device_type; legacy GPUDeviceCoreLimit, GPUDeviceMemoryLimit,
  GPUDeviceCoreAllocated, GPUDeviceMemoryAllocated, GPUDeviceSharedNum (nodeid, deviceidx,
  deviceuuid). HAMi's scheduler reports every node from one place; here each node
  reports its own, with the same labels, so the dashboards' sums and joins hold.
  Every legacy series also carries node_name (the node), which HAMi's legacy dashboard
  filters on and HAMi's scrape config adds by relabeling: a plain Prometheus fills it too.

dcgm-exporter (NVIDIA/dcgm-exporter, etc/default-counters.csv): its default counters
  that NVML answers (DCGM_FIELDS below: clocks, GPU temperature, power and energy,
  utilization of the GPU, the memory copy engines, encoder and decoder, framebuffer
  free/used/reserved, the last XID, PCIe replays, volatile ECC totals, remapped rows) and
  the profiling fields from NVML's GPM where the GPU has it (Hopper and later:
  GR_ENGINE_ACTIVE, SM_ACTIVE, SM_OCCUPANCY, PIPE_TENSOR_ACTIVE, DRAM_ACTIVE, PCIE_TX/RX_BYTES;
  absent, not zero, elsewhere); its types (counters keep their names, no _total) and
  units (MiB, MHz, W, mJ, %, 0-1 ratios); labels gpu, UUID, pci_bus_id, device
  ("nvidia" + minor), modelName, Hostname, DCGM_FI_DRIVER_VERSION, and namespace, pod,
  container for a GPU a Pod holds: one series per Pod container on a shared GPU, each
  with the whole GPU's figures, as dcgm-exporter's shared-GPU mode does (a sum over
  Pods counts a shared GPU once per Pod there as here; nvctk's own nvctk_gpu_* series
  are one per GPU, and its nvctk_container_* series are each container's own part);
  a GPU no Pod holds has one series without them. A MIG slice a Pod holds also gets
  FB_USED, FB_FREE and GR_ENGINE_ACTIVE of its own with GPU_I_ID and GPU_I_PROFILE.
  Not exported: DCGM_FI_DEV_MEMORY_TEMP (NVML's public API has no memory temperature),
  NVLink bandwidth (no NVLink on the node: the series is absent, as dcgm-exporter's is),
  DCGM_FI_DEV_VGPU_LICENSE_STATUS (NVIDIA vGPU licensing, not a GPU share).
"""

from __future__ import annotations

from collections.abc import Callable

from nvctk.host.inventory import HostInfo
from nvctk.monitor.exposition import Writer, label_set
from nvctk.monitor.model import ContainerSample, DeviceUse, GpuHealth, GpuSample, Snapshot

FORMATS = ("dcgm", "hami")
MIB = 1 << 20
HAMI_ZONE = "vGPU"  # HAMi's monitor registers its collector under zone="vGPU"

HAMI_HOST = ("zone", "node", "device_index", "device_uuid", "device_type")
HAMI_HOST_LEGACY = ("zone", "nodeid", "deviceidx", "deviceuuid", "devicetype", "node_name")
HAMI_SCHED = ("node", "device_uuid", "device_index", "device_type")
HAMI_SCHED_LEGACY = ("zone", "nodeid", "deviceidx", "deviceuuid", "node_name")
HAMI_CTR = ("zone", "namespace", "pod", "container", "vdevice_index", "device_uuid")
HAMI_CTR_LEGACY = ("zone", "podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid", "node_name")
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
    "hami_gpu_memory_limit_bytes": "GPU device memory limit in bytes",
    "hami_gpu_memory_allocated_bytes": "GPU device memory allocated in bytes",
    "hami_gpu_shared_count": "Number of containers sharing this GPU",
    "hami_gpu_core_allocated_ratio": "GPU core allocated ratio (0-100)",
    "hami_node_gpu_memory_allocated_ratio": "GPU device memory allocated ratio (0-100)",
    "GPUDeviceCoreLimit": "Device memory core limit for a certain GPU",
    "GPUDeviceMemoryLimit": "Device memory limit for a certain GPU",
    "GPUDeviceCoreAllocated": "Device core allocated for a certain GPU",
    "GPUDeviceMemoryAllocated": "Device memory allocated for a certain GPU",
    "GPUDeviceSharedNum": "Number of containers sharing this GPU",
}
DCGM_HELP = {
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "Ratio of time the graphics engine is active.",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
}
Figure = Callable[[GpuSample, GpuHealth], "float | int | None"]


def _pct(x: float | None) -> int | None:
    return round(x * 100) if x is not None else None


# dcgm-exporter's default counters NVML answers, after FB_USED/FB_FREE/GPU_UTIL/XID
# (DCGM_HELP): name -> (type, help, the figure; None leaves the series out)
DCGM_FIELDS: dict[str, tuple[str, str, Figure]] = {
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz).", lambda g, h: h.sm_clock),
    "DCGM_FI_DEV_MEM_CLOCK": ("gauge", "Memory clock frequency (in MHz).", lambda g, h: h.memory_clock),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C).", lambda g, h: h.temperature),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W).", lambda g, h: h.power),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("gauge", "Power management limit (in W).", lambda g, h: h.power_limit),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (
        "counter", "Total energy consumption since boot (in mJ).", lambda g, h: h.energy),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "Total number of PCIe retries.",
                                        lambda g, h: h.pcie_replays),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gauge", "Memory utilization (in %).",
                                  lambda g, h: _pct(h.memory_copy_utilization)),
    "DCGM_FI_DEV_ENC_UTIL": ("gauge", "Encoder utilization (in %).", lambda g, h: _pct(h.encoder_utilization)),
    "DCGM_FI_DEV_DEC_UTIL": ("gauge", "Decoder utilization (in %).", lambda g, h: _pct(h.decoder_utilization)),
    "DCGM_FI_DEV_FB_RESERVED": ("gauge", "Framebuffer memory reserved (in MiB).",
                                lambda g, h: h.memory_reserved // MIB if h.memory_reserved is not None else None),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("counter", "Total number of single-bit volatile ECC errors.",
                                      lambda g, h: h.ecc_corrected),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("counter", "Total number of double-bit volatile ECC errors.",
                                      lambda g, h: h.ecc_uncorrected),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (
        "counter", "Number of remapped rows for uncorrectable errors", lambda g, h: h.rows_remapped_uncorrected),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": (
        "counter", "Number of remapped rows for correctable errors", lambda g, h: h.rows_remapped_corrected),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": (
        "gauge", "Whether remapping of rows has failed",
        lambda g, h: int(h.row_remap_failure) if h.row_remap_failure is not None else None),
    # profiling: GPM's, where the GPU has it (GpuHealth.profile)
    "DCGM_FI_PROF_SM_ACTIVE": ("gauge", "The ratio of cycles an SM has at least 1 warp assigned.",
                               lambda g, h: h.profile.get("sm_active")),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("gauge", "The ratio of number of warps resident on an SM.",
                                  lambda g, h: h.profile.get("sm_occupancy")),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
                                        lambda g, h: h.profile.get("tensor")),
    "DCGM_FI_PROF_DRAM_ACTIVE": (
        "gauge", "Ratio of cycles the device memory interface is active sending or receiving data.",
        lambda g, h: h.profile.get("dram")),
    "DCGM_FI_PROF_PCIE_TX_BYTES": (
        "counter", "The rate of data transmitted over the PCIe bus - including both protocol headers "
        "and data payloads - in bytes per second.", lambda g, h: h.profile.get("pcie_tx")),
    "DCGM_FI_PROF_PCIE_RX_BYTES": (
        "counter", "The rate of data received over the PCIe bus - including both protocol headers "
        "and data payloads - in bytes per second.", lambda g, h: h.profile.get("pcie_rx")),
}


def parse_formats(value: str) -> tuple[str, ...]:
    """'hami,dcgm' -> ('dcgm', 'hami'); ValueError names what is not one of FORMATS."""
    asked = [f.strip().lower() for f in value.split(",") if f.strip()]
    bad = [f for f in asked if f not in FORMATS]
    if bad or not asked:
        raise ValueError(f"{value!r}: not a list of {', '.join(FORMATS)}")
    return tuple(sorted(set(asked)))


def render(fmt: str, snap: Snapshot, host: HostInfo | None) -> str:
    return writer(fmt, snap, host).text()


def writer(fmt: str, snap: Snapshot, host: HostInfo | None) -> Writer:
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


def hami(snap: Snapshot) -> Writer:
    w = Writer()
    for name in HAMI_HELP:
        w.family(name, HAMI_HELP[name])
    for g in snap.gpus:
        values = [HAMI_ZONE, snap.hostname, str(g.index), g.uuid, f"NVIDIA-{g.name}"]
        new, old = label_set(HAMI_HOST, values), label_set(HAMI_HOST_LEGACY, [*values, snap.hostname])
        for name, labels, value in (
            ("hami_host_gpu_memory_used_bytes", new, g.memory_used),
            ("hami_host_gpu_utilization_ratio", new, round(g.utilization * 100)),
            ("HostGPUMemoryUsage", old, g.memory_used),
            ("HostCoreUtilization", old, round(g.utilization * 100)),
        ):
            w.add(name, HAMI_HELP[name], labels, value)
        _hami_scheduler(w, snap, g)
    for c, i, d in _pod_devices(snap):
        values = [HAMI_ZONE, c.namespace, c.pod, c.container, str(i), d.gpu_uuid]
        new, old = label_set(HAMI_CTR, values), label_set(HAMI_CTR_LEGACY, [*values, snap.hostname])
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
        desc = label_set(HAMI_CTR_LEGACY + HAMI_MEMORY_DESC,
                         [*values, snap.hostname, "0", "0", str(d.memory_used), "0"])
        w.add("Device_memory_desc_of_container", HAMI_HELP["Device_memory_desc_of_container"], desc,
              d.memory_used)
        if d.last_kernel_seconds is not None:
            secs = int(d.last_kernel_seconds)  # HAMi's are whole seconds
            w.add("hami_container_last_kernel_elapsed_seconds",
                  HAMI_HELP["hami_container_last_kernel_elapsed_seconds"], new, secs)
            w.add("Device_last_kernel_of_container", HAMI_HELP["Device_last_kernel_of_container"], old, secs)
    return w


def _hami_scheduler(w: Writer, snap: Snapshot, g: GpuSample) -> None:
    """HAMi's scheduler series of GPU g: what this node handed out of it."""
    typ = f"NVIDIA-{g.name}"
    labels = label_set(HAMI_SCHED, [snap.hostname, g.uuid, str(g.index), typ])
    cores = round(g.sm_promised * 100)
    with_cores = label_set((*HAMI_SCHED, "device_cores"), [snap.hostname, g.uuid, str(g.index), typ, str(cores)])
    old = label_set(HAMI_SCHED_LEGACY, [HAMI_ZONE, snap.hostname, str(g.index), g.uuid, snap.hostname])
    old_cores = label_set((*HAMI_SCHED_LEGACY, "devicecores"),
                          [HAMI_ZONE, snap.hostname, str(g.index), g.uuid, snap.hostname, str(cores)])
    ratio = 100 * g.memory_promised / g.memory_total if g.memory_total else 0.0
    for name, lv, value in (
        ("hami_gpu_memory_limit_bytes", labels, g.memory_total),
        ("hami_gpu_memory_allocated_bytes", with_cores, g.memory_promised),
        ("hami_gpu_shared_count", labels, g.shares),
        ("hami_gpu_core_allocated_ratio", labels, cores),
        ("hami_node_gpu_memory_allocated_ratio", labels, ratio),
        ("GPUDeviceCoreLimit", old, 100),
        ("GPUDeviceMemoryLimit", old, g.memory_total),
        ("GPUDeviceCoreAllocated", old, cores),
        ("GPUDeviceMemoryAllocated", old_cores, g.memory_promised),
        ("GPUDeviceSharedNum", old, g.shares),
    ):
        w.add(name, HAMI_HELP[name], lv, value)


def dcgm(snap: Snapshot, host: HostInfo | None) -> Writer:
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
    for name, (kind, help_text, _) in DCGM_FIELDS.items():
        w.family(name, help_text, kind, total=False)
    base_of: dict[int, list[str]] = {}
    for g in snap.gpus:
        info = gpus.get(g.index)
        base = base_of[g.index] = [
            str(g.index), g.uuid, info.pci_bus_id if info else "",
            f"nvidia{info.minor if info else g.index}", g.name, snap.hostname, snap.driver_version]
        used = g.memory_used // MIB
        health = g.health or GpuHealth()
        holders = pods_on.get(g.index)
        for labels in ([label_set(DCGM_GPU + DCGM_POD, base + pod) for pod in holders] if holders
                       else [label_set(DCGM_GPU, base)]):
            for name, value in (
                ("DCGM_FI_DEV_FB_USED", used),
                ("DCGM_FI_DEV_FB_FREE", max(0, g.memory_total // MIB - used)),
                ("DCGM_FI_DEV_GPU_UTIL", round(g.utilization * 100)),
                ("DCGM_FI_DEV_XID_ERRORS", g.last_xid),
            ):
                w.add(name, DCGM_HELP[name], labels, value)
            if "graphics" in health.profile:
                w.add("DCGM_FI_PROF_GR_ENGINE_ACTIVE", DCGM_HELP["DCGM_FI_PROF_GR_ENGINE_ACTIVE"], labels,
                      health.profile["graphics"])
            for name, (kind, help_text, figure) in DCGM_FIELDS.items():
                got = figure(g, health)
                if got is not None:
                    w.add(name, help_text, labels, got, kind, total=False)
    for c, d in slices:
        m = mig[d.device_uuid]
        if d.gpu_index not in base_of:
            continue
        base = base_of[d.gpu_index]
        labels = label_set(DCGM_GPU + DCGM_MIG + DCGM_POD, [*base, m.profile, str(m.gpu_instance), c.container, c.namespace, c.pod])
        used = d.memory_used // MIB
        for name, share in (
            ("DCGM_FI_DEV_FB_USED", used),
            ("DCGM_FI_DEV_FB_FREE", max(0, d.memory_total // MIB - used)),
            ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", d.sm_utilization),
        ):
            w.add(name, DCGM_HELP[name], labels, share)
    return w
