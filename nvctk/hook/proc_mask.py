"""The container's /proc/driver/nvidia: a detached read-only tmpfs holding the driver's
params (ModifyDeviceFiles forced to 0), version, registry and the allowed GPUs' entries,
filled through its fd (never through a path in the container)."""

from __future__ import annotations

import os

from nvctk.base.fileio import read_path
from nvctk.base.mounts import (
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    fsmount_tmpfs,
    mount_setattr,
)
from nvctk.oci.rootfs import BENEATH_NOLINKS, openat2


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
