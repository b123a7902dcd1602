"""`nvctk cdi generate`: the host's edits forms written out as a CDI spec (REFERENCE §7).

The spec is a thin writer of the edits form (nvctk.edits): the device nodes, mounts
and links come from the one planner (nvctk.plan.make.plan_container, as a container's
form does), for every capability and each GPU and MIG device asked for (`cdi_spec`:
the host's all for `nvctk cdi generate`, a claim's for the DRA driver), then written out
as CDI containerEdits. Each device's links (the common ones and its own) and
the ld.so.cache refresh are one `nvctk-hook cdi-edits` createRuntime hook, which runs
the prestart hook's hardened steps (nvctk.hook.children.apply_edits); nvctk-runtime's CDI
mode decodes it back into the form (nvctk.plan.cdi) and runs none of it.

Hooks are `createRuntime` hooks: they run where the prestart hook runs (the
runtime's namespaces, the container's created but not started), so they take the
same path: setns into the container's mount namespace from the host, refusing a
container that shares the host's. A `createContainer` hook already runs inside
the container's mount namespace, where that check cannot tell the two apart.

Reading specs (list, load, check, resolve) is nvctk.cdi.load.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from nvctk.base import fileio
from nvctk.base.config import ALL_CAPABILITIES, host_driver_root
from nvctk.base.errors import CdiError
from nvctk.base.inroot import resolve_in_root
from nvctk.cdi import transforms
from nvctk.cdi.load import CLASS, VENDOR
from nvctk.edits import (
    HOOK_NAME,
    DeviceNode,
    Edits,
    Mount,
    Symlink,
    bind_options,
    container_path_of_host,
)
from nvctk.host import discover
from nvctk.host import driver as nvdriver
from nvctk.host.image import ImageFacts
from nvctk.host.paths import context
from nvctk.host.select import Selected, select_devices
from nvctk.plan import make
from nvctk.plan.mounts import plan_symlinks
from nvctk.request.parse import Request

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.config import Config
    from nvctk.host.inventory import HostInfo

STRATEGIES = ("index", "uuid", "type-index")
HOOK_STAGE = "createRuntime"

# Driver files NVIDIA's CDI spec mounts beyond the per-capability lists of
# nvctk.host.driver (which the runtime's containers get): found by name in the driver
# root's ld.so.cache (any version suffix) and bin dirs, or at fixed paths.
EXTRA_LIBRARIES = (
    "libnvidia-egl-gbm", "libnvidia-egl-wayland", "libnvidia-egl-wayland2",
    "libnvidia-egl-xcb", "libnvidia-egl-xlib", "libnvidia-vulkan-producer", "libnvidia-nvvm70",
)
EXTRA_BINARIES = ("nvidia-imex", "nvidia-imex-ctl", "nvidia-xconfig")
# (path in the root, with {v} for the driver version) for Xorg's driver modules
EXTRA_FILES = (
    "usr/lib/xorg/modules/drivers/nvidia_drv.so",
    "usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.{v}",
    "usr/share/nvidia/nvoptix.bin",
)


# --- the host's plan data --------------------------------------------------------------------


def device_names(sel: Selected, strategy: str) -> str:
    """A device's name under a naming strategy."""
    g, m = sel.gpu, sel.mig
    if strategy == "index":
        return str(g.index) if m is None else f"{g.index}:{m.index}"
    if strategy == "uuid":
        return g.uuid if m is None else m.uuid
    if strategy == "type-index":
        return f"gpu{g.index}" if m is None else f"mig{g.index}:{m.index}"
    raise CdiError(f"unknown device name strategy {strategy!r} (one of {', '.join(STRATEGIES)})")


def _extra_mounts(files: nvdriver.DriverFiles, lib_dir: str) -> list[Mount]:
    from nvctk.host import ldcache

    root = files.driver_root
    out: list[Mount] = []
    seen: set[str] = set()
    links: dict[str, str | None] = {}
    for e in ldcache.read(root, EXTRA_LIBRARIES):
        name = e.name.split(".so", 1)[0]
        if e.arch != "x86-64" or name in seen:
            continue
        real = resolve_in_root(root, e.path, links_seen=links)
        if os.path.isfile(real):
            seen.add(name)
            out.append(Mount(real, f"{lib_dir}/{os.path.basename(real)}"))
    for b in EXTRA_BINARIES:
        for d in nvdriver.BIN_DIRS:
            p = os.path.join(root, d, b)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                out.append(Mount(p, f"/usr/bin/{b}"))
                break
    for rel in EXTRA_FILES:
        p = os.path.join(root, rel.format(v=files.driver_version))
        if os.path.isfile(p):
            out.append(Mount(p, container_path_of_host(files.driver_root, p)))
    return out


def host_edits(config: Config, host: HostInfo, strategies: tuple[str, ...],
               hook_path: str = HOOK_NAME, devices: tuple[str, ...] | None = None
               ) -> tuple[Edits, list[tuple[list[str], Edits]]]:
    """The forms of the host's GPU and MIG devices (`devices`: their ids, as
    NVIDIA_VISIBLE_DEVICES names them; None: every one, NVML order) with every
    capability but compat32 (a CDI spec names no image, so it cannot place 32-bit
    libraries): (what every container gets whatever its devices, [(names, what the
    device adds)]). Each is plan_container's form, on one discovery of them all (hook_path:
    the context's), made a spec's part by nvctk.cdi.transforms."""
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise CdiError(f"unknown device name strategy {(bad or [''])[0]!r} "
                       f"(one of {', '.join(STRATEGIES)})")
    caps = tuple(c for c in ALL_CAPABILITIES if c != "compat32")
    wanted = Request(devices or (), all_devices=devices is None, capabilities=caps,
                     source="the devices of the CDI spec")
    selected = select_devices(wanted, host)
    # no image: the libraries go where the host has them (ImageFacts.host_layout)
    facts = discover.discover(wanted, config, host, selected, ImageFacts(host_layout=True))
    ctx = context(config, hook_path=hook_path)

    def plan(sel: tuple[Selected, ...]) -> Edits:
        ids = tuple(s.name for s in sel)
        return make.plan_container(Request(ids, capabilities=caps), config,
                                   facts.replace(selected=sel), ctx)

    # what every container gets whatever its devices: nvidiactl, uvm, modeset, the files
    common = plan(())
    mounts = list(common.mounts)
    first = {m.container_path for m in mounts}
    mounts += [m for m in _extra_mounts(facts.files, common.lib_dir)
               if m.container_path not in first]
    seen, on = config.driver_root, host_driver_root(config)
    out = []
    for sel in selected:
        names = list(dict.fromkeys(device_names(sel, s) for s in strategies))
        part = transforms.device_part(plan((sel,)), common, sel.gpu.uuid)
        out.append((names, transforms.sources_on_host(part, seen, on)))
    links = plan_symlinks(mounts, common.lib_dir, host.driver_version)
    return transforms.sources_on_host(transforms.common_part(common, mounts, links),
                                      seen, on), out


def cdi_spec(config: Config, host: HostInfo, hook_path: str, *,
             devices: tuple[str, ...] | None = None,
             strategies: tuple[str, ...] = ("index", "uuid"), vendor: str = VENDOR,
             cls: str = CLASS, hook_env: list[str] | None = None) -> dict[str, Any]:
    """The CDI spec for these devices of the host (ids as NVIDIA_VISIBLE_DEVICES names
    them; None: every GPU and MIG device): `nvctk cdi generate`'s, and the DRA driver's
    for a claim's devices."""
    common, edits = host_edits(config, host, strategies, hook_path, devices)
    return make_spec(common, edits, hook_path, vendor=vendor, cls=cls, hook_env=hook_env)


# --- the CDI spec ----------------------------------------------------------------------------


def _node_entry(d: DeviceNode) -> dict[str, Any]:
    # fileMode too: the form's mode (0660 for DRM nodes, as the driver makes them), not
    # the host node's, whatever that is
    out: dict[str, Any] = {"path": d.path, "hostPath": d.host_path, "type": d.type,
                           "major": d.major, "minor": d.minor}
    if d.file_mode is not None:
        out["fileMode"] = d.file_mode
    out["permissions"] = d.permissions
    return out


def _mount_entry(m: Mount) -> dict[str, Any]:
    return {"hostPath": m.host_path, "containerPath": m.container_path,
            "options": list(bind_options(m.read_only, m.noexec))}


def _edits_hook(hook_path: str, links: list[Symlink], folder: str | None,
                env: list[str], pins: tuple[str, ...] = ()) -> dict[str, Any]:
    """One `nvctk-hook cdi-edits` hook: the pins, the links, then ldconfig over folder."""
    args = [os.path.basename(hook_path), "cdi-edits"]
    for p in pins:
        args += ["--pin", p]
    for s in links:
        args += ["--link", f"{s.target}::{s.container_path}"]
    if folder:
        args += ["--folder", folder]
    h: dict[str, Any] = {"hookName": HOOK_STAGE, "path": hook_path, "args": args}
    if env:
        h["env"] = env
    return h


def min_version(spec: dict[str, Any]) -> str:
    """The lowest cdiVersion whose features the spec uses (as the CDI library decides)."""
    edits = [d.get("containerEdits", {}) for d in spec["devices"]]
    edits.append(spec.get("containerEdits", {}))
    if spec.get("annotations") or any(d.get("annotations") for d in spec["devices"]):
        return "0.6.0"
    if any(not d["name"][:1].isalpha() for d in spec["devices"]) or any(
            n.get("hostPath") for e in edits for n in e.get("deviceNodes", ())):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", ())):
        return "0.4.0"
    return "0.3.0"


def make_spec(common: Edits, devices: list[tuple[list[str], Edits]], hook_path: str, *,
              vendor: str = VENDOR, cls: str = CLASS, hook_env: list[str] | None = None,
              all_device: bool = True) -> dict[str, Any]:
    """The spec's parts (nvctk.cdi.transforms) written as a CDI spec. A device's links and
    the common ones, and the ldconfig step, are one `nvctk-hook cdi-edits` createRuntime
    hook in each device's edits (a spec's common edits cannot know the device's links):
    a one-device container runs one hook. Two devices run it twice: the links, pins and
    ldconfig are idempotent. common.pins (a DRA share's /etc and /run) go into every
    device's hook. all_device: a device `all` with every device's edits (not in a DRA
    claim's spec: every claim's spec of the kind would define it, a conflict to CDI)."""
    env = hook_env or []
    folder = common.lib_dir if common.ldconfig else None
    out: list[dict[str, Any]] = []
    all_nodes: dict[str, DeviceNode] = {}
    all_links: list[Symlink] = []

    def edits_of(nodes: list[DeviceNode], links: list[Symlink]) -> dict[str, Any]:
        ce: dict[str, Any] = {"deviceNodes": [_node_entry(n) for n in nodes]}
        links = [*common.symlinks, *(s for s in links if s not in common.symlinks)]
        if links or folder or common.pins:
            ce["hooks"] = [_edits_hook(hook_path, links, folder, env, common.pins)]
        return ce

    for names, d in devices:
        ce = edits_of(list(d.devices), list(d.symlinks))
        for name in names:
            out.append({"name": name, "containerEdits": ce})
        for n in d.devices:
            all_nodes.setdefault(n.path, n)
        all_links += [s for s in d.symlinks if s not in all_links]
    if devices and all_device:
        out.append({"name": "all", "containerEdits": edits_of(list(all_nodes.values()),
                                                              all_links)})
    body: dict[str, Any] = {
        "kind": f"{vendor}/{cls}",
        "devices": out,
        "containerEdits": {
            "deviceNodes": [_node_entry(n) for n in common.devices],
            "mounts": [_mount_entry(m) for m in common.mounts],
            **({"env": [f"{k}={v}" for k, v in common.env.items()]} if common.env else {}),
        },
    }
    return {"cdiVersion": min_version(body), **body}


def dump(spec: dict[str, Any], fmt: Literal["yaml", "json"]) -> bytes:
    if fmt == "json":
        import json

        return (json.dumps(spec, indent=2) + "\n").encode()
    import yaml

    # SafeDumper: no Python tags; aliases off (devices share their edits dicts)
    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(spec, Dumper=_Dumper, sort_keys=False, default_flow_style=False).encode()


def write_spec(path: str, data: bytes) -> None:
    """Atomically, mode 0644 (runtimes read it as any user); only a regular file (or
    nothing) is replaced (fileio.replace_regular_file)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fileio.replace_regular_file(path, data, 0o644)
    except fileio.NotRegularFile as e:
        raise CdiError(f"cannot write {e}")
    except OSError as e:
        raise CdiError(f"cannot write {path}: {e.strerror or e}")


