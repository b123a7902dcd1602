"""Reclaiming vGPU state: who made a state dir, the proof that nvctk did, its removal,
and the collection of the dirs of containers that no longer exist.

The layout of a state dir and its creation are nvctk.vgpu.state's. Here:

    owner      at the dir's tmpfs root (OWNER_NAME): the runtime's --root, the
               container id, the creating process (pid + start time)
    marker     <state-dir>/.<key>-<id>.installing: an install's note, written before
               its mkdir (what proves an empty dir of a killed install nvctk's)
    proof      provably_ours: a tmpfs of nvctk's is mounted on the dir, or it is an
               empty dir with a marker whose creator is gone
    removal    remove_state_dir: detach every mount at or below the dir and remove it
               without ever leaving its own file system
    collect    at every vGPU create, in every poststop and by `nvctk vgpu gc`: a dir
               whose creator is gone and whose runtime has no such container

Only ever a directory directly below the configured state dir is removed.
"""

from __future__ import annotations

import errno
import os
import stat

from nvctk.base import mounts
from nvctk.base.errors import NvctkError, SpecError

# typing is not imported at run time: the shim imports this module in every vGPU
# container's create and the hook in its poststop (names are matched by hand)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.base.config import Config

OWNER_NAME = "owner"  # at the tmpfs root: who made the dir (garbage collection)
LOCK_NAME = ".vgpu-state.lock"  # in state-dir: install, removal and collection take it
_MARK = ".installing"  # .<key>-<id>.installing in state-dir: marker_path
DEFAULT_RUNTIME_ROOT = "/run/runc"
# where a runtime started without --root keeps its containers (runc's and crun's)
DEFAULT_RUNTIME_ROOTS = ("/run/runc", "/run/crun")
# a runtime's per-container state file (runc: state.json, crun: status)
RUNTIME_STATE_FILES = ("state.json", "status")
GC_GRACE_S = 300.0  # a dir without readable owner metadata is left alone this long
LOCK_TIMEOUT_S = 10.0
TMPFS_SOURCE = "nvctk-vgpu"  # the source of every state tmpfs: nothing else mounts one
_MAX_OWNER = 8192  # bytes: an owner file is ~150
_MAX_STACKED = 64  # mounts detached from one state dir before giving up

_HEX = frozenset("0123456789abcdef")
_WORD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")  # [A-Za-z0-9_]
ID_CHARS = _WORD | frozenset(".-")  # [A-Za-z0-9_.-]


def _is_key_dir(name: str) -> bool:
    """name matches [0-9a-f]{16}-[A-Za-z0-9_.-]{1,64}"""
    key, dash, cid = name[:16], name[16:17], name[17:]
    return (len(key) == 16 and set(key) <= _HEX and dash == "-" and 1 <= len(cid) <= 64
            and set(cid) <= ID_CHARS)



def under_state_dir(path: str, config: Config) -> bool:
    top = os.path.realpath(config.state_dir)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    return parent == top and _is_key_dir(os.path.basename(path))


class NotOurs(NvctkError):
    """Something at a state dir's path that nvctk cannot prove it made."""


def _our_tmpfs_mounts() -> set[str]:
    """The mount points of nvctk's state tmpfs (fstype tmpfs, source TMPFS_SOURCE):
    only root mounts, and nothing else mounts with that source."""
    return {m.mount_point for m in mounts.read_mountinfo()
            if m.fstype == "tmpfs" and m.source == TMPFS_SOURCE}


def marker_path(path: str) -> str:
    """<state-dir>/.<key>-<id>.installing: an install's note, written before its mkdir
    and removed once the dir's tmpfs and owner are there (what proves an empty dir of
    an install killed in between is nvctk's)."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.installing")


def write_marker(path: str, owner: str) -> None:
    """The marker of the state dir at path, naming owner (owner_text); a new file only."""
    fd = os.open(marker_path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(owner)


def unlink_marker(path: str) -> None:
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
    if not under_state_dir(path, config):
        raise SpecError(f"refusing to remove {path}: not a vGPU state dir under {config.state_dir}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if only_ours and not provably_ours(path, st):
        raise NotOurs(f"vGPU state dir {path}: left in place: not one nvctk made (no tmpfs "
                      f"of nvctk's is mounted on it, and it is not an empty directory of an "
                      "install that was cut short); move it away")
    unlink_marker(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return True
    # a remover killed between the unmount and the rmdir leaves an empty dir: this
    # process's marker (its creator then gone) still proves it nvctk's (provably_ours)
    try:
        write_marker(path, owner_text(None, os.path.basename(path)[17:]))
    except OSError:  # another remover's marker: it proves the same
        pass
    detach_mounts(path)
    try:
        remove_tree(path)
    except FileNotFoundError:  # removed meanwhile (a poststop and a collector): gone is gone
        pass
    unlink_marker(path)
    return True


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str) -> None:
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
                complete = _empty_dir(top, st.st_dev, mounts.mount_id(top))
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
                if os.fstat(sub).st_dev != dev or mounts.mount_id(sub) != mnt:
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
        below = [m.mount_point for m in mounts.read_mountinfo()
                 if mounts.is_under(m.mount_point, real)]
        if not below:
            return n
        # the deepest; of a stack, the last listed (the topmost)
        target = max(reversed(below), key=lambda p: p.count("/"))
        try:
            mounts.umount2(target, mounts.MNT_DETACH | mounts.UMOUNT_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ENOENT:  # gone meanwhile
                continue
            raise NvctkError(f"vGPU state dir {path}: cannot detach the mount on {target}: "
                             f"{e.strerror}")
    raise NvctkError(f"vGPU state dir {path}: more than {_MAX_STACKED} mounts at or below it")


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

    from nvctk.base.fileio import read_regular_file

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
                unlink_marker(p)
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


def collect_quietly(config: Config, keep: str | None = None) -> None:
    """collect() on the way: its failure is not the create's or the poststop's (the
    next one, or `nvctk vgpu gc`, tries again)."""
    try:
        collect(config, keep=keep)
    except (OSError, NvctkError):
        pass
