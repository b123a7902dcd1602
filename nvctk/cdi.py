"""CDI specs (REFERENCE §7): `nvctk cdi generate` and `nvctk cdi list`.

The spec is a thin writer of plan data: the device nodes, mounts and links come
from nvctk.planner's functions (the ones a container's plan is made of), computed
once for every GPU and MIG device of the host and every capability, then written
out as CDI containerEdits. Links and the ld.so.cache refresh are `nvctk-hook
create-symlinks` / `update-ldcache` hooks, which run the prestart hook's hardened
steps (nvctk.prestart.apply_plan).

Hooks are `createRuntime` hooks: they run where the prestart hook runs (the
runtime's namespaces, the container's created but not started), so they take the
same path: setns into the container's mount namespace from the host, refusing a
container that shares the host's. A `createContainer` hook already runs inside
the container's mount namespace, where that check cannot tell the two apart.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from nvctk import driver as nvdriver
from nvctk import oci
from nvctk.errors import NvctkError
from nvctk.plan import DeviceNode, Mount, Symlink
from nvctk.planner import (
    DEBIAN_LIB_DIR,
    Selected,
    _container_path_of_host,
    drm_nodes,
    plan_devices,
    plan_drm_links,
    plan_mounts,
    plan_symlinks,
)
from nvctk.request import Request

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.config import Config
    from nvctk.host import HostInfo

VENDOR = "nvidia.com"
CLASS = "gpu"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
STRATEGIES = ("index", "uuid", "type-index")
FILE_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
IPC_OPTIONS = ("nosuid", "nodev", "rbind", "rprivate", "noexec")
HOOK_STAGE = "createRuntime"

# Driver files NVIDIA's CDI spec mounts beyond the per-capability lists of
# nvctk.driver (which the runtime's containers get): found by name in the driver
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


class CdiError(NvctkError):
    pass


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


class DeviceEdits:
    """One CDI device: its names and the plan pieces only it adds."""

    def __init__(self, names: list[str], devices: list[DeviceNode],
                 symlinks: list[Symlink]) -> None:
        self.names = names
        self.devices = devices
        self.symlinks = symlinks


class HostEdits:
    """Plan data for every device of the host: what each device adds, and what all share."""

    def __init__(self, devices: list[DeviceEdits], common_devices: list[DeviceNode],
                 mounts: list[Mount], symlinks: list[Symlink], lib_dir: str,
                 driver_version: str) -> None:
        self.devices = devices
        self.common_devices = common_devices
        self.mounts = mounts
        self.symlinks = symlinks
        self.lib_dir = lib_dir
        self.driver_version = driver_version


def _extra_mounts(files: nvdriver.DriverFiles, lib_dir: str) -> list[Mount]:
    from nvctk import ldcache

    root = files.driver_root
    out: list[Mount] = []
    seen: set[str] = set()
    links: dict[str, str | None] = {}
    for e in ldcache.read(root, EXTRA_LIBRARIES):
        name = e.name.split(".so", 1)[0]
        if e.arch != "x86-64" or name in seen:
            continue
        real = nvdriver.resolve_in_root(root, e.path, links_seen=links)
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
            out.append(Mount(p, _container_path_of_host(files, p)))
    return out


def host_edits(config: Config, host: HostInfo, strategies: tuple[str, ...]) -> HostEdits:
    """Every GPU and MIG device of `host` (NVML order) with every capability but compat32
    (a CDI spec names no image, so it cannot place 32-bit libraries)."""
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise CdiError(f"unknown device name strategy {(bad or [''])[0]!r} "
                       f"(one of {', '.join(STRATEGIES)})")
    caps = tuple(c for c in nvdriver.CAPABILITIES if c != "compat32")
    files = nvdriver.discover_files(config.driver_root, host.driver_version, caps)
    cuda = next(iter(files.libraries.get("compute", ())), None)
    lib_dir = _container_path_of_host(files, os.path.dirname(cuda)) if cuda else DEBIAN_LIB_DIR

    request = Request(all_devices=True, capabilities=caps)
    # what every container gets whatever its devices: nvidiactl, uvm, modeset
    common = plan_devices(request, [], files, [])
    mounts = plan_mounts(request, files, config, lib_dir, lib_dir)
    first = {m.container_path for m in mounts}
    mounts += [m for m in _extra_mounts(files, lib_dir) if m.container_path not in first]
    symlinks = plan_symlinks(mounts, lib_dir, host.driver_version)

    selected = [Selected(g) for g in host.gpus]
    selected += [Selected(g, m) for g in host.gpus for m in g.mig_devices]
    devices = []
    common_paths = {d.path for d in common}
    for sel in selected:
        drm = drm_nodes(request, [sel], files)
        nodes = [d for d in plan_devices(request, [sel], files, drm) if d.path not in common_paths]
        names = list(dict.fromkeys(device_names(sel, s) for s in strategies))
        devices.append(DeviceEdits(names, nodes, plan_drm_links(drm)))
    return HostEdits(devices, common, mounts, symlinks, lib_dir, host.driver_version)


# --- the CDI spec ----------------------------------------------------------------------------


def _node_entry(d: DeviceNode) -> dict[str, Any]:
    return {"path": d.path, "hostPath": d.host_path, "type": d.type, "major": d.major,
            "minor": d.minor, "permissions": "rwm"}


def _mount_entry(m: Mount) -> dict[str, Any]:
    opts: tuple[str, ...] = FILE_OPTIONS if m.read_only else IPC_OPTIONS
    if m.read_only and m.noexec:
        opts = (*FILE_OPTIONS, "noexec")
    return {"hostPath": m.host_path, "containerPath": m.container_path, "options": list(opts)}


def _hook(hook_path: str, args: list[str], env: list[str]) -> dict[str, Any]:
    h: dict[str, Any] = {"hookName": HOOK_STAGE, "path": hook_path,
                         "args": [os.path.basename(hook_path), *args]}
    if env:
        h["env"] = env
    return h


def _links_hook(hook_path: str, links: list[Symlink], env: list[str]) -> dict[str, Any]:
    args = ["create-symlinks"]
    for s in links:
        args += ["--link", f"{s.target}::{s.container_path}"]
    return _hook(hook_path, args, env)


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


def make_spec(edits: HostEdits, hook_path: str, *, vendor: str = VENDOR, cls: str = CLASS,
              hook_env: list[str] | None = None) -> dict[str, Any]:
    env = hook_env or []
    devices: list[dict[str, Any]] = []
    all_nodes: dict[str, DeviceNode] = {}
    all_links: list[Symlink] = []
    for d in edits.devices:
        ce: dict[str, Any] = {"deviceNodes": [_node_entry(n) for n in d.devices]}
        if d.symlinks:
            ce["hooks"] = [_links_hook(hook_path, d.symlinks, env)]
        for name in d.names:
            devices.append({"name": name, "containerEdits": ce})
        for n in d.devices:
            all_nodes.setdefault(n.path, n)
        all_links += [s for s in d.symlinks if s not in all_links]
    if edits.devices:
        ce = {"deviceNodes": [_node_entry(n) for n in all_nodes.values()]}
        if all_links:
            ce["hooks"] = [_links_hook(hook_path, all_links, env)]
        devices.append({"name": "all", "containerEdits": ce})
    hooks = []
    if edits.symlinks:
        hooks.append(_links_hook(hook_path, edits.symlinks, env))
    hooks.append(_hook(hook_path, ["update-ldcache", "--folder", edits.lib_dir], env))
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": f"{vendor}/{cls}",
        "devices": devices,
        "containerEdits": {
            "deviceNodes": [_node_entry(n) for n in edits.common_devices],
            "mounts": [_mount_entry(m) for m in edits.mounts],
            "hooks": hooks,
        },
    }
    spec["cdiVersion"] = min_version(spec)
    return spec


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
    """Atomically, mode 0644 (runtimes read it as any user)."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        oci.atomic_write(path, data, 0o644)
    except OSError as e:
        raise CdiError(f"cannot write {path}: {e.strerror or e}")


# --- nvctk cdi list --------------------------------------------------------------------------


def load_spec_file(path: str) -> dict[str, Any]:
    """A spec file, parsed and checked against the CDI schema; CdiError says why not."""
    import yaml

    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise CdiError(f"{path}: {e.strerror}")
    try:
        spec = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as e:
        raise CdiError(f"{path}: not YAML/JSON: {str(e).splitlines()[0]}")
    problem = schema_problem(spec)
    if problem:
        raise CdiError(f"{path}: {problem}")
    return spec  # type: ignore[no-any-return]


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
            return f"invalid device name {n!r}"
        if n in names:
            return f"device {n!r} appears twice"
        names.add(n)
        if not isinstance(d.get("containerEdits"), dict):
            return f"device {n!r} has no containerEdits"
    return None


def list_devices(spec_dirs: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(qualified names, warnings) of the *.json|*.yaml specs in spec_dirs; a later dir's
    spec of the same name wins, as CDI's registry resolves them."""
    found: dict[str, str] = {}
    warnings: list[str] = []
    for d in spec_dirs:
        try:
            entries = sorted(os.listdir(d))
        except FileNotFoundError:
            continue
        except OSError as e:
            warnings.append(f"{d}: {e.strerror}")
            continue
        for name in entries:
            if not name.endswith((".json", ".yaml")):
                continue
            path = os.path.join(d, name)
            try:
                spec = load_spec_file(path)
            except CdiError as e:
                warnings.append(str(e))
                continue
            for dev in spec["devices"]:
                found[f"{spec['kind']}={dev['name']}"] = path
    return sorted(found), warnings
