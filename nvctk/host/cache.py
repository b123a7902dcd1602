"""What the host's GPUs are, from a validated cache, so that a GPU create rarely asks NVML.

A GPU create needs only static facts: the driver and CUDA versions and, per GPU,
index, UUID, name, minor, PCI bus id, memory, compute capability, brand and MIG
state. Asking NVML for them costs every create the pynvml import (~45 ms on a
2-core VM) and nvmlInit (10s-100s of ms on real hardware). NVIDIA's CDI mode
describes the devices once; we do the same with a cache that each create checks.

The cache: `<state_dir>/host-inventory.json`, {"version": 1, "stamp": STAMP,
"host": HostInfo.to_dict()}. It is used only when its STAMP equals the one
computed now (`host_stamp`), which reads a few small files of the driver root
and never NVML. The stamp covers what changes when NVML's answer can change:

- the driver root itself: another root is another driver;
- proc/driver/nvidia/version: the loaded kernel module (a driver upgrade, reload);
- proc/driver/nvidia/gpus/*/information: the GPUs the module drives, with their
  UUID, minor and bus location (a GPU added, removed, swapped or unbound);
- the nvidia* names in dev with their st_rdev: NVML enumerates only GPUs whose
  node exists (the simulated NVML too), so a node removed or renumbered matters;
- the recursive listing of proc/driver/nvidia/capabilities: MIG GI/CI dirs
  appear and vanish there as instances are created and destroyed;
- (st_ino, st_size, st_mtime_ns) of etc/ld.so.cache: installing a driver reruns
  ldconfig, which writes a new file (a new inode), so a new user-space NVML is seen
  even before the module is reloaded;
- the host's boot id: nothing survives a reboot (the cache lives in /run anyway).

Missing files contribute a marker (None), not an error: their absence is a fact
too, and a broken driver root is for NVML to report, with its message.

MIG layouts can change with no cheap file signal (a GI destroyed and re-created
with the same ids and another profile leaves the same capability dirs), so a
cached host with any MIG-enabled GPU is never served: such hosts ask NVML at
every create, as before, and the cache saves only the non-MIG case. A GPU whose
MIG mode is enabled while no instance exists yet shows no file signal either;
`load_host(..., fresh=True)` (or deleting the file) refreshes after such a change.

Robustness: the file is written atomically (a temp file in the same dir, fsync,
rename) with mode 0600, in a state dir created 0700. Failing to write it is
ignored, so a read-only /run costs only the speed-up. A file that cannot be read,
is not ours (not a regular file owned by our euid with no group/other bits), is
not valid JSON, has another version or a malformed host is ignored and rewritten.
When NVML fails (DriverError), nothing is cached and the error propagates.

This module is on every GPU create's path: it imports only os and small nvctk
modules (no pynvml, ctypes, dataclasses, typing, re, json, ...); nvctk.host.nvml (and
with it pynvml) is imported only on a miss.
"""

from __future__ import annotations

import os

from nvctk.base import jsonio, stamped
from nvctk.host.inventory import HostInfo

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CACHE_FILE = "host-inventory.json"
CACHE_VERSION = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"

# --- the stamp ------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    """A small file's bytes as latin-1 text (exact and JSON-able); None when unreadable."""
    from nvctk.base.fileio import read_regular_file  # os and sys only

    try:
        # never a blocking open: a FIFO put at a driver file must not hang a GPU create
        return read_regular_file(path, 1 << 20).decode("latin-1")
    except OSError:
        return None


def _listing(top: str, rel: str = "") -> list[str]:
    """Sorted relative names under top, recursively; dirs end with '/'."""
    try:
        with os.scandir(os.path.join(top, rel) if rel else top) as it:
            entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)
    except OSError:
        return []
    out: list[str] = []
    for name, is_dir in entries:
        path = f"{rel}{name}"
        if is_dir:
            out.append(path + "/")
            out.extend(_listing(top, path + "/"))
        else:
            out.append(path)
    return out


def host_stamp(driver_root: str) -> list[Any]:
    """What the cache is valid for (see the module doc); cheap, never NVML. A plain
    JSON-able list (lists, strings, ints, None), compared for equality.

    For a driver root other than / (a driver container's files) the real driver still
    reads the host's own /proc and /dev, so those are stamped too."""
    root = os.path.abspath(driver_root)
    host = _root_stamp("/") if root != "/" else None
    return [root, _root_stamp(root), host, _read(BOOT_ID)]


def _root_stamp(root: str) -> list[Any]:
    proc = os.path.join(root, "proc/driver/nvidia")

    gpus_dir = os.path.join(proc, "gpus")
    try:
        buses: list[Any] = [
            [bus, _read(os.path.join(gpus_dir, bus, "information"))]
            for bus in sorted(os.listdir(gpus_dir))
        ]
    except OSError:
        buses = [None]

    nodes: list[Any] = []
    try:
        with os.scandir(os.path.join(root, "dev")) as it:
            for e in it:
                if e.name.startswith("nvidia"):
                    try:
                        rdev: int | None = e.stat(follow_symlinks=False).st_rdev
                    except OSError:
                        rdev = None
                    nodes.append([e.name, rdev])
        nodes.sort()
    except OSError:
        nodes = [None]

    caps_dir = os.path.join(proc, "capabilities")
    caps: list[Any] = _listing(caps_dir) if os.path.isdir(caps_dir) else [None]

    try:
        st = os.stat(os.path.join(root, "etc/ld.so.cache"))
        ldcache: list[int] | None = [st.st_ino, st.st_size, st.st_mtime_ns]
    except OSError:
        ldcache = None

    return [_read(os.path.join(proc, "version")), buses, nodes, caps, ldcache]


# --- the cache file -------------------------------------------------------------------------


def _any_mig(host: HostInfo) -> bool:
    return any(g.mig_enabled for g in host.gpus)


def _read_cache(path: str, stamp: list[Any]) -> HostInfo | None:
    """The cached host when the file is ours, well-formed and for this stamp; else None."""
    # a regular file of ours only (never a blocking open, never a link), mode 0600
    raw = stamped.read_cache(path, 0o600, owner=os.geteuid())
    if raw is None:
        return None
    try:
        data = jsonio.loads(raw)
        if type(data) is not dict or type(data.get("version")) is not int \
                or data["version"] != CACHE_VERSION or data.get("stamp") != stamp:
            return None
        return HostInfo.from_dict(data["host"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _write_cache(path: str, stamp: list[Any], host: HostInfo) -> None:
    """Atomically replaces the cache file; any failure is ignored (a read-only /run,
    a directory in the way): the create goes on with the host it has."""
    try:
        text = jsonio.dumps({"version": CACHE_VERSION, "stamp": stamp, "host": host.to_dict()})
    except (ValueError, TypeError):
        return
    stamped.write_cache(path, text.encode(), 0o600, dir_mode=0o700, root_only=False)


def load_host(driver_root: str, state_dir: str, *, fresh: bool = False) -> tuple[HostInfo, bool]:
    """(host, from_cache). fresh=True always asks NVML (and refreshes the cache).

    DriverError (from nvctk.host.nvml) when NVML fails; nothing is cached then."""
    path = os.path.join(state_dir, CACHE_FILE)
    # The stamp is taken before NVML is asked: a change while NVML runs leaves a stamp
    # that no longer matches, so the next create asks again (never a stale hit).
    stamp = host_stamp(driver_root)
    cached = _read_cache(path, stamp)
    if not fresh and cached is not None and not _any_mig(cached):
        return cached, True

    from nvctk.host import nvml  # pynvml: only on a miss

    host = nvml.query_host(driver_root)
    # a MIG host, or a retry for an unknown device id, whose file is current is not
    # rewritten at every create
    if host != cached:
        _write_cache(path, stamp, host)
    return host, False
