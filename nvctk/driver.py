"""The host driver's files per capability (REFERENCE §4), found at a driver root.

Libraries are chosen through the root's ld.so.cache by library name (the cache
key up to ".so"); the file the cache entry resolves to must end in
".so.<driver version>", so stale libraries of another driver are never picked.
Binaries are searched in the root's usual bin dirs. Nothing here calls NVML.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from nvctk import ldcache
from nvctk.errors import DriverError

CAPABILITIES = ("utility", "compute", "video", "graphics", "display", "ngx", "compat32")

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
GRAPHICS_CONFIG_FILES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("usr/share/glvnd/egl_vendor.d/10_nvidia.json", "etc/glvnd/egl_vendor.d/10_nvidia.json"),
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    ),
    (
        ("usr/share/vulkan/icd.d/nvidia_icd.json", "etc/vulkan/icd.d/nvidia_icd.json"),
        "/usr/share/vulkan/icd.d/nvidia_icd.json",
    ),
    (
        ("usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
         "etc/vulkan/implicit_layer.d/nvidia_layers.json"),
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
    ),
    (
        ("usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",),
        "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
    ),
    (
        ("usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",),
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
    ),
)

SOCKETS: dict[str, tuple[str, ...]] = {
    "utility": (
        "run/nvidia-persistenced/socket",
        "run/nvidia-fabricmanager/socket",
    ),
}

FIRMWARE_DIRS = ("lib/firmware/nvidia", "usr/lib/firmware/nvidia")


@dataclass(frozen=True)
class DriverFiles:
    driver_root: str
    driver_version: str
    # capability -> absolute host paths of the 64-bit libraries (the versioned files)
    libraries: dict[str, tuple[str, ...]] = field(default_factory=dict)
    libraries32: tuple[str, ...] = ()
    binaries: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # capability -> ((host path, container path), ...)
    config_files: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    firmware: tuple[str, ...] = ()
    sockets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    proc_dir: str = "/proc/driver/nvidia"
    dev_dir: str = "/dev"

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


def resolve_in_root(root: str, path: str, max_links: int = 40) -> str:
    """Host path of `path` (inside the root) with every symlink resolved as if the root
    were /: absolute link targets stay inside the root, `..` stops at the root."""
    root = os.path.abspath(root)
    parts = [p for p in path.split("/") if p and p != "."]
    resolved: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, part)
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            resolved.append(part)
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > max_links:
                raise DriverError(f"too many levels of symlinks resolving {path} in {root}")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        resolved.append(part)
    return os.path.join(root, *resolved)


def _lib_name(soname: str) -> str:
    return soname.split(".so", 1)[0]


def _find_libraries(
    root: str, version: str, entries: list[ldcache.CacheEntry], arches: tuple[str, ...]
) -> dict[str, str]:
    """library name -> host path of its versioned file, first matching cache entry wins."""
    wanted = {n for names in LIBRARIES.values() for n in names}
    suffix = f".so.{version}"
    found: dict[str, str] = {}
    for e in entries:
        if e.arch not in arches:
            continue
        name = _lib_name(e.name)
        if name not in wanted or name in found:
            continue
        real = resolve_in_root(root, e.path)
        if real.endswith(suffix) and os.path.isfile(real):
            found[name] = real
    return found


def _find_binary(root: str, name: str) -> str | None:
    for d in BIN_DIRS:
        p = os.path.join(root, d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def discover_files(driver_root: str, driver_version: str) -> DriverFiles:
    """The driver files at `driver_root` for `driver_version`; raises DriverError when
    the root has no readable ld.so.cache."""
    root = os.path.abspath(driver_root)
    entries = ldcache.read(root)
    libs64 = _find_libraries(root, driver_version, entries, ("x86-64",))
    libs32 = _find_libraries(root, driver_version, entries, ("i386",))

    libraries = {
        cap: tuple(libs64[n] for n in names if n in libs64) for cap, names in LIBRARIES.items()
    }
    all_names = [n for names in LIBRARIES.values() for n in names]
    libraries32 = tuple(dict.fromkeys(libs32[n] for n in all_names if n in libs32))

    binaries: dict[str, tuple[str, ...]] = {}
    for cap, names in BINARIES.items():
        binaries[cap] = tuple(p for p in (_find_binary(root, n) for n in names) if p)

    configs: list[tuple[str, str]] = []
    for candidates, container_path in GRAPHICS_CONFIG_FILES:
        for rel in candidates:
            p = os.path.join(root, rel)
            if os.path.isfile(p):
                configs.append((p, container_path))
                break
    config_files = {"graphics": tuple(configs), "display": tuple(configs)}

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

    sockets: dict[str, tuple[str, ...]] = {}
    for cap, rels in SOCKETS.items():
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

    proc = os.path.join(root, "proc/driver/nvidia")
    # for "/" that is the real procfs directory anyway
    proc_dir = proc if os.path.isdir(proc) else "/proc/driver/nvidia"

    return DriverFiles(
        driver_root=root,
        driver_version=driver_version,
        libraries=libraries,
        libraries32=libraries32,
        binaries=binaries,
        config_files=config_files,
        firmware=tuple(firmware),
        sockets=sockets,
        proc_dir=proc_dir,
        dev_dir=os.path.join(root, "dev"),
    )
