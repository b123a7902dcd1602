"""nvctk-runtime's CDI mode: named CDI devices -> the edits form -> config.json.

The same footing as legacy mode (nvctk.runtime.create): the devices resolve into an
Edits (nvctk.cdi.resolve: nvctk's own createRuntime hooks decoded into symlinks and
the ldconfig step, the mounts of nvctk's own spec into the hook's mounts, any other
spec's mounts and hooks verbatim), nvctk.spec.apply applies it, and when it leaves the
prestart hook work (links, ldconfig, mounts) the form is saved beside the spec and
one `nvctk-hook prestart` does it, as in legacy mode: one hook process per
container, not one per CDI hook.
"""

from __future__ import annotations

import os

from nvctk.base import fileio
from nvctk.base.errors import RequestError, SpecError
from nvctk.edits import HOOK_NAME, PLAN_FILE, LogSettings, prestart_hook
from nvctk.oci import spec as oci
from nvctk.runtime import earlier
from nvctk.spec import apply as spec_edits

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.base.config import Config
    from nvctk.base.log import Logger
    from nvctk.edits import Edits
    from nvctk.request.parse import Request

# the variables that set vGPU limits (nvctk.vgpu.limits), which CDI mode does not apply
VGPU_LIMIT_VARS = ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT")


def make_edits(bundle: str, spec: dict[str, Any], request: Request, config: Config,
               hook_path: str, nvctk_config: str | None, served: str | None = None) -> Edits:
    """The form of the request's CDI devices (checked: vendors, specs, host binds)."""
    from nvctk.cdi import load, resolve

    assert request.cdi_devices is not None
    limits = sorted(k for k, v in request.env.items() if k.startswith(VGPU_LIMIT_VARS) and v)
    limits += [f"annotation {k}" for k, _ in request.vgpu_authority]  # the node's share
    if limits:
        raise RequestError(f"{limits[0]}: vGPU limits are not supported in CDI mode (devices "
                           f"from {request.source}); use plain device ids with mode = "
                           '"legacy" for a limited GPU')
    load.check_vendors(request.cdi_devices, config.cdi_vendors, request.source)
    from nvctk.runtime.passthrough import cache_dir

    # the parsed specs are kept beside the passthrough cache (root's, /run/nvctk)
    resolved = load.resolve(request.cdi_devices, config.cdi_spec_dirs, cache_dir())
    edits = resolve.to_edits(resolved, ldconfig=config.ldconfig, bundle=bundle, spec=spec)
    if edits.has_hook_work():
        # nvctk's own spec: one prestart hook does its links, ldconfig and mounts
        # (the planner's plan_hooks makes the same; its module is not needed here)
        hook = prestart_hook(hook_path, nvctk_config, config.hook_timeout, served)
        edits = edits.replace(hooks=(hook, *edits.hooks))
    return edits.replace(log=LogSettings(config.log_file, config.log_level))


def prepare(bundle: str, spec: dict[str, Any], data: bytes, request: Request, config: Config,
            logger: Logger | None, hook_path: str, nvctk_config: str | None,
            served: str | None = None) -> tuple[Edits, int]:
    """CDI mode's create: (the form applied, NVIDIA hooks removed). config.json is
    rewritten, and the form saved beside it for the prestart hook when it has work;
    on failure config.json is as it was."""
    spec_edits.check_editable(spec)
    oci.check_rewritable(spec, data)
    edits = make_edits(bundle, spec, request, config, hook_path, nvctk_config, served)
    record = earlier.earlier_record(bundle, spec, config.state_dir)
    spec_edits.check_record(record)
    if record is not None and record.problem is not None and logger is not None:
        logger.warning(f"{oci.SPEC_FILE}: {record.problem}")
    removed = spec_edits.apply(spec, edits, record, earlier.record_seal(
        bundle, config.state_dir, edits, cdi=True), cdi=True)[1]
    plan_path = os.path.join(bundle, PLAN_FILE)
    if not edits.has_hook_work():
        oci.save_spec(bundle, spec)
        _unlink(plan_path)  # an earlier legacy create's: no hook reads it now
        return edits, removed
    where = oci.spec_path(bundle)
    rootfs = oci.root_path(spec, bundle)
    if oci.bundle_in_rootfs(bundle, rootfs):
        # the hook trusts <bundle>/nvctk-plan.json (host paths to bind)
        raise SpecError(f"{where}: root.path {rootfs} contains the bundle; a GPU container's "
                        f"rootfs must not hold its own bundle (it could rewrite {PLAN_FILE})")
    # the hook mounts only the form's own mounts: a spec's verbatim ones are runc's
    saved = edits.replace(mounts=tuple(m for m in edits.mounts if m.options is None),
                          hooks=tuple(h for h in edits.hooks if h.args[:1] == (HOOK_NAME,)))
    # the form first: a spec that names our hook must never be visible without it
    fileio.atomic_write(plan_path, saved.to_json().encode(), 0o644, sync_dir=False)
    try:
        oci.save_spec(bundle, spec)
    except BaseException:
        _unlink(plan_path)
        raise
    return edits, removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
