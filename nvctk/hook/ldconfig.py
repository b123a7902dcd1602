"""The ldconfig child: the host's ldconfig, run for the container, sandboxed.

A child of the hook forked beside the worker (nvctk.hook.children.start) opens the
host's ldconfig and /dev/null, then waits until the worker's libraries and links are
in (LIBRARIES_IN, nvctk.hook.messages); then, in a private copy of the container's
mount namespace, it becomes the host's static ldconfig chrooted into the rootfs: the
rootfs's procfs detached (no magic links to the host), every host directory bound
into the rootfs read-only there, only CAP_DAC_OVERRIDE, an empty environment. Its exec
closes the set-up pipe's only write end (SET_UP: the worker mounts the rest). The
hook's process collects its output and kills it past its time
(nvctk.hook.children.wait_ldconfig); a failing ldconfig is a warning, never the hook's
failure (the libraries are mounted all the same).
"""

from __future__ import annotations

import os
import stat

from nvctk.base import mounts
from nvctk.hook import caps
from nvctk.hook import mount as m
from nvctk.hook.elf import elf_interpreter
from nvctk.hook.messages import LIBRARIES_LIMIT, decode_libraries_in

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.log import HookLog
    from nvctk.edits import Edits
    from nvctk.hook.messages import Channel

LDCONFIG_TIMEOUT = 30.0  # the hook's process kills it past this (children.wait_ldconfig)
# Ubuntu's /sbin/ldconfig is a shell script around /sbin/ldconfig.real (seen on a GPU
# host; NVIDIA's toolkit names ldconfig.real in its config there): a script is followed
# to the binary beside it
REAL_SUFFIX = ".real"


def open_ldconfig(ldconfig: str) -> int:
    """The host's ldconfig, opened: a regular, statically linked file (run chrooted, a
    dynamic one would load the image's loader); a script whose <path>.real exists is
    replaced by that. MountError (step open) when it is not one."""
    what = f"{ldconfig} (nvctk's ldconfig setting)"
    fd = -1
    try:
        # O_NONBLOCK: a FIFO would block open() until runc's hook timeout
        fd = os.open(ldconfig, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise m.step_error("open", what, "not a regular file")
        if os.pread(fd, 2, 0) == b"#!" and not ldconfig.endswith(REAL_SUFFIX) \
                and os.path.exists(ldconfig + REAL_SUFFIX):
            os.close(fd)
            fd = -1
            return open_ldconfig(ldconfig + REAL_SUFFIX)
        interp = elf_interpreter(fd)
        if interp is not None:
            raise m.step_error(
                "open", what,
                f"ldconfig is dynamically linked ({interp}); run chrooted it would load the "
                "image's loader",
            )
        return fd
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        if isinstance(e, OSError):
            raise m.step_error("open", what, e)
        if isinstance(e, ValueError):
            raise m.step_error("open", what, str(e))
        raise


def open_ns(pid: int) -> int:
    """The container's mount namespace (the worker's and this child's); never the
    host's own."""
    nspath = f"/proc/{pid}/ns/mnt"
    fd = -1
    try:
        fd = os.open(nspath, os.O_RDONLY | os.O_CLOEXEC)
        if os.fstat(fd).st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            raise m.step_error("setns", nspath, "the container shares the host's mount "
                               "namespace; refusing to mount into it")
        return fd
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        raise m.step_error("setns", nspath, e)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


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


def become_ldconfig(edits: Edits, rootfs: str, root_id: tuple[int, int], ldfd: int,
                    devnull: int, log: HookLog) -> None:
    """In a private mount namespace (ldconfig_child made it), with its
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
    os.execve(ldfd, ["ldconfig", edits.lib_dir], {})


def ldconfig_child(edits: Edits, rootfs: str, log: HookLog, libraries: Channel,
                   out: int) -> int:
    """The forked ldconfig, beside the worker: once LIBRARIES_IN comes on `libraries`
    (the rootfs and the container's pid), a private copy of the container's mount
    namespace, and there the host's ldconfig with its output on `out`, while the worker
    mounts the rest. Returns only on failure (127, the reason on `out`): a warning,
    never the hook's failure; 0 when the worker failed before its libraries were in."""
    fds: list[int] = []
    try:
        os.dup2(out, 1)
        os.dup2(out, 2)
        caps.restrict(caps.needed(("open", "setns", "ldconfig-setup", "ldconfig")), log)
        caps.enter_step("open", log)
        fds.append(ldfd := open_ldconfig(edits.ldconfig))
        fds.append(devnull := os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
        sent = decode_libraries_in(libraries.recv(LIBRARIES_LIMIT))
        if sent is None:
            return 0  # the worker failed before its libraries were in: the hook fails
        dev, ino, pid = sent
        fds.append(ns := open_ns(pid))
        caps.enter_step("setns", log)
        mounts.setns(ns, mounts.CLONE_NEWNS)
        caps.enter_step("ldconfig-setup", log)
        # private before anything changes: nothing below reaches the container's
        # namespace or the host's
        mounts.unshare(mounts.CLONE_NEWNS)
        mounts.mount_propagation("/", mounts.MS_REC | mounts.MS_PRIVATE)
        os.chdir("/")
        become_ldconfig(edits, rootfs, (dev, ino), ldfd, devnull, log)
    except BaseException as e:
        try:
            os.write(2, f"ldconfig setup: {e}\n".encode("utf-8", "replace"))
        except OSError:
            pass
    finally:
        for fd in fds:
            os.close(fd)
    return 127
