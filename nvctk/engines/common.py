"""What every engine's configure/remove shares: reading a config file, parsing it with
the error's location, style-preserving TOML edits, and the atomic write with `.bak`.

An engine module turns the current bytes of its file(s) into the wanted bytes (a
Change per file); `apply` then writes all of them or none: every new file and every
backup is written to a temporary file beside its target first, and only when all of
those exist are they renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any

import tomlkit
import tomlkit.exceptions
import tomllib
from tomlkit.container import Container
from tomlkit.items import AoT, Comment, InlineTable, Item, Table, Whitespace

from nvctk.base import fileio
from nvctk.base.errors import ConfigError, clipped, shown

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


# --- TOML helpers ----------------------------------------------------------


def dotted(keys: list[str]) -> str:
    return ".".join(k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k) for k in keys)


def get_table(doc: Container | Table, keys: list[str], path: str, create: bool = False) -> Any:
    """The table at `keys` (None when absent and not `create`); a ConfigError when a
    component exists but is not a table. Created tables are super tables: they get no
    header of their own when only sub-tables fill them."""
    cur: Any = doc
    for i, k in enumerate(keys):
        if k not in cur:
            if not create:
                return None
            cur[k] = tomlkit.table(is_super_table=True)
        nxt = cur[k]
        if isinstance(nxt, InlineTable):
            # an inline table cannot take a sub-table, and editing it in place would
            # rewrite the user's one-line layout: refused, with the way out
            raise ConfigError(
                f"{path}: {dotted(keys[: i + 1])} is an inline table ({{...}}); nvctk edits "
                "only [table] sections: write it as [table] sections, or use --drop-in; "
                "left untouched"
            )
        if isinstance(nxt, AoT):
            raise ConfigError(
                f"{path}: {dotted(keys[: i + 1])} is an array of tables ([[...]]), not a "
                "table; left untouched"
            )
        if not isinstance(nxt, (Table, dict)):
            raise ConfigError(
                f"{path}: {dotted(keys[: i + 1])} is a {type(nxt).__name__}, not a table; left untouched"
            )
        cur = nxt
    return cur


# --- checking an edit with an independent parser -----------------------------


MISSING = object()
Edits = dict[tuple[str, ...], Any]


def _pop(d: Any, keys: tuple[str, ...]) -> Any:
    for k in keys[:-1]:
        if not isinstance(d, dict) or k not in d:
            return MISSING
        d = d[k]
    return d.pop(keys[-1], MISSING) if isinstance(d, dict) else MISSING


def _pruned(d: Any) -> Any:
    """d without empty tables (a super table that only held what was edited)."""
    if not isinstance(d, dict):
        return d
    out = {k: _pruned(v) for k, v in d.items()}
    return {k: v for k, v in out.items() if v != {} or not isinstance(d[k], dict)}


def check_edit(path: str, old: bytes, new: bytes, edits: Edits) -> None:
    """The edit did exactly what was meant, read back by another parser (tomllib):
    each key path in `edits` holds its value (MISSING: is gone) and nothing else
    changed. tomlkit places new lines by its own rules, which dotted keys and unusual
    layouts can defeat (a key landing in the wrong table): refused, not written."""
    try:
        before = tomllib.loads(old.decode("utf-8")) if old.strip() else {}
        after = tomllib.loads(new.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: nvctk's edit of this layout is not valid TOML ({e}); "
                          "left untouched: edit it by hand or use --drop-in")
    wrong = []
    for keys, want in edits.items():
        _pop(before, keys)
        got = _pop(after, keys)
        if got != want:
            wrong.append(dotted(list(keys)))
    if wrong or _pruned(before) != _pruned(after):
        where = ", ".join(wrong) or "other keys"
        raise ConfigError(f"{path}: nvctk cannot edit this layout safely ({where} would not "
                          "come out as meant: dotted keys or tables split across the file?); "
                          "left untouched: edit it by hand or use --drop-in")


# A key configure changed carries a comment with its previous value, so that
# --remove can put that back even after the file was edited by hand (its .bak then
# no longer matches): `default_runtime_name = "nvidia"  # nvctk: was "crun"`.
UNSET = object()
_WAS = re.compile(r'#\s*nvctk: was (unset|true|false|"(?:[^"\\]|\\.)*")\s*$')


def _item(tbl: Any, key: str) -> Any:
    try:
        return tbl.value.item(key) if isinstance(tbl, Table) else tbl.item(key)
    except Exception:  # a proxy of a table split across the file: no comment to use
        return None


def mark_previous(tbl: Any, key: str, previous: Any) -> None:
    """Note `previous` (None: the key was unset) in a comment on tbl[key]."""
    item = _item(tbl, key)
    if item is None or not hasattr(item, "comment"):
        return
    was = "unset" if previous is None else json.dumps(previous)
    item.comment(f"nvctk: was {was}")


def previous_value(tbl: Any, key: str) -> Any:
    """What mark_previous noted on tbl[key]: the value, UNSET, or MISSING (no note)."""
    item = _item(tbl, key)
    comment = str(getattr(getattr(item, "trivia", None), "comment", "") or "")
    m = _WAS.search(comment)
    if m is None:
        return MISSING
    return UNSET if m.group(1) == "unset" else json.loads(m.group(1))


def restore_key(tbl: Any, key: str, value: Any) -> None:
    """tbl[key] back to value (UNSET: deleted), without nvctk's note."""
    if value is UNSET:
        del tbl[key]
        return
    tbl[key] = value
    item = _item(tbl, key)
    if item is not None and _WAS.search(str(item.trivia.comment or "")):
        item.trivia.comment = ""
        item.trivia.comment_ws = ""


def guarded(path: str, fn: Any, *args: Any) -> Any:
    """fn(*args), with tomlkit's own refusals of an edit (ValueError, TOMLKitError:
    e.g. a table inside an inline table) as a ConfigError naming the file."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError,
            tomlkit.exceptions.TOMLKitError) as e:
        raise ConfigError(f"{path}: nvctk cannot edit this layout ({clipped(str(e))}); "
                          "left untouched: edit it by hand or use --drop-in")


def _body(tbl: Any) -> list[tuple[Any, Item]]:
    container = tbl.value if isinstance(tbl, Table) else tbl
    return list(container.body) if isinstance(container, Container) else []


def _key_indent(tbl: Any) -> str | None:
    """The indentation of the table's plain keys (None when it has none)."""
    for k, item in _body(tbl):
        if k is not None and not isinstance(item, (Table, AoT, Whitespace, Comment)):
            return _spaces(str(item.trivia.indent))
    return None


def _spaces(indent: str) -> str:
    """The indentation proper: tomlkit keeps a new table's leading blank line there."""
    return indent.rsplit("\n", 1)[-1]


def set_key(tbl: Any, key: str, value: Any, header_indent: str = "") -> None:
    """tbl[key] = value; an existing key keeps its place and comment, a new one gets
    the indentation of its sibling keys (tomlkit would use the header's)."""
    if key in tbl:
        tbl[key] = value
        return
    indent = _key_indent(tbl)
    tbl[key] = value
    item: Any = _item(tbl, key)
    if item is None:  # a table split across the file (a proxy): tomlkit's placement
        return
    if indent is None:
        indent = header_indent + "  " if header_indent else ""
    item.trivia.indent = indent


def table_indent(tbl: Any) -> str:
    return _spaces(str(tbl.trivia.indent)) if isinstance(tbl, Table) else ""


SENTINEL = "nvctk-placeholder-3f9c1e"


def insert_table_text(doc: tomlkit.TOMLDocument, parent_keys: list[str], name: str,
                      block: str, path: str) -> str:
    """The document's text with a new sub-table `name` under `parent_keys`, written as
    `block` (the TOML text of the table and its sub-tables, unindented, full dotted
    headers). tomlkit decides where it goes (a placeholder table marks the spot);
    `block` decides how it looks: indented like its siblings, a blank line around it."""
    parent = get_table(doc, parent_keys, path, create=True)
    sibling_indent = ""
    key_step = "  "
    for _k, item in _body(parent):
        if isinstance(item, Table):
            sibling_indent = table_indent(item)
            ki = _key_indent(item)
            if ki is not None and ki.startswith(sibling_indent) and len(ki) > len(sibling_indent):
                key_step = ki[len(sibling_indent):]
            elif ki is not None and ki == sibling_indent:
                key_step = ""
            break
    else:
        # no sibling: nest one step below the parent's header when the file indents
        pi = table_indent(parent)
        ki = _key_indent(parent)
        if ki is not None and len(ki) > len(pi):
            sibling_indent, key_step = ki, ki[len(pi):]
        elif pi:
            sibling_indent, key_step = pi + "  ", "  "
        else:
            sibling_indent, key_step = "", ""
    parent[SENTINEL] = tomlkit.table()
    parent[SENTINEL]["x"] = 1
    text = tomlkit.dumps(doc)
    del parent[SENTINEL]
    m = re.search(r"^[ \t]*\[[^\n]*" + SENTINEL + r"[^\n]*\]\n(?:[ \t]*x = 1\n?)?", text, re.M)
    if m is None:  # tomlkit rendered it some other way: keep its own rendering
        raise ConfigError(f"{path}: cannot place the new table {name} (unusual layout)")
    lines = []
    base = -1
    cur_indent = sibling_indent
    for line in block.splitlines():
        s = line.strip()
        if s.startswith("["):
            # a sub-table's header goes one step deeper per extra key (the block's
            # headers share their prefix, so counting dots is enough)
            dots = s.count(".")
            base = dots if base < 0 else base
            cur_indent = sibling_indent + key_step * (dots - base)
            lines.append(cur_indent + s)
        elif s:
            lines.append(cur_indent + key_step + s)
        else:
            lines.append("")
    new = "\n".join(lines) + "\n"
    before, after = text[: m.start()], text[m.end():]
    # comment lines right above the spot introduce what follows it: keep them there
    # (tomlkit put a blank line of its own between them and the placeholder)
    lead = re.search(r"((?:^[ \t]*#[^\n]*\n)+)\n?\Z", before, re.M)
    if lead and after.strip():
        before, after = before[: lead.start()], lead.group(1) + after
    if before and not before.endswith("\n\n"):
        new = ("\n" if before.endswith("\n") else "\n\n") + new
    if after.strip() and not after.startswith("\n"):
        new += "\n"
    return before + new + after


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


def _header_keys(line: str) -> list[str] | None:
    """The key path of a `[table]` header line, None for anything else."""
    s = line.strip()
    if not s.startswith("[") or s.startswith("[["):
        return None
    try:
        node: Any = tomlkit.parse(s + "\n").unwrap()
    except tomlkit.exceptions.TOMLKitError:
        return None
    keys = []
    while isinstance(node, dict) and len(node) == 1:
        k = next(iter(node))
        keys.append(k)
        node = node[k]
    return keys if node == {} else None


def remove_table_text(doc: tomlkit.TOMLDocument, keys: list[str], path: str) -> str:
    """The document's text without the table at `keys` and its sub-tables, cut out of
    the text: tomlkit's own deletion also drops the comments that follow the table's
    last line, which introduce the next table. The caller has the doc with the table
    still in it; the result is checked against tomlkit's deletion."""
    text = tomlkit.dumps(doc)
    parent = get_table(doc, keys[:-1], path)
    del parent[keys[-1]]
    fallback = tomlkit.dumps(doc)
    lines = text.splitlines(keepends=True)
    heads: list[tuple[int, list[str]]] = []
    for i, line in enumerate(lines):
        hk = _header_keys(line) if line.lstrip().startswith("[") else None
        if hk is not None:
            heads.append((i, hk))
    drop: set[int] = set()
    for n, (i, k) in enumerate(heads):
        if k[: len(keys)] != keys:
            continue
        j = heads[n + 1][0] if n + 1 < len(heads) else len(lines)
        end = j
        while end > i + 1 and lines[end - 1].lstrip().startswith("#"):
            end -= 1  # comments right above the next header (or ending the file) stay
        drop.update(range(i, end))
    kept = [line for i, line in enumerate(lines) if i not in drop]
    # the blank line configure put before a table that ends the file
    if drop and max(drop) == len(lines) - 1 and len(kept) > 1 and kept[-1].strip() == "":
        kept.pop()
    result = "".join(kept)
    try:
        same = tomlkit.parse(result).unwrap() == tomlkit.parse(fallback).unwrap()
    except tomlkit.exceptions.TOMLKitError:
        same = False
    return result if same else fallback
