"""Real containerd and dockerd, started by tests on private sockets and state dirs.

Each daemon gets its own root, state and socket under a temp dir, is stopped
(and its leftover mounts and shims reaped) when the context exits, and never
touches the host's default daemons.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import wait

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.sim.host import SimHost


@contextlib.contextmanager
def short_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory under /tmp, removed after: a daemon's socket paths under it
    must fit in sun_path (108 bytes), which pytest's tmp_path may not leave room for."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def private_paths(workdir: Path) -> dict[str, object]:
    """The settings that keep a containerd of a test off the host's paths and sockets."""
    sock = workdir / "containerd.sock"
    return {
        "root": f"{workdir}/root", "state": f"{workdir}/state",
        "grpc": {"address": str(sock)}, "ttrpc": {"address": f"{sock}.ttrpc"},
        "debug": {"address": ""}, "metrics": {"address": ""},
    }


def _wait_for(predicate, timeout: float, what: str, log: Path) -> None:
    try:
        wait.until(predicate, timeout, f"{what} to come up")
    except AssertionError as e:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise TimeoutError(f"{e}; log tail:\n{tail}") from None


def umount_below(path: Path) -> None:
    """Lazy-unmount whatever a daemon left mounted under path, deepest first."""
    prefix = str(path)
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == prefix or mp.startswith(prefix + "/"):
                mounts.append(mp)
    for mp in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)


def _kill_shims(root: Path) -> None:
    """containerd-shim processes outlive containerd; kill those of this root."""
    _kill_mentioning(root, lambda exe: b"containerd-shim" in exe)


def _kill_mentioning(root: Path, is_it: Callable[[bytes], bool]) -> None:
    """SIGKILL the processes whose executable is_it() and whose argv names root."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline and is_it(cmdline[0]) and any(str(root).encode() in arg for arg in cmdline):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Containerd:
    dir: Path
    socket: Path
    proc: subprocess.Popen
    bin_dir: Path | None = None

    def ctr(self, *args: str, timeout: float = 60, check: bool = False,
            namespace: str = "nvctk-test") -> subprocess.CompletedProcess[str]:
        ctr = str(self.bin_dir / "ctr") if self.bin_dir else "ctr"
        return subprocess.run(
            [ctr, "-a", str(self.socket), "-n", namespace, *args],
            capture_output=True, text=True, timeout=timeout, check=check,
        )


@contextlib.contextmanager
def containerd(workdir: Path, env: dict[str, str] | None = None,
               config: Path | None = None, bin_dir: Path | None = None) -> Iterator[Containerd]:
    """containerd with its own root/state/socket; `env` is what its shims (and
    so the runtimes they call) inherit, e.g. NVCTK_CONFIG for a simulated host.
    `config`: a config file of the caller's, which must put root, state and the
    sockets under workdir (see private_paths); else one without the CRI plugin.
    `bin_dir`: another containerd's binaries (e.g. 2.3.4's), first on its PATH so that
    it starts its own shim."""
    workdir.mkdir(parents=True, exist_ok=True)
    sock = workdir / "containerd.sock"
    cfg = config or workdir / "config.toml"
    if config is None:
        cfg.write_text(
            f'version = 2\nroot = "{workdir}/root"\nstate = "{workdir}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n'
            '[debug]\n  address = ""\n[metrics]\n  address = ""\n'
        )
    log = workdir / "containerd.log"
    exe = str(bin_dir / "containerd") if bin_dir else "containerd"
    full_env = peer_env(bin_dir, env) if bin_dir else {**os.environ, **(env or {})}
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [exe, "--config", str(cfg)],
            stdout=logf, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
        )
    daemon = Containerd(workdir, sock, proc, bin_dir)
    try:
        _wait_for(
            lambda: sock.exists() and daemon.ctr("version").returncode == 0, 30, "containerd", log
        )
        yield daemon
    finally:
        _stop(daemon.proc, 10)  # a test may have restarted it
        _kill_shims(workdir)
        umount_below(workdir)


@dataclass
class Dockerd:
    dir: Path
    host: str
    proc: subprocess.Popen

    def docker(self, *args: str, timeout: float = 120, input: bytes | None = None,
               ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [shutil.which("docker", path="/usr/bin") or "docker", "-H", self.host, *args],
            capture_output=True, timeout=timeout, input=input,
        )


@contextlib.contextmanager
def dockerd(workdir: Path, ctd: Containerd, runtimes: dict[str, str],
            path_prepend: str = "", config: Path | None = None) -> Iterator[Dockerd]:
    """dockerd on a private socket and data root, using the test's containerd.
    `runtimes` maps names to runtime binaries (daemon.json "runtimes");
    `config`: a daemon.json of the caller's, used as it is instead."""
    import json

    workdir.mkdir(parents=True, exist_ok=True)
    cfg = config or workdir / "daemon.json"
    if config is None:
        cfg.write_text(json.dumps({
            "runtimes": {name: {"path": p, "runtimeArgs": []} for name, p in runtimes.items()},
        }))
    host = f"unix://{workdir}/docker.sock"
    log = workdir / "dockerd.log"
    env = dict(os.environ)
    if path_prepend:
        env["PATH"] = path_prepend + ":" + env.get("PATH", "/usr/bin:/bin")
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            ["dockerd", "--data-root", f"{workdir}/data", "--exec-root", f"{workdir}/exec",
             "--pidfile", f"{workdir}/docker.pid", "-H", host, "--bridge=none",
             "--iptables=false", "--ip-masq=false", "--config-file", str(cfg),
             "--containerd", str(ctd.socket), "--containerd-namespace", "nvctk-moby",
             "--containerd-plugins-namespace", "nvctk-moby-plugins"],
            stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    daemon = Dockerd(workdir, host, proc)
    try:
        _wait_for(lambda: daemon.docker("version").returncode == 0, 60, "dockerd", log)
        yield daemon
    finally:
        _stop(daemon.proc, 20)  # a test may have restarted it
        umount_below(workdir)


def import_rootfs(daemon: Dockerd, rootfs: Path, tag: str) -> None:
    """docker import of a directory tree as a single-layer image."""
    tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True, check=True)
    res = daemon.docker("import", "-", tag, input=tar.stdout)
    if res.returncode != 0:
        raise RuntimeError(f"docker import failed: {res.stderr.decode()}")


# --- the peers in ../shared: containerd 2.3.4 and CRI-O 1.36.3 -----------------------

SHARED = Path(__file__).resolve().parents[3] / "shared"
CONTAINERD_2_TAR = SHARED / "peers" / "containerd" / "containerd-2.3.4-linux-amd64.tar.xz"
CRIO_TAR = SHARED / "peers" / "crio" / "crio-1.36.3-linux-amd64.tar.xz"


def unpack_peer(tarball: Path, dest: Path) -> Path | None:
    """The peer's binaries unpacked into dest (a test's own dir), None when ../shared
    lacks it (the caller skips, saying so)."""
    if not tarball.is_file():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-C", str(dest), "-xJf", str(tarball)], check=True)
    return dest


def peer_env(bin_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment with bin_dir first on PATH: containerd 2.3.4 must find its own
    shim, not Debian's."""
    base = {**os.environ, **(env or {})}
    return {**base, "PATH": f"{bin_dir}:{base.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}


CRIO_EXAMPLE = SHARED / "peers" / "crio" / "crio.conf.example"


def crio_config(workdir: Path, pause_image: str, bin_dir: Path) -> Path:
    """../shared's private CRI-O config for workdir (its socket, storage, state there),
    with an empty conf.d beside it."""
    text = (CRIO_EXAMPLE.read_text().replace("@DIR@", str(workdir))
            .replace("@PAUSE_IMAGE@", pause_image)
            # "": the pause image's own entrypoint
            .replace("@PAUSE_COMMAND@", ""))
    text = text.replace(f'pinns_path = "{workdir}/bin/pinns"', f'pinns_path = "{bin_dir}/pinns"')
    (workdir / "conf.d").mkdir(parents=True, exist_ok=True)
    (workdir / "policy.json").write_text('{"default":[{"type":"insecureAcceptAnything"}]}\n')
    cfg = workdir / "crio.conf"
    cfg.write_text(text)
    return cfg


def crio_dump(bin_dir: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    """`crio config`: CRI-O's reading of crio.conf and conf.d, as TOML."""
    return subprocess.run([str(bin_dir / "crio"), "--config", str(workdir / "crio.conf"),
                           "--config-dir", str(workdir / "conf.d"), "config"],
                          capture_output=True, text=True, timeout=60, env=peer_env(bin_dir))


@dataclass
class Crio:
    dir: Path
    socket: Path
    proc: subprocess.Popen


@contextlib.contextmanager
def crio(workdir: Path, bin_dir: Path) -> Iterator[Crio]:
    """CRI-O 1.36.3 on crio_config's private paths (write it, and load images, first)."""
    sock = workdir / "crio.sock"
    log = workdir / "crio.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [str(bin_dir / "crio"), "--config", str(workdir / "crio.conf"),
             "--config-dir", str(workdir / "conf.d")],
            stdout=logf, stderr=subprocess.STDOUT, env=peer_env(bin_dir), start_new_session=True)
    daemon = Crio(workdir, sock, proc)
    try:
        _wait_for(lambda: sock.exists() or proc.poll() is not None, 60, "crio", log)
        if proc.poll() is not None:
            raise RuntimeError(f"crio exited {proc.returncode}: {log.read_text()[-2000:]}")
        yield daemon
    finally:
        _stop(proc, 20)
        _kill_conmons(workdir)
        umount_below(workdir)


def _kill_conmons(root: Path) -> None:
    _kill_mentioning(root, lambda exe: exe.endswith(b"conmon"))


def need(*tools: str, starts: str = "containerd") -> None:
    """Skip, saying why, unless root and every tool is on PATH (make test installs them)."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: starts {starts}")
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (make test installs them)")


def configured_containerd(cd: Path, pause: str) -> Path:
    """cd/config.toml: a CRI config of containerd's (pause image `pause`) with nvctk's
    runtimes added by `nvctk configure`, as an operator would do it."""
    from support.cri import containerd_cri_config
    from support.exe import nvctk_exe

    cd.mkdir()
    cfg = cd / "config.toml"
    cfg.write_text(containerd_cri_config(cd, pause))
    r = subprocess.run([*nvctk_exe(), "configure", "--runtime", "containerd", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return cfg


@contextlib.contextmanager
def peer_bin(tarball: Path, prefix: str) -> Iterator[Path]:
    """The binaries of a peer's release tarball (../shared/peers/...), unpacked into a
    short temp dir for the with-block; skips, saying which, when the tarball is absent."""
    with short_dir(prefix) as d:
        got = unpack_peer(tarball, d / "bin")
        if got is None:
            pytest.skip(f"{tarball} is absent (../shared/peers/{tarball.parent.name})")
        yield got


def import_images(daemon: Containerd, *tars: Path) -> None:
    """Image archives into the CRI's namespace (k8s.io), as a kubelet's images are."""
    for tar in tars:
        res = daemon.ctr("images", "import", str(tar), namespace="k8s.io")
        assert res.returncode == 0, res.stderr


def containerd_workdir(prefix: str) -> Callable[[], Iterator[Path]]:
    """A module's fixture `work = containerd_workdir(prefix)`: a short work dir for the
    module's own containerd (sockets have short paths); skips without root or
    containerd's tools."""
    @pytest.fixture(scope="module")
    def work() -> Iterator[Path]:
        need("containerd", "ctr", "runc", "containerd-shim-runc-v2")
        with short_dir(prefix) as d:
            yield d

    return work


@contextlib.contextmanager
def gpu_containerd(work: Path, sim: SimHost, pause: str, image: str, env: dict[str, str],
                   edit_config: Callable[[Path], None] | None = None,
                   add_files: Callable[[Path], None] | None = None) -> Iterator[Containerd]:
    """containerd in work/ctd, configured by `nvctk configure` for the simulated host
    sim (edit_config may change its config.toml then), with the Pods' pause image and
    `image` imported: the sim's rootfs with its CUDA sample (add_files may put more in
    it) and environment env."""
    from nvctk.sim.rootfs import build_rootfs
    from support.cri import image_archive, pause_image

    cd = work / "ctd"
    cfg = configured_containerd(cd, pause)
    if edit_config is not None:
        edit_config(cfg)
    with containerd(cd, env=sim.env, config=cfg) as daemon:
        root = Path(build_rootfs(str(work / "gpu"), with_sample=sim.sample))
        if add_files is not None:
            add_files(root)
        import_images(daemon, pause_image(work, pause),
                      image_archive(root, image, work / "gpu.tar", env=env))
        yield daemon


class SupervisedContainerd:
    """containerd (bin_dir's) started again each time it exits, until stop_file exists:
    what a node's service manager (systemd's Restart=always) does, which `nvctk configure
    --restart-mode signal` relies on (containerd exits on SIGHUP)."""

    def __init__(self, work: Path, bin_dir: Path, config: Path, sock: str) -> None:
        self.work, self.config, self.sock = work, config, sock
        self.stop_file = work / "stop"
        loop = (f'while [ ! -e "{self.stop_file}" ]; do "{bin_dir}/containerd" --config '
                f'"{config}" >>"{work}/containerd.log" 2>&1; done')
        self.proc = subprocess.Popen(["sh", "-c", loop], env=peer_env(bin_dir),
                                     start_new_session=True)

    def pid(self) -> int:
        from nvctk.engines import restart

        return restart.engine_pid(self.sock)

    def close(self) -> None:
        from nvctk.engines import restart

        self.stop_file.touch()
        with contextlib.suppress(restart.EngineError, ProcessLookupError):
            os.kill(self.pid(), signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        _kill_shims(self.work)


@contextlib.contextmanager
def supervised_containerd(work: Path, bin_dir: Path, config: Path, sock: str
                          ) -> Iterator[SupervisedContainerd]:
    """A SupervisedContainerd, up (its CRI answering) for the with-block."""
    from nvctk.engines import restart

    work.mkdir(parents=True, exist_ok=True)
    s = SupervisedContainerd(work, bin_dir, config, sock)
    try:
        restart.wait_for(restart.Restart("containerd", socket=sock, timeout=60), "runc", True)
        yield s
    finally:
        s.close()
