"""What planning needs to know about the container's image, read once (discovery).

Everything is looked up inside the rootfs by the kernel (openat2 RESOLVE_IN_ROOT via
nvctk.oci.rootfs), never following a link out of it. The vGPU facts (its libc, its own
/etc/ld.so.preload) are read only for a container that may set a limit.
"""

from __future__ import annotations

import errno
import os
import stat

from nvctk.base.errors import NvctkError, SpecError
from nvctk.base.record import Record
from nvctk.edits import MAX_PRELOAD_BYTES, PRELOAD
from nvctk.oci import spec as oci

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

GLIBC_LOADERS = ("/lib64/ld-linux-x86-64.so.2",)  # plus /lib/ld-linux-*.so*
_DIGITS = frozenset("0123456789")
_WORD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")  # [A-Za-z0-9_]


class ImageFacts(Record):
    """What the plan needs from the container image."""

    __slots__ = ("rootfs", "debian", "root_readonly", "libc", "preload_entries",  # noqa: RUF023
                 "host_layout")

    def __init__(self, rootfs: str | None = None, debian: bool = False,
                 root_readonly: bool = False, libc: str | None = None,
                 preload_entries: tuple[str, ...] | NvctkError = (),
                 host_layout: bool = False) -> None:
        self.rootfs = rootfs  # None: not known (the vGPU checks of the image are skipped)
        self.debian = debian  # /etc/debian_version: the Debian lib dir layout
        self.root_readonly = root_readonly  # the spec's root.readonly
        # 'glibc' | 'musl' | 'none'; None: not looked at (no vGPU asked, or no rootfs)
        self.libc = libc
        # the image's own /etc/ld.so.preload entries, or why they cannot be read (raised
        # by the plan only for a container that gets libvgpu)
        self.preload_entries = preload_entries
        # no image (a CDI spec's form): the libraries go to the host's own lib dir
        self.host_layout = host_layout


def image_facts(spec: dict[str, Any], bundle: str, *, vgpu: bool = False) -> ImageFacts:
    """The image's facts: its rootfs (the spec's root.path, maybe bundle-relative),
    whether it is laid out as Debian's and whether it is mounted read-only; with vgpu,
    also its libc and its own preload entries."""
    from nvctk.oci.rootfs import exists_in_rootfs  # start time: only GPU creates need it

    rootfs = oci.root_path(spec, bundle)
    readonly = (spec.get("root") or {}).get("readonly") is True
    debian = exists_in_rootfs(rootfs, "/etc/debian_version")
    if not vgpu:
        return ImageFacts(rootfs, debian, readonly)
    try:
        entries: tuple[str, ...] | NvctkError = tuple(image_preload(rootfs))
    except NvctkError as e:
        entries = e
    return ImageFacts(rootfs, debian, readonly, libc_kind(rootfs), entries)


def _is_glibc_loader(name: str) -> bool:
    """name matches ld-linux(-[A-Za-z0-9_-]+)?\\.so(\\.[0-9]+)*"""
    if not name.startswith("ld-linux"):
        return False
    arch, sep, version = name[len("ld-linux"):].partition(".so")
    if not sep:
        return False
    if arch and (arch[0] != "-" or len(arch) < 2 or not set(arch[1:]) <= _WORD | {"-"}):
        return False
    if not version:
        return True
    first, *parts = version.split(".")
    return first == "" and all(p and set(p) <= _DIGITS for p in parts)


def _is_musl_loader(name: str) -> bool:
    """name matches ld-musl-[A-Za-z0-9_]+\\.so\\.1"""
    prefix, suffix = "ld-musl-", ".so.1"
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return False
    arch = name[len(prefix):-len(suffix)]
    return bool(arch) and set(arch) <= _WORD


def _list_in_rootfs(rootfs: str, path: str) -> list[str]:
    from nvctk.oci.rootfs import open_in_rootfs

    try:
        fd = open_in_rootfs(rootfs, path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def libc_kind(rootfs: str) -> str:
    """'musl' if the image has musl's loader, 'glibc' if it has glibc's, else 'none'."""
    from nvctk.oci.rootfs import exists_in_rootfs

    lib = _list_in_rootfs(rootfs, "/lib")
    if any(_is_musl_loader(n) for n in lib):
        return "musl"
    loaders = [*GLIBC_LOADERS, *(f"/lib/{n}" for n in lib if _is_glibc_loader(n))]
    if any(exists_in_rootfs(rootfs, p) for p in loaders):
        return "glibc"
    return "none"


def image_preload(rootfs: str) -> list[str]:
    """The entries of the image's own /etc/ld.so.preload ([] if it has none)."""
    from nvctk.oci.rootfs import open_in_rootfs

    # O_PATH first: opening the image's file for reading before knowing what it is
    # would block on a FIFO (the create hangs) or open a device node the image
    # ships (its major/minor are the host's drivers).
    try:
        pfd = open_in_rootfs(rootfs, PRELOAD, os.O_PATH)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return []
        raise SpecError(f"{rootfs}: {PRELOAD}: {e.strerror}")
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise SpecError(f"{rootfs}: {PRELOAD} is not a regular file")
        try:
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as e:
            raise SpecError(f"{rootfs}: {PRELOAD}: {e.strerror}")
    finally:
        os.close(pfd)
    try:
        data = b""
        while len(data) <= MAX_PRELOAD_BYTES:
            chunk = os.read(fd, MAX_PRELOAD_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_PRELOAD_BYTES:
        raise SpecError(f"{rootfs}: {PRELOAD} is larger than {MAX_PRELOAD_BYTES} bytes")
    # as ld.so reads it: names separated by white space or ':', '#' starts a comment
    text = "\n".join(line.partition("#")[0] for line in data.decode("utf-8", "replace").split("\n"))
    return text.replace(":", " ").split()
