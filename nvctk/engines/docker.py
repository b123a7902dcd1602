"""Docker: `runtimes.<name> = {"path": ..., "runtimeArgs": []}` in daemon.json.

JSON keeps no comments, so the file is rewritten from its parsed value with the
same key order, the indentation it used (detected) and its final newline; a file
laid out that way already (Docker's docs, `json.dumps(indent=N)`, nvidia-ctk) gets
only the new lines.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nvctk.engines.common import (
    ConfigError,
    EngineRequest,
    is_our_binary,
    loads_json,
    not_ours,
    parse_json_object,
)

SERVICE = "docker"
DEFAULT_CONFIG = "/etc/docker/daemon.json"

Files = dict[str, "bytes | None"]


def paths(req: EngineRequest) -> list[str]:
    if req.drop_in:
        raise ConfigError("Docker has no drop-in files: --drop-in is for containerd and CRI-O")
    return [req.config or DEFAULT_CONFIG]


def _indent(text: str) -> str | int:
    m = re.search(r"^([ \t]+)\"", text, re.M)
    return m.group(1) if m else 2


def _dump(value: dict[str, Any], like: str) -> bytes:
    # ensure_ascii for what UTF-8 cannot carry: a JSON \ud800 escape (a lone surrogate)
    # the file held is written back as that escape, not a traceback
    try:
        text = json.dumps(value, indent=_indent(like), ensure_ascii=False)
        data = text.encode()
    except UnicodeEncodeError:
        text = json.dumps(value, indent=_indent(like), ensure_ascii=True)
        data = text.encode()
    return data + b"\n" if like.endswith("\n") or not like.strip() else data


def _object(parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = parent.setdefault(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key!r} is not a JSON object; left untouched")
    return value


def configure(req: EngineRequest, old: Files) -> tuple[Files, list[str]]:
    path = paths(req)[0]
    raw = old[path] or b""
    cfg = parse_json_object(path, raw)
    notes: list[str] = []
    runtimes = _object(cfg, "runtimes", path)
    cur = runtimes.get(req.name)
    want = {"path": req.runtime_path, "runtimeArgs": []}
    if not (isinstance(cur, dict) and cur.get("path") == req.runtime_path):
        if cur is not None:
            notes.append(f"runtime {req.name!r} existed in {path} ({json.dumps(cur)}): "
                         f"now runs {req.runtime_path}")
        runtimes[req.name] = want
    if req.set_as_default:
        cfg["default-runtime"] = req.name
    if req.cdi:
        _object(cfg, "features", path)["cdi"] = True
    return {path: _dump(cfg, raw.decode("utf-8", "replace"))}, notes


def binary_in(req: EngineRequest, old: Files) -> str | None:
    path = paths(req)[0]
    if old[path] is None:
        return None
    rt = parse_json_object(path, old[path] or b"").get("runtimes", {})
    entry = rt.get(req.name) if isinstance(rt, dict) else None
    value = entry.get("path") if isinstance(entry, dict) else None
    return value if isinstance(value, str) else None


def _bak_key(bak: bytes | None, key: str) -> Any:
    """daemon.json.bak's value of key; None when there is none or no JSON object."""
    if bak is None:
        return None
    try:  # loads_json: a value of it may be written back (strip)
        return loads_json(bak).get(key)
    except (ValueError, AttributeError, RecursionError):
        return None


def _bak_default(bak: bytes | None, req: EngineRequest) -> str | None:
    """daemon.json.bak's default-runtime when it is not nvctk's: what configure
    replaced (JSON keeps no comment to note it in), None when unknown or unset."""
    value = _bak_key(bak, "default-runtime")
    return value if isinstance(value, str) and value != req.name else None


def _bak_runtime(bak: bytes | None, req: EngineRequest) -> Any:
    """daemon.json.bak's runtime of req.name when it is someone else's, else None."""
    rts = _bak_key(bak, "runtimes")
    entry = rts.get(req.name) if isinstance(rts, dict) else None
    if not isinstance(entry, dict) or is_our_binary(entry.get("path"), req):
        return None
    return entry


def strip(req: EngineRequest, old: Files, baks: Files | None = None) -> tuple[Files | None, list[str]]:
    path = paths(req)[0]
    if old[path] is None:
        return None, []
    raw = old[path] or b""
    cfg = parse_json_object(path, raw)
    runtimes = cfg.get("runtimes")
    entry = runtimes.get(req.name) if isinstance(runtimes, dict) else None
    if entry is None:
        return None, []
    binary = entry.get("path") if isinstance(entry, dict) else None
    if not is_our_binary(binary, req):
        raise not_ours(path, req, "path", binary)
    notes: list[str] = []
    assert isinstance(runtimes, dict)
    was = _bak_runtime((baks or {}).get(path), req)
    if was is not None:
        # configure had replaced someone else's runtime of that name: it comes back
        runtimes[req.name] = was
        notes.append(f"{path}: runtime {req.name!r} back to the one configure replaced")
    else:
        del runtimes[req.name]
    if not runtimes:
        del cfg["runtimes"]
    if cfg.get("default-runtime") == req.name:
        was = _bak_default((baks or {}).get(path), req)
        if was is None:
            del cfg["default-runtime"]
            notes.append(f"{path}: default-runtime removed (Docker's default, runc, applies)")
        else:
            cfg["default-runtime"] = was
            notes.append(f"{path}: default-runtime set back to {was!r}")
    features = cfg.get("features")
    if isinstance(features, dict) and features.get("cdi") is True:
        notes.append(f"{path}: features.cdi left as it is (nvctk cannot tell who set it)")
    # the file stays, even when nothing else is left: only a file configure created
    # (plan_remove's restore of a missing backup) is deleted
    return {path: _dump(cfg, raw.decode("utf-8", "replace"))}, notes
