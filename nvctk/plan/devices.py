"""The container's device nodes and DRM links, from discovery's DeviceFacts (no I/O)."""

from __future__ import annotations

import posixpath

from nvctk.base.errors import DriverError
from nvctk.edits import DeviceNode, Symlink
from nvctk.host.inventory import proc_bus_id  # records only: no I/O

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.host.discover import DeviceFacts
    from nvctk.host.select import Selected
    from nvctk.request.parse import Request

CAPS_NODE = "nvidia-caps"  # the cap nodes' dir under /dev, and their /proc/devices name


def node(facts: DeviceFacts, rel: str, proc_name: str = "", minor: int | None = None) -> DeviceNode:
    """The host node <dev_dir>/rel as a DeviceNode with its real major/minor. A missing
    nvidia-caps node (made on demand by nvidia-modprobe on real hosts) falls back to the
    major /proc/devices gives (proc_name) and the capability's minor."""
    host = posixpath.join(facts.dev_dir, rel)
    got = facts.nodes.get(rel)
    if got is None:
        major = facts.proc_majors.get(proc_name) if proc_name else None
        if major is None or minor is None:
            raise DriverError(f"device node {host} is missing (is the NVIDIA driver loaded?)")
        return DeviceNode("/dev/" + rel, host, major, minor)
    if isinstance(got, str):
        if got == "not a character device":
            raise DriverError(f"{host} is not a character device")
        raise DriverError(f"device node {host}: {got}")
    return DeviceNode("/dev/" + rel, host, got[0], got[1])


def cap_node(facts: DeviceFacts, access_rel: str) -> DeviceNode:
    """The nvidia-caps node of the capability whose access file is capabilities/access_rel."""
    minor = facts.cap_minors.get(access_rel)
    if minor is None:
        raise DriverError(f"the MIG capability {access_rel} was not looked up")  # a bug
    if isinstance(minor, str):
        raise DriverError(minor)
    return node(facts, f"{CAPS_NODE}/nvidia-cap{minor}", CAPS_NODE, minor)


def drm_nodes(request: Request, selected: list[Selected],
              facts: DeviceFacts) -> list[tuple[str, str]]:
    """(sysfs bus id, node name) of the selected whole GPUs' DRM nodes, for containers
    with the graphics or display capability (as NVIDIA's toolkit gives them); a MIG
    device has no display engine of its own."""
    if not {"graphics", "display"} & set(request.capabilities):
        return []
    out = []
    for sel in selected:
        if sel.mig is None:
            bus = proc_bus_id(sel.gpu.pci_bus_id)
            out += [(bus, n) for n in facts.drm.get(bus, ())]
    return out


def plan_drm_links(drm: list[tuple[str, str]]) -> list[Symlink]:
    """udev's /dev/dri/by-path/pci-<busid>-{card,render} links (what Mesa, Vulkan
    loaders and X servers find a GPU's nodes by) for these DRM nodes."""
    out = []
    for bus, name in drm:
        kind = "card" if name.startswith("card") else "render"
        out.append(Symlink(f"/dev/dri/by-path/pci-{bus}-{kind}", f"../{name}"))
    return out


def plan_devices(request: Request, selected: list[Selected], facts: DeviceFacts,
                 drm: list[tuple[str, str]] | None = None) -> list[DeviceNode]:
    """nvidiactl, each GPU's node, the capabilities' nodes (uvm for compute/video,
    modeset for display where the host has it), DRM nodes, MIG capability nodes; first order, no repeats.
    drm: drm_nodes(...) when the caller has them already."""
    nodes = [node(facts, "nvidiactl")]
    for sel in selected:
        nodes.append(node(facts, f"nvidia{sel.gpu.minor}"))
    caps = set(request.capabilities)
    if caps & {"compute", "video"}:
        nodes += [node(facts, "nvidia-uvm"), node(facts, "nvidia-uvm-tools")]
    # nvidia-modeset exists only where nvidia-modeset.ko is loaded: headless data-centre
    # hosts (an H100 with driver 580, seen) have none; as NVIDIA's toolkit, a missing one
    # is left out, an unusable one still refused
    if "display" in caps and facts.nodes.get("nvidia-modeset") is not None:
        nodes.append(node(facts, "nvidia-modeset"))
    for _, name in drm_nodes(request, selected, facts) if drm is None else drm:
        nodes.append(node(facts, f"dri/{name}"))
    for sel in selected:
        if sel.mig is not None:
            # MIG paths use the parent's minor number, not its NVML index
            base = f"gpu{sel.gpu.minor}/mig/gi{sel.mig.gpu_instance}"
            nodes.append(cap_node(facts, f"{base}/access"))
            nodes.append(cap_node(facts, f"{base}/ci{sel.mig.compute_instance}/access"))
    if request.mig_config:
        nodes.append(cap_node(facts, "mig/config"))
    if request.mig_monitor:
        nodes.append(cap_node(facts, "mig/monitor"))
    return list({n.path: n for n in nodes}.values())  # drop repeats, keep first order
