"""The prestart hook's logic: state -> bundle -> spec -> plan -> steps.

`main` is what `nvctk-hook prestart` runs. The work itself happens in a forked
worker so that the hook's own process stays in the host's mount namespace:

    open       (host ns)  clone every driver file as a detached, already
                          read-only/nosuid/nodev bind mount; build the
                          /proc/driver/nvidia mask (a detached tmpfs); open the
                          host's ldconfig and the container's mount namespace
    setns      enter the container's mount namespace (state.pid)
    propagation  never let a mount under the rootfs propagate to the host
    mount      (vGPU: pin /etc and /run first, recursive self-binds, so that
               renaming them cannot carry nvctk's mounts away) resolve each
               destination inside the rootfs (openat2 RESOLVE_IN_ROOT), create
               it, move_mount the clone onto its fd; vGPU's destinations with no
               symlink on the way (vgpu_layout: ro/ at /run/nvctk, ...)
    symlink    libcuda.so -> libcuda.so.1 and friends (symlinkat on a parent fd)
    proc-mask  tmpfs over /proc/driver/nvidia where the container has it
    ldconfig   the worker, its answer sent: private mount ns, the rootfs's
               procfs detached (no magic links to the host), every host
               directory bound into the rootfs made read-only there, chroot,
               only CAP_DAC_OVERRIDE, exec the host's static ldconfig from its
               fd with an empty env. The hook's process bounds it in time.

Nothing is created anywhere but on the rootfs's own mounts (nvctk.mount.Root):
a target below a host directory bound read-write into the container (a volume,
extra-mounts, the MPS pipe dir) is skipped, or refused when required. The
worker dies with the hook's process (PR_SET_PDEATHSIG): runc's hook timeout
kills only the hook, and nothing the hook starts may outlive it.

Each step runs with exactly its capabilities effective (nvctk.caps) and logs
them at debug level. On any failure the worker detaches what it mounted and
the hook exits 1 with "nvctk-hook: step <name>: <path>: <why>" on stderr.

This runs in every GPU container's start, so it imports only os-level modules
and small nvctk modules that do the same (tests/test_prestart.py checks the
import profile): no json, re, typing, dataclasses, subprocess or signal. The
worker imports nothing once it is in the container's mount namespace (a lazy
import would be looked up through the container's view of the file system),
and becomes ldconfig itself rather than forking again.
"""

from __future__ import annotations

import _signal
import os
import select
import stat
import sys
import time

from nvctk import caps, jsonio
from nvctk import config as nvconfig
from nvctk import mount as m
from nvctk.errors import MountError, NvctkError, SpecError
from nvctk.log import Logger, open_log
from nvctk.oci import bundle_in_rootfs, load_spec_as_runc, load_state
from nvctk.plan import PLAN_FILE, Mount, Plan
from nvctk.record import Record

# typing is for the type checker only (the hook starts in every GPU container)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping
    from typing import IO, Any, Literal

PROC_DRIVER = "/proc/driver/nvidia"
# driver libraries whose absence fails the create: (file name prefix, capability)
REQUIRED = (("libcuda.so", "compute"), ("libnvidia-ml.so", "utility"))
ALL_STEPS = ("open", "setns", "propagation", "mount", "symlink", "proc-mask", "ldconfig-setup",
             "ldconfig", "undo", "done")
LDCONFIG_TIMEOUT = 30.0

# the worker's answer on its pipe: _OK, or _FAILED followed by the message
_OK = b"ok"
_FAILED = b"error\n"


# --- logging through an fd opened on the host --------------------------------------
class HookLog(Logger):
    """nvctk's log, written through an fd opened in the host namespace.

    The worker changes mount namespace and ldconfig chroots into the image: a
    log that re-opened its path would then write into the container. So the
    file is opened here, once, and never by path again.
    """

    def __init__(self, path: str, level: str = "info", prog: str = "nvctk-hook") -> None:
        super().__init__("", level, prog)
        if not path:
            return
        # never blocks (a FIFO log-file would hang the hook until runc's timeout)
        self.fd = open_log(path, make_dirs=True)


# --- inputs ---------------------------------------------------------------------------
def sanitize_environ(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Drop LD_* and PYTHON* from our own environment; returns the names dropped."""
    env = os.environ if env is None else env
    bad = [k for k in env if k.startswith(("LD_", "PYTHON"))]
    for k in bad:
        del env[k]
    return bad


class HookState(Record):
    # field order is the record's order (repr, to_dict): the OCI state's
    __slots__ = ("id", "pid", "bundle", "root", "annotations")  # noqa: RUF023

    def __init__(self, id: str, pid: int, bundle: str, root: str | None = None,
                 annotations: dict[str, str] | None = None) -> None:
        self.id = id
        self.pid = pid
        self.bundle = bundle
        self.root = root  # crun passes the rootfs; runc does not
        self.annotations = {} if annotations is None else annotations


def parse_state(text: str | bytes) -> HookState:
    st = load_state(text)
    root: Any = st.root
    if root is None:  # crun may send root as {"path": ...}; be lenient
        try:
            raw = jsonio.loads(text).get("root")
        except (ValueError, AttributeError):
            raw = None
        if isinstance(raw, dict) and isinstance(raw.get("path"), str):
            root = raw["path"]
    return HookState(st.id, st.pid, st.bundle, root or None, dict(st.annotations))


def rootfs_path(state: HookState, spec: dict[str, Any]) -> str:
    """The rootfs: crun's state.root, else the spec's root.path (maybe bundle-relative)."""
    path = state.root or (spec.get("root") or {}).get("path")
    if not isinstance(path, str) or not path:
        raise SpecError(f"{state.bundle}/config.json: root.path is missing")
    return os.path.normpath(os.path.join(state.bundle, path))


def load_plan(bundle: str, spec: dict[str, Any], config: nvconfig.Config, rootfs: str,
              container_id: str) -> Plan | None:
    """Read back <bundle>/nvctk-plan.json, else recompute it as the shim would have."""
    path = os.path.join(bundle, PLAN_FILE)
    try:
        data: bytes | None = m.read_bytes(path)
    except FileNotFoundError:
        data = None
    except OSError as e:
        raise MountError(f"step plan: {path}: {e.strerror}")
    if data is not None:
        try:
            return Plan.from_json(data.decode("utf-8"))
        except (ValueError, KeyError, TypeError) as e:
            raise MountError(f"step plan: {path}: unusable plan: {e}")
    from nvctk import planner  # NVML and driver discovery: only without a saved plan

    return planner.make_plan(spec, config, bundle=bundle, rootfs=rootfs,
                             container_id=container_id)


# --- helpers --------------------------------------------------------------------------
def elf_interpreter(fd: int) -> str | None:
    """PT_INTERP of an ELF file (None for a static binary); ValueError if not ELF64."""
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    order: Literal["little", "big"] = "little" if head[5] == 1 else "big"

    def word(buf: bytes, off: int, size: int) -> int:
        return int.from_bytes(buf[off:off + size], order)

    phoff, phentsize, phnum = word(head, 32, 8), word(head, 54, 2), min(word(head, 56, 2), 256)
    if not 40 <= phentsize <= 256:  # Elf64_Phdr is 56 bytes; we read up to p_filesz
        raise ValueError("not a 64-bit ELF file")
    table = os.pread(fd, phentsize * phnum, phoff)  # the program headers in one read
    for i in range(min(phnum, len(table) // phentsize)):
        ph = table[i * phentsize:(i + 1) * phentsize]
        if word(ph, 0, 4) == 3:  # PT_INTERP
            off, size = word(ph, 8, 8), word(ph, 32, 8)
            return os.pread(fd, min(size, 4096), off).rstrip(b"\0").decode("utf-8", "replace")
    return None


def required_for(mnt: Mount, plan: Plan) -> str | None:
    """The capability that makes this file mandatory, if any."""
    name = os.path.basename(mnt.host_path)
    for prefix, cap in REQUIRED:
        if name.startswith(prefix) and cap in plan.capabilities:
            return cap
    return None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class _Prepared(Record):
    """The fds the host-namespace step opens for the rest."""

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


# the host side of a vGPU container's state (nvctk.vgpu_state), below its own tmpfs:
# ro/ is mounted read-only at /run/nvctk, rw/ (the accounting dir) read-write over its
# placeholder ro/vgpu; the other names are files, or placeholders (mount points) for
# the files bound over them. Nothing the container can write backs a read-only bind.
VGPU_DIRS = ("ro", "rw")
VGPU_FILES = ("ro/limits", "ro/ld.so.preload", "rw/cache", "rw/limits")
# the directories below the rootfs that hold the vGPU mounts: pinned (rename fails)
VGPU_PINNED = ("etc", "run")
PRELOAD = "/etc/ld.so.preload"


def _is_own_tmpfs(path: str, st: os.stat_result) -> bool:
    """path (lstat st) is the root of a tmpfs: a file system apart from its parent's."""
    if os.lstat(os.path.dirname(path)).st_dev == st.st_dev:
        return False
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return m.fstatfs_type(fd) == m.TMPFS_MAGIC
    finally:
        os.close(fd)


def _vgpu_mounts(plan: Plan, log: HookLog) -> list[Mount]:
    """The vGPU mounts in their order (docs: the vGPU state layout): ro/ at /run/nvctk,
    libvgpu.so, rw/ at /run/nvctk/vgpu, ro/limits and rw/cache on their placeholders in
    it, ro/ld.so.preload over /etc/ld.so.preload. The shim made the state; a missing
    piece fails the hook (a container that sets a limit never runs uncapped)."""
    v = plan.vgpu
    if v is None:
        return []
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
    out = [
        Mount(ro, top, "dir", True, False),
        Mount(v.library, v.container_library, "file", True, False),
        Mount(rw, v.container_state_dir, "dir", False, True),
        Mount(os.path.join(ro, "limits"), os.path.join(v.container_state_dir, "limits"),
              "file", True, True),
        Mount(os.path.join(rw, "cache"), os.path.join(v.container_state_dir, "cache"),
              "file", False, True),
        Mount(os.path.join(ro, "ld.so.preload"), PRELOAD, "file", True, True),
    ]
    log.debug(f"vgpu: {len(out)} mounts for {v.library}, state {v.state_dir}")
    return out


# --- the worker -----------------------------------------------------------------------
def _prepare(plan: Plan, pid: int, log: HookLog) -> _Prepared:
    """Host-namespace work: clones of the sources, the mask, ldconfig and ns fds."""
    caps.enter_step("open", log)
    p = _Prepared()
    try:
        vgpu = _vgpu_mounts(plan, log)
        for i, mnt in enumerate((*plan.mounts, *vgpu)):
            if i == len(plan.mounts):
                p.vgpu_from = len(p.sources)
            try:
                fd = m.clone_source(mnt.host_path, m.attrs_for(mnt.read_only, mnt.noexec))
            except OSError as e:
                # open_tree first, lstat only when it failed: one syscall per file
                if os.path.lexists(mnt.host_path) or i >= len(plan.mounts):
                    raise m.step_error("open", mnt.host_path, e)
                cap = required_for(mnt, plan)
                if cap is not None:
                    raise MountError(
                        f"step open: {mnt.host_path}: required driver library is missing on the "
                        f"host ({os.path.basename(mnt.host_path)}, needed for '{cap}')"
                    )
                log.info(f"skip {mnt.container_path}: {mnt.host_path} is missing on the host")
                continue
            p.sources.append((mnt, fd))
        pm = plan.proc_mask
        if pm is not None:
            if os.path.isdir(pm.host_dir):
                try:
                    p.mask = m.make_proc_mask(pm.host_dir, pm.gpu_bus_ids)
                except OSError as e:
                    raise m.step_error("open", pm.host_dir, e)
            else:
                log.info(f"skip the {PROC_DRIVER} mask: {pm.host_dir} is missing on the host")
        if plan.ldconfig:
            what = f"{plan.ldconfig} (nvctk's ldconfig setting)"
            try:
                # O_NONBLOCK: a FIFO would block open() until runc's hook timeout
                p.ldconfig = os.open(plan.ldconfig, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
                                     | os.O_CLOEXEC)
                if not stat.S_ISREG(os.fstat(p.ldconfig).st_mode):
                    raise m.step_error("open", what, "not a regular file")
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
        p.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        nspath = f"/proc/{pid}/ns/mnt"
        try:
            p.ns = os.open(nspath, os.O_RDONLY | os.O_CLOEXEC)
            if os.fstat(p.ns).st_ino == os.stat("/proc/self/ns/mnt").st_ino:
                raise m.step_error("setns", nspath, "the container shares the host's mount "
                                   "namespace; refusing to mount into it")
        except OSError as e:
            raise m.step_error("setns", nspath, e)
        return p
    except BaseException:
        fds = p.fds()
        _close_all(fds)
        raise


def _detach_procfs_under(top: str, infos: list[m.MountInfo], log: HookLog) -> None:
    """In a private mount ns: detach every procfs mounted below the rootfs `top`."""
    for info in sorted(infos, key=lambda i: len(i.mount_point)):
        if info.fstype != "proc" or not (info.mount_point + "/").startswith(top + "/"):
            continue
        try:
            fd = m.openat2(m.AT_FDCWD, info.mount_point, os.O_PATH | os.O_DIRECTORY,
                           m.RESOLVE_NO_SYMLINKS | m.RESOLVE_NO_MAGICLINKS)
        except OSError:
            continue  # gone with an earlier detach
        try:
            if m.fstatfs_type(fd) == m.PROC_SUPER_MAGIC:
                m.umount2(f"/proc/self/fd/{fd}", m.MNT_DETACH)
                log.debug(f"ldconfig: detached procfs at {info.mount_point} (private ns)")
        finally:
            os.close(fd)


def _ldconfig_child(plan: Plan, rootfs: str, root_st: os.stat_result, ldfd: int, devnull: int,
                    out_w: int, log: HookLog) -> None:
    """Become the host's ldconfig run chrooted into the rootfs: never returns."""
    try:
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        caps.enter_step("ldconfig-setup", log)
        m.unshare(m.CLONE_NEWNS)
        m.mount_propagation("/", m.MS_REC | m.MS_PRIVATE)
        top = os.path.realpath(rootfs)
        infos = m.read_mountinfo()
        _detach_procfs_under(top, infos, log)
        # re-open the rootfs in this namespace (an fd from the old one would walk its mounts)
        rfd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(rfd)
        if (st.st_dev, st.st_ino) != (root_st.st_dev, root_st.st_ino):
            raise OSError(f"{rootfs} changed under the hook")
        # ldconfig writes its cache and links where the image's ld.so.conf says: never
        # through a host directory bound into the container (a volume, the MPS pipe dir)
        ro = m.readonly_foreign(infos, top, m.mount_id(rfd))
        if ro:
            log.debug("ldconfig: read-only in its namespace (not the container's rootfs): "
                      + ", ".join(p[len(top):] for p in ro))
        os.fchdir(rfd)
        os.chroot(".")
        os.chdir("/")
        os.close(rfd)
        caps.limit_to(caps.STEP_CAPS["ldconfig"])
        log.debug(f"caps step=ldconfig effective={','.join(caps.current()) or '-'}")
        os.execve(ldfd, ["ldconfig", plan.lib_dir], {})
    except BaseException as e:
        try:
            os.write(2, f"ldconfig setup: {e}\n".encode())
        finally:
            os._exit(127)


def _wait_ldconfig(plan: Plan, pid: int, out_r: int, log: Logger) -> None:
    """Collect ldconfig's output (closes out_r), kill it past LDCONFIG_TIMEOUT, reap
    it and log how it went: a failing ldconfig is a warning, never the hook's failure."""
    chunks = []
    deadline = time.monotonic() + LDCONFIG_TIMEOUT
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
    if timed_out:
        try:
            os.kill(pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    out = b"".join(chunks).decode("utf-8", "replace").strip()
    code = os.waitstatus_to_exitcode(status)
    if timed_out:
        out = f"killed after {LDCONFIG_TIMEOUT:g}s" + (f"; {out}" if out else "")
    if code != 0:
        # a read-only rootfs, or an image without a writable /etc: the libraries are
        # mounted all the same; programs that dlopen by SONAME may not find them
        log.warning(f"step ldconfig: {plan.lib_dir}: ldconfig exited {code}: {out or '-'}")
    else:
        log.info(f"ldconfig refreshed the container's cache ({plan.lib_dir})")
        if out:
            log.debug(f"ldconfig: {out}")


def _pin(root: m.Root, mounter: m.Mounter, log: HookLog) -> None:
    """Pin /etc and /run, which hold the vGPU mounts: renaming either (or a directory
    on the way to a vGPU mount) would take nvctk's mounts away from the paths
    ld.so and libvgpu read (the layout's step 1)."""
    for name in VGPU_PINNED:
        try:
            if root.pin(name, mounter):
                log.debug(f"pinned /{name} (a recursive bind onto itself)")
            else:
                log.debug(f"/{name} is a mount point already")
        except OSError as e:
            raise m.step_error("mount", f"/{name}", e)


def _mount_steps(plan: Plan, rootfs: str, prep: _Prepared, mounter: m.Mounter,
                 log: HookLog) -> m.Root:
    """setns to proc-mask; returns the rootfs (open, for ldconfig) once all are in."""
    caps.enter_step("setns", log)
    try:
        m.setns(prep.ns, m.CLONE_NEWNS)
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

        caps.enter_step("mount", log)
        if prep.vgpu_from >= 0:
            _pin(root, mounter, log)
        debug = log.enabled("debug")
        for i, (mnt, src) in enumerate(prep.sources):
            kind = "dir" if mnt.kind == "dir" else "file"
            vgpu = 0 <= prep.vgpu_from <= i
            try:
                # vGPU's mounts sit at exactly their paths: no link the container could
                # replace leads to them
                dest = (root.ensure_exact if vgpu else root.ensure)(mnt.container_path, kind)
            except m.NotOnRootfs as e:
                if vgpu or required_for(mnt, plan) is not None:
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
            if debug:
                log.debug(f"mounted {mnt.host_path} at {mnt.container_path}")
        if root.pins and plan.vgpu is not None and plan.vgpu.root_readonly:
            try:
                root.seal_pins()
            except OSError as e:
                raise m.step_error("mount", "/etc, /run", e)

        caps.enter_step("symlink", log)
        for link in plan.symlinks:
            try:
                if not root.symlink(link.container_path, link.target):
                    log.info(f"skip link {link.container_path}: the image has a file there")
            except m.NotOnRootfs as e:
                log.info(f"skip link {link.container_path}: {e.strerror}")
            except OSError as e:
                raise m.step_error("symlink", link.container_path, e)

        if prep.mask >= 0:
            caps.enter_step("proc-mask", log)
            try:
                dest = root.open(PROC_DRIVER, os.O_PATH | os.O_DIRECTORY)
            except FileNotFoundError:
                dest = -1
                log.info(f"skip the {PROC_DRIVER} mask: the container has no {PROC_DRIVER}")
            except OSError as e:
                raise m.step_error("proc-mask", PROC_DRIVER, e)
            if dest >= 0:
                try:
                    mounter.attach(prep.mask, dest, PROC_DRIVER)
                except OSError as e:
                    raise m.step_error("proc-mask", PROC_DRIVER, e)
                finally:
                    os.close(dest)
                log.debug(f"masked {PROC_DRIVER}")
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


def _answer(fd: int, err: str | None) -> None:
    """The worker's answer to the hook's process; closes fd."""
    try:
        data = _OK if err is None else _FAILED + err.encode("utf-8", "replace")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def worker(plan: Plan, rootfs: str, pid: int, log: HookLog, answer: int,
           ldconfig_out: int) -> int:
    """The forked worker: every step, then its answer on `answer` (closed then).

    Once the mounts are in and answered for, a worker with ldconfig to run
    becomes that ldconfig (its output on ldconfig_out), so this returns only
    on failure or without ldconfig: the exit code.
    """
    mounter = m.Mounter()
    prep: _Prepared | None = None
    root: m.Root | None = None
    try:
        try:
            caps.restrict(caps.needed(ALL_STEPS), log)
            prep = _prepare(plan, pid, log)
            root = _mount_steps(plan, rootfs, prep, mounter, log)
            mounter.forget()
        except BaseException as e:
            _answer(answer, _failed(e, mounter, log))
            return 1
        if prep.ldconfig < 0:
            caps.enter_step("done", log)
            _answer(answer, None)
            return 0
        root_st = os.fstat(root.fd)
        _answer(answer, None)
        # nothing below can undo the mounts: ldconfig failing is a warning
        _ldconfig_child(plan, root.path, root_st, prep.ldconfig, prep.devnull, ldconfig_out,
                        log)
        return 127  # not reached: _ldconfig_child execs or exits
    finally:
        if root is not None:
            root.close()
        if prep is not None:
            _close_all(prep.fds())


def apply_plan(plan: Plan, rootfs: str, pid: int, log: HookLog,
               drop_parent_caps: bool = False) -> None:
    """Run the worker in a forked child; MountError with its message on failure.

    drop_parent_caps: the calling process gives up every capability once the
    worker is forked (the hook's main process needs none afterwards).
    """
    caps.warm_up()
    r, w = os.pipe()
    out_r, out_w = os.pipe() if plan.ldconfig else (-1, -1)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            # nothing the hook starts outlives it: killed (runc's hook timeout) or not,
            # its worker and the ldconfig it becomes go with it
            caps.die_with_parent(parent)
            os.close(r)
            if out_r >= 0:
                os.close(out_r)
            code = worker(plan, rootfs, pid, log, w, out_w)
        finally:
            os._exit(code)
    os.close(w)
    if out_w >= 0:
        os.close(out_w)
    if drop_parent_caps:
        caps.drop_all()
    try:
        data = m.read_fd(r)
    finally:
        os.close(r)
    if data == _OK:
        err = None
    elif data.startswith(_FAILED):
        err = data[len(_FAILED):].decode("utf-8", "replace")
    else:
        err = "worker gave a garbled answer" if data else "worker gave no answer"
    if err is None and out_r >= 0:
        _wait_ldconfig(plan, child, out_r, log)  # the worker is ldconfig now
        # the worker's caps went with its exec: what is left of the hook is this process
        log.debug(f"caps step=done effective={','.join(caps.current()) or '-'}")
        return
    if out_r >= 0:
        os.close(out_r)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and err is None:
        err = f"worker exited {code}"
    if err is not None:
        raise MountError(err)


def prestart(stdin_text: str | bytes, log_override: HookLog | None = None,
             drop_parent_caps: bool = False) -> None:
    """The whole hook minus process-level concerns (env, exit codes)."""
    state = parse_state(stdin_text)
    config = nvconfig.load()
    log = log_override or HookLog(config.log_file, config.log_level)
    try:
        log.debug(f"prestart id={state.id} pid={state.pid} bundle={state.bundle}")
        if state.pid <= 0:
            raise SpecError(f"hook state on stdin: container {state.id} has no pid")
        try:
            spec = load_spec_as_runc(state.bundle)
        except SpecError as e:
            if not os.path.lexists(os.path.join(state.bundle, PLAN_FILE)):
                # the runtime wrapper handed an unreadable spec on: it saw no GPU
                log.warning(f"{state.id}: {e}; no {PLAN_FILE}: no GPU asked for, nothing to do")
                return
            raise
        rootfs = rootfs_path(state, spec)
        if bundle_in_rootfs(state.bundle, rootfs):
            # the container's own files would be the plan naming host paths to mount
            raise SpecError(f"rootfs {rootfs} contains the bundle {state.bundle}: refusing to "
                            f"trust {PLAN_FILE} there")
        plan = load_plan(state.bundle, spec, config, rootfs, state.id)
        if plan is None:
            log.info(f"{state.id}: no GPU requested; nothing to do")
            return
        if plan.vgpu is not None and (spec.get("root") or {}).get("readonly") is True:
            plan.vgpu.root_readonly = True
        apply_plan(plan, rootfs, state.pid, log, drop_parent_caps)
        log.info(f"{state.id}: prestart done ({len(plan.mounts)} mounts, rootfs {rootfs})")
    except NvctkError as e:
        log.error(f"{state.id}: {e}")
        raise
    finally:
        if log_override is None:
            log.close()


def main(stdin: IO[bytes] | None = None, stderr: IO[str] | None = None) -> int:
    sanitize_environ()
    err = stderr or sys.stderr
    try:
        data = (stdin or sys.stdin.buffer).read()
        prestart(data, drop_parent_caps=True)
        return 0
    except NvctkError as e:
        err.write(f"nvctk-hook: {e}\n")
        err.flush()
        return 1
    except Exception as e:  # a bug: still a clear, non-zero failure
        err.write(f"nvctk-hook: internal error: {e!r}\n")
        err.flush()
        return 1
