"""The host's GPUs as plain records: what NVML said (nvctk.host.nvml) or the cache kept
(nvctk.host.cache). Data only, so that both read it without importing each other."""

from __future__ import annotations

from nvctk.base.record import FrozenRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any




def _get(d: dict[str, Any], key: str, kind: type) -> Any:
    """d[key], which must be exactly of type kind (bool is not an int here)."""
    v = d[key]
    if type(v) is not kind:
        raise TypeError(f"{key}: expected {kind.__name__}, got {type(v).__name__}")
    return v


def _fields(d: dict[str, Any], kinds: dict[str, type]) -> dict[str, Any]:
    """_get of each key of kinds, in order (the first wrong one is the error)."""
    return {key: _get(d, key, kind) for key, kind in kinds.items()}


class MigInfo(FrozenRecord):
    __slots__ = ("index", "uuid", "gpu_instance", "compute_instance", "profile", "memory_mib")  # noqa: RUF023
    index: int
    uuid: str
    gpu_instance: int
    compute_instance: int
    profile: str  # e.g. "3g.40gb" ("" when NVML cannot say)
    memory_mib: int

    def __init__(self, index: int, uuid: str, gpu_instance: int, compute_instance: int,
                 profile: str, memory_mib: int) -> None:
        self._fill(index, uuid, gpu_instance, compute_instance, profile, memory_mib)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigInfo:
        return cls(**_fields(d, _MIG_KINDS))


_MIG_KINDS = {"index": int, "uuid": str, "gpu_instance": int, "compute_instance": int,
              "profile": str, "memory_mib": int}


class GpuInfo(FrozenRecord):
    __slots__ = ("index", "uuid", "name", "minor", "pci_bus_id", "memory_mib",  # noqa: RUF023
                 "compute_capability", "brand", "mig_enabled", "mig_devices")
    index: int
    uuid: str
    name: str
    minor: int
    pci_bus_id: str  # NVML's form, e.g. 00000000:1B:00.0
    memory_mib: int
    compute_capability: str  # "9.0"
    brand: str  # lower-case, e.g. "nvidia", "tesla"
    mig_enabled: bool
    mig_devices: tuple[MigInfo, ...]

    def __init__(self, index: int, uuid: str, name: str, minor: int, pci_bus_id: str,
                 memory_mib: int, compute_capability: str, brand: str, mig_enabled: bool,
                 mig_devices: tuple[MigInfo, ...] = ()) -> None:
        self._fill(index, uuid, name, minor, pci_bus_id, memory_mib, compute_capability, brand,
                   mig_enabled, tuple(mig_devices))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuInfo:
        return cls(**_fields(d, _GPU_KINDS),
                   mig_devices=tuple(MigInfo.from_dict(m) for m in _get(d, "mig_devices", list)))


_GPU_KINDS = {"index": int, "uuid": str, "name": str, "minor": int, "pci_bus_id": str,
              "memory_mib": int, "compute_capability": str, "brand": str, "mig_enabled": bool}


class HostInfo(FrozenRecord):
    __slots__ = ("driver_version", "cuda_version", "gpus")  # noqa: RUF023
    driver_version: str
    cuda_version: str  # "12.4"
    gpus: tuple[GpuInfo, ...]

    def __init__(self, driver_version: str, cuda_version: str,
                 gpus: tuple[GpuInfo, ...] = ()) -> None:
        self._fill(driver_version, cuda_version, tuple(gpus))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostInfo:
        """The inverse of to_dict; KeyError/TypeError when d is not one (extra keys are
        ignored)."""
        return cls(
            driver_version=_get(d, "driver_version", str),
            cuda_version=_get(d, "cuda_version", str),
            gpus=tuple(GpuInfo.from_dict(g) for g in _get(d, "gpus", list)),
        )

    def gpu(self, ident: str) -> GpuInfo | None:
        """GPU by index, UUID (case-insensitive) or PCI bus id."""
        for g in self.gpus:
            if ident == str(g.index) or ident.lower() in (g.uuid.lower(), g.pci_bus_id.lower()):
                return g
        return None


def proc_bus_id(pci_bus_id: str) -> str:
    """NVML's 00000000:1B:00.0 -> procfs's and sysfs's directory name 0000:1b:00.0."""
    domain, _, rest = pci_bus_id.partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"
