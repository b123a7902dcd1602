"""AppliedRecord: what one create added to config.json (nvctk.spec.apply records it in
the spec's org.nvctk.edits annotation, with a keyed MAC, for the next create to remove).

Its own module so that nvctk.spec.seccomp (which adds to it) and nvctk.spec.apply
(which applies the edits form, nvctk.edits) do not import each other.
"""

from __future__ import annotations

from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class AppliedRecord(Record):
    """The entries one create added: device nodes and allow rules as
    [path, type, major, minor] / [type, major, minor], env entries as "K=V"; in CDI
    mode (cdi True) also spec mounts as the entries added, hooks as [stage, entry]."""

    __slots__ = ("devices", "rules", "env", "seccomp", "mounts", "hooks", "cdi")  # noqa: RUF023

    def __init__(self, devices: list[list[Any]] | None = None,
                 rules: list[list[Any]] | None = None, env: list[str] | None = None,
                 seccomp: dict[str, Any] | None = None,
                 mounts: list[dict[str, Any]] | None = None,
                 hooks: list[list[Any]] | None = None, cdi: bool = False) -> None:
        self.devices: list[list[Any]] = [] if devices is None else devices
        self.rules: list[list[Any]] = [] if rules is None else rules
        self.env: list[str] = [] if env is None else env
        # block_user_namespaces: {"created": bool, "syscalls": [rules added]}, or None
        self.seccomp = seccomp
        self.mounts: list[dict[str, Any]] = [] if mounts is None else mounts
        self.hooks: list[list[Any]] = [] if hooks is None else hooks
        # the entries came from CDI specs: any device path, env name, rule access
        self.cdi = cdi
