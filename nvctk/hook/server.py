"""The prestart's server: a fork of nvctk-runtime that runs the prestart for its runc's
hook (nvctk.hook.served has the whole exchange and starts it).

    serve_prestart  while runc starts: the bundle's prestart made ready
                    (nvctk.hook.prestart.ready: inputs read, worker and ldconfig
                    forked); then serve; then what was not used released
    serve           wait for the one connection of a root child of this create's runc
                    (SO_PEERCRED, its parent in /proc), answer it SERVED_ANSWER
                    (nvctk.hook.messages); others are closed unanswered, and their
                    launcher runs the prestart itself; the end of the runtime (a pidfd)
                    ends the wait

Imported only in the fork (nvctk.hook.served.start), never on the runtime's own path to
exec runc. Its accept and peer checks go through a Procs (nvctk.hook.procs), which the
unit tests replace (tests/unit/test_hook_serve.py).
"""

from __future__ import annotations

import os
import select

from nvctk.base.fileio import MAX_HOOK_STATE, TooLarge, read_all, write_all
from nvctk.hook.messages import encode_served_answer
from nvctk.hook.prestart import answer, ready
from nvctk.hook.procs import PROCS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from nvctk.hook.procs import Procs


def is_runc_child(parent: int, uid: int, runtime: int, runc: int | None) -> bool:
    """The peer (its parent's pid, its uid) is a root child of this create's runc:
    `runc` itself, or (runc None) the runtime process, which became runc by exec."""
    return uid == 0 and parent == (runtime if runc is None else runc)


def serve(listener: int, runtime: int, runc: int | None,
          prestart: Callable[[bytes], tuple[int, str]], watch: int | None = None,
          procs: Procs | None = None) -> None:
    """In the forked server: answer the first connection of a root child of runc with
    prestart(state) -> (exit code, stderr text), as SERVED_ANSWER
    (nvctk.hook.messages); others are closed unanswered (their launcher runs the
    prestart itself). runtime: the process that forked the server; runc: its pid when
    it is not the runtime itself (a vGPU create, where the runtime waits on it). watch:
    a pidfd of the runtime; the server returns once it ends. procs: the kernel's
    (nvctk.hook.procs; the unit tests give their own peers)."""
    procs = PROCS if procs is None else procs

    poller = select.poll()
    poller.register(listener, select.POLLIN)
    if watch is not None:
        poller.register(watch, select.POLLIN)
    while True:
        if watch is not None:
            ready = {fd for fd, _ in poller.poll()}
            if watch in ready:
                return  # the runtime (or the runc it became) ended: no hook will come
            if listener not in ready:
                continue
        try:
            conn, pid, uid = procs.accept_peer(listener)
        except InterruptedError:
            continue
        if not is_runc_child(procs.parent_of(pid), uid, runtime, runc):
            os.close(conn)
            continue
        try:
            try:
                code, text = prestart(read_all(conn, MAX_HOOK_STATE))
            except TooLarge:
                code, text = 1, f"nvctk-hook: prestart: state larger than {MAX_HOOK_STATE} bytes\n"
            write_all(conn, encode_served_answer(code, text))
        finally:
            os.close(conn)
        return


def serve_prestart(listener: int, runtime: int, runc: int | None, bundle: str,
                   watch: int | None = None) -> None:
    """The server's life, in the fork (nvctk.hook.served.start): the prestart made ready
    for `bundle`, then served (serve)."""
    prepared = ready(bundle)
    try:
        serve(listener, runtime, runc, lambda state: answer(state, prepared), watch)
    finally:
        if prepared is not None:
            prepared.release()
