"""What a simulated NVIDIA host contains: the driver, its GPUs and their MIG devices.

`nvctk sim init` builds a Topology from its options, writes it as JSON beside the
sim (DIR/topology.json, for humans and tests) and compiles it into the mock
driver libraries, so the mocks carry their topology wherever they are mounted.
"""

from __future__ import annotations

import json
import uuid as uuidlib
from dataclasses import asdict, dataclass, field

# name -> (slices of 7, memory MiB on an 80 GB A100/H100 class GPU, profile id as
# `nvidia-smi mig -lgip` lists it)
# Memory scales with the GPU's memory (see mig_memory_mib).
MIG_PROFILES: dict[str, tuple[int, int, int]] = {
    "1g.10gb": (1, 9856, 19),
    "1g.20gb": (1, 19968, 15),
    "2g.20gb": (2, 19968, 14),
    "3g.40gb": (3, 40192, 9),
    "4g.40gb": (4, 40192, 5),
    "7g.80gb": (7, 80896, 0),
}


@dataclass(frozen=True)
class MigDevice:
    index: int  # position under its parent GPU (the `gpu:mig` form's second number)
    uuid: str  # MIG-xxxxxxxx-...
    profile: str  # e.g. "1g.10gb"
    gpu_instance: int
    compute_instance: int
    memory_mib: int
    gi_cap_minor: int  # DeviceFileMinor of .../mig/gi<g>/access
    ci_cap_minor: int  # DeviceFileMinor of .../mig/gi<g>/ci<c>/access


@dataclass(frozen=True)
class Gpu:
    index: int
    minor: int
    uuid: str  # GPU-xxxxxxxx-...
    name: str
    pci_bus_id: str  # 00000000:3B:00.0 (NVML's form: 8-digit domain, upper case)
    memory_mib: int
    compute_capability: tuple[int, int]
    brand: str  # nvml brand name, e.g. "tesla", "nvidia", "geforce"
    mig_devices: tuple[MigDevice, ...] = ()

    @property
    def mig_enabled(self) -> bool:
        return bool(self.mig_devices)


@dataclass(frozen=True)
class Topology:
    driver_version: str = "550.54.15"
    cuda_version: str = "12.4"
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)
    # how long one simulated kernel keeps the device busy, microseconds
    kernel_time_us: int = 200

    @property
    def cuda_version_int(self) -> int:
        """CUDA's integer form: 12.4 -> 12040."""
        major, minor = (int(x) for x in self.cuda_version.split(".")[:2])
        return major * 1000 + minor * 10

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Topology:
        d = json.loads(text)
        gpus = []
        for g in d["gpus"]:
            migs = tuple(MigDevice(**m) for m in g.pop("mig_devices"))
            g["compute_capability"] = tuple(g["compute_capability"])
            gpus.append(Gpu(**g, mig_devices=migs))
        d["gpus"] = tuple(gpus)
        return cls(**d)


def _uuid(prefix: str, seed: str) -> str:
    return f"{prefix}-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, 'nvctk-sim/' + seed)}"


def mig_memory_mib(profile: str, gpu_memory_mib: int) -> int:
    return MIG_PROFILES[profile][1] * gpu_memory_mib // 81920


def make_topology(
    gpus: int = 2,
    mig: dict[int, list[str]] | None = None,
    driver_version: str = "550.54.15",
    cuda_version: str = "12.4",
    memory_mib: int = 81920,
    product: str = "NVIDIA H100 80GB HBM3",
    compute_capability: tuple[int, int] = (9, 0),
    brand: str = "nvidia",
    kernel_time_us: int = 200,
    seed: str = "",
) -> Topology:
    """Deterministic for equal arguments, so tests can name UUIDs; `seed` varies them."""
    mig = mig or {}
    unknown = [p for ps in mig.values() for p in ps if p not in MIG_PROFILES]
    if unknown:
        raise ValueError(
            f"unknown MIG profile {unknown[0]!r}; valid profiles: {', '.join(MIG_PROFILES)}"
        )
    bad = [i for i in mig if not 0 <= i < gpus]
    if bad:
        raise ValueError(f"--mig names GPU {bad[0]}, but the sim has GPUs 0..{gpus - 1}")
    cap_minor = 1  # nvidia-cap1/2 are mig/config and mig/monitor, as on real hosts
    out = []
    for i in range(gpus):
        key = f"{seed}/{driver_version}/{i}"
        migs = []
        profiles = mig.get(i, [])
        if sum(MIG_PROFILES[p][0] for p in profiles) > 7:
            raise ValueError(f"MIG profiles {','.join(profiles)} need more than GPU {i}'s 7 slices")
        for m, p in enumerate(profiles):
            gi, ci = m + 1, 0
            migs.append(
                MigDevice(
                    index=m,
                    uuid=_uuid("MIG", f"{key}/mig{m}"),
                    profile=p,
                    gpu_instance=gi,
                    compute_instance=ci,
                    memory_mib=mig_memory_mib(p, memory_mib),
                    gi_cap_minor=cap_minor + 2 + i * 256 + gi * 2,
                    ci_cap_minor=cap_minor + 3 + i * 256 + gi * 2,
                )
            )
        out.append(
            Gpu(
                index=i,
                minor=i,
                uuid=_uuid("GPU", key),
                name=product,
                pci_bus_id=f"00000000:{0x1B + i * 0x10:02X}:00.0",
                memory_mib=memory_mib,
                compute_capability=compute_capability,
                brand=brand,
                mig_devices=tuple(migs),
            )
        )
    return Topology(driver_version, cuda_version, tuple(out), kernel_time_us)
