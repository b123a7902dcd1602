"""Capability handling for the prestart hook (python-prctl).

The hook's worker process first `restrict`s itself to the union of the
capabilities its steps need (bounding set, permitted, inheritable; ambient goes
with inheritable) and sets no_new_privs; each step then `enter_step`s, which
raises exactly that step's capabilities into the effective set and logs
``caps step=<name> effective=<list>`` at debug level.
"""

from __future__ import annotations

from collections.abc import Iterable

import prctl

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    class DebugLog(Protocol):
        def debug(self, msg: str) -> None: ...


# what each step of the hook needs in its effective set
STEP_CAPS: dict[str, tuple[str, ...]] = {
    # open_tree(OPEN_TREE_CLONE) of host sources and fsmount of the proc mask
    # (sys_ptrace: /proc/<pid>/ns/mnt of runc init, which is not dumpable)
    "open": ("sys_admin", "dac_override", "dac_read_search", "sys_ptrace"),
    # setns(CLONE_NEWNS) needs both
    "setns": ("sys_admin", "sys_chroot"),
    # propagation check/fix of the rootfs mount
    "propagation": ("sys_admin",),
    # destinations created in an image owned by anyone, then move_mount
    "mount": ("sys_admin", "dac_override", "fowner"),
    "symlink": ("dac_override", "fowner"),
    "proc-mask": ("sys_admin", "dac_override", "fowner"),
    # private namespace, detaching the rootfs's procfs, chroot
    "ldconfig-setup": ("sys_admin", "sys_chroot"),
    # the ldconfig process itself: writes the image's cache and links
    "ldconfig": ("dac_override",),
    "undo": ("sys_admin",),
    "done": (),
}

# python-prctl names cap 40 after CAP_LAST_CAP of its build headers
_NAME_FIX = {"last_cap": "checkpoint_restore"}


def _cap_number(name: str) -> int:
    for num, n in zip(prctl.ALL_CAPS, prctl.ALL_CAP_NAMES, strict=True):
        if n == name or _NAME_FIX.get(n) == name:
            return int(num)
    raise ValueError(f"unknown capability {name!r}")


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
            return int(f.read())
    except OSError:
        return int(max(prctl.ALL_CAPS))


def current(flag: int = prctl.CAP_EFFECTIVE) -> list[str]:
    """Names of the capabilities in one of our sets (effective by default)."""
    got = prctl.get_caps((list(prctl.ALL_CAPS), flag))[flag]
    names = dict(zip(prctl.ALL_CAPS, prctl.ALL_CAP_NAMES, strict=True))
    return sorted(_NAME_FIX.get(names[c]) or names[c] for c, on in got.items() if on)


def needed(steps: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for s in steps:
        out.update(STEP_CAPS[s])
    return out


def restrict(keep: Iterable[str], log: DebugLog | None = None) -> None:
    """Drop every capability not in keep from all sets; set no_new_privs.

    Must be called while CAP_SETPCAP is still effective (as root, normally).
    Afterwards the effective set is empty until `enter_step`.
    """
    nums = {_cap_number(n) for n in keep}
    last = _last_cap()
    if prctl.capbset_read(prctl.CAP_SETPCAP) and not prctl.cap_effective.setpcap:
        prctl.cap_effective.setpcap = True
    for cap in range(last + 1):
        if cap not in nums and prctl.capbset_read(cap):
            prctl.capbset_drop(cap)
    known = [c for c in prctl.ALL_CAPS if c <= last]
    prctl.set_caps((known, [prctl.CAP_INHERITABLE, prctl.CAP_EFFECTIVE], False))
    prctl.set_caps(([c for c in known if c not in nums], prctl.CAP_PERMITTED, False))
    prctl.set_no_new_privs(1)
    if log is not None:
        permitted = ",".join(current(prctl.CAP_PERMITTED)) or "-"
        log.debug(f"caps restricted permitted={permitted} no_new_privs={prctl.get_no_new_privs()}")


def enter_step(step: str, log: DebugLog, extra: Iterable[str] = ()) -> list[str]:
    """Make exactly the step's capabilities effective and log the effective set."""
    want = set(STEP_CAPS[step]) | set(extra)
    permitted = set(current(prctl.CAP_PERMITTED))
    want &= permitted  # a cap we gave up cannot come back; the syscall will say so
    nums = [_cap_number(n) for n in want]
    others = [c for c in prctl.ALL_CAPS if c <= _last_cap() and c not in nums]
    prctl.set_caps((others, prctl.CAP_EFFECTIVE, False))
    if nums:
        prctl.set_caps((nums, prctl.CAP_EFFECTIVE, True))
    eff = current()
    log.debug(f"caps step={step} effective={','.join(eff) or '-'}")
    return eff


def limit_to(keep: Iterable[str]) -> None:
    """Shrink permitted (and bounding) to keep, e.g. in a process about to exec."""
    nums = {_cap_number(n) for n in keep}
    last = _last_cap()
    if prctl.cap_permitted.setpcap:
        prctl.cap_effective.setpcap = True
        for cap in range(last + 1):
            if cap not in nums and prctl.capbset_read(cap):
                prctl.capbset_drop(cap)
    known = [c for c in prctl.ALL_CAPS if c <= last]
    prctl.set_caps(([c for c in known if c not in nums],
                    [prctl.CAP_EFFECTIVE, prctl.CAP_PERMITTED, prctl.CAP_INHERITABLE], False))
    if nums:
        prctl.set_caps((list(nums), prctl.CAP_EFFECTIVE, True))


def drop_all() -> None:
    """Give up every capability (effective, permitted, inheritable)."""
    limit_to(())
