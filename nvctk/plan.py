"""The plan: everything a GPU container gets, computed once from request + host.

The shim turns a Plan into spec edits (devices, cgroup rules, hooks, env) and
saves it beside the spec; the prestart hook reads it back and performs the
mounts. Both executables go through `make_plan` (nvctk.planner) so they agree.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Literal

PLAN_FILE = "nvctk-plan.json"  # in the bundle directory, beside config.json


@dataclass(frozen=True)
class DeviceNode:
    path: str  # path inside the container, e.g. /dev/nvidia0
    host_path: str  # node on the host (under the driver root's dev dir)
    major: int
    minor: int
    type: Literal["c", "b"] = "c"
    file_mode: int = 0o666


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    kind: Literal["file", "dir", "socket"] = "file"
    read_only: bool = True  # IPC mounts are writable but noexec
    noexec: bool = False


@dataclass(frozen=True)
class Symlink:
    container_path: str
    target: str  # relative or absolute as it should read inside the container


@dataclass(frozen=True)
class ProcMask:
    """Mask /proc/driver/nvidia with a tmpfs holding only these host files."""

    host_dir: str  # the driver's /proc/driver/nvidia on the host
    gpu_bus_ids: tuple[str, ...]  # gpus/<busid> dirs to copy (lower-case, as procfs names them)


@dataclass(frozen=True)
class VgpuPlan:
    library: str  # host path of libvgpu.so
    container_library: str  # where it is mounted
    state_dir: str  # per-container accounting dir on the host
    container_state_dir: str  # where it is mounted in the container
    limits: dict[str, str] = field(default_factory=dict)  # validated CUDA_DEVICE_* values


@dataclass(frozen=True)
class Plan:
    driver_version: str
    capabilities: tuple[str, ...]
    gpu_uuids: tuple[str, ...]  # selected GPUs (parents included for MIG), container order
    devices: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    symlinks: tuple[Symlink, ...] = ()
    proc_mask: ProcMask | None = None
    lib_dir: str = "/usr/lib/x86_64-linux-gnu"  # container lib dir the libraries land in
    ldconfig: str = "/sbin/ldconfig"  # host ldconfig to run chrooted in the rootfs
    env: dict[str, str] = field(default_factory=dict)  # added to process.env by the shim
    vgpu: VgpuPlan | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
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
