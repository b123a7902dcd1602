"""A legacy-mode form on a (simulated) host, as nvctk-runtime's create makes it: the
runtime's discovery (nvctk.runtime.create.legacy_facts), this invocation's context, then
the one planner (nvctk.plan.make.plan_container)."""

from __future__ import annotations

from nvctk.base.config import Config
from nvctk.edits import HOOK_NAME, Edits
from nvctk.host.image import ImageFacts
from nvctk.host.inventory import HostInfo
from nvctk.host.paths import context
from nvctk.plan.make import plan_container
from nvctk.request.parse import Request
from nvctk.runtime.create import legacy_facts, vgpu_state_dir


def make_plan(request: Request, config: Config, host: HostInfo | None = None,
              image: ImageFacts | None = None, *, hook_path: str = HOOK_NAME,
              container_id: str = "container", runtime_root: str | None = None) -> Edits:
    """The form for this request. host: NVML's view of config.driver_root, loaded when not
    given. image: the image's facts; without them the non-Debian lib dir is used and the
    vGPU checks of the image are skipped."""
    facts = legacy_facts(request, config, image or ImageFacts(), host)
    ctx = context(config, hook_path=hook_path, runtime_root=runtime_root,
                  vgpu_state_dir=vgpu_state_dir(request, config, runtime_root, container_id))
    return plan_container(request, config, facts, ctx)
