"""The vGPU decisions (no I/O): the limits a container gets (env, tightened to the node's
verified share), whether its image can take them, libvgpu's mounts, the env it adds,
the image's preload entries kept after libvgpu's, and the seccomp and pin decisions.
"""

from __future__ import annotations

import posixpath

from nvctk.base.errors import NvctkError, RequestError
from nvctk.edits import PRELOAD, VGPU_DIRS, VGPU_PINS, Mount, Vgpu
from nvctk.plan.select import vgpu_devices
from nvctk.request.parse import asks_for_vgpu
from nvctk.vgpu import authority
from nvctk.vgpu import limits as vgpu

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from nvctk.base.config import Config
    from nvctk.host.image import ImageFacts
    from nvctk.host.select import Selected
    from nvctk.request.parse import Request


def _a_limit_variable(env: dict[str, str]) -> str:
    """The first variable that sets a limit (for messages)."""
    for k in sorted(env):
        try:
            if k.startswith(vgpu.MEMORY_VAR) and vgpu.parse_memory(env[k]):
                return k
            if k.startswith(vgpu.SM_VAR) and vgpu.parse_sm(env[k]):
                return k
        except ValueError:
            continue
    return vgpu.MEMORY_VAR


def authority_shares(request: Request, config: Config, key: bytes | NvctkError | None,
                     devs: list[Selected]) -> list[tuple[int, int]]:
    """(memory bytes, SM percent) per GPU of the container, as the node granted them in
    verified nvctk.io/vgpu.* annotations (nvctk.vgpu.authority). A GPU the container gets
    but no annotation names is refused: its share would not hold there."""
    if isinstance(key, NvctkError):
        raise key
    annotations = dict(request.vgpu_authority)
    shares = authority.shares(annotations, key, config.authority_key)
    uuids = [d.mig.uuid if d.mig is not None else d.gpu.uuid for d in devs]
    missing = [u for u in uuids if u not in shares]
    if missing:
        raise RequestError(
            f"annotation {', '.join(sorted(annotations))}: the node granted a vGPU share of "
            f"{', '.join(sorted(shares)) or 'no device'}, but the container also gets "
            f"{', '.join(missing)} (from {request.source}); refused: the share would not hold there")
    return [shares[u] for u in uuids]


def check_preloadable(libc: str | None, variable: str) -> None:
    """RequestError unless the image's loader honours /etc/ld.so.preload (glibc);
    libc None: not known, not checked."""
    if libc is None or libc == "glibc":
        return
    why = ("the image uses musl (/lib/ld-musl-*.so.1), which ignores /etc/ld.so.preload"
           if libc == "musl" else
           "the image has no glibc dynamic loader (/lib64/ld-linux-x86-64.so.2 or "
           "/lib/ld-linux-*.so*), so nothing would load /etc/ld.so.preload")
    raise RequestError(
        f"{variable} is set but GPU limits cannot be enforced in this container: {why}; "
        "libvgpu.so needs a glibc-based image (unset the limit or use a glibc image)"
    )


def plan_vgpu(request: Request, selected: Sequence[Selected], config: Config, image: ImageFacts,
              *, authority_key: bytes | NvctkError | None = None,
              library: str | NvctkError = "", state_dir: str = "") -> Vgpu | None:
    """CUDA_DEVICE_MEMORY_LIMIT[_i] / CUDA_DEVICE_SM_LIMIT[_i] -> Vgpu (None: no limit).

    Validates at create time (RequestError naming the variable): malformed values,
    an index beyond the container's GPUs, a memory cap above the GPU's memory, and
    an image whose loader would ignore /etc/ld.so.preload (musl, no glibc loader).
    authority_key, library: discovery's (an error is raised here, only for a limit);
    state_dir: the container's vGPU state dir (nvctk.vgpu.state.state_dir_for).
    """
    if not asks_for_vgpu(request):
        return None
    env = {k: v for k, v in request.env.items() if k != vgpu.CACHE_VAR}  # nvctk sets that one
    devs = vgpu_devices(selected)
    limits = vgpu.limits_from_env(env, len(devs))
    granted = (authority_shares(request, config, authority_key, devs)
               if request.vgpu_authority else None)
    if granted is not None:
        # the env can only tighten what the node granted (docs/decisions.md)
        limits = vgpu.VgpuLimits(
            memory=tuple(vgpu.stricter(m, g[0]) for m, g in zip(limits.memory, granted, strict=True)),
            sm=tuple(vgpu.stricter(p, g[1]) for p, g in zip(limits.sm, granted, strict=True)),
            shared_cache=limits.shared_cache, context_reserve=limits.context_reserve)
    if not limits.any:
        return None
    for i, (cap, dev) in enumerate(zip(limits.memory, devs, strict=True)):
        mib = dev.mig.memory_mib if dev.mig is not None else dev.gpu.memory_mib
        if cap and mib and cap > mib << 20:
            if granted is not None and granted[i][0] == cap:
                what = f"the node's vGPU share ({cap >> 20} MiB)"
            else:
                name = vgpu.limit_source(env, vgpu.MEMORY_VAR, i, cap)
                what = f"{name}={env[name]}"
            raise RequestError(
                f"{what}: above the memory of the container's GPU {i} "
                f"({dev.name}, {mib} MiB)"
            )
    check_preloadable(image.libc, _a_limit_variable(env))
    if isinstance(library, NvctkError):
        raise library
    if isinstance(image.preload_entries, NvctkError):
        raise image.preload_entries
    return Vgpu(
        library=library,
        container_library=vgpu.CONTAINER_LIBRARY,
        state_dir=state_dir,
        container_state_dir=vgpu.VGPU_DIR,
        limits={**limits.values(), **gpu_uuid_keys(devs)},
        root_readonly=image.root_readonly,
        mounts=vgpu_mounts(library, vgpu.CONTAINER_LIBRARY, state_dir, vgpu.VGPU_DIR),
        preload_entries=kept_preload_entries(vgpu.CONTAINER_LIBRARY, image.preload_entries),
    )


def claim_vgpu(library: str, ledger: str, limits: dict[str, str]) -> Vgpu:
    """A DRA share claim's vGPU part (nvctk.dra.driver): its ledger (a state dir of the
    claim's, nvctk.vgpu.state.install_ledger) with the claim's limits, bound into every
    container of the claim by the claim's CDI spec, and the dirs its hook pins. No image
    is known when the spec is written: the preload holds libvgpu alone."""
    mounts = vgpu_mounts(library, vgpu.CONTAINER_LIBRARY, ledger, vgpu.VGPU_DIR)
    return Vgpu(library=library, container_library=vgpu.CONTAINER_LIBRARY, state_dir=ledger,
                container_state_dir=vgpu.VGPU_DIR, limits=limits, mounts=mounts)


def gpu_uuid_keys(devs: list[Selected]) -> dict[str, str]:
    """NVCTK_VGPU_UUID_<i>: the container's GPU i by UUID, so libvgpu maps CUDA's devices
    to their limits without loading NVML; only where every device is a whole GPU (a MIG
    device's CUDA UUID is not the MIG- one NVML names), else libvgpu asks NVML."""
    if any(d.mig is not None for d in devs):
        return {}
    return {f"{vgpu.UUID_VAR}_{i}": d.gpu.uuid for i, d in enumerate(devs)}


def kept_preload_entries(container_library: str, image_entries: tuple[str, ...]) -> tuple[str, ...]:
    """The image's own /etc/ld.so.preload entries the container keeps after libvgpu
    (which comes first: its cu* symbols win): each once, libvgpu itself not again."""
    return tuple(dict.fromkeys(e for e in image_entries if e != container_library))


def vgpu_mounts(library: str, container_library: str, state_dir: str,
                container_state_dir: str) -> tuple[Mount, ...]:
    """The vGPU mounts in their order (docs: the vGPU state layout): ro/ at /run/nvctk,
    libvgpu.so, rw/ at /run/nvctk/vgpu, ro/limits and rw/cache on their placeholders in
    it, ro/ld.so.preload over /etc/ld.so.preload. All required: a container that sets
    a limit never runs uncapped. state_dir: the container's, or a DRA claim's ledger."""
    join = posixpath.join
    top = posixpath.dirname(container_state_dir)
    ro, rw = (join(state_dir, d) for d in VGPU_DIRS)
    return (
        Mount(ro, top, "dir", True, False, True),
        Mount(library, container_library, "file", True, False, True),
        Mount(rw, container_state_dir, "dir", False, True, True),
        Mount(join(ro, "limits"), join(container_state_dir, "limits"), "file", True, True, True),
        Mount(join(rw, "cache"), join(container_state_dir, "cache"), "file", False, True, True),
        Mount(join(ro, "ld.so.preload"), PRELOAD, "file", True, True, True),
    )


def vgpu_env(plan: Vgpu | None) -> dict[str, str]:
    """The env the runtime adds: where the container's accounting file is."""
    if plan is None:
        return {}
    return {"CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{plan.container_state_dir}/cache"}


def vgpu_pins(plan: Vgpu | None) -> tuple[str, ...]:
    """The rootfs dirs the hook pins before the vGPU mounts: the top dirs of their
    container paths (/run/nvctk, /etc/ld.so.preload), so no link the image planted on
    the way redirects them."""
    if plan is None:
        return ()
    tops = [m.container_path.lstrip("/").split("/", 1)[0] for m in plan.mounts]
    return tuple(t for t in VGPU_PINS if t in tops) + tuple(
        t for t in dict.fromkeys(tops) if t not in VGPU_PINS)
