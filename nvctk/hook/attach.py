"""Fd-based mounts: a source cloned detached with its flags set (`clone_source`),
attached onto a resolved destination's fd and undone newest first (`Mounter`).
Errors are `MountError("step <name>: <path>: <strerror>")` (`step_error`)."""

from __future__ import annotations

import os

from nvctk.base.errors import MountError
from nvctk.base.mounts import (
    AT_FDCWD,
    MNT_DETACH,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    OPEN_TREE_CLOEXEC,
    OPEN_TREE_CLONE,
    mount_setattr,
    move_mount,
    open_tree,
    umount2,
)


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
