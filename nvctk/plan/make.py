"""request + facts + context -> Edits (nvctk.edits, the one form). No I/O.

plan_container is the one planner: nvctk-runtime's legacy and CDI modes, `nvctk cdi
generate` (and through it the per-claim specs of the DRA driver) all call it, and differ
only in what they ask for (the request), what discovery read for it (legacy: the host's
Facts, with the devices selected on it; CDI mode: the CdiFacts of the named devices),
which it dispatches on, and where the form goes. The legacy steps: requirements,
devices, mounts, symlinks, vgpu, hooks; CDI mode's decisions are nvctk.plan.cdi. Each is
a function of plain records; this module only strings them together.
"""

from __future__ import annotations

# start time: CDI mode (on every CDI create's path) needs only what is imported here;
# the legacy steps (devices, mounts, select, vgpu) are imported by _plan_legacy
from nvctk.base.errors import RequestError
from nvctk.edits import prestart_hook
from nvctk.plan.hooks import hook_log
from nvctk.request.parse import asks_for_vgpu

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from nvctk.base.config import Config
    from nvctk.edits import Edits, Vgpu
    from nvctk.host.facts import CdiFacts, Context, Facts
    from nvctk.host.inventory import HostInfo
    from nvctk.host.select import Selected
    from nvctk.request.parse import Request


def check_requirements(request: Request, host: HostInfo, selected: Sequence[Selected]) -> None:
    """NVIDIA_REQUIRE_* against the host and the selected GPUs (RequirementError); a
    step of its own, before discovery (a container the host cannot run reads nothing)."""
    if not request.disable_require and request.requirements:
        # only containers that state requirements need it
        from nvctk.plan.select import requirement_facts
        from nvctk.request.requirements import check

        check(request.requirements, requirement_facts(host, selected))


def make_vgpu(request: Request, config: Config, facts: Facts, context: Context) -> Vgpu | None:
    if not asks_for_vgpu(request):
        return None
    # start time: plan.vgpu and vgpu.limits/authority: vGPU only
    from nvctk.plan.vgpu import plan_vgpu

    return plan_vgpu(request, facts.selected, config, facts.image,
                     authority_key=facts.authority_key, library=facts.vgpu_library,
                     state_dir=context.vgpu_state_dir)


def plan_container(request: Request, config: Config, facts: Facts | CdiFacts,
                   context: Context) -> Edits:
    """The form for this request: from the host's facts (legacy mode; check_requirements
    comes first, before discovery) or from the CDI devices' (CDI mode). Raises NvctkError
    subclasses whose message names the culprit."""
    if facts.kind == "cdi":  # discovery read the CDI devices the request names
        return _plan_cdi(config, facts, context)
    return _plan_legacy(request, config, facts, context)


# the variables that set vGPU limits (nvctk.vgpu.limits), which CDI mode does not apply
VGPU_LIMIT_VARS = ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT")


def check_cdi_request(request: Request) -> None:
    """No vGPU limit in CDI mode, which cannot cap (RequestError); a step of its own,
    before discovery, as check_requirements is (a refused container reads no spec)."""
    limits = sorted(k for k, v in request.env.items() if k.startswith(VGPU_LIMIT_VARS) and v)
    limits += [f"annotation {k}" for k, _ in request.vgpu_authority]  # the node's share
    if limits:
        raise RequestError(f"{limits[0]}: vGPU limits are not supported in CDI mode (devices "
                           f"from {request.source}); use plain device ids with mode = "
                           '"legacy" for a limited GPU')


def _plan_cdi(config: Config, facts: CdiFacts, context: Context) -> Edits:
    """CDI mode (check_cdi_request comes first, before discovery): the devices' edits as
    their specs say them (nvctk.plan.cdi), one prestart hook for what the form leaves the
    hook (nvctk's own spec: links, ldconfig, mounts), where the hook logs."""
    from nvctk.plan.cdi import cdi_edits

    edits = cdi_edits(facts, config.ldconfig)
    if edits.has_hook_work():
        hook = prestart_hook(context.hook_path, context.nvctk_config, config.hook_timeout)
        edits = edits.replace(hooks=(hook, *edits.hooks))
    return edits.replace(log=hook_log(config))


def _plan_legacy(request: Request, config: Config, facts: Facts, context: Context) -> Edits:
    from nvctk.edits import Edits, ProcMask
    from nvctk.host.inventory import proc_bus_id  # records only: no I/O
    from nvctk.plan.devices import drm_nodes, plan_devices, plan_drm_links
    from nvctk.plan.hooks import plan_hooks, removed_hooks
    from nvctk.plan.mounts import container_lib_dirs, plan_mounts, plan_symlinks
    from nvctk.plan.select import vgpu_devices

    selected = list(facts.selected)  # the query discovery made of the host's inventory
    files = facts.files
    lib_dir, lib32_dir = container_lib_dirs(facts.image, files)
    drm = drm_nodes(request, selected, facts.devices)
    devices = plan_devices(request, selected, facts.devices, drm)
    mounts = plan_mounts(request, files, lib_dir, lib32_dir, mps_dir=facts.mps_dir,
                         extra_mounts=config.extra_mounts,
                         extra_mount_kinds=facts.extra_mount_kinds)
    symlinks = plan_symlinks(mounts, lib_dir, facts.host.driver_version) + plan_drm_links(drm)
    vgpu = make_vgpu(request, config, facts, context)
    env: dict[str, str] = {}
    pins: tuple[str, ...] = ()
    if vgpu is not None:
        from nvctk.plan.vgpu import vgpu_env, vgpu_pins  # loaded by make_vgpu already

        env, pins = vgpu_env(vgpu), vgpu_pins(vgpu)
    return Edits(
        driver_version=facts.host.driver_version,
        capabilities=request.capabilities,
        gpu_uuids=tuple(dict.fromkeys(s.gpu.uuid for s in selected)),
        devices=tuple(devices),
        mounts=tuple(mounts),
        symlinks=tuple(symlinks),
        proc_mask=ProcMask(
            files.proc_dir, tuple(dict.fromkeys(proc_bus_id(s.gpu.pci_bus_id) for s in selected))
        ),
        lib_dir=lib_dir,
        ldconfig=config.ldconfig,
        env=env,
        vgpu=vgpu,
        hooks=plan_hooks(context.hook_path, config.hook_timeout, context.nvctk_config,
                         vgpu is not None, context.runtime_root),
        remove_hooks=removed_hooks(),
        # a vGPU container must not make user namespaces: in one it could mount over the
        # cap's files (docs/decisions.md)
        seccomp_block_userns=vgpu is not None,
        pins=pins,
        log=hook_log(config),
        selected=tuple(s.name for s in vgpu_devices(selected)),
    )
