"""What the planner decides of the selected devices (no I/O): `vgpu_devices` orders them
as libvgpu indexes them, `requirement_facts` is what NVIDIA_REQUIRE_* is checked against.
The selection itself is a query of the inventory (nvctk.host.select), part of the facts.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from nvctk.host.inventory import HostInfo
    from nvctk.host.select import Selected
    from nvctk.request.requirements import HostFacts


def vgpu_devices(selected: Sequence[Selected]) -> list[Selected]:
    """The container's GPUs in the order libvgpu indexes them (NVML order inside it)."""
    return sorted(selected, key=lambda s: (s.gpu.index, -1 if s.mig is None else s.mig.index))


def requirement_facts(host: HostInfo, selected: Sequence[Selected]) -> list[HostFacts]:
    """What NVIDIA_REQUIRE_* expressions are checked against, one record per device."""
    # imported here and at check(): only containers that state requirements need it
    from nvctk.request.requirements import HostFacts

    if not selected:
        return [HostFacts(host.cuda_version, host.driver_version)]
    return [
        HostFacts(host.cuda_version, host.driver_version, s.gpu.compute_capability,
                  s.gpu.brand, f"GPU {s.gpu.index} ({s.name})")
        for s in selected
    ]
