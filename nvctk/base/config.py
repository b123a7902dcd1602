"""nvctk's configuration: TOML at /etc/nvctk/config.toml, overridden by NVCTK_CONFIG.

A missing file means defaults. Unknown keys and malformed TOML are errors that
name the file (and the key or line), because a typo that is silently ignored
would change which GPUs or limits a container gets.
"""

from __future__ import annotations

import os
import sys

from nvctk.base import jsonio, stamped
from nvctk.base.errors import ConfigError, shown
from nvctk.base.fileio import NotRegularFile, read_regular_file_stat
from nvctk.base.record import FrozenRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, TypeVar

    _T = TypeVar("_T")
    _R = TypeVar("_R")

DEFAULT_PATH = "/etc/nvctk/config.toml"
# the driver capabilities, in the order nvctk lists and mounts them (one list: the
# request parser, the config check, driver discovery, CDI and `nvctk info` use it)
ALL_CAPABILITIES = ("compute", "utility", "video", "graphics", "display", "ngx", "compat32")
LOG_LEVELS = ("debug", "info", "warning", "error")
MODES = ("legacy", "cdi")
# A Kubernetes node's settings over the defaults (`nvctk config default --kubernetes`,
# which the installer writes): an unprivileged container's own env never selects a GPU
# (an image's NVIDIA_VISIBLE_DEVICES=all would get every GPU, uncapped); GPUs come only
# from what the kubelet hands over: the device plugin's /dev/null mounts, CDI devices.
# Hosts used with Docker or podman directly keep the defaults (env honoured).
KUBERNETES_NODE: dict[str, Any] = {"accept_envvar_when_unprivileged": False,
                                   "accept_volume_mount_devices": True}


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


# Config comes from one table: its class body. Each field is written once, with its
# type, default, doc (the comment `nvctk config default` prints) and what parse()
# checks of it; the slots, __init__, render(), parse() and the docs derive from it.
# Not a dataclass: `import dataclasses` costs 11-15 ms (python -X importtime) against
# this module's 6-7 ms, in every nvctk-runtime start (docs/decisions.md, "Start time").
# mypy reads the body as a dataclass's (dataclass_transform, seen only by it).


class _Setting:
    __slots__ = ("check", "default", "doc", "high", "low")

    def __init__(self, default: Any, doc: str, check: str, low: int, high: int) -> None:
        self.default, self.doc, self.check, self.low, self.high = default, doc, check, low, high


def setting(*, default: _T, doc: str = "", check: str = "", low: int = 0, high: int = 0) -> _T:
    """One field of a _table class. doc: the comment render() prints ("": not a file
    key); check: "absolute" or "absolute-or-empty" for a path; low, high: an int's range."""
    return _Setting(default, doc, check, low, high)  # type: ignore[return-value]


if TYPE_CHECKING:
    from typing import dataclass_transform
else:
    def dataclass_transform(**_: Any) -> Any:
        return lambda f: f


@dataclass_transform(field_specifiers=(setting,))
def _table(cls: type[_R]) -> type[_R]:
    """cls rebuilt with a slot for each annotated field, in order, and an __init__ that
    takes them positionally or by name (FrozenRecord: pickling passes them in order),
    the missing ones from their setting()'s default. Its methods must not use super()."""
    names = tuple(cls.__annotations__)
    specs: dict[str, _Setting] = {n: cls.__dict__[n] for n in names}
    defaults = tuple(s.default for s in specs.values())
    where = {n: i for i, n in enumerate(names)}

    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes at most {len(names)} arguments")
        values = [*args, *defaults[len(args):]]
        for k, v in kw.items():
            i = where.get(k, -1)
            if i < 0 or i < len(args):
                raise TypeError(f"{cls.__name__}() got an unexpected or repeated argument {k!r}")
            values[i] = v
        self._fill(*values)

    body = {k: v for k, v in cls.__dict__.items()
            if k not in where and k not in ("__dict__", "__weakref__")}
    body["__slots__"] = names
    body["__init__"] = __init__
    body["_settings"] = specs
    return type(cls.__name__, cls.__bases__, body)  # type: ignore[return-value]


@_table
class Config(FrozenRecord):
    # the fields in order: __init__'s positional order, and render()'s
    driver_root: str = setting(
        default="/", check="absolute",
        doc="where nvctk sees the driver's files (libraries, binaries, /dev and /proc/driver nodes)")
    host_driver_root: str = setting(
        default="", check="absolute-or-empty",
        doc="where that driver root is on the host, written into what the host reads "
            "(CDI specs): differs in a container that mounts it elsewhere (empty: driver-root)")
    runtimes: tuple[str, ...] = setting(
        default=("runc", "crun"),
        doc="low-level OCI runtimes to try in order: names on PATH or absolute paths")
    hook_path: str = setting(
        default="", check="absolute-or-empty",
        doc="absolute path of nvctk-hook written into specs (empty: beside nvctk-runtime)")
    # runc turns a hook's timeout into a Go time.Duration of nanoseconds, which a huge
    # value overflows (and a day is already far too long)
    hook_timeout: int = setting(
        default=60, low=1, high=86400,
        doc="seconds runc gives the prestart hook")
    ldconfig: str = setting(
        default="/sbin/ldconfig", check="absolute",
        doc="the host's ldconfig, run chrooted into the container's rootfs")
    log_file: str = setting(
        default="/var/log/nvctk.log", check="absolute-or-empty",
        doc="nvctk's own log (empty: no log file)")
    log_level: str = setting(
        default="info",
        doc="one of debug, info, warning, error")
    accept_envvar_when_unprivileged: bool = setting(
        default=True,
        doc="honour NVIDIA_VISIBLE_DEVICES in containers without CAP_SYS_ADMIN")
    accept_volume_mount_devices: bool = setting(
        default=False,
        doc="honour /dev/null mounts at /var/run/nvidia-container-devices/<id>")
    supported_capabilities: tuple[str, ...] = setting(
        default=ALL_CAPABILITIES,
        doc="driver capabilities this host allows containers to ask for")
    vgpu_library: str = setting(
        default="", check="absolute-or-empty",
        doc="host path of libvgpu.so (empty: the one installed with nvctk)")
    state_dir: str = setting(
        default="/run/nvctk", check="absolute",
        doc="per-container vGPU accounting directories live here")
    authority_key: str = setting(
        default="/var/lib/nvctk/authority.key", check="absolute",
        doc="root-only key of the device plugin's vGPU share annotations (nvctk.io/vgpu.*); "
            "kept across reboots: a restarted Pod keeps its annotation")
    extra_mounts: tuple[ExtraMount, ...] = setting(
        default=(),
        doc="extra host paths bound into every GPU container: "
            "[{host-path, container-path, read-only}]")
    mode: str = setting(
        default="legacy",
        doc="legacy: nvctk's prestart hook mounts the driver; cdi: the devices' edits from the "
            "CDI specs (also chosen by a qualified name such as nvidia.com/gpu=0)")
    cdi_spec_dirs: tuple[str, ...] = setting(
        default=("/etc/cdi", "/var/run/cdi"), check="absolute",
        doc="where CDI spec files (*.json, *.yaml) are read from; a file in a later dir "
            "replaces one of the same name in an earlier dir")
    cdi_vendors: tuple[str, ...] = setting(
        # nvctk.io: nvctk's one domain (its annotations', its CDI vendor)
        default=("nvidia.com", "nvctk.io"),
        doc="the CDI vendors whose devices a container may name (env, annotations, device "
            "mounts): another vendor's devices, with their host mounts, are the engine's to apply")
    # the file this came from ("" = defaults); not a file key, not part of equality
    path: str = setting(default="")

    def _values(self) -> tuple[Any, ...]:
        # equality and hash ignore where a config was read from
        return tuple(getattr(self, k) for k in _FIELDS)


_SETTINGS: dict[str, _Setting] = Config._settings  # type: ignore[attr-defined]
# the fields a file sets, in the order render() prints them, and their defaults
# (parse() checks a value's type against its default's)
_FIELDS = tuple(f for f, s in _SETTINGS.items() if s.doc)
_DEFAULTS: dict[str, Any] = {f: _SETTINGS[f].default for f in _FIELDS}
# TOML key -> field name
_NAMES = {f.replace("_", "-"): f for f in _FIELDS}
# TOML key -> the comment render() prints above it
_DOC: dict[str, str] = {k: _SETTINGS[f].doc for k, f in _NAMES.items()}


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


# integer keys: (least, most); path keys: absolute, or "" allowed too (the default
# place, or no log) -- from the table
INT_RANGES = {k: (_SETTINGS[f].low, _SETTINGS[f].high) for k, f in _NAMES.items()
              if _SETTINGS[f].high}
_ABSOLUTE_OR_EMPTY = frozenset(k for k, f in _NAMES.items()
                               if _SETTINGS[f].check == "absolute-or-empty")
_ABSOLUTE = frozenset(k for k, f in _NAMES.items() if _SETTINGS[f].check == "absolute")


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


# Structure no real config has (a few KiB of short lines), refused before the parse:
# tomllib is quadratic in a key's dotted parts (a 60 KB key takes seconds). Two
# C-speed counts bound it; no TOML lexer of nvctk's own.
MAX_LINE = 8192
MAX_DOTS = 1024


def _bounds(text: str, where: str) -> None:
    longest = max(map(len, text.split("\n")))
    if longest > MAX_LINE:
        n = next(i for i, line in enumerate(text.split("\n"), 1) if len(line) == longest)
        raise ConfigError(f"{where}: line {n} is longer than {MAX_LINE} bytes: not an nvctk config")
    if text.count(".") > MAX_DOTS:
        raise ConfigError(f"{where}: more than {MAX_DOTS} '.' characters: not an nvctk config")


def _loads(text: str, where: str) -> dict[str, Any]:
    _bounds(text, where)
    if sys.version_info >= (3, 11):
        import tomllib  # start time: tomllib (re, datetime, ...) only when the cache misses
    else:  # pragma: no cover
        import tomli as tomllib  # start time: as tomllib
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
    return checked(_loads(text, where), where)


def checked(data: dict[str, Any], where: str) -> Config:
    """The Config of a parsed TOML document, every key and value checked."""
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


# The keys a node component's command line (or its container's env) may set over the
# file's: a DaemonSet's container sees the host's driver, and nvctk-hook, elsewhere
# than the host's config says (docs/decisions.md, "Node components in containers").
OVERRIDABLE = ("driver-root", "host-driver-root", "hook-path", "vgpu-library")


def overridden(config: Config, values: Mapping[str, str | None], where: str) -> Config:
    """config with these keys set (None: kept), each checked as a file's value would be
    (where: what set them, for the error). A new driver-root without a host-driver-root
    keeps the file's driver-root as the host's: the file is the host's config, read
    from a container that mounts the driver elsewhere."""
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key not in OVERRIDABLE:
            raise ConfigError(f"{where}: {key} cannot be set there")
        if value is not None:
            changes[_NAMES[key]] = _check_type(key, value, "", where)
    if "driver_root" in changes and "host_driver_root" not in changes \
            and not config.host_driver_root and changes["driver_root"] != config.driver_root:
        changes["host_driver_root"] = config.driver_root
    return config.replace(**changes) if changes else config


def host_driver_root(config: Config) -> str:
    """The driver root as the host sees it."""
    return config.host_driver_root or config.driver_root


def config_path(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("NVCTK_CONFIG") or DEFAULT_PATH


def load(path: str | None = None) -> Config:
    """The config at path (default: config_path()); a missing file is the defaults.

    Never blocks: a FIFO, device or socket is refused unread (see
    fileio.read_regular_file). ConfigError names the file for every failure.
    """
    return load_stat(path)[0]


def load_stat(path: str | None = None, environ: Mapping[str, str] | None = None
              ) -> tuple[Config, os.stat_result | None]:
    """load(), and the stat of the file it read (None: no file, the defaults);
    environ: where the parsed-config cache is (cache_dir)."""
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
    cache = parsed_cache_path(path, environ)
    config = _cached(cache, path, st)
    if config is not None:
        return config, st
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 (invalid byte at offset {e.start})")
    parsed = _loads(text, path)
    config = checked(parsed, path)
    _remember(cache, path, st, parsed)
    return config, st


# The parsed-config cache: every GPU container start loads the config in the runtime,
# and tomllib's imports cost more than the rest of the load (docs/decisions.md). So
# the TOML document of a config that passed the checks is kept as JSON beside the
# passthrough launcher's stamps, keyed by the file's stamp, and a hit runs only the
# checks on it (nvctk.base.stamped: only root writes it, and only a root-owned 0600 file
# in a root-owned directory others cannot write is read).
CACHE_VAR = "NVCTK_PASSTHROUGH_CACHE"  # another directory (the tests use their own)
DEFAULT_CACHE_DIR = "/run/nvctk/passthrough"
CACHE_MAGIC = "nvctk-config 1"


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(CACHE_VAR) or DEFAULT_CACHE_DIR


def cache_name(path: str) -> str:
    """FNV-1a 64 of the config path's bytes, 16 hex digits (nvctk-runtime.c fnv1a64)."""
    h = 0xCBF29CE484222325
    for b in os.fsencode(path):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def parsed_cache_path(path: str, environ: Mapping[str, str] | None = None) -> str:
    return os.path.join(cache_dir(environ), f"config-{cache_name(path)}.json")


def _cached(file: str, path: str, st: os.stat_result) -> Config | None:
    """The checked Config the cache `file` holds for this stamp of `path`, or None (a
    miss: no entry, another stamp, an entry not root's alone, or anything malformed)."""
    raw = stamped.read_cache(file, 0o600)
    if raw is None:
        return None
    try:
        entry = jsonio.loads(raw)
        if not (isinstance(entry, dict) and entry.get("magic") == CACHE_MAGIC
                and entry.get("path") == path and entry.get("stamp") == stamped.stamp(st)
                and isinstance(entry.get("data"), dict)):
            return None
        return checked(entry["data"], path)
    except (OSError, ValueError, ConfigError):
        return None


def _remember(file: str, path: str, st: os.stat_result, parsed: dict[str, Any]) -> None:
    """Keep a parsed config in `file` for the next load; any failure is ignored (not
    root, a read-only /run): the next load then parses again."""
    if stamped.racy(st.st_ctime_ns):
        return
    try:
        data = jsonio.dumps({"magic": CACHE_MAGIC, "path": path, "stamp": stamped.stamp(st),
                             "data": parsed}).encode()
    except (TypeError, ValueError):
        return
    stamped.write_cache(file, data, 0o600)
