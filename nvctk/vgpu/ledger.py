"""What libvgpu accounts, read-only: the container's accounting file and its lock
ledger (libvgpu/src/shm.h's layout), and the public per-process usage reader for
monitoring. The limits a container asks for are nvctk.vgpu.limits'."""

from __future__ import annotations

import os
import stat
import struct

from nvctk.base.record import Record
from nvctk.vgpu.limits import DEFAULT_RESERVE

TYPE_CHECKING = False
if TYPE_CHECKING:
    pass


# ---- the accounting file and the lock ledger (libvgpu/src/shm.h), read-only view ----

# shm.h is the one source of these: tests/integration/test_vgpu_layout.py compiles a program
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
