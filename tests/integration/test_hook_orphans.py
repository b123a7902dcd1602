"""Nothing nvctk-hook starts outlives it.

An image whose /etc/ld.so.conf is a FIFO blocks the chrooted ldconfig without a
byte of output. When the hook itself is killed (SIGKILL, or runc's hook timeout,
which is a SIGKILL to the hook), its ldconfig child (which becomes that ldconfig)
must die with it instead of living on as an orphan holding a private mount namespace
of the container's ~40 mounts: both children set PR_SET_PDEATHSIG(SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import support.runc as th
from nvctk.edits import Mount
from nvctk.sim.host import SimHost
from support import wait
from support.canary.harness import (
    HOOK,
    HOOK_PATH_ENV,
    fake_container,
    make_bundle,
    make_plan,
    run_hook,
)

runc = th.runc  # the fixture: real runc, containers deleted afterwards

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, runc)")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a live process, None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if rest[0] in ("Z", "X") else (rest[0], int(rest[1]))


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _root(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/root")
    except OSError:
        return ""


def _wait_for(find: Callable[[], list[int]], what: str, timeout: float = 20.0) -> list[int]:
    return wait.until(find, timeout, what)


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after waiting up to `seconds` for all of them to end."""
    with contextlib.suppress(AssertionError):
        wait.until(lambda: all(_stat(p) is None for p in pids), seconds, "the processes to end")
    return [p for p in pids if _stat(p) is not None]


class _Watch(threading.Thread):
    """Waits (up to 10 s) for ldconfig processes of `find` to appear: their pids."""

    def __init__(self, find: Callable[[], list[int]]) -> None:
        super().__init__()
        self.find = find
        self.pids: list[int] = []
        self.start()

    def run(self) -> None:
        with contextlib.suppress(AssertionError):
            self.pids = _wait_for(self.find, "the hook's ldconfig", 10)


def _no_ldconfig_after_the_timeout(run: Callable[[], subprocess.CompletedProcess[str]],
                                   real_root: str, within: float) -> None:
    """run() fails on its hook's timeout; the hook's ldconfig (chrooted in real_root,
    blocked on the FIFO, watched while run() runs) is gone `within` seconds after."""
    def ours() -> list[int]:
        return [p for p in _pids() if _comm(p) == "ldconfig" and _root(p) == real_root]

    seen = _Watch(ours)
    r = run()
    seen.join()
    assert r.returncode != 0 and "timeout" in r.stderr, r.stderr
    assert seen.pids, "the hook's ldconfig never ran"
    left = _gone_within(seen.pids, within)
    try:
        assert left == [], f"ldconfig outlived the hook's timeout: {left}"
        assert ours() == []
    finally:
        for p in left:
            os.kill(p, signal.SIGKILL)


@pytest.fixture
def fifo_rootfs(rootfs: Callable[..., str]) -> Iterator[str]:
    """A rootfs whose /etc/ld.so.conf is a FIFO; afterwards, whatever still blocks on
    it (a leftover of a failing test) is released."""
    root = rootfs()
    conf = os.path.join(root, "etc/ld.so.conf")
    os.unlink(conf)
    os.mkfifo(conf)
    yield root
    try:
        os.close(os.open(conf, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_sigkilled_hook_takes_its_ldconfig_along(sim_host: SimHost, fifo_rootfs: str,
                                                 tmp_path: Path) -> None:
    bundle = make_bundle(str(tmp_path / "bundle"), fifo_rootfs, make_plan(sim_host))
    env = dict(e.split("=", 1) for e in [HOOK_PATH_ENV, f"NVCTK_CONFIG={bundle.config}"])
    leftovers: list[int] = []
    with fake_container() as pid:
        state = {"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": pid,
                 "bundle": bundle.path}
        hook = subprocess.Popen([HOOK, "prestart"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            assert hook.stdin is not None
            hook.stdin.write(json.dumps(state).encode())
            hook.stdin.close()
            # its worker, exec'd into ldconfig chrooted in the rootfs, blocked on the FIFO
            workers = _wait_for(
                lambda: [p for p in _pids() if (_stat(p) or ("", 0))[1] == hook.pid
                         and _comm(p) == "ldconfig"], "the hook's ldconfig")
            assert _root(workers[0]) == os.path.realpath(fifo_rootfs)
            hook.send_signal(signal.SIGKILL)
            hook.wait()
            leftovers = _gone_within(workers, 1.0)
            assert leftovers == [], f"ldconfig outlived the hook: {leftovers}"
        finally:
            for p in leftovers:  # the hook's own descendants, found above
                os.kill(p, signal.SIGKILL)
            if hook.poll() is None:
                hook.kill()
                hook.wait()


def test_a_worker_failing_after_the_libraries_stops_the_ldconfig_beside_it(
        sim_host: SimHost, fifo_rootfs: str, tmp_path: Path) -> None:
    """ldconfig starts once the worker's libraries are in, while it mounts the rest. A
    later mount that fails (a file mount onto the image's /etc, a directory) fails the
    hook at once: the ldconfig beside it, blocked on the FIFO, is killed and reaped,
    not waited for (30 s) nor left behind."""
    smi = os.path.join(sim_host.bin_dir, "nvidia-smi")
    plan = make_plan(sim_host, extra=[Mount(smi, "/etc", required=True)])
    bundle = make_bundle(str(tmp_path / "bundle"), fifo_rootfs, plan)
    real = os.path.realpath(fifo_rootfs)
    with fake_container() as pid:
        r = run_hook(bundle, pid, timeout=20)
    assert r.returncode == 1 and "step mount: /etc" in r.stderr, r.stderr
    left = _gone_within([p for p in _pids() if _root(p) == real], 1.0)
    try:
        assert left == [], f"the hook's ldconfig outlived its failure: {left}"
    finally:
        for p in left:
            os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_runc_hook_timeout_leaves_no_ldconfig(sim_host: SimHost, fifo_rootfs: str,
                                              tmp_path: Path,
                                              runc: Callable[..., subprocess.CompletedProcess[str]]
                                              ) -> None:
    root = Path(fifo_rootfs)
    bundle = th.runc_bundle(tmp_path, root, sim_host, ["/bin/true"], [])
    spec = json.loads((bundle / "config.json").read_text())
    spec["hooks"]["prestart"][0]["timeout"] = 2
    (bundle / "config.json").write_text(json.dumps(spec))
    # the hook's own timeout ends it well before runc's 30 s
    _no_ldconfig_after_the_timeout(lambda: runc(bundle, timeout=30), os.path.realpath(root), 1.0)


@pytest.mark.slow
def test_a_served_hook_past_its_timeout_leaves_no_ldconfig(sim_host: SimHost, fifo_rootfs: str,
                                                          tmp_path: Path) -> None:
    """Through nvctk-runtime the prestart runs in its server, which runc's hook timeout
    does not kill (it kills the launcher): the server stops its ldconfig at the hook's
    own deadline, not 30 s (LDCONFIG_TIMEOUT) later. The wait below is far shorter than
    that, far longer than the 2 s deadline."""
    import re
    import uuid

    from support.runc import RUNTIME, containers

    text = re.sub(r"(?m)^hook-timeout = .*\n", "", Path(sim_host.config_path).read_text())
    config = tmp_path / "config.toml"
    config.write_text(text + "hook-timeout = 2\n")
    real = os.path.realpath(fifo_rootfs)
    with containers(sim_host, tmp_path) as rc:
        b = rc.bundle(fifo_rootfs, ["/bin/true"], ["NVIDIA_VISIBLE_DEVICES=0"])
        cid = "nvctk-orphan-" + uuid.uuid4().hex[:8]
        rc.ids.append(cid)
        _no_ldconfig_after_the_timeout(lambda: subprocess.run(
            [RUNTIME, "--root", str(rc.root), "run", "--bundle", str(b), cid],
            env={**os.environ, "NVCTK_CONFIG": str(config)}, capture_output=True, text=True,
            timeout=60, stdin=subprocess.DEVNULL), real, 10.0)
