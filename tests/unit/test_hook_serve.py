"""The prestart server's loop without root (nvctk.hook.server.serve): its peers come from
a stand-in Procs over socket pairs, so who is answered (a root child of this create's
runc, once) and who is closed unanswered, and the end with the runtime, are checked
without a runc or a launcher (tests/integration/test_hook_served.py runs those)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator

import pytest

from nvctk.hook import server
from nvctk.hook.messages import decode_served_answer
from nvctk.hook.procs import Procs

RUNTIME, RUNC = 1000, 1001  # the pids the server was told


class Peers(Procs):
    """Connections as accept would hand them: (pid, uid, parent's pid, state sent)."""

    def __init__(self, peers: list[tuple[int, int, int, bytes]]) -> None:
        self.queue: list[tuple[int, int, int]] = []
        self.clients: list[socket.socket] = []
        self.parents: dict[int, int] = {}
        self.interrupt = False
        for pid, uid, parent, state in peers:
            server_end, client = socket.socketpair()
            client.sendall(state)
            client.shutdown(socket.SHUT_WR)  # as the launcher does once stdin is sent
            self.queue.append((server_end.detach(), pid, uid))
            self.clients.append(client)
            self.parents[pid] = parent

    def accept_peer(self, listener: int) -> tuple[int, int, int]:
        if self.interrupt:
            self.interrupt = False
            raise InterruptedError
        return self.queue.pop(0)

    def parent_of(self, pid: int) -> int:
        return self.parents.get(pid, -1)

    def answers(self) -> list[bytes | None]:
        """What each client read; None: closed unanswered (the kernel resets a unix
        connection closed with its state unread, and the launcher then runs the
        prestart itself)."""
        out: list[bytes | None] = []
        for c in self.clients:
            with c:
                try:
                    out.append(b"".join(iter(lambda c=c: c.recv(65536), b"")))
                except ConnectionResetError:
                    out.append(None)
        return out


@pytest.fixture
def asked() -> list[bytes]:
    return []


@pytest.fixture
def listener() -> Iterator[int]:
    """An fd for the listening socket's place (only polled when there is a watch)."""
    r, w = os.pipe()
    yield r
    os.close(r)
    os.close(w)


def _prestart(asked: list[bytes]) -> Callable[[bytes], tuple[int, str]]:
    def prestart(state: bytes) -> tuple[int, str]:
        asked.append(state)
        return 3, f"state {state.decode()}\n"

    return prestart


def test_only_a_root_child_of_the_runtime_become_runc_is_answered(asked: list[bytes], listener: int) -> None:
    peers = Peers([(11, 0, 4711, b"stranger"), (12, 1000, RUNTIME, b"not root"),
                   (13, 0, RUNTIME, b"runc's hook"), (14, 0, RUNTIME, b"too late")])
    server.serve(listener, RUNTIME, None, _prestart(asked), procs=peers)
    assert asked == [b"runc's hook"]  # once, then the server is done
    assert len(peers.queue) == 1  # the fourth was never accepted
    os.close(peers.queue[0][0])
    a = peers.answers()
    assert a[:2] == [None, None] and a[3] is None
    assert a[2] is not None and decode_served_answer(a[2]) == (3, "state runc's hook\n")


def test_beside_a_runc_it_started_only_that_runc_s_child_is_answered(asked: list[bytes], listener: int) -> None:
    """A vGPU create: the runtime waits on runc, whose children run the hook."""
    peers = Peers([(12, 0, RUNTIME, b"the runtime's"), (13, 0, RUNC, b"runc's")])
    server.serve(listener, RUNTIME, RUNC, _prestart(asked), procs=peers)
    assert asked == [b"runc's"]
    a = peers.answers()
    assert a[0] is None
    assert a[1] is not None and decode_served_answer(a[1]) == (3, "state runc's\n")


def test_an_interrupted_accept_is_tried_again(asked: list[bytes], listener: int) -> None:
    peers = Peers([(13, 0, RUNTIME, b"hook")])
    peers.interrupt = True
    server.serve(listener, RUNTIME, None, _prestart(asked), procs=peers)
    assert asked == [b"hook"]
    assert peers.answers() == [b"\x03state hook\n"]


def test_the_server_ends_with_its_runtime_unasked(asked: list[bytes]) -> None:
    """watch (a pidfd of the runtime) readable: no hook will come, nothing is accepted."""
    listener_r, listener_w = os.pipe()  # never readable: nobody connects
    watch_r, watch_w = os.pipe()
    os.close(watch_w)  # readable (EOF), as the pidfd of a process that ended
    peers = Peers([(13, 0, RUNTIME, b"never")])
    try:
        server.serve(listener_r, RUNTIME, None, _prestart(asked), watch=watch_r, procs=peers)
    finally:
        for fd in (listener_r, listener_w, watch_r):
            os.close(fd)
    assert asked == [] and len(peers.queue) == 1
    os.close(peers.queue[0][0])
    assert peers.answers() == [None]


def test_a_state_past_its_bound_is_answered_with_the_failure(asked: list[bytes], listener: int,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.setattr(server, "MAX_HOOK_STATE", 16)
    peers = Peers([(13, 0, RUNTIME, b"x" * 17)])
    server.serve(listener, RUNTIME, None, _prestart(asked), procs=peers)
    assert asked == []  # the prestart never ran on it
    assert peers.answers() == [b"\x01nvctk-hook: prestart: state larger than 16 bytes\n"]
