"""request + discovery's facts -> Edits (nvctk.edits, the one form). No I/O.

The steps: select (nvctk.plan.select, done before discovery: it says which nodes to
look at), requirements, devices, mounts, symlinks, vgpu, hooks. Each is a function of
plain records; this module only strings them together.
"""

from __future__ import annotations

from nvctk.edits import Edits, ProcMask
from nvctk.host.inventory import proc_bus_id  # records only: no I/O
from nvctk.plan.devices import drm_nodes, plan_devices, plan_drm_links
from nvctk.plan.hooks import hook_log, plan_hooks, removed_hooks
from nvctk.plan.mounts import container_lib_dirs, plan_mounts, plan_symlinks
from nvctk.plan.select import requirement_facts
from nvctk.request.parse import asks_for_vgpu

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.config import Config
    from nvctk.edits import Vgpu
    from nvctk.host.discover import Facts
    from nvctk.host.inventory import HostInfo
    from nvctk.plan.select import Selected
    from nvctk.request.parse import Request


def check_requirements(request: Request, host: HostInfo, selected: list[Selected]) -> None:
    """NVIDIA_REQUIRE_* against the host and the selected GPUs (RequirementError); a
    step of its own, before discovery (a container the host cannot run reads nothing)."""
    if not request.disable_require and request.requirements:
        # only containers that state requirements need it
        from nvctk.request.requirements import check

        check(request.requirements, requirement_facts(host, selected))


def make_vgpu(request: Request, config: Config, facts: Facts,
              selected: list[Selected]) -> Vgpu | None:
    if not asks_for_vgpu(request):
        return None
    # start time: plan.vgpu and vgpu.limits/authority: vGPU only
    from nvctk.plan.vgpu import plan_vgpu

    return plan_vgpu(request, selected, config, facts.image, authority_key=facts.authority_key,
                     library=facts.vgpu_library, state_dir=facts.vgpu_state_dir)


def make_edits(request: Request, config: Config, facts: Facts,
               selected: list[Selected]) -> Edits:
    """The form for this request on this host (check_requirements comes first, before
    discovery). Raises NvctkError subclasses whose message names the culprit."""
    files = facts.files
    lib_dir, lib32_dir = container_lib_dirs(facts.image)
    drm = drm_nodes(request, selected, facts.devices)
    devices = plan_devices(request, selected, facts.devices, drm)
    mounts = plan_mounts(request, files, lib_dir, lib32_dir, mps_dir=facts.mps_dir,
                         extra_mounts=config.extra_mounts,
                         extra_mount_kinds=facts.extra_mount_kinds)
    symlinks = plan_symlinks(mounts, lib_dir, facts.host.driver_version) + plan_drm_links(drm)
    vgpu = make_vgpu(request, config, facts, selected)
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
        hooks=plan_hooks(facts.hook_path, config.hook_timeout, facts.nvctk_config,
                         vgpu is not None, facts.runtime_root, facts.served),
        remove_hooks=removed_hooks(),
        # a vGPU container must not make user namespaces: in one it could mount over the
        # cap's files (docs/decisions.md)
        seccomp_block_userns=vgpu is not None,
        pins=pins,
        log=hook_log(config),
    )
