"""The prestart hook, served by the nvctk-runtime that created the container.

Run by itself, `nvctk-hook prestart` starts a second Python interpreter in every GPU
container's start, and that start and its imports are half of the hook's time. So
nvctk-runtime's create serves it:

    nvctk-runtime  writes the spec with the hook `nvctk-hook prestart --served TOKEN`,
                   listens on the abstract unix socket TOKEN names, forks the server,
                   then execs runc as always (or starts it, for a vGPU create)
    the server     nvctk.hook.server, in the fork: while runc starts, imports the prestart,
                   reads the bundle's inputs and forks the worker and ldconfig, which
                   open the host side (nvctk.hook.prestart.ready); then waits for one
                   connection
    runc           runs the hook: nvctk-hook's launcher (hooks/nvctk-hook.c) connects
                   and passes its stdin on, the OCI state
    the server     runs the very prestart the hook would (nvctk.hook.prestart: inputs,
                   checks, errors and log alike; the inputs read before stand only while
                   the bundle's files are byte for byte what was read) and answers with
                   the exit code and the text for stderr, then exits
    the launcher   writes that text to stderr and exits with that code

Both ends check the other with the kernel's SO_PEERCRED: the server answers only root
processes whose parent is its runc (the server's parent, when the runtime became runc
by exec, or a child of its parent, when the runtime started runc beside it); the
launcher talks only to a socket root made in its runc or in runc's parent (for a
listening socket SO_PEERCRED names the process that listened: the runtime, which
became runc or started it). A name someone else holds, no server (runc failed before
the hook: the server ends with its runtime), a check that fails: the launcher runs the
Python prestart itself, which does the same work. The name is 128 random bits, made
anew for every create.

This module is the runtime's side: the socket, and the server forked in the process
shape the create needs (serve_beside, start; nvctk.runtime.create picks the shape):

    create              the runtime execs runc; the server is its child, so runc's,
                        handed on to the reaper when `runc create` returns
    run (foreground)    the server a grandchild, reaped by the init or the node's
                        subreaper: `runc run` never waits on a child it did not start
    vGPU create or run  the runtime starts runc as its child and waits on it (to remove
                        the vGPU state when runc fails); the server a grandchild
    no pidfds (< 5.3)   the server a child that dies with the runtime (PDEATHSIG)

The server's own loop is nvctk.hook.server, imported only in the fork.
docs/architecture.md has every process of a create and its messages.
"""

from __future__ import annotations

import os

from nvctk import _sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from nvctk.base.log import Logger

# the abstract socket's name: this prefix, then the token (hooks/nvctk-hook.c has both)
NAME_PREFIX = b"nvctk-prestart-"
_FD_LIMIT = 1 << 30  # closerange's end: close_range(2) takes any bound
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def listen(token: str) -> int:
    """The server's listening socket (close-on-exec: runc never holds it); OSError when
    the name is taken."""
    return _sys.listen_abstract(NAME_PREFIX + token.encode())


def serve_beside(token: str, logger: Logger, bundle: str,
                 start_runc: Callable[[], int] | None = None,
                 grandchild: bool = True) -> int | None:
    """Serve a create's prestart hook, in either process shape (nvctk.runtime.create
    calls this): listen on the token's socket, then start runc as this process's child
    (start_runc, which returns its pid; a vGPU create) or leave it to the exec that
    follows (None), then fork the server beside it (grandchild: see start). Returns
    runc's pid (None: the exec's). Listening comes first: the socket is there before
    runc can run the hook. No socket: the hook runs by itself. bundle: the container's
    (the server makes its prestart ready while runc starts)."""
    try:
        listener = listen(token)
    except OSError as e:
        logger.warning(f"the prestart hook runs by itself: no server socket ({e})")
        listener = -1
    try:
        runc = start_runc() if start_runc is not None else None
        if listener >= 0:
            start(listener, runc, grandchild, bundle)
    finally:
        if listener >= 0:
            os.close(listener)  # the server holds its own; runc never held it (cloexec)
    return runc


def start(listener: int, runc: int | None, grandchild: bool, bundle: str) -> int:
    """Start the server (nvctk.hook.server: serve nvctk.hook.prestart.answer, then
    exit); returns the pid of the process that forked it, already reaped (grandchild),
    or the server's.
    bundle: the container's, whose prestart the server makes ready before runc runs
    the hook.

    grandchild: the runtime forks a child that forks the server and exits at once,
    and reaps that child here. Nothing of the server is then left for the runtime to
    wait on, or for the runc it becomes, which never waits on a child it did not start
    (a foreground `run` kept a defunct server for the container's life); the init (or
    the node's subreaper: the shim, systemd) reaps it. Else the server is this
    process's child: for a `create` that becomes runc, which returns once the container
    exists (its hook done, the server ended) and whose end hands the server on to that
    reaper, as the grandchild is; it saves the start the second fork and the wait for
    it (~1-2 ms a GPU create). The server ends with this process, whatever it becomes,
    runc or the runtime that waits on it (a pidfd of it, which an exec leaves open and
    its end makes readable); holds none of its stdio or other fds, and never returns
    into the caller's code."""
    runtime = os.getpid()
    try:
        watch = os.pidfd_open(runtime)  # close-on-exec: runc never holds it
    except (OSError, AttributeError):
        return _start_child(listener, runtime, runc, bundle)  # a kernel before 5.3
    try:
        pid = os.fork()
    except BaseException:
        os.close(watch)
        raise
    if pid:
        os.close(watch)
        if grandchild:
            os.waitpid(pid, 0)  # it only forks the server: at once
        return pid
    code = 0
    try:
        if grandchild and os.fork():
            os._exit(0)
        _detach(listener, watch)
        _serve_in_fork(listener, runtime, runc, bundle, watch)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _serve_in_fork(listener: int, runtime: int, runc: int | None, bundle: str,
                   watch: int | None = None) -> None:
    # start time: the server's modules are imported here, in the fork, while runc
    # starts: never on the runtime's own path to exec runc
    from nvctk.hook.server import serve_prestart

    serve_prestart(listener, runtime, runc, bundle, watch)


def _detach(*keep: int) -> None:
    """In the server: stdio to /dev/null, every other fd but `keep` closed (runc's pipes,
    its console socket, --preserve-fds: the server holds none of them)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _FD_LIMIT)


def _start_child(listener: int, runtime: int, runc: int | None, bundle: str) -> int:
    """Without pidfds: the server as a child that dies with this process
    (PR_SET_PDEATHSIG), reaped only when this process ends."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        _sys.prctl(_PR_SET_PDEATHSIG, _SIGKILL)
        if os.getppid() != runtime:  # the runtime ended before prctl took effect
            os._exit(0)
        _detach(listener)
        _serve_in_fork(listener, runtime, runc, bundle)
    except BaseException:
        code = 1
    finally:
        os._exit(code)
