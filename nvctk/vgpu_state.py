"""A vGPU container's host-side state: its accounting directory and the checks
that decide whether libvgpu can be installed at all.

    <state-dir>/<key16>-<id>/       one per container, recreated on every create; its
                                     own small tmpfs (TMPFS_SIZE), so what the container
                                     writes there never fills the host's /run
        limits                       the validated limits (0444; libvgpu/README.md)
        ld.so.preload                libvgpu's container path + the image's own lines
        cache                        the accounting file (libvgpu maps it)

The key is sha256 of (runtime --root, container id): equal ids under different
runc roots (containerd namespaces use /run/containerd/runc/<ns>) never collide.
The shim creates the directory and mounts the tmpfs on it (`install`);
`nvctk-hook poststop` detaches the tmpfs and removes the directory (`poststop`), and
only ever a directory directly below the configured state dir. The tmpfs is made
private: the hook's clone of it (open_tree, not recursive) is then no peer of it,
so nothing mounted on the clone inside the container comes back to the host.
The prestart hook mounts it at nvctk.vgpu.VGPU_DIR with the limits file bound
read-only on top, the library, and the preload file over /etc/ld.so.preload.
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
    from typing import IO

    from nvctk.config import Config
    from nvctk.plan import VgpuPlan

CONTAINER_LIBRARY = "/run/nvctk/libvgpu.so"  # where libvgpu.so is mounted inside
PRELOAD_NAME = "ld.so.preload"
LIMITS_NAME = "limits"
CACHE_NAME = "cache"
DEFAULT_RUNTIME_ROOT = "/run/runc"
MAX_PRELOAD_BYTES = 64 * 1024

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
    return hashlib.sha256(f"{root}\0{container_id}".encode()).hexdigest()[:16]


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


def remove_state_dir(path: str, config: Config) -> bool:
    """Detach the tmpfs (if mounted) and rm -rf a container's state dir; only a
    <key>-<id> dir directly under state-dir."""
    if not _under_state_dir(path, config):
        raise SpecError(f"refusing to remove {path}: not a vGPU state dir under {config.state_dir}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return True
    detach_mounts(path)
    import shutil  # not at the top: it costs every create 3-9 ms (bz2, lzma, fnmatch)

    shutil.rmtree(path)
    return True


def detach_mounts(path: str) -> int:
    """umount2(MNT_DETACH) whatever is mounted on path (ours, or the stale ones of a
    crashed container, stacked); returns how many. Never follows a link."""
    for n in range(_MAX_STACKED + 1):
        try:
            mount.umount2(path, mount.MNT_DETACH | mount.UMOUNT_NOFOLLOW)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
                return n
            raise NvctkError(f"vGPU state dir {path}: cannot detach its tmpfs: {e.strerror}")
    raise NvctkError(f"vGPU state dir {path}: more than {_MAX_STACKED} mounts stacked on it")


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


def install(vgpu: VgpuPlan, rootfs: str | None, config: Config) -> None:
    """(Re)create the container's state dir, a tmpfs of its own: limits,
    ld.so.preload, an empty cache."""
    d = vgpu.state_dir
    if not _under_state_dir(d, config):
        raise SpecError(f"vGPU state dir {d} is not directly under state-dir {config.state_dir}")
    entries = image_preload(rootfs) if rootfs else []
    # 0700: each container can write (and plant files in) its own dir, and the
    # accounting file is 0666 for the container's users; no host user may reach them
    os.makedirs(os.path.dirname(d), 0o700, exist_ok=True)
    remove_state_dir(d, config)  # a restarted container is a new set of processes
    os.mkdir(d, 0o700)
    try:
        # every file goes onto the bounded tmpfs (its root is 0755, TMPFS_OPTIONS)
        _mount_tmpfs(d)
        write_limits_file(os.path.join(d, LIMITS_NAME), vgpu.limits,
                          os.path.join(vgpu.container_state_dir, CACHE_NAME))
        _write(os.path.join(d, PRELOAD_NAME), preload_text(vgpu.container_library, entries), 0o644)
        # empty: libvgpu sizes and initialises it; 0666 so a non-root process may map it
        _write(os.path.join(d, CACHE_NAME), "", 0o666)
    except BaseException:
        try:
            remove_state_dir(d, config)
        except (OSError, NvctkError):
            pass
        raise


def _write(path: str, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        os.fchmod(f.fileno(), mode)


# --- nvctk-hook poststop -------------------------------------------------------------------
def poststop(stdin_text: str | bytes, config: Config | None = None) -> str | None:
    """Remove the container's vGPU state dir; returns it (None: nothing to do)."""
    from nvctk import config as nvconfig
    from nvctk.oci import load_state

    state = load_state(stdin_text)
    cfg = config or nvconfig.load()
    try:
        with open(os.path.join(state.bundle, PLAN_FILE), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SpecError(f"{state.bundle}/{PLAN_FILE}: {e.strerror}")
    try:
        plan = Plan.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{state.bundle}/{PLAN_FILE}: unusable plan: {e}")
    if plan.vgpu is None:
        return None
    remove_state_dir(plan.vgpu.state_dir, cfg)
    return plan.vgpu.state_dir


def poststop_main(stdin: IO[bytes], stderr: IO[str]) -> int:
    """`nvctk-hook poststop`: exit 0, or 1 with 'nvctk-hook: poststop: <why>'."""
    try:
        poststop(stdin.read())
        return 0
    except NvctkError as e:
        stderr.write(f"nvctk-hook: poststop: {e}\n")
    except OSError as e:
        stderr.write(f"nvctk-hook: poststop: {e.filename or '-'}: {e.strerror or e}\n")
    stderr.flush()
    return 1
