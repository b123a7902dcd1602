"""The container's mounts and library links, from discovery's facts (no I/O).

Driver files of the requested capabilities (libraries, 32-bit ones for compat32,
binaries, config files, firmware, IPC sockets), the MPS pipe dir, the config's extra
mounts; one mount per container path, the first wins.
"""

from __future__ import annotations

import posixpath

from nvctk.edits import Mount, Symlink, container_path_of_host
from nvctk.request.parse import expanded_capabilities

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Literal

    from nvctk.base.config import ExtraMount
    from nvctk.host.driver import DriverFiles
    from nvctk.host.image import ImageFacts
    from nvctk.request.parse import Request

DEBIAN_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
OTHER_LIB_DIR = "/usr/lib64"
DEBIAN_LIB32_DIR = "/usr/lib/i386-linux-gnu"
OTHER_LIB32_DIR = "/usr/lib"
FIRMWARE_DIR = "/lib/firmware/nvidia"
DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"

# driver libraries a container does not start without: (file name prefix, capability)
REQUIRED = (("libcuda.so", "compute"), ("libnvidia-ml.so", "utility"))

# (library name prefix, link name, target) made beside the mounted libraries;
# target None means libGLX_nvidia.so.<driver version>.
LINKS: tuple[tuple[str, str, str | None], ...] = (
    ("libcuda.so.", "libcuda.so", "libcuda.so.1"),
    ("libnvidia-opticalflow.so.", "libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1"),
    ("libGLX_nvidia.so.", "libGLX_indirect.so.0", None),
)


def container_lib_dirs(image: ImageFacts, files: DriverFiles | None = None) -> tuple[str, str]:
    """(64-bit, 32-bit) lib dirs: Debian layout if the image has /etc/debian_version; no
    image (host_layout, a CDI spec's form): the host's own dir of libcuda, both."""
    cuda = next(iter(files.libraries.get("compute", ())), None) if files is not None else None
    if image.host_layout:
        lib_dir = container_path_of_host(files.driver_root, posixpath.dirname(cuda)) \
            if files is not None and cuda else DEBIAN_LIB_DIR
        return lib_dir, lib_dir
    if image.debian:
        return DEBIAN_LIB_DIR, DEBIAN_LIB32_DIR
    return OTHER_LIB_DIR, OTHER_LIB32_DIR


def required_for(name: str, request: Request) -> str | None:
    """The capability asked for that makes the driver library `name` required, if any."""
    for prefix, cap in REQUIRED:
        if name.startswith(prefix) and cap in request.capabilities:
            return cap
    return None


def mps_mount(request: Request, mps_dir: str | None) -> Mount | None:
    """The host's MPS pipe dir at the container's CUDA_MPS_PIPE_DIRECTORY (compute).
    That variable only says where the pipe dir appears inside; the host side is always
    the host's pipe dir: a host path taken from the image's env would bind any host
    directory (/etc, /) writable."""
    if mps_dir is None or "compute" not in expanded_capabilities(request.capabilities):
        return None
    pipe = request.env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIR
    if not pipe.startswith("/") or posixpath.normpath(pipe) == "/":
        return None
    return Mount(mps_dir, pipe, "dir", read_only=False, noexec=True)


def plan_mounts(request: Request, files: DriverFiles, lib_dir: str, lib32_dir: str, *,
                mps_dir: str | None = None, extra_mounts: Iterable[ExtraMount] = (),
                extra_mount_kinds: Mapping[str, str] | None = None) -> list[Mount]:
    """mps_dir: the host's MPS pipe dir (discovery: None when it is not a real dir);
    extra_mount_kinds: extra mount host path -> "file" | "dir" (missing: "dir")."""
    basename = posixpath.basename
    caps = expanded_capabilities(request.capabilities)
    out: list[Mount] = []
    for cap in caps:
        for host in files.libraries.get(cap, ()):
            out.append(Mount(host, f"{lib_dir}/{basename(host)}",
                             required=required_for(basename(host), request) is not None))
    if "compat32" in caps:
        wanted = {n for c in caps for n in files.library_names.get(c, ())}
        for host in files.libraries32:
            if basename(host).split(".so", 1)[0] in wanted:
                out.append(Mount(host, f"{lib32_dir}/{basename(host)}"))
    for cap in caps:
        for host in files.binaries.get(cap, ()):
            out.append(Mount(host, f"/usr/bin/{basename(host)}"))
        for host, container in files.config_files.get(cap, ()):
            out.append(Mount(host, container))
    for host in files.firmware:
        out.append(Mount(host, f"{FIRMWARE_DIR}/{files.driver_version}/{basename(host)}"))
    for cap in caps:
        for host in files.sockets.get(cap, ()):
            out.append(Mount(host, container_path_of_host(files.driver_root, host), "socket",
                             read_only=False, noexec=True))
    mps = mps_mount(request, mps_dir)
    if mps is not None:
        out.append(mps)
    kinds = extra_mount_kinds or {}
    for em in extra_mounts:
        kind: Literal["file", "dir"] = "file" if kinds.get(em.host_path) == "file" else "dir"
        out.append(Mount(em.host_path, em.container_path, kind, read_only=em.read_only))
    # one mount per container path, the first wins (driver files before extra mounts)
    first: dict[str, Mount] = {}
    for m in out:
        first.setdefault(m.container_path, m)
    return list(first.values())


def plan_symlinks(mounts: list[Mount], lib_dir: str, driver_version: str) -> list[Symlink]:
    """The links beside the mounted libraries (LINKS) whose library is mounted."""
    names = {posixpath.basename(m.container_path) for m in mounts
             if posixpath.dirname(m.container_path) == lib_dir}
    out = []
    for prefix, link, target in LINKS:
        if any(n.startswith(prefix) for n in names):
            out.append(Symlink(f"{lib_dir}/{link}", target or f"libGLX_nvidia.so.{driver_version}"))
    return out
