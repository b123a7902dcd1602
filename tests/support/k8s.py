"""The device plugin's view of a simulated topology, without NVML."""

from __future__ import annotations

from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from nvctk.sim.topology import Topology


def host_of(topo: Topology) -> HostInfo:
    """What nvml.query_host answers for a sim of this topology (no NVML needed)."""
    gpus = tuple(
        GpuInfo(g.index, g.uuid, g.name, g.minor, g.pci_bus_id, g.memory_mib,
                "{}.{}".format(*g.compute_capability), g.brand, g.mig_enabled,
                tuple(MigInfo(m.index, m.uuid, m.gpu_instance, m.compute_instance, m.profile,
                              m.memory_mib) for m in g.mig_devices))
        for g in topo.gpus)
    return HostInfo(driver_version=topo.driver_version, cuda_version=topo.cuda_version, gpus=gpus)
