"""Style-preserving TOML edits of an engine's config (containerd's, CRI-O's), with tomlkit:
finding a table, setting a key with its siblings' indentation, a new table's text
placed and indented like its siblings, a table cut out with its comments left in
place, the previous value noted on a changed key for --remove, and every edit read
back by an independent parser (tomllib) before it is written."""

from __future__ import annotations

import json
import re
from typing import Any

import tomlkit
import tomlkit.exceptions
import tomllib
from tomlkit.container import Container
from tomlkit.items import AoT, Comment, InlineTable, Item, Table, Whitespace

from nvctk.base.errors import ConfigError, clipped

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


def _new_table_indents(parent: Any) -> tuple[str, str]:
    """(header indent, key step) of a new sub-table of parent: its sibling tables'; with
    no sibling, one step below the parent's header when the file indents."""
    for _k, item in _body(parent):
        if isinstance(item, Table):
            sibling_indent = table_indent(item)
            ki = _key_indent(item)
            if ki is not None and ki.startswith(sibling_indent) and len(ki) > len(sibling_indent):
                return sibling_indent, ki[len(sibling_indent):]
            if ki is not None and ki == sibling_indent:
                return sibling_indent, ""
            return sibling_indent, "  "
    pi = table_indent(parent)
    ki = _key_indent(parent)
    if ki is not None and len(ki) > len(pi):
        return ki, ki[len(pi):]
    if pi:
        return pi + "  ", "  "
    return "", ""


def _indented(block: str, sibling_indent: str, key_step: str) -> str:
    """block's lines indented: its first header at sibling_indent, a sub-table's header
    one key_step deeper per extra key, each key one key_step below its header."""
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
    return "\n".join(lines) + "\n"


def insert_table_text(doc: tomlkit.TOMLDocument, parent_keys: list[str], name: str,
                      block: str, path: str) -> str:
    """The document's text with a new sub-table `name` under `parent_keys`, written as
    `block` (the TOML text of the table and its sub-tables, unindented, full dotted
    headers). tomlkit decides where it goes (a placeholder table marks the spot);
    `block` decides how it looks: indented like its siblings, a blank line around it."""
    parent = get_table(doc, parent_keys, path, create=True)
    sibling_indent, key_step = _new_table_indents(parent)
    parent[SENTINEL] = tomlkit.table()
    parent[SENTINEL]["x"] = 1
    text = tomlkit.dumps(doc)
    del parent[SENTINEL]
    m = re.search(r"^[ \t]*\[[^\n]*" + SENTINEL + r"[^\n]*\]\n(?:[ \t]*x = 1\n?)?", text, re.M)
    if m is None:  # tomlkit rendered it some other way: keep its own rendering
        raise ConfigError(f"{path}: cannot place the new table {name} (unusual layout)")
    new = _indented(block, sibling_indent, key_step)
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
