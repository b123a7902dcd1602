"""Processes tests start: a runtime whose children outlive it; the ones a test left running;
the fds this one holds; a function run in a forked child in a private mount namespace."""

from __future__ import annotations

import gc
import os
import subprocess
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nvctk.base import mounts


def run_to_files(argv: list[str], env: dict[str, str], out_dir: Path,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """argv with its stdout and stderr in files under out_dir, read back: files, not
    pipes, because a created container's init holds runc's stdio open (a pipe would
    never reach EOF)."""
    with open(out_dir / "out.txt", "w+") as out, open(out_dir / "err.txt", "w+") as err:
        r = subprocess.run(argv, env=env, stdout=out, stderr=err, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(r.args, r.returncode, out.read(), err.read())


def kill_left(procs: Iterable[subprocess.Popen[Any]], timeout: float = 30) -> None:
    """SIGKILL and reap each of procs that still runs (a fixture's teardown)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout)


def open_fds() -> set[tuple[str, str]]:
    """This process's open fds, each with what it refers to: a leak check compares which
    are open, not how many. Garbage of earlier tests (a channel, a file) is collected
    first: its fds closing meanwhile is no leak."""
    gc.collect()
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # the listing's own fd, closed by now
    return out


def in_private_ns(fn: Callable[[], None]) -> None:
    """Run fn in a forked child inside a new private mount namespace."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            mounts.unshare(mounts.CLONE_NEWNS)
            mounts.mount_propagation("/", mounts.MS_REC | mounts.MS_PRIVATE)
            fn()
        except BaseException:
            os.write(w, traceback.format_exc().encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
