"""The plan: everything a GPU container gets, computed once from request + host.

The shim turns a Plan into spec edits (devices, cgroup rules, hooks, env) and
saves it beside the spec; the prestart hook reads it back and performs the
mounts. Both executables go through `make_plan` (nvctk.planner) so they agree.
"""

from __future__ import annotations

from nvctk import jsonio
from nvctk.record import Record

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Literal

PLAN_FILE = "nvctk-plan.json"  # in the bundle directory, beside config.json


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
    __slots__ = ("host_path", "container_path", "kind", "read_only", "noexec")  # noqa: RUF023

    def __init__(self, host_path: str, container_path: str,
                 kind: Literal["file", "dir", "socket"] = "file", read_only: bool = True,
                 noexec: bool = False) -> None:
        self.host_path = host_path
        self.container_path = container_path
        self.kind = kind
        self.read_only = read_only  # IPC mounts are writable but noexec
        self.noexec = noexec


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
                 "container_state_dir", "limits", "root_readonly")

    def __init__(self, library: str, container_library: str, state_dir: str,
                 container_state_dir: str, limits: dict[str, str] | None = None,
                 root_readonly: bool = False) -> None:
        self.library = library  # host path of libvgpu.so
        self.container_library = container_library  # where it is mounted
        # per-container state on the host: its own tmpfs holding ro/ and rw/
        self.state_dir = state_dir
        self.container_state_dir = container_state_dir  # where rw/ is mounted in the container
        # validated CUDA_DEVICE_* values
        self.limits: dict[str, str] = {} if limits is None else limits
        # the spec's root.readonly (the hook reads it from the spec): the hook's pins of
        # /etc and /run are then read-only too (runc remounts only / read-only)
        self.root_readonly = root_readonly


class Plan(Record):
    __slots__ = ("driver_version", "capabilities", "gpu_uuids", "devices",  # noqa: RUF023
                 "mounts", "symlinks", "proc_mask", "lib_dir", "ldconfig", "env", "vgpu")

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
        self.env: dict[str, str] = {} if env is None else env  # added to process.env by the shim
        self.vgpu = vgpu

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
            d["vgpu"] = VgpuPlan(**d["vgpu"])
        return cls(**d)
