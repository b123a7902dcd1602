"""containerd: a runtime table whose runc shim calls nvctk-runtime.

Config versions: no `version` key = 1 (plugin "cri"), 2 = containerd 1.x
("io.containerd.grpc.v1.cri"), 3 = containerd 2.0-2.2 ("io.containerd.cri.v1.runtime"),
4 = containerd 2.3 (the runtime plugin as in 3; the server's own settings moved into
plugins, which nvctk does not touch). An empty or missing file gets the version the
installed containerd writes: 2 before 2.0, 3 before 2.3, else 4.

--drop-in: the runtime goes into the drop-in file and an `imports` glob for its
directory into the main file. Before containerd 2.1 an imported file's plugin table
replaces the main file's one wholesale (a runtime-only drop-in would silently drop
every other CRI setting, e.g. runc's SystemdCgroup), so there the drop-in carries a
copy of the main file's CRI plugin table with the runtime added.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
from typing import Any

import tomlkit
from tomlkit.items import Table

from nvctk.engines.common import RUNC_SHIM, ConfigError, EngineRequest, parse_toml
from nvctk.engines.containerd_layout import (
    DEFAULT_CONFIG,
    PLUGIN,
    Files,
    config_version,
    containerd_version,
    imports_glob,
    is_empty,
    paths,
    plain,
)
from nvctk.engines.containerd_remove import binary_in, strip
from nvctk.engines.toml_edit import (
    Edits,
    check_edit,
    dotted,
    get_table,
    guarded,
    insert_table_text,
    mark_previous,
    set_key,
    table_indent,
)

# what nvctk.engines.changes and the CLI name as containerd.<name>
__all__ = ["DEFAULT_CONFIG", "PLUGIN", "SERVICE", "binary_in", "configure", "containerd_version",
           "paths", "strip"]

SERVICE = "containerd"


def _default_name(doc: tomlkit.TOMLDocument, plugin: list[str], path: str) -> str:
    ctd = get_table(doc, [*plugin, "containerd"], path)
    name = ctd.get("default_runtime_name") if ctd is not None else None
    return str(name) if isinstance(name, str) and name else "runc"


CDI_ANNOTATIONS = "cdi.k8s.io/*"
# the device plugin's own container annotations (the node's vGPU limits): passed to
# the runtime as container annotations, which only the kubelet sets; never as Pod
# annotations, which a Pod's author writes
NVCTK_ANNOTATIONS = "nvctk.io/*"
CONTAINER_ANNOTATIONS = [CDI_ANNOTATIONS, NVCTK_ANNOTATIONS]


def _glob_match(pattern: str, key: str) -> bool:
    """containerd's annotation patterns are Go's path.Match: `*` stops at `/`."""
    rx = re.escape(pattern).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.fullmatch(rx, key) is not None


# nvctk's own annotations: the node's vGPU limits (nvctk.io/, the device plugin's) and
# the record of what a create added to the spec (nvctk.io/edits): a Pod's author must
# set neither, so no pod_annotations pattern of nvctk's runtime may let one through
NVCTK_PREFIXES = ("nvctk.io/",)
_NVCTK_PROBES = ("nvctk.io/x", "nvctk.io/vgpu.x", "nvctk.io/edits")


def _pod_ok(pattern: object) -> bool:
    """A pod_annotations pattern that lets none of nvctk's own annotations through."""
    return not (isinstance(pattern, str) and (
        pattern.startswith(NVCTK_PREFIXES) or any(_glob_match(pattern, k) for k in _NVCTK_PROBES)))


def _pod_note(name: str, was: list[Any], kept: list[Any]) -> str:
    return (f"runtime {name!r}: pod_annotations no longer passes nvctk's own annotations "
            f"({', '.join(p + '*' for p in NVCTK_PREFIXES)}: a Pod's author must not set the "
            f"node's limits nor nvctk's edit records): {was} -> {kept}; list the Pod "
            "annotations this runtime needs by name or prefix")


def _annotations(current: object) -> list[Any]:
    annotations = list(current) if isinstance(current, list) else []
    return annotations + [a for a in CONTAINER_ANNOTATIONS if a not in annotations]


def _source_runtime(doc: tomlkit.TOMLDocument, plugin: list[str], req: EngineRequest,
                    path: str) -> dict[str, Any]:
    """The runtime whose settings the new one copies: the default one when it is a
    runc-shim runtime other than ours, else "runc"; {} when neither is in the file."""
    runtimes = get_table(doc, [*plugin, "containerd", "runtimes"], path)
    if runtimes is None:
        return {}
    for name in (_default_name(doc, plugin, path), "runc"):
        rt = runtimes.get(name)
        if name != req.name and isinstance(rt, dict) and rt.get("runtime_type", RUNC_SHIM) == RUNC_SHIM:
            return dict(plain(rt))
    return {}


def _entry(source: dict[str, Any], binary: str, name: str, notes: list[str]) -> dict[str, Any]:
    """The new runtime's settings: the source's scalar settings and options, with the
    runc shim as type and nvctk-runtime as BinaryName, but no pod_annotations pattern
    that passes nvctk's own annotations (said in notes)."""
    entry: dict[str, Any] = {"runtime_type": RUNC_SHIM}
    for k, v in source.items():
        if k not in ("runtime_type", "options") and not isinstance(v, dict):
            entry[k] = v
    # containerd's CRI hands a Pod's annotations to the runtime only where listed: the
    # device plugin's cdi-annotations requests (cdi.k8s.io/*) need it, as NVIDIA's
    # `nvidia-ctk runtime configure` sets it
    entry["container_annotations"] = _annotations(entry.get("container_annotations"))
    pods = entry.get("pod_annotations")
    if isinstance(pods, list) and not all(_pod_ok(a) for a in pods):
        entry["pod_annotations"] = [a for a in pods if _pod_ok(a)]
        notes.append(_pod_note(name, pods, entry["pod_annotations"]))
    opts = source.get("options")
    options: dict[str, Any] = {"BinaryName": binary}
    if isinstance(opts, dict):
        for k, v in opts.items():
            if k != "BinaryName":
                options[k] = v
    entry["options"] = options
    return entry


def _literal_style(text: str) -> bool:
    """Whether the file writes strings '...' (containerd 2.x's `config default` does)."""
    return len(re.findall(r"= '", text)) > len(re.findall(r'= "', text))


def _styled(value: Any, literal: bool) -> Any:
    """value with its strings written the file's way."""
    if literal and isinstance(value, str) and "'" not in value and "\n" not in value:
        return tomlkit.string(value, literal=True)
    if literal and isinstance(value, list):
        arr = tomlkit.array()
        arr.extend(_styled(v, literal) for v in value)
        return arr
    return value


def _dotted_styled(keys: list[str], literal: bool) -> str:
    if not literal:
        return dotted(keys)
    return ".".join(k if re.fullmatch(r"[A-Za-z0-9_-]+", k) or "'" in k else f"'{k}'"
                    for k in keys)


def _block(runtimes_keys: list[str], name: str, entry: dict[str, Any], literal: bool) -> str:
    head = _dotted_styled([*runtimes_keys, name], literal)
    lines = [f"[{head}]"]
    lines += [tomlkit.dumps({k: _styled(v, literal)}).strip()
              for k, v in entry.items() if k != "options"]
    lines += ["", f"[{head}.options]"]
    lines += [tomlkit.dumps({k: _styled(v, literal)}).strip() for k, v in entry["options"].items()]
    return "\n".join(lines) + "\n"


def _header_indent(tbl: Any) -> str:
    return table_indent(tbl) if isinstance(tbl, Table) else ""


def _ensure_table(doc: Any, keys: list[str], path: str) -> Any:
    """The table at keys, created (with a header) when missing."""
    parent = get_table(doc, keys[:-1], path, create=True)
    if keys[-1] not in parent:
        parent[keys[-1]] = tomlkit.table()
    return get_table(doc, keys, path)


def _add(doc: tomlkit.TOMLDocument, path: str, version: int, req: EngineRequest,
         source: dict[str, Any], notes: list[str], need_runc: bool) -> str:
    """The text of `doc` with nvctk's runtime (and default/CDI) in it, checked."""
    before = tomlkit.dumps(doc)
    edits: Edits = {}
    text = guarded(path, _edit, doc, path, version, req, source, notes, need_runc, edits)
    check_edit(path, before.encode(), text.encode(), edits)
    return text


def _edit(doc: tomlkit.TOMLDocument, path: str, version: int, req: EngineRequest,
          source: dict[str, Any], notes: list[str], need_runc: bool, edits: Edits) -> str:
    plugin = PLUGIN[version]
    runtimes_keys = [*plugin, "containerd", "runtimes"]
    lit = _literal_style(tomlkit.dumps(doc))
    _set_default_and_cdi(doc, plugin, req, lit, path, edits)
    runtimes = get_table(doc, runtimes_keys, path)
    existing = runtimes.get(req.name) if runtimes is not None else None
    if existing is None:
        entry = _entry(source, req.runtime_path, req.name, notes)
        edits[tuple([*runtimes_keys, req.name])] = entry
        block = _block(runtimes_keys, req.name, entry, lit)
        if need_runc:
            # containerd's built-in "runc" runtime exists only while the file names no
            # runtime at all; once it names one, a missing default runtime makes the CRI
            # plugin fail to load ("no corresponding runtime configured")
            runc = (f"[{_dotted_styled([*runtimes_keys, 'runc'], lit)}]\n"
                    f"{tomlkit.dumps({'runtime_type': _styled(RUNC_SHIM, lit)})}")
            block = runc + "\n" + block
            edits[tuple([*runtimes_keys, "runc"])] = {"runtime_type": RUNC_SHIM}
            notes.append(f"{path} named no runtime: added runc too (containerd's built-in "
                         "one goes once the file names any)")
        return insert_table_text(doc, runtimes_keys, req.name, block, path)
    if not isinstance(existing, Table):
        raise ConfigError(f"{path}: {dotted([*runtimes_keys, req.name])} is not a table; left untouched")
    _update_entry(existing, (*runtimes_keys, req.name), req, lit, path, notes, edits)
    return tomlkit.dumps(doc)


def _set_default_and_cdi(doc: tomlkit.TOMLDocument, plugin: list[str], req: EngineRequest,
                         lit: bool, path: str, edits: Edits) -> None:
    """default_runtime_name and enable_cdi as asked, each with its previous value noted."""
    if req.set_as_default:
        ctd = _ensure_table(doc, [*plugin, "containerd"], path)
        prev = ctd.get("default_runtime_name")
        if prev != req.name:
            set_key(ctd, "default_runtime_name", _styled(req.name, lit), _header_indent(ctd))
            if prev is not None and prev != "runc":  # remove's fallback is runc
                mark_previous(ctd, "default_runtime_name", plain(prev))
        edits[(*plugin, "containerd", "default_runtime_name")] = req.name
    if req.cdi:
        cri = _ensure_table(doc, plugin, path)
        prev = cri.get("enable_cdi")
        if prev is not True:
            set_key(cri, "enable_cdi", True, _header_indent(cri))
            mark_previous(cri, "enable_cdi", plain(prev))
        edits[(*plugin, "enable_cdi")] = True


def _update_entry(existing: Table, here: tuple[str, ...], req: EngineRequest, lit: bool,
                  path: str, notes: list[str], edits: Edits) -> None:
    """A runtime table of that name already there: the runc shim running nvctk-runtime,
    with the annotations it needs and none of nvctk's own passed from a Pod."""
    opts = existing.get("options")
    if existing.get("runtime_type") != RUNC_SHIM or not isinstance(opts, dict) \
            or opts.get("BinaryName") != req.runtime_path:
        was = opts.get("BinaryName") if isinstance(opts, dict) else None
        notes.append(f"runtime {req.name!r} existed in {path} (BinaryName {was!r}): "
                     f"now runs {req.runtime_path}")
        set_key(existing, "runtime_type", _styled(RUNC_SHIM, lit), _header_indent(existing))
        if not isinstance(opts, Table):
            existing["options"] = tomlkit.table()
            opts = existing["options"]
        set_key(opts, "BinaryName", _styled(req.runtime_path, lit), _header_indent(opts))
    edits[(*here, "runtime_type")] = RUNC_SHIM
    edits[(*here, "options", "BinaryName")] = req.runtime_path
    # an entry of an older nvctk (or someone else's): the annotations it needs too
    current = plain(existing.get("container_annotations"))
    wanted = _annotations(current)
    if wanted != current:
        set_key(existing, "container_annotations", _styled(wanted, lit), _header_indent(existing))
    edits[(*here, "container_annotations")] = wanted
    pods = plain(existing.get("pod_annotations"))
    if isinstance(pods, list) and not all(_pod_ok(a) for a in pods):
        kept = [a for a in pods if _pod_ok(a)]
        notes.append(_pod_note(req.name, pods, kept))
        set_key(existing, "pod_annotations", _styled(kept, lit), _header_indent(existing))
        pods = kept
    if isinstance(pods, list):
        edits[(*here, "pod_annotations")] = pods


def configure(req: EngineRequest, old: Files) -> tuple[Files, list[str]]:
    notes: list[str] = []
    main_path = paths(req)[0]
    main_doc = parse_toml(main_path, old[main_path] or b"")
    version = config_version(main_doc, main_path)
    if is_empty(main_doc):
        main_doc["version"] = version
    plugin = PLUGIN[version]
    source = _source_runtime(main_doc, plugin, req, main_path)
    main_runtimes = get_table(main_doc, [*plugin, "containerd", "runtimes"], main_path)
    need_runc = main_runtimes is None or len(main_runtimes) == 0
    if req.cdi:
        v = containerd_version()
        if v is not None and v < (1, 7) and version <= 2:
            notes.append(f"containerd {v[0]}.{v[1]} ignores enable_cdi (CDI came in 1.7)")
    if not req.drop_in:
        return {main_path: _add(main_doc, main_path, version, req, source, notes, need_runc).encode()}, notes
    if version == 1:
        raise ConfigError(f"{main_path}: config version 1 cannot import drop-ins; convert it to "
                          "version 2 or configure without --drop-in")
    di_path = req.drop_in
    di_doc = parse_toml(di_path, old[di_path] or b"")
    if is_empty(di_doc):
        di_doc["version"] = version
        cv = containerd_version()
        main_cri = get_table(main_doc, plugin, main_path)
        if (cv is None or cv < (2, 1)) and main_cri is not None:
            # this containerd replaces the main file's plugin table with the imported one
            get_table(di_doc, plugin[:-1], di_path, create=True)[plugin[-1]] = copy.deepcopy(main_cri)
            notes.append(f"containerd {'.'.join(map(str, cv)) if cv else '(unknown version)'} "
                         f"replaces the main file's {plugin[-1]} table with the drop-in's: "
                         f"{di_path} carries a copy of it; edit CRI settings there from now on")
    elif config_version(di_doc, di_path) != version:
        raise ConfigError(f"{di_path}: config version {config_version(di_doc, di_path)} differs from "
                          f"{main_path}'s {version}; left untouched")
    di_text = _add(di_doc, di_path, version, req, source, notes, need_runc)
    glob = imports_glob(di_path)
    imports = main_doc.get("imports")
    if imports is None:
        main_doc["imports"] = [glob]
    elif not isinstance(imports, list):
        raise ConfigError(f"{main_path}: imports is not an array; left untouched")
    elif not any(isinstance(p, str) and fnmatch.fnmatch(os.path.abspath(di_path), p) for p in imports):
        imports.append(glob)
    main_text = tomlkit.dumps(main_doc).encode()
    edits: Edits = {("imports",): plain(main_doc["imports"])}
    if is_empty(parse_toml(main_path, old[main_path] or b"")):
        edits[("version",)] = version
    check_edit(main_path, old[main_path] or b"", main_text, edits)
    return {main_path: main_text, di_path: di_text.encode()}, notes
