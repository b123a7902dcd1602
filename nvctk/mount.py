"""Namespaces, secure path resolution inside a rootfs, and fd-based mounts.

Everything here works on file descriptors so that no path string taken from a
container image is ever re-resolved by the kernel outside our control
(REFERENCE §10, CVE-2024-0132/0134):

- `Root` wraps an O_PATH fd of the rootfs; every lookup is ``openat2(root_fd,
  path, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)``, so absolute symlinks, ``..``
  chains and ``/proc/self/root`` tricks in the image resolve inside the rootfs
  (container semantics) or fail; directories are created component by
  component with ``mkdirat`` on the parent fd, files with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` on the parent fd, symlinks with ``symlinkat`` on the parent fd.
- Mounts use the new mount API: a source is cloned with
  ``open_tree(OPEN_TREE_CLONE)`` (in the host namespace, before ``setns``), its
  flags are set on the still-detached tree with ``mount_setattr`` and it is
  attached with ``move_mount(..., MOVE_MOUNT_T_EMPTY_PATH)`` onto the fd of the
  resolved destination. A tmpfs is made with ``fsopen``/``fsmount``, filled
  through its fd while detached, then made read-only and attached the same way.
- `Mounter` remembers every mount it attached (as the fd of the mount's root)
  and `Mounter.undo` detaches them in reverse order.

Errors are `MountError("step <name>: <path>: <strerror>")`.
"""

from __future__ import annotations

import errno
import os
import stat

from nvctk import ffi
from nvctk.errors import MountError, SpecError
from nvctk.record import Record

# typing is for the type checker only, and nvctk.ffi stands in for ctypes (less
# than half its import cost): this module is on every GPU container's start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

# --- syscall numbers (x86-64 and the generic table agree for these) ---------
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_FSOPEN = 430
SYS_FSCONFIG = 431
SYS_FSMOUNT = 432
SYS_OPENAT2 = 437
SYS_MOUNT_SETATTR = 442

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

MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MS_REC = 16384

MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

PROC_SUPER_MAGIC = 0x9FA0
TMPFS_MAGIC = 0x01021994

# resolution used for every path taken from an image
IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
# a single component below a directory fd we already hold
BENEATH_NOLINKS = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS

_syscall = ffi.libc_function("syscall", ffi.c_long)
_umount2 = ffi.libc_function("umount2")
_mount = ffi.libc_function("mount")
_setns = ffi.libc_function("setns")
_unshare = ffi.libc_function("unshare")
_fstatfs = ffi.libc_function("fstatfs")
c_int, c_uint, c_char_p, c_size_t = ffi.c_int, ffi.c_uint, ffi.c_char_p, ffi.c_size_t


class _OpenHow(ffi.Structure):
    _fields_ = [("flags", ffi.c_uint64), ("mode", ffi.c_uint64), ("resolve", ffi.c_uint64)]


class _MountAttr(ffi.Structure):
    _fields_ = [
        ("attr_set", ffi.c_uint64),
        ("attr_clr", ffi.c_uint64),
        ("propagation", ffi.c_uint64),
        ("userns_fd", ffi.c_uint64),
    ]


class _Statfs(ffi.Structure):
    _fields_ = [("f_type", ffi.c_long), ("_rest", ffi.c_char * 112)]


_OPEN_HOW_SIZE = ffi.sizeof(_OpenHow)
_MOUNT_ATTR_SIZE = ffi.sizeof(_MountAttr)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ffi.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def _b(path: str) -> bytes:
    return os.fsencode(path)


# --- thin syscall wrappers (raise OSError) -----------------------------------
def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
    return _check(
        _syscall(SYS_OPENAT2, c_int(dirfd), c_char_p(_b(path)), ffi.byref(how),
                 c_size_t(_OPEN_HOW_SIZE)),
        "openat2",
    )


def open_tree(dirfd: int, path: str, flags: int) -> int:
    return _check(
        _syscall(SYS_OPEN_TREE, c_int(dirfd), c_char_p(_b(path)), c_uint(flags)),
        "open_tree",
    )


def move_mount(from_fd: int, to_fd: int) -> None:
    _check(
        _syscall(SYS_MOVE_MOUNT, c_int(from_fd), c_char_p(b""), c_int(to_fd), c_char_p(b""),
                 c_uint(MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)),
        "move_mount",
    )


def mount_setattr(fd: int, attr_set: int = 0, attr_clr: int = 0, propagation: int = 0,
                  recursive: bool = False) -> None:
    attr = _MountAttr(attr_set, attr_clr, propagation, 0)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(
        _syscall(SYS_MOUNT_SETATTR, c_int(fd), c_char_p(b""), c_uint(flags), ffi.byref(attr),
                 c_size_t(_MOUNT_ATTR_SIZE)),
        "mount_setattr",
    )


def fsmount_tmpfs(options: dict[str, str], attrs: int) -> int:
    """A detached tmpfs; returns the fd of its root (write into it with *at calls)."""
    fs = _check(_syscall(SYS_FSOPEN, c_char_p(b"tmpfs"), c_uint(FSOPEN_CLOEXEC)), "fsopen")
    try:
        for k, v in options.items():
            _check(
                _syscall(SYS_FSCONFIG, c_int(fs), c_uint(FSCONFIG_SET_STRING), c_char_p(_b(k)),
                         c_char_p(_b(v)), c_int(0)),
                "fsconfig",
            )
        _check(
            _syscall(SYS_FSCONFIG, c_int(fs), c_uint(FSCONFIG_CMD_CREATE), None, None, c_int(0)),
            "fsconfig create",
        )
        return _check(
            _syscall(SYS_FSMOUNT, c_int(fs), c_uint(FSMOUNT_CLOEXEC), c_uint(attrs)),
            "fsmount",
        )
    finally:
        os.close(fs)


def umount2(path: str, flags: int) -> None:
    _check(_umount2(c_char_p(_b(path)), c_int(flags)), "umount2")


def mount_propagation(path: str, flags: int) -> None:
    _check(_mount(None, c_char_p(_b(path)), None, ffi.c_ulong(flags), None), "mount")


def setns(fd: int, nstype: int) -> None:
    _check(_setns(c_int(fd), c_int(nstype)), "setns")


def unshare(flags: int) -> None:
    _check(_unshare(c_int(flags)), "unshare")


def fstatfs_type(fd: int) -> int:
    buf = _Statfs()
    _check(_fstatfs(c_int(fd), ffi.byref(buf)), "fstatfs")
    return int(buf.f_type)


def read_bytes(path: str) -> bytes:
    """A whole file through os.open/os.read: no buffered or text layer, and no codec
    lookup (which could import an encodings module after the hook's setns)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_fd(fd)
    finally:
        os.close(fd)


def read_fd(fd: int) -> bytes:
    """Everything left to read from fd (a file or a pipe, up to EOF)."""
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def mount_id(fd: int) -> int:
    """The mount id of the mount an fd lies on (from /proc/self/fdinfo)."""
    for line in read_bytes(f"/proc/self/fdinfo/{fd}").split(b"\n"):
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
    # field order is the record's order (repr, to_dict): the mountinfo columns'
    __slots__ = ("mount_id", "parent_id", "mount_point", "fstype", "optional")  # noqa: RUF023

    mount_id: int
    parent_id: int
    mount_point: str
    fstype: str
    optional: tuple[str, ...]  # e.g. ("shared:1", "master:2")

    def __init__(self, mount_id: int, parent_id: int, mount_point: str, fstype: str,
                 optional: tuple[str, ...]) -> None:
        self.mount_id = mount_id
        self.parent_id = parent_id
        self.mount_point = mount_point
        self.fstype = fstype
        self.optional = optional

    @property
    def shared(self) -> bool:
        return any(o.startswith("shared:") for o in self.optional)


def _unescape(s: str) -> str:
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
        sep = parts.index("-")
        result.append(
            MountInfo(int(parts[0]), int(parts[1]), _unescape(parts[4]), parts[sep + 1],
                      tuple(parts[6:sep]))
        )
    return result


def read_mountinfo(pid: int | str = "self") -> list[MountInfo]:
    data = read_bytes(f"/proc/{pid}/mountinfo")
    return parse_mountinfo(data.decode("utf-8", "surrogateescape"))


def _under(path: str, top: str) -> bool:
    top = top.rstrip("/")
    return path == top or path.startswith(top + "/") or top == ""


# --- resolution inside a rootfs -------------------------------------------------
def _components(path: str) -> list[str]:
    return [c for c in path.split("/") if c not in ("", ".")]


class Root:
    """An O_PATH fd of a rootfs; every path given to it is container-relative."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, cpath: str) -> str:
        """The rootfs path of a container path, for messages only."""
        return os.path.join(self.path, cpath.lstrip("/"))

    def open(self, cpath: str, flags: int = os.O_PATH) -> int:
        """Resolve cpath inside the rootfs (symlinks followed, never out of it)."""
        rel = "/".join(_components(cpath)) or "."
        return openat2(self.fd, rel, flags, IN_ROOT)

    def mkdirs(self, cpath: str, mode: int = 0o755) -> int:
        """O_PATH fd of directory cpath, creating missing components inside the rootfs."""
        comps = _components(cpath)
        if comps:
            # the directory usually exists (a lib dir, /usr/bin): one lookup, resolved
            # exactly as the walk below would; anything else takes the walk
            try:
                return openat2(self.fd, "/".join(comps), os.O_PATH | os.O_DIRECTORY, IN_ROOT)
            except OSError:
                pass
        parent = os.dup(self.fd)
        try:
            for i, name in enumerate(comps):
                prefix = "/".join(comps[: i + 1])
                try:
                    fd = openat2(self.fd, prefix, os.O_PATH | os.O_DIRECTORY, IN_ROOT)
                except FileNotFoundError:
                    try:
                        os.mkdir(name, mode, dir_fd=parent)
                    except FileExistsError:
                        pass  # raced, or a dangling symlink: the re-open below decides
                    try:
                        fd = openat2(self.fd, prefix, os.O_PATH | os.O_DIRECTORY, IN_ROOT)
                    except FileNotFoundError:
                        raise OSError(errno.ENOENT, f"/{prefix} is a dangling symlink in the "
                                      "image (nothing it names exists inside the rootfs)",
                                      "/" + prefix)
                os.close(parent)
                parent = fd
            return parent
        except BaseException:
            os.close(parent)
            raise

    def _parent(self, cpath: str) -> tuple[int, str]:
        comps = _components(cpath)
        if not comps:
            raise OSError(errno.EINVAL, "the rootfs itself", cpath)
        return self.mkdirs("/".join(comps[:-1])), comps[-1]

    def ensure(self, cpath: str, kind: str, mode: int = 0o644) -> int:
        """O_PATH fd of a mount destination of `kind` (file|dir), created if missing.

        An existing path is used where it resolves (inside the rootfs); a
        dangling final symlink is replaced by an empty file.
        """
        want_dir = kind == "dir"
        try:
            fd = self.open(cpath)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            if is_dir != want_dir:
                os.close(fd)
                raise OSError(errno.EISDIR if is_dir else errno.ENOTDIR,
                              "exists as a " + ("directory" if is_dir else "non-directory"),
                              cpath)
            return fd
        parent, name = self._parent(cpath)
        try:
            if want_dir:
                try:
                    os.mkdir(name, 0o755, dir_fd=parent)
                except FileExistsError:
                    self._drop_dangling(parent, name)
                    os.mkdir(name, 0o755, dir_fd=parent)
                return openat2(parent, name, os.O_PATH | os.O_DIRECTORY, BENEATH_NOLINKS)
            flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
            try:
                new = openat2(parent, name, flags, BENEATH_NOLINKS, mode)
            except FileExistsError:
                self._drop_dangling(parent, name)
                new = openat2(parent, name, flags, BENEATH_NOLINKS, mode)
            os.close(new)
            return openat2(parent, name, os.O_PATH | os.O_NOFOLLOW, BENEATH_NOLINKS)
        finally:
            os.close(parent)

    @staticmethod
    def _drop_dangling(parent: int, name: str) -> None:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            raise OSError(errno.EEXIST, "exists", name)
        os.unlink(name, dir_fd=parent)

    def symlink(self, cpath: str, target: str) -> bool:
        """Create link cpath -> target inside the rootfs; False if a non-link is there."""
        parent, name = self._parent(cpath)
        try:
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None:
                if not stat.S_ISLNK(st.st_mode):
                    return False
                if os.readlink(name, dir_fd=parent) == target:
                    return True
                os.unlink(name, dir_fd=parent)
            os.symlink(target, name, dir_fd=parent)
            return True
        finally:
            os.close(parent)

    def mount_info(self) -> MountInfo | None:
        """The mount the rootfs lies on, from this namespace's mountinfo."""
        mid = mount_id(self.fd)
        for m in read_mountinfo():
            if m.mount_id == mid:
                return m
        return None


def open_in_rootfs(rootfs: str, path: str, flags: int = os.O_PATH) -> int:
    """An fd of `path` inside `rootfs`, resolved as if rootfs were / (never out of it)."""
    try:
        root = Root(rootfs)
    except OSError as e:
        raise SpecError(f"rootfs {rootfs}: {e.strerror}")
    with root:
        return root.open(path, flags)


def exists_in_rootfs(rootfs: str, path: str) -> bool:
    """Whether `path` exists inside `rootfs`, never following a link out of it."""
    try:
        os.close(open_in_rootfs(rootfs, path))
        return True
    except OSError:
        return False


# --- mounts ---------------------------------------------------------------------

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
                write_file(dst_dirfd, e.name, read_bytes(e.path))


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
            params = read_bytes(os.path.join(host_dir, "params")).decode("utf-8",
                                                                          "surrogateescape")
        except FileNotFoundError:
            params = ""
        write_file(fd, "params", params_without_modify(params).encode("utf-8", "surrogateescape"))
        for name in ("version", "registry"):
            try:
                data = read_bytes(os.path.join(host_dir, name))
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


def iter_mounts_under(infos: list[MountInfo], top: str) -> Iterator[MountInfo]:
    for m in infos:
        if _under(m.mount_point, top):
            yield m


def ensure_not_shared(root: Root) -> bool:
    """Keep mounts under the rootfs from propagating to the host namespace.

    If the mount holding the rootfs, or any mount below it, is shared, the
    mount holding the rootfs is made a recursive slave (what runc does by
    default): it still receives the host's mount events but sends none.
    Returns True when something was changed. Call inside the container ns.
    """
    infos = read_mountinfo()
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
