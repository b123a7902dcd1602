"""Secure path resolution and creation inside a rootfs (`Root`), and the hook's mount
code by name (the mounts themselves: nvctk.hook.mounting).

Everything here works on file descriptors so that no path string taken from a
container image is ever re-resolved by the kernel outside our control
(REFERENCE §10, CVE-2024-0132/0134):

- `Root` wraps an O_PATH fd of the rootfs; every lookup is ``openat2(root_fd,
  path, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)``, so absolute symlinks, ``..``
  chains and ``/proc/self/root`` tricks in the image resolve inside the rootfs
  (container semantics) or fail; directories are created component by
  component with ``mkdirat`` on the parent fd, files with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` on the parent fd, symlinks with ``symlinkat`` on the parent fd.
- Mounts use the new mount API (nvctk.hook.mounting): a source is cloned with
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

from nvctk.base.mounts import (
    AT_EMPTY_PATH,
    AT_RECURSIVE,
    MOUNT_ATTR_RDONLY,
    OPEN_TREE_CLOEXEC,
    OPEN_TREE_CLONE,
    MountInfo,
    fd_path,
    mount_id,
    mount_setattr,
    open_tree,
    read_mountinfo,
)
from nvctk.hook.mounting import (
    Mounter,
    attrs_for,
    clone_source,
    ensure_not_shared,
    make_proc_mask,
    own_mount_ids,
    params_without_modify,
    readonly_foreign,
    step_error,
)
from nvctk.oci.rootfs import (
    BENEATH_NOLINKS,
    IN_ROOT,
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    openat2,
)
from nvctk.oci.rootfs import components as _components

# the hook's callers name these as mount.<name> (one import for the mount code)
__all__ = [
    "BENEATH_NOLINKS", "IN_ROOT", "NEW_FILE", "RESOLVE_BENEATH", "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS", "Mounter", "NotOnRootfs", "Root", "attrs_for", "clone_source",
    "ensure_not_shared", "make_proc_mask", "openat2", "own_mount_ids",
    "params_without_modify", "readonly_foreign", "step_error",
]

# the syscalls come from the compiled nvctk._sys, not ctypes: start time

# a file destination made here: new, empty, never through a link
NEW_FILE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW


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

