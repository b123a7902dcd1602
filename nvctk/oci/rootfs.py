"""Lookups inside a container's rootfs by the kernel: openat2 RESOLVE_IN_ROOT.

A path taken from an image resolves as if the rootfs were / (absolute symlinks and
`..` stay inside it, magic links refused), never out of it. The create's image facts
(nvctk.host.image) need only this, not the hook's mount code (nvctk.hook.mount, which
builds on it), so a GPU create does not load that.
"""

from __future__ import annotations

import os

from nvctk import _sys
from nvctk.base.errors import SpecError

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

# resolution used for every path taken from an image
IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
# a single component below a directory fd already held
BENEATH_NOLINKS = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """One lookup (_sys.openat2 looks again when a rename or mount raced it: EAGAIN)."""
    return _sys.openat2(dirfd, path, flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                        resolve)


def components(path: str) -> list[str]:
    return [c for c in path.split("/") if c not in ("", ".")]


def open_in_rootfs(rootfs: str, path: str, flags: int = os.O_PATH) -> int:
    """An fd of `path` inside `rootfs`, resolved as if rootfs were / (never out of it)."""
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise SpecError(f"rootfs {rootfs}: {e.strerror}")
    try:
        return openat2(root, "/".join(components(path)) or ".", flags, IN_ROOT)
    finally:
        os.close(root)


def exists_in_rootfs(rootfs: str, path: str) -> bool:
    """Whether `path` exists inside `rootfs`, never following a link out of it."""
    try:
        os.close(open_in_rootfs(rootfs, path))
        return True
    except OSError:
        return False
