"""CDI mode's discovery: the containerEdits of the devices a container names, read and
checked, as nvctk.host.facts' CdiFacts. Nothing here decides what the container gets:
the planner (nvctk.plan.cdi) does.

Each resolved device's containerEdits, and once per spec file its common
containerEdits, are checked (nvctk.cdi.check: fields nvctk can apply, nothing created on
a host directory bound into the container) and read: each deviceNode's type, major,
minor and mode from the spec, else a stat of the host node; for a spec nvctk generated
(its hooks run nvctk-hook), each mount source's kind.
"""

from __future__ import annotations

import os
import stat

from nvctk.base.errors import CdiError
from nvctk.cdi.check import check_host_binds, edit_problem
from nvctk.cdi.load import Resolved, check_vendors, resolve
from nvctk.edits import HOOK_NAME, DeviceNode
from nvctk.host.facts import CdiEdit, CdiFacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

    from nvctk.base.config import Config
    from nvctk.request.parse import Request


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


def _is_own_spec(spec: dict[str, Any]) -> bool:
    """A spec `nvctk cdi generate` wrote: its common edits run nvctk-hook."""
    edits = [spec.get("containerEdits") or {}, *(d.get("containerEdits") or {}
                                                  for d in spec["devices"])]
    return any(isinstance(h, dict) and (h.get("args") or [None])[0] == HOOK_NAME
               for e in edits if isinstance(e, dict)
               for h in (e.get("hooks") or ()))


def _edits_of(devices: list[Resolved]) -> list[tuple[str, dict[str, Any], bool]]:
    """(where, containerEdits, own spec) of each spec file's common edits (once, before
    its first device's) and of each device, in the devices' order."""
    out: list[tuple[str, dict[str, Any], bool]] = []
    seen: dict[str, bool] = {}
    for r in devices:
        if r.path not in seen:
            seen[r.path] = own = _is_own_spec(r.spec)
            if "containerEdits" in r.spec:
                out.append((f"{r.path}: containerEdits", r.spec["containerEdits"], own))
        out.append((f"{r.path}: device {r.device['name']}", r.device["containerEdits"],
                    seen[r.path]))
    return out


def read_devices(devices: list[Resolved], *, bundle: str | None = None,
                 spec: dict[str, Any] | None = None) -> CdiFacts:
    """The devices' edits as facts. Everything is checked, and every node stat'ed, before
    anything is returned; none may make runc or a hook create anything on a host
    directory the OCI spec binds into the container (check_host_binds; bundle: where a
    relative mount source is)."""
    edits = _edits_of(devices)
    for where, e, _ in edits:
        problem = edit_problem(e)
        if problem:
            raise CdiError(f"{where}: {problem}")
    if spec is not None:
        check_host_binds(spec, [(w, e) for w, e, _ in edits], bundle)
    return CdiFacts(tuple(
        CdiEdit(where, own, e, tuple(_node(n, where) for n in e.get("deviceNodes", ())),
                {m["hostPath"]: _kind(m["hostPath"]) for m in e.get("mounts", ())} if own
                else None)
        for where, e, own in edits))


def cdi_facts(request: Request, config: Config, bundle: str, spec: dict[str, Any],
              cache_dir: str | None = None) -> CdiFacts:
    """CDI mode's discovery: the request's devices (of the vendors in cdi-vendors only)
    loaded from the spec dirs (cache_dir: the parsed specs' cache), read and checked
    against the OCI spec's host binds."""
    assert request.cdi_devices is not None
    check_vendors(request.cdi_devices, config.cdi_vendors, request.source)
    resolved = resolve(request.cdi_devices, config.cdi_spec_dirs, cache_dir)
    return read_devices(resolved, bundle=bundle, spec=spec)
