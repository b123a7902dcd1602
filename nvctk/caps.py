"""Capability handling for the prestart hook (python-prctl's C module, `_prctl`).

The hook's worker process first `restrict`s itself to the union of the
capabilities its steps need (bounding set, permitted, inheritable; ambient goes
with inheritable) and sets no_new_privs; each step then `enter_step`s, which
raises exactly that step's capabilities into the effective set and logs
``caps step=<name> effective=<list>`` at debug level.

This runs in every GPU container's start, so it talks to `_prctl` directly:
python-prctl's `prctl` wrapper module costs about a millisecond to import (it
generates a property per capability and flag) and re-parses name lists on
every call; here each step is one capset, plus a capget for the log line.
"""

from __future__ import annotations

import os

import _prctl

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Protocol

    class DebugLog(Protocol):
        def debug(self, msg: str) -> None: ...


CAP_EFFECTIVE: int = _prctl.CAP_EFFECTIVE
CAP_PERMITTED: int = _prctl.CAP_PERMITTED
CAP_INHERITABLE: int = _prctl.CAP_INHERITABLE

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

_FLAG_NAMES = ("CAP_EFFECTIVE", "CAP_PERMITTED", "CAP_INHERITABLE")
# python-prctl names cap 40 after CAP_LAST_CAP of its build headers
_NAME_FIX = {"last_cap": "checkpoint_restore"}


def _cap_table() -> dict[str, int]:
    out: dict[str, int] = {}
    for attr in dir(_prctl):
        if attr.startswith("CAP_") and attr not in _FLAG_NAMES:
            name = attr[4:].lower()
            out[_NAME_FIX.get(name, name)] = int(getattr(_prctl, attr))
    return out


NUMBERS: dict[str, int] = _cap_table()  # capability name (lower case, no CAP_) -> number
NAMES: dict[int, str] = {num: name for name, num in NUMBERS.items()}
_last: int = -1


def _cap_number(name: str) -> int:
    try:
        return NUMBERS[name]
    except KeyError:
        raise ValueError(f"unknown capability {name!r}") from None


def _last_cap() -> int:
    """The kernel's highest capability number (read once: it cannot change)."""
    global _last
    if _last < 0:
        try:
            fd = os.open("/proc/sys/kernel/cap_last_cap", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _last = int(os.read(fd, 32))
            finally:
                os.close(fd)
        except (OSError, ValueError):
            _last = max(NAMES)
    return _last


def warm_up() -> None:
    """Read what the steps need from /proc once (call before forking the worker:
    the worker and the hook's process then share it)."""
    _last_cap()


def _known() -> list[int]:
    """The capabilities both the kernel and python-prctl's build know."""
    last = _last_cap()
    return [c for c in NAMES if c <= last]


def current(flag: int = CAP_EFFECTIVE) -> list[str]:
    """Names of the capabilities in one of our sets (effective by default)."""
    known = _known()
    empty: list[int] = []
    args = [known if f == flag else empty for f in (CAP_EFFECTIVE, CAP_PERMITTED,
                                                     CAP_INHERITABLE)]
    got = _prctl.get_caps(*args)[flag]
    return sorted(NAMES[c] for c, on in got.items() if on)


def needed(steps: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for s in steps:
        out.update(STEP_CAPS[s])
    return out


def _drop_bounding(keep: set[int]) -> None:
    """Drop every capability but keep from the bounding set. Only those still there:
    without CAP_SETPCAP (a runtime started with a reduced bounding set) every
    PR_CAPBSET_DROP fails, even of a capability already gone."""
    prctl, read, drop = _prctl.prctl, _prctl.PR_CAPBSET_READ, _prctl.PR_CAPBSET_DROP
    for cap in range(_last_cap() + 1):
        if cap not in keep and prctl(read, cap):
            prctl(drop, cap)


def _setpcap_effective() -> None:
    """Raise CAP_SETPCAP (needed to shrink the bounding set) if we may."""
    setpcap = NUMBERS["setpcap"]
    _prctl.set_caps([setpcap], [], [], [], [], [])


def restrict(keep: Iterable[str], log: DebugLog | None = None) -> None:
    """Drop every capability not in keep from all sets; set no_new_privs.

    Must be called while CAP_SETPCAP is still effective (as root, normally).
    Afterwards the effective set is empty until `enter_step`.
    """
    nums = {_cap_number(n) for n in keep}
    setpcap = NUMBERS["setpcap"]
    if _prctl.prctl(_prctl.PR_CAPBSET_READ, setpcap) and not _prctl.get_caps(
            [setpcap], [], [])[CAP_EFFECTIVE][setpcap]:
        _setpcap_effective()
    _drop_bounding(nums)
    known = _known()
    # one capset: effective and inheritable emptied, permitted down to keep
    _prctl.set_caps([], [], [], known, [c for c in known if c not in nums], known)
    _prctl.prctl(_prctl.PR_SET_NO_NEW_PRIVS, 1)
    if log is not None:
        permitted = ",".join(current(CAP_PERMITTED)) or "-"
        nnp = _prctl.prctl(_prctl.PR_GET_NO_NEW_PRIVS)
        log.debug(f"caps restricted permitted={permitted} no_new_privs={nnp}")


def enter_step(step: str, log: DebugLog, extra: Iterable[str] = ()) -> list[str]:
    """Make exactly the step's capabilities effective and log the effective set."""
    want = {_cap_number(n) for n in STEP_CAPS[step]} | {_cap_number(n) for n in extra}
    known = _known()
    permitted = _prctl.get_caps([], known, [])[CAP_PERMITTED]
    # a cap we gave up cannot come back; the syscall that needs it will say so
    on = [c for c in want if permitted.get(c)]
    _prctl.set_caps(on, [], [], [c for c in known if c not in want], [], [])
    eff = current()  # read back: the log line says what the kernel has, not what we asked
    log.debug(f"caps step={step} effective={','.join(eff) or '-'}")
    return eff


def limit_to(keep: Iterable[str]) -> None:
    """Shrink permitted (and bounding) to keep, e.g. in a process about to exec."""
    nums = {_cap_number(n) for n in keep}
    setpcap = NUMBERS["setpcap"]
    if _prctl.get_caps([], [setpcap], [])[CAP_PERMITTED][setpcap]:
        _setpcap_effective()
        _drop_bounding(nums)
    known = _known()
    drop = [c for c in known if c not in nums]
    _prctl.set_caps([], [], [], drop, drop, drop)
    if nums:
        _prctl.set_caps(list(nums), [], [], [], [], [])


def drop_all() -> None:
    """Give up every capability (effective, permitted, inheritable)."""
    limit_to(())


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the one that forked it (pid parent) dies; exits at
    once if it is already gone (the signal is set for the parent of the moment).
    Survives execve of a program without file capabilities or set-id bits."""
    _prctl.prctl(_prctl.PR_SET_PDEATHSIG, 9)  # SIGKILL, without importing signal
    if os.getppid() != parent:
        os._exit(1)
