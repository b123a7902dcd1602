"""Seccomp rules that keep a vGPU container out of new user namespaces.

In a user namespace of its own, a process holds CAP_SYS_ADMIN over a mount namespace of
its own: there it can mount over /etc/ld.so.preload or /run/nvctk and run CUDA without its
cap. Docker's default seccomp profile refuses new user namespaces; runc's default spec (and
so a plain runc or containerd container) has no profile at all.
"""

from __future__ import annotations

import os

from nvctk.base import jsonio
from nvctk.base.errors import SpecError
from nvctk.oci.spec import SPEC_FILE, field, is_privileged, linux_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.spec.record import AppliedRecord

CLONE_NEWUSER = 0x10000000
_EPERM = 1
_ENOSYS = 38
_SCMP_ALLOW = "SCMP_ACT_ALLOW"
_SCMP_ERRNO = "SCMP_ACT_ERRNO"
# actions that fail a call whatever its arguments: a rule with one lets nothing through
_SCMP_REFUSING = frozenset({_SCMP_ERRNO, "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS",
                            "SCMP_ACT_KILL_THREAD", "SCMP_ACT_TRAP"})
_USERNS_SYSCALLS = ("unshare", "clone", "clone3")
# The ABIs a process of this machine can call the kernel through, as runc's and Docker's
# profiles list them: the rules then also cover a syscall made through int 0x80 on x86-64
_SECCOMP_ARCHES = {
    "x86_64": ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"),
    "aarch64": ("SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"),
    "ppc64le": ("SCMP_ARCH_PPC64LE",),
    "s390x": ("SCMP_ARCH_S390X", "SCMP_ARCH_S390"),
}


def _flags_index(name: str, machine: str) -> int:
    # the flags come first, but for clone on s390 (its stack pointer does there)
    return 1 if name == "clone" and machine.startswith("s390") else 0


def _newuser(index: int, datum: int) -> dict[str, Any]:
    """The comparison "CLONE_NEWUSER set" (datum CLONE_NEWUSER) or "clear" (datum 0)."""
    return {"index": index, "value": CLONE_NEWUSER, "valueTwo": datum,
            "op": "SCMP_CMP_MASKED_EQ"}


def userns_rules(machine: str | None = None) -> list[dict[str, Any]]:
    """Seccomp rules that make creating a user namespace fail: unshare and clone with
    CLONE_NEWUSER in their flags get EPERM; clone3 gets ENOSYS, as under Docker's
    profile (its flags sit in memory seccomp cannot read; glibc then falls back to clone)."""
    machine = machine or os.uname().machine
    rules: list[dict[str, Any]] = [
        {"names": [name], "action": _SCMP_ERRNO, "errnoRet": _EPERM,
         "args": [_newuser(_flags_index(name, machine), CLONE_NEWUSER)]}
        for name in ("unshare", "clone")
    ]
    rules.append({"names": ["clone3"], "action": _SCMP_ERRNO, "errnoRet": _ENOSYS})
    return rules


def _new_profile(machine: str) -> dict[str, Any]:
    """The profile made for a spec that has none: everything allowed but what nvctk adds."""
    return {"defaultAction": _SCMP_ALLOW, "architectures": list(_SECCOMP_ARCHES.get(machine, ())),
            "syscalls": []}


def rule_key(rule: Any) -> str:
    """A JSON value as a key of exact equality (Python's == takes true for 1)."""
    return jsonio.dumps(rule, sort_keys=True)


def _excludes_newuser(cmp: dict[str, Any]) -> bool:
    """Whether a comparison on the flags never holds while CLONE_NEWUSER is set."""
    op, value, two = cmp.get("op"), cmp.get("value"), cmp.get("valueTwo", 0)
    if not (isinstance(value, int) and isinstance(two, int)) or isinstance(value, bool) \
            or isinstance(two, bool):
        return False
    if op == "SCMP_CMP_MASKED_EQ":
        return bool(value & CLONE_NEWUSER) and not two & CLONE_NEWUSER
    if op == "SCMP_CMP_EQ":
        return not value & CLONE_NEWUSER
    if op == "SCMP_CMP_LT":
        return value <= CLONE_NEWUSER
    if op == "SCMP_CMP_LE":
        return value < CLONE_NEWUSER
    return False


def _needs_narrowing(rule: dict[str, Any], name: str, index: int, where: str) -> bool:
    """For a rule that lets `name` (unshare or clone) through: whether it may do so with
    CLONE_NEWUSER set; SpecError when its conditions on the flags leave nvctk unsure."""
    args = rule.get("args") or []
    if isinstance(args, list) and all(isinstance(a, dict) for a in args):
        indexes = [rule_key(a.get("index")) for a in args]
        # a rule that compares one argument twice, runc splits into one rule for each
        # comparison (any of them lets the call through): no condition added holds then
        if len(set(indexes)) == len(indexes):
            on_flags = [a for a in args if a.get("index") == index]
            if not on_flags:
                return True  # narrowed by one more condition, on the flags
            if _excludes_newuser(on_flags[0]):
                return False
    raise SpecError(f"{SPEC_FILE}: {where} lets {name} through on conditions nvctk cannot "
                    "combine with its rule against new user namespaces (in one, a process of a "
                    "vGPU container could mount over the files that cap it); take "
                    f"{name} out of that rule, or set no vGPU limit")


def _narrowed(rule: Any, where: str, machine: str) -> list[Any] | None:
    """The rules that replace `rule` so that it lets no new user namespace through
    (unshare and clone only with CLONE_NEWUSER clear; clone3 left to nvctk's ENOSYS),
    or None when it needs no change. libseccomp lets an unconditional rule for a syscall
    win over every conditional one, and picks between overlapping ones itself: nvctk's
    own rules hold only when no rule of the profile lets the same calls through."""
    names = rule.get("names") if isinstance(rule, dict) else None
    if (not isinstance(names, list) or rule.get("action") in _SCMP_REFUSING
            or not any(n in _USERNS_SYSCALLS for n in names)):
        return None
    kept: list[Any] = []
    narrow: dict[int, list[str]] = {}
    for name in names:
        if name == "clone3":
            continue
        if name in ("unshare", "clone"):
            index = _flags_index(name, machine)
            if _needs_narrowing(rule, name, index, where):
                narrow.setdefault(index, []).append(name)
                continue
        kept.append(name)
    if kept == names:
        return None
    out: list[Any] = [{**rule, "names": kept}] if kept else []
    for index, group in narrow.items():
        out.append({**rule, "names": group,
                    "args": [*(rule.get("args") or []), _newuser(index, 0)]})
    return out


def userns_way(seccomp: Any, machine: str | None = None) -> str | None:
    """The first of unshare, clone, clone3 by which a process under this profile (the
    spec's linux.seccomp, after the engine resolved it) may make a new user namespace,
    or None when the profile refuses every one: unshare and clone with CLONE_NEWUSER
    refused (by the default action or a rule) and let through by no rule, clone3 refused
    whatever its arguments (they sit in memory). A rule it cannot judge counts as letting
    the call through: the caller fails closed."""
    if not isinstance(seccomp, dict):
        return "unshare"  # no profile: everything goes
    machine = machine or os.uname().machine
    rules = seccomp.get("syscalls") or []
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        return "unshare"
    default_refuses = seccomp.get("defaultAction") in _SCMP_REFUSING
    for name in _USERNS_SYSCALLS:
        mine = [r for r in rules if isinstance(r.get("names"), list) and name in r["names"]]
        allowing = [r for r in mine if r.get("action") not in _SCMP_REFUSING]
        refusing = [r for r in mine if r.get("action") in _SCMP_REFUSING]
        if name == "clone3":
            if allowing or not (default_refuses or any(not r.get("args") for r in refusing)):
                return name
            continue
        index = _flags_index(name, machine)
        for r in allowing:
            args = r.get("args") or []
            on_flags = [a for a in args if isinstance(a, dict) and a.get("index") == index]
            if not (on_flags and len(args) == len({rule_key(a.get("index")) for a in args})
                    and _excludes_newuser(on_flags[0])):
                return name
        if not default_refuses and not any(
                not r.get("args") or r.get("args") == [_newuser(index, CLONE_NEWUSER)]
                for r in refusing):
            return name
    return None


def block_user_namespaces(spec: dict[str, Any], edits: AppliedRecord) -> None:
    """A vGPU container's seccomp profile refuses new user namespaces: userns_rules
    appended to linux.seccomp.syscalls (a profile that allows everything else is made
    when the spec has none), the profile's own rules that would let one through
    narrowed; edits.seccomp records both, for remove_our_edits.

    A container with CAP_SYS_ADMIN in its bounding set is left alone: it can mount over
    nvctk's files without any user namespace, so the rules would only take away what it
    may have been given that capability for (nested containers, sandboxes)."""
    if is_privileged(spec):
        return
    machine = os.uname().machine
    linux = linux_of(spec)
    created = linux.get("seccomp") is None
    seccomp: dict[str, Any] = field(linux, "seccomp", dict, "linux.seccomp")
    if created:
        seccomp.update(_new_profile(machine))
    syscalls = field(seccomp, "syscalls", list, "linux.seccomp.syscalls")
    replaced: list[list[Any]] = []  # [position, the rule as it was, the rules put there]
    out: list[Any] = []
    for i, rule in enumerate(syscalls):
        new = _narrowed(rule, f"linux.seccomp.syscalls[{i}]", machine)
        if new is None:
            out.append(rule)
        else:
            replaced.append([len(out), rule, new])
            out.extend(new)
    syscalls[:] = out
    # a rule the profile already has is not added twice (nor recorded: it stays the user's)
    present = {rule_key(r) for r in syscalls}
    added = [r for r in userns_rules(machine) if rule_key(r) not in present]
    syscalls.extend(added)
    edits.seccomp = {"created": created, "syscalls": added, "replaced": replaced}


def remove_userns_rules(spec: dict[str, Any], rec: Any) -> None:
    """Undo block_user_namespaces as recorded, only as far as it is what nvctk does,
    whatever the record says: its own rules out, each narrowed rule back as it was, the
    profile itself out when nvctk made it and nothing else has been put in it since.
    nvctk.runtime.earlier passes only a record it proved written for this bundle, whose
    additions the spec still carries (missing_userns_rules): rules equal to nvctk's in a
    profile that carried them itself are the profile's."""
    if not isinstance(rec, dict):
        return
    linux = spec.get("linux")
    if not isinstance(linux, dict) or not isinstance(linux.get("seccomp"), dict):
        return
    seccomp = linux["seccomp"]
    syscalls = seccomp.get("syscalls")
    machine = os.uname().machine
    if isinstance(syscalls, list):
        recorded = rec.get("syscalls")
        if isinstance(recorded, list):
            ours = {rule_key(r) for m in _SECCOMP_ARCHES for r in userns_rules(m)}
            for key in (k for k in map(rule_key, recorded) if k in ours):
                # the last match: nvctk appended its rules after the user's
                for i in range(len(syscalls) - 1, -1, -1):
                    if rule_key(syscalls[i]) == key:
                        del syscalls[i]
                        break
        replaced = rec.get("replaced")
        if isinstance(replaced, list):
            for item in reversed(replaced):
                _restore_rule(syscalls, item, machine)
    if rec.get("created") is True and rule_key(seccomp) == rule_key(_new_profile(machine)):
        del linux["seccomp"]


def _restore_rule(syscalls: list[Any], item: Any, machine: str) -> None:
    """Put a narrowed rule back: only where the rules recorded as its replacement are
    exactly what narrowing it makes, and are still in the profile."""
    if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int)
            and isinstance(item[2], list)):
        return
    at, rule, new = item
    try:
        if rule_key(_narrowed(rule, "", machine)) != rule_key(new):
            return
    except SpecError:
        return
    keys = [rule_key(r) for r in new]
    n = len(keys)
    starts = [at] + [i for i in range(len(syscalls) - n + 1) if i != at]
    for i in starts:
        if 0 <= i <= len(syscalls) - n and [rule_key(r) for r in syscalls[i:i + n]] == keys:
            syscalls[i:i + n] = [rule]
            return


def missing_userns_rules(spec: dict[str, Any], rec: Any) -> str | None:
    """What of a record's seccomp part (block_user_namespaces') the spec no longer
    carries, or None: every rule it names as added, every rule a narrowed one became
    (as many times as named), and the profile it names as made."""
    if not isinstance(rec, dict):
        return None
    linux = spec.get("linux")
    profile = linux.get("seccomp") if isinstance(linux, dict) else None
    replaced = rec.get("replaced")
    named = list(rec.get("syscalls") or ()) if isinstance(rec.get("syscalls"), list) else []
    for item in replaced if isinstance(replaced, list) else ():
        if isinstance(item, list) and len(item) == 3 and isinstance(item[2], list):
            named.extend(item[2])
    if not isinstance(profile, dict):
        return "the seccomp profile it names" if named or rec.get("created") is True else None
    syscalls = profile.get("syscalls")
    keys = [rule_key(r) for r in syscalls] if isinstance(syscalls, list) else []
    for rule in named:
        try:
            keys.remove(rule_key(rule))
        except ValueError:
            return "a seccomp rule it names as added"
    return None
