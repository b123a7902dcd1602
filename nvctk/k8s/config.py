"""The device plugin's YAML config, validated with jsonschema; every error names
the field (`sharing.timeSlicing.resources[0].replicas: ...`) and the file.

    version: v1
    flags:
      migStrategy: none | single | mixed          # default none
      deviceListStrategy: volume-mounts | [envvar, volume-mounts, cdi-annotations, cdi-cri]
                                                  # default volume-mounts: a Pod cannot forge
                                                  # it (envvar: any Pod's env can; unsafe on
                                                  # shared nodes, see README)
      driverRoot: /                               # default: nvctk's config driver-root
      mpsPipeDirectory: /tmp/nvidia-mps           # under the driver root
    sharing:                                      # at most one of the three
      timeSlicing:
        renameByDefault: false                    # true: <name>.shared
        failRequestsGreaterThanOne: false
        resources: [{name: nvidia.com/gpu, replicas: 4, rename: optional}]
      vgpu: {replicas: 4, resourceName: nvidia.com/vgpu}
      mps: {coreResource: nvidia.com/mps-core, memoryResource: nvidia.com/mps-memory}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jsonschema

from nvctk.base import yamlio
from nvctk.base.errors import ConfigError, clipped
from nvctk.base.fileio import NotRegularFile, read_regular_file

STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
# the default device list: /dev/null mounts only the kubelet makes (a Pod's env, or an
# image's NVIDIA_VISIBLE_DEVICES=all, cannot name a GPU on a node that ignores the env:
# nvctk.base.config.KUBERNETES_NODE)
DEFAULT_STRATEGY = "volume-mounts"
MIG_STRATEGIES = ("none", "single", "mixed")
_RESOURCE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$"
MAX_REPLICAS = 100  # a vGPU share keeps >= 1% of the SMs

SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["version"],
    "properties": {
        "version": {"const": "v1"},
        "flags": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "migStrategy": {"enum": list(MIG_STRATEGIES)},
                "deviceListStrategy": {
                    "oneOf": [
                        {"enum": list(STRATEGIES)},
                        {"type": "array", "minItems": 1, "uniqueItems": True,
                         "items": {"enum": list(STRATEGIES)}},
                    ]
                },
                "driverRoot": {"type": "string", "pattern": "^/"},
                "mpsPipeDirectory": {"type": "string", "pattern": "^/"},
                "cdiVendorClass": {"type": "string", "pattern": r"^[a-z0-9.-]+/[a-zA-Z0-9_.-]+$"},
            },
        },
        "sharing": {
            "type": "object",
            "additionalProperties": False,
            "maxProperties": 1,
            "properties": {
                "timeSlicing": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["resources"],
                    "properties": {
                        "renameByDefault": {"type": "boolean"},
                        "failRequestsGreaterThanOne": {"type": "boolean"},
                        "resources": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name", "replicas"],
                                "properties": {
                                    "name": {"type": "string", "pattern": _RESOURCE},
                                    "rename": {"type": "string", "pattern": _RESOURCE},
                                    "replicas": {"type": "integer", "minimum": 2,
                                                 "maximum": 1024},
                                },
                            },
                        },
                    },
                },
                "vgpu": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["replicas"],
                    "properties": {
                        "replicas": {"type": "integer", "minimum": 1, "maximum": MAX_REPLICAS},
                        "resourceName": {"type": "string", "pattern": _RESOURCE},
                    },
                },
                "mps": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "coreResource": {"type": "string", "pattern": _RESOURCE},
                        "memoryResource": {"type": "string", "pattern": _RESOURCE},
                    },
                },
            },
        },
    },
}


@dataclass(frozen=True)
class TimeSliced:
    name: str
    replicas: int
    rename: str | None = None


@dataclass(frozen=True)
class PluginConfig:
    mig_strategy: str = "none"
    strategies: tuple[str, ...] = (DEFAULT_STRATEGY,)
    driver_root: str | None = None  # None: nvctk's config decides
    mps_pipe_dir: str = "/tmp/nvidia-mps"
    cdi_kind: str = "nvidia.com/gpu"
    sharing: str = "none"  # none | time-slicing | vgpu | mps
    time_sliced: tuple[TimeSliced, ...] = ()
    rename_by_default: bool = False
    fail_gt_one: bool = False
    vgpu_replicas: int = 0
    vgpu_resource: str = "nvidia.com/vgpu"
    mps_core_resource: str = "nvidia.com/mps-core"
    mps_memory_resource: str = "nvidia.com/mps-memory"
    # nvctk's config authority-key (set by `nvctk device-plugin`, not by this file): the
    # key of the vGPU share annotations (nvctk.vgpu.authority); None: env only, no annotation
    authority_key: str | None = None
    # where the driver root is on the host, when the plugin sees it elsewhere (nvctk's
    # host-driver-root, set by `nvctk device-plugin`): the paths Allocate answers name
    host_driver_root: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


def _is_integer(_checker: Any, value: Any) -> bool:
    """JSON Schema's integer takes 2.0 (a number with no fraction); the plugin counts
    with it (range(replicas)), so an integer here is an int and nothing else: 2.0, 1e3,
    .nan, true are refused naming the field, never a traceback later."""
    return isinstance(value, int) and not isinstance(value, bool)


# the schema's types are the types parse() hands on
_VALIDATOR = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))


def _where(path: Any) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def parse(data: Any, source: str = "config") -> PluginConfig:

    validator = _VALIDATOR(SCHEMA)
    errors = sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        e = errors[0]
        msg = e.message
        if e.validator == "additionalProperties":
            msg = f"unknown field: {msg}"
        elif e.validator == "maxProperties" and list(e.absolute_path) == ["sharing"]:
            msg = "only one of timeSlicing, vgpu, mps may be set"
        raise ConfigError(f"{source}: {clipped(_where(e.absolute_path))}: {clipped(msg)}")
    flags = data.get("flags", {})
    sharing = data.get("sharing", {})
    strategies = flags.get("deviceListStrategy", DEFAULT_STRATEGY)
    kw: dict[str, Any] = {
        "mig_strategy": flags.get("migStrategy", "none"),
        "strategies": (strategies,) if isinstance(strategies, str) else tuple(strategies),
        "driver_root": flags.get("driverRoot"),
        "mps_pipe_dir": flags.get("mpsPipeDirectory", "/tmp/nvidia-mps"),
        "cdi_kind": flags.get("cdiVendorClass", "nvidia.com/gpu"),
        "raw": data,
    }
    if "timeSlicing" in sharing:
        ts = sharing["timeSlicing"]
        names = [r["name"] for r in ts["resources"]]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ConfigError(f"{source}: sharing.timeSlicing.resources: {clipped(dup, 100)} "
                              "is listed twice")
        kw.update(sharing="time-slicing", rename_by_default=ts.get("renameByDefault", False),
                  fail_gt_one=ts.get("failRequestsGreaterThanOne", False),
                  time_sliced=tuple(TimeSliced(r["name"], r["replicas"], r.get("rename"))
                                    for r in ts["resources"]))
    elif "vgpu" in sharing:
        v = sharing["vgpu"]
        if not {"envvar", "volume-mounts"} & set(kw["strategies"]):
            # cdi-cri: containerd 2.x and CRI-O inject the GPU from the CDI spec, and
            # nvctk-runtime (which sets up the cap) never hears of it: a whole GPU.
            # cdi-annotations: nvctk-runtime refuses vGPU limits on CDI devices.
            raise ConfigError(
                f"{source}: sharing.vgpu needs deviceListStrategy envvar or volume-mounts: "
                f"with only {', '.join(kw['strategies'])} the engine applies the GPU from its "
                "CDI spec, where nvctk-runtime cannot cap it")
        kw.update(sharing="vgpu", vgpu_replicas=v["replicas"],
                  vgpu_resource=v.get("resourceName", "nvidia.com/vgpu"))
    elif "mps" in sharing:
        m = sharing["mps"]
        kw.update(sharing="mps",
                  mps_core_resource=m.get("coreResource", "nvidia.com/mps-core"),
                  mps_memory_resource=m.get("memoryResource", "nvidia.com/mps-memory"))
        if kw["mps_core_resource"] == kw["mps_memory_resource"]:
            raise ConfigError(f"{source}: sharing.mps: coreResource and memoryResource "
                              "must differ")
    _check_names(kw, source)
    return PluginConfig(**kw)


GPU_RESOURCE = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"  # + a MIG profile: a MIG resource under migStrategy mixed


def _check_names(kw: dict[str, Any], source: str) -> None:
    """ConfigError naming both fields when two resources the config makes share a name,
    or one takes a name the host's own resources have (nvidia.com/gpu where nothing
    replaces it, nvidia.com/mig-*): the kubelet would then get one name from two plugins,
    and one resource's devices would never be advertised."""
    made: list[tuple[str, str, str]] = []  # (name, field, the resource it replaces or "")
    sharing = kw.get("sharing", "none")
    if sharing == "time-slicing":
        for i, t in enumerate(kw["time_sliced"]):
            at = f"sharing.timeSlicing.resources[{i}]"
            if t.rename:
                made.append((t.rename, f"{at}.rename", t.name))
            elif kw["rename_by_default"]:
                made.append((f"{t.name}.shared", f"{at}.name (renameByDefault: {t.name}.shared)",
                             t.name))
            else:
                made.append((t.name, f"{at}.name", t.name))
        replaced = {t.name for t in kw["time_sliced"]}
    elif sharing == "vgpu":
        made.append((kw["vgpu_resource"], "sharing.vgpu.resourceName", GPU_RESOURCE))
        replaced = {GPU_RESOURCE}
    elif sharing == "mps":
        made.append((kw["mps_core_resource"], "sharing.mps.coreResource", GPU_RESOURCE))
        made.append((kw["mps_memory_resource"], "sharing.mps.memoryResource", GPU_RESOURCE))
        replaced = {GPU_RESOURCE}
    else:
        return
    seen: dict[str, str] = {}
    for name, where, own in made:
        if name in seen:
            raise ConfigError(f"{source}: {where}: {clipped(name, 100)} is also the name of "
                              f"{seen[name]}; two resources cannot share one name (one of them "
                              "would never be advertised)")
        seen[name] = where
        if name in (own, f"{own}.shared"):
            continue  # the resource itself, shared (kept, or renamed the default way)
        if name.startswith(MIG_PREFIX):
            raise ConfigError(f"{source}: {where}: {clipped(name, 100)} is the name of a MIG "
                              f"resource ({MIG_PREFIX}<profile> under migStrategy mixed); name "
                              "this resource otherwise")
        if name == GPU_RESOURCE and GPU_RESOURCE not in replaced:
            raise ConfigError(f"{source}: {where}: {GPU_RESOURCE} is the name of the host's "
                              "whole GPUs, which this config does not rename; name this "
                              "resource otherwise")


def load(path: str | None) -> PluginConfig:
    """The file's config (None: the defaults). ConfigError names the file and field."""
    if path is None:
        return PluginConfig()
    try:
        # never blocks: a FIFO at the path is refused unread, as every nvctk config
        text = read_regular_file(path, 1 << 20)
    except NotRegularFile:
        raise ConfigError(f"{path}: cannot read: not a regular file")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}")
    try:
        data = yamlio.load(text)
    except ValueError as e:
        raise ConfigError(f"{path}: {clipped(str(e))}".replace("\n", " "))
    if data is None:
        data = {}
    return parse(data, path)
