"""The records discovery fills and the planner (nvctk.plan.make.plan_container) reads:
the host's facts (legacy mode, Facts), the CDI devices' (CDI mode, CdiFacts), and this
invocation's context (ids and paths, which are no host fact). Records only: no I/O,
light to import. The planner dispatches on the facts' class."""

from __future__ import annotations

from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

    from nvctk.base.errors import NvctkError
    from nvctk.edits import DeviceNode
    from nvctk.host.driver import DriverFiles
    from nvctk.host.image import ImageFacts
    from nvctk.host.inventory import HostInfo
    from nvctk.host.select import Selected

DEFAULT_RUNTIME_ROOT = "/run/runc"  # runc's --root when none is given


class DeviceFacts(Record):
    """The host's device nodes as the kernel has them (their numbers are never
    hard-coded: nvidia-uvm's and nvidia-caps' majors are dynamic)."""

    __slots__ = ("dev_dir", "nodes", "proc_majors", "cap_minors", "drm")  # noqa: RUF023

    def __init__(self, dev_dir: str = "/dev",
                 nodes: dict[str, tuple[int, int] | str | None] | None = None,
                 proc_majors: dict[str, int] | None = None,
                 cap_minors: dict[str, int | str] | None = None,
                 drm: dict[str, tuple[str, ...]] | None = None) -> None:
        self.dev_dir = dev_dir
        # path under dev_dir -> (major, minor); None: missing; str: why it is unusable
        self.nodes: dict[str, tuple[int, int] | str | None] = nodes or {}
        # /proc/devices: driver name -> major (read only when a caps node is missing)
        self.proc_majors: dict[str, int] = proc_majors or {}
        # capabilities/<rel> access file -> its DeviceFileMinor, or why it cannot be read
        self.cap_minors: dict[str, int | str] = cap_minors or {}
        # sysfs bus id -> its DRM node names (card before renderD)
        self.drm: dict[str, tuple[str, ...]] = drm or {}


class Facts(Record):
    """What the host and the image say, read for a legacy-mode plan (nvctk.plan.make)."""

    kind: Literal["legacy"] = "legacy"  # the tag plan_container dispatches on

    __slots__ = ("host", "selected", "files", "devices", "image", "mps_dir",  # noqa: RUF023
                 "extra_mount_kinds", "authority_key", "vgpu_library")

    def __init__(self, host: HostInfo, selected: tuple[Selected, ...], files: DriverFiles,
                 devices: DeviceFacts, image: ImageFacts, *, mps_dir: str | None = None,
                 extra_mount_kinds: dict[str, str] | None = None,
                 authority_key: bytes | NvctkError | None = None,
                 vgpu_library: str | NvctkError = "") -> None:
        self.host = host
        # the request's devices on host, container order (nvctk.host.select: queried once)
        self.selected = selected
        self.files = files
        self.devices = devices
        self.image = image
        self.mps_dir = mps_dir  # the host's MPS pipe dir (a real dir, not a link); None: none
        # extra-mounts host path -> "file" | "dir"
        self.extra_mount_kinds: dict[str, str] = extra_mount_kinds or {}
        self.authority_key = authority_key  # read only when the request has vGPU annotations
        self.vgpu_library = vgpu_library  # libvgpu.so's host path ("" not looked for)


class CdiEdit(Record):
    """One containerEdits object of the CDI devices a container names (a device's, or once
    per spec file that file's common one), as read and checked (nvctk.cdi.resolve): where
    it is, whether nvctk wrote its spec, the object itself, its device nodes as the host
    has them (type, numbers and mode from the spec, else a stat) and, for nvctk's own
    spec, its mount sources' kinds."""

    __slots__ = ("where", "own", "edits", "nodes", "kinds")  # noqa: RUF023

    def __init__(self, where: str, own: bool, edits: dict[str, Any],
                 nodes: tuple[DeviceNode, ...] = (),
                 kinds: dict[str, Literal["file", "dir", "socket"]] | None = None) -> None:
        self.where = where  # "<spec file>: device <name>" or "<spec file>: containerEdits"
        self.own = own  # a spec `nvctk cdi generate` wrote (its hooks run nvctk-hook)
        self.edits = edits
        self.nodes = nodes  # edits' deviceNodes, in their order
        # hostPath -> what is there ("file" also for a missing one: the hook skips it)
        self.kinds: dict[str, Literal["file", "dir", "socket"]] = kinds or {}


class CdiFacts(Record):
    """What the CDI specs say of the devices a container names, in their order: CDI mode's
    facts (nvctk.cdi.resolve.cdi_facts), which the planner (nvctk.plan.cdi) decides from."""

    kind: Literal["cdi"] = "cdi"  # the tag plan_container dispatches on

    __slots__ = ("entries",)

    def __init__(self, entries: tuple[CdiEdit, ...]) -> None:
        self.entries = entries


class Context(Record):
    """This invocation's own values, beside the host's facts: where nvctk-hook is, the
    config the hooks are to load, runc's root, the container's vGPU state dir."""

    __slots__ = ("hook_path", "nvctk_config", "runtime_root", "vgpu_state_dir")

    def __init__(self, hook_path: str = "nvctk-hook", nvctk_config: str | None = None,
                 runtime_root: str = DEFAULT_RUNTIME_ROOT, vgpu_state_dir: str = "") -> None:
        self.hook_path = hook_path  # nvctk-hook's absolute path
        self.nvctk_config = nvctk_config  # NVCTK_CONFIG made absolute, for the hooks
        self.runtime_root = runtime_root  # runc's --root, absolute and normalised
        self.vgpu_state_dir = vgpu_state_dir  # this container's vGPU state dir ("" none)
