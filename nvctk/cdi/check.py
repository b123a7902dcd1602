"""CDI mode's checks of the devices' containerEdits, before anything is planned: each is
one nvctk can apply (edit_problem), and none makes runc or a hook create anything on a
host directory the OCI spec binds into the container (check_host_binds)."""

from __future__ import annotations

import os
import stat
from itertools import chain

from nvctk.base.errors import CdiError, NvctkError
from nvctk.base.inroot import resolve_in_root

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HOOK_STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart",
               "poststop")
# containerEdits fields nvctk applies; any other (intelRdt, additionalGIDs, netDevices) is
# refused by name rather than dropped: the container would lack what its spec promises
_EDIT_FIELDS = frozenset({"env", "deviceNodes", "mounts", "hooks"})
_NODE_FIELDS = frozenset({"path", "hostPath", "type", "major", "minor", "fileMode",
                          "permissions", "uid", "gid"})
_MOUNT_FIELDS = frozenset({"hostPath", "containerPath", "options", "type"})
_HOOK_FIELDS = frozenset({"hookName", "path", "args", "env", "timeout"})


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


def edit_problem(edits: Any) -> str | None:
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
    problem = next(filter(None, chain(map(_node_problem, edits.get("deviceNodes", ())),
                                      map(_mount_problem, edits.get("mounts", ())),
                                      map(_hook_problem, edits.get("hooks", ())))), None)
    if problem:
        return problem
    for text in _strings(edits):
        if "\0" in text:
            return f"a string contains a NUL byte ({text.partition(chr(0))[0][:40]!r}...)"
    return None


def _shape_problem(what: str, entry: Any, fields: frozenset[str]) -> str | None:
    if not isinstance(entry, dict) or set(entry) - fields:
        return f"{what} {entry!r}: unknown field or not an object"
    return None


def _path_problem(what: str, entry: dict[str, Any], keys: tuple[str, ...],
                  required: bool) -> str | None:
    """The first of `keys` that is not an absolute path (an absent one too, if required)."""
    for k in keys:
        if (required or k in entry) and not (isinstance(entry.get(k), str)
                                             and entry[k].startswith("/")):
            return f"{what} {k} {entry.get(k)!r} must be an absolute path"
    return None


def _strings_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _node_problem(n: Any) -> str | None:
    problem = _shape_problem("deviceNode", n, _NODE_FIELDS) or \
        _path_problem("deviceNode", n, ("path", "hostPath"), required=False)
    if problem:
        return problem
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
    return None


def _mount_problem(m: Any) -> str | None:
    problem = _shape_problem("mount", m, _MOUNT_FIELDS) or \
        _path_problem("mount", m, ("hostPath", "containerPath"), required=True)
    if problem:
        return problem
    if not _strings_list(m.get("options", [])):
        return f"mount {m['containerPath']}: options must be a list of strings"
    if not isinstance(m.get("type", ""), str):
        return f"mount {m['containerPath']}: type must be a string"
    return None


def _hook_problem(h: Any) -> str | None:
    problem = _shape_problem("hook", h, _HOOK_FIELDS)
    if problem:
        return problem
    if h.get("hookName") not in HOOK_STAGES:
        return f"hook hookName {h.get('hookName')!r} is not one of {', '.join(HOOK_STAGES)}"
    problem = _path_problem("hook", h, ("path",), required=True)
    if problem:
        return problem
    for k in ("args", "env"):
        if k in h and not _strings_list(h[k]):
            return f"hook {h['path']}: {k} must be a list of strings"
    t = h.get("timeout")
    if t is not None and (not isinstance(t, int) or isinstance(t, bool) or not
                          1 <= t <= 2**31 - 1):
        return f"hook {h['path']}: timeout must be an integer from 1 to {2**31 - 1}"
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
