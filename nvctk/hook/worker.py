"""The prestart hook's worker: a form's mounts, links and mask, then ldconfig.

The work happens in a process forked from the hook's, so that the hook itself
stays in the host's mount namespace:

    open       (host ns)  clone every source as a detached, already
                          read-only/nosuid/nodev bind mount; build the
                          /proc/driver/nvidia mask (a detached tmpfs); open the
                          host's ldconfig; then wait for the container's pid (a
                          served prestart forks the worker while runc starts,
                          before the container exists: nvctk.hook.prestart.ready)
                          and open its mount namespace
    setns      enter the container's mount namespace (state.pid)
    propagation  never let a mount under the rootfs propagate to the host
    mount      (the form's pins first, a vGPU's /etc and /run: recursive self-binds,
               so that renaming them cannot carry nvctk's mounts away) resolve each
               destination inside the rootfs (openat2 RESOLVE_IN_ROOT), create
               it, move_mount the clone onto its fd; vGPU's destinations with no
               symlink on the way
    symlink    libcuda.so -> libcuda.so.1 and friends (symlinkat on a parent fd)
    proc-mask  tmpfs over /proc/driver/nvidia where the container has it

ldconfig runs beside the worker, not after it: the worker mounts the form's libraries
(and makes its links) first and then sends LIBRARIES_IN to the ldconfig child
(nvctk.hook.ldconfig), which enters a private copy of the container's mount namespace
and becomes the host's ldconfig there while the worker mounts the rest (once SET_UP
came: the child has exec'd ldconfig; its set-up and the worker's mounts would contend
for the kernel's namespace lock, and that set-up is on the hook's critical path). The
cache and links it writes are on the rootfs's own file system, the one the container
sees. The hook's process forks both (nvctk.hook.children), bounds ldconfig in time and
stops it when the worker fails; nvctk.hook.messages has every message between them.

It does what the form says and decides nothing else: which mounts may be missing
(skipped, logged) and which may not (the hook fails) is each Mount's `required`.
Nothing is created anywhere but on the rootfs's own mounts (nvctk.hook.mount.Root): a
target below a host directory bound read-write into the container (a volume,
extra-mounts, the MPS pipe dir) is skipped, or refused when required. The worker dies
with the hook's process (PR_SET_PDEATHSIG): runc's hook timeout kills only the hook,
and nothing the hook starts may outlive it.

Each step runs with exactly its capabilities effective (nvctk.hook.caps) and logs
them at debug level. On any failure the worker detaches what it mounted and
the hook exits 1 with "nvctk-hook: step <name>: <path>: <why>" on stderr.

The worker imports nothing once it is in the container's mount namespace (a lazy
import would be looked up through the container's view of the file system).
"""

from __future__ import annotations

import os
import stat

from nvctk.base import mounts
from nvctk.base.errors import MountError, NvctkError
from nvctk.base.record import Record
from nvctk.edits import VGPU_DIRS, VGPU_FILES, Edits, Mount
from nvctk.hook import caps
from nvctk.hook import mount as m
from nvctk.hook.ldconfig import open_ldconfig, open_ns
from nvctk.hook.messages import (
    PID_LIMIT,
    decode_pid,
    decode_set_up,
    encode_answer,
    encode_libraries_in,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.log import HookLog
    from nvctk.hook.messages import Channel

PROC_DRIVER = "/proc/driver/nvidia"
ALL_STEPS = ("open", "setns", "propagation", "mount", "symlink", "proc-mask", "ldconfig-setup",
             "ldconfig", "undo", "done")


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class WorkerFds(Record):
    """The fds the host-namespace step (open) opens for the steps in the container.
    (nvctk.runtime's Prepared is something else: a bundle the runtime made ready.)"""

    __slots__ = ("sources", "mask", "ns", "vgpu_from")  # noqa: RUF023

    def __init__(self, sources: list[tuple[Mount, int]] | None = None, mask: int = -1,
                 ns: int = -1, vgpu_from: int = -1) -> None:
        self.sources = [] if sources is None else sources
        self.vgpu_from = vgpu_from  # sources[vgpu_from:] are the vGPU mounts (-1: none)
        self.mask = mask
        self.ns = ns

    def fds(self) -> list[int]:
        out = [fd for _, fd in self.sources]
        return out + [fd for fd in (self.mask, self.ns) if fd >= 0]


# the host side of a vGPU container's state (nvctk.vgpu.state), below its own tmpfs:
# ro/ is mounted read-only at /run/nvctk, rw/ (the accounting dir) read-write over its
# placeholder ro/vgpu; the other names are files, or placeholders (mount points) for
# the files bound over them. Nothing the container can write backs a read-only bind.


def _is_own_tmpfs(path: str, st: os.stat_result) -> bool:
    """path (lstat st) is the root of a tmpfs: a file system apart from its parent's."""
    if os.lstat(os.path.dirname(path)).st_dev == st.st_dev:
        return False
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return mounts.fstatfs_type(fd) == mounts.TMPFS_MAGIC
    finally:
        os.close(fd)


def check_vgpu_state(edits: Edits, log: HookLog) -> tuple[Mount, ...]:
    """The form's vGPU mounts, once their sources are what nvctk-runtime made at create
    (nvctk.vgpu.state): the state dir a tmpfs of its own holding ro/ and rw/ and the
    files the mounts take. A missing piece fails the hook: a container that sets a
    limit never runs uncapped."""
    v = edits.vgpu
    if v is None:
        return ()
    top = os.path.dirname(v.container_state_dir)
    if (os.path.dirname(v.container_library) != top or top.count("/") != 2
            or not top.startswith("/run/")):
        raise MountError(f"step open: {v.container_state_dir}: the vGPU state must be mounted "
                         f"in a directory of its own below /run, with {v.container_library}")
    ro, rw = (os.path.join(v.state_dir, d) for d in VGPU_DIRS)
    lib_name = os.path.basename(v.container_library)
    dir_name = os.path.basename(v.container_state_dir)
    try:
        st = os.lstat(v.state_dir)
        if not stat.S_ISDIR(st.st_mode):
            raise MountError(f"step open: {v.state_dir}: the vGPU state dir is not a directory")
        if not _is_own_tmpfs(v.state_dir, st):
            # the container writes there: never a directory of the host's file system
            raise MountError(f"step open: {v.state_dir}: the vGPU state dir is not a tmpfs of "
                             "its own (nvctk-runtime mounts one at create)")
        for d in (ro, rw, os.path.join(ro, dir_name)):
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                raise MountError(f"step open: {d}: not a directory")
        for name in (*VGPU_FILES, f"ro/{lib_name}"):
            if not stat.S_ISREG(os.lstat(os.path.join(v.state_dir, name)).st_mode):
                raise MountError(f"step open: {v.state_dir}/{name}: not a regular file")
        if not os.path.isfile(v.library):
            raise MountError(f"step open: {v.library}: libvgpu.so is missing on the host")
    except FileNotFoundError as e:
        raise MountError(f"step open: {e.filename}: missing (the container sets GPU limits; "
                         "its vGPU state is made by nvctk-runtime at create)")
    except OSError as e:
        raise MountError(f"step open: {e.filename or v.state_dir}: {e.strerror}")
    if not v.mounts or not all(mnt.required for mnt in v.mounts):
        raise MountError(f"step edits: the vGPU state {v.state_dir} has no mounts, or optional "
                         "ones, in the plan (a container that sets a limit never runs uncapped)")
    log.debug(f"vgpu: {len(v.mounts)} mounts for {v.library}, state {v.state_dir}")
    return v.mounts


def _prepare(edits: Edits, log: HookLog) -> WorkerFds:
    """Host-namespace work that needs no container: clones of the sources, the mask,
    ldconfig checked (the ns fd comes once the pid is known: ldconfig.open_ns)."""
    caps.enter_step("open", log)
    p = WorkerFds()
    try:
        _clone_sources(edits, p, log)
        _make_mask(edits, p, log)
        if edits.ldconfig:
            # the ldconfig child opens it too: a wrong one fails the hook here
            os.close(open_ldconfig(edits.ldconfig))
        return p
    except BaseException:
        fds = p.fds()
        _close_all(fds)
        raise


def _clone_sources(edits: Edits, p: WorkerFds, log: HookLog) -> None:
    """Every mount's source cloned (detached, already read-only/nosuid/nodev), the vGPU
    state's last; a missing optional one skipped, a missing required one an error."""
    vgpu = check_vgpu_state(edits, log)
    for i, mnt in enumerate((*edits.mounts, *vgpu)):
        if i == len(edits.mounts):
            p.vgpu_from = len(p.sources)
        try:
            fd = m.clone_source(mnt.host_path, m.attrs_for(mnt.read_only, mnt.noexec))
        except OSError as e:
            # open_tree first, lstat only when it failed: one syscall per file
            if os.path.lexists(mnt.host_path) or i >= len(edits.mounts):
                raise m.step_error("open", mnt.host_path, e)
            if mnt.required:
                raise MountError(
                    f"step open: {mnt.host_path}: required, and missing on the host "
                    f"({os.path.basename(mnt.host_path)}; the container's capabilities: "
                    f"{', '.join(edits.capabilities)})"
                )
            log.info(f"skip {mnt.container_path}: {mnt.host_path} is missing on the host")
            continue
        p.sources.append((mnt, fd))


def _make_mask(edits: Edits, p: WorkerFds, log: HookLog) -> None:
    """The /proc/driver/nvidia mask: a detached tmpfs with the selected GPUs' files."""
    pm = edits.proc_mask
    if pm is None:
        return
    if not os.path.isdir(pm.host_dir):
        log.info(f"skip the {PROC_DRIVER} mask: {pm.host_dir} is missing on the host")
        return
    try:
        p.mask = m.make_proc_mask(pm.host_dir, pm.gpu_bus_ids)
    except OSError as e:
        raise m.step_error("open", pm.host_dir, e)


def _pin(edits: Edits, root: m.Root, mounter: m.Mounter, log: HookLog) -> None:
    """Pin the rootfs dirs the form lists (a vGPU's: /etc and /run, which hold its
    mounts): renaming one (or a directory on the way to a vGPU mount) would take
    nvctk's mounts away from the paths ld.so and libvgpu read (the layout's step 1)."""
    for name in edits.pins:
        if not name or "/" in name or name in (".", ".."):
            raise MountError(f"step edits: pin {name!r}: want a directory name at the "
                             "rootfs's top")
        try:
            if root.pin(name, mounter):
                log.debug(f"pinned /{name} (a recursive bind onto itself)")
            else:
                log.debug(f"/{name} is a mount point already")
        except OSError as e:
            raise m.step_error("mount", f"/{name}", e)


def _threads() -> str:
    """This process's thread count, for an error message (a library's fork handler can
    start one in a forked child)."""
    try:
        with open("/proc/self/status", "rb") as f:
            return next((line.split()[1].decode() for line in f if line.startswith(b"Threads:")), "?")
    except OSError:
        return "?"


def _enter(rootfs: str, prep: WorkerFds, log: HookLog) -> m.Root:
    """setns into the container's mount namespace; the rootfs, opened there, made so
    that nothing mounted under it propagates to the host."""
    caps.enter_step("setns", log)
    try:
        mounts.setns(prep.ns, mounts.CLONE_NEWNS)
    except OSError as e:
        raise m.step_error("setns", f"/proc/<pid>/ns/mnt ({rootfs}; the fd is {mounts.fd_path(prep.ns)}, "
                                    f"this process has {_threads()} thread(s): a mount "
                                    "namespace takes one)", e)
    os.chdir("/")
    try:
        root = m.Root(rootfs)
    except OSError as e:
        raise m.step_error("setns", rootfs, e)
    try:
        caps.enter_step("propagation", log)
        try:
            if m.ensure_not_shared(root):
                log.info(f"rootfs {rootfs} was on a shared mount: made it a recursive slave so "
                         "nothing mounted under it reaches the host")
        except OSError as e:
            raise m.step_error("propagation", rootfs, e)
    except BaseException:
        root.close()
        raise
    return root


def _mount_sources(root: m.Root, sources: list[tuple[Mount, int]], vgpu_from: int,
                   mounter: m.Mounter, log: HookLog) -> None:
    """Every cloned source at its destination in the rootfs (sources[vgpu_from:] are
    the vGPU's, -1: none)."""
    caps.enter_step("mount", log)
    debug = log.enabled("debug")
    for i, (mnt, src) in enumerate(sources):
        kind = "dir" if mnt.kind == "dir" else "file"
        vgpu = 0 <= vgpu_from <= i
        try:
            # vGPU's mounts sit at exactly their paths: no link the container could
            # replace leads to them
            dest = (root.ensure_exact if vgpu else root.ensure)(mnt.container_path, kind)
        except m.NotOnRootfs as e:
            if vgpu or mnt.required:
                raise m.step_error("mount", mnt.container_path, e)
            log.info(f"skip {mnt.container_path}: {e.strerror}")
            continue
        except OSError as e:
            raise m.step_error("mount", mnt.container_path, e)
        try:
            mounter.attach(src, dest, mnt.container_path)
        except OSError as e:
            raise m.step_error("mount", mnt.container_path, e)
        finally:
            os.close(dest)
            if kind == "dir":
                root.forget_dirs()  # what paths below it resolve to changed
        if debug:
            log.debug(f"mounted {mnt.host_path} at {mnt.container_path}")
    root.forget_dirs()


def reads_for_ldconfig(mnt: Mount) -> bool:
    """A mount ldconfig may read: a file whose name has ".so" in it (ldconfig's own
    first test of a directory entry)."""
    return mnt.kind != "dir" and ".so" in mnt.container_path.rsplit("/", 1)[-1]


def ldconfig_first(sources: list[tuple[Mount, int]]) -> tuple[list[tuple[Mount, int]], int]:
    """The sources with what ldconfig reads first, and how many lead: ldconfig starts
    once those are in, while the worker mounts the rest. Kept in the form's order where
    a directory mount lies on the way to a library (mounting the library first would
    put it under that directory); then the lead runs to the last library."""
    libs = [s for s in sources if reads_for_ldconfig(s[0])]
    dirs = [s[0].container_path.rstrip("/") + "/" for s in sources if s[0].kind == "dir"]
    if not any(mnt.container_path.startswith(d) for mnt, _ in libs for d in dirs):
        return libs + [s for s in sources if not reads_for_ldconfig(s[0])], len(libs)
    last = max((i for i, s in enumerate(sources) if reads_for_ldconfig(s[0])), default=-1)
    return sources, last + 1


def _make_links(edits: Edits, root: m.Root, log: HookLog) -> None:
    """The form's symlinks; one where the image has a file, or off the rootfs, is skipped."""
    caps.enter_step("symlink", log)
    for link in edits.symlinks:
        try:
            if not root.symlink(link.container_path, link.target):
                log.info(f"skip link {link.container_path}: the image has a file there")
        except m.NotOnRootfs as e:
            log.info(f"skip link {link.container_path}: {e.strerror}")
        except OSError as e:
            raise m.step_error("symlink", link.container_path, e)


def _mask_proc(root: m.Root, mask: int, mounter: m.Mounter, log: HookLog) -> None:
    """The /proc/driver/nvidia mask (a tmpfs made in the host namespace) where the
    container has that dir."""
    caps.enter_step("proc-mask", log)
    try:
        dest = root.open(PROC_DRIVER, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        log.info(f"skip the {PROC_DRIVER} mask: the container has no {PROC_DRIVER}")
        return
    except OSError as e:
        raise m.step_error("proc-mask", PROC_DRIVER, e)
    try:
        mounter.attach(mask, dest, PROC_DRIVER)
    except OSError as e:
        raise m.step_error("proc-mask", PROC_DRIVER, e)
    finally:
        os.close(dest)
    log.debug(f"masked {PROC_DRIVER}")


def _mount_steps(edits: Edits, rootfs: str, pid: int, prep: WorkerFds, mounter: m.Mounter,
                 log: HookLog, libraries: Channel, set_up: Channel) -> m.Root:
    """setns to proc-mask; returns the rootfs once all are in. Once the libraries and
    links are in, LIBRARIES_IN on `libraries` (closed: no ldconfig) starts ldconfig, and
    the rest waits for SET_UP (ldconfig set up: nvctk.hook.messages)."""
    root = _enter(rootfs, prep, log)
    try:
        caps.enter_step("mount", log)
        _pin(edits, root, mounter, log)
        n = len(prep.sources) if prep.vgpu_from < 0 else prep.vgpu_from
        ordered, lead = ldconfig_first(prep.sources[:n])
        vgpu_from = n - lead if prep.vgpu_from >= 0 else -1  # in what follows the lead
        _mount_sources(root, ordered[:lead], -1, mounter, log)
        _make_links(edits, root, log)
        if libraries.fd >= 0:
            st = os.fstat(root.fd)  # the rootfs ldconfig is to chroot into: this one
            libraries.send(encode_libraries_in(st.st_dev, st.st_ino, pid))
        if set_up.fd >= 0:
            # its set-up (the namespace copy, the mountinfo read, the procfs detach)
            # takes the kernel's namespace lock, as every mount here does: the rest is
            # mounted while ldconfig runs, not while it is set up
            decode_set_up(set_up.recv(PID_LIMIT))
        _mount_sources(root, ordered[lead:] + prep.sources[n:], vgpu_from, mounter, log)
        if root.pins and edits.vgpu is not None and edits.vgpu.root_readonly:
            try:
                root.seal_pins()
            except OSError as e:
                raise m.step_error("mount", ", ".join(f"/{p}" for p in edits.pins), e)
        if prep.mask >= 0:
            _mask_proc(root, prep.mask, mounter, log)
        return root
    except BaseException:
        root.close()
        raise


def _traceback_text(e: BaseException) -> str:
    """A traceback without importing traceback (the worker may be in the container's
    mount namespace, where an import would read the container's view of the files)."""
    lines = ["Traceback (most recent call last):"]
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        lines.append(f"  {code.co_filename}:{tb.tb_lineno} in {code.co_name}")
        tb = tb.tb_next
    lines.append(repr(e))
    return "\n".join(lines)


def _failed(e: BaseException, mounter: m.Mounter, log: HookLog) -> str:
    """The message for a failed step, after undoing the mounts made."""
    if isinstance(e, NvctkError):
        msg = str(e)
    elif isinstance(e, OSError):
        msg = f"step unknown: {e.filename or '-'}: {e.strerror or e}"
    else:
        msg = f"internal error: {e!r}"
        log.debug(_traceback_text(e))
    if mounter.attached:
        try:
            caps.enter_step("undo", log)
        except OSError:
            pass
        left = mounter.undo()
        if left:
            msg += "; undo failed for " + ", ".join(left)
        else:
            log.info("undid the mounts made before the failure")
    log.error(msg)
    return msg


def worker(edits: Edits, rootfs: str, log: HookLog, pid_r: Channel, answer: Channel,
           libraries: Channel, set_up: Channel) -> int:
    """The forked worker: the host-side step, then (once PID comes on pid_r) every other,
    then its ANSWER (nvctk.hook.messages); the exit code. Cancelled (EOF alone on
    pid_r), it exits 0 with no answer. libraries, set_up: see _mount_steps."""
    mounter = m.Mounter()
    prep: WorkerFds | None = None
    root: m.Root | None = None
    try:
        try:
            caps.restrict(caps.needed(ALL_STEPS), log)
            prep = _prepare(edits, log)
            pid = decode_pid(pid_r.recv(PID_LIMIT))
            if pid is None:
                return 0
            prep.ns = open_ns(pid)
            root = _mount_steps(edits, rootfs, pid, prep, mounter, log, libraries, set_up)
            mounter.forget()
        except BaseException as e:
            answer.send(encode_answer(_failed(e, mounter, log)))
            return 1
        caps.enter_step("done", log)
        answer.send(encode_answer(None))
        return 0
    finally:
        if root is not None:
            root.close()
        if prep is not None:
            _close_all(prep.fds())
