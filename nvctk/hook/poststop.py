"""`nvctk-hook poststop [--runtime-root DIR]`: remove the container's vGPU state dir.

Nothing to undo for the mounts (they go with the container's mount namespace). The
dir is named by --runtime-root with the state's id: the bundle's form may be another
container's by now (two containers created from one bundle); the form (read by the one
form loader, nvctk.edits_file.load_edits) only when the hook has no --runtime-root (a
spec written by an nvctk that passed none). Then what containers that are gone left
is collected (nvctk.vgpu.gc).
"""

from __future__ import annotations

from nvctk.edits_file import load_edits
from nvctk.hook.entry import STATE, HookRun, UsageError, run
from nvctk.vgpu.gc import StateLock, collect_quietly, remove_state_dir
from nvctk.vgpu.state import state_dir_for

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO

    from nvctk.base.config import Config
    from nvctk.base.log import HookLog

USAGE = "usage: nvctk-hook poststop [--runtime-root DIR]  (OCI state JSON on stdin)"


def parse_args(args: list[str]) -> str | None:
    """The --runtime-root (None: none given)."""
    if not args:
        return None
    if args[:1] == ["--runtime-root"] and len(args) == 2 and args[1]:
        return args[1]
    raise UsageError(f"unexpected arguments {args!r}")


def poststop(hook: HookRun) -> str | None:
    """Remove the container's vGPU state dir, then collect; returns the dir (None:
    nothing to do)."""
    # the state dir's parent (and what gc may touch) is the node's setting
    cfg = hook.config()
    runtime_root = hook.opts
    if runtime_root is not None:
        d: str | None = state_dir_for(cfg, runtime_root, hook.state.id)
    else:
        edits = load_edits(hook.state.bundle)
        d = None if edits is None or edits.vgpu is None else edits.vgpu.state_dir
    if d is not None:
        with StateLock(cfg):
            # the container's own path, where its create mounted nvctk's tmpfs: whatever
            # is there now goes (never followed), as gc removes only what it can prove
            remove_state_dir(d, cfg, only_ours=False)
        hook.log.debug(f"{hook.state.id}: removed the vGPU state {d}")
    collect_quietly(cfg)
    return d


def main(argv: list[str], stdin: IO[bytes] | None = None, stderr: IO[str] | None = None,
         config: Config | None = None, log: HookLog | None = None) -> int:
    """Exit 0, or 1 with 'nvctk-hook: poststop: <why>' (2: bad usage)."""
    def body(hook: HookRun) -> None:
        poststop(hook)

    return run("poststop", body, argv, parse=parse_args, inputs=STATE, usage=USAGE,
               stdin=stdin, stderr=stderr, log=log, config=config)
