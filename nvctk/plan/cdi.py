"""CDI mode's decisions: the CDI devices' edits (nvctk.host.facts.CdiFacts, as discovery
read them) into the edits form (no I/O).

Device nodes: a later entry for a path wins, in its place; env: a later edit's value
wins; nvctk's own createRuntime hooks (`nvctk-hook cdi-edits`, and create-symlinks|
update-ldcache of older specs) become symlinks, pins and the ldconfig step (over one
folder only), and the mounts of a spec nvctk generated become the hook's mounts, so that
nvctk's own spec gives the form legacy mode gives (one prestart hook does them,
hardened, as in legacy). Any other spec's mounts and hooks stay verbatim (options
kept; runc and the spec's own hooks do them), each once.
"""

from __future__ import annotations

from nvctk.base.errors import CdiError
from nvctk.edits import (
    BIND_FLAGS,
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

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

    from nvctk.host.facts import CdiEdit, CdiFacts


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


def _mount(m: dict[str, Any], own: bool,
           kinds: dict[str, Literal["file", "dir", "socket"]]) -> Mount:
    """nvctk's own bind (options it writes, no type) as the hook's mount; any other
    verbatim: runc mounts it as the spec says."""
    opts = tuple(m.get("options", ()))
    flags = BIND_FLAGS.get(opts) if own and not m.get("type") else None
    if flags is None:
        return Mount(m["hostPath"], m["containerPath"], options=opts, fs_type=m.get("type"))
    kind = kinds.get(m["hostPath"], "file")
    return Mount(m["hostPath"], m["containerPath"], kind, read_only=flags[0], noexec=flags[1])


class _Hooks:
    """The hooks of the edits: foreign ones verbatim, each once; nvctk's own decoded into
    links (the first for a path wins), ldconfig folders and pins."""

    def __init__(self) -> None:
        self.hooks: list[Hook] = []
        self.links: dict[str, Symlink] = {}
        self.folders: list[str] = []
        self.pins: list[str] = []

    def add(self, h: dict[str, Any], own: bool) -> None:
        decoded = _own_hook(h) if own else None
        if decoded is None:
            hook = Hook(h["hookName"], h["path"], tuple(h.get("args", ())),
                        tuple(h.get("env", ())), h.get("timeout") or 0)
            if hook not in self.hooks:
                self.hooks.append(hook)
            return
        for link in decoded.links:
            self.links.setdefault(link.container_path, link)
        if decoded.folder is not None and decoded.folder not in self.folders:
            self.folders.append(decoded.folder)
        self.pins += [p for p in decoded.pins if p not in self.pins]

    def folder(self) -> str | None:
        """The ldconfig step's one folder (None: no step); CdiError for more than one."""
        if len(self.folders) > 1:
            raise CdiError(f"the devices' specs ask for ldconfig in {' and '.join(self.folders)}: "
                           "nvctk runs it over one folder")
        return self.folders[0] if self.folders else None


def _later_wins(entries: tuple[CdiEdit, ...]) -> tuple[dict[str, DeviceNode], dict[str, str]]:
    """The device nodes by path and the env: a later entry's wins, in its place."""
    nodes: dict[str, DeviceNode] = {}
    env: dict[str, str] = {}
    for entry in entries:
        for node in entry.nodes:
            nodes.pop(node.path, None)
            nodes[node.path] = node
        for item in entry.edits.get("env", ()):
            k, _, v = item.partition("=")
            env.pop(k, None)
            env[k] = v
    return nodes, env


def cdi_edits(facts: CdiFacts, ldconfig: str) -> Edits:
    """The form of the CDI devices' edits (origin "cdi"). ldconfig: the host's ldconfig,
    for the ldconfig step."""
    nodes, env = _later_wins(facts.entries)
    mounts: dict[str, Mount] = {}
    hooks = _Hooks()
    for entry in facts.entries:
        for m in entry.edits.get("mounts", ()):
            mount = _mount(m, entry.own, entry.kinds)
            key = mount.container_path if mount.options is None else repr(mount.to_dict())
            mounts.setdefault(key, mount)
        for h in entry.edits.get("hooks", ()):
            hooks.add(h, entry.own)
    folder = hooks.folder()
    return Edits(
        "", (), (),
        devices=tuple(nodes.values()),
        mounts=tuple(mounts.values()),
        symlinks=tuple(hooks.links.values()),
        lib_dir=folder or "/",
        ldconfig=ldconfig if folder else "",
        env=env,
        hooks=tuple(hooks.hooks),
        pins=tuple(hooks.pins),
        origin="cdi",
    )
