"""request + host inventory + image facts -> Plan (nvctk.edits, the one intermediate form).

`make_plan` resolves the requested ids against NVML's view of the host, checks
the requirements, picks the driver files for the capabilities and lays out
where everything goes in the container: devices, mounts (and which are required),
symlinks, env, hooks, the vGPU mounts. It never mounts or writes anything, and
never reads the spec: the few facts of the image it needs are gathered once by
`image_facts`. Each step (plan_devices, plan_mounts, plan_symlinks, plan_vgpu,
plan_hooks) is a function of plain data.
"""

from __future__ import annotations

import os
import stat

from nvctk.base.errors import DriverError, RequestError, UnknownDeviceError, ascii_uint, shown
from nvctk.base.record import Record
from nvctk.edits import (
    PRELOAD,
    VGPU_DIRS,
    DeviceNode,
    Hook,
    Mount,
    Plan,
    ProcMask,
    Symlink,
    VgpuPlan,
)
from nvctk.host import driver as nvdriver
from nvctk.oci import spec as oci
from nvctk.request.parse import Request
from nvctk.spec.apply import HOOK_NAME, HOOK_PATH_ENV

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Literal

    from nvctk.base.config import Config
    from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
    from nvctk.request.requirements import HostFacts

DEBIAN_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
OTHER_LIB_DIR = "/usr/lib64"
DEBIAN_LIB32_DIR = "/usr/lib/i386-linux-gnu"
OTHER_LIB32_DIR = "/usr/lib"
FIRMWARE_DIR = "/lib/firmware/nvidia"
DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"

# every variable nvctk.vgpu.limits reads from a container's env starts with one of these
VGPU_ENV_PREFIXES = ("CUDA_DEVICE_", "NVCTK_VGPU_")
# driver libraries a container does not start without: (file name prefix, capability)
REQUIRED = (("libcuda.so", "compute"), ("libnvidia-ml.so", "utility"))

# (library name prefix, link name, target) made beside the mounted libraries;
# target None means libGLX_nvidia.so.<driver version>.
LINKS: tuple[tuple[str, str, str | None], ...] = (
    ("libcuda.so.", "libcuda.so", "libcuda.so.1"),
    ("libnvidia-opticalflow.so.", "libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1"),
    ("libGLX_nvidia.so.", "libGLX_indirect.so.0", None),
)


class Selected(Record):
    __slots__ = ("gpu", "mig")

    def __init__(self, gpu: GpuInfo, mig: MigInfo | None = None) -> None:
        self.gpu = gpu
        self.mig = mig

    @property
    def name(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid


class ImageFacts(Record):
    """What the plan needs from the container image, gathered once (image_facts)."""

    __slots__ = ("debian", "root_readonly", "rootfs")

    def __init__(self, rootfs: str | None = None, debian: bool = False,
                 root_readonly: bool = False) -> None:
        self.rootfs = rootfs  # None: not known (the vGPU checks of the image are skipped)
        self.debian = debian  # /etc/debian_version: the Debian lib dir layout
        self.root_readonly = root_readonly  # the spec's root.readonly


def image_facts(spec: dict[str, Any], bundle: str) -> ImageFacts:
    """The image's facts: its rootfs (the spec's root.path, maybe bundle-relative),
    whether it is laid out as Debian's (looked up inside the rootfs by the kernel,
    never following a link out of it) and whether it is mounted read-only."""
    from nvctk.hook.mount import exists_in_rootfs

    rootfs = oci.root_path(spec, bundle)
    return ImageFacts(rootfs, exists_in_rootfs(rootfs, "/etc/debian_version"),
                      (spec.get("root") or {}).get("readonly") is True)


def container_lib_dirs(image: ImageFacts) -> tuple[str, str]:
    """(64-bit, 32-bit) lib dirs: Debian layout if the image has /etc/debian_version."""
    if image.debian:
        return DEBIAN_LIB_DIR, DEBIAN_LIB32_DIR
    return OTHER_LIB_DIR, OTHER_LIB32_DIR


# --- device resolution ---------------------------------------------------------------------


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


def proc_bus_id(pci_bus_id: str) -> str:
    """NVML's 00000000:1B:00.0 -> procfs's directory name 0000:1b:00.0."""
    domain, _, rest = pci_bus_id.partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


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


def load_and_select(request: Request, config: Config) -> tuple[HostInfo, list[Selected]]:
    """The host (nvctk.host.cache's cache under config.state_dir, else NVML) and the
    request's devices on it. A device the cache does not know may have been made
    since it was written (a new MIG device): NVML itself is asked before that is
    an error."""
    from nvctk.host.cache import load_host

    host, cached = load_host(config.driver_root, config.state_dir)
    try:
        return host, select_devices(request, host)
    except UnknownDeviceError:
        if not cached:
            raise
    host, _ = load_host(config.driver_root, config.state_dir, fresh=True)
    return host, select_devices(request, host)


# --- device nodes --------------------------------------------------------------------------


def _proc_devices_major(driver_root: str, name: str) -> int | None:
    from nvctk.base.fileio import read_regular_file  # never blocks (a FIFO is refused)

    try:
        text = read_regular_file(os.path.join(driver_root, "proc/devices"), 1 << 20)
    except OSError:
        return None
    for line in text.decode("ascii", "replace").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1] == name and fields[0].isascii() \
                and fields[0].isdigit() and len(fields[0]) < 8:
            return int(fields[0])
    return None


def _node(dev_dir: str, rel: str, driver_root: str = "", proc_name: str = "",
          minor: int | None = None) -> DeviceNode:
    """The host node dev_dir/rel -> DeviceNode with its real major/minor (never
    hard-coded: nvidia-uvm's major is dynamic). A missing nvidia-caps node (created
    on demand by nvidia-modprobe on real hosts) falls back to /proc/devices."""
    host = os.path.join(dev_dir, rel)
    try:
        st = os.stat(host)
    except FileNotFoundError:
        major = _proc_devices_major(driver_root, proc_name) if proc_name else None
        if major is None or minor is None:
            raise DriverError(f"device node {host} is missing (is the NVIDIA driver loaded?)")
        return DeviceNode("/dev/" + rel, host, major, minor)
    except OSError as e:
        raise DriverError(f"device node {host}: {e.strerror}")
    if not stat.S_ISCHR(st.st_mode):
        raise DriverError(f"{host} is not a character device")
    return DeviceNode("/dev/" + rel, host, os.major(st.st_rdev), os.minor(st.st_rdev))


def _cap_minor(access_file: str) -> int:
    from nvctk.base.fileio import read_regular_file  # never blocks (a FIFO is refused)

    try:
        text = read_regular_file(access_file, 1 << 16).decode("ascii", "replace")
    except OSError as e:
        raise DriverError(f"cannot read the MIG capability minor from {access_file}: {e}")
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor":
            value = value.strip()
            if not (value.isascii() and value.isdigit() and len(value) < 8):
                raise DriverError(f"{access_file}: DeviceFileMinor {value[:20]!r} is not a number")
            return int(value)
    raise DriverError(f"{access_file} has no DeviceFileMinor line")


def _cap_node(files: nvdriver.DriverFiles, access_rel: str) -> DeviceNode:
    minor = _cap_minor(os.path.join(files.proc_dir, "capabilities", access_rel))
    return _node(files.dev_dir, f"nvidia-caps/nvidia-cap{minor}", files.driver_root,
                 "nvidia-caps", minor)


def drm_nodes(request: Request, selected: list[Selected],
              files: nvdriver.DriverFiles) -> list[tuple[str, str]]:
    """(sysfs bus id, node name) of the selected whole GPUs' DRM nodes, for containers
    with the graphics or display capability (as NVIDIA's toolkit gives them); a MIG
    device has no display engine of its own."""
    if not {"graphics", "display"} & set(request.capabilities):
        return []
    out = []
    for sel in selected:
        if sel.mig is None:
            bus = proc_bus_id(sel.gpu.pci_bus_id)
            out += [(bus, n) for n in nvdriver.drm_node_names(files.driver_root, bus)]
    return out


def plan_drm_links(drm: list[tuple[str, str]]) -> list[Symlink]:
    """udev's /dev/dri/by-path/pci-<busid>-{card,render} links (what Mesa, Vulkan
    loaders and X servers find a GPU's nodes by) for these DRM nodes."""
    out = []
    for bus, name in drm:
        kind = "card" if name.startswith("card") else "render"
        out.append(Symlink(f"/dev/dri/by-path/pci-{bus}-{kind}", f"../{name}"))
    return out


def plan_devices(
    request: Request, selected: list[Selected], files: nvdriver.DriverFiles,
    drm: list[tuple[str, str]] | None = None,
) -> list[DeviceNode]:
    """drm: drm_nodes(...) when the caller has them already."""
    dev = files.dev_dir
    nodes = [_node(dev, "nvidiactl")]
    for sel in selected:
        nodes.append(_node(dev, f"nvidia{sel.gpu.minor}"))
    caps = set(request.capabilities)
    if caps & {"compute", "video"}:
        nodes += [_node(dev, "nvidia-uvm"), _node(dev, "nvidia-uvm-tools")]
    if "display" in caps:
        nodes.append(_node(dev, "nvidia-modeset"))
    for _, name in drm_nodes(request, selected, files) if drm is None else drm:
        nodes.append(_node(dev, f"dri/{name}"))
    for sel in selected:
        if sel.mig is not None:
            # MIG paths use the parent's minor number, not its NVML index
            base = f"gpu{sel.gpu.minor}/mig/gi{sel.mig.gpu_instance}"
            nodes.append(_cap_node(files, f"{base}/access"))
            nodes.append(_cap_node(files, f"{base}/ci{sel.mig.compute_instance}/access"))
    if request.mig_config:
        nodes.append(_cap_node(files, "mig/config"))
    if request.mig_monitor:
        nodes.append(_cap_node(files, "mig/monitor"))
    return list({n.path: n for n in nodes}.values())  # drop repeats, keep first order


# --- mounts -----------------------------------------------------------------------------------


def _expanded(capabilities: tuple[str, ...]) -> list[str]:
    caps = list(capabilities)
    if "video" in caps and "compute" not in caps:
        caps.append("compute")
    if "display" in caps and "graphics" not in caps:
        caps.append("graphics")
    return caps


def _container_path_of_host(files: nvdriver.DriverFiles, host: str) -> str:
    """A host path under the driver root as the same path inside the container
    (<root>/var/run/x is /run/x: /var/run is a link to /run)."""
    rel = os.path.relpath(host, files.driver_root)
    if rel.startswith(".."):
        return host
    if rel.startswith("var/run/"):
        rel = rel[len("var/") :]
    return "/" + rel


def plan_mounts(
    request: Request, files: nvdriver.DriverFiles, config: Config, lib_dir: str, lib32_dir: str
) -> list[Mount]:
    caps = _expanded(request.capabilities)
    out: list[Mount] = []
    for cap in caps:
        for host in files.libraries.get(cap, ()):
            out.append(Mount(host, f"{lib_dir}/{os.path.basename(host)}",
                             required=required_for(os.path.basename(host), request) is not None))
    if "compat32" in caps:
        wanted = {n for c in caps for n in nvdriver.LIBRARIES.get(c, ())}
        for host in files.libraries32:
            if os.path.basename(host).split(".so", 1)[0] in wanted:
                out.append(Mount(host, f"{lib32_dir}/{os.path.basename(host)}"))
    for cap in caps:
        for host in files.binaries.get(cap, ()):
            out.append(Mount(host, f"/usr/bin/{os.path.basename(host)}"))
        for host, container in files.config_files.get(cap, ()):
            out.append(Mount(host, container))
    for host in files.firmware:
        out.append(Mount(host, f"{FIRMWARE_DIR}/{files.driver_version}/{os.path.basename(host)}"))
    for cap in caps:
        for host in files.sockets.get(cap, ()):
            out.append(Mount(host, _container_path_of_host(files, host), "socket",
                             read_only=False, noexec=True))
    if "compute" in caps:
        # The container's CUDA_MPS_PIPE_DIRECTORY only says where the pipe dir appears
        # inside it; the host side is always the host's pipe dir. A host path taken
        # from the image's env would bind any host directory (/etc, /) writable.
        pipe = request.env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIR
        if pipe.startswith("/") and os.path.normpath(pipe) != "/":
            host_pipe = os.path.join(files.driver_root, DEFAULT_MPS_PIPE_DIR.lstrip("/"))
            # in the host's world-writable /tmp: never a link someone else planted
            if os.path.isdir(host_pipe) and not os.path.islink(host_pipe):
                out.append(Mount(host_pipe, pipe, "dir", read_only=False, noexec=True))
    for em in config.extra_mounts:
        kind: Literal["file", "dir"] = "file" if os.path.isfile(em.host_path) else "dir"
        out.append(Mount(em.host_path, em.container_path, kind, read_only=em.read_only))
    # one mount per container path, the first wins (driver files before extra mounts)
    first: dict[str, Mount] = {}
    for m in out:
        first.setdefault(m.container_path, m)
    return list(first.values())


def required_for(name: str, request: Request) -> str | None:
    """The capability asked for that makes the driver library `name` required, if any."""
    for prefix, cap in REQUIRED:
        if name.startswith(prefix) and cap in request.capabilities:
            return cap
    return None


def plan_symlinks(mounts: list[Mount], lib_dir: str, driver_version: str) -> list[Symlink]:
    names = {os.path.basename(m.container_path) for m in mounts
             if os.path.dirname(m.container_path) == lib_dir}
    out = []
    for prefix, link, target in LINKS:
        if any(n.startswith(prefix) for n in names):
            out.append(Symlink(f"{lib_dir}/{link}", target or f"libGLX_nvidia.so.{driver_version}"))
    return out


# --- vGPU hook point ----------------------------------------------------------------------------


def vgpu_devices(selected: list[Selected]) -> list[Selected]:
    """The container's GPUs in the order libvgpu indexes them (NVML order inside it)."""
    return sorted(selected, key=lambda s: (s.gpu.index, -1 if s.mig is None else s.mig.index))


def _a_limit_variable(env: dict[str, str]) -> str:
    """The first variable that sets a limit (for messages)."""
    from nvctk.vgpu import limits as vgpu

    for k in sorted(env):
        try:
            if k.startswith(vgpu.MEMORY_VAR) and vgpu.parse_memory(env[k]):
                return k
            if k.startswith(vgpu.SM_VAR) and vgpu.parse_sm(env[k]):
                return k
        except ValueError:
            continue
    return vgpu.MEMORY_VAR


def _authority_shares(request: Request, config: Config,
                      devs: list[Selected]) -> list[tuple[int, int]]:
    """(memory bytes, SM percent) per GPU of the container, as the node granted them in
    verified nvctk.io/vgpu.* annotations (nvctk.vgpu.authority). A GPU the container gets
    but no annotation names is refused: its share would not hold there."""
    from nvctk.vgpu import authority

    annotations = dict(request.vgpu_authority)
    key = authority.load_key(config.authority_key)
    shares = authority.shares(annotations, key, config.authority_key)
    uuids = [d.mig.uuid if d.mig is not None else d.gpu.uuid for d in devs]
    missing = [u for u in uuids if u not in shares]
    if missing:
        raise RequestError(
            f"annotation {', '.join(sorted(annotations))}: the node granted a vGPU share of "
            f"{', '.join(sorted(shares)) or 'no device'}, but the container also gets "
            f"{', '.join(missing)} (from {request.source}); refused: the share would not hold there")
    return [shares[u] for u in uuids]


def plan_vgpu(
    request: Request,
    selected: list[Selected],
    config: Config,
    image: ImageFacts,
    *,
    container_id: str | None = None,
    runtime_root: str | None = None,
    vgpu_library: Callable[[], str] | None = None,
) -> VgpuPlan | None:
    """CUDA_DEVICE_MEMORY_LIMIT[_i] / CUDA_DEVICE_SM_LIMIT[_i] -> VgpuPlan (None: no limit).

    Validates at create time (RequestError naming the variable): malformed values,
    an index beyond the container's GPUs, a memory cap above the GPU's memory, and
    an image whose loader would ignore /etc/ld.so.preload (musl, no glibc loader).
    """
    if not request.vgpu_authority and not any(k.startswith(VGPU_ENV_PREFIXES)
                                              for k in request.env):
        return None  # no variable nvctk.vgpu.limits reads: not even worth importing it
    from nvctk.vgpu import limits as vgpu

    env = {k: v for k, v in request.env.items() if k != vgpu.CACHE_VAR}  # nvctk sets that one
    devs = vgpu_devices(selected)
    limits = vgpu.limits_from_env(env, len(devs))
    granted = _authority_shares(request, config, devs) if request.vgpu_authority else None
    if granted is not None:
        # the env can only tighten what the node granted (docs/decisions.md)
        limits = vgpu.VgpuLimits(
            memory=tuple(vgpu.stricter(m, g[0]) for m, g in zip(limits.memory, granted, strict=True)),
            sm=tuple(vgpu.stricter(p, g[1]) for p, g in zip(limits.sm, granted, strict=True)),
            shared_cache=limits.shared_cache, context_reserve=limits.context_reserve)
    if not limits.any:
        return None
    # only now: it brings nvctk.hook.mount (ctypes), re and more to the create path
    from nvctk.vgpu import state as vs

    for i, (cap, dev) in enumerate(zip(limits.memory, devs, strict=True)):
        mib = dev.mig.memory_mib if dev.mig is not None else dev.gpu.memory_mib
        if cap and mib and cap > mib << 20:
            if granted is not None and granted[i][0] == cap:
                what = f"the node's vGPU share ({cap >> 20} MiB)"
            else:
                name = vgpu.limit_source(env, vgpu.MEMORY_VAR, i, cap)
                what = f"{name}={env[name]}"
            raise RequestError(
                f"{what}: above the memory of the container's GPU {i} "
                f"({dev.name}, {mib} MiB)"
            )
    if image.rootfs is not None:
        vs.check_preloadable(image.rootfs, _a_limit_variable(env))
    if vgpu_library is None:
        from nvctk.host.paths import require_vgpu_library

        library = require_vgpu_library(config)
    else:
        library = vgpu_library()
    cid = container_id or "container"
    state_dir = vs.state_dir_for(config, runtime_root, cid)  # the shim (re)creates it
    return VgpuPlan(
        library=library,
        container_library=vs.CONTAINER_LIBRARY,
        state_dir=state_dir,
        container_state_dir=vgpu.VGPU_DIR,
        limits=limits.values(),
        root_readonly=image.root_readonly,
        mounts=vgpu_mounts(library, vs.CONTAINER_LIBRARY, state_dir, vgpu.VGPU_DIR),
    )


def vgpu_mounts(library: str, container_library: str, state_dir: str,
                container_state_dir: str) -> tuple[Mount, ...]:
    """The vGPU mounts in their order (docs: the vGPU state layout): ro/ at /run/nvctk,
    libvgpu.so, rw/ at /run/nvctk/vgpu, ro/limits and rw/cache on their placeholders in
    it, ro/ld.so.preload over /etc/ld.so.preload. All required: a container that sets
    a limit never runs uncapped."""
    top = os.path.dirname(container_state_dir)
    ro, rw = (os.path.join(state_dir, d) for d in VGPU_DIRS)
    return (
        Mount(ro, top, "dir", True, False, True),
        Mount(library, container_library, "file", True, False, True),
        Mount(rw, container_state_dir, "dir", False, True, True),
        Mount(os.path.join(ro, "limits"), os.path.join(container_state_dir, "limits"),
              "file", True, True, True),
        Mount(os.path.join(rw, "cache"), os.path.join(container_state_dir, "cache"),
              "file", False, True, True),
        Mount(os.path.join(ro, "ld.so.preload"), PRELOAD, "file", True, True, True),
    )


def vgpu_env(vgpu: VgpuPlan | None) -> dict[str, str]:
    """The env the shim adds: where the container's accounting file is."""
    if vgpu is None:
        return {}
    return {"CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{vgpu.container_state_dir}/cache"}


# --- the plan -------------------------------------------------------------------------------------


def host_facts(host: HostInfo, selected: list[Selected]) -> list[HostFacts]:
    # imported here and at check(): only containers that state requirements need it
    from nvctk.request.requirements import HostFacts

    if not selected:
        return [HostFacts(host.cuda_version, host.driver_version)]
    return [
        HostFacts(host.cuda_version, host.driver_version, s.gpu.compute_capability,
                  s.gpu.brand, f"GPU {s.gpu.index} ({s.name})")
        for s in selected
    ]


def plan_hooks(hook_path: str, config: Config, nvctk_config: str | None, vgpu: bool,
               runtime_root: str | None = None) -> tuple[Hook, ...]:
    """nvctk-hook prestart; with a vGPU also `nvctk-hook poststop --runtime-root ROOT`,
    which removes the vGPU state dir. The root, with the id runc passes in the state,
    names the dir: runc keeps each container's own copy of its hooks, while the
    bundle's plan is the last create's (two containers from one bundle)."""
    env = (HOOK_PATH_ENV, f"NVCTK_CONFIG={nvctk_config}") if nvctk_config else (HOOK_PATH_ENV,)
    hooks = [Hook("prestart", hook_path, (HOOK_NAME, "prestart"), env, config.hook_timeout)]
    if vgpu:
        from nvctk.vgpu.state import DEFAULT_RUNTIME_ROOT

        # absolute: runc resolves a relative --root against its cwd, the hook runs in the bundle
        root = os.path.normpath(os.path.abspath(runtime_root or DEFAULT_RUNTIME_ROOT))
        try:
            root.encode()
        except UnicodeEncodeError:  # argv's non-UTF-8 bytes, as surrogate escapes
            shown_root = os.fsencode(root).decode("ascii", "backslashreplace")
            raise RequestError(f"runc's --root '{shown_root[:200]}' is not UTF-8: a container "
                               "with a vGPU limit passes it to its poststop hook in "
                               "config.json, which holds text only") from None
        hooks.append(Hook("poststop", hook_path, (HOOK_NAME, "poststop", "--runtime-root", root),
                          env, config.hook_timeout))
    return tuple(hooks)


def make_plan(
    request: Request,
    config: Config,
    host: HostInfo | None = None,
    image: ImageFacts | None = None,
    *,
    hook_path: str = HOOK_NAME,
    nvctk_config: str | None = None,
    container_id: str | None = None,
    runtime_root: str | None = None,
    vgpu_library: Callable[[], str] | None = None,
) -> Plan:
    """The plan for this request.

    host: NVML's view of config.driver_root, loaded when not given (see
    load_and_select). image: the image's facts (image_facts); without them the
    non-Debian lib dir is used and the vGPU checks of the image are skipped.
    hook_path, nvctk_config: the hooks' executable and the config they read.
    container_id, runtime_root (runc's --root): key the container's vGPU state dir.
    vgpu_library: finds libvgpu.so (default nvctk.host.paths.require_vgpu_library).
    Raises NvctkError subclasses whose message names the culprit.
    """
    image = image or ImageFacts()
    if host is None:
        host, selected = load_and_select(request, config)
    else:
        selected = select_devices(request, host)
    if not request.disable_require and request.requirements:
        from nvctk.request.requirements import check

        check(request.requirements, host_facts(host, selected))
    files = nvdriver.discover_files(config.driver_root, host.driver_version,
                                    _expanded(request.capabilities))
    lib_dir, lib32_dir = container_lib_dirs(image)

    drm = drm_nodes(request, selected, files)
    devices = plan_devices(request, selected, files, drm)
    mounts = plan_mounts(request, files, config, lib_dir, lib32_dir)
    symlinks = plan_symlinks(mounts, lib_dir, host.driver_version) + plan_drm_links(drm)
    gpu_uuids = tuple(dict.fromkeys(s.gpu.uuid for s in selected))
    vgpu = plan_vgpu(request, selected, config, image, container_id=container_id,
                     runtime_root=runtime_root, vgpu_library=vgpu_library)
    return Plan(
        driver_version=host.driver_version,
        capabilities=request.capabilities,
        gpu_uuids=gpu_uuids,
        devices=tuple(devices),
        mounts=tuple(mounts),
        symlinks=tuple(symlinks),
        proc_mask=ProcMask(
            files.proc_dir, tuple(dict.fromkeys(proc_bus_id(s.gpu.pci_bus_id) for s in selected))
        ),
        lib_dir=lib_dir,
        ldconfig=config.ldconfig,
        env=vgpu_env(vgpu),
        vgpu=vgpu,
        hooks=plan_hooks(hook_path, config, nvctk_config, vgpu is not None, runtime_root),
    )
