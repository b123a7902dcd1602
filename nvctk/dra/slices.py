"""This node's ResourceSlices (resource.k8s.io/v1) from nvctk's host inventory: plain
data in, the API's JSON form out, no I/O (nvctk.dra.publish writes them).

One pool per node, named after the node; devices named as nvctk.dra.devices names
them (what NodePrepareResources looks up):

- `gpu-<i>`: a GPU, with NVIDIA's DRA driver's attribute names (type, uuid,
  productName, brand, index, minor, pcieBusID, cudaComputeCapability, driverVersion,
  cudaDriverVersion; migEnabled) and its capacities `memory` (bytes) and `smShare`
  (percent). Without MIG it is shareable by consumable capacity (KEP-5075):
  `allowMultipleAllocations`, memory's request policy defaulting to all of it (a claim
  that asks for no capacity gets the whole GPU) in steps of 1 MiB, smShare's
  defaulting to 0 (no SM-share cap: a claim that asks for memory only) within 0..100.
- `gpu-<i>-mig-<m>`: a MIG device of a MIG-enabled GPU (type mig, its uuid, parent,
  profile, instance ids) with its memory.
- A MIG-enabled GPU and its MIG devices consume one counter set `gpu-<i>` (KEP-4815):
  the GPU all of its memory, each MIG device its own, so the scheduler never
  allocates the GPU together with one of its MIG devices. A v1 slice holds devices or
  sharedCounters, never both: the counter sets go in slices of their own (≤ 8 each).
- An unhealthy device (nvctk.k8s.health: an XID, or XIDs it cannot watch) gets a taint
  `<driver>/unhealthy` with the effect TaintPolicy gives it, as NVIDIA's DRA driver
  does: a fatal XID NoSchedule (no new claim; the pods on it keep running and see their
  own errors), a non-fatal one (a contained or corrected error: 63, 92, 94) none (the
  device stays published as it is), XIDs it cannot watch NoSchedule; the operator
  may map any XID to NoExecute (evict), NoSchedule or none.
- GPUs carry `architecture` (from the compute capability) and the standard
  `resource.kubernetes.io/pcieRoot` (the PCIe root complex, as sysfs names it) and
  `resource.kubernetes.io/pciBusID`, which align GPUs with NICs of other drivers; MIG
  devices their GPU's pcieRoot.

Devices go into slices of at most 128, or 64 when one of them has taints or consumes
counters (the 1.36 limits). Every slice of a pool carries the pool's generation and
slice count.

A server that does not know a feature drops its fields (1.34 and 1.35 have
consumable capacity, partitionable devices and device taints as alpha, off by
default). `Features` says what to publish so that what is left stays safe: without
shares whole GPUs; without counters the MIG devices only, never beside their GPU;
without taints an unhealthy device is left out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from nvctk.base.errors import ascii_uint
from nvctk.dra.devices import MEMORY, MIB, SM_FULL, SM_SHARE, device_name
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo, proc_bus_id

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 128
MAX_DEVICES_TAINTED_OR_COUNTING = 64
MAX_COUNTER_SETS = 8
MAX_STRING = 64  # an attribute's string value
MEMORY_STEP = MIB
XID_REASON = "XID "  # how nvctk.k8s.health names an XID: "XID <n>"
EFFECTS = ("NoSchedule", "NoExecute", "None")  # "None": no taint
# XIDs of an error the GPU contained or corrected: it goes on serving its other work
NON_FATAL_XIDS = frozenset({63, 92, 94})
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
# compute capability major (minor) -> NVIDIA's architecture name
_ARCHITECTURES = {"3": "Kepler", "5": "Maxwell", "6": "Pascal", "7.0": "Volta", "7.2": "Volta",
                  "7.5": "Turing", "8.0": "Ampere", "8.6": "Ampere", "8.7": "Ampere",
                  "8.9": "Ada Lovelace", "9": "Hopper", "10": "Blackwell", "11": "Blackwell",
                  "12": "Blackwell"}


def architecture(compute_capability: str) -> str | None:
    """NVIDIA's name for the architecture of a compute capability ("9.0" -> "Hopper")."""
    cc = compute_capability.strip()
    return _ARCHITECTURES.get(cc) or _ARCHITECTURES.get(cc.split(".", 1)[0])


@dataclasses.dataclass(frozen=True)
class TaintPolicy:
    """An unhealthy device's taint effect by its reason: `xids` overrides the default
    (fatal XIDs NoSchedule, NON_FATAL_XIDS none) per XID; None: no taint."""

    xids: Mapping[int, str | None] = dataclasses.field(default_factory=dict)

    def effect(self, reason: str) -> str | None:
        xid = xid_of(reason)
        if xid is None:
            return "NoSchedule"  # not watched: what nothing sees may be broken
        if xid in self.xids:
            return self.xids[xid]
        return None if xid in NON_FATAL_XIDS else "NoSchedule"

    @classmethod
    def parse(cls, items: tuple[str, ...] | list[str]) -> TaintPolicy:
        """From `XID=EFFECT` items (EFFECT one of EFFECTS); ValueError naming a bad one."""
        out: dict[int, str | None] = {}
        for item in items:
            xid, sep, effect = item.partition("=")
            n = ascii_uint(xid.strip())
            if not sep or n is None or effect.strip() not in EFFECTS:
                raise ValueError(f"{item!r}: want XID=EFFECT, EFFECT one of "
                                 f"{', '.join(EFFECTS)} (e.g. 79=NoExecute, 94=None)")
            e = effect.strip()
            out[n] = None if e == "None" else e
        return cls(out)


def xid_of(reason: str) -> int | None:
    """The XID a reason names ("XID 79" -> 79), None for another reason."""
    if not reason.startswith(XID_REASON):
        return None
    head = reason[len(XID_REASON):].split(" ", 1)[0]
    return ascii_uint(head)


DEFAULT_TAINTS = TaintPolicy()


@dataclasses.dataclass(frozen=True)
class Features:
    """The optional API fields the API server keeps (see the module docstring)."""

    shares: bool = True  # DRAConsumableCapacity: allowMultipleAllocations, requestPolicy
    counters: bool = True  # DRAPartitionableDevices: sharedCounters, consumesCounters
    taints: bool = True  # DRADeviceTaints: devices[].taints


ALL = Features()  # what a 1.36 API server keeps


def semver(version: str) -> str | None:
    """A driver's or CUDA's version as semver 2.0.0 ("535.104.05" -> "535.104.5",
    "12.4" -> "12.4.0"); None when it has no numeric form."""
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    nums = [str(int(p)) for p in parts]
    return ".".join(nums + ["0"] * (3 - len(nums)))


def _string(v: str) -> dict[str, Any]:
    return {"string": v[:MAX_STRING]}


def _common_attributes(host: HostInfo, gpu: GpuInfo, pcie_root: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "productName": _string(gpu.name),
        "brand": _string(gpu.brand),
        "pcieBusID": _string(proc_bus_id(gpu.pci_bus_id)),
    }
    if (arch := architecture(gpu.compute_capability)) is not None:
        out["architecture"] = _string(arch)
    if pcie_root:
        out[PCIE_ROOT] = _string(pcie_root)
    for key, version in (("cudaComputeCapability", gpu.compute_capability),
                         ("driverVersion", host.driver_version),
                         ("cudaDriverVersion", host.cuda_version)):
        if (v := semver(version)) is not None:
            out[key] = {"version": v}
    return out


def taint(driver: str, reason: str, effect: str = "NoSchedule") -> dict[str, Any]:
    """The taint of an unhealthy device; the value is the reason as a label value."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", reason).strip("-_.")[:63].strip("-_.")
    return {"key": f"{driver}/unhealthy", "value": value, "effect": effect}


def counter_set(gpu: GpuInfo) -> str:
    return device_name(gpu)


def _counter_total(gpu: GpuInfo) -> int:
    """The counter set's memory: the GPU's, or its MIG devices' together if more."""
    return max(gpu.memory_mib, sum(m.memory_mib for m in gpu.mig_devices)) * MIB


def gpu_device(host: HostInfo, gpu: GpuInfo, features: Features,
               pcie_root: str | None = None) -> dict[str, Any]:
    memory = gpu.memory_mib * MIB
    dev: dict[str, Any] = {
        "name": device_name(gpu),
        "attributes": {
            "type": _string("gpu"),
            "uuid": _string(gpu.uuid),
            "index": {"int": gpu.index},
            "minor": {"int": gpu.minor},
            "migEnabled": {"bool": gpu.mig_enabled},
            **_common_attributes(host, gpu, pcie_root),
            PCI_BUS_ID: _string(proc_bus_id(gpu.pci_bus_id)),
        },
        "capacity": {MEMORY: {"value": str(memory)}, SM_SHARE: {"value": str(SM_FULL)}},
    }
    if gpu.mig_enabled:
        if features.counters:
            dev["consumesCounters"] = [{"counterSet": counter_set(gpu), "counters": {
                MEMORY: {"value": str(_counter_total(gpu))}}}]
    elif features.shares:
        dev["allowMultipleAllocations"] = True
        dev["capacity"][MEMORY]["requestPolicy"] = {
            "default": str(memory),
            "validRange": {"min": str(MEMORY_STEP), "step": str(MEMORY_STEP)}}
        dev["capacity"][SM_SHARE]["requestPolicy"] = {
            "default": "0", "validRange": {"min": "0", "max": str(SM_FULL), "step": "1"}}
    return dev


def mig_device(host: HostInfo, gpu: GpuInfo, mig: MigInfo, features: Features,
               pcie_root: str | None = None) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": device_name(gpu, mig),
        "attributes": {
            "type": _string("mig"),
            "uuid": _string(mig.uuid),
            "index": {"int": mig.index},
            "parentUUID": _string(gpu.uuid),
            "parentIndex": {"int": gpu.index},
            "parentMinor": {"int": gpu.minor},
            "profile": _string(mig.profile),
            "gpuInstance": {"int": mig.gpu_instance},
            "computeInstance": {"int": mig.compute_instance},
            **_common_attributes(host, gpu, pcie_root),
        },
        "capacity": {MEMORY: {"value": str(mig.memory_mib * MIB)}},
    }
    if features.counters:
        dev["consumesCounters"] = [{"counterSet": counter_set(gpu), "counters": {
            MEMORY: {"value": str(mig.memory_mib * MIB)}}}]
    return dev


@dataclasses.dataclass(frozen=True)
class Pool:
    """What this node publishes: its devices and counter sets, in NVML order."""

    devices: tuple[dict[str, Any], ...]
    counter_sets: tuple[dict[str, Any], ...]


def node_pool(host: HostInfo, driver: str, unhealthy: Mapping[str, str],
              features: Features = ALL, policy: TaintPolicy = DEFAULT_TAINTS,
              pcie_roots: Mapping[str, str] | None = None) -> Pool:
    """The pool's content; unhealthy: uuid -> reason (a GPU's or a MIG device's);
    pcie_roots: sysfs bus id -> its PCIe root (nvctk.dra.node reads them)."""
    devices: list[dict[str, Any]] = []
    sets: list[dict[str, Any]] = []
    roots = pcie_roots or {}
    for gpu in host.gpus:
        root = roots.get(proc_bus_id(gpu.pci_bus_id))
        pairs: list[tuple[str, dict[str, Any]]] = []
        if not gpu.mig_enabled or features.counters:
            pairs.append((gpu.uuid, gpu_device(host, gpu, features, root)))
        pairs += [(m.uuid, mig_device(host, gpu, m, features, root)) for m in gpu.mig_devices]
        if gpu.mig_enabled and features.counters:
            sets.append({"name": counter_set(gpu),
                         "counters": {MEMORY: {"value": str(_counter_total(gpu))}}})
        for uuid, dev in pairs:
            reason = unhealthy.get(uuid)
            effect = None if reason is None else policy.effect(reason)
            if effect is None:
                devices.append(dev)
            elif features.taints:
                devices.append({**dev, "taints": [taint(driver, reason or "", effect)]})
    return Pool(tuple(devices), tuple(sets))


def _limit(dev: dict[str, Any]) -> int:
    return MAX_DEVICES_TAINTED_OR_COUNTING if dev.get("taints") or dev.get("consumesCounters") \
        else MAX_DEVICES


def chunk_devices(devices: tuple[dict[str, Any], ...]) -> list[list[dict[str, Any]]]:
    """Devices in order, into as few slices as the limits allow (a slice with one
    tainted or counter-consuming device holds at most 64)."""
    out: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] = []
    cur_limit = MAX_DEVICES
    for d in devices:
        limit = min(cur_limit, _limit(d))
        if len(cur) + 1 > limit:
            out.append(cur)
            cur, limit = [], _limit(d)
        cur.append(d)
        cur_limit = limit
    if cur:
        out.append(cur)
    return out


def slice_name(node: str, driver: str, i: int) -> str:
    """`<node>-<driver>-<i>`: a DNS subdomain of ≤ 253 (node names are DNS subdomains)."""
    return f"{node[: 253 - len(driver) - 8]}-{driver}-{i}"


def slices(pool: Pool, node: str, driver: str, generation: int) -> list[dict[str, Any]]:
    """The pool's ResourceSlices at generation: counter sets first, then devices. A
    node with no device publishes one empty slice (the pool exists, empty)."""
    specs: list[dict[str, Any]] = [
        {"sharedCounters": list(pool.counter_sets[i:i + MAX_COUNTER_SETS])}
        for i in range(0, len(pool.counter_sets), MAX_COUNTER_SETS)]
    specs += [{"devices": c} for c in chunk_devices(pool.devices)]
    if not specs:
        specs = [{"devices": []}]
    return [{
        "apiVersion": API_VERSION, "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, driver, i)},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": generation,
                          "resourceSliceCount": len(specs)},
                 **spec},
    } for i, spec in enumerate(specs)]
