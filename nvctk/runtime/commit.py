"""The one commit of a GPU create, whatever made its form (legacy mode, CDI mode): the
form applied to the spec (what an earlier create added out first, as its record proves), the container's vGPU state made, the form saved beside the
spec for the prestart hook, then the spec saved. A spec that names nvctk's hook is never
visible without what the hook reads; a failure leaves none of the three."""

from __future__ import annotations

import os

from nvctk.base import fileio
from nvctk.base.errors import NvctkError
from nvctk.edits import is_prestart_hook
from nvctk.edits_file import remove_edits, save_edits
from nvctk.host.facts import DEFAULT_RUNTIME_ROOT
from nvctk.oci import spec as oci
from nvctk.runtime import earlier
from nvctk.spec import apply as spec_edits

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.base.config import Config
    from nvctk.base.log import Logger
    from nvctk.edits import Edits
    from nvctk.spec.record import EarlierRecord


def commit(bundle: str, spec: dict[str, Any], edits: Edits, record: EarlierRecord | None,
           config: Config, logger: Logger | None, *, container_id: str | None = None,
           runtime_root: str | None = None) -> tuple[int, str | None]:
    """Apply `edits` to the (in-memory) spec and save: (NVIDIA hooks removed, the vGPU
    state dir this create made or None). nvctk's part of the spec comes from this form
    only: what an earlier create of this bundle added goes first, as far as its record
    proves it (record: nvctk.runtime.earlier's judgement, checked before planning)."""
    removed = spec_edits.apply(spec, edits, record,
                               earlier.record_seal(bundle, config.state_dir, edits))[1]
    if not any(is_prestart_hook(h) for h in edits.hooks):
        oci.save_spec(bundle, spec)
        remove_edits(bundle, logger)  # an earlier create's: no hook reads it now
        return removed, None
    oci.check_bundle_outside_rootfs(bundle, oci.root_path(spec, bundle))
    vgpu_dir = None
    if edits.vgpu is not None and _install_vgpu(edits, config, container_id, runtime_root,
                                                logger):
        vgpu_dir = edits.vgpu.state_dir
    try:
        form_path = save_edits(bundle, edits)  # beside the spec, before it
        try:
            oci.save_spec(bundle, spec)
        except BaseException:
            fileio.unlink_quietly(form_path)
            raise
    except BaseException:
        if vgpu_dir is not None:
            remove_vgpu_dir(vgpu_dir, config)
        raise
    return removed, vgpu_dir


def remove_vgpu_dir(path: str, config: Config) -> None:
    """Best effort, on a failure path: the failure itself is what gets reported."""
    from nvctk.vgpu import state as vgpu_state

    try:
        vgpu_state.remove_state_dir(path, config)
    except (OSError, NvctkError):
        pass


def _install_vgpu(edits: Edits, config: Config, container_id: str | None,
                  runtime_root: str | None, logger: Logger | None) -> bool:
    """(Re)create the container's vGPU state dir; False if left alone because the
    runtime already has a container of this id (runc then refuses the create)."""
    from nvctk.vgpu import state as vgpu_state  # only for vGPU: it brings the mount code, re, ...

    assert edits.vgpu is not None
    if container_id and os.path.isdir(
            os.path.join(runtime_root or DEFAULT_RUNTIME_ROOT, container_id)):
        if logger is not None:
            logger.warning(f"{container_id}: the runtime already has this container; "
                           f"its vGPU state {edits.vgpu.state_dir} is left as it is")
        return False
    # it also reclaims the state of containers that are gone (vgpu_state.collect)
    vgpu_state.install(edits.vgpu, config, runtime_root=runtime_root,
                       container_id=container_id)
    return True
