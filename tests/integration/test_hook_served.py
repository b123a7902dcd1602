"""The prestart hook served by nvctk-runtime (nvctk.hook.served, hooks/nvctk-hook.c).

A GPU create through nvctk-runtime forks a server that runs the prestart for runc's
hook, made ready while runc starts (inputs read, worker and ldconfig forked); the log
says which ran it and whether the ready part was used, so a fast path that silently
falls back fails here. Without the server (plain runc on the spec), or with a stranger holding its
name, the hook runs the Python prestart itself and the container gets its GPU all
the same. The server answers only root children of its runc.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nvctk.base import config as nvconfig
from nvctk.edits_file import EDITS_FILE
from nvctk.hook import served
from nvctk.hook import server as hook_server
from nvctk.hook.entry import read_early
from nvctk.hook.inputs import HookState
from nvctk.runtime.create import prepare_bundle
from nvctk.sim.host import SimHost
from support.runc import RUNTIME, Runc, containers
from support.runtime import BIN
from support.wait import line, until

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, device nodes)"),
    pytest.mark.skipif(shutil.which("runc") is None, reason="needs runc"),
]

HOOK = os.path.join(BIN, "nvctk-hook")
SMI = ["sh", "-c", "nvidia-smi -L"]
DONE = "prestart done"
SERVED = "prestart done, served by nvctk-runtime"
READY = "prestart done, served by nvctk-runtime, made ready while runc started"
READ_ANEW = "the inputs read while runc started are not this hook's"
BY_ITSELF = "the hook runs by itself"


@pytest.fixture
def rc(sim_host: SimHost, tmp_path: Path) -> Iterator[Runc]:
    with containers(sim_host, tmp_path) as r:
        yield r


def _token() -> str:
    """A server name as nvctk-runtime makes one: 32 hex digits."""
    return os.urandom(16).hex()


def _log(sim_host: SimHost, cid: str) -> list[str]:
    """The nvctk log's lines about container cid."""
    path = nvconfig.load(sim_host.config_path).log_file
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line for line in f if f" {cid}:" in line]


def _gpu0(out: str, sim_host: SimHost) -> bool:
    return f"GPU 0: {sim_host.topology.gpus[0].name}" in out


def test_a_gpu_run_is_served(rc: Runc, sim_host: SimHost) -> None:
    res = rc.run(rc.bundle(None, SMI, ["NVIDIA_VISIBLE_DEVICES=0"]))
    assert res.proc.returncode == 0, res.proc.stderr
    assert _gpu0(res.proc.stdout, sim_host), res.proc.stdout
    log = _log(sim_host, rc.ids[-1])
    assert [line for line in log if READY in line], log
    assert not [line for line in log if BY_ITSELF in line or READ_ANEW in line], log


@pytest.mark.parametrize("limit", [False, True], ids=["whole-gpu", "vgpu"])
def test_create_start_delete_is_served(rc: Runc, sim_host: SimHost, limit: bool) -> None:
    """The engines' lifecycle: create (the runtime execs runc; for a vGPU it waits on
    it, the server beside runc), start, the container's exit, delete."""
    env = ["NVIDIA_VISIBLE_DEVICES=0", *(["CUDA_DEVICE_MEMORY_LIMIT=1g"] if limit else [])]
    b = rc.bundle(None, SMI, env)
    cid = "nvctk-served-" + uuid.uuid4().hex[:8]
    rc.ids.append(cid)
    envs = {**os.environ, "NVCTK_CONFIG": sim_host.config_path}
    out = b / "out"

    def runtime(*args: str) -> int:
        # files, not pipes: the created container keeps runc create's stdio
        with open(out, "a") as f, open(b / "err", "a") as e:
            return subprocess.run([RUNTIME, "--root", str(rc.root), *args], env=envs,
                                  stdin=subprocess.DEVNULL, stdout=f, stderr=e,
                                  timeout=120).returncode

    assert runtime("create", "--bundle", str(b), cid) == 0, (b / "err").read_text()
    # the server (a fork of the runtime: its command line) has answered and ended; for a
    # whole GPU it was runc's own child, handed on to the init when runc create ended
    until(lambda: not _with_cmdline(cid), 30, "the prestart's server to end")
    assert runtime("start", cid) == 0, (b / "err").read_text()

    def stopped() -> bool:
        st = subprocess.run(["runc", "--root", str(rc.root), "state", cid],
                            capture_output=True, text=True, timeout=30)
        return '"status": "stopped"' in st.stdout

    until(stopped, 60, f"container {cid} to stop")
    assert runtime("delete", cid) == 0
    assert _gpu0(out.read_text(), sim_host), out.read_text()
    log = _log(sim_host, cid)
    assert [line for line in log if READY in line], log


def _with_cmdline(word: str) -> list[int]:
    """Live processes (not zombies) with `word` in their command line."""
    return [p for p, _, state, cmd in _procs() if state != "Z" and word in cmd]


def _edited(rc: Runc, sim_host: SimHost, token: str) -> Path:
    """A bundle nvctk edited for GPU 0 whose hook names server `token` (none runs)."""
    b = rc.bundle(None, SMI, ["NVIDIA_VISIBLE_DEVICES=0"])
    config = nvconfig.load(sim_host.config_path)
    assert prepare_bundle(str(b), config, argv0=RUNTIME, served=token).served(token)
    return b


def _plain_runc(rc: Runc, b: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    cid = "nvctk-plain-" + uuid.uuid4().hex[:8]
    rc.ids.append(cid)
    r = subprocess.run(["runc", "--root", str(rc.root), "run", "--bundle", str(b), cid],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return cid, r


def test_without_a_server_the_hook_runs_by_itself(rc: Runc, sim_host: SimHost) -> None:
    b = _edited(rc, sim_host, _token())
    cid, r = _plain_runc(rc, b)
    assert r.returncode == 0, r.stderr
    assert _gpu0(r.stdout, sim_host), r.stdout
    log = _log(sim_host, cid)
    assert [line for line in log if BY_ITSELF in line], log
    assert [line for line in log if DONE in line and SERVED not in line], log


STRANGER = """
import os, sys
from nvctk import _sys
from nvctk.hook import served
listener = served.listen(sys.argv[1])
print("ready", flush=True)
conn, _, _ = _sys.accept_peer(listener)
print(repr(os.read(conn, 65536)), flush=True)
"""


def test_the_hook_never_talks_to_a_stranger(rc: Runc, sim_host: SimHost) -> None:
    """Someone else (root, but neither runc nor the one who started it) holds the
    server's name: the launcher hands it nothing, runs the prestart itself, and the
    container gets its GPU."""
    token = _token()
    b = _edited(rc, sim_host, token)
    with subprocess.Popen([sys.executable, "-c", STRANGER, token], stdout=subprocess.PIPE,
                          text=True) as stranger:
        try:
            assert line(stranger.stdout, "ready", 60, "the stranger listening")
            cid, r = _plain_runc(rc, b)
            # connected, checked, and closed without a byte of the state
            assert stranger.communicate(timeout=60)[0] == "b''\n"
        finally:
            stranger.kill()
    assert r.returncode == 0, r.stderr
    assert _gpu0(r.stdout, sim_host), r.stdout
    assert [line for line in _log(sim_host, cid) if BY_ITSELF in line]


def _ask(token: str, state: bytes) -> bytes:
    """What the server answers this process for `state`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(b"\0" + served.NAME_PREFIX + token.encode())
        chunks = []
        try:
            s.sendall(state)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed with the state unread (a refused peer can be closed before it writes)
        return b"".join(chunks)


def test_the_server_answers_only_children_of_its_runc() -> None:
    """The server's parent (this test) stands for the runtime that became runc: this
    process, no child of itself, is closed unanswered; a child of it is answered."""
    token = _token()
    listener = served.listen(token)
    server = os.fork()
    if server == 0:
        code = 1
        try:
            hook_server.serve(listener, os.getppid(), None, lambda st: (3, f"state {st!r}\n"))
            code = 0
        finally:
            os._exit(code)
    os.close(listener)
    try:
        assert _ask(token, b"from a stranger") == b""
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                os.write(w, _ask(token, b"from runc's child"))
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            answer = f.read()
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        assert answer == b"\x03state b\"from runc's child\"\n"
        # one answer, then the server is done
        assert os.waitstatus_to_exitcode(os.waitpid(server, 0)[1]) == 0
    finally:
        try:
            os.kill(server, 9)
            os.waitpid(server, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.mark.parametrize(("answer", "code", "stderr"), [
    (b"\x07it went wrong\n", 7, "it went wrong\n"),  # relayed as given
    (b"", 1, "nvctk-hook: prestart: nvctk-runtime's prestart server ended without an answer\n"),
])
def test_the_launcher_relays_the_servers_answer(answer: bytes, code: int, stderr: str) -> None:
    """The launcher run by this process (its "runc") trusts the socket this process made,
    hands it its stdin whole, and exits with the server's code and text; a server that
    closes without one is a failure, never a silent success."""
    from nvctk import _sys

    token = _token()
    listener = served.listen(token)
    got: list[bytes] = []

    def server() -> None:
        conn, _, _ = _sys.accept_peer(listener)
        try:
            chunks = []
            while chunk := os.read(conn, 65536):
                chunks.append(chunk)
            got.append(b"".join(chunks))
            if answer:
                os.write(conn, answer)
        finally:
            os.close(conn)

    t = threading.Thread(target=server, daemon=True)
    t.start()
    try:
        r = subprocess.run([HOOK, "prestart", "--served", token], input=b'{"id": "x"}',
                           capture_output=True, timeout=60)
    finally:
        t.join(timeout=60)
        os.close(listener)
    assert got == [b'{"id": "x"}']
    assert (r.returncode, r.stderr.decode()) == (code, stderr)


def _procs() -> list[tuple[int, int, str, str]]:
    """(pid, parent's pid, state, cmdline) of every process."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        out.append((int(d), int(fields[1]), fields[0].decode(), cmd))
    return out


def _children(pid: int) -> list[tuple[int, str, str]]:
    """(pid, state, cmdline) of pid's children."""
    return [(p, state, cmd) for p, ppid, state, cmd in _procs() if ppid == pid]


@pytest.mark.parametrize("limit", [False, True], ids=["whole-gpu", "vgpu"])
def test_a_foreground_run_leaves_no_defunct_server(rc: Runc, sim_host: SimHost, limit: bool) -> None:
    """`nvctk-runtime run` in the foreground, the container running on: once the served
    prestart is done, neither the runtime's process (runc, by exec; or the runtime that
    waits on runc, for a vGPU) nor runc beside it has a defunct child."""
    env = ["NVIDIA_VISIBLE_DEVICES=0", *(["CUDA_DEVICE_MEMORY_LIMIT=1g"] if limit else [])]
    b = rc.bundle(None, ["sh", "-c", "echo up; exec sleep 600"], env)
    cid = "nvctk-served-" + uuid.uuid4().hex[:8]
    rc.ids.append(cid)
    p = subprocess.Popen([RUNTIME, "--root", str(rc.root), "run", "--bundle", str(b), cid],
                         env={**os.environ, "NVCTK_CONFIG": sim_host.config_path},
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        assert p.stdout is not None
        line(p.stdout, "up", 60, "the container to start")
        # the server: a fork of the runtime (its command line), gone once it answered
        until(lambda: not [c for c in _children(p.pid) + [x for k in _children(p.pid)
                                                           for x in _children(k[0])]
                           if "nvctk-runtime" in c[2] and c[1] != "Z"],
              60, "the prestart's server to end")
        tree = _children(p.pid)
        tree += [x for c in tree for x in _children(c[0])]
        assert [c for c in tree if c[1] == "Z"] == [], tree
        log = _log(sim_host, cid)
        assert [x for x in log if READY in x], log
    finally:
        subprocess.run(["runc", "--root", str(rc.root), "kill", cid, "KILL"], capture_output=True)
        p.wait(60)


def test_inputs_read_early_stand_only_while_the_bundle_is_as_read(rc: Runc,
                                                                 sim_host: SimHost) -> None:
    """What the server reads while runc starts is the hook's input only for a state of
    that bundle (and rootfs, where crun names one) whose spec and form are byte for byte
    what was read; a rewrite with the same bytes still is."""
    b = _edited(rc, sim_host, _token())
    early = read_early(str(b))
    assert early is not None
    try:
        rootfs = str(b / "rootfs")
        assert early.rootfs == rootfs
        spec, form = b / "config.json", b / EDITS_FILE
        originals = {spec: spec.read_bytes(), form: form.read_bytes()}

        def rewrite(path: Path, data: bytes) -> None:  # a new file, as an atomic save
            path.with_suffix(".new").write_bytes(data)
            os.replace(path.with_suffix(".new"), path)

        state = HookState("c", 4242, str(b))

        def same_bytes() -> None:
            rewrite(form, originals[form])
            rewrite(spec, originals[spec])

        rows: list[tuple[str, Callable[[], object] | None, HookState, bool]] = [
            ("as read", None, state, True),
            ("crun names the same rootfs", None, HookState("c", 4242, str(b), rootfs), True),
            ("the same bytes saved anew", same_bytes, state, True),
            ("another bundle", None, HookState("c", 4242, str(b) + "-other"), False),
            ("no pid", None, HookState("c", 0, str(b)), False),
            ("crun names another rootfs", None, HookState("c", 4242, str(b), "/srv"), False),
            ("the spec changed", lambda: rewrite(spec, originals[spec] + b" "), state, False),
            ("the form changed", lambda: rewrite(form, originals[form] + b" "), state, False),
            ("the form is gone", form.unlink, state, False),
        ]
        for name, change, at, holds in rows:
            if change is not None:
                change()
            got = early.holds(at)
            for path, data in originals.items():
                rewrite(path, data)
            assert got is holds, name
    finally:
        early.log.close()


def _reap(pid: int) -> int | None:
    """The exit code of child `pid` once it ends (within 30 s; else killed: None). A
    server nobody asked (its runc failed first) would wait on this process for ever."""
    status: list[int] = []

    def ended() -> bool:
        done, st = os.waitpid(pid, os.WNOHANG)
        status.append(st)
        return done != 0

    try:
        until(ended, 30, f"process {pid} to end")
    except BaseException:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return None
    return os.waitstatus_to_exitcode(status[-1])


def _run_after_the_server_read(rc: Runc, sim_host: SimHost, change: Callable[[Path], None]
                               ) -> tuple[str, int, int | None, str, list[int]]:
    """A served runc run whose bundle `change`s after the server made the prestart ready
    and before runc runs the hook: (container id, runc's exit code, the server's, runc's
    output, the children the server had made ready)."""
    token = _token()
    b = _edited(rc, sim_host, token)
    cid = "nvctk-served-" + uuid.uuid4().hex[:8]
    rc.ids.append(cid)
    go_r, go_w = os.pipe()
    runc = os.fork()
    if runc == 0:  # runc, once told to: the server's "runc" (its peer's parent)
        try:
            os.close(go_w)
            if not os.read(go_r, 1):
                os._exit(0)  # the test failed before: no container
            out = os.open(b / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.execvp("runc", ["runc", "--root", str(rc.root), "run", "--bundle", str(b), cid])
        finally:
            os._exit(127)
    os.close(go_r)
    server = -1
    try:
        listener = served.listen(token)
        try:
            server = served.start(listener, runc, grandchild=False, bundle=str(b))
        finally:
            os.close(listener)
        # ready: the form read, then the worker forked (and ldconfig beside it)
        until(lambda: _children(server), 30, "the server to make the prestart ready")
        ready = [p for p, _, _ in _children(server)]
        change(b)
        os.write(go_w, b"x")
    finally:
        os.close(go_w)
        code = os.waitstatus_to_exitcode(os.waitpid(runc, 0)[1])
        server_code = _reap(server) if server > 0 else None
    return cid, code, server_code, (b / "out").read_text(), ready


def test_a_form_changed_after_the_server_read_it_is_read_anew(rc: Runc,
                                                              sim_host: SimHost) -> None:
    """The form changes after the server made the prestart ready and before runc runs
    the hook: the hook's inputs are read anew, the children made ready end unused
    (mounting nothing), and the container gets its GPU all the same."""
    def append(b: Path) -> None:
        with open(b / EDITS_FILE, "ab") as f:
            f.write(b" ")  # still the same form, but not the bytes read

    cid, code, server_code, out, ready = _run_after_the_server_read(rc, sim_host, append)
    assert code == 0, out
    assert server_code == 0
    assert _gpu0(out, sim_host), out
    log = _log(sim_host, cid)
    assert [line for line in log if READ_ANEW in line], log
    assert [line for line in log if SERVED in line], log
    assert not [line for line in log if READY in line], log
    # reaped by the server before it ended
    assert [p for p in ready if os.path.exists(f"/proc/{p}")] == [], ready


@pytest.mark.parametrize("spoil", ["removed", "renamed", "emptied"])
def test_a_form_gone_after_the_server_read_it_starts_no_gpu_container(
        rc: Runc, sim_host: SimHost, spoil: str) -> None:
    """The form vanishes (or is no form) after the server read it, while the spec still
    holds what the GPU create added (its devices, its hook, its record): the hook fails
    and the container does not start, rather than start with the GPU's device nodes and
    without its mounts or cap."""
    def change(b: Path) -> None:
        form = b / EDITS_FILE
        if spoil == "removed":
            form.unlink()
        elif spoil == "renamed":
            form.rename(b / "elsewhere.json")
        else:
            form.write_bytes(b"")

    cid, code, server_code, out, ready = _run_after_the_server_read(rc, sim_host, change)
    assert code != 0, out
    assert "nvctk-hook: prestart:" in out and EDITS_FILE in out, out
    assert not _gpu0(out, sim_host), out
    assert server_code == 0  # it answered: the failure
    assert [p for p in ready if os.path.exists(f"/proc/{p}")] == [], ready
    assert cid not in rc.listed() or "running" not in subprocess.run(
        ["runc", "--root", str(rc.root), "state", cid], capture_output=True, text=True,
        timeout=30).stdout
