"""The spec edits of a GPU container: the edits form (nvctk.edits) applied to a spec.

`apply` is the whole of it: what an earlier create of the bundle added goes first
(its record in the annotation org.nvctk.edits), then NVIDIA's own hooks, then the
plan's device nodes with their cgroup rules, hooks and env, and for a vGPU the
seccomp rules against new user namespaces (nvctk.spec.seccomp); the record of this
create's entries last. Every edit is idempotent: applying a plan twice yields the
spec applying it once does.
"""

from __future__ import annotations

import os

from nvctk.base import jsonio
from nvctk.base.errors import SpecError, shown
from nvctk.edits import HOOK_NAME, HOOK_PATH_ENV, NVIDIA_HOOK_NAMES  # noqa: F401 (re-export)
from nvctk.oci.spec import SPEC_FILE, field, json_type, linux_of
from nvctk.spec import seccomp
from nvctk.spec.record import AppliedRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from nvctk.edits import DeviceNode, Edits, Hook


def apply(spec: dict[str, Any], edits: Edits, state_dir: str | None = None,
          cdi: bool = False) -> tuple[AppliedRecord, int]:
    """The edits form into spec: (what was added, hooks removed). Executes what the form
    says, deciding nothing: what an earlier create added goes (its record, verified by
    the MAC keyed in state_dir), then the hooks edits.remove_hooks names, then device
    nodes with their cgroup rules, a CDI spec's own mounts and hooks (verbatim), ours
    per stage, env and the seccomp rule; the record last. cdi: the edits came from CDI
    specs (their entries may be any device, variable or mount: the record says so)."""
    remove_our_edits(spec, state_dir)
    removed = remove_nvidia_hooks(spec, edits.remove_hooks)
    added = add_devices(spec, edits.devices)
    added.cdi = cdi
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
    record_edits(spec, added, state_dir)
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
    anything is planned (add_devices, set_hook, set_env check again as they edit)."""
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
    problem = edits_record_problem(spec)
    if problem is not None:
        raise SpecError(f"{SPEC_FILE}: {problem} (nvctk's record of what an earlier create "
                        "added; take the annotation out)")


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

# The annotation in which a GPU create records the spec entries it added, so that the
# next create of the same bundle (reused, its request changed) removes exactly those.
EDITS_ANNOTATION = "org.nvctk.edits"
# Only entries of these shapes are ever removed, whatever the annotation says: removing
# an NVIDIA device node, an allow rule or a variable nvctk sets only takes access away.
_OUR_DEVICE_PREFIX = "/dev/nvidia"
OUR_ENV_PREFIXES = ("CUDA_DEVICE_", "NVCTK_")


def record_edits(spec: dict[str, Any], edits: AppliedRecord, state_dir: str | None = None) -> None:
    """The record into the annotation, with a MAC keyed by <state_dir>/edits.key, so that
    no spec's author can forge one: a record is what the next create removes, and only
    a record nvctk provably wrote may take out more than NVIDIA access (see
    remove_our_edits). A record without state_dir (tests, tools) has no MAC."""
    annotations = field(spec, "annotations", dict, "annotations")
    record: dict[str, Any] = {"devices": edits.devices, "rules": edits.rules, "env": edits.env}
    if edits.seccomp is not None:  # vGPU only: other GPU containers' records stay as they were
        record["seccomp"] = edits.seccomp
    if edits.cdi:  # CDI only: legacy records stay as they were
        record.update(cdi=True, mounts=edits.mounts, hooks=edits.hooks)
    needs_mac = edits.cdi or edits.seccomp is not None
    if state_dir is not None:
        try:
            key = edits_key(state_dir, create=True)
        except (OSError, SpecError):
            if needs_mac:
                raise
            # a plain GPU record unsigned (a read-only state dir must not stop GPU
            # containers): on reuse only its NVIDIA nodes and rules are taken out
            key = None
        if key is not None:
            record["mac"] = _record_mac(record, key)
    elif needs_mac:
        raise ValueError("a CDI or vGPU record needs the state dir of its key")
    annotations[EDITS_ANNOTATION] = jsonio.dumps(record)


EDITS_KEY_FILE = "edits.key"
_KEY_BYTES = 32


def _record_mac(record: dict[str, Any], key: bytes) -> str:
    """blake2b keyed MAC of the record's canonical JSON (without its "mac")."""
    try:  # every GPU create signs its record: _blake2 alone imports in a sixth of hashlib's time
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - an interpreter without the module
        from hashlib import blake2b

    body = jsonio.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True)
    return blake2b(body.encode(), key=key, digest_size=32).hexdigest()


def edits_key(state_dir: str, create: bool = False) -> bytes | None:
    """The key of CDI records' MACs, <state_dir>/edits.key: 32 random bytes, made on
    first use (create) with O_EXCL via link(), so a racing create never reads half a
    key. None when there is none and create is False. A key file that is not a regular
    0600 file of ours, 32 bytes long, is refused (SpecError): anyone else who could
    write it could forge records."""
    from nvctk.base.keyfile import load_key

    return load_key(os.path.join(state_dir, EDITS_KEY_FILE), _KEY_BYTES, create, 0o755,
                    SpecError, "key of CDI edit records",
                    "remove it: the next CDI create makes a new one")


def record_problem(spec: dict[str, Any], state_dir: str | None) -> str | None:
    """Why the annotation's record is not honoured in full (None: no record, or one whose
    MAC is valid). A record nvctk did not write could otherwise remove any CDI hook,
    mount, variable or device, nvctk's own seccomp rules from a profile that carried
    them itself, or put back a rule nvctk never narrowed."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict) or not isinstance(annotations.get(EDITS_ANNOTATION), str):
        return None
    try:
        rec = jsonio.loads(annotations[EDITS_ANNOTATION])
    except (ValueError, RecursionError):
        return None  # edits_record_problem says so
    if not isinstance(rec, dict):
        return None
    what = "a CDI record" if "cdi" in rec else "a record"
    where = f"annotations[{EDITS_ANNOTATION!r}]"
    mac = rec.get("mac")
    if not isinstance(mac, str):
        return f"{where}: {what} without nvctk's MAC (not written by nvctk); ignored"
    if state_dir is None:
        return f"{where}: {what} nvctk cannot check (no config); ignored"
    try:
        key = edits_key(state_dir)
    except SpecError as e:
        return f"{where}: {what} nvctk cannot check ({e}); ignored"
    if key is None:
        return f"{where}: {what} nvctk cannot check (no {EDITS_KEY_FILE} in {state_dir}); ignored"
    try:  # hmac's own, without hmac's import of hashlib (every reused bundle's create)
        from _operator import _compare_digest as compare_digest
    except ImportError:  # pragma: no cover - an interpreter without it
        from hmac import compare_digest  # type: ignore[no-redef]

    try:
        good = _record_mac(rec, key)
    except (ValueError, RecursionError, TypeError):
        return f"{where}: {what} nvctk cannot serialize; ignored"
    if not compare_digest(good, mac):
        return f"{where}: {what} with a wrong MAC (not written by nvctk); ignored"
    return None


def cdi_record_problem(spec: dict[str, Any], state_dir: str | None) -> str | None:
    """record_problem of a CDI record (None for any other): an unverified CDI record is
    ignored whole, another one's NVIDIA nodes and rules still go (remove_our_edits)."""
    annotations = spec.get("annotations")
    raw = annotations.get(EDITS_ANNOTATION) if isinstance(annotations, dict) else None
    try:
        cdi = isinstance(raw, str) and "cdi" in jsonio.loads(raw)
    except (ValueError, RecursionError, TypeError):
        return None  # edits_record_problem says so
    return record_problem(spec, state_dir) if cdi else None


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# the record's fields and the shape of each entry (record_edits writes these only)
_RECORD_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "devices": (lambda e: isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
                and isinstance(e[1], str) and _is_int(e[2]) and _is_int(e[3]),
                "[path, type, major, minor]"),
    "rules": (lambda e: isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
              and _is_int(e[1]) and _is_int(e[2]), "[type, major, minor]"),
    "env": (lambda e: isinstance(e, str), "a string"),
    "mounts": (lambda e: isinstance(e, dict), "an object"),
    "hooks": (lambda e: isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
              and isinstance(e[1], dict), "[stage, hook]"),
}


def edits_record_problem(spec: dict[str, Any]) -> str | None:
    """What is wrong with the org.nvctk.edits annotation, or None (absent or well
    formed). Strict: remove_our_edits acts on it only when it is exactly what
    record_edits writes."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict) or EDITS_ANNOTATION not in annotations:
        return None
    where = f"annotations[{EDITS_ANNOTATION!r}]"
    raw = annotations[EDITS_ANNOTATION]
    if not isinstance(raw, str):
        return f"{where} must be a string, not {json_type(raw)}"
    try:
        rec = jsonio.loads(raw)
    except (ValueError, RecursionError):
        return f"{where}: not valid JSON"
    if not isinstance(rec, dict):
        return f"{where} must hold a JSON object, not {json_type(rec)}"
    for key, value in rec.items():
        if key == "seccomp":
            if not isinstance(value, dict):
                return f"{where}: seccomp must be an object, not {json_type(value)}"
            continue  # _remove_userns_rules acts only on what matches nvctk's own rules
        if key == "mac":
            if not isinstance(value, str):
                return f"{where}: mac must be a string, not {json_type(value)}"
            continue
        if key == "cdi":
            if not isinstance(value, bool):
                return f"{where}: cdi must be true or false, not {json_type(value)}"
            continue
        if key not in _RECORD_SHAPES:
            return f"{where}: unknown field {shown(key)}"
        ok, shape = _RECORD_SHAPES[key]
        if not isinstance(value, list):
            return f"{where}: {key} must be a list, not {json_type(value)}"
        for entry in value:
            if not ok(entry):
                # no repr(): an entry may be nested deep or hold a 5000-digit number
                what = f"an array of {len(entry)}" if isinstance(entry, list) else json_type(entry)
                return f"{where}: a {key} entry must be {shape}, not {what}"
    return None


def _recorded(annotations: Any) -> dict[str, Any]:
    if not isinstance(annotations, dict):
        return {}
    raw = annotations.pop(EDITS_ANNOTATION, None)
    if not isinstance(raw, str):
        return {}
    try:
        rec = jsonio.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _as_keys(items: Any, size: int) -> list[tuple[Any, ...]]:
    if not isinstance(items, list):
        return []
    # _hashable: a malformed record must not raise TypeError (edits_record_problem
    # refuses one before this runs; this is the second line)
    return [_hashable(tuple(i)) for i in items if isinstance(i, list) and len(i) == size]


def remove_our_edits(spec: dict[str, Any], state_dir: str | None = None) -> None:
    """Take out what an earlier create added: nvctk's prestart/poststop hooks, and the
    device nodes, allow rules and env entries its annotation records (only of the
    shapes nvctk adds: see OUR_ENV_PREFIXES). Everyone else's entries stay in order.
    A record is acted on in full only with a valid MAC (record_problem, keyed in
    state_dir). Of any other, only what can only take NVIDIA access away is: its
    /dev/nvidia* nodes and their allow rules, never a variable, a seccomp rule or
    (a record with "cdi") anything."""
    # emptied lists and objects stay: a GPU create that follows then refills them in
    # place, and writes the same bytes as the first create did
    unverified = record_problem(spec, state_dir) is not None
    rec = _recorded(spec.get("annotations"))
    if unverified:
        rec = {} if "cdi" in rec else {k: rec[k] for k in ("devices", "rules") if k in rec}
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
    devices = set(_as_keys(rec.get("devices"), 4))
    rules = set(_as_keys(rec.get("rules"), 3))
    env = rec.get("env")
    env_entries = {e for e in env if isinstance(e, str)
                   and (cdi or e.startswith(OUR_ENV_PREFIXES))} if isinstance(env, list) else set()
    device_prefix = "/" if cdi else _OUR_DEVICE_PREFIX
    linux = spec.get("linux")
    if isinstance(linux, dict):
        if devices and isinstance(linux.get("devices"), list):
            linux["devices"] = [
                d for d in linux["devices"]
                if not (isinstance(d, dict) and str(d.get("path", "")).startswith(device_prefix)
                        and _hashable((d.get("path"), d.get("type"), d.get("major"),
                                       d.get("minor"))) in devices)
            ]
        resources = linux.get("resources")
        if rules and isinstance(resources, dict) and isinstance(resources.get("devices"), list):
            resources["devices"] = [
                r for r in resources["devices"]
                if not (isinstance(r, dict) and r.get("allow") is True
                        and (r.get("access") == "rwm" or (cdi and isinstance(r.get("access"), str)))
                        and set(r) == {"allow", "type", "major", "minor", "access"}
                        and _hashable((r.get("type"), r.get("major"), r.get("minor"))) in rules)
            ]
    process = spec.get("process")
    if env_entries and isinstance(process, dict) and isinstance(process.get("env"), list):
        process["env"] = [e for e in process["env"] if e not in env_entries]
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
