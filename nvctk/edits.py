"""The plan: every edit a GPU container gets, computed once from request + host.

nvctk's one intermediate form, as NVIDIA's toolkit turns discovery into CDI
container edits: device nodes (with their cgroup rules), mounts (each saying
whether the container may start without it), symlinks, env, hooks and the vGPU
mounts. nvctk.plan.planner makes it; nvctk.edits applies it to the spec and the shim
saves it beside the spec; the prestart hook reads it back (nvctk.hook.inputs) and
performs its mounts, deciding nothing the plan does not say; nvctk.cdi.cdi writes the
same records out as a CDI spec.
"""

from __future__ import annotations

from nvctk.base import jsonio
from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

PLAN_FILE = "nvctk-plan.json"  # in the bundle directory, beside config.json
# the host side of a vGPU container's state (nvctk.vgpu.state), below its own tmpfs:
# ro/ is mounted read-only at /run/nvctk, rw/ (the accounting dir) read-write over its
# placeholder ro/vgpu; the other names are files, or placeholders (mount points) for
# the files bound over them. Nothing the container can write backs a read-only bind.
VGPU_DIRS = ("ro", "rw")
VGPU_FILES = ("ro/limits", "ro/ld.so.preload", "rw/cache", "rw/limits")
PRELOAD = "/etc/ld.so.preload"


class DeviceNode(Record):
    __slots__ = ("path", "host_path", "major", "minor", "type", "file_mode")  # noqa: RUF023

    def __init__(self, path: str, host_path: str, major: int, minor: int,
                 type: Literal["c", "b"] = "c", file_mode: int = 0o666) -> None:
        self.path = path  # path inside the container, e.g. /dev/nvidia0
        self.host_path = host_path  # node on the host (under the driver root's dev dir)
        self.major = major
        self.minor = minor
        self.type = type
        self.file_mode = file_mode


class Mount(Record):
    __slots__ = ("host_path", "container_path", "kind", "read_only", "noexec",  # noqa: RUF023
                 "required")

    def __init__(self, host_path: str, container_path: str,
                 kind: Literal["file", "dir", "socket"] = "file", read_only: bool = True,
                 noexec: bool = False, required: bool = False) -> None:
        self.host_path = host_path
        self.container_path = container_path
        self.kind = kind
        self.read_only = read_only  # IPC mounts are writable but noexec
        self.noexec = noexec
        # the container does not start without it (a missing source, or a destination
        # off the rootfs's own mounts); else the hook skips it, saying so in the log
        self.required = required


class Hook(Record):
    """An OCI hook nvctk puts into the spec (hooks.<stage>)."""

    __slots__ = ("stage", "path", "args", "env", "timeout")  # noqa: RUF023

    def __init__(self, stage: str, path: str, args: tuple[str, ...],
                 env: tuple[str, ...] = (), timeout: int = 0) -> None:
        self.stage = stage  # prestart, poststop, createRuntime, ...
        self.path = path
        self.args = args
        self.env = env  # built from scratch: never the container's
        self.timeout = timeout  # seconds, 0: none

    def entry(self) -> dict[str, Any]:
        """The spec's hook object."""
        out: dict[str, Any] = {"path": self.path, "args": list(self.args)}
        if self.env:
            out["env"] = list(self.env)
        if self.timeout:
            out["timeout"] = self.timeout
        return out


class Symlink(Record):
    __slots__ = ("container_path", "target")

    def __init__(self, container_path: str, target: str) -> None:
        self.container_path = container_path
        self.target = target  # relative or absolute as it should read inside the container


class ProcMask(Record):
    """Mask /proc/driver/nvidia with a tmpfs holding only these host files."""

    __slots__ = ("host_dir", "gpu_bus_ids")  # noqa: RUF023

    def __init__(self, host_dir: str, gpu_bus_ids: tuple[str, ...]) -> None:
        self.host_dir = host_dir  # the driver's /proc/driver/nvidia on the host
        # gpus/<busid> dirs to copy (lower-case, as procfs names them)
        self.gpu_bus_ids = gpu_bus_ids


class VgpuPlan(Record):
    __slots__ = ("library", "container_library", "state_dir",  # noqa: RUF023
                 "container_state_dir", "limits", "root_readonly", "mounts")

    def __init__(self, library: str, container_library: str, state_dir: str,
                 container_state_dir: str, limits: dict[str, str] | None = None,
                 root_readonly: bool = False, mounts: tuple[Mount, ...] = ()) -> None:
        self.library = library  # host path of libvgpu.so
        self.container_library = container_library  # where it is mounted
        # per-container state on the host: its own tmpfs holding ro/ and rw/
        self.state_dir = state_dir
        self.container_state_dir = container_state_dir  # where rw/ is mounted in the container
        # validated CUDA_DEVICE_* values
        self.limits: dict[str, str] = {} if limits is None else limits
        # the spec's root.readonly: the hook's pins of /etc and /run are then read-only
        # too (runc remounts only / read-only)
        self.root_readonly = root_readonly
        # the state's mounts, in their order, after the hook pins /etc and /run; each
        # lands at exactly its path (no link on the way) and all are required
        self.mounts = mounts


class Plan(Record):
    __slots__ = ("driver_version", "capabilities", "gpu_uuids", "devices",  # noqa: RUF023
                 "mounts", "symlinks", "proc_mask", "lib_dir", "ldconfig", "env", "vgpu",
                 "hooks")

    def __init__(
        self,
        driver_version: str,
        capabilities: tuple[str, ...],
        gpu_uuids: tuple[str, ...],
        devices: tuple[DeviceNode, ...] = (),
        mounts: tuple[Mount, ...] = (),
        symlinks: tuple[Symlink, ...] = (),
        proc_mask: ProcMask | None = None,
        lib_dir: str = "/usr/lib/x86_64-linux-gnu",
        ldconfig: str = "/sbin/ldconfig",
        env: dict[str, str] | None = None,
        vgpu: VgpuPlan | None = None,
        hooks: tuple[Hook, ...] = (),
    ) -> None:
        self.driver_version = driver_version
        self.capabilities = capabilities
        # selected GPUs (parents included for MIG), container order
        self.gpu_uuids = gpu_uuids
        self.devices = devices
        self.mounts = mounts
        self.symlinks = symlinks
        self.proc_mask = proc_mask
        self.lib_dir = lib_dir  # container lib dir the libraries land in
        self.ldconfig = ldconfig  # host ldconfig to run chrooted in the rootfs
        self.env: dict[str, str] = {} if env is None else env  # added to process.env
        self.vgpu = vgpu
        self.hooks = hooks

    def to_json(self) -> str:
        return jsonio.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        d = jsonio.loads(text)
        d["capabilities"] = tuple(d["capabilities"])
        d["gpu_uuids"] = tuple(d["gpu_uuids"])
        d["devices"] = tuple(DeviceNode(**x) for x in d["devices"])
        d["mounts"] = tuple(Mount(**x) for x in d["mounts"])
        d["symlinks"] = tuple(Symlink(**x) for x in d["symlinks"])
        if d["proc_mask"] is not None:
            pm = d["proc_mask"]
            d["proc_mask"] = ProcMask(pm["host_dir"], tuple(pm["gpu_bus_ids"]))
        if d["vgpu"] is not None:
            v = d["vgpu"]
            v["mounts"] = tuple(Mount(**x) for x in v["mounts"])
            d["vgpu"] = VgpuPlan(**v)
        d["hooks"] = tuple(Hook(h["stage"], h["path"], tuple(h["args"]), tuple(h["env"]),
                                h["timeout"]) for h in d["hooks"])
        return cls(**d)
