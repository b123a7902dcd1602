"""The host's ldconfig, run for the container: sandboxed, bounded in time.

A child of the hook forked beside the worker (nvctk.hook.worker.ldconfig_child) waits
until the worker's libraries and links are in, then, in a private copy of the
container's mount namespace, becomes the host's static ldconfig chrooted into the
rootfs: the rootfs's procfs detached (no magic links to the host), every host directory
bound into the rootfs read-only there, only CAP_DAC_OVERRIDE, an empty environment.
The hook's process collects its output and kills it past LDCONFIG_TIMEOUT; a failing
ldconfig is a warning, never the hook's failure (the libraries are mounted all the
same).
"""

from __future__ import annotations

import os
import select
import time

from nvctk.base import mounts
from nvctk.hook import caps
from nvctk.hook import mount as m

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.log import HookLog, Logger
    from nvctk.edits import Edits

LDCONFIG_TIMEOUT = 30.0
# SIGKILL's number on every Linux architecture (signal(7)): the signal module would cost
# the hook enum's import, and _signal is CPython's private module
SIGKILL = 9


def detach_procfs_under(top: str, infos: list[mounts.MountInfo], log: HookLog) -> None:
    """In a private mount ns: detach every procfs mounted below the rootfs `top`."""
    for info in sorted(infos, key=lambda i: len(i.mount_point)):
        if info.fstype != "proc" or not (info.mount_point + "/").startswith(top + "/"):
            continue
        try:
            fd = m.openat2(mounts.AT_FDCWD, info.mount_point, os.O_PATH | os.O_DIRECTORY,
                           m.RESOLVE_NO_SYMLINKS | m.RESOLVE_NO_MAGICLINKS)
        except OSError:
            continue  # gone with an earlier detach
        try:
            if mounts.fstatfs_type(fd) == mounts.PROC_SUPER_MAGIC:
                mounts.umount2(f"/proc/self/fd/{fd}", mounts.MNT_DETACH)
                log.debug(f"ldconfig: detached procfs at {info.mount_point} (private ns)")
        finally:
            os.close(fd)


def become_ldconfig(plan: Edits, rootfs: str, root_id: tuple[int, int], ldfd: int,
                    devnull: int, log: HookLog) -> None:
    """In a private mount namespace (nvctk.hook.worker.ldconfig_child made it), with its
    output on fds 1 and 2: become the host's ldconfig run chrooted into the rootfs, the
    directory the worker mounted into (root_id: its st_dev, st_ino). Returns only on
    failure (OSError)."""
    os.dup2(devnull, 0)
    caps.enter_step("ldconfig-setup", log)
    top = os.path.realpath(rootfs)
    infos = mounts.read_mountinfo()
    detach_procfs_under(top, infos, log)
    # re-open the rootfs in this namespace (an fd from the old one would walk its mounts)
    rfd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(rfd)
        if (st.st_dev, st.st_ino) != root_id:
            raise OSError(f"{rootfs} is not the directory the worker mounted into")
        # ldconfig writes its cache and links where the image's ld.so.conf says: never
        # through a host directory bound into the container (a volume, the MPS pipe dir)
        ro = m.readonly_foreign(infos, top, mounts.mount_id(rfd))
        if ro:
            log.debug("ldconfig: read-only in its namespace (not the container's rootfs): "
                      + ", ".join(p[len(top):] for p in ro))
        os.fchdir(rfd)
    finally:
        os.close(rfd)
    os.chroot(".")
    os.chdir("/")
    caps.limit_to(caps.STEP_CAPS["ldconfig"])
    log.debug(f"caps step=ldconfig effective={','.join(caps.current()) or '-'}")
    os.execve(ldfd, ["ldconfig", plan.lib_dir], {})


def stop(pid: int) -> int:
    """Kill and reap the ldconfig process (past its time, or the worker failed);
    its wait status."""
    try:
        os.kill(pid, SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitpid(pid, 0)[1]


def wait_ldconfig(plan: Edits, pid: int, out_r: int, log: Logger,
                  hook_deadline: float | None = None) -> None:
    """Collect ldconfig's output (closes out_r), kill it past LDCONFIG_TIMEOUT or at the
    hook's own deadline (time.monotonic), whichever comes first, reap it and log how it
    went: a failing ldconfig is a warning, never the hook's failure (past the hook's
    deadline runc has failed the container already: nothing of the hook outlives it)."""
    chunks = []
    deadline = time.monotonic() + LDCONFIG_TIMEOUT
    if hook_deadline is not None and hook_deadline < deadline:
        deadline = hook_deadline
    timed_out = False
    try:
        # never wait on the image for ever: an /etc/ld.so.conf that is a FIFO (or
        # names one) blocks ldconfig without a byte of output
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out_r], [], [], left)[0]:
                timed_out = True
                break
            chunk = os.read(out_r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(out_r)
    status = stop(pid) if timed_out else os.waitpid(pid, 0)[1]
    out = b"".join(chunks).decode("utf-8", "replace").strip()
    code = os.waitstatus_to_exitcode(status)
    if timed_out:
        out = ("killed at the hook's deadline (runc's hook timeout)" if deadline == hook_deadline
               else f"killed after {LDCONFIG_TIMEOUT:g}s") + (f"; {out}" if out else "")
    if code != 0:
        # a read-only rootfs, or an image without a writable /etc: the libraries are
        # mounted all the same; programs that dlopen by SONAME may not find them
        log.warning(f"step ldconfig: {plan.lib_dir}: ldconfig exited {code}: {out or '-'}")
    else:
        log.info(f"ldconfig refreshed the container's cache ({plan.lib_dir})")
        if out:
            log.debug(f"ldconfig: {out}")
