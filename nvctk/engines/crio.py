"""CRI-O: nvctk's own drop-in, `[crio.runtime.runtimes.<name>]` with runtime_path,
runtime_type = "oci" and the default runtime's other settings copied.

CRI-O reads /etc/crio/crio.conf, then /etc/crio/crio.conf.d/*.toml in lexical order
(later files win, key by key, but a runtime's table is taken whole from the last file
that defines it). The default runtime and its settings are looked up
the same way, in the main file and the other drop-ins; only the drop-in is written.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from typing import Any

import tomlkit
import tomllib
from tomlkit.items import Table

from nvctk.base.errors import clipped
from nvctk.engines import common, toml_edit
from nvctk.engines.common import ConfigError, EngineRequest, parse_toml
from nvctk.engines.toml_edit import get_table, set_key

SERVICE = "crio"
DEFAULT_CONFIG = "/etc/crio/crio.conf"
DEFAULT_DROP_IN = "/etc/crio/crio.conf.d/99-nvctk.toml"
RUNTIMES = ["crio", "runtime", "runtimes"]
# settings that name the runtime itself, not how CRI-O runs it
NOT_COPIED = {"runtime_path", "runtime_type", "runtime_root"}

Files = dict[str, "bytes | None"]


def paths(req: EngineRequest) -> list[str]:
    return [req.config or DEFAULT_CONFIG, req.drop_in or DEFAULT_DROP_IN]


def backup_path(path: str) -> str:
    """A drop-in's previous version is kept beside its directory, not in it: CRI-O
    reads every file there (99-nvctk.toml.bak would still define the runtime)."""
    full = common.target(path)
    d = os.path.dirname(full)
    return f"{d}-{os.path.basename(full)}.bak"


def readonly_paths(req: EngineRequest) -> list[str]:
    return paths(req)[:1]


def _sources(req: EngineRequest, files: Files, with_drop_in: bool) -> list[tuple[str, bytes | None]]:
    """The files CRI-O reads, in its order: crio.conf, then the drop-in dir's *.toml in
    lexical order (later files win, key by key); nvctk's drop-in as `files` has it
    (with_drop_in), or left out."""
    main, drop_in = paths(req)
    ours = os.path.abspath(drop_in)
    drop_dir = os.path.dirname(ours)
    names = {os.path.abspath(f) for f in glob.glob(os.path.join(drop_dir, "*.toml"))}
    if with_drop_in:
        names.add(ours)
    out: list[tuple[str, bytes | None]] = [(main, files.get(main))]
    for f in sorted(names, key=os.path.basename):
        out.append((f, files.get(drop_in) if f == ours else common.read(f)))
    return out


def _effective(req: EngineRequest, old: Files) -> tuple[str, dict[str, Any]]:
    """The default runtime's name and settings over crio.conf and the other drop-ins."""
    default = "crun"  # CRI-O's own default since 1.31 (runc before)
    runtimes: dict[str, dict[str, Any]] = {}
    for path, data in _sources(req, old, with_drop_in=False):
        if not data:
            continue
        doc = parse_toml(path, data)
        rt = get_table(doc, ["crio", "runtime"], path)
        if rt is not None and isinstance(rt.get("default_runtime"), str):
            default = rt["default_runtime"]
        tables = get_table(doc, RUNTIMES, path)
        for name, value in (tables or {}).items():
            if isinstance(value, dict):
                # whole: CRI-O takes a runtime's table from the last file that defines it
                runtimes[name] = dict(value.unwrap() if hasattr(value, "unwrap") else value)
    if default == req.name:
        default = "crun" if "crun" in runtimes else "runc"
    return default, runtimes.get(default, {})


def _block(name: str, binary: str, source: dict[str, Any]) -> str:
    lines = [f'[crio.runtime.runtimes.{tomlkit.dumps({name: 0}).split(" =")[0]}]',
             tomlkit.dumps({"runtime_path": binary}).strip(), 'runtime_type = "oci"']
    lines += [tomlkit.dumps({k: v}).strip() for k, v in source.items()
              if k not in NOT_COPIED and not isinstance(v, dict)]
    return "\n".join(lines) + "\n"


def configure(req: EngineRequest, old: Files) -> tuple[Files, list[str]]:
    _, path = paths(req)
    notes: list[str] = []
    doc = parse_toml(path, old[path] or b"")
    _, source = _effective(req, old)
    if req.cdi:
        notes.append("CRI-O reads CDI specs (cdi_spec_dirs) by default: --cdi changes nothing")
    if req.set_as_default:
        rt = get_table(doc, ["crio", "runtime"], path, create=True)
        if rt.is_super_table():
            get_table(doc, ["crio"], path)["runtime"] = tomlkit.table()
            rt = get_table(doc, ["crio", "runtime"], path)
        prev = rt.get("default_runtime")
        if prev != req.name:
            set_key(rt, "default_runtime", req.name)
            if prev is not None:
                toml_edit.mark_previous(rt, "default_runtime", str(prev))
    tables = get_table(doc, RUNTIMES, path)
    cur = tables.get(req.name) if tables is not None else None
    if cur is None:
        text = toml_edit.insert_table_text(doc, RUNTIMES, req.name, _block(req.name, req.runtime_path, source), path)
        return {path: text.encode()}, notes
    if not isinstance(cur, Table):
        raise ConfigError(f"{path}: crio.runtime.runtimes.{req.name} is not a table; left untouched")
    if cur.get("runtime_path") != req.runtime_path or cur.get("runtime_type", "oci") != "oci":
        notes.append(f"runtime {req.name!r} existed in {path} (runtime_path "
                     f"{cur.get('runtime_path')!r}): now runs {req.runtime_path}")
        set_key(cur, "runtime_path", req.runtime_path)
        set_key(cur, "runtime_type", "oci")
    return {path: tomlkit.dumps(doc).encode()}, notes


def binary_in(req: EngineRequest, old: Files) -> str | None:
    _, path = paths(req)
    if not old[path]:
        return None
    tables = get_table(parse_toml(path, old[path] or b""), RUNTIMES, path)
    entry = tables.get(req.name) if tables is not None else None
    value = entry.get("runtime_path") if isinstance(entry, dict) else None
    return value if isinstance(value, str) else None


def _has_values(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_values(v) for v in value.values())
    return True


def strip(req: EngineRequest, old: Files, baks: Files | None = None) -> tuple[Files | None, list[str]]:
    _, path = paths(req)
    if not old[path]:
        return None, []
    doc = parse_toml(path, old[path] or b"")
    tables = get_table(doc, RUNTIMES, path)
    entry = tables.get(req.name) if tables is not None else None
    if entry is None:
        return None, []
    binary = entry.get("runtime_path") if isinstance(entry, dict) else None
    if not common.is_our_binary(binary, req):
        raise common.not_ours(path, req, "runtime_path", binary)
    rt = get_table(doc, ["crio", "runtime"], path)
    if rt is not None and rt.get("default_runtime") == req.name:
        # back to what configure replaced in this file (noted on the line), else unset:
        # crio.conf's or another drop-in's default applies again
        was = toml_edit.previous_value(rt, "default_runtime")
        toml_edit.restore_key(rt, "default_runtime", toml_edit.UNSET if was is toml_edit.MISSING else was)
    doc = tomlkit.parse(toml_edit.remove_table_text(doc, [*RUNTIMES, req.name], path))
    # nvctk's drop-in: gone when nothing else is left in it
    keep = _has_values(doc.unwrap())
    return {path: tomlkit.dumps(doc).encode() if keep else None}, []


def validate(req: EngineRequest, new: Files) -> None:
    """CRI-O's own reading of the files as they would be (`crio config` over a copy of
    the drop-in dir with the new drop-in): a drop-in CRI-O would refuse at its next
    start is never written, nor one whose runtime another file overrides (check_merged:
    on nvctk's own reading of the files where no `crio` is installed)."""
    exe = shutil.which("crio")
    if exe is None:
        check_merged(req, new, None)
        return
    main, drop = paths(req)
    src = os.path.dirname(os.path.abspath(drop))
    with tempfile.TemporaryDirectory(prefix="nvctk-crio-") as d:
        confd = os.path.join(d, "conf.d")
        os.mkdir(confd)
        for f in glob.glob(os.path.join(src, "*.toml")):
            if os.path.abspath(f) != os.path.abspath(drop):
                data = common.read(f)
                if data is not None:
                    with open(os.path.join(confd, os.path.basename(f)), "wb") as out:
                        out.write(data)
        if new.get(drop) is not None:
            with open(os.path.join(confd, os.path.basename(drop)), "wb") as out:
                out.write(new[drop] or b"")
        conf = main if os.path.isfile(main) else os.path.join(d, "crio.conf")
        if conf != main:
            open(conf, "wb").close()
        try:
            res = subprocess.run([exe, "--config", conf, "--config-dir", confd, "config"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            raise ConfigError(f"{drop}: cannot check the result with {exe}: {e}; left untouched")
    if res.returncode != 0:
        lines = [li for li in res.stderr.splitlines() if li.strip()]
        why = lines[-1] if lines else f"exit {res.returncode}"
        raise ConfigError(f"{drop}: CRI-O ({exe}) would refuse the result: "
                          f"{clipped(why.replace(d, os.path.dirname(drop)))}; left untouched")
    try:
        merged = tomllib.loads(res.stdout)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{drop}: cannot read {exe}'s merged configuration ({e}); left untouched")
    check_merged(req, new, merged)


def _lookup(doc: Any, keys: list[str]) -> Any:
    for k in keys:
        if not isinstance(doc, dict) or k not in doc:
            return None
        doc = doc[k]
    return doc


def check_merged(req: EngineRequest, new: Files, merged: dict[str, Any] | None) -> None:
    """ConfigError when CRI-O, merging crio.conf and every drop-in with nvctk's as `new`
    has it, would not run req.runtime_path as runtime req.name (nor make it the default,
    where nvctk's drop-in makes it so): a drop-in read after nvctk's that defines the
    runtime (CRI-O takes a runtime's table whole from the last file that defines it) or
    sets default_runtime wins, and configure names it. merged: `crio config`'s reading,
    where crio is installed (None: nvctk's own reading of the files). Nothing to check
    when nvctk's drop-in does not define the runtime (a removal)."""
    _, drop = paths(req)
    ours_path = os.path.abspath(drop)
    ours = parse_toml(drop, new.get(drop) or b"").unwrap()
    if _lookup(ours, [*RUNTIMES, req.name, "runtime_path"]) != req.runtime_path:
        return
    table_keys, default_keys = [*RUNTIMES, req.name], ["crio", "runtime", "default_runtime"]
    table: tuple[str, dict[str, Any]] = (ours_path, {})
    default: tuple[str, Any] = (ours_path, None)
    for path, data in _sources(req, new, with_drop_in=True):
        if data:
            doc = parse_toml(path, data).unwrap()
            if isinstance(_lookup(doc, table_keys), dict):
                table = (path, _lookup(doc, table_keys))
            if _lookup(doc, default_keys) is not None:
                default = (path, _lookup(doc, default_keys))
    checks: list[tuple[list[str], Any, str, Any]] = [  # keys, wanted, who set it, the value
        # the type first: another type changes what CRI-O makes of the path ("vm": none)
        ([*table_keys, "runtime_type"], "oci", table[0], table[1].get("runtime_type", "oci")),
        ([*table_keys, "runtime_path"], req.runtime_path, table[0], table[1].get("runtime_path")),
    ]
    if _lookup(ours, default_keys) == req.name:
        checks.append((default_keys, req.name, default[0], default[1]))
    for keys, want, where, got in checks:
        if merged is not None:
            got = _lookup(merged, keys)
        if keys[-1] == "runtime_type" and got == "":
            got = "oci"  # CRI-O's default, shown as ""
        if got == want:
            continue
        if where == ours_path:
            where = "a setting nvctk cannot place"
        raise ConfigError(
            f"{drop}: CRI-O would not use it: its merged configuration has {'.'.join(keys)} = "
            f"{clipped(repr(got), 200)}, not {want!r}, because of {where} (CRI-O reads "
            f"{os.path.dirname(ours_path)}/*.toml in lexical order after crio.conf: the last "
            "file that defines a runtime defines all of it, the last default_runtime wins); "
            "left untouched. Take that out of it, or give nvctk's drop-in a name that sorts "
            "after it (--drop-in)")
