"""nvctk's configuration: TOML at /etc/nvctk/config.toml, overridden by NVCTK_CONFIG.

A missing file means defaults. Unknown keys and malformed TOML are errors that
name the file (and the key or line), because a typo that is silently ignored
would change which GPUs or limits a container gets.
"""

from __future__ import annotations

import os
import sys

from nvctk.errors import ConfigError
from nvctk.record import FrozenRecord, fields
from nvctk.toml_subset import loads as _loads_subset

# typing is for the type checker only: importing it costs every container start;
# so do dataclasses (~27 ms: inspect, ast, enum, re) and tomllib (~28 ms), which
# parse() imports only for a file outside toml_subset's subset
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DEFAULT_PATH = "/etc/nvctk/config.toml"
ALL_CAPABILITIES = ("compute", "utility", "video", "graphics", "display", "ngx", "compat32")
LOG_LEVELS = ("debug", "info", "warning", "error")


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
        "extra_mounts",
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
    extra_mounts: tuple[ExtraMount, ...]
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
        extra_mounts: tuple[ExtraMount, ...] = (),
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
        init(self, "extra_mounts", extra_mounts)
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
    "extra-mounts": "extra host paths bound into every GPU container: [{host-path, container-path, read-only}]",
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
            raise ConfigError(f"{where}: {key} must be true or false, not {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{where}: {key} must be a positive integer, not {value!r}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string, not {value!r}")
        return value
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key} must be a list, not {value!r}")
    if key == "extra-mounts":
        return tuple(_extra_mount(m, where) for m in value)
    if not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of strings")
    return tuple(value)


def _extra_mount(item: Any, where: str) -> ExtraMount:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: extra-mounts entries must be tables, not {item!r}")
    unknown = set(item) - {"host-path", "container-path", "read-only"}
    if unknown:
        raise ConfigError(f"{where}: unknown key extra-mounts.{sorted(unknown)[0]}")
    try:
        host, cont = item["host-path"], item["container-path"]
    except KeyError as e:
        raise ConfigError(f"{where}: extra-mounts entry lacks {e.args[0]}")
    if not (isinstance(host, str) and host.startswith("/") and isinstance(cont, str) and cont.startswith("/")):
        raise ConfigError(f"{where}: extra-mounts paths must be absolute: {item!r}")
    return ExtraMount(host, cont, bool(item.get("read-only", False)))


def _loads(text: str, where: str) -> dict[str, Any]:
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


def parse(text: str, where: str) -> Config:
    data = _loads(text, where)
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = _NAMES.get(key)
        if name is None:
            raise ConfigError(f"{where}: unknown key {key!r}")
        values[name] = _check_type(key, value, _DEFAULTS[name], where)
    cfg = Config(**values, path=where)
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"{where}: log-level must be one of {', '.join(LOG_LEVELS)}, not {cfg.log_level!r}")
    bad = [c for c in cfg.supported_capabilities if c not in ALL_CAPABILITIES]
    if bad:
        raise ConfigError(f"{where}: unknown capability {bad[0]!r} in supported-capabilities")
    if not cfg.driver_root.startswith("/"):
        raise ConfigError(f"{where}: driver-root must be an absolute path, not {cfg.driver_root!r}")
    return cfg


def config_path(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("NVCTK_CONFIG") or DEFAULT_PATH


def load(path: str | None = None) -> Config:
    path = path or config_path()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return Config()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}")
    return parse(text, path)
