"""What the plugin advertises: one Resource per extended resource name, each a
set of device ids over the host's physical units (whole GPUs, MIG devices).

Sharing modes replicate a unit as ids `<uuid>::<n>` (NVIDIA's replica form):
time-slicing (NVIDIA-compatible), vGPU shares (hard caps by libvgpu) and MPS
shares (mps-core: 100 per GPU, percent of its SMs; mps-memory: one per GiB).
vGPU and MPS split whole GPUs only and replace `nvidia.com/gpu` for them, as
NVIDIA's sharing modes replace the resource they share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nvctk.base.errors import ConfigError
from nvctk.host.inventory import HostInfo
from nvctk.k8s.config import PluginConfig

GPU = "nvidia.com/gpu"
KINDS = ("gpu", "mig", "time-slicing", "vgpu", "mps-core", "mps-memory")
MIB = 1 << 20


@dataclass(frozen=True)
class Unit:
    """A physical device a container can be given."""

    uuid: str  # GPU-... or MIG-...
    gpu_index: int
    gpu_uuid: str
    memory_mib: int
    mig_index: int | None = None
    profile: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None

    @property
    def index_name(self) -> str:
        """The device's index form (`0`, `0:1`), as NVIDIA_VISIBLE_DEVICES and CDI take it."""
        g = str(self.gpu_index)
        return g if self.mig_index is None else f"{g}:{self.mig_index}"


@dataclass(frozen=True)
class Device:
    id: str
    unit: Unit
    replica: int | None = None  # None: the unit itself


@dataclass
class Resource:
    name: str
    kind: str  # one of KINDS
    devices: dict[str, Device] = field(default_factory=dict)
    replicas: int = 1  # per unit
    fail_gt_one: bool = False

    def add(self, unit: Unit, replicas: int | None) -> None:
        if replicas is None:
            self.devices[unit.uuid] = Device(unit.uuid, unit)
            return
        for n in range(replicas):
            d = Device(f"{unit.uuid}::{n}", unit, n)
            self.devices[d.id] = d

    @property
    def units(self) -> dict[str, Unit]:
        return {d.unit.uuid: d.unit for d in self.devices.values()}


def units_of(host: HostInfo) -> tuple[list[Unit], dict[str, list[Unit]]]:
    """(whole GPUs without MIG, MIG devices by profile)."""
    whole: list[Unit] = []
    mig: dict[str, list[Unit]] = {}
    for g in host.gpus:
        if g.mig_enabled:
            for m in g.mig_devices:
                mig.setdefault(m.profile, []).append(
                    Unit(m.uuid, g.index, g.uuid, m.memory_mib, m.index, m.profile,
                         m.gpu_instance, m.compute_instance))
        else:
            whole.append(Unit(g.uuid, g.index, g.uuid, g.memory_mib))
    return whole, mig


def build(cfg: PluginConfig, host: HostInfo) -> list[Resource]:
    """The resources this host advertises under cfg; ConfigError when they cannot be."""
    whole, mig = units_of(host)
    base = _by_strategy(cfg, host, whole, mig)
    if cfg.sharing == "time-slicing":
        out = _time_sliced(cfg, base)
    elif cfg.sharing in ("vgpu", "mps"):
        out = _split(cfg, base, whole)
    else:
        out = _plain(base)
    # a resource with no device is not advertised (a kubelet would show capacity 0)
    out = [r for r in out if r.devices]
    names = [r.name for r in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:  # parse refuses the configs that make one; this host's names too
        kinds = " and ".join(r.kind for r in out if r.name == twice)
        raise ConfigError(f"resource {twice} would be advertised twice on this host ({kinds}): "
                          "rename one in the device plugin's config")
    return out


# resource name -> (kind, units)
Base = dict[str, tuple[str, list[Unit]]]


def _by_strategy(cfg: PluginConfig, host: HostInfo, whole: list[Unit],
                 mig: dict[str, list[Unit]]) -> Base:
    """The resources before sharing, by the MIG strategy."""
    base: Base = {}
    if cfg.mig_strategy == "none":
        # MIG is ignored: every GPU is advertised whole (as NVIDIA's `none`)
        allg = [Unit(g.uuid, g.index, g.uuid, g.memory_mib) for g in host.gpus]
        base[GPU] = ("gpu", allg)
    elif cfg.mig_strategy == "single":
        if whole and mig:
            raise ConfigError("migStrategy single: every GPU must have MIG enabled, but GPU(s) "
                              f"{', '.join(str(u.gpu_index) for u in whole)} do not")
        if len(mig) > 1:
            raise ConfigError("migStrategy single: all MIG devices must have one profile, found "
                              f"{', '.join(sorted(mig))}; use migStrategy mixed")
        base[GPU] = ("mig", next(iter(mig.values()))) if mig else ("gpu", whole)
    else:
        base[GPU] = ("gpu", whole)
        for profile, units in sorted(mig.items()):
            base[f"nvidia.com/mig-{profile}"] = ("mig", units)
    return base


def _plain(base: Base) -> list[Resource]:
    """Each resource as it is: one device per unit."""
    out = []
    for name, (kind, units) in base.items():
        res = Resource(name, kind)
        for u in units:
            res.add(u, None)
        out.append(res)
    return out


def _time_sliced(cfg: PluginConfig, base: Base) -> list[Resource]:
    """The resources the config time-slices as replicas (renamed where it says), the
    others as they are."""
    shared = {t.name: t for t in cfg.time_sliced}
    unknown = [n for n in shared if n not in base]
    if unknown:
        raise ConfigError(f"sharing.timeSlicing.resources: {unknown[0]} is not a resource of "
                          f"this host under migStrategy {cfg.mig_strategy} (it has "
                          f"{', '.join(base)})")
    out: list[Resource] = []
    for name, (kind, units) in base.items():
        t = shared.get(name)
        if t is None:
            out += _plain({name: (kind, units)})
            continue
        new = t.rename or (f"{name}.shared" if cfg.rename_by_default else name)
        res = Resource(new, "time-slicing", replicas=t.replicas, fail_gt_one=cfg.fail_gt_one)
        for u in units:
            res.add(u, t.replicas)
        out.append(res)
    return out


def _split(cfg: PluginConfig, base: Base, whole: list[Unit]) -> list[Resource]:
    """vGPU or MPS: the whole GPUs split into shares; the other resources as they are."""
    kind, units = base.pop(GPU)
    splittable = {u.uuid for u in whole}  # never a MIG-enabled GPU, even under `none`
    units = [u for u in units if u.uuid in splittable]
    if kind != "gpu":
        raise ConfigError(f"sharing.{cfg.sharing}: splits whole GPUs; with migStrategy "
                          "single there are none (use none or mixed)")
    out: list[Resource] = []
    if cfg.sharing == "vgpu":
        res = Resource(cfg.vgpu_resource, "vgpu", replicas=cfg.vgpu_replicas)
        for u in units:
            res.add(u, cfg.vgpu_replicas)
        out.append(res)
    else:
        core = Resource(cfg.mps_core_resource, "mps-core", replicas=100)
        mem = Resource(cfg.mps_memory_resource, "mps-memory")
        for u in units:
            core.add(u, 100)
            mem.add(u, u.memory_mib // 1024)  # one id per whole GiB
        out += [core, mem]
    return out + _plain(base)


def vgpu_share(unit: Unit, replicas: int) -> tuple[int, int]:
    """(MiB, SM percent) of one vGPU share of unit."""
    return unit.memory_mib // replicas, max(1, 100 // replicas)
