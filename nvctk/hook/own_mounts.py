"""Which mounts under a rootfs are the container's own, and keeping the others in check.

`own_mount_ids` says where nvctk (and the container's ldconfig) may create files;
`readonly_foreign` makes the host's directories bound into the rootfs read-only for
ldconfig's private namespace; `ensure_not_shared` keeps the hook's mounts from
propagating to the host. All read one mount table (nvctk.base.mounts.read_mountinfo).
"""

from __future__ import annotations

import errno
import os

from nvctk.base.mounts import (
    AT_FDCWD,
    MOUNT_ATTR_RDONLY,
    MS_SLAVE,
    MountInfo,
    is_under,
    mount_id,
    mount_setattr,
    read_mountinfo,
)
from nvctk.oci.rootfs import RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

    from nvctk.hook.mount import Root


def own_mount_ids(infos: list[MountInfo], top: str, holder_id: int) -> set[int]:
    """The mounts at or below the rootfs `top` (a real path) that hold the container's
    own files: what nvctk and its ldconfig may create files on.

    - holder_id: the mount the rootfs lies on;
    - a bind of a directory of the rootfs onto its own place (the hook's pins of
      /etc and /run, a runtime's self-binds): same file system, and its root is
      the holder's directory at that place;
    - a file system mounted nowhere outside the rootfs (the runtime's own /dev
      tmpfs, podman's /run tmpfs, the rootfs's overlay under runc's bind of it).
    Anything else (a host directory bound in: a volume, extra-mounts, the MPS
    pipe dir, /dev/shm of Docker) is the host's: nothing is created there.
    """
    holder = next((i for i in infos if i.mount_id == holder_id), None)
    own = {holder_id}
    if holder is None:
        return own
    outside = {i.dev for i in infos if not is_under(i.mount_point, top)}
    hp = holder.mount_point.rstrip("/")
    for i in infos:
        if i.mount_id == holder_id or not is_under(i.mount_point, top):
            continue
        if i.dev not in outside:
            own.add(i.mount_id)
        elif i.dev == holder.dev and is_under(i.mount_point, hp):
            rel = i.mount_point[len(hp):].lstrip("/")
            if i.root == os.path.normpath(os.path.join(holder.root, rel)):
                own.add(i.mount_id)
    return own


def readonly_foreign(infos: list[MountInfo], top: str, holder_id: int) -> list[str]:
    """In a private mount namespace about to chroot into the rootfs `top`: make every
    writable mount below it that is not the rootfs's own read-only, and the rootfs's
    own pins as writable as the rootfs. Returns the mount points made read-only.

    A mount hidden under another one (or gone) is left alone: no path reaches it.
    """
    own = own_mount_ids(infos, top, holder_id)
    holder = next((i for i in infos if i.mount_id == holder_id), None)
    done = []
    for i in infos:
        if i.mount_id == holder_id or i.mount_point == top or not is_under(i.mount_point, top):
            continue
        foreign = i.mount_id not in own
        if foreign and i.read_only:
            continue
        unseal = (not foreign and holder is not None and i.read_only
                  and not holder.read_only and i.dev == holder.dev)
        if not foreign and not unseal:
            continue
        try:
            fd = openat2(AT_FDCWD, i.mount_point, os.O_PATH | os.O_NOFOLLOW,
                         RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        except FileNotFoundError:
            continue  # detached with the procfs above it, or its point was deleted
        try:
            if mount_id(fd) != i.mount_id:
                continue  # hidden under a later mount
            if foreign:
                mount_setattr(fd, attr_set=MOUNT_ATTR_RDONLY)
                done.append(i.mount_point)
            else:
                try:
                    mount_setattr(fd, attr_clr=MOUNT_ATTR_RDONLY)
                except OSError:
                    pass  # locked (a container in a user ns): ldconfig then fails EROFS there
        finally:
            os.close(fd)
    return done


def iter_mounts_under(infos: list[MountInfo], top: str) -> Iterator[MountInfo]:
    for m in infos:
        if is_under(m.mount_point, top):
            yield m


def ensure_not_shared(root: Root) -> bool:
    """Keep mounts under the rootfs from propagating to the host namespace.

    If the mount holding the rootfs, or any mount below it, is shared, the
    mount holding the rootfs is made a recursive slave (what runc does by
    default): it still receives the host's mount events but sends none.
    Returns True when something was changed. Call inside the container ns.
    """
    infos = read_mountinfo()
    root.learn_mounts(infos)  # the same table says where the hook may create files
    holder_id = mount_id(root.fd)
    holder = next((m for m in infos if m.mount_id == holder_id), None)
    if holder is None:
        raise OSError(errno.ENOENT, "rootfs mount not in mountinfo", root.path)
    rp = os.path.realpath(root.path)
    relevant = [holder, *iter_mounts_under(infos, rp)]
    if not any(m.shared for m in relevant):
        return False
    fd = os.open(holder.mount_point, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if mount_id(fd) != holder_id:
            raise OSError(errno.EBUSY, "rootfs mount moved", holder.mount_point)
        mount_setattr(fd, propagation=MS_SLAVE, recursive=True)
    finally:
        os.close(fd)
    return True
