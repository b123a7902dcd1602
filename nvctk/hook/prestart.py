"""`nvctk-hook prestart`: state -> bundle -> form -> the worker's steps.

The inputs are read and the errors mapped by nvctk.hook.entry (the same for every
hook command); the work is done by two children this process forks
(nvctk.hook.children): the worker (nvctk.hook.worker, whose docstring lists the steps)
and the ldconfig child (nvctk.hook.ldconfig).

This runs in every GPU container's start, so it imports only os-level modules
and small nvctk modules that do the same (tests/integration/test_hook_prestart.py checks the
import profile): no json, re, typing, dataclasses, subprocess or signal.
"""

from __future__ import annotations

import io

from nvctk.base.record import Record
from nvctk.edits import SERVED_FLAG
from nvctk.hook.children import Children, apply_edits, start
from nvctk.hook.entry import EDITS, Early, HookRun, UsageError, read_early, run

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


class Ready(Record):
    """A served prestart made ready while runc starts (ready): its inputs read early
    (entry.Early: read by the server from the bundle before runc runs the hook), its
    children forked and waiting for the container's pid (children.Children). The hook,
    when it comes, takes the children only if its inputs are those (take); what is not
    taken is ended unused (release)."""

    __slots__ = ("early", "children")  # noqa: RUF023

    def __init__(self, early: Early, children: Children | None) -> None:
        self.early = early
        self.children = children  # None once taken (body) or released

    def take(self, hook: HookRun) -> Children | None:
        """The children, when the hook's inputs are the very ones read here (entry.run
        puts the Early on the hook only when Early.holds for its state); None when they
        are not, or the children were taken already (they serve one hook)."""
        children = self.children if hook.early is self.early else None
        if children is not None:
            self.children = None
        return children

    def release(self) -> None:
        """What was not taken: the children ended (they mounted nothing), the log closed."""
        if self.children is not None:
            self.children.cancel()
            self.children = None
        self.early.log.close()


def ready(bundle: str) -> Ready | None:
    """The server's work before runc runs the hook (nvctk.hook.served): the bundle's
    inputs read and the worker and ldconfig forked, each opening the host side; None
    when the inputs are not as a GPU create leaves them (the hook reads them anew)."""
    early = read_early(bundle)
    if early is None:
        return None
    try:
        return Ready(early, start(early.edits, early.rootfs, early.log))
    except OSError:
        early.log.close()
        return None


def body(hook: HookRun, drop_parent_caps: bool = True, served: bool = False,
         prepared: Ready | None = None) -> None:
    """The prestart's own work, as entry.run calls each command's body once it has read
    the state, spec, rootfs and form: the children made ready (prepared) when they are
    this hook's, else children forked now (children.apply_edits), then the log's line."""
    edits, rootfs = hook.edits, hook.rootfs
    assert edits is not None and rootfs is not None  # inputs=EDITS
    if hook.opts is not None and not served:
        hook.log.info(f"{hook.state.id}: nvctk-runtime's prestart server was not there (runc "
                      "not started by the create that wrote this spec): the hook runs by itself")
    by = ", served by nvctk-runtime" if served else ""
    children = prepared.take(hook) if prepared is not None else None
    if children is not None:
        children.go(edits, hook.state.pid, hook.log, drop_parent_caps, hook.deadline())
        by += ", made ready while runc started"
    else:
        if prepared is not None:
            hook.log.info(f"{hook.state.id}: the inputs read while runc started are not "
                          "this hook's (another bundle, or its files changed): read anew")
        apply_edits(edits, rootfs, hook.state.pid, hook.log, drop_parent_caps, hook.deadline())
    hook.log.info(f"{hook.state.id}: prestart done{by} ({len(edits.mounts)} mounts, "
                  f"rootfs {rootfs})")


def main(argv: list[str] | None = None, stdin: IO[bytes] | None = None,
         stderr: IO[str] | None = None, log: HookLog | None = None,
         drop_parent_caps: bool = True, served: bool = False,
         prepared: Ready | None = None) -> int:
    """Exit 0, or 1 with 'nvctk-hook: prestart: <why>' on stderr (2: bad arguments).
    served: run by nvctk-runtime's server (nvctk.hook.served), not by the hook;
    prepared: what that server made ready (released here when not used)."""
    try:
        return run("prestart", lambda hook: body(hook, drop_parent_caps, served, prepared),
                   argv or [], parse=parse_args, inputs=EDITS, stdin=stdin, stderr=stderr,
                   log=log, early=prepared.early if prepared is not None else None)
    finally:
        if prepared is not None:
            prepared.release()


def answer(state: bytes, prepared: Ready | None = None) -> tuple[int, str]:
    """The prestart nvctk-runtime's server runs for the launcher that handed it `state`:
    (exit code, the text for the hook's stderr). prepared: see ready()."""
    err = io.StringIO()
    code = main([], stdin=io.BytesIO(state), stderr=err, served=True, prepared=prepared)
    return code, err.getvalue()
