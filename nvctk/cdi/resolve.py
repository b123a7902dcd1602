"""CDI devices into the edits form (nvctk.edits.Edits): nvctk-runtime's CDI mode.

Each resolved device's containerEdits, and once per spec file its common
containerEdits, are checked (cdi._edit_problem, check_host_binds) and decoded:
deviceNodes into DeviceNodes (type, major, minor from the spec, else a stat of the
host node), env into env (a later edit's value wins), nvctk's own createRuntime
hooks (`nvctk-hook cdi-edits`, and create-symlinks|update-ldcache of older specs) into symlinks and the
ldconfig step, and the mounts of a spec nvctk generated into the hook's mounts, so
that nvctk's own spec gives the form legacy mode gives (one prestart hook does them,
hardened, as in legacy). Any other spec's mounts and hooks stay verbatim (options
kept; runc and the spec's own hooks do them).
"""

from __future__ import annotations

import os
import stat

from nvctk.cdi.load import (
    BIND_FLAGS,
    CdiError,
    Resolved,
    _edit_problem,
    check_host_binds,
    check_vendors,
    resolve,
)
from nvctk.edits import (
    CDI_HOOK_FLAGS,
    HOOK_NAME,
    CdiHookArgs,
    DeviceNode,
    Edits,
    Hook,
    Mount,
    Symlink,
    cdi_hook_args,
)
from nvctk.host.facts import CdiFacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

    from nvctk.base.config import Config
    from nvctk.request.parse import Request

def _own_hook(h: dict[str, Any]) -> CdiHookArgs | None:
    """What an nvctk-hook CDI hook adds to the form, None for any other hook."""
    args = h.get("args") or []
    if len(args) < 2 or args[0] != HOOK_NAME or args[1] not in CDI_HOOK_FLAGS \
            or h.get("hookName") != "createRuntime":
        return None
    try:
        return cdi_hook_args(args[1], args[2:])
    except ValueError as e:
        raise CdiError(f"hook {h['path']} {args[1]}: {e}")


def _node(n: dict[str, Any], where: str) -> DeviceNode:
    """A CDI deviceNode as the form's node: type, major and minor from the spec, else
    from a stat of hostPath (path when none is given)."""
    host = n.get("hostPath", n["path"])
    kind, major, minor, mode = n.get("type"), n.get("major"), n.get("minor"), n.get("fileMode")
    if kind is None or major is None or minor is None or mode is None:
        try:
            st: os.stat_result | None = os.stat(host)
        except OSError as e:
            if kind is not None and major is not None and minor is not None:
                st = None  # the spec says all runc needs to make the node
            else:
                raise CdiError(f"{where}: deviceNode {n['path']}: cannot stat {host}: "
                               f"{e.strerror}")
        if st is not None:
            if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
                raise CdiError(f"{where}: deviceNode {n['path']}: {host} is not a device node")
            if kind is None:
                kind = "b" if stat.S_ISBLK(st.st_mode) else "c"
            if major is None or minor is None:
                major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
            if mode is None:
                mode = stat.S_IMODE(st.st_mode)
    assert kind is not None and major is not None and minor is not None
    return DeviceNode(n["path"], host, major, minor, kind, 0o666 if mode is None else mode,
                      n.get("uid", 0), n.get("gid", 0), n.get("permissions", "rwm"))


def _kind(host: str) -> Literal["file", "dir", "socket"]:
    try:
        mode = os.stat(host).st_mode
    except OSError:
        return "file"  # the hook skips a missing source, saying so
    return "dir" if stat.S_ISDIR(mode) else "socket" if stat.S_ISSOCK(mode) else "file"


def _mount(m: dict[str, Any], own: bool) -> Mount:
    opts = tuple(m.get("options", ()))
    flags = BIND_FLAGS.get(opts) if own and not m.get("type") else None
    if flags is None:  # verbatim: runc mounts it as the spec says
        return Mount(m["hostPath"], m["containerPath"], options=opts, fs_type=m.get("type"))
    kind = _kind(m["hostPath"])
    return Mount(m["hostPath"], m["containerPath"], kind, read_only=flags[0], noexec=flags[1])


def _is_own_spec(spec: dict[str, Any]) -> bool:
    """A spec `nvctk cdi generate` wrote: its common edits run nvctk-hook."""
    edits = [spec.get("containerEdits") or {}, *(d.get("containerEdits") or {}
                                                  for d in spec["devices"])]
    return any(isinstance(h, dict) and (h.get("args") or [None])[0] == HOOK_NAME
               for e in edits if isinstance(e, dict)
               for h in (e.get("hooks") or ()))


def to_edits(devices: list[Resolved], *, ldconfig: str, bundle: str | None = None,
             spec: dict[str, Any] | None = None) -> Edits:
    """The form of the devices' edits. Everything is checked, and every node stat'ed,
    before anything is returned; none may make runc or a hook create anything on a host
    directory the OCI spec binds into the container (check_host_binds; bundle: where a
    relative mount source is). ldconfig: the host's ldconfig, for the ldconfig step."""
    edits: list[tuple[str, dict[str, Any], bool]] = []
    seen: dict[str, bool] = {}
    for r in devices:
        if r.path not in seen:
            seen[r.path] = own = _is_own_spec(r.spec)
            if "containerEdits" in r.spec:
                edits.append((f"{r.path}: containerEdits", r.spec["containerEdits"], own))
        edits.append((f"{r.path}: device {r.device['name']}", r.device["containerEdits"],
                      seen[r.path]))
    for where, e, _ in edits:
        problem = _edit_problem(e)
        if problem:
            raise CdiError(f"{where}: {problem}")
    if spec is not None:
        check_host_binds(spec, [(w, e) for w, e, _ in edits], bundle)

    nodes: dict[str, DeviceNode] = {}
    env: dict[str, str] = {}
    mounts: dict[str, Mount] = {}
    links: dict[str, Symlink] = {}
    folders: list[str] = []
    pins: list[str] = []
    hooks: list[Hook] = []
    for where, e, own in edits:
        for n in e.get("deviceNodes", ()):
            node = _node(n, where)
            nodes.pop(node.path, None)  # a later entry for a path wins, in its place
            nodes[node.path] = node
        for item in e.get("env", ()):
            k, _, v = item.partition("=")
            env.pop(k, None)  # a later edit's value wins, in its place
            env[k] = v
        for m in e.get("mounts", ()):
            mount = _mount(m, own)
            key = mount.container_path if mount.options is None else repr(mount.to_dict())
            mounts.setdefault(key, mount)
        for h in e.get("hooks", ()):
            decoded = _own_hook(h) if own else None
            if decoded is None:
                hook = Hook(h["hookName"], h["path"], tuple(h.get("args", ())),
                            tuple(h.get("env", ())), h.get("timeout") or 0)
                if hook not in hooks:
                    hooks.append(hook)
                continue
            for link in decoded.links:
                links.setdefault(link.container_path, link)
            if decoded.folder is not None and decoded.folder not in folders:
                folders.append(decoded.folder)
            pins += [p for p in decoded.pins if p not in pins]
    if len(folders) > 1:
        raise CdiError(f"the devices' specs ask for ldconfig in {' and '.join(folders)}: "
                       "nvctk runs it over one folder")
    return Edits(
        "", (), (),
        devices=tuple(nodes.values()),
        mounts=tuple(mounts.values()),
        symlinks=tuple(links.values()),
        lib_dir=folders[0] if folders else "/",
        ldconfig=ldconfig if folders else "",
        env=env,
        hooks=tuple(hooks),
        pins=tuple(pins),
    )


def cdi_facts(request: Request, config: Config, bundle: str, spec: dict[str, Any],
              cache_dir: str | None = None) -> CdiFacts:
    """CDI mode's discovery: the request's devices (of the vendors in cdi-vendors only)
    loaded from the spec dirs (cache_dir: the parsed specs' cache) and decoded into the
    form's parts, checked against the OCI spec's host binds."""
    assert request.cdi_devices is not None
    check_vendors(request.cdi_devices, config.cdi_vendors, request.source)
    resolved = resolve(request.cdi_devices, config.cdi_spec_dirs, cache_dir)
    return CdiFacts(to_edits(resolved, ldconfig=config.ldconfig, bundle=bundle, spec=spec))
