"""vGPU limits: parsing and validating the container's CUDA_DEVICE_* variables
with the same grammar as libvgpu's C parser, and the limits file libvgpu reads. (What
libvgpu accounts, its binary file and lock ledger, is read by nvctk.vgpu.ledger.)

The runtime validates the limits at create time (a malformed value is a clear
error before the container starts; libvgpu would fail closed at cuInit anyway),
writes them to the container's read-only limits file, and mounts the accounting
directory at VGPU_DIR inside the container (libvgpu/README.md has the format).
"""

from __future__ import annotations

import os

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
