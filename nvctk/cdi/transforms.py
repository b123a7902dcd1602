"""The named transforms from the planner's forms to the parts of a CDI spec, in one place.

`nvctk cdi generate` and the DRA driver plan a container's form (nvctk.plan.make) with
no device (what every container gets) and with each device; a CDI spec is those forms
less what belongs to one container, and the DRA driver's per-claim spec adds a share's
vGPU part. Each step is one function here; nothing else edits a form or a CDI dict
(nvctk.cdi.generate.make_spec writes the parts as they are).
"""

from __future__ import annotations

from nvctk.edits import Edits, on_host
from nvctk.request.parse import VISIBLE_DEVICES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.edits import Mount, Symlink, Vgpu


def common_part(common: Edits, mounts: list[Mount], symlinks: list[Symlink]) -> Edits:
    """What a spec's common containerEdits say: the no-device form's nodes, env and the
    ldconfig step, with `mounts` (its own and the driver's extra files) and their links,
    and nothing of one container's (GPUs, /proc mask, hooks, hooks to remove, where the
    hook logs, the devices selected: no container is planned)."""
    return common.replace(gpu_uuids=(), mounts=tuple(mounts), symlinks=tuple(symlinks),
                          proc_mask=None, hooks=(), remove_hooks=(), log=None, selected=())


def device_part(own: Edits, common: Edits, uuid: str) -> Edits:
    """What a device's containerEdits say: the nodes and links its form has beyond the
    common form's (`common`: the no-device form)."""
    nodes = {d.path for d in common.devices}
    return Edits(own.driver_version, own.capabilities, (uuid,),
                 devices=tuple(d for d in own.devices if d.path not in nodes),
                 symlinks=tuple(s for s in own.symlinks if s not in common.symlinks),
                 ldconfig="")


# The part with its sources as the host sees them: a node component in a container sees
# the driver under a mount of its own (config host-driver-root). The form's own step.
sources_on_host = on_host


def with_vgpu_share(common: Edits, vgpu: Vgpu, env: dict[str, str],
                    pins: tuple[str, ...]) -> Edits:
    """A DRA share's common part: the host's, plus the share's vGPU mounts (libvgpu, the
    ledger's limits and cache, ld.so.preload), its env, and the rootfs dirs its hook pins
    first (nvctk.plan.vgpu.vgpu_env, vgpu_pins)."""
    return common.replace(mounts=(*common.mounts, *vgpu.mounts), env={**common.env, **env},
                          pins=pins)


def claim_part(common: Edits, env: dict[str, str], mounts: tuple[Mount, ...] = ()) -> Edits:
    """A DRA claim's common part: its devices and no other (NVIDIA_VISIBLE_DEVICES=void:
    an image's =all, which CUDA images have, must not widen the claim under
    nvctk-runtime's legacy mode), and what every container of the claim gets besides
    (`env`, `mounts`: an MPS claim's limits and pipe directory)."""
    return common.replace(env={**common.env, VISIBLE_DEVICES: "void", **env},
                          mounts=(*common.mounts, *mounts))
