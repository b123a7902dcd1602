"""The spec edits of a GPU container: the edits form (nvctk.edits) applied to a spec.

`apply` is the whole of it: what an earlier create of the bundle added goes first
(its record in the annotation nvctk.io/edits, nvctk.spec.record, as far as the runtime
judged it may: nvctk.runtime.earlier), then NVIDIA's own hooks, then the
plan's device nodes with their cgroup rules, hooks and env, and for a vGPU the
seccomp rules against new user namespaces (nvctk.spec.seccomp); the record of this
create's entries last. Every edit is idempotent: applying a plan twice yields the
spec applying it once does.
"""

from __future__ import annotations

import os

from nvctk.base.errors import SpecError
from nvctk.edits import HOOK_NAME, HOOK_PATH_ENV, NVIDIA_HOOK_NAMES  # noqa: F401 (re-export)
from nvctk.oci.spec import SPEC_FILE, field, json_type, linux_of
from nvctk.spec import seccomp
from nvctk.spec.record import EDITS_ANNOTATION, AppliedRecord, record_text

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from nvctk.edits import DeviceNode, Edits, Hook
    from nvctk.spec.record import EarlierRecord, Seal


def apply(spec: dict[str, Any], edits: Edits, earlier: EarlierRecord | None = None,
          seal: Seal | None = None) -> tuple[AppliedRecord, int]:
    """The edits form into spec: (what was added, hooks removed). Executes what the form
    says, deciding nothing: what an earlier create added goes (earlier: the spec's
    record as the runtime judged it, nvctk.runtime.earlier), then the hooks
    edits.remove_hooks names, then device nodes with their cgroup rules, a CDI spec's
    own mounts and hooks (verbatim), ours per stage, env and the seccomp rule; the
    record last, sealed with `seal`. A form from CDI specs (edits.origin) may add any
    device, variable or mount: the record says so."""
    remove_our_edits(spec, earlier)
    removed = remove_nvidia_hooks(spec, edits.remove_hooks)
    added = add_devices(spec, edits.devices)
    added.cdi = edits.origin == "cdi"
    _add_foreign_mounts(spec, edits, added)
    for stage in ("prestart", "poststop"):
        ours = [h for h in edits.hooks if h.stage == stage and _is_ours(h)]
        if ours:
            for hook in ours:
                set_hook(spec, hook.entry(), stage)
        else:
            drop_our_hooks(spec, stage)
    _add_foreign_hooks(spec, edits, added)
    set_env(spec, edits.env)
    added.env = [f"{k}={v}" for k, v in edits.env.items()]
    if edits.seccomp_block_userns:
        seccomp.block_user_namespaces(spec, added)
    record_edits(spec, added, seal)
    return added, removed


def _is_ours(hook: Hook) -> bool:
    return bool(hook.args) and hook.args[0] == HOOK_NAME


def _add_foreign_mounts(spec: dict[str, Any], edits: Edits, added: AppliedRecord) -> None:
    """A CDI spec's own mounts (options given: not ones nvctk's hook makes) into
    spec.mounts, as the spec words them; runc makes them."""
    foreign = [m for m in edits.mounts if m.options is not None]
    if not foreign:
        return
    mounts = field(spec, "mounts", list, "mounts")
    for m in foreign:
        opts = list(m.options or ())
        entry: dict[str, Any] = {"destination": m.container_path, "source": m.host_path}
        kind = m.fs_type or ("bind" if {"bind", "rbind"} & set(opts) else "")
        if kind:
            entry["type"] = kind
        entry["options"] = opts
        if entry not in mounts:
            mounts.append(entry)
            added.mounts.append(entry)


def _add_foreign_hooks(spec: dict[str, Any], edits: Edits, added: AppliedRecord) -> None:
    """A CDI spec's own hooks (not nvctk-hook's), verbatim, at their stages."""
    foreign = [h for h in edits.hooks if not _is_ours(h)]
    if not foreign:
        return
    hooks = field(spec, "hooks", dict, "hooks")
    for h in foreign:
        entry: dict[str, Any] = {"path": h.path, "args": list(h.args)}
        if h.env:
            entry["env"] = list(h.env)
        if h.timeout:
            entry["timeout"] = h.timeout
        stage_hooks = field(hooks, h.stage, list, f"hooks.{h.stage}")
        if entry not in stage_hooks:
            stage_hooks.append(entry)
            added.hooks.append([h.stage, entry])


def drop_our_hooks(spec: dict[str, Any], stage: str) -> None:
    """No nvctk hook in hooks.<stage> (an earlier create's, e.g. a vGPU's poststop)."""
    hooks = spec.get("hooks")
    if isinstance(hooks, dict) and isinstance(hooks.get(stage), list):
        hooks[stage] = [h for h in hooks[stage] if not is_our_hook(h, stage)]


# --- devices ------------------------------------------------------------------------------


def device_entry(node: DeviceNode) -> dict[str, Any]:
    return {
        "path": node.path,
        "type": node.type,
        "major": node.major,
        "minor": node.minor,
        **({"fileMode": node.file_mode} if node.file_mode is not None else {}),
        **({"uid": node.uid} if node.uid is not None else {}),
        **({"gid": node.gid} if node.gid is not None else {}),
    }


def cgroup_rule(node: DeviceNode) -> dict[str, Any]:
    return {
        "allow": True,
        # a cgroup rule knows c and b only: an unbuffered char device ("u") is a "c"
        "type": "c" if node.type == "u" else node.type,
        "major": node.major,
        "minor": node.minor,
        "access": node.permissions,
    }


def check_editable(spec: dict[str, Any]) -> None:
    """SpecError naming the first field nvctk edits that has the wrong type, before
    anything is planned (add_devices, set_hook, set_env check again as they edit); the
    record of an earlier create is check_record's."""
    linux = spec.get("linux")
    if isinstance(linux, dict):
        _check_kind(linux, "devices", list, "linux.devices")
        resources = _check_kind(linux, "resources", dict, "linux.resources")
        if isinstance(resources, dict):
            _check_kind(resources, "devices", list, "linux.resources.devices")
    hooks = spec.get("hooks")
    if isinstance(hooks, dict):
        for stage in ("prestart", "poststop"):
            _check_kind(hooks, stage, list, f"hooks.{stage}")


def _check_kind(parent: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = parent.get(key)
    if value is not None and not isinstance(value, kind):
        raise SpecError(f"{SPEC_FILE}: {where} must be {json_type(kind())}, not "
                        f"{json_type(value)}")
    return value


def add_devices(spec: dict[str, Any], nodes: Iterable[DeviceNode]) -> AppliedRecord:
    """linux.devices (runc creates the nodes) + linux.resources.devices allow rules.

    An entry for the same container path is replaced, an identical rule is not
    added again, so repeated creates do not grow the spec. Returns what was added
    (for record_edits: the next create removes exactly that).
    """
    linux = linux_of(spec)
    devices = field(linux, "devices", list, "linux.devices")
    resources = field(linux, "resources", dict, "linux.resources")
    rules = field(resources, "devices", list, "linux.resources.devices")
    added = AppliedRecord()
    for node in nodes:
        entry = device_entry(node)
        for i, d in enumerate(devices):
            if isinstance(d, dict) and d.get("path") == node.path:
                if d == entry:  # the user's own (ours went with the earlier create's record)
                    break
                devices[i] = entry
                added.devices.append([node.path, node.type, node.major, node.minor])
                break
        else:
            devices.append(entry)
            added.devices.append([node.path, node.type, node.major, node.minor])
        rule = cgroup_rule(node)
        if rule not in rules:
            rules.append(rule)
            added.rules.append([rule["type"], node.major, node.minor])
    return added


# --- what an earlier create added ---------------------------------------------------------

# Only entries of these shapes are in a legacy (not CDI) record: nvctk.runtime.earlier
# keeps a record to them, whatever it says
OUR_DEVICE_PREFIX = "/dev/nvidia"
OUR_ENV_PREFIXES = ("CUDA_DEVICE_", "NVCTK_")


def record_edits(spec: dict[str, Any], added: AppliedRecord, seal: Seal | None) -> None:
    """The record of what this create added into the annotation, sealed (record_text:
    a MAC keyed by the node's edits key, bound to this bundle) when it names more than
    NVIDIA device access: the next create of this bundle removes what it names."""
    annotations = field(spec, "annotations", dict, "annotations")
    annotations[EDITS_ANNOTATION] = record_text(added, seal)


def check_record(record: EarlierRecord | None) -> None:
    """SpecError for a record that is not what nvctk writes (a GPU create refuses it)."""
    if record is not None and record.malformed:
        raise SpecError(f"{SPEC_FILE}: {record.problem} (nvctk's record of what an earlier "
                        "create added; take the annotation out)")


def has_our_edits(spec: dict[str, Any]) -> bool:
    """Whether an earlier create left nvctk's entries in the spec (cheap: no-GPU
    creates ask this, and rewrite the spec only when it is true)."""
    annotations = spec.get("annotations")
    if isinstance(annotations, dict) and EDITS_ANNOTATION in annotations:
        return True
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict):
        return False
    return any(
        isinstance(hooks.get(stage), list) and any(is_our_hook(h, stage) for h in hooks[stage])
        for stage in ("prestart", "poststop")
    )


def missing_additions(spec: dict[str, Any], fields: dict[str, Any]) -> str | None:
    """The first entry a record names as added that the spec no longer carries (as many
    times as the record names it), or None: a record whose additions are not all in the
    spec does not describe it."""
    linux = _dict(spec.get("linux"))
    resources = _dict(linux.get("resources"))
    process = _dict(spec.get("process"))
    hooks = _dict(spec.get("hooks"))
    carried: list[tuple[str, list[Any], list[Any]]] = [
        ("device", list(fields.get("devices") or ()),
         [[d.get("path"), d.get("type"), d.get("major"), d.get("minor")]
          for d in _list(linux.get("devices")) if isinstance(d, dict)]),
        ("allow rule", list(fields.get("rules") or ()),
         [[r.get("type"), r.get("major"), r.get("minor")]
          for r in _list(resources.get("devices")) if isinstance(r, dict) and r.get("allow") is True]),
        ("variable", list(fields.get("env") or ()), _list(process.get("env"))),
        ("mount", list(fields.get("mounts") or ()), _list(spec.get("mounts"))),
        ("hook", list(fields.get("hooks") or ()),
         [[stage, h] for stage in sorted(hooks) for h in _list(hooks[stage])]),
    ]
    for what, recorded, present in carried:
        keys = [seccomp.rule_key(p) for p in present]
        for entry in recorded:
            try:
                keys.remove(seccomp.rule_key(entry))
            except ValueError:
                return f"a {what} it names as added"
    return seccomp.missing_userns_rules(spec, fields.get("seccomp"))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def remove_our_edits(spec: dict[str, Any], record: EarlierRecord | None) -> None:
    """Take out what an earlier create added: nvctk's prestart/poststop hooks, and what
    `record` (the spec's record as nvctk.runtime.earlier judged it: read_record, then
    only what this create may take out) names, each entry of it once. Everyone else's
    entries stay in order; the annotation goes."""
    # emptied lists and objects stay: a GPU create that follows then refills them in
    # place, and writes the same bytes as the first create did
    annotations = spec.get("annotations")
    if isinstance(annotations, dict):
        annotations.pop(EDITS_ANNOTATION, None)
    rec = record.fields if record is not None and not record.malformed else {}
    # a CDI spec's entries are any device, variable or access: removing them still only
    # takes away what the record says this create's request added
    cdi = rec.get("cdi") is True
    hooks = spec.get("hooks")
    if isinstance(hooks, dict):
        for stage in ("prestart", "poststop"):
            entries = hooks.get(stage)
            if isinstance(entries, list):
                hooks[stage] = [h for h in entries if not is_our_hook(h, stage)]
        if cdi:
            _remove_recorded(hooks, rec.get("hooks"))
    if cdi and isinstance(spec.get("mounts"), list) and isinstance(rec.get("mounts"), list):
        gone = list(rec["mounts"])
        spec["mounts"] = [m for m in spec["mounts"] if not _take(gone, m)]
    devices = [_hashable(tuple(d)) for d in _list(rec.get("devices"))]
    rules = [_hashable(tuple(r)) for r in _list(rec.get("rules"))]
    env = [e for e in _list(rec.get("env")) if isinstance(e, str)]
    linux = spec.get("linux")
    if isinstance(linux, dict):
        if devices and isinstance(linux.get("devices"), list):
            linux["devices"] = [
                d for d in linux["devices"]
                if not (isinstance(d, dict) and _take(devices, _hashable(
                    (d.get("path"), d.get("type"), d.get("major"), d.get("minor")))))
            ]
        resources = linux.get("resources")
        if rules and isinstance(resources, dict) and isinstance(resources.get("devices"), list):
            resources["devices"] = [
                r for r in resources["devices"]
                if not (isinstance(r, dict) and r.get("allow") is True
                        and (r.get("access") == "rwm" or (cdi and isinstance(r.get("access"), str)))
                        and set(r) == {"allow", "type", "major", "minor", "access"}
                        and _take(rules, _hashable((r.get("type"), r.get("major"), r.get("minor")))))
            ]
    process = spec.get("process")
    if env and isinstance(process, dict) and isinstance(process.get("env"), list):
        process["env"] = [e for e in process["env"] if not _take(env, e)]
    seccomp.remove_userns_rules(spec, rec.get("seccomp"))


def _take(recorded: list[Any], entry: Any) -> bool:
    """Whether entry is one of recorded (then used up: each record entry removes one)."""
    for i, r in enumerate(recorded):
        if r == entry:
            del recorded[i]
            return True
    return False


def _remove_recorded(hooks: dict[str, Any], recorded: Any) -> None:
    """CDI hooks a create added ([stage, entry] each) out of hooks.<stage>."""
    if not isinstance(recorded, list):
        return
    by_stage: dict[str, list[Any]] = {}
    for item in recorded:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str):
            by_stage.setdefault(item[0], []).append(item[1])
    for stage, gone in by_stage.items():
        if isinstance(hooks.get(stage), list):
            hooks[stage] = [h for h in hooks[stage] if not _take(gone, h)]


def _hashable(key: tuple[Any, ...]) -> tuple[Any, ...]:
    # a spec's values may be lists or objects where numbers belong: never in our set
    return tuple(k if isinstance(k, (str, int, float, bool)) or k is None else repr(k)
                 for k in key)


def is_nvidia_hook(hook: Any, names_gone: Iterable[str] = NVIDIA_HOOK_NAMES) -> bool:
    """Docker's --gpus hook or NVIDIA's runtime hook (by path or args[0] basename)."""
    if not isinstance(hook, dict):
        return False
    names = {os.path.basename(str(hook.get("path", "")))}
    args = hook.get("args")
    if isinstance(args, list) and args:
        names.add(os.path.basename(str(args[0])))
    return not names.isdisjoint(names_gone)


def is_our_hook(hook: Any, kind: str = "prestart") -> bool:
    if not isinstance(hook, dict):
        return False
    args = hook.get("args")
    if not (isinstance(args, list) and len(args) >= 2 and args[1] == kind):
        return False
    # we always write args[0] = nvctk-hook; the path's name depends on hook-path
    return HOOK_NAME in (os.path.basename(str(hook.get("path", ""))), args[0])


def remove_nvidia_hooks(spec: dict[str, Any],
                        names: Iterable[str] = NVIDIA_HOOK_NAMES) -> int:
    """Drop NVIDIA's/Docker's GPU hooks from every hook list; returns how many."""
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict):
        return 0
    removed = 0
    for name, entries in list(hooks.items()):
        if isinstance(entries, list):
            kept = [h for h in entries if not is_nvidia_hook(h, names)]
            removed += len(entries) - len(kept)
            hooks[name] = kept
    return removed


def set_hook(spec: dict[str, Any], hook: dict[str, Any], stage: str = "prestart") -> None:
    """Put `hook` in hooks.<stage>, replacing an earlier nvctk hook of the same kind
    (so a second create does not run the hook twice) and keeping everyone else's."""
    hooks = field(spec, "hooks", dict, "hooks")
    entries = field(hooks, stage, list, f"hooks.{stage}")
    kind = hook["args"][1]
    kept = [h for h in entries if not is_our_hook(h, kind)]
    kept.append(hook)
    hooks[stage] = kept


def set_env(spec: dict[str, Any], env: dict[str, str]) -> None:
    """Set process.env keys (replacing every earlier occurrence of each key)."""
    if not env:
        return
    process = field(spec, "process", dict, "process")
    current = [e for e in field(process, "env", list, "process.env")
               if not (isinstance(e, str) and e.partition("=")[0] in env)]
    process["env"] = current + [f"{k}={v}" for k, v in env.items()]
