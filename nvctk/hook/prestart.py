"""`nvctk-hook prestart`: state -> bundle -> plan -> the worker's steps.

The inputs are read and the errors mapped by nvctk.hook.entry (the same for every
hook command), the work is nvctk.hook.worker's (its docstring lists the steps).

This runs in every GPU container's start, so it imports only os-level modules
and small nvctk modules that do the same (tests/test_prestart.py checks the
import profile): no json, re, typing, dataclasses, subprocess or signal.
"""

from __future__ import annotations

from nvctk.hook.entry import PLAN, HookRun, run
from nvctk.hook.worker import apply_plan

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO

    from nvctk.base.log import HookLog


def body(hook: HookRun, drop_parent_caps: bool = True) -> None:
    """The worker's steps on the plan (entry has read state, spec, rootfs and plan)."""
    plan, rootfs = hook.plan, hook.rootfs
    assert plan is not None and rootfs is not None  # inputs=PLAN
    apply_plan(plan, rootfs, hook.state.pid, hook.log, drop_parent_caps)
    hook.log.info(f"{hook.state.id}: prestart done ({len(plan.mounts)} mounts, rootfs {rootfs})")


def main(stdin: IO[bytes] | None = None, stderr: IO[str] | None = None,
         log: HookLog | None = None, drop_parent_caps: bool = True) -> int:
    """Exit 0, or 1 with 'nvctk-hook: prestart: <why>' on stderr."""
    return run("prestart", lambda hook: body(hook, drop_parent_caps), [], inputs=PLAN,
               stdin=stdin, stderr=stderr, log=log)
