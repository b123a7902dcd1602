"""`nvctk-hook prestart`: state -> bundle -> plan -> the worker's steps.

The inputs are nvctk.hook.inputs's, the work nvctk.hook.worker's (its docstring
lists the steps). This module holds what is the prestart hook's own: the checks
between the state and the plan, the log, the exit codes.

This runs in every GPU container's start, so it imports only os-level modules
and small nvctk modules that do the same (tests/test_prestart.py checks the
import profile): no json, re, typing, dataclasses, subprocess or signal.
"""

from __future__ import annotations

import os
import sys

from nvctk.base import config as nvconfig
from nvctk.base.errors import NvctkError, SpecError
from nvctk.base.log import HookLog
from nvctk.edits import PLAN_FILE
from nvctk.hook.inputs import load_plan, parse_state, rootfs_path, sanitize_environ
from nvctk.hook.worker import apply_plan
from nvctk.oci.spec import bundle_in_rootfs, load_spec_as_runc

# typing is for the type checker only (the hook starts in every GPU container)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO


def prestart(stdin_text: str | bytes, log_override: HookLog | None = None,
             drop_parent_caps: bool = False) -> None:
    """The whole hook minus process-level concerns (env, exit codes)."""
    state = parse_state(stdin_text)
    config = nvconfig.load()
    log = log_override or HookLog(config.log_file, config.log_level)
    try:
        log.debug(f"prestart id={state.id} pid={state.pid} bundle={state.bundle}")
        if state.pid <= 0:
            raise SpecError(f"hook state on stdin: container {state.id} has no pid")
        try:
            spec = load_spec_as_runc(state.bundle)
        except SpecError as e:
            if not os.path.lexists(os.path.join(state.bundle, PLAN_FILE)):
                # the runtime wrapper handed an unreadable spec on: it saw no GPU
                log.warning(f"{state.id}: {e}; no {PLAN_FILE}: no GPU asked for, nothing to do")
                return
            raise
        rootfs = rootfs_path(state, spec)
        if bundle_in_rootfs(state.bundle, rootfs):
            # the container's own files would be the plan naming host paths to mount
            raise SpecError(f"rootfs {rootfs} contains the bundle {state.bundle}: refusing to "
                            f"trust {PLAN_FILE} there")
        plan = load_plan(state.bundle)
        if plan is None:
            log.warning(f"{state.id}: no {PLAN_FILE} in {state.bundle}: nvctk-runtime made no "
                        "plan for this container (no GPU asked for, or not created through "
                        "it); nothing to do")
            return
        apply_plan(plan, rootfs, state.pid, log, drop_parent_caps)
        log.info(f"{state.id}: prestart done ({len(plan.mounts)} mounts, rootfs {rootfs})")
    except NvctkError as e:
        log.error(f"{state.id}: {e}")
        raise
    finally:
        if log_override is None:
            log.close()


def main(stdin: IO[bytes] | None = None, stderr: IO[str] | None = None) -> int:
    sanitize_environ()
    err = stderr or sys.stderr
    try:
        data = (stdin or sys.stdin.buffer).read()
        prestart(data, drop_parent_caps=True)
        return 0
    except NvctkError as e:
        err.write(f"nvctk-hook: {e}\n")
        err.flush()
        return 1
    except Exception as e:  # a bug: still a clear, non-zero failure
        err.write(f"nvctk-hook: internal error: {e!r}\n")
        err.flush()
        return 1
