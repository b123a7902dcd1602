"""nvctk-runtime's create becoming runc: exec'd, with this create's prestart server
beside it (become_runc), or, for a create that made vGPU state, run as a child whose
failure removes that state (create_and_clean_up)."""

from __future__ import annotations

import os

from nvctk.base.errors import NvctkError
from nvctk.base.log import exit_now
from nvctk.oci import runc_argv as ra

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from nvctk.base.config import Config
    from nvctk.base.log import Logger


def become_runc(runtime: str, args: ra.RuncArgs, bundle: str, served: str | None,
                 fail: Callable[[str], int], logger: Logger) -> int:
    """Exec runc, this create's prestart server (served: its token) forked beside it
    first; returns only when the exec fails."""
    if served is not None:
        # start time: GPU creates only (nvctk._sys is a dlopen); a no-GPU create loads neither
        from nvctk.hook.served import serve_beside

        # the hook of the runc this process becomes; a `create` (returns once the
        # container exists) may keep its server as a child, a foreground `run` may not
        serve_beside(served, logger, bundle, grandchild=args.subcommand != "create")
    try:
        ra.exec_runtime(runtime, args.argv)
    except OSError as e:
        return fail(f"cannot exec {runtime}: {e.strerror}")
    return 1  # not reached


# what a supervisor sends its runtime to stop or tell it something: passed on to runc
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_PR_SET_PDEATHSIG = 1


def create_and_clean_up(runtime: str, args: ra.RuncArgs, bundle: str, vgpu_dir: str,
                         config: Config, fail: Callable[[str], int], logger: Logger,
                         served: str | None = None) -> int:
    """Run `runtime create` (or `run`) as a child, not by exec, and remove the vGPU state
    this create made when it fails (a run: when no container is left); exit with its
    status (128+N: killed by signal N).
    Returns only when the child cannot be started.

    runc gets everything an exec would give it (argv, environment, stdio and the
    --preserve-fds descriptors: every inheritable fd), and dies with this process
    (PR_SET_PDEATHSIG): a supervisor that kills the runtime kills runc. What a
    SIGKILL of this process leaves is reclaimed by vgpu_state.collect. served: the
    token of this create's prestart server, started beside runc (served.serve_beside) for
    `bundle` (args.bundle_dir(), as prepared).
    """
    import signal

    sigs = [getattr(signal, n) for n in FORWARDED_SIGNALS]
    parent = os.getpid()
    child = 0

    def forward(signum: int, _frame: object) -> None:
        if child > 0:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    # blocked until the child's pid is known: a signal in between is forwarded, not lost
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    old = {s: signal.signal(s, forward) for s in sigs}

    def start_runc() -> int:
        return _fork_runc(runtime, args, fail, parent, old, old_mask)

    try:
        # beside runc, the server serves that runc's hook
        if served is not None:
            from nvctk.hook.served import serve_beside

            pid = serve_beside(served, logger, bundle, start_runc)
        else:
            pid = start_runc()
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _remove_own_vgpu_dir(vgpu_dir, config, logger)
        return fail(f"cannot start {runtime}: {e.strerror}")
    assert pid is not None
    child = pid
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # pending ones are forwarded now
    _, status = os.waitpid(pid, 0)  # a forwarded signal interrupts it; Python resumes it
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        code = 128 - code
    _clean_up_after(code, args, vgpu_dir, config, logger)
    # like the exec it stands for, this ends the process: the interpreter's teardown
    # would slow every vGPU create (the log is written unbuffered)
    exit_now(code)


def _clean_up_after(code: int, args: ra.RuncArgs, vgpu_dir: str, config: Config,
                    logger: Logger) -> None:
    """The vGPU state this create made removed when runc exited `code` and left no
    container."""
    if code != 0 and args.subcommand != "run":
        _remove_own_vgpu_dir(vgpu_dir, config, logger)
    elif args.subcommand == "run":
        # `run` exits with the container's status, and a failed run leaves no container;
        # a container that is still there (--detach, --keep) keeps its state for the
        # poststop of its delete
        from nvctk.vgpu.gc import runtime_has

        if args.container_id is None or not runtime_has(args.root, args.container_id):
            _remove_own_vgpu_dir(vgpu_dir, config, logger)


def _fork_runc(runtime: str, args: ra.RuncArgs, fail: Callable[[str], int], parent: int,
               old: dict[Any, Any], old_mask: set[Any]) -> int:
    """runc (`runtime` with args.argv) as this process's child, dying with `parent`, its
    signal handlers and mask as an exec from here would leave them (old, old_mask:
    those before create_and_clean_up changed them); its pid."""
    import signal

    from nvctk import _sys

    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 127
        try:
            _sys.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(128 + signal.SIGKILL)
            for s, h in old.items():  # as an exec from here would leave them
                signal.signal(s, signal.SIG_IGN if h == signal.SIG_IGN else signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            ra.exec_runtime(runtime, args.argv)
        except OSError as e:
            code = fail(f"cannot exec {runtime}: {e.strerror}")
        finally:
            os._exit(code)
    return pid


def _remove_own_vgpu_dir(path: str, config: Config, logger: Logger) -> None:
    """A failed create's clean-up; the runtime's failure is what gets reported."""
    from nvctk.vgpu import state as vgpu_state

    try:
        vgpu_state.remove_if_owner(path, config)
    except (OSError, NvctkError) as e:
        logger.warning(f"vGPU state {path}: not removed after the failed create ({e}); "
                       "the next vGPU create or `nvctk vgpu gc` reclaims it")
