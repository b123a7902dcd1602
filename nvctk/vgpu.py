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

from nvctk.errors import RequestError
from nvctk.oci import atomic_write
from nvctk.record import Record

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    from collections.abc import Mapping
    from typing import Any

# inside the container (libvgpu's compiled-in VGPU_LIMITS_FILE)
VGPU_DIR = "/run/nvctk/vgpu"
LIMITS_FILE = f"{VGPU_DIR}/limits"
CACHE_FILE = f"{VGPU_DIR}/cache"

MEMORY_VAR = "CUDA_DEVICE_MEMORY_LIMIT"
SM_VAR = "CUDA_DEVICE_SM_LIMIT"
CACHE_VAR = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
RESERVE_VAR = "NVCTK_VGPU_CONTEXT_RESERVE"

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
        raise RequestError(f"{name}: not {prefix} or {prefix}_<index>")
    i = int(rest[1:])
    if i >= gpu_count:
        raise RequestError(
            f"{name}: the container has {gpu_count} GPU(s), indexes 0..{gpu_count - 1}"
        )
    return i


def limits_from_env(env: Mapping[str, str], gpu_count: int) -> VgpuLimits:
    """The container's vGPU limits from its environment; RequestError names the
    variable that is malformed. `<VAR>_<i>` overrides `<VAR>` for GPU i."""
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
                    f"{name}={value!r}: not a memory size (bytes, or a number with k/m/g/t, "
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
                raise RequestError(f"{name}={value!r}: not a percentage 0-100 (0 = no limit)")
            if i is None:
                sm_all = v
            else:
                sm[i] = v
    cache = env.get(CACHE_VAR)
    if cache is not None and not cache.startswith("/"):
        raise RequestError(f"{CACHE_VAR}={cache!r}: not an absolute path")
    reserve = None
    if RESERVE_VAR in env:
        try:
            reserve = parse_memory(env[RESERVE_VAR])
        except ValueError:
            raise RequestError(f"{RESERVE_VAR}={env[RESERVE_VAR]!r}: not a memory size")
    return VgpuLimits(
        memory=tuple(mem.get(i, mem_all) for i in range(gpu_count)),
        sm=tuple(sm.get(i, sm_all) for i in range(gpu_count)),
        shared_cache=cache,
        context_reserve=reserve,
    )


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
        if not (key.startswith((MEMORY_VAR, SM_VAR)) or key in (CACHE_VAR, RESERVE_VAR)):
            raise RequestError(f"{path}:{n}: unknown key {key}")
        env[key] = value
    return limits_from_env(env, gpu_count)


# ---- the accounting file (libvgpu/src/shm.h), read-only view for tools/tests ----

SHM_MAGIC = 0x55504756
SHM_VERSION = 1
MAX_DEV = 16
MAX_SLOTS = 1024
_DEV = struct.Struct("<64sQQII qQQQQ")  # 128 bytes
_SLOT = struct.Struct(f"<iIQQ{MAX_DEV}Q{MAX_DEV}Q{MAX_DEV}IQ")  # 352 bytes
DEVS_OFFSET = 128
SLOTS_OFFSET = DEVS_OFFSET + MAX_DEV * _DEV.size
SHM_SIZE = SLOTS_OFFSET + MAX_SLOTS * _SLOT.size


class DeviceUsage(Record):
    __slots__ = ("uuid", "used", "mem_cap", "sm_pct", "busy_ns", "launches")  # noqa: RUF023

    def __init__(self, uuid: str, used: int, mem_cap: int, sm_pct: int, busy_ns: int,
                 launches: int) -> None:
        self.uuid = uuid
        self.used = used  # bytes, the container's live processes (slots' sum)
        self.mem_cap = mem_cap
        self.sm_pct = sm_pct
        self.busy_ns = busy_ns
        self.launches = launches


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(")") + 2 :].split()[19])


def read_usage(path: str | os.PathLike[str]) -> dict[str, DeviceUsage]:
    """The container's usage per GPU UUID, counting only live processes (same
    pid namespace as the caller: pid + start time)."""
    # The file sits in a directory the container can write: it may have been replaced
    # by a link to a host file, a FIFO or a device node. Only a regular file is read,
    # and only as much of it as the layout has.
    pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise ValueError(f"{path}: not a libvgpu accounting file (not a regular file)")
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(pfd)
    try:
        data = os.pread(fd, SHM_SIZE, 0)
    finally:
        os.close(fd)
    if len(data) < SHM_SIZE:
        raise ValueError(f"{path}: not a libvgpu accounting file")
    magic, version = struct.unpack_from("<II", data, 0)
    if magic != SHM_MAGIC or version != SHM_VERSION:
        raise ValueError(f"{path}: not a libvgpu accounting file of version {SHM_VERSION}")
    live = [0] * MAX_DEV
    for s in range(MAX_SLOTS):
        f = _SLOT.unpack_from(data, SLOTS_OFFSET + s * _SLOT.size)
        pid, start = f[0], f[2]
        if pid and _start_time(pid) == start:
            for e in range(MAX_DEV):
                live[e] += f[4 + e]
    out = {}
    for e in range(MAX_DEV):
        uuid, _used, cap, sm, _pad, _tok, _last, busy, launches, _p2 = _DEV.unpack_from(
            data, DEVS_OFFSET + e * _DEV.size
        )
        name = uuid.split(b"\0", 1)[0].decode("utf-8", "replace")
        if name:
            out[name] = DeviceUsage(name, live[e], cap, sm, busy, launches)
    return out
