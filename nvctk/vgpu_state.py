"""A vGPU container's host-side state: its accounting directory, the checks that
decide whether libvgpu can be installed at all, and reclaiming the state of
containers that no longer exist.

    <state-dir>/<key16>-<id>/       0700, one per container, recreated on every create;
                                     its own small tmpfs (TMPFS_SIZE), so what the
                                     container writes there never fills the host's /run
        owner                        who made it (OWNER_NAME; never seen in the container)
        ro/          0755            mounted read-only at /run/nvctk in the container
            limits         0444      the validated limits (libvgpu/README.md)
            ld.so.preload  0444      libvgpu's container path + the image's own lines
            libvgpu.so     0444      empty: the mount point for the host's libvgpu.so
            vgpu/          0755      empty: the mount point for rw/
        rw/          0755            mounted read-write (noexec) at /run/nvctk/vgpu
            cache          0666      the accounting file, preallocated to SHM_SIZE
            limits         0444      empty: the mount point for ro/limits

Nothing the container can write is the backing file of a read-only bind
(/work/brief/vgpu_layout.md has the container side). The key is sha256 of
(runtime --root, container id): equal ids under different runc roots
(containerd namespaces use /run/containerd/runc/<ns>) never collide.

Life cycle. The shim creates the directory and mounts the tmpfs on it (`install`)
and, when the runtime then fails to create the container, removes it again
(`remove_if_owner`). `nvctk-hook poststop` removes its container's directory
(`poststop`). What a killed shim or a killed poststop leaves behind is reclaimed
by `collect`, run at every vGPU create, in every poststop and by `nvctk vgpu gc`:
a directory whose creator process is gone and whose runtime has no such container.
Only ever a directory directly below the configured state dir is removed. The
tmpfs is made private: the hook's clone of it (open_tree, not recursive) is then
no peer of it, so nothing mounted on the clone inside the container comes back.
"""

from __future__ import annotations

import errno
import os
import stat

from nvctk import mount
from nvctk.errors import NvctkError, RequestError, SpecError
from nvctk.plan import PLAN_FILE, Plan
from nvctk.vgpu import SHM_SIZE, write_limits_file

# typing and re are not imported at run time: the shim imports this module in every
# vGPU container's create and the hook in its poststop (names are matched by hand)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any

    from nvctk.config import Config
    from nvctk.plan import VgpuPlan

CONTAINER_LIBRARY = "/run/nvctk/libvgpu.so"  # where libvgpu.so is mounted inside
RO_DIR = "ro"  # the tmpfs's read-only half: mounted at /run/nvctk
RW_DIR = "rw"  # the accounting dir: mounted at /run/nvctk/vgpu
PRELOAD_NAME = "ld.so.preload"
LIMITS_NAME = "limits"
CACHE_NAME = "cache"
LIBRARY_NAME = "libvgpu.so"
VGPU_NAME = "vgpu"
OWNER_NAME = "owner"  # at the tmpfs root: who made the dir (garbage collection)
LOCK_NAME = ".vgpu-state.lock"  # in state-dir: install, removal and collection take it
_MARK = ".installing"  # .<key>-<id>.installing in state-dir: marker_path
DEFAULT_RUNTIME_ROOT = "/run/runc"
# where a runtime started without --root keeps its containers (runc's and crun's)
DEFAULT_RUNTIME_ROOTS = ("/run/runc", "/run/crun")
# a runtime's per-container state file (runc: state.json, crun: status)
RUNTIME_STATE_FILES = ("state.json", "status")
MAX_PRELOAD_BYTES = 64 * 1024
GC_GRACE_S = 300.0  # a dir without readable owner metadata is left alone this long
LOCK_TIMEOUT_S = 10.0

# The per-container tmpfs: the accounting file (libvgpu sizes it to SHM_SIZE), the
# limits and preload files, with headroom; a few inodes (each costs kernel memory).
_MIB = 1 << 20
TMPFS_SIZE = max(_MIB, -(-2 * (SHM_SIZE + MAX_PRELOAD_BYTES) // _MIB) * _MIB)
TMPFS_INODES = 64
# 0755: non-root processes of the container reach the 0666 cache through the bind
# mount; host users cannot, the state dir above is 0700
TMPFS_OPTIONS = {"source": "nvctk-vgpu", "size": str(TMPFS_SIZE),
                 "nr_inodes": str(TMPFS_INODES), "mode": "0755"}
TMPFS_ATTRS = mount.MOUNT_ATTR_NOSUID | mount.MOUNT_ATTR_NODEV | mount.MOUNT_ATTR_NOEXEC
_MAX_OWNER = 8192  # bytes: an owner file is ~150
_MAX_STACKED = 64  # mounts detached from one state dir before giving up

GLIBC_LOADERS = ("/lib64/ld-linux-x86-64.so.2",)  # plus /lib/ld-linux-*.so*

_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdef")
_WORD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")  # [A-Za-z0-9_]
_ID_CHARS = _WORD | frozenset(".-")  # [A-Za-z0-9_.-]


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


def _is_key_dir(name: str) -> bool:
    """name matches [0-9a-f]{16}-[A-Za-z0-9_.-]{1,64}"""
    key, dash, cid = name[:16], name[16:17], name[17:]
    return (len(key) == 16 and set(key) <= _HEX and dash == "-" and 1 <= len(cid) <= 64
            and set(cid) <= _ID_CHARS)


# --- naming --------------------------------------------------------------------------------
def state_key(runtime_root: str | None, container_id: str) -> str:
    """16 hex digits from (runtime root, container id)."""
    import hashlib  # not at the top: loading OpenSSL costs every create 3-5 ms

    root = os.path.normpath(os.path.abspath(runtime_root or DEFAULT_RUNTIME_ROOT))
    # fsencode: runc's --root is any bytes (argv gives them back as surrogate escapes)
    key = os.fsencode(root) + b"\0" + os.fsencode(container_id)
    return hashlib.sha256(key).hexdigest()[:16]


def sanitize_id(container_id: str) -> str:
    """A container id as a file name: [A-Za-z0-9_.-], at most 64 characters."""
    out = "".join(c if c in _ID_CHARS else "_" for c in container_id[:64]).lstrip(".")
    return out or "_"


def state_dir_for(config: Config, runtime_root: str | None, container_id: str) -> str:
    name = f"{state_key(runtime_root, container_id)}-{sanitize_id(container_id)}"
    return os.path.join(os.path.abspath(config.state_dir), name)


# --- looking into the image (never following a link out of the rootfs) --------------------
def _list_in_rootfs(rootfs: str, path: str) -> list[str]:
    try:
        fd = mount.open_in_rootfs(rootfs, path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def libc_kind(rootfs: str) -> str:
    """'musl' if the image has musl's loader, 'glibc' if it has glibc's, else 'none'."""
    lib = _list_in_rootfs(rootfs, "/lib")
    if any(_is_musl_loader(n) for n in lib):
        return "musl"
    loaders = [*GLIBC_LOADERS, *(f"/lib/{n}" for n in lib if _is_glibc_loader(n))]
    if any(mount.exists_in_rootfs(rootfs, p) for p in loaders):
        return "glibc"
    return "none"


def check_preloadable(rootfs: str, variable: str) -> None:
    """RequestError unless the image's loader honours /etc/ld.so.preload (glibc)."""
    kind = libc_kind(rootfs)
    if kind == "glibc":
        return
    why = ("the image uses musl (/lib/ld-musl-*.so.1), which ignores /etc/ld.so.preload"
           if kind == "musl" else
           "the image has no glibc dynamic loader (/lib64/ld-linux-x86-64.so.2 or "
           "/lib/ld-linux-*.so*), so nothing would load /etc/ld.so.preload")
    raise RequestError(
        f"{variable} is set but GPU limits cannot be enforced in this container: {why}; "
        "libvgpu.so needs a glibc-based image (unset the limit or use a glibc image)"
    )


def image_preload(rootfs: str) -> list[str]:
    """The entries of the image's own /etc/ld.so.preload ([] if it has none)."""
    # O_PATH first: opening the image's file for reading before knowing what it is
    # would block on a FIFO (the create hangs) or open a device node the image
    # ships (its major/minor are the host's drivers).
    try:
        pfd = mount.open_in_rootfs(rootfs, "/etc/ld.so.preload", os.O_PATH)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return []
        raise SpecError(f"{rootfs}: /etc/ld.so.preload: {e.strerror}")
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise SpecError(f"{rootfs}: /etc/ld.so.preload is not a regular file")
        try:
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as e:
            raise SpecError(f"{rootfs}: /etc/ld.so.preload: {e.strerror}")
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
        raise SpecError(f"{rootfs}: /etc/ld.so.preload is larger than {MAX_PRELOAD_BYTES} bytes")
    # as ld.so reads it: names separated by white space or ':', '#' starts a comment
    text = "\n".join(line.partition("#")[0] for line in data.decode("utf-8", "replace").split("\n"))
    return text.replace(":", " ").split()


def preload_text(container_library: str, image_entries: list[str]) -> str:
    """libvgpu first (its cu* symbols win), then the image's own entries."""
    rest = [e for e in image_entries if e != container_library]
    return "\n".join([container_library, *dict.fromkeys(rest)]) + "\n"


# --- create / remove -----------------------------------------------------------------------
def _under_state_dir(path: str, config: Config) -> bool:
    top = os.path.realpath(config.state_dir)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    return parent == top and _is_key_dir(os.path.basename(path))


class NotOurs(NvctkError):
    """Something at a state dir's path that nvctk cannot prove it made."""


def _our_tmpfs_mounts() -> set[str]:
    """The mount points of nvctk's state tmpfs (fstype tmpfs, source TMPFS_OPTIONS'):
    only root mounts, and nothing else mounts with that source."""
    from nvctk.mount import _unescape, read_bytes

    out = set()
    for line in read_bytes("/proc/self/mountinfo").decode("utf-8", "surrogateescape").splitlines():
        left, sep, right = line.partition(" - ")
        fields, sb = left.split(), right.split()
        if sep and len(fields) >= 5 and len(sb) >= 2 and sb[0] == "tmpfs" \
                and sb[1] == TMPFS_OPTIONS["source"]:
            out.add(_unescape(fields[4]))
    return out


def marker_path(path: str) -> str:
    """<state-dir>/.<key>-<id>.installing: an install's note, written before its mkdir
    and removed once the dir's tmpfs and owner are there (what proves an empty dir of
    an install killed in between is nvctk's)."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.installing")


def _unlink_marker(path: str) -> None:
    try:
        os.unlink(marker_path(path))
    except FileNotFoundError:
        pass


def _marker_owner(path: str) -> dict[str, Any] | None:
    return read_owner(os.path.dirname(marker_path(path)), os.path.basename(marker_path(path)))


def provably_ours(path: str, st: os.stat_result | None = None,
                  ours: set[str] | None = None) -> bool:
    """Whether nvctk made what is at the state dir path: a tmpfs of nvctk's is mounted on
    it; or it is an empty directory, no mount point, with an install's marker
    (marker_path) whose creator is gone. (Also a non-directory: a state dir's path holds
    nothing else of anyone's.) An operator's directory that merely looks like one, with
    or without an owner file, is none of these."""
    try:
        st = st or os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    real = os.path.realpath(path)
    if real in (_our_tmpfs_mounts() if ours is None else ours):
        return True
    owner = _marker_owner(path)
    if owner is None or creator_alive(owner):
        return False
    try:
        parent = os.lstat(os.path.dirname(real))
        return parent.st_dev == st.st_dev and os.listdir(path) == []
    except OSError:
        return False


def remove_state_dir(path: str, config: Config, *, only_ours: bool = True) -> bool:
    """Detach every mount at or below a container's state dir (its tmpfs, stale ones,
    anything bound below it) and remove the dir without ever leaving its own file
    system; only a <key>-<id> dir directly under state-dir, and (only_ours) only one
    nvctk provably made (provably_ours): anything else there is NotOurs, left as it
    is. Raises NvctkError, leaving the dir, when a mount cannot be detached or
    something else is mounted in it."""
    if not _under_state_dir(path, config):
        raise SpecError(f"refusing to remove {path}: not a vGPU state dir under {config.state_dir}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if only_ours and not provably_ours(path, st):
        raise NotOurs(f"vGPU state dir {path}: left in place: not one nvctk made (no tmpfs "
                      f"of nvctk's is mounted on it, and it is not an empty directory of an "
                      "install that was cut short); move it away")
    _unlink_marker(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return True
    # a remover killed between the unmount and the rmdir leaves an empty dir: this
    # process's marker (its creator then gone) still proves it nvctk's (provably_ours)
    try:
        _write(marker_path(path), owner_text(None, os.path.basename(path)[17:]), 0o600)
    except OSError:  # another remover's marker: it proves the same
        pass
    detach_mounts(path)
    try:
        _remove_tree(path)
    except FileNotFoundError:  # removed meanwhile (a poststop and a collector): gone is gone
        pass
    _unlink_marker(path)
    return True


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _remove_tree(path: str) -> None:
    """rm -rf path by dir fds, never following a link and never entering a directory
    of another file system or mount (a bind mount made after detach_mounts looked):
    shutil.rmtree would delete the host files such a mount shows."""
    parent = os.open(os.path.dirname(os.path.abspath(path)), _DIR_FLAGS)
    try:
        name = os.path.basename(path)
        top = os.open(name, _DIR_FLAGS, dir_fd=parent)
        try:
            st = os.fstat(top)
            try:
                complete = _empty_dir(top, st.st_dev, mount.mount_id(top))
            except RecursionError:
                complete = False
        finally:
            os.close(top)
        if not complete:
            raise NvctkError(f"vGPU state dir {path}: left in place: it holds another "
                             "file system or files that cannot be removed")
        os.rmdir(name, dir_fd=parent)
    finally:
        os.close(parent)


def _empty_dir(fd: int, dev: int, mnt: int) -> bool:
    """Remove what the directory fd holds on file system dev, mount mnt; whether all of it."""
    complete = True
    with os.scandir(fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        try:
            if not is_dir:
                os.unlink(name, dir_fd=fd)
                continue
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                if os.fstat(sub).st_dev != dev or mount.mount_id(sub) != mnt:
                    complete = False  # a mount point: never into it
                    continue
                if not _empty_dir(sub, dev, mnt):
                    complete = False
                    continue
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError:
            complete = False
    return complete


def detach_mounts(path: str) -> int:
    """umount2(MNT_DETACH) every mount whose mount point is at or below path (ours, the
    stale ones of a crashed container, stacked, and anything bound into it), deepest and
    topmost first; returns how many. Never follows a link."""
    real = os.path.realpath(path)
    for n in range(_MAX_STACKED + 1):
        below = [m.mount_point for m in mount.read_mountinfo()
                 if mount._under(m.mount_point, real)]
        if not below:
            return n
        # the deepest; of a stack, the last listed (the topmost)
        target = max(reversed(below), key=lambda p: p.count("/"))
        try:
            mount.umount2(target, mount.MNT_DETACH | mount.UMOUNT_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ENOENT:  # gone meanwhile
                continue
            raise NvctkError(f"vGPU state dir {path}: cannot detach the mount on {target}: "
                             f"{e.strerror}")
    raise NvctkError(f"vGPU state dir {path}: more than {_MAX_STACKED} mounts at or below it")


def _mount_tmpfs(path: str) -> None:
    """Mount the container's own tmpfs on the fresh (empty) dir path, private."""
    try:
        fd = mount.fsmount_tmpfs(TMPFS_OPTIONS, TMPFS_ATTRS)
    except OSError as e:
        raise NvctkError(f"vGPU state dir {path}: cannot make its tmpfs: {e.strerror}")
    try:
        dest = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mount.move_mount(fd, dest)
        finally:
            os.close(dest)
        # attached under a shared mount (/run on systemd hosts) it is shared too: private,
        # so that the hook's clone is no peer of it
        mount.mount_setattr(fd, propagation=mount.MS_PRIVATE)
    except OSError as e:
        raise NvctkError(f"vGPU state dir {path}: cannot mount its tmpfs: {e.strerror}")
    finally:
        os.close(fd)


class StateLock:
    """flock on <state-dir>/LOCK_NAME: a collector's "is it stale?" and its removal
    are one step for an install of the same dir (docker restarts a crashed
    container under its old id), and two removals never race."""

    def __init__(self, config: Config, timeout: float = LOCK_TIMEOUT_S) -> None:
        self.path = os.path.join(os.path.abspath(config.state_dir), LOCK_NAME)
        self.timeout = timeout
        self.fd = -1

    def __enter__(self) -> StateLock:
        import fcntl
        import time

        os.makedirs(os.path.dirname(self.path), 0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise NvctkError(f"{self.path}: held by another process for more than "
                                     f"{self.timeout:g} s")
                time.sleep(0.005)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing the only descriptor releases the lock
        self.fd = -1


# --- owner metadata ------------------------------------------------------------------------
def proc_start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot; /proc/<pid>/stat field 22),
    None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def owner_text(runtime_root: str | None, container_id: str, pid: int | None = None) -> str:
    """The owner file: the runtime's --root (null: its default), the id, the creating
    process (pid + start time: a reused pid is not it) and the time of creation."""
    import json
    import time

    pid = os.getpid() if pid is None else pid
    return json.dumps({"runtime_root": runtime_root, "id": container_id, "pid": pid,
                       "start": proc_start_time(pid), "created": time.time()}) + "\n"


def read_owner(path: str, name: str = OWNER_NAME) -> dict[str, Any] | None:
    """A state dir's owner metadata (or an install's marker's: path its dir, name the
    marker's); None if missing or unusable."""
    import json

    from nvctk.fileio import read_regular_file

    try:  # larger than _MAX_OWNER, a link, a FIFO...: not one nvctk wrote
        data = read_regular_file(os.path.join(path, name), _MAX_OWNER, nofollow=True)
    except OSError:
        return None
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: [[[[... (a deep nesting)
        return None
    root = d.get("runtime_root") if isinstance(d, dict) else 0
    pid = d.get("pid") if isinstance(d, dict) else None
    if not (isinstance(d, dict) and isinstance(d.get("id"), str) and d["id"]
            and type(pid) is int and (root is None or isinstance(root, str))):
        return None
    return d


def creator_alive(owner: dict[str, Any]) -> bool:
    start = proc_start_time(owner["pid"]) if owner["pid"] > 0 else None
    return start is not None and start == owner.get("start")


def runtime_has(runtime_root: str | None, container_id: str) -> bool:
    """Whether the runtime still has the container (its state file exists). runc
    removes its container dir before it runs the poststop hooks; a runc killed
    during create can leave the dir without state.json: no container either."""
    if container_id in ("", ".", "..") or "/" in container_id:
        return False
    roots = (runtime_root,) if runtime_root else DEFAULT_RUNTIME_ROOTS
    return any(os.path.lexists(os.path.join(r, container_id, f))
               for r in roots for f in RUNTIME_STATE_FILES)


def _is_stale(path: str, grace: float = GC_GRACE_S) -> bool:
    """A state dir nobody will remove: its creator is gone and its runtime has no such
    container; or it has no readable owner and holds nothing else (an install killed
    before its owner file was whole) or is older than `grace` (a dir of an nvctk that
    wrote none). Exact only under StateLock, which every install holds from its mkdir
    to its owner file."""
    owner = read_owner(path)
    if owner is None:
        import time

        try:
            # nothing, or only an owner file cut short: an install killed before its
            # owner was whole (under StateLock no live install is half-way there)
            if os.listdir(path) in ([], [OWNER_NAME]):
                return True
            age = time.time() - os.lstat(path).st_mtime
        except OSError:
            return False
        return age > grace
    return not creator_alive(owner) and not runtime_has(owner["runtime_root"], owner["id"])


def collect(config: Config, keep: str | None = None, grace: float = GC_GRACE_S,
            errors: list[str] | None = None) -> list[str]:
    """Remove the state dirs of containers that no longer exist (`is_stale`); returns
    them. One listdir of state-dir when there are none; never fails for one dir (why
    one was left goes to `errors`)."""
    top = os.path.abspath(config.state_dir)
    try:
        listed = os.listdir(top)
    except OSError:
        return []
    names = [n for n in listed if _is_key_dir(n)]
    # an install's marker without its dir: one killed before its mkdir
    markers = [os.path.join(top, n[1:-len(_MARK)]) for n in listed
               if n.startswith(".") and n.endswith(_MARK) and _is_key_dir(n[1:-len(_MARK)])
               and n[1:-len(_MARK)] not in names]
    # first without the lock (the common case: nothing stale, no lock taken) ...
    stale = [p for p in (os.path.join(top, n) for n in names)
             if p != keep and _is_stale(p, grace)]
    if not stale and not markers:
        return []
    removed = []
    with StateLock(config):
        for p in markers:
            owner = _marker_owner(p)
            if not os.path.lexists(p) and owner is not None and not creator_alive(owner):
                _unlink_marker(p)
        ours = _our_tmpfs_mounts() if stale else set()
        for p in stale:
            try:
                # ... then exactly: no install is half-way now, and one may have made
                # the dir anew meanwhile; and only what nvctk provably made
                if not _is_stale(p, grace):
                    continue
                if not provably_ours(p, ours=ours):
                    raise NotOurs(f"{p}: not one nvctk made (no tmpfs of nvctk's on it); "
                                  "nvctk removes only its own state dirs")
                if remove_state_dir(p, config, only_ours=False):
                    removed.append(p)
            except (OSError, NvctkError) as e:
                if errors is not None:
                    errors.append(str(e))
    return removed


def _collect_quietly(config: Config, keep: str | None = None) -> None:
    """collect() on the way: its failure is not the create's or the poststop's (the
    next one, or `nvctk vgpu gc`, tries again)."""
    try:
        collect(config, keep=keep)
    except (OSError, NvctkError):
        pass


def remove_if_owner(path: str, config: Config, pid: int | None = None) -> bool:
    """Remove a state dir this process (or pid) made, unless another create of the same
    container has made it anew since (a failed create's clean-up)."""
    pid = os.getpid() if pid is None else pid
    with StateLock(config):
        owner = read_owner(path)
        if owner is None or owner["pid"] != pid or owner.get("start") != proc_start_time(pid):
            return False
        return remove_state_dir(path, config)


# --- install --------------------------------------------------------------------------------
def install(vgpu: VgpuPlan, rootfs: str | None, config: Config, *,
            runtime_root: str | None = None, container_id: str | None = None) -> None:
    """(Re)create the container's state dir, a tmpfs of its own (the layout above),
    owned by this process; first reclaim what containers that are gone left."""
    d = vgpu.state_dir
    if not _under_state_dir(d, config):
        raise SpecError(f"vGPU state dir {d} is not directly under state-dir {config.state_dir}")
    entries = image_preload(rootfs) if rootfs else []
    # 0700: each container can write (and plant files in) its own dir, and the
    # accounting file is 0666 for the container's users; no host user may reach them
    os.makedirs(os.path.dirname(d), 0o700, exist_ok=True)
    _collect_quietly(config, keep=d)
    cid = container_id or os.path.basename(d)[17:]
    with StateLock(config):
        try:
            remove_state_dir(d, config)  # a restarted container is a new set of processes
        except NotOurs:
            # an empty dir at this container's own path (a state-dir that outlived a
            # reboot keeps the mount points) holds nothing: it is taken over; anything
            # else is someone's, and the create fails naming it
            try:
                os.rmdir(d)
            except OSError:
                raise NotOurs(f"vGPU state dir {d}: something that is not nvctk's is in "
                              "the way (not a tmpfs of nvctk's, not empty); move it away")
        owner = owner_text(runtime_root, cid)
        # before the mkdir: an install killed before its tmpfs is mounted leaves an
        # empty dir that this note proves nvctk's (provably_ours)
        _unlink_marker(d)
        _write(marker_path(d), owner, 0o600)
        try:
            os.mkdir(d, 0o700)
            # every file goes onto the bounded tmpfs (its root is 0755, TMPFS_OPTIONS)
            _mount_tmpfs(d)
            # first: a shim killed from here on leaves a dir the collector can place
            _write(os.path.join(d, OWNER_NAME), owner, 0o600)
            _populate(d, vgpu, entries)
            _unlink_marker(d)
        except BaseException:
            try:
                remove_state_dir(d, config, only_ours=False)  # what this install made
            except (OSError, NvctkError):
                pass
            _unlink_marker(d)
            raise


def _populate(d: str, vgpu: VgpuPlan, image_entries: list[str]) -> None:
    ro, rw = os.path.join(d, RO_DIR), os.path.join(d, RW_DIR)
    for sub in (ro, rw):
        os.mkdir(sub, 0o755)
        os.chmod(sub, 0o755)  # whatever the umask
    write_limits_file(os.path.join(ro, LIMITS_NAME), vgpu.limits,
                      os.path.join(vgpu.container_state_dir, CACHE_NAME))
    _write(os.path.join(ro, PRELOAD_NAME), preload_text(vgpu.container_library, image_entries),
           0o444)
    _write(os.path.join(ro, LIBRARY_NAME), "", 0o444)  # mount points
    os.mkdir(os.path.join(ro, VGPU_NAME), 0o755)
    os.chmod(os.path.join(ro, VGPU_NAME), 0o755)
    _write(os.path.join(rw, LIMITS_NAME), "", 0o444)
    # 0666 so a non-root process may map it; every page allocated now, so a full
    # tmpfs can never turn libvgpu's first touch of a page into SIGBUS
    _write(os.path.join(rw, CACHE_NAME), "", 0o666, size=SHM_SIZE)


def _write(path: str, text: str, mode: int, size: int = 0) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        if size:
            os.posix_fallocate(f.fileno(), 0, size)
        os.fchmod(f.fileno(), mode)


# --- nvctk-hook poststop -------------------------------------------------------------------
def poststop(stdin_text: str | bytes, config: Config | None = None,
             runtime_root: str | None = None) -> str | None:
    """Remove the container's vGPU state dir, then collect; returns the dir (None:
    nothing to do). runtime_root (the hook's --runtime-root) with the state's id
    names the dir: the bundle's plan may be another container's by now (two
    containers created from one bundle); the plan only when it is absent (a spec
    written by an nvctk that passed no root)."""
    from nvctk import config as nvconfig
    from nvctk.oci import load_state

    state = load_state(stdin_text)
    cfg = config or nvconfig.load()
    if runtime_root is not None:
        d: str | None = state_dir_for(cfg, runtime_root, state.id)
    else:
        d = _plan_state_dir(state.bundle)
    if d is not None:
        with StateLock(cfg):
            # the container's own path, where its create mounted nvctk's tmpfs: whatever
            # is there now goes (never followed), as gc removes only what it can prove
            remove_state_dir(d, cfg, only_ours=False)
    _collect_quietly(cfg)
    return d


def _plan_state_dir(bundle: str) -> str | None:
    try:
        with open(os.path.join(bundle, PLAN_FILE), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SpecError(f"{bundle}/{PLAN_FILE}: {e.strerror}")
    try:
        plan = Plan.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{bundle}/{PLAN_FILE}: unusable plan: {e}")
    return None if plan.vgpu is None else plan.vgpu.state_dir


POSTSTOP_USAGE = "usage: nvctk-hook poststop [--runtime-root DIR]  (OCI state JSON on stdin)"


def poststop_main(stdin: IO[bytes], stderr: IO[str], argv: list[str] | None = None) -> int:
    """`nvctk-hook poststop [--runtime-root DIR]`: exit 0, or 1 with
    'nvctk-hook: poststop: <why>' (2: bad usage)."""
    args = list(argv or [])
    root = None
    if args[:1] == ["--runtime-root"] and len(args) == 2 and args[1]:
        root = args[1]
    elif args:
        stderr.write(f"nvctk-hook: poststop: unexpected arguments {args!r}\n{POSTSTOP_USAGE}\n")
        stderr.flush()
        return 2
    try:
        poststop(stdin.read(), runtime_root=root)
        return 0
    except NvctkError as e:
        stderr.write(f"nvctk-hook: poststop: {e}\n")
    except OSError as e:
        stderr.write(f"nvctk-hook: poststop: {e.filename or '-'}: {e.strerror or e}\n")
    stderr.flush()
    return 1
