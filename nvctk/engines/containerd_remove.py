"""Removing nvctk's runtime from containerd's config: the runtime table (refused when
the table of that name runs something else), a default_runtime_name or enable_cdi that
configure set back to what they were, someone else's runtime configure replaced
restored from the backup, and a drop-in of nvctk's alone with its imports glob."""

from __future__ import annotations

import glob as globmod
import os
from typing import Any

import tomlkit
from tomlkit.items import Table

from nvctk.engines.common import RUNC_SHIM, EngineRequest, is_our_binary, not_ours, parse_toml
from nvctk.engines.containerd_layout import (
    PLUGIN,
    Files,
    config_version,
    imports_glob,
    is_empty,
    paths,
    plain,
)
from nvctk.engines.toml_edit import (
    MISSING,
    UNSET,
    Edits,
    check_edit,
    get_table,
    guarded,
    previous_value,
    remove_table_text,
    restore_key,
)


def binary_in(req: EngineRequest, old: Files) -> str | None:
    """The BinaryName of runtime req.name in the file that holds it (None: no such runtime)."""
    path = paths(req)[-1]
    if old[path] is None:
        return None
    doc = parse_toml(path, old[path] or b"")
    main_doc = parse_toml(paths(req)[0], old[paths(req)[0]] or b"")
    version = config_version(main_doc, paths(req)[0]) if not is_empty(main_doc) else 2
    runtimes = get_table(doc, [*PLUGIN[version], "containerd", "runtimes"], path) \
        if not is_empty(doc) else None
    rt = runtimes.get(req.name) if runtimes is not None else None
    opts = rt.get("options") if isinstance(rt, dict) else None
    name = opts.get("BinaryName") if isinstance(opts, dict) else None
    return str(name) if isinstance(name, str) else None


def _drop_empty_super(doc: Any, keys: list[str]) -> None:
    """Delete the header-less (super) tables along keys that removing left empty."""
    for n in range(len(keys), 0, -1):
        parent = get_table(doc, keys[: n - 1], "") if n > 1 else doc
        tbl = parent.get(keys[n - 1]) if parent is not None else None
        if isinstance(tbl, Table) and tbl.is_super_table() and len(tbl) == 0:
            del parent[keys[n - 1]]
        else:
            return


def _bak_table(bak: bytes | None, keys: list[str]) -> tuple[bool, Any]:
    """(False, None) when there is no .bak or it does not parse, else (True, its table
    at keys or None)."""
    if bak is None:
        return False, None
    try:
        return True, get_table(tomlkit.parse(bak.decode()), keys, "")
    except Exception:
        return False, None


def _bak_value(bak: bytes | None, keys: list[str], key: str, req: EngineRequest) -> Any:
    """The value of key in the table at keys of the file's .bak: what was there before
    nvctk last wrote the file (MISSING when unknown: no .bak, or it says nvctk's name)."""
    read, tbl = _bak_table(bak, keys)
    if not read:
        return MISSING
    value = tbl.get(key) if tbl is not None else None
    if value is None:
        return UNSET
    value = plain(value)
    return MISSING if value == req.name else value


def _replaced_runtime(bak: bytes | None, runtimes_keys: list[str], req: EngineRequest) -> Any:
    """The runtime table of req.name in the .bak when it is someone else's (configure
    replaced it), else None."""
    rts = _bak_table(bak, runtimes_keys)[1]
    rt = rts.get(req.name) if rts is not None else None
    if not isinstance(rt, Table):
        return None
    opts = rt.get("options")
    binary = opts.get("BinaryName") if isinstance(opts, dict) else None
    return None if is_our_binary(binary, req) else rt


def strip(req: EngineRequest, old: Files, baks: Files | None = None) -> tuple[Files | None, list[str]]:
    """Structural removal: nvctk's runtime (refused when the table of that name is
    someone else's); a default_runtime_name naming it and an enable_cdi configure set
    back to what they were (noted on the line, else the .bak's, else "runc" and left);
    the imports glob of a drop-in that was nvctk's alone. None: nothing of nvctk's."""
    notes: list[str] = []
    main_path = paths(req)[0]
    path = paths(req)[-1]
    if old[path] is None:
        return None, notes
    main_doc = parse_toml(main_path, old[main_path] or b"")
    doc = parse_toml(path, old[path] or b"") if path != main_path else main_doc
    if is_empty(doc):
        return None, notes
    version = config_version(main_doc, main_path) if not is_empty(main_doc) else config_version(doc, path)
    plugin = PLUGIN[version]
    runtimes_keys = [*plugin, "containerd", "runtimes"]
    runtimes = get_table(doc, runtimes_keys, path)
    rt = runtimes.get(req.name) if runtimes is not None else None
    if rt is None:
        return None, notes
    opts = rt.get("options") if isinstance(rt, dict) else None
    binary = opts.get("BinaryName") if isinstance(opts, dict) else None
    if not isinstance(rt, dict) or rt.get("runtime_type") != RUNC_SHIM or not is_our_binary(binary, req):
        raise not_ours(path, req, "BinaryName", binary)
    bak = (baks or {}).get(path)
    edits: Edits = {tuple([*runtimes_keys, req.name]): MISSING}
    _restore_default(doc, plugin, path, req, bak, edits, notes)
    _restore_cdi(doc, plugin, path, edits, notes)
    before = tomlkit.dumps(parse_toml(path, old[path] or b""))
    text = _without_runtime(doc, runtimes_keys, path, req, bak, edits, notes)
    check_edit(path, before.encode(), text.encode(), edits)
    out: Files = {}
    if path != main_path:
        # the drop-in is nvctk's file: it goes, and the imports glob with it when no
        # other file uses that directory
        out[path] = None
        glob = imports_glob(path)
        imports = main_doc.get("imports")
        others = [f for f in globmod.glob(glob) if os.path.abspath(f) != os.path.abspath(path)]
        if isinstance(imports, list) and glob in imports and not others:
            imports.remove(glob)
        out[main_path] = tomlkit.dumps(main_doc).encode()
    else:
        # kept, even with only `version` left: only a file configure created (plan_remove's
        # restore of a missing backup) is deleted
        out[path] = text.encode()
    return out, notes


def _restore_default(doc: Any, plugin: list[str], path: str, req: EngineRequest,
                     bak: bytes | None, edits: Edits, notes: list[str]) -> None:
    """A default_runtime_name naming nvctk's runtime back to what it was (noted on the
    line, else the .bak's, else "runc")."""
    ctd = get_table(doc, [*plugin, "containerd"], path)
    if ctd is None or ctd.get("default_runtime_name") != req.name:
        return
    was = previous_value(ctd, "default_runtime_name")
    if was is MISSING:
        was = _bak_value(bak, [*plugin, "containerd"], "default_runtime_name", req)
    if was is MISSING:
        was = "runc"
    restore_key(ctd, "default_runtime_name", was)
    edits[(*plugin, "containerd", "default_runtime_name")] = MISSING if was is UNSET else was
    notes.append(f"{path}: default_runtime_name " + (
        "removed (containerd's default, runc, applies)" if was is UNSET
        else f"set back to {was!r}"))


def _restore_cdi(doc: Any, plugin: list[str], path: str, edits: Edits,
                 notes: list[str]) -> None:
    """enable_cdi back to what it was where configure noted that; else left."""
    cri = get_table(doc, plugin, path)
    if cri is None or cri.get("enable_cdi") is not True:
        return
    was = previous_value(cri, "enable_cdi")
    if was is MISSING:
        notes.append(f"{path}: enable_cdi left as it is (not set by nvctk configure)")
        return
    restore_key(cri, "enable_cdi", was)
    if was is UNSET and isinstance(cri, Table) and len(cri) > 0 \
            and all(isinstance(v, Table) for v in cri.values()):
        # the header configure gave the table for enable_cdi goes with it
        cri._is_super_table = True
    edits[(*plugin, "enable_cdi")] = MISSING if was is UNSET else was
    notes.append(f"{path}: enable_cdi back to " + ("unset" if was is UNSET else str(was).lower()))


def _without_runtime(doc: Any, runtimes_keys: list[str], path: str, req: EngineRequest,
                     bak: bytes | None, edits: Edits, notes: list[str]) -> str:
    """The text of doc with nvctk's runtime table cut out, or with the runtime of that
    name configure had replaced back in its place (from the backup)."""
    replaced = _replaced_runtime(bak, runtimes_keys, req)
    if replaced is not None:
        # configure had replaced someone else's runtime of that name: it comes back
        rts = get_table(doc, runtimes_keys, path)
        rts[req.name] = replaced
        edits[tuple([*runtimes_keys, req.name])] = plain(replaced)
        notes.append(f"{path}: runtime {req.name!r} back to the one configure replaced "
                     f"(from {path}'s backup)")
        return tomlkit.dumps(doc)
    text = guarded(path, remove_table_text, doc, [*runtimes_keys, req.name], path)
    doc = tomlkit.parse(text)
    _drop_empty_super(doc, runtimes_keys)
    return tomlkit.dumps(doc)
