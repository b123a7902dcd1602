"""CDI spec files: list, load and check them, find the named devices.

What nvctk-runtime's CDI mode reads (nvctk.cdi.resolve reads the devices' edits for the
planner, nvctk.plan.cdi, and nvctk.cdi.check checks them) and `nvctk cdi list` lists.
No planner here.
"""

from __future__ import annotations

import os

from nvctk.base import jsonio, stamped
from nvctk.base.config import cache_name
from nvctk.base.errors import CdiError, clipped, shown

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

VENDOR = "nvidia.com"
CLASS = "gpu"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


# --- nvctk cdi list --------------------------------------------------------------------------


# A spec file larger than this is refused unread: NVIDIA's spec for 8 GPUs with MIG is
# well under 100 KiB. The loaded document's JSON size is bounded too (YAML aliases can
# make a 1 MB file load as gigabytes: each *alias is a copy in config.json).
MAX_SPEC_BYTES = 4 << 20
MAX_LOADED_BYTES = 16 << 20


def load_spec_file(path: str) -> dict[str, Any]:
    """A spec file, parsed and checked against the CDI schema; CdiError says why not.
    Never blocks (a FIFO, /dev/zero) and never raises anything else: a broken file is
    one unreadable spec, the others still resolve."""
    from nvctk.base.fileio import read_regular_file

    try:
        text = read_regular_file(path, MAX_SPEC_BYTES)
    except OSError as e:
        raise CdiError(f"{path}: {e.strerror or e}")
    try:
        # JSON is YAML, but PyYAML parses it ~50x slower than jsonio (and the CDI
        # create path would import yaml): a JSON document goes to jsonio
        spec = _parse(text)
    except ValueError as e:
        raise CdiError(f"{path}: not a CDI spec: {e}")
    except Exception as e:  # the parser's own failures, any kind
        raise CdiError(f"{path}: not a CDI spec: {type(e).__name__}: {str(e)[:200]}")
    try:
        size = len(jsonio.dumps(spec, ensure_ascii=False))
    except (RecursionError, ValueError, TypeError) as e:
        raise CdiError(f"{path}: not a CDI spec: {type(e).__name__} ({str(e)[:200]})")
    if size > MAX_LOADED_BYTES:
        raise CdiError(f"{path}: loads as more than {MAX_LOADED_BYTES >> 20} MiB of JSON "
                       "(YAML aliases?); refused")
    problem = schema_problem(spec)
    if problem:
        raise CdiError(f"{path}: {problem}")
    return spec  # type: ignore[no-any-return]


def _parse(text: bytes) -> Any:
    """JSON through jsonio, anything else (YAML, or a flow-style YAML mapping that
    looks like JSON) through yamlio."""
    if text.lstrip()[:1] == b"{":
        try:
            return jsonio.loads(text)
        except (ValueError, RecursionError):
            pass  # maybe YAML's flow style ({kind: x}): YAML says
    from nvctk.base import yamlio  # start time: YAML specs only (yaml and typing)

    return yamlio.load(text)


def schema_problem(spec: Any) -> str | None:
    """Why spec is no valid CDI spec (None: it is): the structural checks CDI runtimes
    make (kind vendor/class, device names, unique names)."""
    if not isinstance(spec, dict):
        return "not a CDI spec (no mapping at the top)"
    for key in ("cdiVersion", "kind", "devices"):
        if key not in spec:
            return f"missing {key}"
    kind = spec["kind"]
    if not isinstance(kind, str) or kind.count("/") != 1 or not all(kind.split("/")):
        return f"kind {kind!r} is not vendor/class"
    devs = spec["devices"]
    if not isinstance(devs, list) or not devs:
        return "devices must be a non-empty list"
    names: set[str] = set()
    for d in devs:
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"]:
            return "a device without a name"
        n = d["name"]
        if not all(c.isascii() and (c.isalnum() or c in "_.:-") for c in n) \
                or not n[0].isalnum() or not n[-1].isalnum():
            return f"invalid device name {shown(n)}"
        if n in names:
            return f"device {n!r} appears twice"
        names.add(n)
        if not isinstance(d.get("containerEdits"), dict):
            return f"device {n!r} has no containerEdits"
    return None


def list_devices(spec_dirs: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(qualified names, warnings) of the *.json|*.yaml specs in spec_dirs, found as
    `resolve` finds them (spec_files, load_spec_file)."""
    found: set[str] = set()
    files, warnings = spec_files(spec_dirs)
    for _, spec in _loaded(files, warnings, None):
        found.update(f"{spec['kind']}={dev['name']}" for dev in spec["devices"])
    return sorted(found), warnings


def _loaded(files: list[str], broken: list[str], cache: SpecCache | None
            ) -> list[tuple[str, dict[str, Any]]]:
    """(path, spec) of each file that loads; why the others do not goes to `broken`:
    a broken file is one unreadable spec, never the end of the others. cache: the
    parsed and checked specs of these files' spec dirs, keyed by each file's stat."""
    out = []
    for path in files:
        try:
            if cache is None:
                out.append((path, load_spec_file(path)))
                continue
            st = stamped.stat_stamp(path)
            spec = cache.get(path, st)
            if spec is None:
                spec = load_spec_file(path)
                if st is not None and st == stamped.stat_stamp(path):  # unchanged while it was read
                    cache.put(path, st, spec)
            out.append((path, spec))
        except CdiError as e:
            broken.append(str(e))
    if cache is not None:
        cache.keep_only(files)
        cache.save()
    return out


# --- the parsed-spec cache ---------------------------------------------------------------

_CACHE_VERSION = 2  # 1: one cdi-specs.json for every configuration


def spec_cache_path(directory: str, spec_dirs: tuple[str, ...]) -> str:
    """The cache file of one list of spec dirs: cdi-specs-<FNV-1a 64 of the list>.json."""
    return os.path.join(directory, f"cdi-specs-{cache_name(chr(0).join(spec_dirs))}.json")


class SpecCache:
    """The specs CDI mode read before from one list of spec dirs, parsed and checked
    (load_spec_file), keyed by their files' stat (dev, inode, size, mtime, ctime): a
    create whose specs did not change parses one JSON file, not YAML (PyYAML: ~10 ms
    import, ~1 ms per 10 KB). One file per list of spec dirs (spec_cache_path), the
    list written in it and checked on reading: configurations with other dirs, used in
    turn, keep their own and never read another's. Kept in a root-owned directory no
    one else can write (nvctk-runtime's passthrough cache dir), itself root's and
    written atomically; anything else there is ignored. A file changed too recently for
    its stamp to show a change is not cached yet (nvctk.base.stamped: the stamp, the
    racy rule, the trusted read and write)."""

    def __init__(self, directory: str, spec_dirs: tuple[str, ...]) -> None:
        self.dirs = list(spec_dirs)
        self.path = spec_cache_path(directory, spec_dirs)
        self.entries: dict[str, list[Any]] = {}
        self.changed = False
        raw = stamped.read_cache(self.path, 0o644, limit=MAX_LOADED_BYTES)
        try:
            data = jsonio.loads(raw) if raw is not None else None
        except (ValueError, RecursionError):
            data = None  # not one to use: the specs are read
        if isinstance(data, dict) and data.get("version") == _CACHE_VERSION \
                and data.get("dirs") == self.dirs and isinstance(data.get("files"), dict):
            self.entries = data["files"]

    def get(self, path: str, st: list[int] | None) -> dict[str, Any] | None:
        e = self.entries.get(path)
        if st is None or not isinstance(e, list) or len(e) != 2 or e[0] != st \
                or schema_problem(e[1]) is not None:
            return None
        return e[1]  # type: ignore[no-any-return]

    def put(self, path: str, st: list[int], spec: dict[str, Any]) -> None:
        if not stamped.racy(st[4]):
            self.entries[path] = [st, spec]
            self.changed = True

    def keep_only(self, files: list[str]) -> None:
        """Forget the specs of files no longer in the spec dirs (a removed or renamed
        spec): the cache holds what a create reads, nothing more."""
        gone = self.entries.keys() - set(files)
        for path in gone:
            del self.entries[path]
        self.changed |= bool(gone)

    def save(self) -> None:
        if not self.changed:
            return
        try:
            data = jsonio.dumps({"version": _CACHE_VERSION, "dirs": self.dirs,
                                 "files": self.entries}).encode()
        except ValueError:
            return  # no cache this time: the next create reads the specs again
        if len(data) <= MAX_LOADED_BYTES:
            stamped.write_cache(self.path, data, 0o644)


# --- nvctk-runtime's CDI mode: the named devices (nvctk.cdi.resolve reads their edits) ---

class Resolved:
    """One requested device: the spec file it is in, the spec, and its entry."""

    def __init__(self, name: str, path: str, spec: dict[str, Any], device: dict[str, Any]) -> None:
        self.name = name
        self.path = path
        self.spec = spec
        self.device = device


def spec_files(spec_dirs: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the *.json|*.yaml files of spec_dirs, the dirs that could not be listed); a
    later dir's file replaces an earlier dir's file of the same name (CDI's priority
    rule). A missing dir is no problem."""
    files: dict[str, str] = {}
    problems: list[str] = []
    for d in spec_dirs:
        try:
            entries = sorted(os.listdir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            problems.append(f"CDI spec dir {d}: {e.strerror}")
            continue
        for name in entries:
            if name.endswith((".json", ".yaml")):
                files[name] = os.path.join(d, name)
    return list(files.values()), problems


def check_vendors(names: tuple[str, ...], vendors: tuple[str, ...], source: str) -> None:
    """RequestError for a name whose vendor is not one of vendors (config cdi-vendors):
    a container's env, annotations or device mounts name devices of those vendors only.
    Another vendor's spec may bind any host path read-write into the container; the
    engine (containerd, podman) applies such devices itself, where its operator asked."""
    from nvctk.base.errors import RequestError
    from nvctk.request.parse import parse_qualified

    for n in names:
        parts = parse_qualified(n)
        vendor = parts[0] if parts else ""
        if vendor not in vendors:
            raise RequestError(
                f"CDI device {clipped(n, 200)} (from {source}): vendor {shown(vendor)} is not one "
                f"nvctk applies devices of (cdi-vendors = {list(vendors)} in the nvctk config; "
                "an operator adds a vendor there)")


def resolve(names: tuple[str, ...], spec_dirs: tuple[str, ...],
            cache_dir: str | None = None) -> list[Resolved]:
    """Each qualified name's device from the specs in spec_dirs (read with
    load_spec_file, as `nvctk cdi list` does; cache_dir: SpecCache's dir). CdiError for
    a name no readable spec defines (naming the unreadable ones), or one that two spec
    files define."""
    found: dict[str, Resolved] = {}
    twice: dict[str, list[str]] = {}
    broken: list[str] = []
    files, problems = spec_files(spec_dirs)
    if problems:
        raise CdiError(problems[0])
    cache = SpecCache(cache_dir, spec_dirs) if cache_dir else None
    for path, spec in _loaded(files, broken, cache):
        for dev in spec["devices"]:
            q = f"{spec['kind']}={dev['name']}"
            if q in found:
                twice.setdefault(q, [found[q].path]).append(path)
            else:
                found[q] = Resolved(q, path, spec, dev)
    out = []
    for n in names:
        if n in twice:
            raise CdiError(f"CDI device {n} is defined by more than one spec file: "
                           f"{' and '.join(twice[n])} (remove one)")
        if n not in found:
            kind = n.partition("=")[0]
            known = [q.partition("=")[2] for q in found if q.startswith(kind + "=")]
            hint = (f"; {kind} has: {clipped(', '.join(known[:12]))}"
                    f"{', ...' if len(known) > 12 else ''}"
                    if known else f"; no spec defines kind {kind}")
            if broken:
                hint += f"; unreadable specs: {clipped('; '.join(broken[:3]), 900)}"
            raise CdiError(f"unresolvable CDI device {clipped(n, 200)}: not in the CDI specs of "
                           f"{', '.join(spec_dirs)}{hint}")
        out.append(found[n])
    return out
