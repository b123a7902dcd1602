"""The process calls of the prestart's choreography, behind one object tests replace.

nvctk.hook.children (forks the worker and the ldconfig child, reaps or kills them) and
nvctk.hook.server's serve (accepts the launcher, checks that it is runc's child) make
these calls through a Procs, by default the kernel's (os, nvctk._sys). The unit tests
(tests/unit/test_hook_children.py, test_hook_serve.py) give them one whose fork fails,
whose peer is anyone, so that the failure paths run without root; the children they
fork there are real processes running stand-in roles.
"""

from __future__ import annotations

import os

from nvctk import _sys
from nvctk.hook import caps

# SIGKILL's number on every Linux architecture (signal(7)): the signal module would cost
# the hook enum's import
SIGKILL = 9


def parent_of(pid: int) -> int:
    """pid's parent (its /proc status); -1 when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"PPid:"):
                    return int(line[5:])
    except (OSError, ValueError):
        pass
    return -1


class Procs:
    """fork, wait, kill and the peer checks, as the prestart's processes make them."""

    def fork(self) -> int:
        return os.fork()

    def die_with_parent(self, parent: int) -> None:
        """In a child: SIGKILL once `parent` dies (nothing the hook starts outlives it)."""
        caps.die_with_parent(parent)

    def wait(self, pid: int) -> int:
        """Reap child `pid`; its wait status."""
        return os.waitpid(pid, 0)[1]

    def kill(self, pid: int) -> int:
        """SIGKILL child `pid` (gone already: no matter) and reap it; its wait status."""
        try:
            os.kill(pid, SIGKILL)
        except ProcessLookupError:
            pass
        return self.wait(pid)

    def accept_peer(self, listener: int) -> tuple[int, int, int]:
        """The next connection on `listener`: (fd, the peer's pid, its uid)."""
        return _sys.accept_peer(listener)

    def parent_of(self, pid: int) -> int:
        return parent_of(pid)


PROCS = Procs()
