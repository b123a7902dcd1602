"""Discovery: every host and image fact a GPU container's plan needs, read once (into
nvctk.host.facts' records).

The planner (nvctk.plan) does no I/O: what it decides from lives in the records made
here. A fact that could not be read is kept as what went wrong (a missing node is None,
an unreadable one its error text, a key that is refused the error itself): the plan
decides whether that matters for this request, and words the message.
"""

from __future__ import annotations

import os
import stat

from nvctk.base.errors import NvctkError, UnknownDeviceError
from nvctk.base.fileio import read_regular_file
from nvctk.host import cache as host_cache
from nvctk.host import driver as nvdriver
from nvctk.host.facts import DeviceFacts, Facts
from nvctk.host.inventory import proc_bus_id
from nvctk.host.paths import require_vgpu_library
from nvctk.host.select import select_devices
from nvctk.request.parse import asks_for_vgpu, expanded_capabilities

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import TypeVar

    from nvctk.base.config import Config
    from nvctk.host.image import ImageFacts
    from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
    from nvctk.host.select import Selected
    from nvctk.request.parse import Request

    T = TypeVar("T")

DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"
# nodes every plan may use; a missing one matters only to a request that needs it
COMMON_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
CAPS_NODE = "nvidia-caps"  # its /proc/devices name, and the dir of the cap nodes


# --- the inventory ----------------------------------------------------------------------------


def load_and_select(request: Request, config: Config) -> tuple[HostInfo, list[Selected]]:
    """The host (nvctk.host.cache's cache under config.state_dir, else NVML) and the
    request's devices on it (nvctk.host.select, a query of that inventory). A device the
    cache does not know may have been made since it was written (a new MIG device):
    NVML itself is asked before that is an error."""
    host, cached = host_cache.load_host(config.driver_root, config.state_dir)
    try:
        return host, select_devices(request, host)
    except UnknownDeviceError:
        if not cached:
            raise
    host, _ = host_cache.load_host(config.driver_root, config.state_dir, fresh=True)
    return host, select_devices(request, host)


# --- device nodes -------------------------------------------------------------------------------


def proc_devices_majors(driver_root: str) -> dict[str, int]:
    """<root>/proc/devices: driver name -> character major ({} when unreadable)."""
    try:  # never blocks (a FIFO is refused)
        text = read_regular_file(os.path.join(driver_root, "proc/devices"), 1 << 20)
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.decode("ascii", "replace").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isascii() and fields[0].isdigit() \
                and len(fields[0]) < 8:
            out.setdefault(fields[1], int(fields[0]))
    return out


def node_fact(path: str) -> tuple[int, int] | str | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e.strerror or str(e)
    if not stat.S_ISCHR(st.st_mode):
        return "not a character device"
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def cap_minor_fact(access_file: str) -> int | str:
    """The DeviceFileMinor of a MIG capability's access file, or the error text."""
    try:
        text = read_regular_file(access_file, 1 << 16).decode("ascii", "replace")
    except OSError as e:
        return f"cannot read the MIG capability minor from {access_file}: {e}"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor":
            value = value.strip()
            if not (value.isascii() and value.isdigit() and len(value) < 8):
                return f"{access_file}: DeviceFileMinor {value[:20]!r} is not a number"
            return int(value)
    return f"{access_file} has no DeviceFileMinor line"


def cap_access_rels(selected: Iterable[tuple[GpuInfo, MigInfo | None]], mig_config: bool,
                    mig_monitor: bool) -> list[str]:
    """The capabilities/ access files of these (gpu, mig) pairs (MIG paths use the
    parent's minor number, not its NVML index), and of mig/config and mig/monitor."""
    out = []
    for gpu, mig in selected:
        if mig is not None:
            base = f"gpu{gpu.minor}/mig/gi{mig.gpu_instance}"
            out += [f"{base}/access", f"{base}/ci{mig.compute_instance}/access"]
    if mig_config:
        out.append("mig/config")
    if mig_monitor:
        out.append("mig/monitor")
    return out


def device_facts(files: nvdriver.DriverFiles, selected: Iterable[tuple[GpuInfo, MigInfo | None]],
                 capabilities: Iterable[str], mig_config: bool = False,
                 mig_monitor: bool = False) -> DeviceFacts:
    """The nodes a plan of these devices may use: the common ones, each selected GPU's,
    its DRM nodes (graphics/display only), and its MIG capability nodes."""
    pairs = list(selected)
    caps = set(capabilities)
    rels = [*COMMON_NODES, *(f"nvidia{g.minor}" for g, _ in pairs)]
    drm: dict[str, tuple[str, ...]] = {}
    if caps & {"graphics", "display"}:
        for gpu, mig in pairs:
            if mig is None:
                bus = proc_bus_id(gpu.pci_bus_id)
                drm[bus] = tuple(nvdriver.drm_node_names(files.driver_root, bus))
                rels += [f"dri/{n}" for n in drm[bus]]
    cap_minors: dict[str, int | str] = {}
    for rel in cap_access_rels(pairs, mig_config, mig_monitor):
        cap_minors[rel] = minor = cap_minor_fact(os.path.join(files.proc_dir, "capabilities", rel))
        if isinstance(minor, int):
            rels.append(f"{CAPS_NODE}/nvidia-cap{minor}")
    nodes = {rel: node_fact(os.path.join(files.dev_dir, rel)) for rel in dict.fromkeys(rels)}
    # nvidia-modprobe makes a caps node on demand on real hosts: its major from /proc/devices
    majors = proc_devices_majors(files.driver_root) if any(
        v is None for r, v in nodes.items() if r.startswith(CAPS_NODE + "/")) else {}
    return DeviceFacts(files.dev_dir, nodes, majors, cap_minors, drm)


# --- the rest -----------------------------------------------------------------------------------


def mps_dir(driver_root: str) -> str | None:
    """The host's MPS pipe dir when it is a real directory: in the host's world-writable
    /tmp, never a link someone else planted."""
    host_pipe = os.path.join(driver_root, DEFAULT_MPS_PIPE_DIR.lstrip("/"))
    return host_pipe if os.path.isdir(host_pipe) and not os.path.islink(host_pipe) else None


def extra_mount_kinds(config: Config) -> dict[str, str]:
    """The config's extra mounts' host paths: "file" or "dir" (also for a missing one)."""
    return {em.host_path: "file" if os.path.isfile(em.host_path) else "dir"
            for em in config.extra_mounts}


def or_error(read: Callable[[], T]) -> T | NvctkError:
    try:
        return read()
    except NvctkError as e:  # the plan raises it when (and only where) it matters
        return e


def discover(request: Request, config: Config, host: HostInfo, selected: Iterable[Selected],
             image: ImageFacts) -> Facts:
    """The facts for planning `request` on `host` with its `selected` devices (the
    query's result, kept in the facts). Reads only what the request can use: the driver
    files of its capabilities, the nodes of its devices, the vGPU facts only when it may
    set a limit."""
    selected = tuple(selected)
    caps = expanded_capabilities(request.capabilities)
    files = nvdriver.discover_files(config.driver_root, host.driver_version, caps)
    devices = device_facts(files, [(s.gpu, s.mig) for s in selected], caps, request.mig_config,
                           request.mig_monitor)
    vgpu = asks_for_vgpu(request)
    key: bytes | NvctkError | None = None
    if vgpu and request.vgpu_authority:
        from nvctk.vgpu import authority  # start time: vGPU annotations only

        key = or_error(lambda: authority.load_key(config.authority_key))
    return Facts(
        host, selected, files, devices, image,
        mps_dir=mps_dir(files.driver_root) if "compute" in caps else None,
        extra_mount_kinds=extra_mount_kinds(config),
        authority_key=key,
        vgpu_library=or_error(lambda: require_vgpu_library(config)) if vgpu else "",
    )
