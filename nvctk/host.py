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
modules (no pynvml, ctypes, dataclasses, typing, re, json, ...); nvctk.nvml (and
with it pynvml) is imported only on a miss.
"""

from __future__ import annotations

import os

from nvctk import jsonio
from nvctk.record import FrozenRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CACHE_FILE = "host-inventory.json"
CACHE_VERSION = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"

_set = object.__setattr__


def _get(d: dict[str, Any], key: str, kind: type) -> Any:
    """d[key], which must be exactly of type kind (bool is not an int here)."""
    v = d[key]
    if type(v) is not kind:
        raise TypeError(f"{key}: expected {kind.__name__}, got {type(v).__name__}")
    return v


class MigInfo(FrozenRecord):
    __slots__ = ("index", "uuid", "gpu_instance", "compute_instance", "profile", "memory_mib")  # noqa: RUF023
    index: int
    uuid: str
    gpu_instance: int
    compute_instance: int
    profile: str  # e.g. "3g.40gb" ("" when NVML cannot say)
    memory_mib: int

    def __init__(self, index: int, uuid: str, gpu_instance: int, compute_instance: int,
                 profile: str, memory_mib: int) -> None:
        _set(self, "index", index)
        _set(self, "uuid", uuid)
        _set(self, "gpu_instance", gpu_instance)
        _set(self, "compute_instance", compute_instance)
        _set(self, "profile", profile)
        _set(self, "memory_mib", memory_mib)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigInfo:
        return cls(
            index=_get(d, "index", int),
            uuid=_get(d, "uuid", str),
            gpu_instance=_get(d, "gpu_instance", int),
            compute_instance=_get(d, "compute_instance", int),
            profile=_get(d, "profile", str),
            memory_mib=_get(d, "memory_mib", int),
        )


class GpuInfo(FrozenRecord):
    __slots__ = ("index", "uuid", "name", "minor", "pci_bus_id", "memory_mib",  # noqa: RUF023
                 "compute_capability", "brand", "mig_enabled", "mig_devices")
    index: int
    uuid: str
    name: str
    minor: int
    pci_bus_id: str  # NVML's form, e.g. 00000000:1B:00.0
    memory_mib: int
    compute_capability: str  # "9.0"
    brand: str  # lower-case, e.g. "nvidia", "tesla"
    mig_enabled: bool
    mig_devices: tuple[MigInfo, ...]

    def __init__(self, index: int, uuid: str, name: str, minor: int, pci_bus_id: str,
                 memory_mib: int, compute_capability: str, brand: str, mig_enabled: bool,
                 mig_devices: tuple[MigInfo, ...] = ()) -> None:
        _set(self, "index", index)
        _set(self, "uuid", uuid)
        _set(self, "name", name)
        _set(self, "minor", minor)
        _set(self, "pci_bus_id", pci_bus_id)
        _set(self, "memory_mib", memory_mib)
        _set(self, "compute_capability", compute_capability)
        _set(self, "brand", brand)
        _set(self, "mig_enabled", mig_enabled)
        _set(self, "mig_devices", tuple(mig_devices))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuInfo:
        return cls(
            index=_get(d, "index", int),
            uuid=_get(d, "uuid", str),
            name=_get(d, "name", str),
            minor=_get(d, "minor", int),
            pci_bus_id=_get(d, "pci_bus_id", str),
            memory_mib=_get(d, "memory_mib", int),
            compute_capability=_get(d, "compute_capability", str),
            brand=_get(d, "brand", str),
            mig_enabled=_get(d, "mig_enabled", bool),
            mig_devices=tuple(MigInfo.from_dict(m) for m in _get(d, "mig_devices", list)),
        )


class HostInfo(FrozenRecord):
    __slots__ = ("driver_version", "cuda_version", "gpus")  # noqa: RUF023
    driver_version: str
    cuda_version: str  # "12.4"
    gpus: tuple[GpuInfo, ...]

    def __init__(self, driver_version: str, cuda_version: str,
                 gpus: tuple[GpuInfo, ...] = ()) -> None:
        _set(self, "driver_version", driver_version)
        _set(self, "cuda_version", cuda_version)
        _set(self, "gpus", tuple(gpus))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostInfo:
        """The inverse of to_dict; KeyError/TypeError when d is not one (extra keys are
        ignored)."""
        return cls(
            driver_version=_get(d, "driver_version", str),
            cuda_version=_get(d, "cuda_version", str),
            gpus=tuple(GpuInfo.from_dict(g) for g in _get(d, "gpus", list)),
        )

    def gpu(self, ident: str) -> GpuInfo | None:
        """GPU by index, UUID (case-insensitive) or PCI bus id."""
        for g in self.gpus:
            if ident == str(g.index) or ident.lower() in (g.uuid.lower(), g.pci_bus_id.lower()):
                return g
        return None


# --- the stamp ------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    """A small file's bytes as latin-1 text (exact and JSON-able); None when unreadable."""
    from nvctk.runc_argv import read_regular_file  # os and sys only

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
    try:
        # O_NONBLOCK: a FIFO put there must not hang the create; O_NOFOLLOW: no links
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        # only a regular file we wrote: owned by us, no group/other bits (we write 0600)
        if (st.st_mode & 0o170000) != 0o100000 or st.st_uid != os.geteuid() \
                or st.st_mode & 0o077:
            return None
        chunks = []
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = jsonio.loads(b"".join(chunks))
        if type(data) is not dict or type(data.get("version")) is not int \
                or data["version"] != CACHE_VERSION or data.get("stamp") != stamp:
            return None
        return HostInfo.from_dict(data["host"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _write_cache(state_dir: str, path: str, stamp: list[Any], host: HostInfo) -> None:
    """Atomically replaces the cache file; any failure is ignored (a read-only /run,
    a directory in the way): the create goes on with the host it has."""
    tmp = None
    try:
        text = jsonio.dumps({"version": CACHE_VERSION, "stamp": stamp, "host": host.to_dict()})
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        tmp = os.path.join(state_dir, f".{CACHE_FILE}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask can only have removed bits; be exact
            data = text.encode()
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)  # the rename must never expose a file whose data is not there
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
    except (OSError, ValueError, TypeError):
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def load_host(driver_root: str, state_dir: str, *, fresh: bool = False) -> tuple[HostInfo, bool]:
    """(host, from_cache). fresh=True always asks NVML (and refreshes the cache).

    DriverError (from nvctk.nvml) when NVML fails; nothing is cached then."""
    path = os.path.join(state_dir, CACHE_FILE)
    # The stamp is taken before NVML is asked: a change while NVML runs leaves a stamp
    # that no longer matches, so the next create asks again (never a stale hit).
    stamp = host_stamp(driver_root)
    cached = _read_cache(path, stamp)
    if not fresh and cached is not None and not _any_mig(cached):
        return cached, True

    from nvctk import nvml  # pynvml: only on a miss

    host = nvml.query_host(driver_root)
    # a MIG host, or a retry for an unknown device id, whose file is current is not
    # rewritten at every create
    if host != cached:
        _write_cache(state_dir, path, stamp, host)
    return host, False
