#!/usr/bin/env python3
"""GPU container start cost: nvctk-runtime side by side with runc and NVIDIA's toolkit.

Run as root from the repo with the venv set up (`make bench`; `--quick` for a
one-minute run). Everything runs on one simulated 8-GPU host built in a temp dir.

Each container goes through the lifecycle containerd's shim drives, every step
through the runtime under test:

    <rt> create --bundle B --pid-file P ID -> <rt> start ID -> wait -> <rt> delete ID

(with `--root R --log L --log-format json` before each subcommand, as the shim
passes them) of a container running `true`. The bench process is a child
subreaper (PR_SET_CHILD_SUBREAPER), so the container's init becomes its child
when `create` exits; "wait" is waitpid() on the pid from the pid file, and the
exit status must be 0. Each container gets a fresh bundle directory and a fresh
overlay (lower: the image rootfs on disk, upper on tmpfs) as under a real engine,
so no run sees what an earlier one wrote into its bundle or rootfs; preparing and
removing them is not timed. Bundles, runtime state and upper dirs live on a tmpfs.
Every bundle, of every case (nvctk's, NVIDIA's, runc's), carries the binds a kubelet
gives each container through containerd's CRI (kubelet_binds: /etc/hosts,
/etc/resolv.conf, /etc/hostname, /dev/termination-log, the service-account
directory), so the bench measures what a node meets; `runc spec`'s own mounts bind
nothing of the host's.

Cases, interleaved round-robin so drift hits all alike:
- runc, no GPU: the baseline; overhead = a case's median minus this one's;
- nvctk-runtime, 1 GPU (default capabilities), 1 GPU with
  NVIDIA_DRIVER_CAPABILITIES=all, all 8 GPUs; and in CDI mode (mode = "cdi", the spec
  from `nvctk cdi generate`, made once, up front), 1 GPU;
- NVIDIA Container Toolkit (../shared/peers/nct) nvidia-container-runtime in
  `cdi` mode (spec from `nvidia-ctk cdi generate`, once, up front) and in `jit-cdi`
  mode, 1 GPU; the sim's shared state mount (/run/nvidia-sim), which nvctk adds
  from its config's extra-mounts, is written into NCT's bundles by hand. The bench
  runs where /sys shows the sim's PCI devices (support.sim.show_sim_pci), so NCT
  finds each GPU's DRM nodes as on a real host; one more NCT cdi case uses its spec
  made before that (no DRM nodes: what earlier runs of this bench compared with).
  Skipped, with a message, when NCT is absent;
- where nvctk's start goes: `nvctk-runtime create` alone (its low-level runtime
  /bin/true), and plain runc through the lifecycle on the spec the shim wrote,
  without and with the hook (the spec is made, untimed, for each run). Under plain
  runc no nvctk-runtime serves the hook (nvctk.hook.served): it runs by itself, a
  Python start of its own; the served hook's share is what the 1-GPU case has over
  the shim alone and runc on the edited spec without the hook;
- passthrough: `<rt> list` (one created container in the root) through runc,
  nvctk-runtime, nvidia-container-runtime, and a bare interpreter start.

Before timing, each case runs once with a validation command (`ls` of the GPU
device nodes, `nvidia-smi -L`, the service account's namespace file) whose output
must show the requested GPUs and the kubelet's binds, so a broken case cannot look
fast. NCT reads its config from
NVIDIA_CTK_CONFIG_FILE_PATH (nothing is written to /etc). Reports medians and
p90s, and the ratios the README reports, to stdout and, with --out, to a file.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml  # reads nvctk's JSON spec as well as NCT's YAML

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # support.podman, support.sim

from nvctk.runtime.passthrough import use_cache_dir  # noqa: E402
from nvctk.sim import host as simhost  # noqa: E402
from nvctk.sim.rootfs import build_rootfs  # noqa: E402
from nvctk.sim.topology import make_topology  # noqa: E402
from support.podman import private_podman  # noqa: E402
from support.sim import show_sim_pci  # noqa: E402

VENV_BIN = REPO / ".venv" / "bin"
NCT_DEFAULT = REPO.parent / "shared" / "peers" / "nct"
PR_SET_CHILD_SUBREAPER = 36
GPUS = 8


SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SA_NAMESPACE = "nvctk-bench"


def validate_cmd(smi: bool) -> list[str]:
    """The validation run's command: the GPU device nodes, nvidia-smi's GPU list, and
    the namespace file of the service account the kubelet's binds bring in."""
    return ["/bin/sh", "-c", "ls -d /dev/nvidia[0-9]* 2>/dev/null; "
            + ("nvidia-smi -L; " if smi else "") + f"echo; cat {SA_DIR}/namespace"]


def kubelet_binds(d: Path) -> list[dict]:
    """The binds a kubelet gives every container (containerd's CRI writes them so):
    the pod's hosts, resolv.conf and hostname files, the container's termination log,
    and the service account's token directory (read-only), their sources made in d."""
    d.mkdir()
    for name, text in (("hosts", "127.0.0.1 localhost\n"),
                       ("resolv.conf", "nameserver 10.96.0.10\nsearch svc.cluster.local\n"),
                       ("hostname", "bench-pod\n"), ("termination-log", "")):
        (d / name).write_text(text)
    sa = d / "serviceaccount"
    sa.mkdir()
    for name, text in (("token", "x" * 900), ("ca.crt", "-----BEGIN CERTIFICATE-----\n"),
                       ("namespace", SA_NAMESPACE)):
        (sa / name).write_text(text)
    rw, ro = ["rbind", "rprivate", "rw"], ["rbind", "rprivate", "ro"]
    return [{"destination": at, "type": "bind", "source": str(d / name), "options": opts}
            for at, name, opts in (("/etc/hosts", "hosts", rw),
                                   ("/etc/resolv.conf", "resolv.conf", rw),
                                   ("/etc/hostname", "hostname", rw),
                                   ("/dev/termination-log", "termination-log", rw),
                                   (SA_DIR, "serviceaccount", ro))]


@dataclass(frozen=True)
class Runtime:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]


@dataclass
class Case:
    """One timed case: `timed()` makes what it needs untimed and returns seconds taken."""

    label: str
    timed: Callable[[], float]
    samples: list[float] = field(default_factory=list)


def set_subreaper() -> None:
    # orphaned container inits (runc create exits, leaving the container's init
    # behind) are re-parented to us, so we can waitpid() them as a shim does
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_strays() -> None:
    """Reap re-parented orphans nobody waits for (e.g. a hook's double-forked child)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pctl(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[max(0, math.ceil(q * len(s)) - 1)]


class Bench:
    def __init__(self, run_dir: Path, lower: Path) -> None:
        self.run_dir = run_dir
        self.root = run_dir / "state"  # the runtimes' --root
        self.log = run_dir / "runtime-log.json"
        self.lower = lower
        self.count = 0
        self.errfile = run_dir / "stderr"

    def _run(self, argv: list[str], env: dict[str, str], what: str) -> None:
        # never a pipe: the container inherits create's stdio and would hold it open
        with open(self.errfile, "wb") as err:
            rc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err).returncode
        if rc != 0:
            raise RuntimeError(f"{what}: {' '.join(argv)} exited {rc}: "
                               f"{self.errfile.read_text(errors='replace').strip()[-2000:]}")

    def rt(self, rt: Runtime, *args: str) -> list[str]:
        return [*rt.argv, "--root", str(self.root), "--log", str(self.log),
                "--log-format", "json", *args]

    def new_bundle(self, spec: dict) -> tuple[str, Path]:
        """A fresh bundle dir and rootfs overlay for one container (untimed)."""
        self.count += 1
        cid = f"c{self.count}"
        b = self.run_dir / "b" / cid
        for d in ("rootfs", "upper", "work"):
            (b / d).mkdir(parents=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={self.lower},upperdir={b / 'upper'},workdir={b / 'work'}",
                        str(b / "rootfs")], check=True)
        s = json.loads(json.dumps(spec))
        s["root"] = {"path": str(b / "rootfs"), "readonly": False}
        (b / "config.json").write_text(json.dumps(s))
        return cid, b

    def drop_bundle(self, b: Path) -> None:
        subprocess.run(["umount", str(b / "rootfs")], check=True)
        shutil.rmtree(b)

    def lifecycle(self, rt: Runtime, cid: str, b: Path, out: Path | None = None) -> float:
        """create -> start -> waitpid -> delete, all through `rt`; seconds taken."""
        pid_file = b / "init.pid"
        t0 = time.perf_counter()
        if out is None:
            self._run(self.rt(rt, "create", "--bundle", str(b), "--pid-file", str(pid_file),
                              cid), rt.env, f"{rt.name} create")
        else:  # validation: the container's stdout goes to a file
            with open(out, "wb") as f:
                rc = subprocess.run(self.rt(rt, "create", "--bundle", str(b), "--pid-file",
                                            str(pid_file), cid),
                                    env=rt.env, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RuntimeError(f"{rt.name} create exited {rc}: {out.read_text()[-2000:]}")
        pid = int(pid_file.read_text())
        try:
            self._run(self.rt(rt, "start", cid), rt.env, f"{rt.name} start")
            _, status = os.waitpid(pid, 0)
        except BaseException:
            self.force_delete(cid)
            raise
        self._run(self.rt(rt, "delete", cid), rt.env, f"{rt.name} delete")
        dt = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise RuntimeError(f"{rt.name}: the container exited {code}")
        return dt

    def force_delete(self, cid: str) -> None:
        subprocess.run(["runc", "--root", str(self.root), "delete", "--force", cid],
                       capture_output=True)

    def cleanup(self) -> None:
        if self.root.is_dir():
            ids = subprocess.run(["runc", "--root", str(self.root), "list", "-q"],
                                 capture_output=True, text=True).stdout.split()
            for cid in ids:
                self.force_delete(cid)
        reap_strays()


def plain_spec(env: list[str], args: list[str], mounts: list[dict] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:  # `runc spec` writes <d>/config.json
        subprocess.run(["runc", "spec", "--bundle", d], check=True)
        spec = json.loads((Path(d) / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] = ["PATH=/usr/local/bin:/usr/bin:/bin", *env]
    spec["mounts"] = [*spec["mounts"], *(mounts or [])]
    return spec


def spec_nodes(path: Path, device: str = "0") -> str:
    """The container paths of a CDI spec's device nodes for `device`, as one string."""
    spec = yaml.safe_load(path.read_text())
    edits = [spec.get("containerEdits", {}),
             *(d["containerEdits"] for d in spec["devices"] if d["name"] == device)]
    return " ".join(sorted(n["path"] for e in edits for n in e.get("deviceNodes", ())))


def with_config_line(text: str, key: str, value: str) -> str:
    """`text` (TOML) with top-level `key` set to `value`: replaced where it is, else put
    first (a key appended at the end could land in a [table])."""
    line = f"{key} = {value}"
    lines = text.splitlines()
    found = [i for i, ln in enumerate(lines) if ln.split("=")[0].strip() == key]
    for i in found:
        lines[i] = line
    return "\n".join(lines if found else [line, *lines]) + "\n"


NODRM = "cdi without DRM"  # NCT cdi mode, its spec made where /sys lacks the sim's GPUs


def nct_generate(nct_bin: Path, sim_root: str, out: Path) -> None:
    """`nvidia-ctk cdi generate` for the simulated host into `out`."""
    out.parent.mkdir()
    subprocess.run([str(nct_bin / "nvidia-ctk"), "cdi", "generate",
                    f"--driver-root={sim_root}", f"--dev-root={sim_root}",
                    f"--nvidia-cdi-hook-path={nct_bin / 'nvidia-cdi-hook'}",
                    f"--output={out}"], check=True, capture_output=True)


def nct_config(mode: str, sim: str, spec_dir: Path, nct_bin: Path) -> str:
    return f"""accept-nvidia-visible-devices-envvar-when-unprivileged = true
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"
[nvidia-container-cli]
root = "{sim}"
ldconfig = "@/sbin/ldconfig"
load-kmods = false
[nvidia-container-runtime]
log-level = "info"
mode = "{mode}"
runtimes = ["runc"]
[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["{spec_dir}"]
[nvidia-ctk]
path = "{nct_bin / 'nvidia-ctk'}"
"""

# podman: the CDI specs go to /var/run/cdi (podman 4.3 reads no other dir) under vendors
# of the bench's own
PODMAN_SPEC_DIR = Path("/var/run/cdi")


class Podman:
    """`podman run --rm --device KIND=0 IMAGE true` with private storage, one image
    imported from the bench's rootfs; close() removes all of it and the specs."""

    def __init__(self, exe: str, rootfs: Path) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="nvctk-bp-", dir="/tmp"))  # short: runroot
        dirs, self.env, self.base = private_podman(exe, self.work)
        self.specs: list[Path] = []
        self.image = "localhost/nvctk-bench:latest"
        tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True,
                             check=True).stdout
        # the import caches blob digests under /var/lib/containers: a /var/lib of its own
        subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                        'mount --bind "$0" /var/lib; exec "$@"', str(dirs["varlib"]),
                        *self.base, "import", "-", self.image], input=tar, env=self.env,
                       capture_output=True, check=True)

    def add_spec(self, data: bytes, name: str) -> None:
        PODMAN_SPEC_DIR.mkdir(parents=True, exist_ok=True)
        p = PODMAN_SPEC_DIR / name
        p.write_bytes(data)
        self.specs.append(p)

    def run(self, kind: str, args: list[str]) -> str:
        r = subprocess.run([*self.base, "run", "--rm", "--network", "none", "--device",
                            f"{kind}=0", self.image, *args], env=self.env,
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"podman run --device {kind}=0 exited {r.returncode}: "
                               f"{r.stderr[-2000:]}")
        return r.stdout

    def close(self) -> None:
        for p in self.specs:
            p.unlink(missing_ok=True)
        for what in (["rm", "--all", "--force"], ["rmi", "--all", "--force"]):
            subprocess.run([*self.base, *what], env=self.env, capture_output=True, timeout=120)
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4]
                if mp.startswith(str(self.work) + "/"):
                    mounts.append(mp)
        for mp in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)


def podman_cases(tmp: Path, cfg: Path, sim_root: str, nct_bin: Path | None,
                 say: Callable[[str], None]) -> tuple[list[Case], Podman | None]:
    """`podman run --device K=0 IMAGE true` with nvctk's spec and with NCT's (same
    host, same image), for the bench's podman rows; none when podman is absent."""
    exe = shutil.which("podman")
    if exe is None:
        say("podman not found: its rows are skipped")
        return [], None
    pm = Podman(exe, tmp / "rootfs")
    tag = os.urandom(4).hex()
    kinds = {"nvctk": f"b{tag}.nvctk.bench/gpu"}
    out = subprocess.run([str(VENV_BIN / "nvctk"), "cdi", "generate", "--vendor",
                          f"b{tag}.nvctk.bench", "--class", "gpu"],
                         env={**os.environ, "NVCTK_CONFIG": str(cfg)}, check=True,
                         capture_output=True).stdout
    pm.add_spec(out, f"nvctk-bench-{tag}.yaml")
    if nct_bin is not None:
        kinds["NCT"] = f"b{tag}.nct.bench/gpu"
        nct_out = tmp / "nct-podman.yaml"
        subprocess.run([str(nct_bin / "nvidia-ctk"), "cdi", "generate",
                        f"--driver-root={sim_root}", f"--dev-root={sim_root}",
                        f"--nvidia-cdi-hook-path={nct_bin / 'nvidia-cdi-hook'}",
                        f"--vendor=b{tag}.nct.bench", "--class=gpu", f"--output={nct_out}"],
                       check=True, capture_output=True)
        pm.add_spec(nct_out.read_bytes(), f"nct-bench-{tag}.yaml")
    cases = []
    for who, kind in kinds.items():
        listed = pm.run(kind, ["sh", "-c", "ls -d /dev/nvidia[0-9]*"]).split()
        if listed != ["/dev/nvidia0"]:
            raise RuntimeError(f"podman with {who}'s spec: expected /dev/nvidia0, got {listed}")

        def one(kind: str = kind) -> float:
            t0 = time.perf_counter()
            pm.run(kind, ["true"])
            return time.perf_counter() - t0
        cases.append(Case(f"podman run, {who}'s CDI spec, 1 GPU", one))
    return cases, pm



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("-n", type=int, default=0,
                    help="container lifecycles per case (default 150; --quick: 25)")
    ap.add_argument("--quick", action="store_true", help="a run of about a minute")
    ap.add_argument("--nct", type=Path, default=NCT_DEFAULT,
                    help=f"NVIDIA Container Toolkit build (default {NCT_DEFAULT})")
    ap.add_argument("--out", type=Path, help="also write the report here")
    opts = ap.parse_args()
    n = opts.n or (25 if opts.quick else 150)
    n_pass = 4 * n  # passthrough runs are cheap and their differences small
    n_podman = min(n, max(6, n // 10))  # podman run is ~250 ms: a smoke run (-n 1) takes one
    if os.geteuid() != 0:
        print("bench/container_start.py: needs root", file=sys.stderr)
        return 1
    for exe in ("nvctk-runtime", "nvctk-hook", "python3"):
        if not os.access(VENV_BIN / exe, os.X_OK):
            print(f"bench/container_start.py: no {VENV_BIN / exe} (run `make setup`)",
                  file=sys.stderr)
            return 1
    runc = shutil.which("runc")
    if runc is None:
        print("bench/container_start.py: runc is not on PATH", file=sys.stderr)
        return 1
    nct_bin = opts.nct / "bin"
    have_nct = all(os.access(nct_bin / x, os.X_OK) for x in
                   ("nvidia-ctk", "nvidia-container-runtime", "nvidia-cdi-hook"))
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    set_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix="nvctk-bench-"))
    sim = simhost.init(str(tmp / "sim"), make_topology(gpus=GPUS))
    nodrm_dir = tmp / "cdi-nodrm"
    if have_nct:  # NCT's spec as it came out before the sim's /sys was shown to it
        nct_generate(nct_bin, sim.root, nodrm_dir / "nvidia.yaml")
    # from here on the bench and all it starts see the sim's PCI devices in /sys, where
    # NCT looks for the DRM nodes (in a mount namespace of the bench's own)
    show_sim_pci(sim.root)
    # nvctk-runtime's passthrough cache in the bench's own dir: removed with the rest
    use_cache_dir(str(tmp / "passthrough"))
    # bundles and runtime state on a tmpfs, where containerd, Docker and CRI-O keep
    # them (/run); the image rootfs on disk, under a per-container overlay
    run_dir = tmp / "run"
    run_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(run_dir)],
                   check=True)
    bench = Bench(run_dir, tmp / "rootfs")
    try:
        load = os.getloadavg()
        say(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
            f"kernel {platform.release()}, python {platform.python_version()}, load average "
            f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start (a VM other engineers share)")
        say(f"one simulated host with {GPUS} GPUs; each container gets a fresh bundle dir and "
            "rootfs overlay (untimed); bundles, runtime state on tmpfs")
        say("every bundle (every case) carries a kubelet's binds: /etc/hosts, /etc/resolv.conf, "
            "/etc/hostname, /dev/termination-log, the service-account dir")
        say("nvctk: the sim's config at log-level info (the default)")
        if have_nct:
            say(f"NCT: {opts.nct}, `cdi` mode (spec from `nvidia-ctk cdi generate`, made once) "
                "and `jit-cdi` mode, log-level info")
        else:
            say(f"NVIDIA Container Toolkit not found in {opts.nct}: its cases are skipped")
        build_rootfs(str(tmp / "rootfs"), with_sample=sim.sample)
        base_env = dict(os.environ)
        # nvctk: the sim's config at the production log level (the sim's is debug)
        cfg = Path(sim.config_path).with_name("bench.toml")
        cfg_text = with_config_line(Path(sim.config_path).read_text(), "log-level", '"info"')
        cfg.write_text(cfg_text)
        shim_cfg = cfg.with_name("shim-only.toml")
        shim_cfg.write_text(with_config_line(cfg_text, "runtimes", '["/bin/true"]'))
        r_runc = Runtime("runc", (runc,), base_env)
        r_nvctk = Runtime("nvctk-runtime", (str(VENV_BIN / "nvctk-runtime"),),
                          {**base_env, "NVCTK_CONFIG": str(cfg)})
        r_shim = Runtime("nvctk-runtime (shim only)", r_nvctk.argv,
                         {**base_env, "NVCTK_CONFIG": str(shim_cfg)})
        # nvctk in CDI mode: the spec from `nvctk cdi generate`, made once, up front
        nvctk_spec_dir = tmp / "nvctk-cdi"
        subprocess.run([str(VENV_BIN / "nvctk"), "cdi", "generate", "--output",
                        str(nvctk_spec_dir / "nvidia.json")],
                       env={**base_env, "NVCTK_CONFIG": str(cfg)}, check=True,
                       capture_output=True)
        cdi_cfg = cfg.with_name("cdi.toml")
        cdi_cfg.write_text(with_config_line(with_config_line(cfg_text, "mode", '"cdi"'),
                                            "cdi-spec-dirs", f'["{nvctk_spec_dir}"]'))
        r_nvctk_cdi = Runtime("nvctk-runtime (cdi)", r_nvctk.argv,
                              {**base_env, "NVCTK_CONFIG": str(cdi_cfg)})
        r_nct: dict[str, Runtime] = {}
        if have_nct:
            spec_dir = tmp / "cdi"
            nct_generate(nct_bin, sim.root, spec_dir / "nvidia.yaml")
            say("device nodes of GPU 0 (its own and the common ones): nvctk's spec "
                f"{spec_nodes(nvctk_spec_dir / 'nvidia.json')}, NCT's "
                f"{spec_nodes(spec_dir / 'nvidia.yaml')}; NCT's made without the sim's /sys "
                f"{spec_nodes(nodrm_dir / 'nvidia.yaml')}")
            for mode, d in (("cdi", spec_dir), ("jit-cdi", spec_dir), (NODRM, nodrm_dir)):
                p = tmp / f"nct-{mode.replace(' ', '-')}.toml"
                p.write_text(nct_config(mode.split()[0], sim.root, d, nct_bin))
                r_nct[mode] = Runtime(f"nvidia-container-runtime ({mode})",
                                      (str(nct_bin / "nvidia-container-runtime"),),
                                      {**base_env, "NVIDIA_CTK_CONFIG_FILE_PATH": str(p)})

        sim_mount = [{"destination": "/run/nvidia-sim", "type": "bind",
                      "source": sim.state_dir, "options": ["rbind", "rw"]}]
        gpu1 = ["NVIDIA_VISIBLE_DEVICES=0"]
        gpu1_all = [*gpu1, "NVIDIA_DRIVER_CAPABILITIES=all"]
        gpu8 = ["NVIDIA_VISIBLE_DEVICES=all"]

        kubelet = kubelet_binds(tmp / "pod")

        def spec(env: list[str], args: list[str], nct: bool = False) -> dict:
            return plain_spec(env, args, [*kubelet, *(sim_mount if nct else [])])

        # (label, runtime, env, NCT bundle, GPUs expected, nvidia-smi expected)
        full: list[tuple[str, Runtime, list[str], bool, int, bool]] = [
            ("runc, no GPU", r_runc, [], False, 0, False),
            ("nvctk-runtime, 1 GPU", r_nvctk, gpu1, False, 1, True),
            ("nvctk-runtime, 1 GPU, caps=all", r_nvctk, gpu1_all, False, 1, True),
            ("nvctk-runtime, 8 GPUs", r_nvctk, gpu8, False, GPUS, True),
            ("nvctk-runtime cdi mode, 1 GPU", r_nvctk_cdi, gpu1, False, 1, True),
        ]
        for mode, r in r_nct.items():
            full.append((f"NCT {mode}, 1 GPU", r, gpu1, True, 1, True))

        def validate(label: str, rt: Runtime, b_cid: tuple[str, Path], gpus: int,
                     smi: bool) -> None:
            cid, b = b_cid
            out = run_dir / "validate.out"
            try:
                bench.lifecycle(rt, cid, b, out)
            finally:
                bench.drop_bundle(b)
            text = out.read_text(errors="replace")
            nodes = [ln for ln in text.splitlines() if ln.startswith("/dev/nvidia")]
            listed = [ln for ln in text.splitlines() if ln.startswith("GPU ")]
            if len(nodes) != gpus or (smi and len(listed) != gpus) \
                    or text.splitlines()[-1:] != [SA_NAMESPACE]:
                raise RuntimeError(f"{label}: validation expected {gpus} GPU(s) and the "
                                   f"kubelet's binds, got:\n{text}")

        def lifecycle_case(rt: Runtime, s: dict) -> Callable[[], float]:
            def one() -> float:
                cid, b = bench.new_bundle(s)
                try:
                    return bench.lifecycle(rt, cid, b)
                finally:
                    bench.drop_bundle(b)
            return one

        cases: list[Case] = []
        for label, rt, env, nct, gpus, smi in full:
            validate(label, rt, bench.new_bundle(spec(env, validate_cmd(smi), nct)),
                     gpus, smi)
            cases.append(Case(label, lifecycle_case(rt, spec(env, ["/bin/true"], nct))))

        # where nvctk's start goes: the shim alone, then runc on the spec it wrote (its
        # hook runs by itself there: no nvctk-runtime serves it)
        def shim_edited(args: list[str], hook: bool) -> tuple[str, Path]:
            cid, b = bench.new_bundle(spec(gpu1, args))
            bench._run(bench.rt(r_shim, "create", "--bundle", str(b), cid), r_shim.env,
                       "nvctk-runtime create (shim only)")
            if not hook:
                s = json.loads((b / "config.json").read_text())
                s.pop("hooks", None)
                (b / "config.json").write_text(json.dumps(s))
            return cid, b

        def shim_alone() -> float:
            cid, b = bench.new_bundle(spec(gpu1, ["/bin/true"]))
            try:
                t0 = time.perf_counter()
                bench._run(bench.rt(r_shim, "create", "--bundle", str(b), cid), r_shim.env,
                           "nvctk-runtime create (shim only)")
                return time.perf_counter() - t0
            finally:
                bench.drop_bundle(b)

        def edited_case(hook: bool) -> Callable[[], float]:
            def one() -> float:
                cid, b = shim_edited(["/bin/true"], hook)
                try:
                    return bench.lifecycle(r_runc, cid, b)
                finally:
                    bench.drop_bundle(b)
            return one

        breakdown_ok = True
        try:
            for hook in (False, True):
                validate(f"runc, edited spec, hook={hook}", r_runc,
                         shim_edited(validate_cmd(hook), hook), 1, hook)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            breakdown_ok = False
            bench.cleanup()
            say(f"the breakdown of nvctk's start is skipped: {e}")
        if breakdown_ok:
            cases += [Case("shim alone", shim_alone),
                      Case("runc, edited spec, no hook", edited_case(False)),
                      Case("runc, edited spec, hook", edited_case(True))]

        # passthrough: `list` of a root holding one created container
        cid, b = bench.new_bundle(spec([], ["/bin/true"]))
        bench._run(bench.rt(r_runc, "create", "--bundle", str(b), "--pid-file",
                            str(b / "init.pid"), cid), r_runc.env, "runc create")
        held = (cid, b, int((b / "init.pid").read_text()))
        py = str(VENV_BIN / "python3")

        def timed(argv: list[str], env: dict[str, str]) -> Callable[[], float]:
            def one() -> float:
                t0 = time.perf_counter()
                rc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL).returncode
                dt = time.perf_counter() - t0
                if rc != 0:
                    raise RuntimeError(f"{' '.join(argv)} exited {rc}")
                return dt
            return one

        passthrough = [Case("bare interpreter (python3 -I -S -c pass)",
                            timed([py, "-I", "-S", "-c", "pass"], base_env))]
        for r in (r_runc, r_nvctk, *r_nct.values()):
            if r is r_nct.get("jit-cdi") or r is r_nct.get(NODRM):
                continue  # the same passthrough as cdi mode
            argv = bench.rt(r, "list")
            out = subprocess.run(argv, env=r.env, capture_output=True, text=True)
            if out.returncode != 0 or cid not in out.stdout:
                raise RuntimeError(f"{r.name} list: {out.stdout}{out.stderr}")
            passthrough.append(Case(r.name.split(" (")[0] + " list", timed(argv, r.env)))

        t_start = time.perf_counter()
        try:
            interleave(passthrough, n_pass)
        finally:
            bench.force_delete(held[0])
            os.waitpid(held[2], 0)
            bench.drop_bundle(held[1])
        interleave(cases, n)
        elapsed = time.perf_counter() - t_start
        report(say, cases, passthrough, n, n_pass, elapsed, have_nct, breakdown_ok)
        # podman: each `podman run` takes ~0.5 s, so fewer runs, interleaved as the rest
        pcases, pm = podman_cases(tmp, cfg, sim.root, nct_bin if have_nct else None, say)
        if pm is not None:
            try:
                interleave(pcases, n_podman)
            finally:
                pm.close()
            report_podman(say, pcases, n_podman)
        say(f"load average {os.getloadavg()[0]:.2f} at the end")
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        # a case that does not work must stop the bench, not look fast
        detail = getattr(e, "stderr", None) or ""
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        print(f"bench/container_start.py: {e}\n{detail}".rstrip(), file=sys.stderr)
        return 1
    finally:
        bench.cleanup()
        # tmp itself is no mount point: `umount -R tmp` would leave run_dir mounted
        subprocess.run(["umount", "-R", str(run_dir)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if opts.out:
        opts.out.write_text("\n".join(lines) + "\n")
    return 0


def report_podman(say: Callable[[str], None], cases: list[Case], n: int) -> None:
    med = {c.label: statistics.median(c.samples) * 1000 for c in cases}
    say("")
    say(f"podman run --rm --network none --device KIND=0 IMAGE true ({n} interleaved runs "
        "each; the spec in /var/run/cdi)")
    for c in cases:
        say(f"  {c.label:<42} median {med[c.label]:7.2f}  p90 "
            f"{pctl(c.samples, 0.9) * 1000:7.2f}")
    if len(cases) == 2:
        a, b = (med[c.label] for c in cases)
        say(f"  {'podman run with nvctk spec / with NCT spec':<52} {a / b:5.2f} x  (goal <= 1.00)")


def interleave(cases: list[Case], n: int) -> None:
    for c in cases:  # warm-up: page cache, pyc files
        c.timed()
    for _ in range(n):
        for c in cases:
            c.samples.append(c.timed())
        reap_strays()


def report(say: Callable[[str], None], cases: list[Case], passthrough: list[Case], n: int,
           n_pass: int, elapsed: float, have_nct: bool, breakdown_ok: bool) -> None:
    med = {c.label: statistics.median(c.samples) * 1000 for c in [*cases, *passthrough]}
    p90 = {c.label: pctl(c.samples, 0.9) * 1000 for c in [*cases, *passthrough]}
    say(f"round-robin interleaved runs: {n} per container case, {n_pass} per passthrough "
        f"case ({elapsed:.0f} s); times in ms")
    say("lifecycle: create --bundle --pid-file -> start -> waitpid(init) -> delete, each "
        "step through the runtime under test; container runs `true`")
    say("")

    def row(label: str, base: str | None) -> None:
        extra = f"  overhead {med[label] - med[base]:7.2f}" if base and label != base else ""
        say(f"  {label:<42} median {med[label]:7.2f}  p90 {p90[label]:7.2f}{extra}")

    say("passthrough (overhead = minus runc list)")
    for c in passthrough:
        row(c.label, None if c is passthrough[0] else "runc list")
    say("")
    say("container lifecycle (overhead = minus runc, no GPU)")
    for c in cases[:len(cases) - (3 if breakdown_ok else 0)]:
        row(c.label, "runc, no GPU")
    say("")

    def ov(label: str) -> float:
        return med[label] - med["runc, no GPU"]

    def ratio(text: str, a: float, b: float, goal: str = "") -> None:
        say(f"  {text:<52} {a / b:5.2f} x{f'  (goal {goal})' if goal else ''}")

    say("ratios (of medians)")
    legacy, cdi = ov("nvctk-runtime, 1 GPU"), ov("nvctk-runtime cdi mode, 1 GPU")
    ratio("GPU start overhead nvctk cdi mode / legacy mode", cdi, legacy)
    say(f"  {'  cdi mode minus legacy mode':<52} {cdi - legacy:5.2f} ms  (goal <= 1.00)")
    # nvctk's spec gives every capability but compat32: legacy mode with caps=all is the
    # like-for-like start (7 device nodes and 77 mounts, 21 of them 32-bit libraries,
    # against the spec's 7 and 69; legacy's default capabilities: 4 and 26)
    say(f"  {'  cdi mode minus legacy mode with caps=all':<52} "
        f"{cdi - ov('nvctk-runtime, 1 GPU, caps=all'):5.2f} ms")
    if have_nct:
        ratio("GPU start overhead nvctk / NCT cdi", legacy, ov("NCT cdi, 1 GPU"), "<= 0.40")
        ratio("  same, nvctk with caps=all / NCT cdi", ov("nvctk-runtime, 1 GPU, caps=all"),
              ov("NCT cdi, 1 GPU"))
        ratio("GPU start overhead nvctk cdi mode / NCT cdi", cdi, ov("NCT cdi, 1 GPU"),
              "<= 0.40")
        ratio("  same, NCT's spec without the DRM nodes", cdi, ov(f"NCT {NODRM}, 1 GPU"))
        ratio("GPU start overhead NCT jit-cdi / NCT cdi", ov("NCT jit-cdi, 1 GPU"),
              ov("NCT cdi, 1 GPU"))
        pt = med["nvctk-runtime list"] - med["runc list"]
        ratio("passthrough overhead nvctk / NCT", pt,
              med["nvidia-container-runtime list"] - med["runc list"], "<= 0.20")
    ratio("start nvctk 8 GPUs / 1 GPU", med["nvctk-runtime, 8 GPUs"],
          med["nvctk-runtime, 1 GPU"], "<= 1.20")
    ratio("start nvctk 1 GPU / runc", med["nvctk-runtime, 1 GPU"], med["runc, no GPU"])
    if have_nct:
        ratio("start NCT cdi 1 GPU / runc", med["NCT cdi, 1 GPU"], med["runc, no GPU"])
    if breakdown_ok:
        say("")
        say("where nvctk's 1-GPU start goes")
        for c in cases[-3:]:
            row(c.label, None)
        hook, no_hook = med["runc, edited spec, hook"], med["runc, edited spec, no hook"]
        served = med["nvctk-runtime, 1 GPU"] - med["shim alone"] - no_hook
        say(f"  so: runtime {med['shim alone']:.1f}, hook served by the runtime {served:.1f} "
            f"(by itself {hook - no_hook:.1f}), device nodes "
            f"{no_hook - med['runc, no GPU']:.1f}, bare interpreter start "
            f"{med[passthrough[0].label]:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
