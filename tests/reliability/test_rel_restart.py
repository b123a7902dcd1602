"""Issue 13 §2: containerd and dockerd restarted (SIGTERM, then SIGKILL, in turn) while GPU
containers run, on the simulated host.

containerd (Debian's 1.6) loads a config that `nvctk configure` edited; its containers run
with the runtime that config names (runtime_type + BinaryName, read back from `containerd
config dump`: ctr has no CRI runtime names). dockerd runs the `nvidia` runtime of a
daemon.json that `nvctk configure` edited, with live-restore on (without it dockerd stops
its containers when it goes). After each restart: every container's task still runs with
the same pid, its GPU mounts (libcuda) are still in its mount table, the capped one still
sees its cap, its vGPU state is still there (the collection a restart may trigger must not
take it), and a new GPU container starts and sees exactly its GPU. At the end everything
is stopped: no vGPU state dir, no mount, no process of the test's left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomlkit

from nvctk.sim.host import SimHost
from support import reliability as relkit
from support import wait
from support.daemons import (
    Containerd,
    Dockerd,
    containerd,
    dockerd,
    import_rootfs,
    private_paths,
    short_dir,
    umount_below,
)

pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (daemons, device nodes)")]

CAP = "CUDA_DEVICE_MEMORY_LIMIT=512m"
QUERY = ["nvidia-smi", "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"]
SIGNALS = (signal.SIGTERM, signal.SIGKILL)


def _need(*tools: str) -> None:
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimHost]:
    """A sim of its own: its vGPU state dir holds only this module's containers."""
    from nvctk.sim import host
    from nvctk.sim.topology import make_topology

    s = host.init(str(tmp_path_factory.mktemp("rstsim") / "host"), make_topology(gpus=2))
    yield s
    # after a failure that left a daemon down no poststop ran: its state tmpfs goes here
    umount_below(Path(s.root))


@pytest.fixture(scope="module")
def image_rootfs(tmp_path_factory: pytest.TempPathFactory, sim: SimHost) -> str:
    from nvctk.sim.rootfs import build_rootfs

    return build_rootfs(str(tmp_path_factory.mktemp("rstrootfs") / "r"), with_sample=sim.sample)


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir("nvctk-r-") as d:
        yield d


def _nvctk_configure(engine: str, cfg: Path) -> None:
    r = subprocess.run([relkit.NVCTK, "configure", "--runtime", engine, "--config", str(cfg),
                        "--runtime-path", relkit.RUNTIME],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _restart(proc: subprocess.Popen[bytes], sig: int, log: Path, env: dict[str, str]
             ) -> subprocess.Popen[bytes]:
    """The daemon killed with sig, then started again with the same argv (so the same
    config, root, state and sockets)."""
    proc.send_signal(sig)
    proc.wait(30)
    with open(log, "a") as logf:
        return subprocess.Popen(proc.args, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait_up(check: Callable[[], bool], what: str, log: Path) -> float:
    t0 = time.monotonic()
    try:
        wait.until(check, 60, what)
    except AssertionError:
        raise AssertionError(f"{what}; log tail:\n{log.read_text(errors='replace')[-2000:]}")
    return time.monotonic() - t0


def _gpu_mounted(pid: int) -> bool:
    """The container's own mount table (its init's) still has the driver's libcuda."""
    return "libcuda.so" in Path(f"/proc/{pid}/mountinfo").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _state_dir(sim: SimHost) -> str:
    """nvctk's vGPU state dir in the sim's config (not sim.state_dir, the GPUs' own)."""
    return os.path.join(sim.root, "run", "nvctk")


def _query_line(gpu_uuid: str, mib: int) -> str:
    return f"{gpu_uuid}, {mib}"


def _gc(sim: SimHost) -> None:
    r = relkit.vgpu_gc({**os.environ, **sim.env})
    assert r.returncode == 0 and relkit.clean_failure(r.stderr), r.stderr


def _ours(needle: str, *but: int) -> list[tuple[int, str]]:
    return [p for p in relkit.procs_mentioning(needle) if p[0] not in but]


# ---------------------------------------------------------------- containerd


def _ctd_config(work: Path) -> tuple[Path, str, str]:
    """A containerd config under work, edited by `nvctk configure`; returns it with the
    nvidia runtime's type and binary as containerd itself reads them."""
    cfg = work / "config.toml"
    doc = tomlkit.document()
    doc["version"] = 2
    for k, v in private_paths(work).items():
        doc[k] = v
    cfg.write_text(tomlkit.dumps(doc))
    _nvctk_configure("containerd", cfg)
    r = subprocess.run(["containerd", "--config", str(cfg), "config", "dump"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rt = (tomlkit.parse(r.stdout).unwrap()["plugins"]["io.containerd.grpc.v1.cri"]
          ["containerd"]["runtimes"]["nvidia"])
    assert rt["options"]["BinaryName"] == relkit.RUNTIME
    return cfg, rt["runtime_type"], rt["options"]["BinaryName"]


class Ctr:
    """GPU containers of one containerd, run with the configured runtime."""

    def __init__(self, d: Containerd, rootfs: str, runtime: str, binary: str) -> None:
        self.d, self.rootfs, self.runtime, self.binary = d, rootfs, runtime, binary
        self.count = 0

    def _args(self, env: list[str]) -> list[str]:
        self.count += 1
        # a rootfs per container: the hook's ldconfig writes the container's ld.so.cache
        rootfs = self.d.dir / "rootfs" / str(self.count)
        shutil.copytree(self.rootfs, rootfs, symlinks=True)
        # runc's state and the I/O fifos under the test's own dir, not /run/containerd
        args = ["--runtime", self.runtime, "--runc-binary", self.binary,
                "--runc-root", str(self.d.dir / "runc"), "--fifo-dir", str(self.d.dir / "fifo")]
        for e in [relkit.PATH_ENV, *env]:
            args += ["--env", e]
        # --rootfs is a switch: the first positional is then the rootfs dir
        return [*args, "--rootfs", str(rootfs)]

    def start(self, cid: str, env: list[str]) -> None:
        r = self.d.ctr("run", "-d", *self._args(env), cid, "sleep", "100000", timeout=90)
        assert r.returncode == 0, r.stderr

    def once(self, env: list[str], *cmd: str) -> str:
        args = self._args(env)
        r = self.d.ctr("run", "--rm", *args, f"rst-new-{self.count}", *cmd, timeout=90)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def tasks(self) -> dict[str, tuple[int, str]]:
        """id -> (pid, status), from `ctr task ls`."""
        r = self.d.ctr("task", "ls")
        assert r.returncode == 0, r.stderr
        rows = [li.split() for li in r.stdout.splitlines()[1:]]
        return {x[0]: (int(x[1]), x[2]) for x in rows if len(x) == 3}

    def exec(self, cid: str, *cmd: str) -> str:
        self.count += 1
        r = self.d.ctr("task", "exec", "--exec-id", f"q{self.count}", cid, *cmd)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def remove(self, cid: str) -> None:
        self.d.ctr("task", "kill", "-s", "SIGKILL", cid)
        wait.until(lambda: self.tasks().get(cid, (0, "STOPPED"))[1] == "STOPPED", 30,
                          f"task {cid} to stop")
        self.d.ctr("task", "delete", cid)
        self.d.ctr("container", "delete", cid)


def _check_survivors(pids: dict[str, int], now: dict[str, int]) -> None:
    """Every container still runs as the same process, its GPU mounts in place."""
    assert now == pids, (now, pids)
    for cid, pid in pids.items():
        assert _alive(pid), cid
        assert _gpu_mounted(pid), f"{cid}: libcuda no longer mounted"


def _kill_leftovers(pids: dict[str, int]) -> None:
    """After a failure that left a daemon down: the containers' sleeps, which outlive
    their shims, killed by pid (only while the pid is still that sleep)."""
    for pid in pids.values():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\0" + b"100000\0":
                os.kill(pid, signal.SIGKILL)


def _assert_clean(sim: SimHost, work: Path, host_mounts: list[str],
                  pids: dict[str, int]) -> None:
    # the poststop hooks removed the vGPU state: no gc first
    assert relkit.state_entries(_state_dir(sim)) == []
    assert relkit.mounts_under(_state_dir(sim)) == []
    assert relkit.mounts_from(work, sim.root) == host_mounts
    assert not [p for p in pids.values() if _alive(p)]
    assert _ours(str(work)) == []


def test_containerd_restart_keeps_gpu_containers(sim: SimHost, image_rootfs: str,
                                                 work: Path) -> None:
    _need("containerd", "ctr", "runc")
    count, restarts = relkit.n(3, 8), relkit.n(2, 10)
    gpus = sim.topology.gpus
    cfg, runtime, binary = _ctd_config(work)
    env = {**os.environ, **sim.env}
    host_mounts = relkit.mounts_from(work, sim.root)
    ids = [f"rst-{i}" for i in range(count)]
    pids: dict[str, int] = {}
    up_s: list[float] = []
    survived = new_starts = 0
    with containerd(work, env=sim.env, config=cfg) as d:
        ctr = Ctr(d, image_rootfs, runtime, binary)
        try:
            for i, cid in enumerate(ids):
                # the first one capped: its vGPU state must outlive the restarts
                ctr.start(cid, [f"NVIDIA_VISIBLE_DEVICES={i % len(gpus)}",
                                *([CAP] if i == 0 else [])])
            tasks = ctr.tasks()
            assert all(tasks[c][1] == "RUNNING" for c in ids), tasks
            pids = {c: tasks[c][0] for c in ids}
            _check_survivors(pids, pids)
            state = relkit.state_entries(_state_dir(sim))
            assert len(state) == 1 and state[0].endswith("-rst-0"), state
            for r in range(restarts):
                d.proc = _restart(d.proc, SIGNALS[r % 2], d.dir / "containerd.log", env)
                up_s.append(_wait_up(lambda: d.ctr("version").returncode == 0,
                                     "containerd back", d.dir / "containerd.log"))
                tasks = ctr.tasks()
                assert all(tasks[c][1] == "RUNNING" for c in ids), tasks
                _check_survivors(pids, {c: tasks[c][0] for c in ids})
                survived += count
                # the capped one still capped; its state not collected as an orphan's
                assert ctr.exec("rst-0", *QUERY) == _query_line(gpus[0].uuid, 512)
                _gc(sim)
                assert relkit.state_entries(_state_dir(sim)) == state
                g = r % len(gpus)
                out = ctr.once([f"NVIDIA_VISIBLE_DEVICES={g}", "CUDA_DEVICE_MEMORY_LIMIT=256m"],
                               *QUERY)
                assert out == _query_line(gpus[g].uuid, 256)
                new_starts += 1
        finally:
            for cid in ids if d.proc.poll() is None else []:  # ctr hangs on a dead socket
                with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                    ctr.remove(cid)
            _kill_leftovers(pids)
        assert ctr.tasks() == {}
        wait.until(lambda: not _ours(str(work), d.proc.pid), 30, "the shims to exit")
    _assert_clean(sim, work, host_mounts, pids)
    relkit.record("fault", "containerd restarted under running GPU containers",
                  injected=restarts, containers=count, survived=survived,
                  new_starts=new_starts, lost=restarts * count - survived, leaks=0,
                  back_up_ms_max=round(1000 * max(up_s), 1))


# ---------------------------------------------------------------- dockerd


def _inspect(dk: Dockerd, cids: list[str]) -> dict[str, int]:
    """id -> pid of the running ones."""
    r = dk.docker("inspect", "-f", "{{.Id}} {{.State.Running}} {{.State.Pid}}", *cids)
    assert r.returncode == 0, r.stderr.decode()
    rows = [li.split() for li in r.stdout.decode().splitlines()]
    return {x[0]: int(x[2]) for x in rows if x[1] == "true"}


def _live_restore_config(work: Path) -> Path:
    """dockerd's daemon.json with live-restore, configured by `nvctk configure`."""
    cfg = work / "daemon.json"
    cfg.write_text(json.dumps({"live-restore": True}, indent=2) + "\n")
    _nvctk_configure("docker", cfg)
    conf = json.loads(cfg.read_text())
    assert conf["live-restore"] is True and conf["runtimes"]["nvidia"]["path"] == relkit.RUNTIME
    return cfg


def _assert_capped_query(dk: Dockerd, cid: str, uuid: str) -> None:
    """The first container, still running, still sees its GPU with its 512 MiB cap."""
    q = dk.docker("exec", cid, *QUERY)
    assert q.returncode == 0, q.stderr.decode()
    assert q.stdout.decode().strip() == _query_line(uuid, 512)


def test_dockerd_live_restore_keeps_gpu_containers(sim: SimHost, image_rootfs: str,
                                                   work: Path) -> None:
    _need("containerd", "ctr", "dockerd", "docker", "runc")
    count, restarts = relkit.n(3, 8), relkit.n(2, 10)
    gpus = sim.topology.gpus
    cfg = _live_restore_config(work)
    host_mounts = relkit.mounts_from(work, sim.root)
    image = "nvctk-restart:latest"
    ids: list[str] = []
    pids: dict[str, int] = {}
    up_s: list[float] = []
    survived = new_starts = 0

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return dk.docker("run", "--network", "none", "--runtime", "nvidia", *args)

    with containerd(work / "ctd", env=sim.env) as ctd, \
            dockerd(work / "dk", ctd, {}, config=cfg) as dk:
        import_rootfs(dk, Path(image_rootfs), image)
        try:
            for i in range(count):
                r = run("-d", "-e", f"NVIDIA_VISIBLE_DEVICES={i % len(gpus)}",
                        *(["-e", CAP] if i == 0 else []), image, "sleep", "100000")
                assert r.returncode == 0, r.stderr.decode()
                ids.append(r.stdout.decode().strip())
            pids = _inspect(dk, ids)
            assert len(pids) == count, pids
            _check_survivors(pids, pids)
            state = relkit.state_entries(_state_dir(sim))
            assert len(state) == 1 and state[0].endswith("-" + ids[0]), state
            for r_ in range(restarts):
                dk.proc = _restart(dk.proc, SIGNALS[r_ % 2], dk.dir / "dockerd.log",
                                   dict(os.environ))
                up_s.append(_wait_up(lambda: dk.docker("version").returncode == 0,
                                     "dockerd back", dk.dir / "dockerd.log"))
                _check_survivors(pids, _inspect(dk, ids))
                survived += count
                _assert_capped_query(dk, ids[0], gpus[0].uuid)
                _gc(sim)
                assert relkit.state_entries(_state_dir(sim)) == state
                g = r_ % len(gpus)
                res = run("--rm", "-e", f"NVIDIA_VISIBLE_DEVICES={g}", "-e",
                          "CUDA_DEVICE_MEMORY_LIMIT=256m", image, *QUERY)
                assert res.returncode == 0, res.stderr.decode()
                assert res.stdout.decode().strip() == _query_line(gpus[g].uuid, 256)
                new_starts += 1
        finally:
            if ids and dk.proc.poll() is None:
                dk.docker("rm", "-f", *ids)
            _kill_leftovers(pids)
        assert dk.docker("ps", "-aq").stdout.decode().split() == []
        wait.until(lambda: not _ours(str(work), ctd.proc.pid, dk.proc.pid), 30,
                          "the shims to exit")
    _assert_clean(sim, work, host_mounts, pids)
    relkit.record("fault", "dockerd restarted (live-restore) under running GPU containers",
                  injected=restarts, containers=count, survived=survived,
                  new_starts=new_starts, lost=restarts * count - survived, leaks=0,
                  back_up_ms_max=round(1000 * max(up_s), 1))
