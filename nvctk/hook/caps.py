"""Capability handling for the prestart hook (capget/capset/prctl of nvctk._sys).

The hook's worker process first `restrict`s itself to the union of the
capabilities its steps need (bounding set, permitted, inheritable; ambient goes
with inheritable) and sets no_new_privs; each step then `enter_step`s, which
raises exactly that step's capabilities into the effective set and logs
``caps step=<name> effective=<list>`` at debug level.

This runs in every GPU container's start, so the sets are bit masks handed to the
kernel by nvctk._sys (nvctk/_sys.c, Python's public C API): each step is one capset,
plus a capget for the log line. (python-prctl's public `prctl` module costs about a
millisecond to import, and its C module `_prctl` is that library's private part.)
"""

from __future__ import annotations

import os

from nvctk import _sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Protocol

    class DebugLog(Protocol):
        def debug(self, msg: str) -> None: ...


# indexes into what _sys.capget() returns
CAP_EFFECTIVE = 0
CAP_PERMITTED = 1
CAP_INHERITABLE = 2

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39

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

# <linux/capability.h>, in number order (capability(7))
_CAP_NAMES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid",
    "setuid", "setpcap", "linux_immutable", "net_bind_service", "net_broadcast",
    "net_admin", "net_raw", "ipc_lock", "ipc_owner", "sys_module", "sys_rawio",
    "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
    "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write",
    "audit_control", "setfcap", "mac_override", "mac_admin", "syslog", "wake_alarm",
    "block_suspend", "audit_read", "perfmon", "bpf", "checkpoint_restore",
)
NUMBERS: dict[str, int] = {n: i for i, n in enumerate(_CAP_NAMES)}  # name (no CAP_) -> number
NAMES: dict[int, str] = dict(enumerate(_CAP_NAMES))
_last: int = -1


def _cap_number(name: str) -> int:
    try:
        return NUMBERS[name]
    except KeyError:
        raise ValueError(f"unknown capability {name!r}") from None


def _mask(names: Iterable[str]) -> int:
    m = 0
    for n in names:
        m |= 1 << _cap_number(n)
    return m


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


def _names(mask: int) -> list[str]:
    return sorted(NAMES.get(c, f"cap_{c}") for c in range(_last_cap() + 1) if mask >> c & 1)


def current(flag: int = CAP_EFFECTIVE) -> list[str]:
    """Names of the capabilities in one of our sets (effective by default)."""
    return _names(_sys.capget()[flag])


def needed(steps: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for s in steps:
        out.update(STEP_CAPS[s])
    return out


def _drop_bounding(keep: int, setpcap: bool = False) -> None:
    """Drop every capability but those in mask keep from the bounding set. Only those
    still there: without CAP_SETPCAP (a runtime started with a reduced bounding set)
    every PR_CAPBSET_DROP fails, even of a capability already gone. setpcap: the caller
    made CAP_SETPCAP effective, so a drop of one already gone succeeds (no read first)."""
    prctl = _sys.prctl
    for cap in range(_last_cap() + 1):
        if not keep >> cap & 1 and (setpcap or prctl(PR_CAPBSET_READ, cap)):
            prctl(PR_CAPBSET_DROP, cap)


def _setpcap_effective(eff: int, perm: int, inh: int) -> None:
    """Raise CAP_SETPCAP (needed to shrink the bounding set) if we may."""
    _sys.capset(eff | 1 << NUMBERS["setpcap"], perm, inh)


def restrict(keep: Iterable[str], log: DebugLog | None = None) -> None:
    """Drop every capability not in keep from all sets; set no_new_privs.

    Must be called while CAP_SETPCAP is still effective (as root, normally).
    Afterwards the effective set is empty until `enter_step`.
    """
    nums = _mask(keep)
    setpcap = NUMBERS["setpcap"]
    eff, perm, inh = _sys.capget()
    if _sys.prctl(PR_CAPBSET_READ, setpcap) and not eff >> setpcap & 1:
        _setpcap_effective(eff, perm, inh)
    _drop_bounding(nums)
    # one capset: effective and inheritable (so ambient) emptied, permitted down to keep
    _sys.capset(0, perm & nums, 0)
    _sys.prctl(PR_SET_NO_NEW_PRIVS, 1)
    if log is not None:
        permitted = ",".join(current(CAP_PERMITTED)) or "-"
        nnp = _sys.prctl(PR_GET_NO_NEW_PRIVS)
        log.debug(f"caps restricted permitted={permitted} no_new_privs={nnp}")


def enter_step(step: str, log: DebugLog, extra: Iterable[str] = ()) -> list[str]:
    """Make exactly the step's capabilities effective and log the effective set."""
    want = _mask(STEP_CAPS[step]) | _mask(extra)
    _eff, perm, inh = _sys.capget()
    # a cap we gave up cannot come back; the syscall that needs it will say so
    _sys.capset(want & perm, perm, inh)
    eff = current()  # read back: the log line says what the kernel has, not what we asked
    log.debug(f"caps step={step} effective={','.join(eff) or '-'}")
    return eff


def limit_to(keep: Iterable[str]) -> None:
    """Shrink permitted (and bounding) to keep, e.g. in a process about to exec; the
    ones of keep still permitted become effective."""
    nums = _mask(keep)
    eff, perm, inh = _sys.capget()
    if perm >> NUMBERS["setpcap"] & 1:
        _setpcap_effective(eff, perm, inh)
        _drop_bounding(nums, setpcap=True)
    perm &= nums
    _sys.capset(perm, perm, inh & nums)


def drop_all() -> None:
    """Give up every capability (effective, permitted, inheritable)."""
    limit_to(())


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the one that forked it (pid parent) dies; exits at
    once if it is already gone (the signal is set for the parent of the moment).
    Survives execve of a program without file capabilities or set-id bits."""
    _sys.prctl(PR_SET_PDEATHSIG, 9)  # SIGKILL, without importing signal
    if os.getppid() != parent:
        os._exit(1)
