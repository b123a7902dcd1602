"""The kernel's mount primitives and the mount table, below every package that mounts:
thin wrappers of the mount syscalls (nvctk._sys: raise OSError "<syscall>: <strerror>"),
a mount's id, and /proc/<pid>/mountinfo parsed. The hook's fd-based mounts into a rootfs
(nvctk.hook.mount) and the vGPU state dir's tmpfs and its removal (nvctk.vgpu) use them."""

from __future__ import annotations

import errno
import os

from nvctk import _sys
from nvctk.base.fileio import read_path
from nvctk.base.record import Record

CLONE_NEWNS = 0x00020000

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
AT_SYMLINK_NOFOLLOW = 0x100

OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC

MOVE_MOUNT_F_EMPTY_PATH = 0x04
MOVE_MOUNT_T_EMPTY_PATH = 0x40

FSOPEN_CLOEXEC = 1
FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8

MS_BIND = 1 << 12
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MS_REC = 16384

MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8

PROC_SUPER_MAGIC = 0x9FA0
TMPFS_MAGIC = 0x01021994

# --- thin syscall wrappers (raise OSError "<syscall>: <strerror>") -------------

def open_tree(dirfd: int, path: str, flags: int) -> int:
    return _sys.open_tree(dirfd, path, flags)


def move_mount(from_fd: int, to_fd: int) -> None:
    _sys.move_mount(from_fd, "", to_fd, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)


def mount_setattr(fd: int, attr_set: int = 0, attr_clr: int = 0, propagation: int = 0,
                  recursive: bool = False) -> None:
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _sys.mount_setattr(fd, "", flags, attr_set, attr_clr, propagation, 0)


def fsmount_tmpfs(options: dict[str, str], attrs: int) -> int:
    """A detached tmpfs; returns the fd of its root (write into it with *at calls)."""
    fs = _sys.fsopen("tmpfs", FSOPEN_CLOEXEC)
    try:
        for k, v in options.items():
            _sys.fsconfig(fs, FSCONFIG_SET_STRING, k, v, 0)
        _sys.fsconfig(fs, FSCONFIG_CMD_CREATE, None, None, 0)
        return _sys.fsmount(fs, FSMOUNT_CLOEXEC, attrs)
    finally:
        os.close(fs)


def umount2(path: str, flags: int) -> None:
    _sys.umount2(path, flags)


def mount_propagation(path: str, flags: int) -> None:
    _sys.mount(None, path, None, flags, None)


def setns(fd: int, nstype: int) -> None:
    _sys.setns(fd, nstype)


def unshare(flags: int) -> None:
    _sys.unshare(flags)


def fstatfs_type(fd: int) -> int:
    return _sys.fstatfs_type(fd)


def mount_id(fd: int) -> int:
    """The mount id of the mount an fd lies on: statx's (one call; the hook asks ~30
    times a start), or /proc/self/fdinfo's on a kernel before 5.8."""
    got = _sys.mount_id(fd)
    if got >= 0:
        return got
    return mount_id_from_fdinfo(fd)


def mount_id_from_fdinfo(fd: int) -> int:
    """The mount id as /proc/self/fdinfo says (kernels without statx's STATX_MNT_ID)."""
    for line in read_path(f"/proc/self/fdinfo/{fd}").split(b"\n"):
        if line.startswith(b"mnt_id:"):
            return int(line.split()[1])
    raise OSError(errno.ENOENT, "no mnt_id in fdinfo")


def fd_path(fd: int) -> str:
    """What the kernel calls an fd's path (for messages and logs only)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


# --- mountinfo ----------------------------------------------------------------
class MountInfo(Record):
    # field order is the record's order (repr, to_dict): the mountinfo columns' (the
    # ones added later last, so positional construction keeps working)
    __slots__ = ("mount_id", "parent_id", "mount_point", "fstype", "optional",  # noqa: RUF023
                 "dev", "root", "options", "source")

    mount_id: int
    parent_id: int
    mount_point: str
    fstype: str
    optional: tuple[str, ...]  # e.g. ("shared:1", "master:2")
    dev: str  # major:minor of the file system
    root: str  # the directory of the file system mounted here
    options: tuple[str, ...]  # per-mount options, e.g. ("rw", "nosuid")
    source: str  # the file system's source, e.g. a device or a tmpfs's name

    def __init__(self, mount_id: int, parent_id: int, mount_point: str, fstype: str,
                 optional: tuple[str, ...], dev: str = "", root: str = "/",
                 options: tuple[str, ...] = (), source: str = "") -> None:
        # set one by one, not through Record._fill: every hook start builds ~300 of
        # these (the container's table, twice), and _fill's loop was most of the parse
        (self.mount_id, self.parent_id, self.mount_point, self.fstype, self.optional,
         self.dev, self.root, self.options, self.source) = (
            mount_id, parent_id, mount_point, fstype, optional, dev, root, options, source)

    @property
    def shared(self) -> bool:
        return any(o.startswith("shared:") for o in self.optional)

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def unescape(s: str) -> str:
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[MountInfo]:
    result = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 7:
            continue
        sep = parts.index("-", 6)  # after the optional fields: a mount point may be "-"
        source = parts[sep + 2] if len(parts) > sep + 2 else ""
        root, point = parts[3], parts[4]
        if "\\" in line:  # only then may a field hold an octal escape
            root, point, source = unescape(root), unescape(point), unescape(source)
        result.append(MountInfo(int(parts[0]), int(parts[1]), point, parts[sep + 1],
                                tuple(parts[6:sep]), parts[2], root,
                                tuple(parts[5].split(",")), source))
    return result


def read_mountinfo(pid: int | str = "self") -> list[MountInfo]:
    data = read_path(f"/proc/{pid}/mountinfo")
    return parse_mountinfo(data.decode("utf-8", "surrogateescape"))


def is_under(path: str, top: str) -> bool:
    """Whether `path` is `top` or below it (paths as mountinfo gives them)."""
    top = top.rstrip("/")
    return path == top or path.startswith(top + "/") or top == ""
