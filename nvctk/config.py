"""nvctk's configuration: TOML at /etc/nvctk/config.toml, overridden by NVCTK_CONFIG.

A missing file means defaults. Unknown keys and malformed TOML are errors that
name the file (and the key or line), because a typo that is silently ignored
would change which GPUs or limits a container gets.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields

from nvctk.errors import ConfigError

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_PATH = "/etc/nvctk/config.toml"
ALL_CAPABILITIES = ("compute", "utility", "video", "graphics", "display", "ngx", "compat32")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ExtraMount:
    host_path: str
    container_path: str
    read_only: bool = False


@dataclass(frozen=True)
class Config:
    driver_root: str = "/"
    runtimes: tuple[str, ...] = ("runc", "crun")
    hook_path: str = ""
    hook_timeout: int = 60
    ldconfig: str = "/sbin/ldconfig"
    log_file: str = "/var/log/nvctk.log"
    log_level: str = "info"
    accept_envvar_when_unprivileged: bool = True
    accept_volume_mount_devices: bool = False
    supported_capabilities: tuple[str, ...] = ALL_CAPABILITIES
    vgpu_library: str = ""
    state_dir: str = "/run/nvctk"
    extra_mounts: tuple[ExtraMount, ...] = ()
    path: str = field(default="", compare=False)  # the file this came from ("" = defaults)


# key -> (comment, TOML rendering of the default); the order is the order printed
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
    for f in fields(Config):
        if f.name == "path":
            continue
        key = _key(f.name)
        if comments:
            out.append(f"# {_DOC[key]}")
        out.append(f"{key} = {_toml_value(getattr(config, f.name))}")
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


def parse(text: str, where: str) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # the decoder's message carries "(at line N, column M)"
        raise ConfigError(f"{where}: malformed TOML: {e}")
    known = {_key(f.name): f for f in fields(Config) if f.name != "path"}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}")
        f = known[key]
        values[f.name] = _check_type(key, value, f.default, where)
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
