"""nvctk's configuration: TOML at /etc/nvctk/config.toml, overridden by NVCTK_CONFIG.

A missing file means defaults. Unknown keys and malformed TOML are errors that
name the file (and the key or line), because a typo that is silently ignored
would change which GPUs or limits a container gets.
"""

from __future__ import annotations

import os
import sys

from nvctk.base.errors import ConfigError, shown
from nvctk.base.fileio import NotRegularFile, read_regular_file_stat
from nvctk.base.record import FrozenRecord, fields
from nvctk.base.toml_subset import loads as _loads_subset

# typing is for the type checker only: importing it costs every container start;
# so do dataclasses (~27 ms: inspect, ast, enum, re) and tomllib (~28 ms), which
# parse() imports only for a file outside toml_subset's subset
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DEFAULT_PATH = "/etc/nvctk/config.toml"
# the driver capabilities, in the order nvctk lists and mounts them (one list: the
# request parser, the config check, driver discovery, CDI and `nvctk info` use it)
ALL_CAPABILITIES = ("compute", "utility", "video", "graphics", "display", "ngx", "compat32")
LOG_LEVELS = ("debug", "info", "warning", "error")
MODES = ("legacy", "cdi")


class ExtraMount(FrozenRecord):
    __slots__ = ("host_path", "container_path", "read_only")  # noqa: RUF023 (field order)

    host_path: str
    container_path: str
    read_only: bool

    def __init__(self, host_path: str, container_path: str, read_only: bool = False) -> None:
        init = object.__setattr__
        init(self, "host_path", host_path)
        init(self, "container_path", container_path)
        init(self, "read_only", read_only)


class Config(FrozenRecord):
    # the fields in order: __init__'s positional order, and render()'s
    __slots__ = (  # noqa: RUF023
        "driver_root",
        "runtimes",
        "hook_path",
        "hook_timeout",
        "ldconfig",
        "log_file",
        "log_level",
        "accept_envvar_when_unprivileged",
        "accept_volume_mount_devices",
        "supported_capabilities",
        "vgpu_library",
        "state_dir",
        "authority_key",
        "extra_mounts",
        "mode",
        "cdi_spec_dirs",
        "cdi_vendors",
        "path",  # the file this came from ("" = defaults); not part of equality
    )

    driver_root: str
    runtimes: tuple[str, ...]
    hook_path: str
    hook_timeout: int
    ldconfig: str
    log_file: str
    log_level: str
    accept_envvar_when_unprivileged: bool
    accept_volume_mount_devices: bool
    supported_capabilities: tuple[str, ...]
    vgpu_library: str
    state_dir: str
    authority_key: str
    extra_mounts: tuple[ExtraMount, ...]
    mode: str
    cdi_spec_dirs: tuple[str, ...]
    cdi_vendors: tuple[str, ...]
    path: str

    def __init__(
        self,
        driver_root: str = "/",
        runtimes: tuple[str, ...] = ("runc", "crun"),
        hook_path: str = "",
        hook_timeout: int = 60,
        ldconfig: str = "/sbin/ldconfig",
        log_file: str = "/var/log/nvctk.log",
        log_level: str = "info",
        accept_envvar_when_unprivileged: bool = True,
        accept_volume_mount_devices: bool = False,
        supported_capabilities: tuple[str, ...] = ALL_CAPABILITIES,
        vgpu_library: str = "",
        state_dir: str = "/run/nvctk",
        authority_key: str = "/var/lib/nvctk/authority.key",
        extra_mounts: tuple[ExtraMount, ...] = (),
        mode: str = "legacy",
        cdi_spec_dirs: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi"),
        cdi_vendors: tuple[str, ...] = ("nvidia.com", "nvctk.org"),
        path: str = "",
    ) -> None:
        init = object.__setattr__
        init(self, "driver_root", driver_root)
        init(self, "runtimes", runtimes)
        init(self, "hook_path", hook_path)
        init(self, "hook_timeout", hook_timeout)
        init(self, "ldconfig", ldconfig)
        init(self, "log_file", log_file)
        init(self, "log_level", log_level)
        init(self, "accept_envvar_when_unprivileged", accept_envvar_when_unprivileged)
        init(self, "accept_volume_mount_devices", accept_volume_mount_devices)
        init(self, "supported_capabilities", supported_capabilities)
        init(self, "vgpu_library", vgpu_library)
        init(self, "state_dir", state_dir)
        init(self, "authority_key", authority_key)
        init(self, "extra_mounts", extra_mounts)
        init(self, "mode", mode)
        init(self, "cdi_spec_dirs", cdi_spec_dirs)
        init(self, "cdi_vendors", cdi_vendors)
        init(self, "path", path)

    def _values(self) -> tuple[Any, ...]:
        # equality and hash ignore where a config was read from
        return tuple(getattr(self, k) for k in _FIELDS)


# the fields a file sets, in the order render() prints them, and their defaults
# (parse() checks a value's type against its default's)
_FIELDS = tuple(f for f in fields(Config) if f != "path")
_DEFAULTS: dict[str, Any] = dict(zip(_FIELDS, Config()._values(), strict=True))
# TOML key -> field name
_NAMES = {f.replace("_", "-"): f for f in _FIELDS}

# TOML key -> the comment render() prints above it
_DOC: dict[str, str] = {
    "driver-root": "where the host driver's files are (libraries, binaries, /dev and /proc/driver nodes)",
    "runtimes": "low-level OCI runtimes to try in order: names on PATH or absolute paths",
    "hook-path": "absolute path of nvctk-hook written into specs (empty: beside nvctk-runtime)",
    "hook-timeout": "seconds runc gives the prestart hook",
    "ldconfig": "the host's ldconfig, run chrooted into the container's rootfs",
    "log-file": "nvctk's own log (empty: no log file)",
    "log-level": "one of debug, info, warning, error",
    "accept-envvar-when-unprivileged": "honour NVIDIA_VISIBLE_DEVICES in containers without CAP_SYS_ADMIN",
    "accept-volume-mount-devices": "honour /dev/null mounts at /var/run/nvidia-container-devices/<id>",
    "supported-capabilities": "driver capabilities this host allows containers to ask for",
    "vgpu-library": "host path of libvgpu.so (empty: the one installed with nvctk)",
    "state-dir": "per-container vGPU accounting directories live here",
    "authority-key": "root-only key of the device plugin's vGPU share annotations (nvctk.io/vgpu.*); "
                     "kept across reboots: a restarted Pod keeps its annotation",
    "extra-mounts": "extra host paths bound into every GPU container: [{host-path, container-path, read-only}]",
    "mode": "legacy: nvctk's prestart hook mounts the driver; cdi: the devices' edits from the "
            "CDI specs (also chosen by a qualified name such as nvidia.com/gpu=0)",
    "cdi-spec-dirs": "where CDI spec files (*.json, *.yaml) are read from; a file in a later dir replaces one of the same name in an earlier dir",
    "cdi-vendors": "the CDI vendors whose devices a container may name (env, annotations, device mounts): "
                   "another vendor's devices, with their host mounts, are the engine's to apply",
}


def _key(name: str) -> str:
    return name.replace("_", "-")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, ExtraMount):
        return (
            f"{{ host-path = {_toml_value(value.host_path)}, "
            f"container-path = {_toml_value(value.container_path)}, "
            f"read-only = {_toml_value(value.read_only)} }}"
        )
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(type(value))


def render(config: Config, comments: bool = True) -> str:
    out = []
    for name in _FIELDS:
        key = _key(name)
        if comments:
            out.append(f"# {_DOC[key]}")
        out.append(f"{key} = {_toml_value(getattr(config, name))}")
    return "\n".join(out) + "\n"


def _check_type(key: str, value: Any, default: Any, where: str) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, not {shown(value)}")
        return value
    if isinstance(default, int):
        low, high = INT_RANGES[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(
                f"{where}: {key} must be an integer from {low} to {high}, not {shown(value)}"
            )
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string, not {shown(value)}")
        _check_string(key, value, where)
        return value
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key} must be a list, not {shown(value)}")
    if key == "extra-mounts":
        return tuple(_extra_mount(m, where) for m in value)
    if not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of strings")
    for v in value:
        _check_string(key, v, where)
    return tuple(value)


# integer keys: (least, most). runc turns a hook's timeout into a Go time.Duration of
# nanoseconds, which a huge value overflows (and a day is already far too long)
INT_RANGES = {"hook-timeout": (1, 86400)}
# path keys: "" allowed (means: the default place, or no log), else absolute
_ABSOLUTE_OR_EMPTY = frozenset({"hook-path", "log-file", "vgpu-library"})
_ABSOLUTE = frozenset({"driver-root", "ldconfig", "state-dir", "authority-key", "cdi-spec-dirs"})


def _check_string(key: str, value: str, where: str) -> None:
    """No NUL (no path or name can hold one: os calls would raise ValueError), and
    paths absolute where the key says so."""
    if "\0" in value:
        raise ConfigError(f"{where}: {key} must not contain a NUL character: {shown(value)}")
    if key in _ABSOLUTE and not value.startswith("/"):
        raise ConfigError(f"{where}: {key} must be an absolute path, not {shown(value)}")
    if key in _ABSOLUTE_OR_EMPTY and value and not value.startswith("/"):
        raise ConfigError(f"{where}: {key} must be an absolute path or empty, not {shown(value)}")
    if key in ("runtimes", "supported-capabilities") and not value:
        raise ConfigError(f"{where}: {key} must not hold an empty string")
    if key == "cdi-vendors" and not _cdi_vendor_ok(value):
        raise ConfigError(f"{where}: cdi-vendors entries must be CDI vendor names such as "
                          f"nvidia.com (ASCII letters, digits and _-.), not {shown(value)}")


def _cdi_vendor_ok(text: str) -> bool:
    # CDI's rule for a vendor (nvctk.request.parse._cdi_part_ok; not imported: config loads first)
    return bool(text) and all(c.isascii() and (c.isalnum() or c in "_-.") for c in text) \
        and text[0].isalnum() and text[-1].isalnum()


def _extra_mount(item: Any, where: str) -> ExtraMount:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: extra-mounts entries must be tables, not {shown(item)}")
    unknown = set(item) - {"host-path", "container-path", "read-only"}
    if unknown:
        raise ConfigError(f"{where}: unknown key extra-mounts.{shown(sorted(unknown)[0])}")
    try:
        host, cont = item["host-path"], item["container-path"]
    except KeyError as e:
        raise ConfigError(f"{where}: extra-mounts entry lacks {e.args[0]}")
    if not (isinstance(host, str) and host.startswith("/") and isinstance(cont, str) and cont.startswith("/")):
        raise ConfigError(f"{where}: extra-mounts paths must be absolute: {shown(item)}")
    if "\0" in host or "\0" in cont:
        raise ConfigError(f"{where}: extra-mounts paths must not contain a NUL character")
    read_only = item.get("read-only", False)
    if not isinstance(read_only, bool):  # "false" as a string would be true
        raise ConfigError(f"{where}: extra-mounts read-only must be true or false, not "
                          f"{shown(read_only)}")
    return ExtraMount(host, cont, read_only)


# Structure no real config has (it is a few KiB of short lines), refused before any
# parse: tomllib is quadratic in a key's dotted parts (a 100 KB key took 34 s).
MAX_LINE = 8192
MAX_DOTTED_PARTS = 16
# the scan's own cost is bounded by its lines and strings (C-speed counts check both)
MAX_LINES = 1024
MAX_QUOTES = 1024


def _string_end(line: str, i: int, quote: str) -> int:
    """Index just past the one-line string opened at line[i]; -1 if not closed."""
    j = i + 1
    while True:
        j = line.find(quote, j)
        if j < 0:
            return -1
        if quote == "'":
            return j + 1
        k = j
        while line[k - 1] == "\\":
            k -= 1
        if (j - k) % 2 == 0:  # an even run of backslashes: this quote closes
            return j + 1
        j += 1


def _ml_end(line: str, i: int, delim: str) -> int:
    """Index just past the closing `delim` (\"\"\" or ''') at or after line[i]; -1 if none."""
    j = i
    while True:
        j = line.find(delim, j)
        if j < 0:
            return -1
        if delim == "'''" or j == 0 or line[j - 1] != "\\":
            end = j + 3
            while end < len(line) and line[end] == delim[0]:  # \"\"\"\"\" closes at the last three
                end += 1
            return end
        j += 1


def precheck(text: str) -> str | None:
    """Why `text` is refused before any TOML parse, or None: one linear pass.

    It follows strings (one-line, multi-line, escapes), comments and [ ] { } nesting.
    Refused: a line over MAX_LINE bytes, more than MAX_DOTTED_PARTS dotted parts on a
    line outside strings (a key, a table header; no config value is a float), more
    than MAX_LINES lines or MAX_QUOTES quote characters (a real config: ~100 and ~60).
    """
    lines = text.count("\n") + 1
    if lines > MAX_LINES:
        return f"{lines} lines, more than {MAX_LINES}: not an nvctk config"
    if text.count('"') + text.count("'") > MAX_QUOTES:
        return f"more than {MAX_QUOTES} quote characters: not an nvctk config"
    depth = 0
    ml = ""  # the open multi-line string's delimiter
    for n, line in enumerate(text.split("\n"), 1):
        if len(line) > MAX_LINE:
            return f"line {n} is longer than {MAX_LINE} bytes: not an nvctk config"
        i = 0
        if ml:
            i = _ml_end(line, 0, ml)
            if i < 0:
                continue
            ml = ""
        # the parts outside strings and comments, found with str.find/count (C
        # speed: a character loop in Python costs ~10 ms on a 64 KiB file)
        dots = 0
        end = len(line)
        nxt = {c: line.find(c, i) for c in ('"', "'", "#")}
        while i < end:
            for c, at in nxt.items():
                if 0 <= at < i:
                    nxt[c] = line.find(c, i)
            found = [at for at in nxt.values() if at >= 0]
            stop = min(found) if found else end
            dots += line.count(".", i, stop)
            depth += (line.count("[", i, stop) + line.count("{", i, stop)
                      - line.count("]", i, stop) - line.count("}", i, stop))
            depth = max(depth, 0)
            if stop == end or line[stop] == "#":
                break
            c = line[stop]
            if line.startswith(c * 3, stop):
                i = _ml_end(line, stop + 3, c * 3)
                if i < 0:
                    ml = c * 3
                    break
            else:
                i = _string_end(line, stop, c)
                if i < 0:
                    break  # unterminated: the parser will say so
        if dots >= MAX_DOTTED_PARTS:
            return (f"line {n}: a key or table header with more than "
                    f"{MAX_DOTTED_PARTS} dotted parts: not an nvctk config")
    return None


def _loads(text: str, where: str) -> dict[str, Any]:
    # linear, before any parse: tomllib is quadratic on some structures
    error = precheck(text)
    if error is not None:
        raise ConfigError(f"{where}: {error}")
    data = _loads_subset(text)
    if data is not None:
        return data
    # outside the subset nvctk writes (or not TOML at all): the full parser decides
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # the decoder's message carries "(at line N, column M)"
        raise ConfigError(f"{where}: malformed TOML: {e}")
    except ValueError as e:  # an integer past int()'s digit limit
        raise ConfigError(f"{where}: malformed TOML: {e}")
    except RecursionError:
        raise ConfigError(f"{where}: malformed TOML: arrays or tables nested too deeply")


def parse(text: str, where: str) -> Config:
    data = _loads(text, where)
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = _NAMES.get(key)
        if name is None:
            raise ConfigError(f"{where}: unknown key {shown(key)}")
        values[name] = _check_type(key, value, _DEFAULTS[name], where)
    cfg = Config(**values, path=where)
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"{where}: log-level must be one of {', '.join(LOG_LEVELS)}, not "
                          f"{shown(cfg.log_level)}")
    bad = [c for c in cfg.supported_capabilities if c not in ALL_CAPABILITIES]
    if bad:
        raise ConfigError(f"{where}: unknown capability {shown(bad[0])} in supported-capabilities")
    if not cfg.runtimes:
        raise ConfigError(f"{where}: runtimes must name at least one runtime")
    if cfg.mode not in MODES:
        raise ConfigError(f"{where}: mode must be one of {', '.join(MODES)}, not "
                          f"{shown(cfg.mode)}")
    return cfg


def config_path(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("NVCTK_CONFIG") or DEFAULT_PATH


def load(path: str | None = None) -> Config:
    """The config at path (default: config_path()); a missing file is the defaults.

    Never blocks: a FIFO, device or socket is refused unread (see
    fileio.read_regular_file). ConfigError names the file for every failure.
    """
    return load_stat(path)[0]


def load_stat(path: str | None = None) -> tuple[Config, os.stat_result | None]:
    """load(), and the stat of the file it read (None: no file, the defaults)."""
    path = path or config_path()
    try:
        data, st = read_regular_file_stat(path)
    except FileNotFoundError:
        return Config(), None
    except NotRegularFile:
        raise ConfigError(f"{path}: cannot read: not a regular file")
    except ValueError:  # a NUL in the path
        raise ConfigError(f"{path!r}: cannot read: the path holds a NUL character")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 (invalid byte at offset {e.start})")
    return parse(text, path), st
