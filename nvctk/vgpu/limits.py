"""vGPU limits: parsing and validating the container's CUDA_DEVICE_* variables
with the same grammar as libvgpu's C parser, and the limits file libvgpu reads.

The runtime validates the limits at create time (a malformed value is a clear
error before the container starts; libvgpu would fail closed at cuInit anyway),
writes them to the container's read-only limits file, and mounts the accounting
directory at VGPU_DIR inside the container (libvgpu/README.md has the format).
"""

from __future__ import annotations

import os
import stat
import struct

from nvctk.base.errors import RequestError, shown
from nvctk.base.fileio import atomic_write
from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    from collections.abc import Mapping
    from typing import Any

# inside the container (libvgpu's compiled-in VGPU_LIMITS_FILE)
VGPU_DIR = "/run/nvctk/vgpu"
CONTAINER_LIBRARY = "/run/nvctk/libvgpu.so"  # where libvgpu.so is mounted inside
LIMITS_FILE = f"{VGPU_DIR}/limits"
CACHE_FILE = f"{VGPU_DIR}/cache"

MEMORY_VAR = "CUDA_DEVICE_MEMORY_LIMIT"
SM_VAR = "CUDA_DEVICE_SM_LIMIT"
CACHE_VAR = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
RESERVE_VAR = "NVCTK_VGPU_CONTEXT_RESERVE"
UUID_VAR = "NVCTK_VGPU_UUID"  # _<i>: the container's GPU i (the limits file only; libvgpu maps by it)
DEFAULT_RESERVE = 64 << 20  # libvgpu/src/vgpu.h VGPU_DEFAULT_RESERVE

_MEMORY_PATTERN = (
    r"[ \t]*(?:(?P<int>[0-9]{1,20})(?:\.(?P<frac>[0-9]{0,18}))?|\.(?P<frac2>[0-9]{1,18}))"
    r"(?P<unit>[kKmMgGtT]?)(?P<suffix>(?:[iI][bB]|[bB])?)[ \t]*"
)
_SM_PATTERN = r"[ \t]*([0-9]{1,3})[ \t]*"
_INDEX_PATTERN = r"_[0-9]{1,6}"
_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}
_compiled: dict[str, re.Pattern[str]] = {}


def _fullmatch(pattern: str, value: str) -> re.Match[str] | None:
    """re.fullmatch, with `re` imported only once a limit is parsed: most GPU
    containers set none, and importing it costs their start milliseconds."""
    try:
        compiled = _compiled[pattern]
    except KeyError:
        import re

        compiled = _compiled[pattern] = re.compile(pattern)
    return compiled.fullmatch(value)


def parse_memory(value: str) -> int:
    """Bytes from `4096m`, `8g`, `1.5G`, `1gb`, `1GiB`, `1073741824`, ...

    A number (decimals only with a unit) with an optional k/m/g/t unit (powers
    of 1024, case-insensitive) and an optional trailing b / ib; fractions are
    floored to a whole byte. 0 means no limit. ValueError when malformed."""
    m = _fullmatch(_MEMORY_PATTERN, value)
    if not m:
        raise ValueError(f"not a memory size: {value!r}")
    unit = m["unit"].lower()
    dot = m["frac"] is not None or m["frac2"] is not None
    if dot and not unit:
        raise ValueError(f"not a memory size: {value!r} (decimals need a unit: k, m, g, t)")
    if m["suffix"].lower() == "ib" and not unit:
        raise ValueError(f"not a memory size: {value!r}")
    ip = int(m["int"] or 0)
    frac = m["frac"] if m["frac"] is not None else (m["frac2"] or "")
    mult = 1 << _SHIFT[unit]
    v = ip * mult + (int(frac or 0) * mult) // (10 ** len(frac))
    if v >= 1 << 63:
        raise ValueError(f"memory size too large: {value!r}")
    return v


def parse_sm(value: str) -> int:
    """An SM share in percent, 0-100 (0 = no limit). ValueError when malformed."""
    m = _fullmatch(_SM_PATTERN, value)
    if not m or int(m[1]) > 100:
        raise ValueError(f"not a percentage 0-100: {value!r}")
    return int(m[1])


class VgpuLimits(Record):
    """Per GPU of the container (its i-th GPU, NVML order inside it); 0 = none."""

    __slots__ = ("memory", "sm", "shared_cache", "context_reserve", "extra")  # noqa: RUF023

    def __init__(self, memory: tuple[int, ...] = (), sm: tuple[int, ...] = (),
                 shared_cache: str | None = None, context_reserve: int | None = None,
                 extra: dict[str, str] | None = None) -> None:
        self.memory = memory
        self.sm = sm
        self.shared_cache = shared_cache  # CUDA_DEVICE_MEMORY_SHARED_CACHE as given
        self.context_reserve = context_reserve  # bytes charged per CUDA context
        self.extra: dict[str, str] = {} if extra is None else extra

    def _values(self) -> tuple[Any, ...]:
        return super()._values()[:-1]  # extra is no part of equality (nor hashing)

    @property
    def any(self) -> bool:
        """Does the container get libvgpu at all?"""
        return any(self.memory) or any(self.sm)

    def values(self) -> dict[str, str]:
        """Per-GPU `KEY: value` with values normalised to bytes and percent: what the
        plan carries and the limits file holds (libvgpu reads the same grammar)."""
        out = {f"{MEMORY_VAR}_{i}": str(v) for i, v in enumerate(self.memory)}
        out.update({f"{SM_VAR}_{i}": str(v) for i, v in enumerate(self.sm)})
        if self.context_reserve is not None:
            out[RESERVE_VAR] = str(self.context_reserve)
        return out


def _index(name: str, prefix: str, gpu_count: int) -> int | None:
    """None for the all-GPU variable, else the index of `<prefix>_<i>`."""
    if name == prefix:
        return None
    rest = name[len(prefix) :]
    if not _fullmatch(_INDEX_PATTERN, rest):
        shown_name = name if len(name) <= 80 and name.isprintable() else shown(name)
        raise RequestError(f"{shown_name}: not {prefix} or {prefix}_<index>")
    i = int(rest[1:])
    if i >= gpu_count:
        raise RequestError(
            f"{name}: the container has {gpu_count} GPU(s), indexes 0..{gpu_count - 1}"
        )
    return i


def stricter(a: int, b: int) -> int:
    """The stricter of two limits where 0 is none: a 0 never lifts the other's limit."""
    if not a:
        return b
    if not b:
        return a
    return min(a, b)


def limits_from_env(env: Mapping[str, str], gpu_count: int,
                    reserve_floor: int = DEFAULT_RESERVE) -> VgpuLimits:
    """The container's vGPU limits from its environment; RequestError names the
    variable that is malformed.

    Strictest wins (docs/decisions.md): the limit of GPU i is the stricter of
    `<VAR>` and `<VAR>_<i>`, and 0 ("no limit") never removes the other's. nvctk sees
    only the merged env (an image's ENV, `docker run -e`, a Pod's env and a device
    plugin's share all land in one list), so no variable may loosen another. HAMi lets
    `<VAR>_<i>` override `<VAR>`; here it can only tighten. The context reserve can
    only be raised above `reserve_floor`."""
    mem_all = sm_all = 0
    mem: dict[int, int] = {}
    sm: dict[int, int] = {}
    for name in sorted(env):
        value = env[name]
        if name.startswith(MEMORY_VAR):
            i = _index(name, MEMORY_VAR, gpu_count)
            try:
                v = parse_memory(value)
            except ValueError:
                raise RequestError(
                    f"{name}={shown(value)}: not a memory size (bytes, or a number with k/m/g/t, "
                    "e.g. 4096m, 1.5g)"
                )
            if i is None:
                mem_all = v
            else:
                mem[i] = v
        elif name.startswith(SM_VAR):
            i = _index(name, SM_VAR, gpu_count)
            try:
                v = parse_sm(value)
            except ValueError:
                raise RequestError(f"{name}={shown(value)}: not a percentage 0-100 (0 = no limit)")
            if i is None:
                sm_all = v
            else:
                sm[i] = v
    cache = env.get(CACHE_VAR)
    if cache is not None and not cache.startswith("/"):
        raise RequestError(f"{CACHE_VAR}={shown(cache)}: not an absolute path")
    reserve = None
    if RESERVE_VAR in env:
        try:
            reserve = max(reserve_floor, parse_memory(env[RESERVE_VAR]))
        except ValueError:
            raise RequestError(f"{RESERVE_VAR}={shown(env[RESERVE_VAR])}: not a memory size")
    return VgpuLimits(
        memory=tuple(stricter(mem.get(i, 0), mem_all) for i in range(gpu_count)),
        sm=tuple(stricter(sm.get(i, 0), sm_all) for i in range(gpu_count)),
        shared_cache=cache,
        context_reserve=reserve,
    )


def limit_source(env: Mapping[str, str], var: str, i: int, value: int) -> str:
    """Which of `<var>_<i>` and `<var>` gave GPU i its limit `value` (for messages)."""
    name = f"{var}_{i}"
    parse = parse_memory if var == MEMORY_VAR else parse_sm
    try:
        if name in env and parse(env[name]) == value:
            return name
    except ValueError:
        pass
    return var


def format_limits(values: Mapping[str, str], cache: str | None = CACHE_FILE) -> str:
    """The limits file's text: `KEY=VALUE` lines (VgpuLimits.values())."""
    lines = ["# nvctk vGPU limits, read by libvgpu.so (format: libvgpu/README.md)"]
    lines += [f"{k}={v}" for k, v in values.items()]
    if cache:
        lines.append(f"{CACHE_VAR}={cache}")
    return "\n".join(lines) + "\n"


def write_limits_file(
    path: str | os.PathLike[str], values: Mapping[str, str], cache: str | None = CACHE_FILE
) -> None:
    """Write the limits file atomically, read-only (0444). `cache` is the
    accounting file's path as the container sees it (None: beside the file)."""
    p = os.fspath(path)
    os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    if RESERVE_VAR not in values:
        # Always stated: libvgpu takes the larger of file and environment, so a
        # process cannot lower the charge for its context's real memory to 0.
        values = {**values, RESERVE_VAR: str(DEFAULT_RESERVE)}
    atomic_write(p, format_limits(values, cache).encode(), 0o444)


def read_limits_file(path: str | os.PathLike[str], gpu_count: int) -> VgpuLimits:
    """Parse a limits file (same keys and grammar as the environment)."""
    env: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise RequestError(f"{path}:{n}: not KEY=VALUE")
        if key.startswith(UUID_VAR):  # libvgpu's device map, no limit
            continue
        if not (key.startswith((MEMORY_VAR, SM_VAR)) or key in (CACHE_VAR, RESERVE_VAR)):
            raise RequestError(f"{path}:{n}: unknown key {key}")
        env[key] = value
    return limits_from_env(env, gpu_count)


# ---- the accounting file and the lock ledger (libvgpu/src/shm.h), read-only view ----

# shm.h is the one source of these: tests/test_vgpu_layout.py compiles a program
# printing its offsetof/sizeof and constants (libvgpu/tests/vgpu_layout.c) and
# compares them with SHM_LAYOUT below, so any drift fails.
SHM_MAGIC = 0x55504756
SHM_VERSION = 2  # 2: memory is in the lock ledger, the file is never mapped
MAX_DEV = 16
MAX_SLOTS = 1024
SLOT_LOCKBASE = 1 << 30  # a live slot's owner holds an OFD write lock on this byte + slot
DATA_LOCK = 0  # the file's mutex: an OFD write lock on this byte

# (field, struct format) in C order; padding is unnamed or starts with "_"
_HDR_FIELDS = (("magic", "I"), ("version", "I"), ("size", "I"), ("nslots", "I"), ("hwm", "I"), ("", "108x"))
_DEV_FIELDS = (("uuid", "64s"), ("used", "Q"), ("mem_cap", "Q"), ("sm_pct", "I"), ("win", "I"),
               ("tokens_ns", "q"), ("last_ns", "Q"), ("busy_ns", "Q"), ("launches", "Q"), ("sm_debt_ns", "Q"))
_SLOT_FIELDS = (("pid", "i"), ("flags", "I"), ("start_time", "Q"), ("pidns", "Q"), ("sm_debt", f"{MAX_DEV}Q"),
                ("mem_cap", f"{MAX_DEV}Q"), ("sm", f"{MAX_DEV}I"), ("host_pid", "i"), ("_pad", "I"))


def _layout(name: str, fields: tuple[tuple[str, str], ...]) -> tuple[struct.Struct, dict[str, int]]:
    fmt, offsets = "<", {}
    for field, f in fields:
        if field and not field.startswith("_"):  # padding is not in the printed layout
            offsets[f"{name}.{field}"] = struct.calcsize(fmt)
        fmt += f
    st = struct.Struct(fmt)
    offsets[f"sizeof(struct {name})"] = st.size
    return st, offsets


_HDR, _HDR_OFF = _layout("vgpu_shm_hdr", _HDR_FIELDS)
_DEV, _DEV_OFF = _layout("vgpu_shm_dev", _DEV_FIELDS)  # 128 bytes (win = ledger window + 1)
_SLOT, _SLOT_OFF = _layout("vgpu_shm_slot", _SLOT_FIELDS)  # 352 bytes
DEVS_OFFSET = _HDR.size
SLOTS_OFFSET = DEVS_OFFSET + MAX_DEV * _DEV.size
SHM_SIZE = SLOTS_OFFSET + MAX_SLOTS * _SLOT.size

# The ledger: OFD read locks on the limits file (on the accounting file where
# there is none); a lease's length is the bytes a process may hold on a device.
LEDGER_NREG = 4096
LEDGER_MARK_BASE = 1 << 32
LEDGER_WIN_SHIFT = 40
LEDGER_LEASE_BASE = 1 << 40
LEDGER_LEASE_END = LEDGER_LEASE_BASE + (LEDGER_NREG * MAX_DEV << LEDGER_WIN_SHIFT)
LEDGER_MAX_QUERIES = 4096
# the SM share's presence markers (shm.h): one 1-byte lock per active process and device
SM_PRES_BASE = 1 << 58
SM_PRES_EPOCHS = 4
SM_PRES_EPOCH_NS = 100_000_000
SM_PRES_END = SM_PRES_BASE + LEDGER_NREG * MAX_DEV * SM_PRES_EPOCHS

# everything above, named as libvgpu/tests/vgpu_layout.c prints it from shm.h
SHM_LAYOUT: dict[str, int] = {
    **_HDR_OFF, **_DEV_OFF, **_SLOT_OFF,
    "sizeof(struct vgpu_shm)": SHM_SIZE,
    "vgpu_shm.devs": DEVS_OFFSET,
    "vgpu_shm.slots": SLOTS_OFFSET,
    "VGPU_SHM_MAGIC": SHM_MAGIC,
    "VGPU_SHM_VERSION": SHM_VERSION,
    "VGPU_MAX_DEV": MAX_DEV,
    "VGPU_MAX_SLOTS": MAX_SLOTS,
    "VGPU_SLOT_LOCKBASE": SLOT_LOCKBASE,
    "VGPU_DATA_LOCK": DATA_LOCK,
    "VGPU_LEDGER_NREG": LEDGER_NREG,
    "VGPU_LEDGER_MARK_BASE": LEDGER_MARK_BASE,
    "VGPU_LEDGER_WIN_SHIFT": LEDGER_WIN_SHIFT,
    "VGPU_LEDGER_LEASE_BASE": LEDGER_LEASE_BASE,
    "VGPU_LEDGER_LEASE_END": LEDGER_LEASE_END,
    "VGPU_LEDGER_MAX_QUERIES": LEDGER_MAX_QUERIES,
    "VGPU_DEFAULT_RESERVE": DEFAULT_RESERVE,
    "VGPU_SM_PRES_BASE": SM_PRES_BASE,
    "VGPU_SM_PRES_EPOCHS": SM_PRES_EPOCHS,
    "VGPU_SM_PRES_EPOCH_NS": SM_PRES_EPOCH_NS,
    "VGPU_SM_PRES_END": SM_PRES_END,
}
F_OFD_GETLK = 36  # <fcntl.h>; Python's fcntl module has no name for it before 3.9 on every build
_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock (x86-64/aarch64 Linux)


class DeviceUsage(Record):
    __slots__ = ("uuid", "used", "mem_cap", "sm_pct", "busy_ns", "launches", "window")  # noqa: RUF023

    def __init__(self, uuid: str, used: int, mem_cap: int, sm_pct: int, busy_ns: int,
                 launches: int, window: int | None = None) -> None:
        self.uuid = uuid
        self.used = used  # bytes leased by the container's live processes (the ledger)
        self.mem_cap = mem_cap
        self.sm_pct = sm_pct
        self.busy_ns = busy_ns
        self.launches = launches
        self.window = window  # the ledger window (the container's GPU index); None = unknown


def _open_regular(path: str | os.PathLike[str]) -> int:
    """An O_RDONLY descriptor of path, only if it is a regular file (no link followed)."""
    # The file may sit in a directory the container can write: it may have been replaced
    # by a link to a host file, a FIFO or a device node.
    pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise ValueError(f"{path}: not a libvgpu accounting file (not a regular file)")
        return os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(pfd)


def read_ledger(path: str | os.PathLike[str]) -> list[int]:
    """Bytes leased per ledger window (the container's GPU index; the last one also
    holds devices libvgpu could not map), from the kernel's lock table: libvgpu's
    census, done here by a process that holds no lock. ValueError past the query
    bound (libvgpu refuses allocations then)."""
    import fcntl  # only tools and tests read usage: the start path never imports it

    fd = _open_regular(path)
    total = [0] * MAX_DEV
    try:
        todo = [(LEDGER_LEASE_BASE, LEDGER_LEASE_END)]
        queries = 0
        while todo:
            a, b = todo.pop()
            if a >= b:
                continue
            queries += 1
            if queries > LEDGER_MAX_QUERIES:
                raise ValueError(f"{path}: more locks than the ledger's census bound")
            got = fcntl.fcntl(fd, F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, a, b - a, 0))
            kind, _whence, start, length, _pid = _FLOCK.unpack(got)
            if kind == fcntl.F_UNLCK:
                continue
            s, e = max(start, a), min(start + length if length > 0 else 1 << 63, b)
            if s >= e:
                raise ValueError(f"{path}: the kernel answered a lock outside the window")
            for k in range((s - LEDGER_LEASE_BASE) >> LEDGER_WIN_SHIFT,
                           ((e - 1 - LEDGER_LEASE_BASE) >> LEDGER_WIN_SHIFT) + 1):
                lo = LEDGER_LEASE_BASE + (k << LEDGER_WIN_SHIFT)
                total[k % MAX_DEV] += min(e, lo + (1 << LEDGER_WIN_SHIFT)) - max(s, lo)
            todo += [(a, s), (e, b)]
    finally:
        os.close(fd)
    return total


def read_usage(
    path: str | os.PathLike[str], ledger: str | os.PathLike[str] | None = None
) -> dict[str, DeviceUsage]:
    """The container's usage per GPU UUID. `path`: its accounting file (UUIDs,
    caps, SM statistics: container-writable, so only informative); `ledger`: the
    file its leases lock, i.e. its limits file as the host sees it (None: the
    accounting file itself, as libvgpu uses where no limits file exists). Usage
    comes from the ledger only; a leased window no UUID entry names (the
    accounting file overwritten) is reported as "window-<i>"."""
    fd = _open_regular(path)
    try:
        data = os.pread(fd, SHM_SIZE, 0)
    finally:
        os.close(fd)
    used = read_ledger(path if ledger is None else ledger)
    valid = len(data) >= SHM_SIZE and struct.unpack_from("<II", data, 0) == (SHM_MAGIC, SHM_VERSION)
    out: dict[str, DeviceUsage] = {}
    named: set[int] = set()
    for e in range(MAX_DEV if valid else 0):
        uuid, _used, cap, sm, win, _tok, _last, busy, launches, _p2 = _DEV.unpack_from(
            data, DEVS_OFFSET + e * _DEV.size
        )
        name = uuid.split(b"\0", 1)[0].decode("utf-8", "replace")
        if not name:
            continue
        w = win - 1 if 0 < win <= MAX_DEV and win - 1 not in named else None
        if w is not None:
            named.add(w)
        out[name] = DeviceUsage(name, used[w] if w is not None else 0, cap, sm, busy, launches, w)
    for w in range(MAX_DEV):
        if used[w] and w not in named:
            out[f"window-{w}"] = DeviceUsage(f"window-{w}", used[w], 0, 0, 0, 0, w)
    return out


# ---- the public reader for monitoring (libvgpu/README.md "Reading a container's usage") ----

class UsageRecord(Record):
    """One line of a container's vGPU usage, as the host sees it.

    kind "process": one process's lease on one GPU window (pid is the host's pid).
    kind "device": the container's totals for one GPU window.
    `memory` (bytes leased) comes from the kernel's lock table: nothing in the
    container can forge it. The fields named in `claimed` come from the
    container-writable accounting file: the container's own claim, for display
    only (a forged file can change them, never `memory`)."""

    __slots__ = ("kind", "window", "pid", "memory", "uuid", "mem_cap", "sm_pct", "busy_ns",  # noqa: RUF023
                 "launches", "claimed")

    CLAIMED = ("uuid", "mem_cap", "sm_pct", "busy_ns", "launches")

    def __init__(self, kind: str, window: int, pid: int | None, memory: int, uuid: str | None = None,
                 mem_cap: int | None = None, sm_pct: int | None = None, busy_ns: int | None = None,
                 launches: int | None = None) -> None:
        self.kind = kind
        self.window = window  # the container's GPU index (NVML order); the last also holds unmapped devices
        self.pid = pid  # host pid (kind "process"), None for "device"
        self.memory = memory  # bytes leased: >= what is allocated, by at most 64 MiB far from the cap
        self.uuid = uuid
        self.mem_cap = mem_cap
        self.sm_pct = sm_pct
        self.busy_ns = busy_ns  # measured kernel time (lags a little)
        self.launches = launches
        self.claimed = tuple(k for k in self.CLAIMED if getattr(self, k) is not None)


def _lease_windows(lines: list[str]) -> list[int]:
    """Bytes per ledger window in the OFD lock lines of one file description."""
    total = [0] * MAX_DEV
    for line in lines:
        # "lock:\t1: OFDLCK ADVISORY  READ -1 fe:00:2148658 <start> <end|EOF>"
        parts = line.split()
        if len(parts) < 8 or parts[2] != "OFDLCK" or parts[4] not in ("READ", "WRITE"):
            continue
        start = int(parts[-2])
        end = (1 << 63) - 1 if parts[-1] == "EOF" else int(parts[-1])
        s, e = max(start, LEDGER_LEASE_BASE), min(end + 1, LEDGER_LEASE_END)
        for k in range((s - LEDGER_LEASE_BASE) >> LEDGER_WIN_SHIFT,
                       ((e - 1 - LEDGER_LEASE_BASE) >> LEDGER_WIN_SHIFT) + 1 if s < e else 0):
            lo = LEDGER_LEASE_BASE + (k << LEDGER_WIN_SHIFT)
            total[k % MAX_DEV] += min(e, lo + (1 << LEDGER_WIN_SHIFT)) - max(s, lo)
    return total


def read_process_leases(ledger: str | os.PathLike[str], proc: str = "/proc") -> dict[int, list[int]]:
    """Host pid -> bytes leased per ledger window, for every process holding
    leases on `ledger` (the container's limits file as the host sees it). Read
    from /proc/<pid>/fdinfo: the kernel's own record of each open file
    description's locks (OFD locks show no pid in /proc/locks). Takes no lock:
    it never slows the container's allocations or launches."""
    st = os.stat(ledger)
    key = (st.st_dev, st.st_ino)
    out: dict[int, list[int]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        fds = f"{proc}/{name}/fd"
        try:
            entries = os.listdir(fds)
        except OSError:
            continue  # gone, or not ours to see
        for fd in entries:
            try:
                fst = os.stat(f"{fds}/{fd}")
                if (fst.st_dev, fst.st_ino) != key:
                    continue
                with open(f"{proc}/{name}/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
                    lines = [ln for ln in f if ln.startswith("lock:")]
            except OSError:
                continue
            w = _lease_windows(lines)
            if any(w):
                acc = out.setdefault(int(name), [0] * MAX_DEV)
                out[int(name)] = [a + b for a, b in zip(acc, w, strict=True)]
    return out
def usage_records(cache: str | os.PathLike[str], ledger: str | os.PathLike[str] | None = None,
                  proc: str = "/proc") -> list[UsageRecord]:
    """read_container_usage for explicit files (`ledger` None: the accounting
    file is the ledger, as libvgpu does where no limits file exists)."""
    ledger = cache if ledger is None else ledger
    totals = read_ledger(ledger)
    claims: dict[int, DeviceUsage] = {}
    try:
        for dev in read_usage(cache, ledger).values():
            if dev.window is not None and not dev.uuid.startswith("window-"):
                claims[dev.window] = dev
    except (OSError, ValueError):
        pass  # an unreadable or replaced accounting file: no claims, the ledger still counts
    out = []
    for w in range(MAX_DEV):
        c = claims.get(w)
        if totals[w] or c:
            out.append(UsageRecord("device", w, None, totals[w], *(
                (c.uuid, c.mem_cap, c.sm_pct, c.busy_ns, c.launches) if c else ())))
    for pid, wins in sorted(read_process_leases(ledger, proc).items()):
        out += [UsageRecord("process", w, pid, b) for w, b in enumerate(wins) if b]
    return out
