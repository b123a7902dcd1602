"""The prestart hook's worker: a plan's mounts, links and mask, then ldconfig.

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
    mount      (the plan's pins first, a vGPU's /etc and /run: recursive self-binds,
               so that renaming them cannot carry nvctk's mounts away) resolve each
               destination inside the rootfs (openat2 RESOLVE_IN_ROOT), create
               it, move_mount the clone onto its fd; vGPU's destinations with no
               symlink on the way
    symlink    libcuda.so -> libcuda.so.1 and friends (symlinkat on a parent fd)
    proc-mask  tmpfs over /proc/driver/nvidia where the container has it

ldconfig runs beside the worker, not after it: the worker mounts the plan's libraries
(and makes its links) first and then signals a second child of the hook's process
(ldconfig_child), which enters a private copy of the container's mount namespace and
becomes the host's ldconfig there (nvctk.hook.ldconfig) while the worker mounts the
rest (once the child has exec'd ldconfig: its set-up and the worker's mounts would
contend for the kernel's namespace lock, and that set-up is on the hook's critical
path). The cache and links it writes are on the rootfs's own file system, the one the
container sees. The hook's process bounds it in time, and stops it when the worker
fails.

It does what the plan says and decides nothing else: which mounts may be missing
(skipped, logged) and which may not (the hook fails) is each Mount's `required`.
Nothing is created anywhere but on the rootfs's own mounts (nvctk.hook.mount.Root): a
target below a host directory bound read-write into the container (a volume,
extra-mounts, the MPS pipe dir) is skipped, or refused when required. Both children
die with the hook's process (PR_SET_PDEATHSIG): runc's hook timeout kills only the
hook, and nothing the hook starts may outlive it.

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
from nvctk.base.fileio import read_all, write_all
from nvctk.base.record import Record
from nvctk.edits import VGPU_DIRS, VGPU_FILES, Edits, Mount
from nvctk.hook import caps
from nvctk.hook import mount as m
from nvctk.hook.elf import elf_interpreter
from nvctk.hook.ldconfig import become_ldconfig, stop, wait_ldconfig

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from nvctk.base.log import HookLog

PROC_DRIVER = "/proc/driver/nvidia"
ALL_STEPS = ("open", "setns", "propagation", "mount", "symlink", "proc-mask", "ldconfig-setup",
             "ldconfig", "undo", "done")

# the worker's answer on its pipe: _OK, or _FAILED followed by the message
_OK = b"ok"
_FAILED = b"error\n"


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

    __slots__ = ("sources", "mask", "ldconfig", "ns", "devnull", "vgpu_from")  # noqa: RUF023

    def __init__(self, sources: list[tuple[Mount, int]] | None = None, mask: int = -1,
                 ldconfig: int = -1, ns: int = -1, devnull: int = -1,
                 vgpu_from: int = -1) -> None:
        self.sources = [] if sources is None else sources
        self.vgpu_from = vgpu_from  # sources[vgpu_from:] are the vGPU mounts (-1: none)
        self.mask = mask
        self.ldconfig = ldconfig
        self.ns = ns
        self.devnull = devnull

    def fds(self) -> list[int]:
        out = [fd for _, fd in self.sources]
        return out + [fd for fd in (self.mask, self.ldconfig, self.ns, self.devnull) if fd >= 0]


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


def check_vgpu_state(plan: Edits, log: HookLog) -> tuple[Mount, ...]:
    """The plan's vGPU mounts, once their sources are what nvctk-runtime made at create
    (nvctk.vgpu.state): the state dir a tmpfs of its own holding ro/ and rw/ and the
    files the mounts take. A missing piece fails the hook: a container that sets a
    limit never runs uncapped."""
    v = plan.vgpu
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


def _prepare(plan: Edits, log: HookLog) -> WorkerFds:
    """Host-namespace work that needs no container: clones of the sources, the mask,
    ldconfig and /dev/null (the ns fd comes once the pid is known: _open_ns)."""
    caps.enter_step("open", log)
    p = WorkerFds()
    try:
        _clone_sources(plan, p, log)
        _make_mask(plan, p, log)
        if plan.ldconfig:
            _open_ldconfig(plan.ldconfig, p)
        p.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        return p
    except BaseException:
        fds = p.fds()
        _close_all(fds)
        raise


def _clone_sources(plan: Edits, p: WorkerFds, log: HookLog) -> None:
    """Every mount's source cloned (detached, already read-only/nosuid/nodev), the vGPU
    state's last; a missing optional one skipped, a missing required one an error."""
    vgpu = check_vgpu_state(plan, log)
    for i, mnt in enumerate((*plan.mounts, *vgpu)):
        if i == len(plan.mounts):
            p.vgpu_from = len(p.sources)
        try:
            fd = m.clone_source(mnt.host_path, m.attrs_for(mnt.read_only, mnt.noexec))
        except OSError as e:
            # open_tree first, lstat only when it failed: one syscall per file
            if os.path.lexists(mnt.host_path) or i >= len(plan.mounts):
                raise m.step_error("open", mnt.host_path, e)
            if mnt.required:
                raise MountError(
                    f"step open: {mnt.host_path}: required, and missing on the host "
                    f"({os.path.basename(mnt.host_path)}; the container's capabilities: "
                    f"{', '.join(plan.capabilities)})"
                )
            log.info(f"skip {mnt.container_path}: {mnt.host_path} is missing on the host")
            continue
        p.sources.append((mnt, fd))


def _make_mask(plan: Edits, p: WorkerFds, log: HookLog) -> None:
    """The /proc/driver/nvidia mask: a detached tmpfs with the selected GPUs' files."""
    pm = plan.proc_mask
    if pm is None:
        return
    if not os.path.isdir(pm.host_dir):
        log.info(f"skip the {PROC_DRIVER} mask: {pm.host_dir} is missing on the host")
        return
    try:
        p.mask = m.make_proc_mask(pm.host_dir, pm.gpu_bus_ids)
    except OSError as e:
        raise m.step_error("open", pm.host_dir, e)


# Ubuntu's /sbin/ldconfig is a shell script around /sbin/ldconfig.real (seen on a GPU
# host; NVIDIA's toolkit names ldconfig.real in its config there): a script is followed
# to the binary beside it
REAL_SUFFIX = ".real"


def _open_ldconfig(ldconfig: str, p: WorkerFds) -> None:
    """The host's ldconfig, opened here: a regular, statically linked file (run chrooted,
    a dynamic one would load the image's loader); a script whose <path>.real exists is
    replaced by that."""
    what = f"{ldconfig} (nvctk's ldconfig setting)"
    try:
        # O_NONBLOCK: a FIFO would block open() until runc's hook timeout
        p.ldconfig = os.open(ldconfig, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(p.ldconfig).st_mode):
            raise m.step_error("open", what, "not a regular file")
        if os.pread(p.ldconfig, 2, 0) == b"#!" and not ldconfig.endswith(REAL_SUFFIX) \
                and os.path.exists(ldconfig + REAL_SUFFIX):
            os.close(p.ldconfig)
            p.ldconfig = -1
            return _open_ldconfig(ldconfig + REAL_SUFFIX, p)
        interp = elf_interpreter(p.ldconfig)
    except OSError as e:
        raise m.step_error("open", what, e)
    except ValueError as e:
        raise m.step_error("open", what, str(e))
    if interp is not None:
        raise m.step_error(
            "open", what,
            f"ldconfig is dynamically linked ({interp}); run chrooted it would load the "
            "image's loader",
        )


def _open_ns(pid: int, p: WorkerFds) -> None:
    """The container's mount namespace; never the host's own."""
    nspath = f"/proc/{pid}/ns/mnt"
    try:
        p.ns = os.open(nspath, os.O_RDONLY | os.O_CLOEXEC)
        if os.fstat(p.ns).st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            raise m.step_error("setns", nspath, "the container shares the host's mount "
                               "namespace; refusing to mount into it")
    except OSError as e:
        raise m.step_error("setns", nspath, e)


def _pin(plan: Edits, root: m.Root, mounter: m.Mounter, log: HookLog) -> None:
    """Pin the rootfs dirs the plan lists (a vGPU's: /etc and /run, which hold its
    mounts): renaming one (or a directory on the way to a vGPU mount) would take
    nvctk's mounts away from the paths ld.so and libvgpu read (the layout's step 1)."""
    for name in plan.pins:
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


def _enter(rootfs: str, prep: WorkerFds, log: HookLog) -> m.Root:
    """setns into the container's mount namespace; the rootfs, opened there, made so
    that nothing mounted under it propagates to the host."""
    caps.enter_step("setns", log)
    try:
        mounts.setns(prep.ns, mounts.CLONE_NEWNS)
    except OSError as e:
        raise m.step_error("setns", f"/proc/<pid>/ns/mnt ({rootfs})", e)
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
    once those are in, while the worker mounts the rest. Kept in the plan's order where
    a directory mount lies on the way to a library (mounting the library first would
    put it under that directory); then the lead runs to the last library."""
    libs = [s for s in sources if reads_for_ldconfig(s[0])]
    dirs = [s[0].container_path.rstrip("/") + "/" for s in sources if s[0].kind == "dir"]
    if not any(mnt.container_path.startswith(d) for mnt, _ in libs for d in dirs):
        return libs + [s for s in sources if not reads_for_ldconfig(s[0])], len(libs)
    last = max((i for i, s in enumerate(sources) if reads_for_ldconfig(s[0])), default=-1)
    return sources, last + 1


def _make_links(plan: Edits, root: m.Root, log: HookLog) -> None:
    """The plan's symlinks; one where the image has a file, or off the rootfs, is skipped."""
    caps.enter_step("symlink", log)
    for link in plan.symlinks:
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


def _mount_steps(plan: Edits, rootfs: str, pid: int, prep: WorkerFds, mounter: m.Mounter,
                 log: HookLog, go: int, set_up: int) -> m.Root:
    """setns to proc-mask; returns the rootfs once all are in. Once the libraries and
    links are in, _libraries_in on `go` (-1: none) starts ldconfig, and the rest waits
    until ldconfig is set up (EOF on `set_up`)."""
    root = _enter(rootfs, prep, log)
    try:
        caps.enter_step("mount", log)
        _pin(plan, root, mounter, log)
        n = len(prep.sources) if prep.vgpu_from < 0 else prep.vgpu_from
        ordered, lead = ldconfig_first(prep.sources[:n])
        vgpu_from = n - lead if prep.vgpu_from >= 0 else -1  # in what follows the lead
        _mount_sources(root, ordered[:lead], -1, mounter, log)
        _make_links(plan, root, log)
        if go >= 0:
            _libraries_in(go, root, pid)
        if set_up >= 0:
            _ldconfig_set_up(set_up)
        _mount_sources(root, ordered[lead:] + prep.sources[n:], vgpu_from, mounter, log)
        if root.pins and plan.vgpu is not None and plan.vgpu.root_readonly:
            try:
                root.seal_pins()
            except OSError as e:
                raise m.step_error("mount", ", ".join(f"/{p}" for p in plan.pins), e)
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


def _libraries_in(fd: int, root: m.Root, pid: int) -> None:
    """Tell the ldconfig child the libraries and links are in, which directory the
    rootfs is (st_dev st_ino of the worker's own fd: ldconfig chroots into exactly that)
    and the container's pid; closes fd."""
    st = os.fstat(root.fd)
    try:
        write_all(fd, b"%d %d %d" % (st.st_dev, st.st_ino, pid))
    finally:
        os.close(fd)


def _libraries_sent(data: bytes) -> tuple[int, int, int] | None:
    """What _libraries_in sent (dev, ino, pid); None: nothing (the worker failed before,
    or never started)."""
    try:
        dev, ino, pid = (int(x) for x in data.split())
    except ValueError:
        return None
    return dev, ino, pid


def _ldconfig_set_up(fd: int) -> None:
    """Wait until the ldconfig child has execed ldconfig, or ended (EOF: it holds the
    pipe's write end, close-on-exec), then close fd. Its set-up (the namespace copy, the
    mountinfo read, the procfs detach) takes the kernel's namespace lock, as every mount
    of the worker does: the worker mounts the rest while ldconfig runs, not while it is
    set up, which is what the hook waits for longest."""
    try:
        read_all(fd)
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    """The container's pid, sent by Children.go (closes fd); None: cancelled (EOF)."""
    try:
        data = read_all(fd, 32)
    finally:
        os.close(fd)
    try:
        pid = int(data)
    except ValueError:
        return None
    return pid if pid > 0 else None


def _answer(fd: int, err: str | None) -> None:
    """The worker's answer to the hook's process; closes fd."""
    try:
        write_all(fd, _OK if err is None else _FAILED + err.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def worker(plan: Edits, rootfs: str, pid_r: int, log: HookLog, answer: int, go: int,
           set_up: int) -> int:
    """The forked worker: the host-side step, then (once the container's pid comes on
    pid_r) every other, then its answer on `answer` (closed then); the exit code.
    Cancelled (no pid), it exits 0 with no answer. go, set_up: see _mount_steps."""
    mounter = m.Mounter()
    prep: WorkerFds | None = None
    root: m.Root | None = None
    try:
        try:
            caps.restrict(caps.needed(ALL_STEPS), log)
            prep = _prepare(plan, log)
            pid = _read_pid(pid_r)
            if pid is None:
                return 0
            _open_ns(pid, prep)
            root = _mount_steps(plan, rootfs, pid, prep, mounter, log, go, set_up)
            mounter.forget()
        except BaseException as e:
            _answer(answer, _failed(e, mounter, log))
            return 1
        caps.enter_step("done", log)
        _answer(answer, None)
        return 0
    finally:
        if root is not None:
            root.close()
        if prep is not None:
            _close_all(prep.fds())


def ldconfig_child(plan: Edits, rootfs: str, log: HookLog, go: int, out: int) -> int:
    """The forked ldconfig, beside the worker: once the worker's libraries and links
    are in (_libraries_in, on `go`: the rootfs and the container's pid), a private copy
    of the container's mount namespace, and there the host's ldconfig
    (nvctk.hook.ldconfig) with its output on `out`, while the worker mounts the rest.
    Returns only on failure (127, the reason on `out`): a warning, never the hook's
    failure."""
    p = WorkerFds()
    try:
        os.dup2(out, 1)
        os.dup2(out, 2)
        caps.restrict(caps.needed(("open", "setns", "ldconfig-setup", "ldconfig")), log)
        caps.enter_step("open", log)
        _open_ldconfig(plan.ldconfig, p)
        p.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        sent = _libraries_sent(read_all(go))
        if sent is None:
            return 0  # the worker failed before its libraries were in: the hook fails
        dev, ino, pid = sent
        _open_ns(pid, p)
        caps.enter_step("setns", log)
        mounts.setns(p.ns, mounts.CLONE_NEWNS)
        caps.enter_step("ldconfig-setup", log)
        # private before anything changes: nothing below reaches the container's
        # namespace or the host's
        mounts.unshare(mounts.CLONE_NEWNS)
        mounts.mount_propagation("/", mounts.MS_REC | mounts.MS_PRIVATE)
        os.chdir("/")
        become_ldconfig(plan, rootfs, (dev, ino), p.ldconfig, p.devnull, log)
    except BaseException as e:
        try:
            os.write(2, f"ldconfig setup: {e}\n".encode("utf-8", "replace"))
        except OSError:
            pass
    finally:
        _close_all(p.fds())
    return 127


def _fork(parent: int, run: Callable[[], int], child_closes: tuple[int, ...],
          parent_closes: tuple[int, ...]) -> int:
    """A child that closes `child_closes`, runs `run` and exits with its code, dying with
    `parent`: nothing the hook starts outlives it (runc's hook timeout kills only the
    hook). The caller's `parent_closes` are closed once it is forked (or failed to be);
    an fd < 0 is none."""
    child = -1
    try:
        child = os.fork()
        if child == 0:
            code = 1
            try:
                caps.die_with_parent(parent)
                _close_all([fd for fd in child_closes if fd >= 0])
                code = run()
            finally:
                os._exit(code)
    finally:
        if child != 0:
            _close_all([fd for fd in parent_closes if fd >= 0])
    return child


class Children(Record):
    """The worker and the ldconfig beside it, forked (`start`) before the container's pid
    is needed: each opens what the host side needs, then waits. `go` hands them the pid
    and waits for the work; `cancel` ends them unused."""

    __slots__ = ("worker", "ldconfig", "pid_w", "answer_r", "out_r")  # noqa: RUF023

    def __init__(self, worker: int, ldconfig: int, pid_w: int, answer_r: int,
                 out_r: int) -> None:
        self.worker = worker
        self.ldconfig = ldconfig  # -1: the plan runs no ldconfig
        self.pid_w = pid_w
        self.answer_r = answer_r
        self.out_r = out_r

    def go(self, plan: Edits, pid: int, log: HookLog, drop_parent_caps: bool = False,
           deadline: float | None = None) -> None:
        """The work on container `pid`; MountError with the worker's message on failure
        (ldconfig is then stopped). drop_parent_caps, deadline: see apply_edits."""
        try:
            write_all(self.pid_w, b"%d" % pid)
        except OSError:
            pass  # the worker is gone: its answer (none) says so
        finally:
            os.close(self.pid_w)
        if drop_parent_caps:
            caps.drop_all()
        try:
            data = read_all(self.answer_r)
        finally:
            os.close(self.answer_r)
        if data == _OK:
            err = None
        elif data.startswith(_FAILED):
            err = data[len(_FAILED):].decode("utf-8", "replace")
        else:
            err = "worker gave a garbled answer" if data else "worker gave no answer"
        _, status = os.waitpid(self.worker, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and err is None:
            err = f"worker exited {code}"
        if self.ldconfig > 0:
            if err is None:
                wait_ldconfig(plan, self.ldconfig, self.out_r, log, deadline)
                # the children's caps went with them: what is left of the hook is this process
                log.debug(f"caps step=done effective={','.join(caps.current()) or '-'}")
            else:
                os.close(self.out_r)
                stop(self.ldconfig)
        if err is not None:
            raise MountError(err)

    def cancel(self) -> None:
        """End both unused (no pid: they exit having mounted nothing) and reap them."""
        _close_all([fd for fd in (self.pid_w, self.answer_r, self.out_r) if fd >= 0])
        os.waitpid(self.worker, 0)
        if self.ldconfig > 0:
            os.waitpid(self.ldconfig, 0)


def start(plan: Edits, rootfs: str, log: HookLog) -> Children:
    """Fork the worker, and ldconfig beside it, for `plan`; they die with this process."""
    caps.warm_up()
    parent = os.getpid()
    r, w = os.pipe()
    pid_r, pid_w = os.pipe()
    go_r, go_w = os.pipe() if plan.ldconfig else (-1, -1)
    # set-up done: EOF once the ldconfig child, which alone holds set_w, execs or ends
    set_r, set_w = os.pipe() if plan.ldconfig else (-1, -1)
    child = _fork(parent, lambda: worker(plan, rootfs, pid_r, log, w, go_w, set_r),
                  (r, go_r, pid_w, set_w), (w, go_w, pid_r, set_r))
    ld = out_r = -1
    if plan.ldconfig:
        out_r, out_w = os.pipe()
        ld = _fork(parent, lambda: ldconfig_child(plan, rootfs, log, go_r, out_w),
                   (r, out_r, pid_w), (out_w, go_r, set_w))
    return Children(child, ld, pid_w, r, out_r)


def apply_edits(plan: Edits, rootfs: str, pid: int, log: HookLog,
                drop_parent_caps: bool = False, deadline: float | None = None) -> None:
    """Run the worker, and ldconfig beside it, in forked children on container `pid`;
    MountError with the worker's message on failure (ldconfig is then stopped).

    drop_parent_caps: the calling process gives up every capability once the
    children have the pid (the hook's main process needs none afterwards).
    deadline: when runc gives up on the hook (time.monotonic; None: no timeout):
    ldconfig is stopped there at the latest, also where the hook's own process is not
    the one runc kills (nvctk-runtime's server).
    """
    start(plan, rootfs, log).go(plan, pid, log, drop_parent_caps, deadline)
