"""What a container asks for: GPUs, driver capabilities, requirements (REFERENCE §5).

Pure functions of the spec (env, mounts, capabilities) and nvctk's config; the
host is not consulted here (ids are resolved against NVML by the planner), so
a container that asks for no GPU is recognised without touching the driver.
"""

from __future__ import annotations

from nvctk.base.config import ALL_CAPABILITIES
from nvctk.base.errors import RequestError, shown
from nvctk.base.record import Record, fields
from nvctk.oci.spec import is_privileged, spec_env, spec_mounts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.base.config import Config

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
DRIVER_CAPABILITIES = "NVIDIA_DRIVER_CAPABILITIES"
REQUIRE_PREFIX = "NVIDIA_REQUIRE_"
DISABLE_REQUIRE = "NVIDIA_DISABLE_REQUIRE"
MIG_CONFIG = "NVIDIA_MIG_CONFIG_DEVICES"
MIG_MONITOR = "NVIDIA_MIG_MONITOR_DEVICES"
DEVICE_MOUNT_ROOT = "/var/run/nvidia-container-devices"
DEFAULT_CAPABILITIES = ("utility", "compute")
# CDI (REFERENCE §7): the annotations a device plugin sets, and the kind plain ids
# name in CDI mode
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_DEFAULT_KIND = "nvidia.com/gpu"


class Request(Record):
    """A GPU container's request. `devices` holds ids as given (not yet resolved);
    empty with all_devices False means `none`: driver files, no GPU."""

    __slots__ = ("devices", "all_devices", "capabilities", "requirements",  # noqa: RUF023
                 "disable_require", "mig_config", "mig_monitor", "privileged", "source", "cdi_devices",
                 "vgpu_authority", "env")

    def __init__(
        self,
        devices: tuple[str, ...] = (),
        all_devices: bool = False,
        capabilities: tuple[str, ...] = DEFAULT_CAPABILITIES,
        requirements: tuple[str, ...] = (),
        disable_require: bool = False,
        mig_config: bool = False,
        mig_monitor: bool = False,
        privileged: bool = False,
        source: str = VISIBLE_DEVICES,
        cdi_devices: tuple[str, ...] | None = None,
        vgpu_authority: tuple[tuple[str, str | None], ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.devices = devices
        self.all_devices = all_devices
        self.capabilities = capabilities
        # NVIDIA_REQUIRE_* expressions (legacy cuda one included)
        self.requirements = requirements
        self.disable_require = disable_require
        self.mig_config = mig_config
        self.mig_monitor = mig_monitor
        self.privileged = privileged
        self.source = source  # where the device list came from, for error messages
        # CDI mode: the qualified device names (vendor/class=name) whose edits the
        # container gets (() for `none`); None: legacy mode
        self.cdi_devices = cdi_devices
        # the node's vGPU shares (nvctk.io/vgpu.* annotations, not yet verified: the
        # planner does, nvctk.vgpu.authority); None: a value that is not a string
        self.vgpu_authority = vgpu_authority
        self.env: dict[str, str] = {} if env is None else env

    # env is the container's whole environment: no part of equality (a dict is not
    # hashable) and never in a repr that could reach a log (it may hold secrets)
    def _values(self) -> tuple[Any, ...]:
        return super()._values()[:-1]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in fields(type(self)) if k != "env")
        return f"{type(self).__name__}({args})"


def parse_bool(value: str) -> bool:
    """Go's strconv.ParseBool, which NVIDIA's toolkit uses; anything else is false."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def split_list(value: str) -> list[str]:
    """Comma-separated, trimmed, empties dropped, duplicates dropped (first wins)."""
    return list(dict.fromkeys(t.strip() for t in value.split(",") if t.strip()))


def is_legacy_image(env: dict[str, str]) -> bool:
    """A CUDA image from before NVIDIA_REQUIRE_CUDA: CUDA_VERSION set, NVIDIA_REQUIRE_CUDA
    unset or empty. Such images get all GPUs and all capabilities by default."""
    return bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")


def devices_from_mounts(spec: dict[str, Any]) -> list[str] | None:
    """Ids from /dev/null bind mounts at /var/run/nvidia-container-devices/<id> (the
    device plugin's way to pass devices that unprivileged pods cannot fake via env)."""
    ids: list[str] = []
    found = False
    prefix = DEVICE_MOUNT_ROOT + "/"
    for m in spec_mounts(spec):
        dest = str(m.get("destination", ""))
        if m.get("source") != "/dev/null" or not dest.startswith(prefix):
            continue
        found = True
        ident = dest[len(prefix) :].strip("/")
        if ident:
            ids.append(ident)
    return list(dict.fromkeys(ids)) if found else None


def _device_tokens(value: str) -> tuple[bool, tuple[str, ...]] | None:
    """NVIDIA_VISIBLE_DEVICES value -> (all, ids) or None for not-a-GPU-container."""
    tokens = split_list(value)
    if not tokens:
        return None  # empty value: like void
    if "all" in tokens:
        return True, ()
    if "none" in tokens:
        return False, ()
    if "void" in tokens:
        return None
    return False, tuple(tokens)


def parse_capabilities(
    env: dict[str, str], legacy: bool, supported: tuple[str, ...]
) -> tuple[str, ...]:
    """NVIDIA_DRIVER_CAPABILITIES -> capabilities in canonical order.

    Unset: utility,compute (legacy images: all). Empty: utility,compute. `all`:
    every capability the host supports. An unknown name is an error naming it;
    a known one the host does not support is dropped, as NVIDIA's toolkit does.
    """
    raw = env.get(DRIVER_CAPABILITIES)
    if raw is None:
        wanted = list(supported) if legacy else list(DEFAULT_CAPABILITIES)
    else:
        tokens = split_list(raw)
        if not tokens:
            wanted = list(DEFAULT_CAPABILITIES)
        elif "all" in tokens:
            wanted = list(supported)
        else:
            unknown = [t for t in tokens if t not in ALL_CAPABILITIES]
            if unknown:
                raise RequestError(
                    f"unknown driver capability {shown(unknown[0])} in {DRIVER_CAPABILITIES}="
                    f"{shown(raw)} (known: all, {', '.join(ALL_CAPABILITIES)})"
                )
            wanted = tokens
    return tuple(c for c in ALL_CAPABILITIES if c in wanted and c in supported)


def requirement_expressions(env: dict[str, str]) -> tuple[str, ...]:
    """Every non-empty NVIDIA_REQUIRE_* value (sorted by name for stable messages);
    legacy images add cuda>=<major.minor of CUDA_VERSION>."""
    exprs = [v.strip() for k, v in sorted(env.items()) if k.startswith(REQUIRE_PREFIX) and v.strip()]
    if is_legacy_image(env):
        parts = env["CUDA_VERSION"].strip().split(".")
        # ASCII digits only: str.isdigit() also takes "²" and other scripts' digits
        if len(parts) >= 2 and _ascii_digits(parts[0]) and _ascii_digits(parts[1]):
            exprs.append(f"cuda>={parts[0]}.{parts[1]}")
        elif _ascii_digits(parts[0]):
            exprs.append(f"cuda>={parts[0]}")
        else:
            raise RequestError(f"CUDA_VERSION={shown(env['CUDA_VERSION'])} is not a version "
                               "(digits and dots, e.g. 12.4.1)")
    return tuple(exprs)


def _ascii_digits(text: str) -> bool:
    return bool(text) and text.isascii() and text.isdigit()


def _cdi_part_ok(text: str, extra: str) -> bool:
    """CDI's name rule: ASCII letters, digits and `extra`, starting and ending with a
    letter or digit."""
    return bool(text) and all(c.isascii() and (c.isalnum() or c in extra) for c in text) \
        and text[0].isalnum() and text[-1].isalnum()


def parse_qualified(name: str) -> tuple[str, str, str] | None:
    """`vendor/class=device` -> (vendor, class, device); None when `name` is not in
    that form at all (a plain id); RequestError when it is, but malformed."""
    kind, eq, device = name.partition("=")
    if not eq:
        return None
    vendor, slash, cls = kind.partition("/")
    if not slash or not _cdi_part_ok(vendor, "_-.") or not _cdi_part_ok(cls, "_-") \
            or not _cdi_part_ok(device, "_-.:"):
        raise RequestError(f"invalid CDI device name {shown(name)} (the form is vendor/class=name, "
                           "e.g. nvidia.com/gpu=0: ASCII letters, digits and _-. in each part)")
    return vendor, cls, device


# CRI-O copies a Pod's own annotations (its author's) into every container's spec, and
# records the container's own (the kubelet's: a device plugin's) as JSON under this key,
# which a Pod annotation of the name cannot replace (docs/decisions.md, issue 18)
CRIO_OWN_ANNOTATIONS = "io.kubernetes.cri-o.Annotations"


def _containers_own(annotations: dict[str, Any], keys: list[str]) -> list[str]:
    """Of keys, those that are the container's own where the engine says which (CRI-O):
    a Pod's `cdi.k8s.io/` annotation never names a device (issue 39). An unreadable
    record trusts none."""
    raw = annotations.get(CRIO_OWN_ANNOTATIONS)
    if raw is None:
        return keys  # containerd: a Pod annotation reaches the spec only where listed
    from nvctk.base import jsonio

    try:
        own = jsonio.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        own = None
    if not isinstance(own, dict):
        return []
    return [k for k in keys if own.get(k) == annotations[k]]


def cdi_annotation_devices(spec: dict[str, Any]) -> tuple[list[str], str] | None:
    """The qualified names in the spec's cdi.k8s.io/* annotations (each value a
    comma-separated list; the container's own only, _containers_own), and the first
    annotation's key; None: none names a device."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict):
        return None
    names: list[str] = []
    first = ""
    keys = sorted(k for k in annotations if isinstance(k, str)
                  and k.startswith(CDI_ANNOTATION_PREFIX))
    for key in _containers_own(annotations, keys) if keys else ():
        value = annotations[key]
        if not isinstance(value, str):
            raise RequestError(f"annotation {shown(key)} must be a string of CDI device names")
        first = first or key
        for t in split_list(value):
            if parse_qualified(t) is None:
                raise RequestError(f"annotation {shown(key)}: {shown(t)} is not a qualified CDI "
                                   "device name (vendor/class=name, e.g. nvidia.com/gpu=0)")
            names.append(t)
    # an annotation that names nothing is no CDI request: the next source decides
    return (list(dict.fromkeys(names)), first) if names else None


def cdi_names(tokens: list[str]) -> tuple[str, ...] | None:
    """A device list in CDI mode: plain ids (`0`, `GPU-…`, `all`) name devices of
    nvidia.com/gpu; `none` alone is no device (()); `void` or nothing: None."""
    names = [t if parse_qualified(t) is not None else f"{CDI_DEFAULT_KIND}={t}"
             for t in tokens if t not in ("none", "void")]
    if names:
        return tuple(dict.fromkeys(names))
    return () if "none" in tokens else None


def _vgpu_authority(spec: dict[str, Any]) -> tuple[tuple[str, str | None], ...]:
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict) or not any(
            isinstance(k, str) and k.startswith("nvctk.io/vgpu.") for k in annotations):
        return ()  # the common case: nothing to import
    from nvctk.vgpu.authority import present

    return tuple(sorted((k, v if isinstance(v, str) else None)
                        for k, v in present(annotations).items()))


# the grant a DRA share's CDI spec carried before shares became plain CDI (nvctk 35):
# a spec of an older plugin still prepared on the node gives the GPU by env alone
OLD_DRA_GRANT = "NVCTK_DRA_SHARE"


def _requested_devices(spec: dict[str, Any], env: dict[str, str], privileged: bool,
                       legacy: bool, config: Config
                       ) -> tuple[tuple[bool, tuple[str, ...]] | None, str, tuple[str, ...] | None]:
    """(all devices?, the device ids) or None for no GPU; where the request came from; the
    CDI names when it is a CDI request. REFERENCE §5's order: CDI annotations, device
    mounts, then NVIDIA_VISIBLE_DEVICES."""
    devices: tuple[bool, tuple[str, ...]] | None = None
    source = VISIBLE_DEVICES
    cdi: tuple[str, ...] | None = None
    annotated = cdi_annotation_devices(spec)
    mount_ids = devices_from_mounts(spec) if config.accept_volume_mount_devices else None
    tokens: list[str] | None = None
    if annotated is not None:  # REFERENCE §5: CDI annotations come first
        names, key = annotated
        source = f"annotation {key}"
        cdi = tuple(names)
        devices = (False, cdi)
    elif mount_ids is not None:
        source = f"{DEVICE_MOUNT_ROOT} mounts"
        tokens = mount_ids
        devices = _device_tokens(",".join(mount_ids))
    elif privileged or config.accept_envvar_when_unprivileged:
        value = env.get(VISIBLE_DEVICES)
        if value is None:
            devices = (True, ()) if legacy else None
            tokens = ["all"] if legacy else None
        else:
            tokens = split_list(value)
            devices = _device_tokens(value)
    # else: an unprivileged container and a config that ignores its env: no GPUs
    if tokens is not None and (config.mode == "cdi" or any("=" in t for t in tokens)):
        # a qualified name anywhere in the list makes it a CDI request
        cdi = cdi_names(tokens)
        devices = None if cdi is None else (False, cdi)
    return devices, source, cdi


def request_from_spec(spec: dict[str, Any], config: Config) -> Request | None:
    """The container's GPU request, or None when it is not a GPU container."""
    env = spec_env(spec)
    privileged = is_privileged(spec)
    legacy = is_legacy_image(env)

    devices, source, cdi = _requested_devices(spec, env, privileged, legacy, config)
    if devices is None:
        return None
    if OLD_DRA_GRANT in env:
        # never a GPU without its cap: nvctk no longer reads the grant
        raise RequestError(f"{OLD_DRA_GRANT}: a DRA share prepared by an nvctk dra-plugin older "
                           "than plain-CDI shares; refused, it would run uncapped: let the plugin "
                           "prepare the claim again (delete and re-create the Pod)")

    mig_config = parse_bool_all(env, MIG_CONFIG)
    mig_monitor = parse_bool_all(env, MIG_MONITOR)
    for name, wanted in ((MIG_CONFIG, mig_config), (MIG_MONITOR, mig_monitor)):
        if wanted and not privileged:
            raise RequestError(f"{name}=all needs a privileged container (CAP_SYS_ADMIN)")

    check_mps(env)
    all_devices, ids = devices
    return Request(
        devices=ids,
        all_devices=all_devices,
        capabilities=parse_capabilities(env, legacy, config.supported_capabilities),
        requirements=requirement_expressions(env),
        disable_require=parse_bool(env.get(DISABLE_REQUIRE, "")),
        mig_config=mig_config,
        mig_monitor=mig_monitor,
        privileged=privileged,
        source=source,
        cdi_devices=cdi,
        vgpu_authority=_vgpu_authority(spec),
        env=env,
    )


MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def check_mps(env: dict[str, str]) -> None:
    """The MPS share a GPU container asks for (the device plugin's mps-core/mps-memory),
    checked at create: MPS itself would read a bad value as no limit, or refuse the
    client only once it runs."""
    threads = env.get(MPS_THREADS)
    if threads is not None:
        t = threads.strip()
        if not (t.isascii() and t.isdigit() and 1 <= int(t) <= 100):
            raise RequestError(f"{MPS_THREADS}={shown(threads)}: want a whole percentage "
                               "from 1 to 100")
    limits = env.get(MPS_MEMORY)
    if limits is None:
        return
    try:
        mps_memory_limits(limits)
    except ValueError as e:
        raise RequestError(f"{MPS_MEMORY}={shown(limits)}: want <device>=<size> items "
                           f"such as 0=8G (bad item {e})") from None


def mps_memory_limits(value: str) -> dict[str, int]:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: device (its index in the container, or a UUID)
    -> bytes. ValueError naming the first bad item."""
    from nvctk.vgpu.limits import parse_memory

    out: dict[str, int] = {}
    for item in value.split(","):
        dev, sep, size = item.strip().partition("=")
        try:
            ok = bool(sep) and ((dev.isascii() and dev.isdigit()) or dev.startswith("GPU-"))
            n = parse_memory(size) if ok else 0
        except ValueError:
            n = 0
        if n <= 0:
            raise ValueError(shown(item))
        out[str(int(dev)) if dev.isdigit() else dev] = n
    return out


def parse_bool_all(env: dict[str, str], name: str) -> bool:
    """NVIDIA_MIG_*_DEVICES: only `all` means anything (per-GPU lists are not supported)."""
    value = env.get(name, "").strip()
    if not value:
        return False
    tokens = split_list(value)
    if tokens == ["all"]:
        return True
    raise RequestError(f"{name}={shown(value)}: only 'all' is supported")


# every variable nvctk.vgpu.limits reads from a container's env starts with one of these
VGPU_ENV_PREFIXES = ("CUDA_DEVICE_", "NVCTK_VGPU_")


def asks_for_vgpu(request: Request) -> bool:
    """Whether the request may set a vGPU limit: the node's share annotations, or a
    variable nvctk.vgpu.limits reads (whether it sets a limit is the planner's call)."""
    return bool(request.vgpu_authority) or any(k.startswith(VGPU_ENV_PREFIXES)
                                               for k in request.env)


def expanded_capabilities(capabilities: tuple[str, ...]) -> list[str]:
    """The capabilities with the ones they include: video needs compute's files,
    display graphics'."""
    caps = list(capabilities)
    if "video" in caps and "compute" not in caps:
        caps.append("compute")
    if "display" in caps and "graphics" not in caps:
        caps.append("graphics")
    return caps
