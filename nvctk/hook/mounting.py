"""The hook's mounts, on file descriptors (the paths they land on: nvctk.hook.mount.Root).

- A source is cloned with ``open_tree(OPEN_TREE_CLONE)`` (in the host namespace,
  before ``setns``), its flags set on the still-detached tree with ``mount_setattr``
  (`clone_source`), and attached with ``move_mount(..., MOVE_MOUNT_T_EMPTY_PATH)`` onto
  the fd of the resolved destination; `Mounter` remembers every mount it attached (as
  the fd of the mount's root) and `Mounter.undo` detaches them in reverse order.
- The container's /proc/driver/nvidia (`make_proc_mask`): a tmpfs made with
  ``fsopen``/``fsmount``, filled through its fd while detached (the driver's params with
  ModifyDeviceFiles forced to 0, version, registry, the allowed GPUs' entries), then
  made read-only and attached the same way.
- Which mounts under the rootfs are the container's own (`own_mount_ids`: where nvctk
  and the container's ldconfig may create files); the host's directories bound in made
  read-only for ldconfig's private namespace (`readonly_foreign`); the hook's mounts
  kept from propagating to the host (`ensure_not_shared`).

Errors are `MountError("step <name>: <path>: <strerror>")` (`step_error`).
"""

from __future__ import annotations

import errno
import os

from nvctk.base.errors import MountError
from nvctk.base.fileio import read_path
from nvctk.base.mounts import (
    AT_FDCWD,
    MNT_DETACH,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MS_SLAVE,
    OPEN_TREE_CLOEXEC,
    OPEN_TREE_CLONE,
    MountInfo,
    fsmount_tmpfs,
    is_under,
    mount_id,
    mount_setattr,
    move_mount,
    open_tree,
    read_mountinfo,
    umount2,
)
from nvctk.oci.rootfs import BENEATH_NOLINKS, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

    from nvctk.hook.mount import Root


# --- attaching ---------------------------------------------------------------------


def attrs_for(read_only: bool, noexec: bool) -> int:
    a = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
    if read_only:
        a |= MOUNT_ATTR_RDONLY
    if noexec:
        a |= MOUNT_ATTR_NOEXEC
    return a


def clone_source(host_path: str, attrs: int) -> int:
    """A detached bind-mount of host_path with attrs set; call in the host namespace."""
    fd = open_tree(AT_FDCWD, host_path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    try:
        mount_setattr(fd, attr_set=attrs)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Mounter:
    """Attaches detached mounts onto resolved destinations and can undo them."""

    def __init__(self) -> None:
        self.attached: list[tuple[int, str]] = []  # (fd of the mount's root, label)

    def attach(self, tree_fd: int, dest_fd: int, label: str) -> None:
        move_mount(tree_fd, dest_fd)
        # tree_fd now names the root of the attached mount: keep it for undo
        self.attached.append((os.dup(tree_fd), label))

    def undo(self) -> list[str]:
        """Detach every mount made, newest first; returns the errors (as text)."""
        errors = []
        while self.attached:
            fd, label = self.attached.pop()
            try:
                umount2(f"/proc/self/fd/{fd}", MNT_DETACH)
            except OSError as e:
                errors.append(f"{label}: {e.strerror}")
            finally:
                os.close(fd)
        return errors

    def forget(self) -> None:
        for fd, _ in self.attached:
            os.close(fd)
        self.attached.clear()


def step_error(step: str, path: str, e: OSError | str) -> MountError:
    why = e if isinstance(e, str) else (e.strerror or str(e))
    return MountError(f"step {step}: {path}: {why}")


# --- the /proc/driver/nvidia mask ----------------------------------------------------


def _copy_tree(src: str, dst_dirfd: int, depth: int = 0) -> None:
    """Copy regular files and dirs (never links) from a host dir into dst_dirfd."""
    if depth > 8:
        return
    with os.scandir(src) as it:
        for e in it:
            if e.is_symlink():
                continue
            if e.is_dir(follow_symlinks=False):
                os.mkdir(e.name, 0o555, dir_fd=dst_dirfd)
                sub = openat2(dst_dirfd, e.name, os.O_PATH | os.O_DIRECTORY, BENEATH_NOLINKS)
                try:
                    _copy_tree(e.path, sub, depth + 1)
                finally:
                    os.close(sub)
            elif e.is_file(follow_symlinks=False):
                write_file(dst_dirfd, e.name, read_path(e.path))


def write_file(dirfd: int, name: str, data: bytes, mode: int = 0o444) -> None:
    fd = openat2(dirfd, name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW,
                 BENEATH_NOLINKS, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def params_without_modify(text: str) -> str:
    """The driver's params with ModifyDeviceFiles forced to 0 (added if absent)."""
    lines, seen = [], False
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() == "ModifyDeviceFiles":
            line, seen = "ModifyDeviceFiles: 0", True
        lines.append(line)
    if not seen:
        lines.append("ModifyDeviceFiles: 0")
    return "\n".join(lines) + "\n"


def make_proc_mask(host_dir: str, gpu_bus_ids: tuple[str, ...]) -> int:
    """A detached read-only tmpfs with the allowed /proc/driver/nvidia entries."""
    fd = fsmount_tmpfs({"mode": "0555", "size": "1m"}, 0)
    try:
        try:
            params = read_path(os.path.join(host_dir, "params")).decode("utf-8",
                                                                          "surrogateescape")
        except FileNotFoundError:
            params = ""
        write_file(fd, "params", params_without_modify(params).encode("utf-8", "surrogateescape"))
        for name in ("version", "registry"):
            try:
                data = read_path(os.path.join(host_dir, name))
            except FileNotFoundError:
                continue
            write_file(fd, name, data)
        if gpu_bus_ids:
            os.mkdir("gpus", 0o555, dir_fd=fd)
            gpus = openat2(fd, "gpus", os.O_PATH | os.O_DIRECTORY, BENEATH_NOLINKS)
            try:
                for bus in gpu_bus_ids:
                    src = os.path.join(host_dir, "gpus", bus)
                    if "/" in bus or bus in (".", "..") or not os.path.isdir(src):
                        continue
                    os.mkdir(bus, 0o555, dir_fd=gpus)
                    sub = openat2(gpus, bus, os.O_PATH | os.O_DIRECTORY, BENEATH_NOLINKS)
                    try:
                        _copy_tree(src, sub)
                    finally:
                        os.close(sub)
            finally:
                os.close(gpus)
        mount_setattr(fd, attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
                      | MOUNT_ATTR_NOEXEC)
    except BaseException:
        os.close(fd)
        raise
    return fd


# --- the container's own mounts, the others kept in check -----------------------------


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
