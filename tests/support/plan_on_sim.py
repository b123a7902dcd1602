"""What the legacy form's tests on the simulated hosts (tests/integration/
test_plan_on_sim_*.py) share: a spec of env, the form planned from it the shim's way,
and its device nodes."""

from __future__ import annotations

from typing import Any

from nvctk.base import config as nvconfig
from nvctk.edits import Edits
from nvctk.host.image import image_facts
from nvctk.host.nvml import HostInfo
from nvctk.request.parse import request_from_spec
from support.planning import make_plan


def spec(env: dict[str, str], **extra: Any) -> dict[str, Any]:
    proc: dict[str, Any] = {"env": [f"{k}={v}" for k, v in env.items()]}
    proc.update(extra)
    return {"process": proc, "root": {"path": "rootfs"}}


def plan_of(s: dict[str, Any], cfg: nvconfig.Config, host: HostInfo | None = None, *,
            bundle: str | None = None, rootfs: str | None = None, **kw: Any) -> Edits | None:
    """The shim's way: the request, the image's facts (from a rootfs or a bundle), the plan."""
    request = request_from_spec(s, cfg)
    if request is None:
        return None
    image = None
    if rootfs is not None:
        image = image_facts({"root": {"path": rootfs}}, "/", vgpu=True)
    elif bundle is not None:
        image = image_facts(s, bundle, vgpu=True)
    return make_plan(request, cfg, host, image, **kw)


def plan(cfg: nvconfig.Config, host: HostInfo, env: dict[str, str], **kw: Any) -> Edits:
    p = plan_of(spec(env), cfg, host, **kw)
    assert p is not None
    return p


def nodes(p: Edits) -> list[str]:
    return [d.path for d in p.devices]
