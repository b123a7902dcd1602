"""Which GPUs and MIG devices a request names: a query of the host's inventory (no I/O).

`select_devices` resolves NVIDIA_VISIBLE_DEVICES-style ids (indexes, UUIDs, PCI bus
ids, GPU:MIG pairs) against the host's inventory record, once per create
(nvctk.host.discover.load_and_select); its result is part of the facts
(Facts.selected), which the planner reads.
"""

from __future__ import annotations

from nvctk.base.errors import UnknownDeviceError, ascii_uint, shown
from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
    from nvctk.request.parse import Request


class Selected(Record):
    __slots__ = ("gpu", "mig")

    def __init__(self, gpu: GpuInfo, mig: MigInfo | None = None) -> None:
        self.gpu = gpu
        self.mig = mig

    @property
    def name(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid


_HEX = frozenset("0123456789abcdefABCDEF")


def _norm_bus_id(ident: str) -> tuple[int, int, int, int] | None:
    """'00000000:1B:00.0' or '0000:1b:00.0' -> (domain, bus, device, function)."""
    parts = ident.split(":")
    if len(parts) != 3 or "." not in parts[2]:
        return None
    dev, _, fn = parts[2].partition(".")
    fields = (parts[0], parts[1], dev, fn)
    # ASCII hex only (int(x, 16) also takes other scripts' digits), and short
    if not all(f and len(f) <= 8 and _HEX.issuperset(f) for f in fields):
        return None
    return int(parts[0], 16), int(parts[1], 16), int(dev, 16), int(fn, 16)


def _known_ids(host: HostInfo) -> str:
    ids = [f"{g.index} ({g.uuid})" for g in host.gpus]
    return ", ".join(ids) if ids else "none: the host has no GPU"


def resolve_device(ident: str, host: HostInfo, source: str) -> Selected:
    """One id of NVIDIA_VISIBLE_DEVICES (or of a device mount) -> GPU or MIG device."""
    low = ident.lower()
    # ids and indexes are ASCII: isdigit()/int() would take U+0660 or "²" (ascii_uint)
    if ident.isascii() and ident.isdigit():
        index = ascii_uint(ident)  # None past 9 digits: no GPU has such an index
        for g in host.gpus:
            if g.index == index:
                return Selected(g)
    elif low.startswith("gpu-"):
        for g in host.gpus:
            if g.uuid.lower() == low:
                return Selected(g)
    elif low.startswith("mig-"):
        for g in host.gpus:
            for m in g.mig_devices:
                if m.uuid.lower() == low:
                    return Selected(g, m)
    elif ":" in ident and "." not in ident:
        gi, _, mi = ident.partition(":")
        gpu_index, mig_index = ascii_uint(gi), ascii_uint(mi)
        if gpu_index is not None and mig_index is not None:
            for g in host.gpus:
                if g.index == gpu_index:
                    for m in g.mig_devices:
                        if m.index == mig_index:
                            return Selected(g, m)
    else:
        want = _norm_bus_id(ident)
        if want is not None:
            for g in host.gpus:
                if _norm_bus_id(g.pci_bus_id) == want:
                    return Selected(g)
    raise UnknownDeviceError(
        f"unknown device {shown(ident)} in {source} (this host has GPUs {_known_ids(host)})"
    )


def select_devices(request: Request, host: HostInfo) -> list[Selected]:
    """The request's devices in container order, duplicates (same device named two
    ways) dropped. `all`: every GPU and every MIG device, in NVML order."""
    if request.all_devices:
        out = [Selected(g) for g in host.gpus]
        out += [Selected(g, m) for g in host.gpus for m in g.mig_devices]
        return out
    seen: set[str] = set()
    out = []
    for ident in request.devices:
        sel = resolve_device(ident, host, request.source)
        if sel.name not in seen:
            seen.add(sel.name)
            out.append(sel)
    return out
