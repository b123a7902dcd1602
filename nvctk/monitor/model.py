"""The monitor's snapshot: one consistent view of the node, taken by nvctk.monitor.collect
and rendered by every view (Prometheus, `nvctk top`, the dashboard's JSON).

Units are base units (bytes, seconds) and 0-1 ratios, as the Prometheus names say.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GpuSample:
    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    memory_used: int  # bytes, every process (NVML)
    utilization: float  # 0-1, NVML's last sample
    healthy: bool = True
    xid_errors: int = 0  # XID critical errors seen since the monitor started
    last_xid: int = 0
    mig: bool = False  # MIG enabled: shares are its MIG devices
    shares: int = 0  # containers holding (part of) it
    memory_promised: int = 0  # bytes: caps of capped shares, the whole GPU for others
    sm_promised: float = 0.0  # 0-1: SM limits, MIG slices' parts, 1 per uncapped whole GPU
    health: GpuHealth | None = None  # None: NVML answered none of it (a MIG-only view)


@dataclass
class GpuHealth:
    """What NVML reports of the board beside memory and utilization; None where the GPU
    does not report it (NVML's NOT_SUPPORTED): a series left out, never a zero."""

    temperature: int | None = None  # degrees C
    power: float | None = None  # W
    power_limit: float | None = None  # W, enforced
    energy: int | None = None  # mJ since the driver loaded (a counter)
    sm_clock: int | None = None  # MHz
    memory_clock: int | None = None  # MHz
    memory_reserved: int | None = None  # bytes the driver keeps (NVML's memory info v2)
    memory_copy_utilization: float | None = None  # 0-1
    encoder_utilization: float | None = None  # 0-1
    decoder_utilization: float | None = None  # 0-1
    pcie_replays: int | None = None  # a counter
    ecc_corrected: int | None = None  # volatile total, a counter
    ecc_uncorrected: int | None = None  # volatile total, a counter
    rows_remapped_corrected: int | None = None
    rows_remapped_uncorrected: int | None = None
    row_remap_failure: bool | None = None
    # GPM (Hopper and later) over the last interval; empty where the GPU has none
    profile: dict[str, float] = field(default_factory=dict)


@dataclass
class DeviceUse:
    """One container's use of one of its devices."""

    gpu_index: int  # the physical GPU (the parent of a MIG device)
    gpu_uuid: str
    device_uuid: str  # the GPU's or the MIG device's
    memory_used: int  # bytes: its processes' NVML usedGpuMemory
    memory_total: int  # bytes: the device's own size (a MIG slice's, the GPU's)
    memory_limit: int | None  # bytes; None: no cap
    sm_utilization: float  # 0-1 of the GPU over the last interval
    sm_limit: float | None  # 0-1; None: no limit
    processes: list[int] = field(default_factory=list)  # host pids on this device
    last_kernel_seconds: float | None = None  # since its last kernel; None: unknown


@dataclass
class ContainerSample:
    id: str
    name: str
    kind: str  # gpu | mig | vgpu | mps: what it asked for (stable for its life)
    runtime_root: str
    namespace: str = ""
    pod: str = ""
    container: str = ""  # the Kubernetes container name
    pod_uid: str = ""
    resource: str = ""  # the extended resource(s) the kubelet gave it (pod-resources), if read
    claim: str = ""  # its DRA ResourceClaim(s), "namespace/name" (pod-resources), if read
    devices: list[DeviceUse] = field(default_factory=list)
    # a Pod's GPU the kubelet did not allocate (nvctk.monitor.allocation)
    outside_allocations: bool = False


@dataclass
class Snapshot:
    time: float  # time.time() when taken
    interval: float  # seconds the SM shares are averaged over
    hostname: str
    driver_version: str
    gpus: list[GpuSample] = field(default_factory=list)
    containers: list[ContainerSample] = field(default_factory=list)
    collect_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)  # causes that hid a part this time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
