"""Allocate and GetPreferredAllocation: what a container gets for the device ids
the kubelet chose, independent of gRPC (server.py converts; the CRI tests call
this directly).

Device list strategies (flags.deviceListStrategy, several may be combined):
- envvar: NVIDIA_VISIBLE_DEVICES=<uuid>,...
- volume-mounts: /dev/null bound at /var/run/nvidia-container-devices/<uuid>
  (with NVIDIA_VISIBLE_DEVICES pointing there, so an image's own `all` is overridden);
- cdi-annotations: `cdi.k8s.io/nvctk-device-plugin_<resource>` = CDI names;
- cdi-cri: the response's cdi_devices.
A vGPU share goes in the env (CUDA_DEVICE_MEMORY_LIMIT, CUDA_DEVICE_SM_LIMIT, as
HAMi's) and, with every strategy, in a MAC'd `nvctk.io/vgpu.<name>` annotation
(nvctk.vgpu.authority) that neither the Pod nor the image can write: the runtime takes the
stricter of the two, so the container's env can only tighten its share.
CDI names are `<kind>=<uuid>` (nvctk cdi generate names every device by uuid).
With neither envvar nor volume-mounts, NVIDIA_VISIBLE_DEVICES=void, so that an
image's baked-in `all` cannot widen a CDI request in legacy mode.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass, field

from nvctk.base.errors import NvctkError, RequestError
from nvctk.edits import host_path_of
from nvctk.k8s.config import PluginConfig
from nvctk.k8s.resources import Device, Resource, Unit, vgpu_share
from nvctk.vgpu import authority

DEVICE_MOUNT_ROOT = "/var/run/nvidia-container-devices"
MPS_PIPE_IN_CONTAINER = "/tmp/nvidia-mps"
ANNOTATION_PREFIX = "cdi.k8s.io/nvctk-device-plugin_"


class AllocateError(NvctkError):
    """code: a gRPC status code name (INVALID_ARGUMENT, FAILED_PRECONDITION)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Allocation:
    """A ContainerAllocateResponse, as plain data."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (container, host, ro)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)


def _check_ids(res: Resource, ids: list[str], unhealthy: set[str]) -> list[Device]:
    if not ids:
        raise AllocateError("INVALID_ARGUMENT", f"{res.name}: the request names no device")
    unknown = [i for i in ids if i not in res.devices]
    if unknown:
        raise AllocateError("INVALID_ARGUMENT",
                            f"{res.name}: unknown device id(s): {', '.join(unknown)}")
    dup = [i for i, n in Counter(ids).items() if n > 1]
    if dup:
        raise AllocateError("INVALID_ARGUMENT",
                            f"{res.name}: device id(s) asked for twice: {', '.join(dup)}")
    devs = [res.devices[i] for i in ids]
    sick = [d.id for d in devs if d.unit.uuid in unhealthy or d.unit.gpu_uuid in unhealthy]
    if sick:
        raise AllocateError("FAILED_PRECONDITION",
                            f"{res.name}: unhealthy device id(s): {', '.join(sick)}")
    return devs


def mps_pipe(pipe_dir: str, driver_root: str, host_root: str | None = None) -> str:
    """The host's MPS pipe directory (pipe_dir under driver_root, as the host names it:
    under host_root when this process sees the driver root elsewhere); a clear error
    when it is not a real directory, never a silent non-MPS run (a container without it
    would bypass MPS's limits). The DRA driver's MPS claims use it too."""
    root = os.path.abspath(driver_root)
    host = os.path.join(root, pipe_dir.lstrip("/"))
    try:
        st = os.lstat(host)
    except OSError as e:
        raise AllocateError(
            "FAILED_PRECONDITION",
            f"MPS pipe directory {host} is missing ({e.strerror}): start the MPS control daemon "
            "(nvidia-cuda-mps-control -d) on this node, or set flags.mpsPipeDirectory")
    if not stat.S_ISDIR(st.st_mode):
        raise AllocateError("FAILED_PRECONDITION",
                            f"MPS pipe directory {host} is not a directory (a link or file)")
    return host_path_of(root, host_root, host) if host_root else host


def _per_gpu(devs: list[Device]) -> dict[Unit, int]:
    """Units in host order (the container's device order) with their share counts."""
    c = Counter(d.unit for d in devs)
    return dict(sorted(c.items(), key=lambda kv: (kv[0].gpu_index, kv[0].mig_index or 0)))


def allocate(res: Resource, cfg: PluginConfig, ids: list[str], driver_root: str,
             unhealthy: set[str] | frozenset[str] = frozenset()) -> Allocation:
    """One container's allocation; AllocateError names what is wrong."""
    devs = _check_ids(res, ids, set(unhealthy))
    if res.kind == "time-slicing" and res.fail_gt_one and len(devs) > 1:
        raise AllocateError(
            "INVALID_ARGUMENT",
            f"{res.name}: {len(devs)} replicas requested, but failRequestsGreaterThanOne allows 1 "
            "(a time-sliced replica gives no more compute than one)")
    shares = _per_gpu(devs)
    units = list(shares)
    out = Allocation()

    if res.kind == "mps-memory":
        # GPU choice is mps-core's: the memory limit names the container's device 0
        # (kubelet merges both resources' answers; two device lists would conflict)
        if len(units) > 1:
            raise AllocateError(
                "INVALID_ARGUMENT",
                f"{res.name}: the {len(devs)} GiB span GPUs "
                f"{', '.join(str(u.gpu_index) for u in units)}; MPS memory must lie on one GPU")
        pipe = mps_pipe(cfg.mps_pipe_dir, driver_root, cfg.host_driver_root)
        out.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={len(devs)}G"
        out.envs["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
        out.mounts.append((MPS_PIPE_IN_CONTAINER, pipe, False))
        return out

    _device_list(out, res, cfg, units)
    if res.kind == "vgpu":
        many = len(units) > 1
        granted = []
        for i, (u, k) in enumerate(shares.items()):
            mib, sm = vgpu_share(u, res.replicas)
            suffix = f"_{i}" if many else ""
            out.envs[f"CUDA_DEVICE_MEMORY_LIMIT{suffix}"] = f"{mib * k}m"
            out.envs[f"CUDA_DEVICE_SM_LIMIT{suffix}"] = str(min(100, sm * k))
            granted.append((u.uuid, (mib * k) << 20, min(100, sm * k)))
        if cfg.authority_key is not None:
            out.annotations.update([_share_annotation(res.name, granted, cfg.authority_key)])
    elif res.kind == "mps-core":
        counts = set(shares.values())
        if len(counts) > 1:
            split = ", ".join(f"GPU {u.gpu_index}: {k}" for u, k in shares.items())
            raise AllocateError(
                "INVALID_ARGUMENT",
                f"{res.name}: uneven shares across GPUs ({split}); "
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is one value for every GPU of a container")
        pipe = mps_pipe(cfg.mps_pipe_dir, driver_root, cfg.host_driver_root)
        out.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(counts.pop())
        out.envs["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
        out.mounts.append((MPS_PIPE_IN_CONTAINER, pipe, False))
    return out


def _share_annotation(resource: str, granted: list[tuple[str, int, int]],
                      key_path: str) -> tuple[str, str]:
    try:
        key = authority.load_key(key_path, create=True)
    except OSError as e:
        raise AllocateError("FAILED_PRECONDITION",
                            f"{key_path}: cannot make nvctk's authority key: {e.strerror}")
    except RequestError as e:
        raise AllocateError("FAILED_PRECONDITION", str(e))
    assert key is not None  # create: made, or an error
    return authority.make(resource, granted, key)


def _device_list(out: Allocation, res: Resource, cfg: PluginConfig, units: list[Unit]) -> None:
    uuids = [u.uuid for u in units]
    s = cfg.strategies
    if "envvar" in s:
        out.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids)
    elif "volume-mounts" in s:
        out.envs["NVIDIA_VISIBLE_DEVICES"] = DEVICE_MOUNT_ROOT
    else:
        out.envs["NVIDIA_VISIBLE_DEVICES"] = "void"
    if "volume-mounts" in s:
        out.mounts += [(f"{DEVICE_MOUNT_ROOT}/{u}", "/dev/null", True) for u in uuids]
    names = [f"{cfg.cdi_kind}={u}" for u in uuids]
    if "cdi-annotations" in s:
        key = ANNOTATION_PREFIX + res.name.split("/", 1)[1]
        out.annotations[key] = ",".join(names)
    if "cdi-cri" in s:
        out.cdi_devices += names


# --- GetPreferredAllocation ---------------------------------------------------------------


def preferred(res: Resource, available: list[str], must_include: list[str], size: int) -> list[str]:
    """size ids from available, must_include first. vGPU and MPS shares are packed
    onto as few GPUs as possible (the fullest GPU that fits the rest, else the GPUs
    with the most free shares first); time-sliced replicas are spread over the
    least-used GPUs, as NVIDIA's plugin does; whole GPUs and MIG devices keep order."""
    avail = [i for i in dict.fromkeys(available) if i in res.devices and i not in must_include]
    chosen = [i for i in dict.fromkeys(must_include) if i in res.devices]
    need = size - len(chosen)
    if need <= 0:
        return chosen[:size]
    by_unit: dict[str, list[str]] = {}
    for i in avail:
        by_unit.setdefault(res.devices[i].unit.uuid, []).append(i)
    order = {u: n for n, u in enumerate(res.units)}
    if res.kind in ("vgpu", "mps-core", "mps-memory"):
        used = {res.devices[i].unit.uuid for i in chosen}
        # GPUs already holding this container's shares first
        for u in sorted(used, key=lambda u: order[u]):
            take = by_unit.pop(u, [])[:need]
            chosen += take
            need -= len(take)
        while need > 0 and by_unit:
            fits = [u for u, ids in by_unit.items() if len(ids) >= need]
            if fits:  # best fit: the GPU with the fewest free shares that holds the rest
                u = min(fits, key=lambda u: (len(by_unit[u]), order[u]))
            else:
                u = max(by_unit, key=lambda u: (len(by_unit[u]), -order[u]))
            take = by_unit.pop(u)[:need]
            chosen += take
            need -= len(take)
        return chosen
    if res.kind == "time-slicing":
        load = Counter(res.devices[i].unit.uuid for i in chosen)
        total = {u: sum(1 for d in res.devices.values() if d.unit.uuid == u) for u in by_unit}
        while need > 0 and by_unit:
            # most free replicas = least used by others; then fewest given to this container
            u = min(by_unit, key=lambda u: (load[u], -len(by_unit[u]) / total[u], order[u]))
            chosen.append(by_unit[u].pop(0))
            load[u] += 1
            need -= 1
            if not by_unit[u]:
                del by_unit[u]
        return chosen
    return chosen + avail[:need]
