"""`nvctk-hook cdi-edits|create-symlinks|update-ldcache`: a CDI spec's hook, where
an engine (podman, containerd with CDI) applies nvctk's spec itself.

The arguments decode into the edits form (nvctk.edits.cdi_hook_args, as
nvctk-runtime's CDI mode decodes them), and the prestart hook's worker does it
(nvctk.hook.worker.apply_plan: capabilities limited, paths resolved inside the
rootfs, the host's static ldconfig chrooted). nvctk-runtime's own CDI mode never
runs these: it folds them into its one prestart hook.
"""

from __future__ import annotations

import sys

USAGE = ("usage: nvctk-hook cdi-edits [--link TARGET::PATH]... [--folder DIR] | "
         "create-symlinks --link TARGET::PATH... | update-ldcache --folder DIR  "
         "(OCI state JSON on stdin)\n")


def main(cmd: str, args: list[str]) -> int:
    from nvctk.base import config as nvconfig
    from nvctk.base.errors import NvctkError, SpecError
    from nvctk.base.log import HookLog
    from nvctk.edits import Edits, cdi_hook_args
    from nvctk.hook.inputs import parse_state, rootfs_path, sanitize_environ
    from nvctk.hook.worker import apply_plan
    from nvctk.oci.spec import load_spec

    sanitize_environ()
    try:
        links, folder = cdi_hook_args(cmd, args)
    except ValueError as e:
        sys.stderr.write(f"nvctk-hook: {cmd}: {e}\n{USAGE}")
        return 2
    try:
        state = parse_state(sys.stdin.buffer.read())
        if state.pid <= 0:
            raise SpecError(f"hook state on stdin: container {state.id} has no pid")
        config = nvconfig.load()
        rootfs = rootfs_path(state, load_spec(state.bundle))
        edits = Edits("", (), (), symlinks=links, lib_dir=folder or "/",
                      ldconfig=config.ldconfig if folder else "")
        log = HookLog(config.log_file, config.log_level)
        try:
            apply_plan(edits, rootfs, state.pid, log, drop_parent_caps=True)
            log.info(f"{state.id}: {cmd} done")
        except NvctkError as e:
            log.error(f"{state.id}: {cmd}: {e}")
            raise
        finally:
            log.close()
        return 0
    except NvctkError as e:
        sys.stderr.write(f"nvctk-hook: {cmd}: {e}\n")
        return 1
    except Exception as e:  # a bug: still a clear, non-zero failure
        sys.stderr.write(f"nvctk-hook: {cmd}: internal error: {e!r}\n")
        return 1
