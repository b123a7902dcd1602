"""CDI spec files: list, load and check them, find the named devices.

What nvctk-runtime's CDI mode reads (nvctk.cdi.resolve turns the devices into the
edits form) and `nvctk cdi list` lists. No planner here: `nvctk cdi generate`
(nvctk.cdi.generate) is the part that plans.
"""

from __future__ import annotations

import os
import stat

from nvctk.base import jsonio, stamped
from nvctk.base.config import cache_name
from nvctk.base.errors import NvctkError, clipped, shown
from nvctk.base.inroot import resolve_in_root

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

VENDOR = "nvidia.com"
CLASS = "gpu"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
# the options `nvctk cdi generate` writes: a read-only file, a writable IPC path
FILE_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
IPC_OPTIONS = ("nosuid", "nodev", "rbind", "rprivate", "noexec")


def bind_options(read_only: bool, noexec: bool) -> tuple[str, ...]:
    """The options of a bind mount nvctk's form makes (FILE_OPTIONS, IPC_OPTIONS, ...)."""
    base = ("nosuid", "nodev", "rbind", "rprivate")
    return (*(("ro",) if read_only else ()), *base, *(("noexec",) if noexec else ()))


# the other way: (read_only, noexec) of the options `nvctk cdi generate` writes
BIND_FLAGS = {bind_options(r, x): (r, x) for r in (True, False) for x in (True, False)}


class CdiError(NvctkError):
    pass


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


# --- nvctk-runtime's CDI mode: the named devices (nvctk.cdi.resolve makes them the form) ---

HOOK_STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart",
               "poststop")
# containerEdits fields nvctk applies; any other (intelRdt, additionalGIDs, netDevices) is
# refused by name rather than dropped: the container would lack what its spec promises
_EDIT_FIELDS = frozenset({"env", "deviceNodes", "mounts", "hooks"})
_NODE_FIELDS = frozenset({"path", "hostPath", "type", "major", "minor", "fileMode",
                          "permissions", "uid", "gid"})
_MOUNT_FIELDS = frozenset({"hostPath", "containerPath", "options", "type"})
_HOOK_FIELDS = frozenset({"hookName", "path", "args", "env", "timeout"})


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


# device numbers, mode and owner as the kernel and runc (Go int64/uint32) take them
_NODE_LIMITS = {"major": 2**32 - 1, "minor": 2**32 - 1, "fileMode": 0o7777,
                "uid": 2**32 - 2, "gid": 2**32 - 2}


def _strings(value: Any) -> list[str]:
    """Every string in a loaded JSON/YAML value (keys included)."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def _edit_problem(edits: Any) -> str | None:
    """Why a containerEdits object is not one nvctk can apply (None: it is)."""
    if not isinstance(edits, dict):
        return "containerEdits must be an object"
    for key, value in edits.items():
        if key not in _EDIT_FIELDS:
            return f"containerEdits.{key} is not supported by nvctk"
        if not isinstance(value, list):
            return f"containerEdits.{key} must be a list"
    for e in edits.get("env", ()):
        if not isinstance(e, str) or "=" not in e or e.startswith("="):
            return f"env entry {e!r} is not NAME=VALUE"
        if "\0" in e:
            return f"env entry {e.partition('=')[0][:40]!r} contains a NUL byte"
    for n in edits.get("deviceNodes", ()):
        if not isinstance(n, dict) or set(n) - _NODE_FIELDS:
            return f"deviceNode {n!r}: unknown field or not an object"
        for k in ("path", "hostPath"):
            if k in n and not (isinstance(n[k], str) and n[k].startswith("/")):
                return f"deviceNode {k} {n.get(k)!r} must be an absolute path"
        if "path" not in n:
            return "a deviceNode without a path"
        if n.get("type", "c") not in ("c", "b", "u"):
            return f"deviceNode {n['path']}: type {n['type']!r} is not c, b or u"
        for k in ("major", "minor", "fileMode", "uid", "gid"):
            if k in n and (not isinstance(n[k], int) or isinstance(n[k], bool) or n[k] < 0):
                return f"deviceNode {n['path']}: {k} must be a non-negative integer"
            if k in n and n[k] > _NODE_LIMITS[k]:  # what runc (Go) and the kernel take
                return f"deviceNode {n['path']}: {k} is larger than {_NODE_LIMITS[k]:#o}" \
                    if k == "fileMode" else \
                    f"deviceNode {n['path']}: {k} is larger than {_NODE_LIMITS[k]}"
        perms = n.get("permissions", "rwm")
        if not isinstance(perms, str) or not perms or set(perms) - set("rwm"):
            return f"deviceNode {n['path']}: permissions {perms!r} is not made of r, w, m"
    for m in edits.get("mounts", ()):
        if not isinstance(m, dict) or set(m) - _MOUNT_FIELDS:
            return f"mount {m!r}: unknown field or not an object"
        for k in ("hostPath", "containerPath"):
            if not (isinstance(m.get(k), str) and m[k].startswith("/")):
                return f"mount {k} {m.get(k)!r} must be an absolute path"
        opts = m.get("options", [])
        if not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
            return f"mount {m['containerPath']}: options must be a list of strings"
        if not isinstance(m.get("type", ""), str):
            return f"mount {m['containerPath']}: type must be a string"
    for h in edits.get("hooks", ()):
        if not isinstance(h, dict) or set(h) - _HOOK_FIELDS:
            return f"hook {h!r}: unknown field or not an object"
        if h.get("hookName") not in HOOK_STAGES:
            return f"hook hookName {h.get('hookName')!r} is not one of {', '.join(HOOK_STAGES)}"
        if not (isinstance(h.get("path"), str) and h["path"].startswith("/")):
            return f"hook path {h.get('path')!r} must be an absolute path"
        for k in ("args", "env"):
            if k in h and not (isinstance(h[k], list) and all(isinstance(a, str) for a in h[k])):
                return f"hook {h['path']}: {k} must be a list of strings"
        t = h.get("timeout")
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or not
                              1 <= t <= 2**31 - 1):
            return f"hook {h['path']}: timeout must be an integer from 1 to {2**31 - 1}"
    for text in _strings(edits):
        if "\0" in text:
            return f"a string contains a NUL byte ({text.partition(chr(0))[0][:40]!r}...)"
    return None


# --- nothing created on a host directory bound into the container ------------------------


def _link_paths(hook: dict[str, Any]) -> list[str]:
    """The links a create-symlinks hook (nvctk-hook's or nvidia-cdi-hook's) or nvctk-hook
    cdi-edits makes:
    each `--link target::path` (or `--link=...`)."""
    args = hook.get("args") or []
    if "create-symlinks" not in args and "cdi-edits" not in args:
        return []
    out = []
    for i, a in enumerate(args):
        value = args[i + 1] if a == "--link" and i + 1 < len(args) else \
            a.partition("=")[2] if a.startswith("--link=") else None
        if value and "::" in value:
            out.append(value.partition("::")[2])
    return out


def _is_host_bind(m: Any) -> bool:
    if not isinstance(m, dict):
        return False
    opts = m.get("options")
    return m.get("type") == "bind" or (isinstance(opts, list) and bool({"bind", "rbind"} & set(opts)))


class _InRootfs:
    """Paths as runc reaches them in the rootfs: their symlinks resolved inside it
    (/lib/x86_64-linux-gnu is /usr/lib/x86_64-linux-gnu in a merged-/usr image). One
    per check: the links met are looked up once for all its paths (they share their
    directories), as the rootfs does not change while it runs."""

    def __init__(self, rootfs: str | None) -> None:
        self.rootfs = rootfs
        self.top = (rootfs or "").rstrip("/")  # resolve_in_root's results start with it
        self.links: dict[str, str | None] = {}

    def __call__(self, path: str) -> str:
        path = "/" + os.path.normpath(path).lstrip("/")  # runc's //x is /x, as is resolve_in_root's
        if self.rootfs is None:
            return path
        try:
            real = resolve_in_root(self.rootfs, path, links_seen=self.links)
        except NvctkError:  # a link loop: runc fails on it anyway
            return path
        return real[len(self.top):] or "/"


def _at_or_above(path: str) -> list[str]:
    """path (normalised, absolute) and each directory above it, up to /."""
    out = [path]
    while len(path) > 1:
        path = path[:path.rindex("/")] or "/"
        out.append(path)
    return out


def _rootfs_of(spec: dict[str, Any], bundle: str | None) -> str | None:
    root = spec.get("root")
    path = root.get("path") if isinstance(root, dict) else None
    if not isinstance(path, str) or not path:
        return None
    path = os.path.join(bundle or ".", path) if not path.startswith("/") else path
    return os.path.abspath(path) if os.path.isdir(path) else None


def _created_on(source: str, rel: str) -> str | None:
    """The first path runc or the hook would create under the host directory source for
    the container path source/rel, or None when all of it is already there. A symlink on
    the way counts as created: where it leads in the container is not where it leads here."""
    here = source
    for part in rel.split("/"):
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
        except OSError:
            return here
        if stat.S_ISLNK(st.st_mode):
            return here
    return None


def check_host_binds(spec: dict[str, Any], edits: list[tuple[str, dict[str, Any]]],
                     bundle: str | None = None) -> None:
    """CdiError when a device node, mount target or link of the edits lies on a host
    directory the spec binds into the container, and is not there yet: runc (nodes,
    mount points, their parents) or the links hook would create it in the host's
    directory. Legacy mode's hook refuses the same (nvctk.hook.worker).

    Each mount's destination and each target is resolved in the rootfs once; the mount
    on top at a target (the last of the spec's mounts at it or above it: a later one
    hides an earlier) is then a look-up per directory above it, and only a host
    directory on top there is looked into."""
    mounts = spec.get("mounts")
    if not isinstance(mounts, list) or not any(_is_host_bind(m) for m in mounts):
        return  # the common case: nothing of the host's is bound in
    in_rootfs = _InRootfs(_rootfs_of(spec, bundle))
    top: dict[str, int] = {}  # resolved destination -> the last mount there
    for i, m in enumerate(mounts):
        dest = m.get("destination") if isinstance(m, dict) else None
        if isinstance(dest, str) and dest.startswith("/"):
            top[in_rootfs(dest)] = i
    dirs: dict[str, str] = {}  # resolved destination -> source, of the host dirs on top there
    for dest, i in top.items():
        source = mounts[i].get("source")
        if not _is_host_bind(mounts[i]) or not isinstance(source, str):
            continue
        if not source.startswith("/"):
            source = os.path.join(bundle or ".", source)
        if os.path.isdir(source):  # a file bound in: nothing can be created below it
            dirs[dest] = source
    if not dirs:
        return
    for where, e in edits:
        targets = [("deviceNode", n.get("path")) for n in e.get("deviceNodes", ())]
        targets += [("mount", m.get("containerPath")) for m in e.get("mounts", ())]
        targets += [("link", p) for h in e.get("hooks", ()) for p in _link_paths(h)]
        for what, path in targets:
            if not isinstance(path, str) or not path.startswith("/"):
                continue
            path = in_rootfs(path)
            dest = max((a for a in _at_or_above(path) if a in top), key=top.__getitem__,
                       default=None)
            if dest is None or dest not in dirs or path == dest:
                continue  # not on a host directory, or mounted over the bind itself
            source, i = dirs[dest], top[dest]
            made = _created_on(source, os.path.relpath(path, dest))
            if made is not None:
                m = mounts[i]
                raise CdiError(
                    f"{where}: {what} {path} lies on the host directory {source} that the "
                    f"spec's mounts[{i}] binds at {m['destination']}: it would create {made} on the "
                    "host; nvctk creates nothing on a host directory bound into a container "
                    f"(bind it somewhere other than {m['destination']})")
