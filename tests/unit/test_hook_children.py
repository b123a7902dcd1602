"""The prestart's choreography without root (nvctk.hook.children): real forks and pipes,
stand-in roles for the worker and the ldconfig child (the real ones need root; the
integration tests run them). A child that dies, a message cut short or garbled, a
worker that never answers (bounded by the hook's deadline), a fork that fails: each
fails the hook with a message that says so, and leaves no child and no fd behind."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nvctk.base.errors import MountError
from nvctk.base.log import HookLog
from nvctk.edits import Edits
from nvctk.hook import children as ch
from nvctk.hook import messages as msg
from nvctk.hook.messages import Channel
from nvctk.hook.prestart import Ready
from nvctk.hook.procs import Procs

PLAN = Edits("1", ("compute",), (), lib_dir="/usr/lib/x", ldconfig="/sbin/ldconfig")
NO_LDCONFIG = PLAN.replace(ldconfig="")
PID = 4242  # the container's, as the stand-ins see it: a number, never used


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _exited(pid: int) -> None:
    """Wait until child pid has ended, leaving it to be reaped."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def _block() -> None:
    """A peer that never answers: wait on a pipe nobody writes (ends with a kill)."""
    r, _w = os.pipe()
    os.read(r, 1)


Worker = Callable[[Channel, Channel, Channel, Channel], int]
Ldconfig = Callable[[Channel, int], int]


def _roles(worker: Worker, ldconfig: Ldconfig | None = None) -> ch.Roles:
    def ld(_plan: Edits, _rootfs: str, _log: HookLog, libraries: Channel, out: int) -> int:
        return ldconfig(libraries, out) if ldconfig is not None else 0

    return ch.Roles(lambda _plan, _rootfs, _log, pid, answer, libraries, set_up:
                    worker(pid, answer, libraries, set_up), ld)


def good_worker(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
    """As the worker: the pid, the libraries in (a made-up rootfs id), ldconfig set up,
    then its answer."""
    got = msg.decode_pid(pid.recv(msg.PID_LIMIT))
    if got is None:
        return 0
    if libraries.fd >= 0:
        libraries.send(msg.encode_libraries_in(7, 8, got))
    if set_up.fd >= 0:
        msg.decode_set_up(set_up.recv(msg.PID_LIMIT))
    answer.send(msg.encode_answer(None))
    return 0


def good_ldconfig(libraries: Channel, out: int) -> int:
    sent = msg.decode_libraries_in(libraries.recv(msg.LIBRARIES_LIMIT))
    os.write(out, b"got %d %d %d" % sent if sent else b"no libraries")
    return 0  # its exit closes the set-up pipe's write end, as ldconfig's exec does


@pytest.fixture
def log(tmp_path: Path) -> Iterator[HookLog]:
    lg = HookLog(str(tmp_path / "hook.log"), "debug")
    yield lg
    lg.close()


def _text(tmp_path: Path) -> str:
    return (tmp_path / "hook.log").read_text()


@pytest.fixture
def fds() -> Iterator[None]:
    """The test leaves no fd of this process open."""
    before = _fds()
    yield
    assert _fds() == before


def test_the_pid_goes_to_the_worker_the_rootfs_to_ldconfig(log: HookLog, tmp_path: Path,
                                                          fds: None) -> None:
    kids = ch.start(PLAN, "/rootfs", log, roles=_roles(good_worker, good_ldconfig))
    kids.go(PLAN, PID, log)
    assert _reaped(kids.worker) and _reaped(kids.ldconfig)
    text = _text(tmp_path)
    assert "ldconfig refreshed the container's cache (/usr/lib/x)" in text
    assert f"ldconfig: got 7 8 {PID}" in text


def test_without_ldconfig_only_the_worker_is_forked(log: HookLog, fds: None) -> None:
    def worker(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
        assert libraries.fd == -1 and set_up.fd == -1
        return good_worker(pid, answer, libraries, set_up)

    kids = ch.start(NO_LDCONFIG, "/rootfs", log, roles=_roles(worker))
    assert kids.ldconfig == -1
    kids.go(NO_LDCONFIG, PID, log)
    assert _reaped(kids.worker)


def _dies(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
    msg.decode_pid(pid.recv(msg.PID_LIMIT))
    os._exit(3)


def _cut(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
    msg.decode_pid(pid.recv(msg.PID_LIMIT))
    answer.send(msg.encode_answer("step mount: /x: no")[:-3])  # then killed, say
    return 0


def _garbled(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
    msg.decode_pid(pid.recv(msg.PID_LIMIT))
    answer.send(b"ok")  # no frame
    return 0


def _fails(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
    msg.decode_pid(pid.recv(msg.PID_LIMIT))
    answer.send(msg.encode_answer("step mount: /usr/lib/x/libcuda.so: boom"))
    return 1


def _ok_but_exits_5(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
    msg.decode_pid(pid.recv(msg.PID_LIMIT))
    answer.send(msg.encode_answer(None))
    return 5


def _never_answers(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
    _block()
    return 0


def _blocked_ldconfig(libraries: Channel, out: int) -> int:
    _block()  # past the worker's end too: only the hook's kill ends it
    return 0


@pytest.mark.parametrize(("worker", "want"), [
    (_dies, "^worker gave no answer$"),
    (_cut, r"^the worker's answer: message cut short \(\d+ of \d+ bytes\)$"),
    (_garbled, "^the worker's answer: garbled message b'ok'$"),
    (_fails, "^step mount: /usr/lib/x/libcuda.so: boom$"),
    (_ok_but_exits_5, "^worker exited 5$"),
], ids=["dies", "cut-short", "garbled", "fails", "exit-code"])
def test_a_failed_worker_fails_the_hook_and_stops_ldconfig(log: HookLog, fds: None,
                                                           worker: Worker, want: str) -> None:
    kids = ch.start(PLAN, "/rootfs", log, roles=_roles(worker, _blocked_ldconfig))
    with pytest.raises(MountError, match=want):
        kids.go(PLAN, PID, log)
    assert _reaped(kids.worker) and _reaped(kids.ldconfig)  # ldconfig killed, not waited on


def test_a_worker_silent_past_the_deadline_is_killed(log: HookLog, fds: None) -> None:
    kids = ch.start(PLAN, "/rootfs", log, roles=_roles(_never_answers, _blocked_ldconfig))
    with pytest.raises(MountError, match=r"^worker gave no answer by the hook's deadline"):
        kids.go(PLAN, PID, log, deadline=0.0)  # long past: nothing is waited for
    assert _reaped(kids.worker) and _reaped(kids.ldconfig)


def test_ldconfig_silent_past_the_deadline_is_killed_and_only_warned(log: HookLog,
                                                                     tmp_path: Path,
                                                                     fds: None) -> None:
    def worker(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
        answer.send(msg.encode_answer(None))  # at once: the pid is not waited for here
        return 0

    kids = ch.start(PLAN, "/rootfs", log, roles=_roles(worker, _blocked_ldconfig))
    _exited(kids.worker)  # its answer is in the pipe before the deadline is looked at
    kids.go(PLAN, PID, log, deadline=0.0)
    assert _reaped(kids.worker) and _reaped(kids.ldconfig)
    assert ("ldconfig exited -9: killed at the hook's deadline (runc's hook timeout)"
            in _text(tmp_path))


def test_cancelled_children_mount_nothing_and_are_reaped(log: HookLog, tmp_path: Path,
                                                         fds: None) -> None:
    seen = tmp_path / "seen"

    def worker(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
        seen.write_text(repr(msg.decode_pid(pid.recv(msg.PID_LIMIT))))
        return 0

    def ldconfig(libraries: Channel, out: int) -> int:
        (tmp_path / "ld").write_text(repr(msg.decode_libraries_in(
            libraries.recv(msg.LIBRARIES_LIMIT))))
        return 0

    kids = ch.start(PLAN, "/rootfs", log, roles=_roles(worker, ldconfig))
    kids.cancel()
    assert _reaped(kids.worker) and _reaped(kids.ldconfig)
    assert seen.read_text() == "None"  # EOF alone: cancelled
    assert (tmp_path / "ld").read_text() == "None"  # the worker sent nothing


class ForkFails(Procs):
    """The kernel's, but the n-th fork is refused (EAGAIN: a pid limit)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.forks = 0
        self.children: list[int] = []

    def fork(self) -> int:
        self.forks += 1
        if self.forks == self.n:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        pid = super().fork()
        if pid:
            self.children.append(pid)
        return pid


@pytest.mark.parametrize("n", [1, 2], ids=["worker", "ldconfig"])
def test_a_fork_that_fails_leaves_no_child_and_no_fd(log: HookLog, tmp_path: Path,
                                                     fds: None, n: int) -> None:
    seen = tmp_path / "seen"

    def worker(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
        seen.write_text(repr(msg.decode_pid(pid.recv(msg.PID_LIMIT))))
        return 0

    procs = ForkFails(n)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        ch.start(PLAN, "/rootfs", log, procs, _roles(worker, good_ldconfig))
    assert procs.forks == n and len(procs.children) == n - 1
    assert all(_reaped(pid) for pid in procs.children)  # the worker forked first: reaped
    if n == 2:
        assert seen.read_text() == "None"  # ended unused: it mounted nothing


def test_a_worker_gone_before_the_pid_fails_the_hook(log: HookLog, fds: None) -> None:
    def gone(pid: Channel, answer: Channel, libraries: Channel, set_up: Channel) -> int:
        return 0  # no pid read, no answer

    kids = ch.start(PLAN, "/rootfs", log, roles=_roles(gone, good_ldconfig))
    _exited(kids.worker)  # the pid is then written into a pipe nobody reads
    with pytest.raises(MountError, match=r"^worker gave no answer$"):
        kids.go(PLAN, PID, log)
    assert _reaped(kids.worker) and _reaped(kids.ldconfig)


# --- what a served prestart made ready (nvctk.hook.prestart.Ready) ---------------------------


class Made:
    """Stands for Children: records whether it was cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Early:
    def __init__(self) -> None:
        self.log = HookLog("")


class Hook:
    def __init__(self, early: object) -> None:
        self.early = early


def test_ready_children_are_taken_once_and_only_for_their_inputs() -> None:
    early, made = Early(), Made()
    ready = Ready(early, made)  # type: ignore[arg-type]
    assert ready.take(Hook(Early())) is None  # the hook read other inputs
    assert ready.take(Hook(early)) is made  # type: ignore[arg-type]
    assert ready.take(Hook(early)) is None  # type: ignore[arg-type]
    ready.release()
    assert not made.cancelled  # taken: the hook's to use


def test_ready_children_not_taken_are_cancelled_at_release() -> None:
    early, made = Early(), Made()
    ready = Ready(early, made)  # type: ignore[arg-type]
    assert ready.take(Hook(Early())) is None  # type: ignore[arg-type]
    ready.release()
    assert made.cancelled and ready.children is None


def test_a_pipe_that_cannot_be_made_leaves_none_open(log: HookLog, fds: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    made = 0

    def pipe() -> tuple[Channel, Channel]:
        nonlocal made
        made += 1
        if made == 3:
            raise OSError(errno.EMFILE, "Too many open files")
        return msg.pipe()

    monkeypatch.setattr(ch, "pipe", pipe)
    forks = ForkFails(0)
    with pytest.raises(OSError, match="Too many open files"):
        ch.start(PLAN, "/rootfs", log, forks, _roles(good_worker, good_ldconfig))
    assert forks.forks == 0
