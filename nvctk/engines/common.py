"""What every engine's configure/remove shares: reading a config file, parsing it with
the error's location, style-preserving TOML edits (nvctk.engines.toml_edit, named here
too), and the atomic write with `.bak`.

An engine module turns the current bytes of its file(s) into the wanted bytes (a
Change per file); `apply` then writes all of them or none: every new file and every
backup is written to a temporary file beside its target first, and only when all of
those exist are they renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any

import tomlkit
import tomlkit.exceptions

from nvctk.base import fileio
from nvctk.base.errors import ConfigError, clipped, shown

__all__ = [
    "MAX_FILE_BYTES", "RUNC_SHIM", "RUNTIME_BINARY", "Change", "ConfigChanges", "ConfigError",
    "EngineRequest", "apply", "backup_path", "check_runtime_path", "default_runtime_path",
    "is_our_binary", "loads_json", "not_ours", "parse_json_object", "parse_toml", "read",
    "target",
]

RUNTIME_BINARY = "nvctk-runtime"
# the runtime type of containerd's runc shim, which calls options.BinaryName
RUNC_SHIM = "io.containerd.runc.v2"


@dataclass
class EngineRequest:
    """One `nvctk configure` invocation, engine-neutral."""

    name: str = "nvidia"
    runtime_path: str = ""  # absolute; "" = not given (remove: any .../nvctk-runtime)
    set_as_default: bool = False
    cdi: bool = False
    config: str = ""  # "" = the engine's default path
    drop_in: str = ""


@dataclass
class Change:
    """The wanted content of one file: `new` None means delete it (kept as .bak)."""

    path: str
    old: bytes | None
    new: bytes | None
    bak: str = ""  # where the replaced file is kept ("": <file>.bak beside it)

    @property
    def changed(self) -> bool:
        return self.old != self.new


@dataclass
class ConfigChanges:
    """What configure or remove would do: the file changes and lines for the user."""

    service: str
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(c.changed for c in self.changes)


# --- runtime path -----------------------------------------------------------


def default_runtime_path() -> str:
    """The nvctk-runtime installed beside the running nvctk (absolute), else the one on
    PATH, else a ConfigError. Beside nvctk first: a venv or /opt install must not pick
    up another install's runtime from PATH."""
    tried = []
    for exe in (sys.argv[0], sys.executable):
        if not exe:
            continue
        cand = os.path.join(os.path.dirname(os.path.abspath(exe)), RUNTIME_BINARY)
        tried.append(cand)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    found = shutil.which(RUNTIME_BINARY)
    if found:
        return os.path.abspath(found)
    raise ConfigError(
        f"cannot find {RUNTIME_BINARY} (looked at {', '.join(dict.fromkeys(tried))} and "
        "on PATH): install nvctk or give --runtime-path"
    )


def check_runtime_path(path: str) -> str:
    """An explicit --runtime-path: absolute, an executable file."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"--runtime-path {path}: no such file")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"--runtime-path {path}: not executable")
    return path


def is_our_binary(value: object, req: EngineRequest) -> bool:
    """Whether a runtime entry's binary is nvctk's: the --runtime-path given, else any
    absolute path ending in /nvctk-runtime (nvctk may have moved since configure)."""
    if not isinstance(value, str):
        return False
    if req.runtime_path:
        return value == req.runtime_path
    return os.path.isabs(value) and os.path.basename(value) == RUNTIME_BINARY


def not_ours(path: str, req: EngineRequest, field: str, binary: object) -> ConfigError:
    """The refusal to remove a runtime entry of that name that runs something else."""
    return ConfigError(
        f"{path}: runtime {req.name!r} is not nvctk's ({field} {shown(binary, 200)}); not "
        "removing it"
        + ("" if req.runtime_path else " (give --runtime-path if nvctk-runtime lives there)")
    )


# --- reading ---------------------------------------------------------------


MAX_FILE_BYTES = 16 << 20  # an engine config is kilobytes; more is not one


def read(path: str) -> bytes | None:
    """The file's bytes, None when it does not exist; a ConfigError for anything but a
    regular file (after a symlink): configure replaces the file it read, and a device
    (/dev/null) or FIFO must never become a regular file, nor a FIFO hang the read."""
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, not a config file")
    try:
        return fileio.read_regular_file(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return None
    except fileio.NotRegularFile:
        raise ConfigError(f"{path}: not a regular file (a device, FIFO or socket); "
                          "left untouched")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}")


def _text(path: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 (byte {e.start}); left untouched")


def parse_toml(path: str, data: bytes) -> tomlkit.TOMLDocument:
    text = _text(path, data)
    try:
        return tomlkit.parse(text)
    except tomlkit.exceptions.TOMLKitError as e:
        # tomlkit's message already ends in "at line L col C"
        raise ConfigError(f"{path}: invalid TOML: {clipped(str(e))}; left untouched")


def _no_constant(name: str) -> Any:
    """json's NaN/Infinity/-Infinity are no JSON: refused, not written back."""
    raise ValueError(f"{name} is not JSON")


# the largest finite float64: Go's encoding/json (dockerd reading daemon.json) decodes a
# number into a float64 and refuses one beyond it ("cannot unmarshal number 1e400")
_FLOAT64_MAX = 1.7976931348623157e308


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent, as json reads it; ValueError for one
    a float64 cannot hold (Python reads 1e400 as inf, and writes it back as Infinity,
    which is no JSON: dockerd would not start)."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {clipped(text, 40)} is beyond a 64-bit float "
                         "(dockerd refuses it)")
    return value


def _float64_int(text: str) -> int:
    """A JSON integer; ValueError for one beyond a float64 (dockerd refuses it), or past
    int()'s digit limit."""
    value = int(text)
    if abs(value) > _FLOAT64_MAX:
        raise ValueError(f"the number {clipped(text, 40)} is beyond a 64-bit float "
                         "(dockerd refuses it)")
    return value


def loads_json(text: str | bytes) -> Any:
    """json.loads of a file nvctk may write back: ValueError for NaN, Infinity and any
    number dockerd cannot read, so that what nvctk writes is one its consumer accepts."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                      parse_int=_float64_int)


def parse_json_object(path: str, data: bytes) -> dict[str, Any]:
    text = _text(path, data)
    if not text.strip():
        return {}
    try:
        value = loads_json(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}; left untouched"
        )
    except RecursionError:
        raise ConfigError(f"{path}: invalid JSON: nested too deeply; left untouched")
    except ValueError as e:  # loads_json's number checks, or int()'s digit limit
        raise ConfigError(f"{path}: invalid JSON: {e}; left untouched")
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object (found {type(value).__name__}); left untouched")
    return value


# --- writing ---------------------------------------------------------------


def _check_writable(path: str) -> None:
    """Fail before anything is written: a directory, an immutable or read-only file."""
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, not a config file")
    if os.path.lexists(path):
        try:
            # O_WRONLY without O_TRUNC changes nothing; it fails for chattr +i (EPERM),
            # a read-only mount (EROFS) and missing permission (EACCES)
            os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {e.strerror}; left untouched")


def target(path: str) -> str:
    """Where a write to `path` goes: through a symlink to its file (a rename would
    replace the link with a file)."""
    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


def backup_path(path: str) -> str:
    return target(path) + ".bak"


def apply(plan: ConfigChanges) -> list[str]:
    """Write every changed file of the plan, or none. Returns lines saying what was done."""
    todo = [c for c in plan.changes if c.changed]
    staged: list[tuple[str, str]] = []  # (tmp, final)
    deletes: list[tuple[str, str]] = []  # (path, .bak)
    done: list[str] = []
    try:
        for c in todo:
            path = target(c.path)
            bak = c.bak or backup_path(c.path)
            _check_writable(path)
            if c.old is not None:
                _check_writable(bak)
            d = os.path.dirname(path)
            if c.new is not None and not os.path.isdir(d):
                try:
                    os.makedirs(d, exist_ok=True)
                except OSError as e:
                    raise ConfigError(f"cannot create {d}: {e.strerror}")
            try:
                # the backup keeps the mode and owner of the file it backs up
                if c.old is not None and c.new is not None:
                    staged.append((fileio.write_temp(bak, c.old, like=path), bak))
                if c.new is not None:
                    staged.append((fileio.write_temp(path, c.new), path))
                else:
                    deletes.append((path, bak))
            except OSError as e:
                raise ConfigError(f"cannot write {path}: {e.strerror}; left untouched")
        # every temporary file exists: now the renames (the .bak before its file)
        for tmp, final in staged:
            try:
                os.replace(tmp, final)
            except OSError as e:
                raise ConfigError(f"cannot write {final}: {e.strerror}")
        for path, bak in deletes:
            try:
                os.replace(path, bak)
            except OSError as e:
                raise ConfigError(f"cannot remove {path}: {e.strerror}")
        for c in todo:
            if c.new is None:
                done.append(f"removed {c.path} (kept as {c.bak or backup_path(c.path)})")
            elif c.old is None:
                done.append(f"created {c.path}")
            else:
                done.append(f"updated {c.path} (previous version: {c.bak or backup_path(c.path)})")
        for d in {os.path.dirname(target(c.path)) for c in todo}:
            with contextlib.suppress(OSError):
                fileio.sync_directory(d)
        return done
    finally:
        for tmp, _ in staged:
            fileio.unlink_quietly(tmp)
