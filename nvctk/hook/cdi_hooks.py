"""`nvctk-hook cdi-edits|create-symlinks|update-ldcache`: a CDI spec's hook, where
an engine (podman, containerd with CDI) applies nvctk's spec itself.

The arguments decode into the edits form (nvctk.edits.cdi_hook_args, as
nvctk-runtime's CDI mode decodes them), and the prestart hook's worker does it
(nvctk.hook.worker.apply_edits: capabilities limited, paths resolved inside the
rootfs, the host's static ldconfig chrooted). nvctk-runtime's own CDI mode never
runs these: it folds them into its one prestart hook.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

USAGE = ("usage: nvctk-hook cdi-edits [--link TARGET::PATH]... [--folder DIR] [--pin etc|run]... | "
         "create-symlinks --link TARGET::PATH... | update-ldcache --folder DIR  "
         "(OCI state JSON on stdin)\n")


def main(cmd: str, args: list[str]) -> int:
    from nvctk.edits import Edits, cdi_hook_args
    from nvctk.hook.entry import ROOTFS, HookRun, UsageError, run
    from nvctk.hook.worker import apply_edits

    def parse(argv: list[str]) -> Any:  # nvctk.edits.CdiHookArgs
        try:
            return cdi_hook_args(cmd, argv)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def body(hook: HookRun) -> None:
        got = hook.opts
        assert hook.rootfs is not None  # ROOTFS: read by run
        folder = got.folder
        # pins first (the worker's order): what runc bound below them stays there
        edits = Edits("", (), (), symlinks=got.links, lib_dir=folder or "/",
                      ldconfig=hook.config().ldconfig if folder else "", pins=got.pins)
        apply_edits(edits, hook.rootfs, hook.state.pid, hook.log, drop_parent_caps=True)
        hook.log.info(f"{hook.state.id}: {cmd} done")

    return run(cmd, body, args, parse=parse, inputs=ROOTFS, usage=USAGE)
