"""The host driver's files per capability (REFERENCE §4), found at a driver root.

Libraries are chosen through the root's ld.so.cache by library name (the cache
key up to ".so"); the file the cache entry resolves to must end in
".so.<driver version>", so stale libraries of another driver are never picked.
Binaries are searched in the root's usual bin dirs. Nothing here calls NVML.
"""

from __future__ import annotations

import os
import stat

from nvctk.base.config import ALL_CAPABILITIES
from nvctk.base.inroot import resolve_in_root
from nvctk.base.record import Record
from nvctk.host import ldcache

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

UTILITY_LIBS = ("libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq")
COMPUTE_LIBS = (
    "libcuda",
    "libcudadebugger",
    "libnvidia-opencl",
    "libnvidia-gpucomp",
    "libnvidia-ptxjitcompiler",
    "libnvidia-fatbinaryloader",
    "libnvidia-allocator",
    "libnvidia-compiler",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-nvvm",
)
VIDEO_LIBS = ("libvdpau_nvidia", "libnvidia-encode", "libnvidia-opticalflow", "libnvcuvid")
GRAPHICS_LIBS = (
    "libnvidia-eglcore",
    "libnvidia-glcore",
    "libnvidia-tls",
    "libnvidia-glsi",
    "libnvidia-fbc",
    "libnvidia-ifr",
    "libnvidia-rtcore",
    "libnvoptix",
    "libGLX_nvidia",
    "libEGL_nvidia",
    "libGLESv2_nvidia",
    "libGLESv1_CM_nvidia",
    "libnvidia-glvkspirv",
    "libnvidia-cbl",
)
NGX_LIBS = ("libnvidia-ngx",)

# capability -> library names (video implies the compute libs, display the graphics ones)
LIBRARIES: dict[str, tuple[str, ...]] = {
    "utility": UTILITY_LIBS,
    "compute": COMPUTE_LIBS,
    "video": VIDEO_LIBS + COMPUTE_LIBS,
    "graphics": GRAPHICS_LIBS,
    "display": GRAPHICS_LIBS,
    "ngx": NGX_LIBS,
}

BINARIES: dict[str, tuple[str, ...]] = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}
BIN_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")

# (searched host paths relative to the root, in order) -> container path
ConfigFiles = tuple[tuple[tuple[str, ...], str], ...]
GRAPHICS_CONFIG_FILES: ConfigFiles = (
    (
        ("usr/share/glvnd/egl_vendor.d/10_nvidia.json", "etc/glvnd/egl_vendor.d/10_nvidia.json"),
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    ),
    (
        ("usr/share/vulkan/icd.d/nvidia_icd.json", "etc/vulkan/icd.d/nvidia_icd.json"),
        "/usr/share/vulkan/icd.d/nvidia_icd.json",
    ),
    # the name some packagings give the ICD (NVIDIA's spec mounts it too; the loader
    # reads every file in icd.d)
    (
        ("usr/share/vulkan/icd.d/nvidia_icd.x86_64.json", "etc/vulkan/icd.d/nvidia_icd.x86_64.json"),
        "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json",
    ),
    (
        ("usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
         "etc/vulkan/implicit_layer.d/nvidia_layers.json"),
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
    ),
    # EGL external platforms: one per libnvidia-egl-* window-system library
    *(((f"usr/share/egl/egl_external_platform.d/{n}", f"etc/egl/egl_external_platform.d/{n}"),
       f"/usr/share/egl/egl_external_platform.d/{n}")
      for n in ("09_nvidia_wayland2.json", "10_nvidia_wayland.json", "15_nvidia_gbm.json",
                "20_nvidia_xcb.json", "20_nvidia_xlib.json")),
)
# an X server in the container: its configuration snippets for the NVIDIA driver
DISPLAY_CONFIG_FILES: ConfigFiles = GRAPHICS_CONFIG_FILES + tuple(
    ((f"usr/share/X11/xorg.conf.d/{n}", f"etc/X11/xorg.conf.d/{n}"), f"/usr/share/X11/xorg.conf.d/{n}")
    for n in ("10-nvidia.conf", "nvidia-drm-outputclass.conf"))
# OpenCL's ICD loader finds the driver through this file: without it, no OpenCL platform
COMPUTE_CONFIG_FILES: ConfigFiles = (
    (("etc/OpenCL/vendors/nvidia.icd",), "/etc/OpenCL/vendors/nvidia.icd"),
)
# capability -> its configuration files (REFERENCE §4 lists the graphics ones)
CONFIG_FILES: dict[str, ConfigFiles] = {
    "compute": COMPUTE_CONFIG_FILES,
    "graphics": GRAPHICS_CONFIG_FILES,
    "display": DISPLAY_CONFIG_FILES,
}

SOCKETS: dict[str, tuple[str, ...]] = {
    "utility": (
        "run/nvidia-persistenced/socket",
        "run/nvidia-fabricmanager/socket",
    ),
}

FIRMWARE_DIRS = ("lib/firmware/nvidia", "usr/lib/firmware/nvidia")


class DriverFiles(Record):
    __slots__ = ("driver_root", "driver_version", "libraries", "libraries32",  # noqa: RUF023
                 "binaries", "config_files", "firmware", "sockets", "proc_dir", "dev_dir",
                 "library_names")

    def __init__(
        self,
        driver_root: str,
        driver_version: str,
        libraries: dict[str, tuple[str, ...]] | None = None,
        libraries32: tuple[str, ...] = (),
        binaries: dict[str, tuple[str, ...]] | None = None,
        config_files: dict[str, tuple[tuple[str, str], ...]] | None = None,
        firmware: tuple[str, ...] = (),
        sockets: dict[str, tuple[str, ...]] | None = None,
        proc_dir: str = "/proc/driver/nvidia",
        dev_dir: str = "/dev",
        library_names: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.driver_root = driver_root
        self.driver_version = driver_version
        # capability -> absolute host paths of the 64-bit libraries (the versioned files)
        self.libraries: dict[str, tuple[str, ...]] = {} if libraries is None else libraries
        self.libraries32 = libraries32
        self.binaries: dict[str, tuple[str, ...]] = {} if binaries is None else binaries
        # capability -> ((host path, container path), ...)
        self.config_files: dict[str, tuple[tuple[str, str], ...]] = (
            {} if config_files is None else config_files)
        self.firmware = firmware
        self.sockets: dict[str, tuple[str, ...]] = {} if sockets is None else sockets
        self.proc_dir = proc_dir
        self.dev_dir = dev_dir
        # capability -> its library names (LIBRARIES): the planner picks by it, no I/O
        self.library_names = LIBRARIES if library_names is None else library_names

    def for_capabilities(self, capabilities: Iterable[str]) -> list[str]:
        """Every host path (libraries, binaries, config files, sockets) of these capabilities,
        de-duplicated, in a stable order; compat32 adds the 32-bit libraries."""
        out: list[str] = []
        for cap in capabilities:
            out += self.libraries.get(cap, ())
            out += self.binaries.get(cap, ())
            out += [h for h, _ in self.config_files.get(cap, ())]
            out += self.sockets.get(cap, ())
            if cap == "compat32":
                out += self.libraries32
        return list(dict.fromkeys(out))


def host_path(root: str, path: str) -> str:
    """`path` (absolute inside the root) as a host path."""
    return os.path.normpath(os.path.join(root, path.lstrip("/")))


def _lib_name(soname: str) -> str:
    return soname.split(".so", 1)[0]


# every library name once, in the order the 32-bit libraries are listed
_LIBRARY_NAMES = tuple(dict.fromkeys(n for names in LIBRARIES.values() for n in names))


def _find_libraries(
    root: str, version: str, entries: list[ldcache.CacheEntry], arch: str,
    links_seen: dict[str, str | None],
) -> dict[str, str]:
    """library name -> host path of its versioned file, first matching cache entry wins
    (entries: the cache's entries of the wanted libraries)."""
    suffix = f".so.{version}"
    found: dict[str, str] = {}
    for e in entries:
        if e.arch != arch:
            continue
        name = _lib_name(e.name)
        if name in found:
            continue
        real = resolve_in_root(root, e.path, links_seen=links_seen)
        if real.endswith(suffix) and os.path.isfile(real):
            found[name] = real
    return found


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _find_binary(root: str, name: str, more_dirs: Iterable[str] = ()) -> str | None:
    """The driver's program `name`: the first executable ELF file in BIN_DIRS, then in
    more_dirs (host paths). A script is passed over: a GPU host seen with driver 580 had
    /usr/bin/nvidia-smi as a shell wrapper that execs /usr/local/nvidia/bin/nvidia-smi,
    which is not there inside a container."""
    for d in (*(os.path.join(root, b) for b in BIN_DIRS), *more_dirs):
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK) and _is_elf(p):
            return p
    return None


def _bin_dirs_beside(libraries: Iterable[str]) -> tuple[str, ...]:
    """<prefix>/bin of the dirs the driver's libraries are in (<prefix>/lib64 and the like):
    where a driver installed under its own prefix keeps its programs (/usr/local/nvidia,
    GKE's /home/kubernetes/bin/nvidia)."""
    return tuple(dict.fromkeys(os.path.join(os.path.dirname(os.path.dirname(p)), "bin")
                               for p in libraries))


DRM_NODE_PREFIXES = ("card", "renderD")


def drm_node_names(driver_root: str, bus_id: str) -> list[str]:
    """The DRM nodes (card<N>, renderD<M>) of the PCI device bus_id ("0000:1b:00.0", sysfs's
    form), as <root>/sys/bus/pci/devices/<bus_id>/drm/ names them; [] when nvidia-drm is
    not loaded for it. Other entries there (controlD<N> of old kernels) are skipped."""
    try:
        names = os.listdir(os.path.join(driver_root, "sys/bus/pci/devices", bus_id, "drm"))
    except OSError:
        return []
    out = []
    for n in names:
        for prefix in DRM_NODE_PREFIXES:
            digits = n[len(prefix):]
            if n.startswith(prefix) and digits.isascii() and digits.isdigit():
                out.append(n)
    # card before renderD, each in number order
    return sorted(out, key=lambda n: (not n.startswith("card"), len(n), n))


def discover_files(driver_root: str, driver_version: str,
                   capabilities: Iterable[str] | None = None) -> DriverFiles:
    """The driver files at `driver_root` for `driver_version`; raises DriverError when
    the root has no readable ld.so.cache.

    capabilities: look only for the files of these (a create needs no more; the
    libraries of "video" and "display" include those of "compute" and "graphics",
    as in LIBRARIES); None: all. The firmware is always looked for.
    """
    caps = ALL_CAPABILITIES if capabilities is None else tuple(capabilities)
    root = os.path.abspath(driver_root)
    wanted = {n for c in caps for n in LIBRARIES.get(c, ())}
    lib_names = [n for n in _LIBRARY_NAMES if n in wanted]
    entries = ldcache.read(root, lib_names)
    links_seen: dict[str, str | None] = {}
    libs64 = _find_libraries(root, driver_version, entries, "x86-64", links_seen)

    libraries = {
        cap: tuple(libs64[n] for n in names if n in libs64)
        for cap, names in LIBRARIES.items() if cap in caps
    }
    libraries32: tuple[str, ...] = ()
    if "compat32" in caps:
        libs32 = _find_libraries(root, driver_version, entries, "i386", links_seen)
        libraries32 = tuple(dict.fromkeys(libs32[n] for n in lib_names if n in libs32))

    binaries: dict[str, tuple[str, ...]] = {}
    beside = _bin_dirs_beside(libs64.values())
    for cap, names in BINARIES.items():
        if cap in caps:
            binaries[cap] = tuple(p for p in (_find_binary(root, n, beside) for n in names) if p)

    config_files = _find_config_files(root, caps)
    firmware = _find_firmware(root, driver_version)
    sockets = _find_sockets(root, caps)
    proc_dir, dev_dir = driver_dirs(root)
    return DriverFiles(driver_root=root, driver_version=driver_version, libraries=libraries,
                       libraries32=libraries32, binaries=binaries, config_files=config_files,
                       firmware=tuple(firmware), sockets=sockets, proc_dir=proc_dir,
                       dev_dir=dev_dir)


def _find_config_files(root: str, caps: tuple[str, ...]) -> dict[str, tuple[tuple[str, str], ...]]:
    """Each capability's config files: (host path, container path), the first of each
    one's candidates that exists."""
    config_files: dict[str, tuple[tuple[str, str], ...]] = {}
    for cap, wanted_files in CONFIG_FILES.items():
        if cap not in caps:
            continue
        configs: list[tuple[str, str]] = []
        for candidates, container_path in wanted_files:
            for rel in candidates:
                p = os.path.join(root, rel)
                if os.path.isfile(p):
                    configs.append((p, container_path))
                    break
        config_files[cap] = tuple(configs)
    return config_files


def _find_firmware(root: str, driver_version: str) -> list[str]:
    """The GSP firmware files of this driver version, from the first firmware dir
    holding any."""
    firmware: list[str] = []
    for d in FIRMWARE_DIRS:
        fw_dir = os.path.join(root, d, driver_version)
        try:
            fw_names = sorted(os.listdir(fw_dir))
        except OSError:
            continue
        firmware += [
            os.path.join(fw_dir, n)
            for n in fw_names
            if n.startswith("gsp") and n.endswith(".bin") and os.path.isfile(os.path.join(fw_dir, n))
        ]
        if firmware:
            break
    return firmware


def _find_sockets(root: str, caps: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Each capability's daemon sockets that exist (under / or /var of the root)."""
    sockets: dict[str, tuple[str, ...]] = {}
    for cap, rels in SOCKETS.items():
        if cap not in caps:
            continue
        found = []
        for rel in rels:
            for p in (os.path.join(root, rel), os.path.join(root, "var", rel)):
                try:
                    if stat.S_ISSOCK(os.stat(p).st_mode):
                        found.append(p)
                        break
                except OSError:
                    pass
        sockets[cap] = tuple(found)
    return sockets


def driver_dirs(driver_root: str) -> tuple[str, str]:
    """The driver's procfs and device dirs under `driver_root` (DriverFiles' proc_dir and
    dev_dir): what the device nodes are found by, without the libraries."""
    root = os.path.abspath(driver_root)
    proc = os.path.join(root, "proc/driver/nvidia")
    # for "/" that is the real procfs directory anyway
    return (proc if os.path.isdir(proc) else "/proc/driver/nvidia"), os.path.join(root, "dev")
