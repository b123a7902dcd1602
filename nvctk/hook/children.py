"""The hook's side of the prestart's work: fork the worker and the ldconfig child, hand
them the container's pid, collect their answers.

    start      fork the worker (nvctk.hook.worker) and, where the form runs ldconfig,
               the ldconfig child (nvctk.hook.ldconfig) beside it, with the pipes
               between them (nvctk.hook.messages has what each carries); each opens
               what it needs on the host and waits for the pid. A served prestart
               does this while runc starts (nvctk.hook.prestart.ready)
    go         send the pid, wait for the worker's answer (bounded by the hook's
               deadline), then for ldconfig (bounded by its LDCONFIG_TIMEOUT and that
               deadline); MountError with the worker's message when it failed
    cancel     end both unused (EOF on the pid pipe: they mount nothing) and reap them

Both children die with the process that forked them (PR_SET_PDEATHSIG): runc's hook
timeout kills only the hook, and nothing the hook starts may outlive it. The forks,
waits and kills go through a Procs (nvctk.hook.procs) and the children's work through
Roles, which the unit tests replace (tests/unit/test_hook_children.py).
"""

from __future__ import annotations

import os
import select
import time

from nvctk.base.errors import MountError
from nvctk.base.record import Record
from nvctk.hook import caps, ldconfig, worker
from nvctk.hook.messages import (
    ANSWER_LIMIT,
    Channel,
    MessageError,
    NoAnswer,
    decode_answer,
    decode_output,
    encode_pid,
    pipe,
)
from nvctk.hook.procs import PROCS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from nvctk.base.log import HookLog, Logger
    from nvctk.edits import Edits
    from nvctk.hook.procs import Procs


class Roles(Record):
    """What the two children run (each returns its exit code):
    worker(edits, rootfs, log, pid, answer, libraries, set_up) and
    ldconfig(edits, rootfs, log, libraries, out); the channels are the ends of their
    pipes (nvctk.hook.messages), out the fd of ldconfig's output."""

    __slots__ = ("worker", "ldconfig")  # noqa: RUF023

    def __init__(self, worker: Callable[..., int], ldconfig: Callable[..., int]) -> None:
        self.worker = worker
        self.ldconfig = ldconfig


ROLES = Roles(worker.worker, ldconfig.ldconfig_child)


def _fork(procs: Procs, parent: int, run: Callable[[], int], child_closes: list[Channel],
          parent_closes: list[Channel]) -> int:
    """A child that closes `child_closes`, runs `run` and exits with its code, dying with
    `parent`. The caller's `parent_closes` are closed once it is forked (or failed to
    be)."""
    child = -1
    try:
        child = procs.fork()
        if child == 0:
            code = 1
            try:
                procs.die_with_parent(parent)
                for ch in child_closes:
                    ch.close()
                code = run()
            finally:
                os._exit(code)
    finally:
        if child != 0:
            for ch in parent_closes:
                ch.close()
    return child


def _pipes(n: int, of: int) -> list[Channel]:
    """n pipes' ends, reader then writer, then closed ends up to `of` pipes; when one
    cannot be made (OSError), none is left open."""
    ends: list[Channel] = []
    try:
        for _ in range(n):
            ends.extend(pipe())
    except BaseException:
        for ch in ends:
            ch.close()
        raise
    return ends + [Channel() for _ in range(2 * (of - n))]


class Children(Record):
    """The worker and the ldconfig beside it, forked (`start`) before the container's pid
    is needed: each has opened what the host side needs and waits. `go` hands them the
    pid and waits for the work; `cancel` ends them unused. Each is used once."""

    __slots__ = ("worker", "ldconfig", "pid_w", "answer_r", "out_r", "procs")  # noqa: RUF023

    def __init__(self, worker: int, ldconfig: int, pid_w: Channel, answer_r: Channel,
                 out_r: Channel, procs: Procs = PROCS) -> None:
        self.worker = worker
        self.ldconfig = ldconfig  # -1: the form runs no ldconfig
        self.pid_w = pid_w
        self.answer_r = answer_r
        self.out_r = out_r
        self.procs = procs

    def go(self, edits: Edits, pid: int, log: HookLog, drop_parent_caps: bool = False,
           deadline: float | None = None) -> None:
        """The work on container `pid`; MountError with the worker's message on failure
        (ldconfig is then stopped). drop_parent_caps, deadline: see apply_edits (a
        worker with no answer by the deadline is killed)."""
        try:
            self.pid_w.send(encode_pid(pid))
        except OSError:
            pass  # the worker is gone: its answer (none) says so
        if drop_parent_caps:
            caps.drop_all()
        err = self._answer(deadline)
        if self.ldconfig > 0:
            if err is None:
                wait_ldconfig(edits, self.ldconfig, self.out_r, log, deadline, self.procs)
                # the children's caps went with them: what is left of the hook is this process
                log.debug(f"caps step=done effective={','.join(caps.current()) or '-'}")
            else:
                self.out_r.close()
                self.procs.kill(self.ldconfig)
        if err is not None:
            raise MountError(err)

    def _answer(self, deadline: float | None) -> str | None:
        """The worker's answer, once it has ended (reaped; killed when silent past the
        deadline): None, done, or why not."""
        try:
            err = decode_answer(self.answer_r.recv(ANSWER_LIMIT, deadline))
        except NoAnswer:
            self.procs.kill(self.worker)
            return "worker gave no answer by the hook's deadline (runc's hook timeout): killed"
        except (MessageError, OSError) as e:  # OSError: TooLarge
            err = f"{e}"
        code = os.waitstatus_to_exitcode(self.procs.wait(self.worker))
        if code != 0 and err is None:
            err = f"worker exited {code}"
        return err

    def cancel(self) -> None:
        """End both unused (no pid: they exit having mounted nothing) and reap them."""
        for ch in (self.pid_w, self.answer_r, self.out_r):
            ch.close()
        self.procs.wait(self.worker)
        if self.ldconfig > 0:
            self.procs.wait(self.ldconfig)


def start(edits: Edits, rootfs: str, log: HookLog, procs: Procs = PROCS,
          roles: Roles = ROLES) -> Children:
    """Fork the worker, and ldconfig beside it, for `edits`; they die with this process.
    OSError when either cannot be forked, leaving no child and no pipe behind."""
    caps.warm_up()
    parent = os.getpid()
    # the libraries, set-up and output pipes only with ldconfig; the set-up pipe's EOF
    # comes once the ldconfig child, which alone holds set_w, execs or ends
    (answer_r, answer_w, pid_r, pid_w, libs_r, libs_w, set_r, set_w, out_r,
     out_w) = _pipes(5 if edits.ldconfig else 2, 5)
    try:
        child = _fork(procs, parent,
                      lambda: roles.worker(edits, rootfs, log, pid_r, answer_w, libs_w, set_r),
                      [answer_r, libs_r, pid_w, set_w, out_r, out_w],
                      [answer_w, libs_w, pid_r, set_r])
    except BaseException:
        for ch in (answer_r, pid_w, libs_r, set_w, out_r, out_w):
            ch.close()
        raise
    children = Children(child, -1, pid_w, answer_r, out_r, procs)
    if edits.ldconfig:
        try:
            children.ldconfig = _fork(
                procs, parent, lambda: roles.ldconfig(edits, rootfs, log, libs_r, out_w.fd),
                [answer_r, out_r, pid_w], [out_w, libs_r, set_w])
        except BaseException:
            children.cancel()  # the worker, unused, ends with its pid pipe
            raise
    return children


def wait_ldconfig(edits: Edits, pid: int, out_r: Channel, log: Logger,
                  hook_deadline: float | None = None, procs: Procs = PROCS) -> None:
    """Collect ldconfig's output (closes out_r), kill it past its LDCONFIG_TIMEOUT or at the
    hook's own deadline (time.monotonic), whichever comes first, reap it and log how it
    went: a failing ldconfig is a warning, never the hook's failure (past the hook's
    deadline runc has failed the container already: nothing of the hook outlives it)."""
    chunks: list[bytes] = []
    limit = ldconfig.LDCONFIG_TIMEOUT
    deadline = time.monotonic() + limit
    if hook_deadline is not None and hook_deadline < deadline:
        deadline = hook_deadline
    timed_out = False
    try:
        # never wait on the image for ever: an /etc/ld.so.conf that is a FIFO (or
        # names one) blocks ldconfig without a byte of output
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out_r.fd], [], [], left)[0]:
                timed_out = True
                break
            chunk = os.read(out_r.fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        out_r.close()
    status = procs.kill(pid) if timed_out else procs.wait(pid)
    out = decode_output(chunks)
    code = os.waitstatus_to_exitcode(status)
    if timed_out:
        out = ("killed at the hook's deadline (runc's hook timeout)" if deadline == hook_deadline
               else f"killed after {limit:g}s") + (f"; {out}" if out else "")
    if code != 0:
        # a read-only rootfs, or an image without a writable /etc: the libraries are
        # mounted all the same; programs that dlopen by SONAME may not find them
        log.warning(f"step ldconfig: {edits.lib_dir}: ldconfig exited {code}: {out or '-'}")
    else:
        log.info(f"ldconfig refreshed the container's cache ({edits.lib_dir})")
        if out:
            log.debug(f"ldconfig: {out}")


def apply_edits(edits: Edits, rootfs: str, pid: int, log: HookLog,
                drop_parent_caps: bool = False, deadline: float | None = None) -> None:
    """Run the worker, and ldconfig beside it, in forked children on container `pid`;
    MountError with the worker's message on failure (ldconfig is then stopped).

    drop_parent_caps: the calling process gives up every capability once the
    children have the pid (the hook's main process needs none afterwards).
    deadline: when runc gives up on the hook (time.monotonic; None: no timeout):
    ldconfig is stopped there at the latest, also where the hook's own process is not
    the one runc kills (nvctk-runtime's server), and a worker silent until then killed.
    """
    start(edits, rootfs, log).go(edits, pid, log, drop_parent_caps, deadline)
