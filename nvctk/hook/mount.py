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

from nvctk.base.errors import MountError
from nvctk.base.fileio import read_path
from nvctk.base.mounts import (
    AT_EMPTY_PATH,
    AT_FDCWD,
    AT_RECURSIVE,
    MNT_DETACH,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MS_SLAVE,
    OPEN_TREE_CLOEXEC,
    OPEN_TREE_CLONE,
    MountInfo,
    fd_path,
    fsmount_tmpfs,
    is_under,
    mount_id,
    mount_setattr,
    move_mount,
    open_tree,
    read_mountinfo,
    umount2,
)
from nvctk.oci.rootfs import (
    IN_ROOT,
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    openat2,
)
from nvctk.oci.rootfs import components as _components

# the syscalls come from the compiled nvctk._sys, not ctypes: start time
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

# a single component below a directory fd we already hold
BENEATH_NOLINKS = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
# a file destination made here: new, empty, never through a link
NEW_FILE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW

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


class NotOnRootfs(OSError):
    """A file would be created on a mount that is not the container's own rootfs."""


# --- resolution inside a rootfs -------------------------------------------------
class Root:
    """An O_PATH fd of a rootfs; every path given to it is container-relative.

    Nothing is created anywhere but on the rootfs's own mounts (`own_mount_ids`):
    a directory of the host bound read-write into the container (a volume,
    extra-mounts, the MPS pipe dir) never gets a file from nvctk, whatever path
    or image symlink leads there. Such a create raises `NotOnRootfs`.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._own: set[int] | None = None  # learnt from mountinfo on the first create
        self._infos: list[MountInfo] = []
        self._pinned: set[int] = set()  # mount ids of the pins made (after the learning)
        self._dirs: dict[tuple[int, int], int] = {}  # (dev, ino) of a parent -> mount id
        # parent directories `ensure` resolved (path -> O_PATH fd): most mounts share a
        # few lib dirs. Valid only while no directory is mounted over (forget_dirs)
        self._dir_fds: dict[str, int] = {}
        self._dir_ok: set[int] = set()  # those of them _may_create passed
        self.pins: list[int] = []  # fds of the roots of the pins made (for `seal_pins`)

    def close(self) -> None:
        self.forget_dirs()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for fd in self.pins:
            os.close(fd)
        self.pins.clear()

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, cpath: str) -> str:
        """The rootfs path of a container path, for messages only."""
        return os.path.join(self.path, cpath.lstrip("/"))

    def learn_mounts(self, infos: list[MountInfo]) -> None:
        """Which mounts are the rootfs's own, from this namespace's mount table."""
        self._infos = infos
        self._own = own_mount_ids(infos, os.path.realpath(self.path), mount_id(self.fd))
        self._dirs.clear()

    def _may_create(self, parent: int, cpath: str) -> None:
        """NotOnRootfs unless directory fd parent lies on one of the rootfs's own mounts."""
        if parent in self._dir_ok:
            return  # a remembered parent that passed (its fd pins its mount)
        st = os.fstat(parent)
        key = (st.st_dev, st.st_ino)
        mid = self._dirs.get(key)
        if mid is None:
            if self._own is None:
                self.learn_mounts(read_mountinfo())
            mid = self._dirs[key] = mount_id(parent)
        assert self._own is not None
        if mid in self._own or mid in self._pinned:
            if parent in self._dir_fds.values():
                self._dir_ok.add(parent)
            return
        info = next((i for i in self._infos if i.mount_id == mid), None)
        where = f"{info.mount_point} ({info.fstype})" if info else fd_path(parent)
        raise NotOnRootfs(errno.EXDEV, f"not created: its directory is on {where}, a mount "
                          "that is not the container's own rootfs (a host directory bound "
                          "into it); nvctk creates files only in the rootfs", cpath)

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
                    fd = self._step(parent, name, prefix)
                except FileNotFoundError:
                    self._may_create(parent, "/" + prefix)
                    try:
                        os.mkdir(name, mode, dir_fd=parent)
                    except FileExistsError:
                        pass  # raced, or a dangling symlink: the re-open below decides
                    try:
                        fd = self._step(parent, name, prefix)
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

    def _step(self, parent: int, name: str, prefix: str) -> int:
        """O_PATH fd of directory `prefix` (= parent's `name`) resolved as from the rootfs:
        a plain directory in one step from its parent; a link (or anything else) by
        the whole prefix, links followed inside the rootfs (each whole-prefix lookup
        is ~8 us, a walk of n components made them n^2/2)."""
        try:
            return openat2(parent, name, os.O_PATH | os.O_DIRECTORY, BENEATH_NOLINKS)
        except FileNotFoundError:
            raise
        except OSError:
            return openat2(self.fd, prefix, os.O_PATH | os.O_DIRECTORY, IN_ROOT)

    def _parent(self, cpath: str) -> tuple[int, str]:
        comps = _components(cpath)
        if not comps:
            raise OSError(errno.EINVAL, "the rootfs itself", cpath)
        return self.mkdirs("/".join(comps[:-1])), comps[-1]

    def _cached_parent(self, cpath: str) -> tuple[int, str]:
        """_parent, remembered until forget_dirs: the caller must not close the fd."""
        comps = _components(cpath)
        if not comps:
            raise OSError(errno.EINVAL, "the rootfs itself", cpath)
        key = "/".join(comps[:-1])
        fd = self._dir_fds.get(key)
        if fd is None:
            fd = self._dir_fds[key] = self.mkdirs(key)
        return fd, comps[-1]

    def forget_dirs(self) -> None:
        """Drop the parent directories `ensure` remembered: a mount over a directory
        (or a link replaced) may change what a path resolves to."""
        for fd in self._dir_fds.values():
            os.close(fd)
        self._dir_fds.clear()
        self._dir_ok.clear()

    def ensure(self, cpath: str, kind: str, mode: int = 0o644) -> int:
        """An fd of a mount destination of `kind` (file|dir), created if missing.

        An existing path is used where it resolves (inside the rootfs); a
        dangling final symlink is replaced by an empty file. The parent directory is
        remembered for the next call: forget_dirs() after mounting over a directory.
        """
        want_dir = kind == "dir"
        if not want_dir:
            fd = self._new_file(cpath, mode)
            if fd >= 0:
                return fd
        try:
            fd = self.open(cpath)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            _check_kind(fd, want_dir, cpath)
            return fd
        parent, name = self._cached_parent(cpath)
        return self._create(parent, name, want_dir, mode, cpath)

    def _new_file(self, cpath: str, mode: int) -> int:
        """The usual file destination, nothing there yet, in one lookup from its
        remembered parent (a whole-path lookup is ~9 us a mount); -1 where anything is
        at that name (a file, a link) or the parent is not the rootfs's own: `ensure`'s
        whole-path resolution then decides, as for any existing path."""
        parent, name = self._cached_parent(cpath)
        try:
            self._may_create(parent, cpath)
            return openat2(parent, name, NEW_FILE, BENEATH_NOLINKS, mode)
        except (NotOnRootfs, FileExistsError):
            return -1

    def ensure_exact(self, cpath: str, kind: str, mode: int = 0o644) -> int:
        """`ensure` without a symlink anywhere on the path: a mount that must stay where
        its users look for it (vGPU's) sits at exactly cpath, never at a place a link
        the container can replace leads to. The image's own final link is replaced; a
        link on the way is refused; the parent directory must exist."""
        comps = _components(cpath)
        if not comps:
            raise OSError(errno.EINVAL, "the rootfs itself", cpath)
        try:
            parent = openat2(self.fd, "/".join(comps[:-1]) or ".", os.O_PATH | os.O_DIRECTORY,
                             IN_ROOT | RESOLVE_NO_SYMLINKS)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "a symbolic link in the image on the way to it",
                              cpath)
            raise
        name = comps[-1]
        want_dir = kind == "dir"
        try:
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                self._may_create(parent, cpath)
                os.unlink(name, dir_fd=parent)
                st = None
            if st is None:
                return self._create(parent, name, want_dir, mode, cpath)
            fd = openat2(parent, name, os.O_PATH, BENEATH_NOLINKS)
            _check_kind(fd, want_dir, cpath)
            return fd
        finally:
            os.close(parent)

    def _create(self, parent: int, name: str, want_dir: bool, mode: int, cpath: str) -> int:
        """Create name (a dir, or an empty file) in parent; an fd of it (a dir's O_PATH,
        a file's the O_WRONLY one that created it)."""
        self._may_create(parent, cpath)
        if want_dir:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                self._drop_dangling(parent, name)
                os.mkdir(name, 0o755, dir_fd=parent)
            return openat2(parent, name, os.O_PATH | os.O_DIRECTORY, BENEATH_NOLINKS)
        # the new empty file's own fd (nothing is written through it): a mount target
        # as good as an O_PATH one, without a second lookup
        try:
            return openat2(parent, name, NEW_FILE, BENEATH_NOLINKS, mode)
        except FileExistsError:
            self._drop_dangling(parent, name)
            return openat2(parent, name, NEW_FILE, BENEATH_NOLINKS, mode)

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
                self._may_create(parent, cpath)
                os.unlink(name, dir_fd=parent)
            else:
                self._may_create(parent, cpath)
            os.symlink(target, name, dir_fd=parent)
            return True
        finally:
            os.close(parent)

    def pin(self, name: str, mounter: Mounter) -> bool:
        """Recursively self-bind the top-level directory /name of the rootfs, unless it
        is a mount point already: rename(2) of a mount point fails (EBUSY), so what
        the hook mounts below it cannot be moved away with it. True if pinned.

        A symlink there is refused (the pin would land where it points, and the
        container could replace the link); a missing directory is created.
        """
        cpath = "/" + name
        self.forget_dirs()  # paths below it resolve into the pin from now on
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            self._may_create(self.fd, cpath)
            os.mkdir(name, 0o755, dir_fd=self.fd)
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "a symbolic link in the image; a GPU-limited container "
                          "needs a real directory there (the limits are mounted in it)", cpath)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory in the image", cpath)
        fd = openat2(self.fd, name, os.O_PATH | os.O_DIRECTORY, BENEATH_NOLINKS)
        try:
            if mount_id(fd) != mount_id(self.fd):
                return False
            tree = open_tree(fd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE
                             | AT_EMPTY_PATH)
            try:
                mounter.attach(tree, fd, cpath)
                self._pinned.add(mount_id(tree))
                self.pins.append(os.dup(tree))
            finally:
                os.close(tree)
        finally:
            os.close(fd)
        return True

    def seal_pins(self) -> None:
        """Make the pins read-only (a read-only rootfs: the runtime remounts only / so)."""
        for fd in self.pins:
            mount_setattr(fd, attr_set=MOUNT_ATTR_RDONLY)


def _check_kind(fd: int, want_dir: bool, cpath: str) -> None:
    """Closes fd and raises unless it is a directory exactly when want_dir."""
    is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
    if is_dir != want_dir:
        os.close(fd)
        raise OSError(errno.EISDIR if is_dir else errno.ENOTDIR,
                      "exists as a " + ("directory" if is_dir else "non-directory"), cpath)


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
