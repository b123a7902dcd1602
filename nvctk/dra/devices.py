"""This node's DRA devices: their names in the driver's pool (the node's name), and what
each can give (its memory, its SM share). One naming for both sides of the driver: the
ResourceSlices published for the node name devices so, and NodePrepareResources finds
an allocation's device by that name.

    gpu-<index>                a whole GPU (NVML's index)
    gpu-<index>-mig-<index>    a MIG device of it (NVML's MIG index)

Capacities (QualifiedNames: C identifiers): `memory` in bytes, `smShare` in percent of
the device's SMs (100). A consumed smShare of 0 means no SM-share cap: the published
request policy's default for a claim that asks for memory only (nvctk.dra.slices).
"""

from __future__ import annotations

from dataclasses import dataclass

from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo

DEFAULT_DRIVER = "gpu.nvctk.io"
MEMORY = "memory"  # capacity: bytes
SM_SHARE = "smShare"  # capacity: percent of the device's SMs
SM_FULL = 100
MIB = 1 << 20


@dataclass(frozen=True)
class DraDevice:
    name: str
    uuid: str  # GPU-... or MIG-...
    gpu: GpuInfo
    mig: MigInfo | None
    memory: int  # bytes

    @property
    def capacity(self) -> dict[str, int]:
        return {MEMORY: self.memory, SM_SHARE: SM_FULL}


def device_name(gpu: GpuInfo, mig: MigInfo | None = None) -> str:
    return f"gpu-{gpu.index}" if mig is None else f"gpu-{gpu.index}-mig-{mig.index}"


def node_devices(host: HostInfo) -> dict[str, DraDevice]:
    """Every GPU and MIG device of the host by its DRA name, in NVML order."""
    out: dict[str, DraDevice] = {}
    for g in host.gpus:
        out[device_name(g)] = DraDevice(device_name(g), g.uuid, g, None, g.memory_mib * MIB)
        for m in g.mig_devices:
            n = device_name(g, m)
            out[n] = DraDevice(n, m.uuid, g, m, m.memory_mib * MIB)
    return out
