"""Discovery, then planning, in one call: `cdi generate` plans every device of the host
with it, and tests plan a request on a simulated host. The runtime's create runs the same
steps itself (nvctk.runtime.create); the planning steps, nvctk.plan.*, do no I/O."""

from __future__ import annotations

from nvctk.edits import HOOK_NAME, DeviceNode, Plan
from nvctk.host import discover as disc
from nvctk.host.discover import load_and_select as _load_and_select
from nvctk.host.image import ImageFacts
from nvctk.host.image import image_facts as _image_facts
from nvctk.host.inventory import proc_bus_id
from nvctk.plan.devices import drm_nodes as _drm_nodes
from nvctk.plan.devices import plan_devices as _plan_devices
from nvctk.plan.devices import plan_drm_links
from nvctk.plan.hooks import plan_hooks as _plan_hooks
from nvctk.plan.make import check_requirements, make_edits
from nvctk.plan.mounts import (
    DEBIAN_LIB_DIR,
    REQUIRED,
    container_lib_dirs,
    container_path_of_host,
    plan_symlinks,
    required_for,
)
from nvctk.plan.mounts import plan_mounts as _plan_mounts
from nvctk.plan.select import Selected, resolve_device, select_devices, vgpu_devices
from nvctk.request.parse import VGPU_ENV_PREFIXES, asks_for_vgpu

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from nvctk.base.config import Config
    from nvctk.host.driver import DriverFiles
    from nvctk.host.inventory import HostInfo
    from nvctk.request.parse import Request

__all__ = [
    "DEBIAN_LIB_DIR", "REQUIRED", "VGPU_ENV_PREFIXES", "DeviceNode", "ImageFacts", "Selected",
    "container_lib_dirs", "container_path_of_host", "drm_nodes", "image_facts",
    "load_and_select", "make_plan", "plan_devices", "plan_drm_links", "plan_hooks",
    "plan_mounts", "plan_symlinks", "proc_bus_id", "required_for", "resolve_device",
    "select_devices", "vgpu_devices",
]



def image_facts(spec: dict[str, Any], bundle: str) -> ImageFacts:
    """The image's facts, its vGPU ones (libc, preload entries) included."""
    return _image_facts(spec, bundle, vgpu=True)


def load_and_select(request: Request, config: Config) -> tuple[HostInfo, list[Selected]]:
    return _load_and_select(request, config, select_devices)


def _device_facts(request: Request, selected: list[Selected],
                  files: DriverFiles) -> disc.DeviceFacts:
    return disc.device_facts(files, [(s.gpu, s.mig) for s in selected],
                             disc.expanded_capabilities(request.capabilities),
                             request.mig_config, request.mig_monitor)


def drm_nodes(request: Request, selected: list[Selected],
              files: DriverFiles) -> list[tuple[str, str]]:
    return _drm_nodes(request, selected, _device_facts(request, selected, files))


def plan_devices(request: Request, selected: list[Selected], files: DriverFiles,
                 drm: list[tuple[str, str]] | None = None) -> list[DeviceNode]:
    return _plan_devices(request, selected, _device_facts(request, selected, files), drm)


def plan_mounts(request: Request, files: DriverFiles, config: Config, lib_dir: str,
                lib32_dir: str) -> list:  # type: ignore[type-arg]
    compute = "compute" in disc.expanded_capabilities(request.capabilities)
    return _plan_mounts(
        request, files, lib_dir, lib32_dir,
        mps_dir=disc.mps_dir(files.driver_root) if compute else None,
        extra_mounts=config.extra_mounts,
        extra_mount_kinds=disc.extra_mount_kinds(config))


def plan_hooks(hook_path: str, config: Config, nvctk_config: str | None, vgpu: bool,
               runtime_root: str | None = None) -> tuple:  # type: ignore[type-arg]
    return _plan_hooks(hook_path, config.hook_timeout, nvctk_config, vgpu,
                       disc.absolute_runtime_root(runtime_root))


def make_plan(
    request: Request,
    config: Config,
    host: HostInfo | None = None,
    image: ImageFacts | None = None,
    *,
    hook_path: str = HOOK_NAME,
    nvctk_config: str | None = None,
    container_id: str | None = None,
    runtime_root: str | None = None,
    vgpu_library: Callable[[], str] | None = None,
) -> Plan:
    """select, discover, plan: the form for this request (see nvctk.runtime.create
    for the runtime's own sequence). host: NVML's view of config.driver_root, loaded when
    not given. image: the image's facts; without them the non-Debian lib dir is used
    and the vGPU checks of the image are skipped. vgpu_library: finds libvgpu.so."""
    image = image or ImageFacts()
    if host is None:
        host, selected = load_and_select(request, config)
    else:
        selected = select_devices(request, host)
    check_requirements(request, host, selected)
    state_dir = ""
    if asks_for_vgpu(request):
        from nvctk.vgpu.state import state_dir_for

        state_dir = state_dir_for(config, runtime_root, container_id or "container")
    facts = disc.discover(request, config, host, [(s.gpu, s.mig) for s in selected], image,
                          hook_path=hook_path, runtime_root=runtime_root,
                          vgpu_state_dir=state_dir)
    facts.nvctk_config = nvctk_config
    if vgpu_library is not None and asks_for_vgpu(request):
        facts.vgpu_library = disc.or_error(vgpu_library)
    return make_edits(request, config, facts, selected)
