"""`nvctk configure`: add nvctk-runtime to a container engine's config, or take it out.

Each engine module offers the same four functions over a {path: bytes | None}
map of its files (None: the file does not exist):
  paths(req)            the files it reads and may write, main config first
  configure(req, old)   their wanted contents and notes (pure: same input, same bytes)
  binary_in(req, old)   the runtime binary of the entry named req.name, or None
  strip(req, old)       structural removal: wanted contents and notes, or None
                        when nothing of nvctk's is there; refuses (ConfigError) an
                        entry of that name that is not nvctk's

How `--remove` knows what configure added: configure keeps the file it replaced as
`<file>.bak`. When configuring those backups again (with the binary found in the
file, and each combination of --set-as-default/--cdi) gives exactly the current
bytes, nobody has edited the files since, and the backups are the original bytes:
remove puts them back. Otherwise (edited since, or no backup) remove takes out what
it can recognise as nvctk's (`strip`): the runtime entry if its binary is
nvctk-runtime; a default naming it, and a CDI switch configure turned on, go back to
what they were (configure notes a replaced value in a `# nvctk: was ...` comment on
the line; else the .bak's value); it never removes a same-named entry that runs
something else.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import ModuleType

from nvctk.engines import common, containerd, crio, docker
from nvctk.engines.common import Change, ConfigChanges, EngineRequest

ENGINES: dict[str, ModuleType] = {"containerd": containerd, "docker": docker, "crio": crio}

RESTART = {
    "containerd": "systemctl restart containerd",
    "docker": "systemctl restart docker",
    "crio": "systemctl restart crio",
}


def _read_all(paths: list[str]) -> dict[str, bytes | None]:
    return {p: common.read(p) for p in paths}


def _bak(mod: ModuleType, path: str) -> str:
    """Where path's previous version is kept: the engine may say (CRI-O reads every
    file in its drop-in dir, a .bak there included), else <file>.bak."""
    return str(getattr(mod, "backup_path", common.backup_path)(path))


def plan_configure(engine: str, req: EngineRequest) -> ConfigChanges:
    mod = ENGINES[engine]
    old = _read_all(mod.paths(req))
    new, notes = mod.configure(req, old)
    plan = ConfigChanges(service=engine, notes=notes)
    plan.changes = [Change(p, old[p], new.get(p, old[p]), _bak(mod, p)) for p in old]
    # unchanged files too: another file may override what they hold (CRI-O's drop-ins)
    _validate(mod, req, plan, always=True)
    return plan


def _validate(mod: ModuleType, req: EngineRequest, plan: ConfigChanges,
              always: bool = False) -> None:
    """The engine's own check of the result, where it has one (CRI-O: `crio config`)."""
    if (always or plan.changed) and hasattr(mod, "validate"):
        mod.validate(req, {c.path: c.new for c in plan.changes})


def plan_remove(engine: str, req: EngineRequest) -> ConfigChanges:
    mod = ENGINES[engine]
    paths = mod.paths(req)
    old = _read_all(paths)
    plan = ConfigChanges(service=engine)
    binary = req.runtime_path or mod.binary_in(req, old)
    base = old
    # files the engine only reads (CRI-O's crio.conf) have no backup: as they are
    readonly = set(getattr(mod, "readonly_paths", lambda r: [])(req))
    baks = {p: old[p] if p in readonly else common.read(_bak(mod, p))
            for p in paths}
    if binary and common.is_our_binary(binary, req):
        for set_default, cdi in itertools.product((False, True), repeat=2):
            trial = replace(req, runtime_path=binary, set_as_default=set_default, cdi=cdi)
            try:
                again, _ = mod.configure(trial, baks)
            except common.ConfigError:
                continue
            if all(again.get(p, baks[p]) == old[p] for p in paths):
                base = baks
                plan.notes.append("the files are as configure left them: restoring their "
                                  "previous versions (.bak)")
                break
    try:
        stripped, notes = mod.strip(req, base, baks)
    except common.ConfigError:
        if base is old:
            raise
        # the backup holds the entry configure replaced (someone else's runtime of that
        # name): restoring the backup is the removal
        stripped, notes = None, [f"runtime {req.name!r} is back to the entry configure "
                                 "replaced"]
    plan.notes += notes
    new = base if stripped is None else {**base, **stripped}
    if stripped is None and base is old:
        plan.notes.append(f"no runtime {req.name!r} of nvctk's in {', '.join(paths)}: nothing to remove")
    plan.changes = [Change(p, old[p], new[p], _bak(mod, p)) for p in paths]
    _validate(mod, req, plan)
    return plan
