"""A vGPU container's host-side state directory: its name, its layout, its creation.

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

Nothing the container can write is the backing file of a read-only bind (the container
side: libvgpu/README.md and docs/decisions.md). The key is sha256 of
(runtime --root, container id): equal ids under different runc roots
(containerd namespaces use /run/containerd/runc/<ns>) never collide.

Life cycle. The shim creates the directory and mounts the tmpfs on it (`install`)
and, when the runtime then fails to create the container, removes it again
(`remove_if_owner`). `nvctk-hook poststop` removes its container's directory
(nvctk.hook.poststop). Owner metadata, the proof that a dir is nvctk's, removal and
the collection of what a killed shim or poststop leaves behind are nvctk.vgpu.gc's.
Only ever a directory directly below the configured state dir is removed. The
tmpfs is made private: the hook's clone of it (open_tree, not recursive) is then
no peer of it, so nothing mounted on the clone inside the container comes back.
"""

from __future__ import annotations

import os

from nvctk.base import mounts
from nvctk.base.errors import NvctkError, SpecError
from nvctk.edits import MAX_PRELOAD_BYTES
from nvctk.vgpu import ledger
from nvctk.vgpu.gc import (
    DEFAULT_RUNTIME_ROOT,
    ID_CHARS,
    OWNER_NAME,
    TMPFS_SOURCE,
    NotOurs,
    StateLock,
    collect_quietly,
    detach_mounts,
    owner_text,
    proc_start_time,
    read_owner,
    remove_state_dir,
    remove_tree,
    under_state_dir,
    unlink_marker,
    write_marker,
)
from nvctk.vgpu.ledger import SHM_SIZE
from nvctk.vgpu.limits import write_limits_file

# typing and re are not imported at run time: the shim imports this module in every
# vGPU container's create (names are matched by hand)
TYPE_CHECKING = False
if TYPE_CHECKING:

    from nvctk.base.config import Config
    from nvctk.edits import Vgpu

CONTAINER_LIBRARY = "/run/nvctk/libvgpu.so"  # where libvgpu.so is mounted inside
RO_DIR = "ro"  # the tmpfs's read-only half: mounted at /run/nvctk
RW_DIR = "rw"  # the accounting dir: mounted at /run/nvctk/vgpu
PRELOAD_NAME = "ld.so.preload"
LIMITS_NAME = "limits"
CACHE_NAME = "cache"
LIBRARY_NAME = "libvgpu.so"
VGPU_NAME = "vgpu"

# The per-container tmpfs: the accounting file (libvgpu sizes it to SHM_SIZE), the
# limits and preload files, with headroom; a few inodes (each costs kernel memory).
_MIB = 1 << 20
TMPFS_SIZE = max(_MIB, -(-2 * (SHM_SIZE + MAX_PRELOAD_BYTES) // _MIB) * _MIB)
TMPFS_INODES = 64
# 0755: non-root processes of the container reach the 0666 cache through the bind
# mount; host users cannot, the state dir above is 0700
TMPFS_OPTIONS = {"source": TMPFS_SOURCE, "size": str(TMPFS_SIZE),
                 "nr_inodes": str(TMPFS_INODES), "mode": "0755"}
TMPFS_ATTRS = mounts.MOUNT_ATTR_NOSUID | mounts.MOUNT_ATTR_NODEV | mounts.MOUNT_ATTR_NOEXEC



# --- naming --------------------------------------------------------------------------------
def state_key(runtime_root: str | None, container_id: str) -> str:
    """16 hex digits from (runtime root, container id)."""
    import hashlib  # start time: OpenSSL, only for vGPU state dirs

    root = os.path.normpath(os.path.abspath(runtime_root or DEFAULT_RUNTIME_ROOT))
    # fsencode: runc's --root is any bytes (argv gives them back as surrogate escapes)
    key = os.fsencode(root) + b"\0" + os.fsencode(container_id)
    return hashlib.sha256(key).hexdigest()[:16]


def sanitize_id(container_id: str) -> str:
    """A container id as a file name: [A-Za-z0-9_.-], at most 64 characters."""
    out = "".join(c if c in ID_CHARS else "_" for c in container_id[:64]).lstrip(".")
    return out or "_"


def state_dir_for(config: Config, runtime_root: str | None, container_id: str) -> str:
    name = f"{state_key(runtime_root, container_id)}-{sanitize_id(container_id)}"
    return os.path.join(os.path.abspath(config.state_dir), name)


def preload_text(container_library: str, entries: tuple[str, ...]) -> str:
    """The container's /etc/ld.so.preload: libvgpu first (its cu* symbols win), then the
    image's entries the plan keeps (nvctk.plan.vgpu.kept_preload_entries decides which)."""
    return "\n".join([container_library, *entries]) + "\n"


# --- create / remove (removal and its proofs: nvctk.vgpu.gc) --------------------------------
def _mount_tmpfs(path: str) -> None:
    """Mount the container's own tmpfs on the fresh (empty) dir path, private."""
    try:
        fd = mounts.fsmount_tmpfs(TMPFS_OPTIONS, TMPFS_ATTRS)
    except OSError as e:
        raise NvctkError(f"vGPU state dir {path}: cannot make its tmpfs: {e.strerror}")
    try:
        dest = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mounts.move_mount(fd, dest)
        finally:
            os.close(dest)
        # attached under a shared mount (/run on systemd hosts) it is shared too: private,
        # so that the hook's clone is no peer of it
        mounts.mount_setattr(fd, propagation=mounts.MS_PRIVATE)
    except OSError as e:
        raise NvctkError(f"vGPU state dir {path}: cannot mount its tmpfs: {e.strerror}")
    finally:
        os.close(fd)


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
def install(vgpu: Vgpu, config: Config, *, runtime_root: str | None = None,
            container_id: str | None = None) -> None:
    """(Re)create the container's state dir, a tmpfs of its own (the layout above),
    owned by this process; first reclaim what containers that are gone left. Its files
    say what the form says (limits, preload entries): nothing is read from the image."""
    d = vgpu.state_dir
    if not under_state_dir(d, config):
        raise SpecError(f"vGPU state dir {d} is not directly under state-dir {config.state_dir}")
    # 0700: each container can write (and plant files in) its own dir, and the
    # accounting file is 0666 for the container's users; no host user may reach them
    os.makedirs(os.path.dirname(d), 0o700, exist_ok=True)
    collect_quietly(config, keep=d)
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
        unlink_marker(d)
        write_marker(d, owner)
        try:
            os.mkdir(d, 0o700)
            # every file goes onto the bounded tmpfs (its root is 0755, TMPFS_OPTIONS)
            _mount_tmpfs(d)
            # first: a shim killed from here on leaves a dir the collector can place
            _write(os.path.join(d, OWNER_NAME), owner, 0o600)
            _populate(d, vgpu)
            unlink_marker(d)
        except BaseException:
            try:
                remove_state_dir(d, config, only_ours=False)  # what this install made
            except (OSError, NvctkError):
                pass
            unlink_marker(d)
            raise


def _populate(d: str, vgpu: Vgpu) -> None:
    ro, rw = os.path.join(d, RO_DIR), os.path.join(d, RW_DIR)
    for sub in (ro, rw):
        os.mkdir(sub, 0o755)
        os.chmod(sub, 0o755)  # whatever the umask
    write_limits_file(os.path.join(ro, LIMITS_NAME), vgpu.limits,
                      os.path.join(vgpu.container_state_dir, CACHE_NAME))
    _write(os.path.join(ro, PRELOAD_NAME), preload_text(vgpu.container_library, vgpu.preload_entries),
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


# --- a DRA claim's ledger (nvctk.dra) ---------------------------------------------------------
LEDGERS_DIR = "dra"  # below the state dir: one ledger per share claim, named by its uid


def ledger_dir(state_dir: str, claim_uid: str) -> str:
    """A DRA claim's ledger: <state-dir>/dra/<claim uid> (the uid checked by the caller)."""
    return os.path.join(os.path.abspath(state_dir), LEDGERS_DIR, claim_uid)


def install_ledger(vgpu: Vgpu) -> None:
    """A DRA claim's ledger at vgpu.state_dir (ledger_dir): its own small tmpfs laid out
    as a container's state dir (ro/ and rw/, the layout above; the containers write the
    cache), with the claim's caps in ro/limits and libvgpu alone in ro/ld.so.preload
    (a CDI spec names no image, so no image's own lines). Every container of the claim
    gets it by the claim's CDI spec (nvctk.plan.vgpu.vgpu_mounts): one cap, one ledger
    for all of them, under any runtime. Made anew when it exists (a retried prepare)."""
    path = vgpu.state_dir
    remove_ledger(path)
    os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
    os.mkdir(path, 0o700)
    try:
        _mount_tmpfs(path)
        _populate(path, vgpu)
    except BaseException:
        remove_ledger(path)
        raise


def remove_ledger(path: str) -> None:
    """The ledger's tmpfs detached and its dir removed; gone already is fine."""
    if not os.path.lexists(path):
        return
    detach_mounts(path)
    remove_tree(path)


def read_container_usage(state_dir: str | os.PathLike[str]) -> list[ledger.UsageRecord]:
    """A vGPU container's usage, from its host-side state dir (this module's
    <state-dir>/<key>-<id>): one "device" record per GPU window in use or named
    by the accounting file, then one "process" record per process and window it
    holds memory on. See UsageRecord for which fields can be trusted."""
    limits_file = os.path.join(state_dir, RO_DIR, "limits")
    cache = os.path.join(state_dir, RW_DIR, "cache")
    return ledger.usage_records(cache, limits_file)
