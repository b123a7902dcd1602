"""`nvctk-hook prestart`: state -> bundle -> plan -> the worker's steps.

The inputs are read and the errors mapped by nvctk.hook.entry (the same for every
hook command), the work is nvctk.hook.worker's (its docstring lists the steps).

This runs in every GPU container's start, so it imports only os-level modules
and small nvctk modules that do the same (tests/integration/test_hook_prestart.py checks the
import profile): no json, re, typing, dataclasses, subprocess or signal.
"""

from __future__ import annotations

import io

from nvctk.edits import SERVED_FLAG
from nvctk.hook.entry import EDITS, HookRun, UsageError, run
from nvctk.hook.worker import apply_edits

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO

    from nvctk.base.log import HookLog


def parse_args(argv: list[str]) -> str | None:
    """The arguments: none, or `--served TOKEN` (nvctk-runtime's server, nvctk.hook.served,
    which the launcher did not reach when this runs)."""
    if not argv:
        return None
    if len(argv) == 2 and argv[0] == SERVED_FLAG and argv[1]:
        return argv[1]
    raise UsageError(f"unexpected arguments {argv!r} (want none, or {SERVED_FLAG} TOKEN)")


def body(hook: HookRun, drop_parent_caps: bool = True, served: bool = False) -> None:
    """The worker's steps on the plan (entry has read state, spec, rootfs and plan)."""
    plan, rootfs = hook.edits, hook.rootfs
    assert plan is not None and rootfs is not None  # inputs=EDITS
    if hook.opts is not None and not served:
        hook.log.info(f"{hook.state.id}: nvctk-runtime's prestart server was not there (runc "
                      "not started by the create that wrote this spec): the hook runs by itself")
    apply_edits(plan, rootfs, hook.state.pid, hook.log, drop_parent_caps)
    by = ", served by nvctk-runtime" if served else ""
    hook.log.info(f"{hook.state.id}: prestart done{by} ({len(plan.mounts)} mounts, "
                  f"rootfs {rootfs})")


def main(argv: list[str] | None = None, stdin: IO[bytes] | None = None,
         stderr: IO[str] | None = None, log: HookLog | None = None,
         drop_parent_caps: bool = True, served: bool = False) -> int:
    """Exit 0, or 1 with 'nvctk-hook: prestart: <why>' on stderr (2: bad arguments).
    served: run by nvctk-runtime's server (nvctk.hook.served), not by the hook."""
    return run("prestart", lambda hook: body(hook, drop_parent_caps, served), argv or [],
               parse=parse_args, inputs=EDITS, stdin=stdin, stderr=stderr, log=log)


def answer(state: bytes) -> tuple[int, str]:
    """The prestart nvctk-runtime's server runs for the launcher that handed it `state`:
    (exit code, the text for the hook's stderr)."""
    err = io.StringIO()
    code = main([], stdin=io.BytesIO(state), stderr=err, served=True)
    return code, err.getvalue()
