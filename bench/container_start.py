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
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # support.podman, support.sim

from runtime_lifecycle import (  # noqa: E402
    SA_NAMESPACE,
    Bench,
    Case,
    Runtime,
    interleave,
    kubelet_binds,
    plain_spec,
    set_subreaper,
    validate_cmd,
)
from start_nct import NODRM, nct_config, nct_generate, spec_nodes  # noqa: E402
from start_podman import podman_cases, report_podman  # noqa: E402
from start_report import report  # noqa: E402

from nvctk.runtime.passthrough import use_cache_dir  # noqa: E402
from nvctk.sim import host as simhost  # noqa: E402
from nvctk.sim.rootfs import build_rootfs  # noqa: E402
from nvctk.sim.topology import make_topology  # noqa: E402
from support.sim import show_sim_pci  # noqa: E402

VENV_BIN = REPO / ".venv" / "bin"
NCT_DEFAULT = REPO.parent / "shared" / "peers" / "nct"
GPUS = 8

# the GPUs a case's container asks for
GPU1 = ["NVIDIA_VISIBLE_DEVICES=0"]
GPU1_ALL = [*GPU1, "NVIDIA_DRIVER_CAPABILITIES=all"]
GPU8 = ["NVIDIA_VISIBLE_DEVICES=all"]


@dataclass
class Setup:
    """What every case runs on: one simulated host, the bundles' tmpfs, NCT if present."""

    tmp: Path
    sim: simhost.SimHost
    run_dir: Path
    bench: Bench
    nct: Path  # --nct
    nct_bin: Path
    have_nct: bool
    nodrm_dir: Path  # NCT's spec made before the sim's /sys was shown to it


@dataclass
class Runtimes:
    """The runtimes under test; cfg: nvctk's config (the sim's at log-level info)."""

    runc: Runtime
    nvctk: Runtime
    shim: Runtime  # nvctk-runtime with /bin/true as its low-level runtime
    nvctk_cdi: Runtime
    nct: dict[str, Runtime]  # by mode
    cfg: Path
    nvctk_spec_dir: Path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("-n", type=int, default=0,
                    help="container lifecycles per case (default 150; --quick: 25)")
    ap.add_argument("--quick", action="store_true", help="a run of about a minute")
    ap.add_argument("--nct", type=Path, default=NCT_DEFAULT,
                    help=f"NVIDIA Container Toolkit build (default {NCT_DEFAULT})")
    ap.add_argument("--out", type=Path, help="also write the report here")
    return ap.parse_args()


def find_runc() -> str | None:
    """runc's path where the bench can run here; None once it said why not."""
    why = None
    if os.geteuid() != 0:
        why = "needs root"
    for exe in ("nvctk-runtime", "nvctk-hook", "python3"):
        if why is None and not os.access(VENV_BIN / exe, os.X_OK):
            why = f"no {VENV_BIN / exe} (run `make setup`)"
    runc = shutil.which("runc")
    if why is None and runc is None:
        why = "runc is not on PATH"
    if why is not None:
        print(f"bench/container_start.py: {why}", file=sys.stderr)
        return None
    return runc


def main() -> int:
    opts = parse_args()
    runc = find_runc()
    if runc is None:
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
        run_bench(opts, Setup(tmp, sim, run_dir, bench, opts.nct, nct_bin, have_nct, nodrm_dir),
                  runc, say)
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


def run_bench(opts: argparse.Namespace, s: Setup, runc: str, say: Callable[[str], None]) -> None:
    """Every case validated, then timed round-robin, and the report."""
    n = opts.n or (25 if opts.quick else 150)
    n_pass = 4 * n  # passthrough runs are cheap and their differences small
    n_podman = min(n, max(6, n // 10))  # podman run is ~250 ms: a smoke run (-n 1) takes one
    say_setup(say, s)
    build_rootfs(str(s.tmp / "rootfs"), with_sample=s.sim.sample)
    rts = make_runtimes(s, runc, say)
    made = Cases(s, rts)
    cases = made.lifecycles()
    breakdown = made.breakdown(say)
    cases += breakdown
    passthrough = made.passthrough()
    t_start = time.perf_counter()
    try:
        interleave(passthrough, n_pass)
    finally:
        made.release_held()
    interleave(cases, n)
    elapsed = time.perf_counter() - t_start
    report(say, cases, passthrough, n, n_pass, elapsed, s.have_nct, bool(breakdown))
    # podman: each `podman run` takes ~0.5 s, so fewer runs, interleaved as the rest
    pcases, pm = podman_cases(s.tmp, rts.cfg, s.sim.root, s.nct_bin if s.have_nct else None,
                              say, VENV_BIN)
    if pm is not None:
        try:
            interleave(pcases, n_podman)
        finally:
            pm.close()
        report_podman(say, pcases, n_podman)
    say(f"load average {os.getloadavg()[0]:.2f} at the end")


def say_setup(say: Callable[[str], None], s: Setup) -> None:
    load = os.getloadavg()
    say(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"kernel {platform.release()}, python {platform.python_version()}, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start (a VM other engineers share)")
    say(f"one simulated host with {GPUS} GPUs; each container gets a fresh bundle dir and "
        "rootfs overlay (untimed); bundles, runtime state on tmpfs")
    say("every bundle (every case) carries a kubelet's binds: /etc/hosts, /etc/resolv.conf, "
        "/etc/hostname, /dev/termination-log, the service-account dir")
    say("nvctk: the sim's config at log-level info (the default)")
    if s.have_nct:
        say(f"NCT: {s.nct}, `cdi` mode (spec from `nvidia-ctk cdi generate`, made once) "
            "and `jit-cdi` mode, log-level info")
    else:
        say(f"NVIDIA Container Toolkit not found in {s.nct}: its cases are skipped")


def make_runtimes(s: Setup, runc: str, say: Callable[[str], None]) -> Runtimes:
    """The runtimes and their configs: nvctk's (legacy, CDI, the shim alone) and NCT's."""
    base_env = dict(os.environ)
    # nvctk: the sim's config at the production log level (the sim's is debug)
    cfg = Path(s.sim.config_path).with_name("bench.toml")
    cfg_text = with_config_line(Path(s.sim.config_path).read_text(), "log-level", '"info"')
    cfg.write_text(cfg_text)
    shim_cfg = cfg.with_name("shim-only.toml")
    shim_cfg.write_text(with_config_line(cfg_text, "runtimes", '["/bin/true"]'))
    r_nvctk = Runtime("nvctk-runtime", (str(VENV_BIN / "nvctk-runtime"),),
                      {**base_env, "NVCTK_CONFIG": str(cfg)})
    r_shim = Runtime("nvctk-runtime (shim only)", r_nvctk.argv,
                     {**base_env, "NVCTK_CONFIG": str(shim_cfg)})
    # nvctk in CDI mode: the spec from `nvctk cdi generate`, made once, up front
    nvctk_spec_dir = s.tmp / "nvctk-cdi"
    subprocess.run([str(VENV_BIN / "nvctk"), "cdi", "generate", "--output",
                    str(nvctk_spec_dir / "nvidia.json")],
                   env={**base_env, "NVCTK_CONFIG": str(cfg)}, check=True,
                   capture_output=True)
    cdi_cfg = cfg.with_name("cdi.toml")
    cdi_cfg.write_text(with_config_line(with_config_line(cfg_text, "mode", '"cdi"'),
                                        "cdi-spec-dirs", f'["{nvctk_spec_dir}"]'))
    r_nvctk_cdi = Runtime("nvctk-runtime (cdi)", r_nvctk.argv,
                          {**base_env, "NVCTK_CONFIG": str(cdi_cfg)})
    r_nct = nct_runtimes(s, nvctk_spec_dir, base_env, say) if s.have_nct else {}
    return Runtimes(Runtime("runc", (runc,), base_env), r_nvctk, r_shim, r_nvctk_cdi, r_nct,
                    cfg, nvctk_spec_dir)


def nct_runtimes(s: Setup, nvctk_spec_dir: Path, base_env: dict[str, str],
                 say: Callable[[str], None]) -> dict[str, Runtime]:
    """nvidia-container-runtime in cdi and jit-cdi mode, and cdi mode on its spec made
    without the sim's /sys (NODRM)."""
    spec_dir = s.tmp / "cdi"
    nct_generate(s.nct_bin, s.sim.root, spec_dir / "nvidia.yaml")
    say("device nodes of GPU 0 (its own and the common ones): nvctk's spec "
        f"{spec_nodes(nvctk_spec_dir / 'nvidia.json')}, NCT's "
        f"{spec_nodes(spec_dir / 'nvidia.yaml')}; NCT's made without the sim's /sys "
        f"{spec_nodes(s.nodrm_dir / 'nvidia.yaml')}")
    r_nct: dict[str, Runtime] = {}
    for mode, d in (("cdi", spec_dir), ("jit-cdi", spec_dir), (NODRM, s.nodrm_dir)):
        p = s.tmp / f"nct-{mode.replace(' ', '-')}.toml"
        p.write_text(nct_config(mode.split()[0], s.sim.root, d, s.nct_bin))
        r_nct[mode] = Runtime(f"nvidia-container-runtime ({mode})",
                              (str(s.nct_bin / "nvidia-container-runtime"),),
                              {**base_env, "NVIDIA_CTK_CONFIG_FILE_PATH": str(p)})
    return r_nct


class Cases:
    """The timed cases on one Setup, each validated once first; every container's spec
    carries the kubelet's binds (and NCT's bundles the sim's shared state mount)."""

    def __init__(self, s: Setup, rts: Runtimes) -> None:
        self.s, self.rts, self.bench = s, rts, s.bench
        self.sim_mount = [{"destination": "/run/nvidia-sim", "type": "bind",
                           "source": s.sim.state_dir, "options": ["rbind", "rw"]}]
        self.kubelet = kubelet_binds(s.tmp / "pod")
        self.held: tuple[str, Path, int] | None = None  # the container passthrough lists

    def spec(self, env: list[str], args: list[str], nct: bool = False) -> dict:
        return plain_spec(env, args, [*self.kubelet, *(self.sim_mount if nct else [])])

    def lifecycles(self) -> list[Case]:
        """runc without a GPU, nvctk's cases, NCT's: create -> start -> wait -> delete."""
        r = self.rts
        # (label, runtime, env, NCT bundle, GPUs expected, nvidia-smi expected)
        full: list[tuple[str, Runtime, list[str], bool, int, bool]] = [
            ("runc, no GPU", r.runc, [], False, 0, False),
            ("nvctk-runtime, 1 GPU", r.nvctk, GPU1, False, 1, True),
            ("nvctk-runtime, 1 GPU, caps=all", r.nvctk, GPU1_ALL, False, 1, True),
            ("nvctk-runtime, 8 GPUs", r.nvctk, GPU8, False, GPUS, True),
            ("nvctk-runtime cdi mode, 1 GPU", r.nvctk_cdi, GPU1, False, 1, True),
        ]
        for mode, rt in r.nct.items():
            full.append((f"NCT {mode}, 1 GPU", rt, GPU1, True, 1, True))
        cases: list[Case] = []
        for label, rt, env, nct, gpus, smi in full:
            self.validate(label, rt, self.bench.new_bundle(self.spec(env, validate_cmd(smi), nct)),
                          gpus, smi)
            cases.append(Case(label, self.lifecycle_case(rt, self.spec(env, ["/bin/true"], nct))))
        return cases

    def validate(self, label: str, rt: Runtime, b_cid: tuple[str, Path], gpus: int,
                 smi: bool) -> None:
        cid, b = b_cid
        out = self.s.run_dir / "validate.out"
        try:
            self.bench.lifecycle(rt, cid, b, out)
        finally:
            self.bench.drop_bundle(b)
        text = out.read_text(errors="replace")
        nodes = [ln for ln in text.splitlines() if ln.startswith("/dev/nvidia")]
        listed = [ln for ln in text.splitlines() if ln.startswith("GPU ")]
        if len(nodes) != gpus or (smi and len(listed) != gpus) \
                or text.splitlines()[-1:] != [SA_NAMESPACE]:
            raise RuntimeError(f"{label}: validation expected {gpus} GPU(s) and the "
                               f"kubelet's binds, got:\n{text}")

    def lifecycle_case(self, rt: Runtime, s: dict) -> Callable[[], float]:
        def one() -> float:
            cid, b = self.bench.new_bundle(s)
            try:
                return self.bench.lifecycle(rt, cid, b)
            finally:
                self.bench.drop_bundle(b)
        return one

    def breakdown(self, say: Callable[[str], None]) -> list[Case]:
        """Where nvctk's start goes: the shim alone, then runc on the spec it wrote (its
        hook runs by itself there: no nvctk-runtime serves it); none where that fails."""
        try:
            for hook in (False, True):
                self.validate(f"runc, edited spec, hook={hook}", self.rts.runc,
                              self.shim_edited(validate_cmd(hook), hook), 1, hook)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            self.bench.cleanup()
            say(f"the breakdown of nvctk's start is skipped: {e}")
            return []
        return [Case("shim alone", self.shim_alone),
                Case("runc, edited spec, no hook", self.edited_case(False)),
                Case("runc, edited spec, hook", self.edited_case(True))]

    def shim_create(self, b: Path, cid: str) -> None:
        shim = self.rts.shim
        self.bench._run(self.bench.rt(shim, "create", "--bundle", str(b), cid), shim.env,
                        "nvctk-runtime create (shim only)")

    def shim_edited(self, args: list[str], hook: bool) -> tuple[str, Path]:
        cid, b = self.bench.new_bundle(self.spec(GPU1, args))
        self.shim_create(b, cid)
        if not hook:
            s = json.loads((b / "config.json").read_text())
            s.pop("hooks", None)
            (b / "config.json").write_text(json.dumps(s))
        return cid, b

    def shim_alone(self) -> float:
        cid, b = self.bench.new_bundle(self.spec(GPU1, ["/bin/true"]))
        try:
            t0 = time.perf_counter()
            self.shim_create(b, cid)
            return time.perf_counter() - t0
        finally:
            self.bench.drop_bundle(b)

    def edited_case(self, hook: bool) -> Callable[[], float]:
        def one() -> float:
            cid, b = self.shim_edited(["/bin/true"], hook)
            try:
                return self.bench.lifecycle(self.rts.runc, cid, b)
            finally:
                self.bench.drop_bundle(b)
        return one

    def passthrough(self) -> list[Case]:
        """`list` of a root holding one created container (release_held() ends it),
        through each runtime, and a bare interpreter start."""
        bench, r = self.bench, self.rts
        cid, b = bench.new_bundle(self.spec([], ["/bin/true"]))
        bench._run(bench.rt(r.runc, "create", "--bundle", str(b), "--pid-file",
                            str(b / "init.pid"), cid), r.runc.env, "runc create")
        self.held = (cid, b, int((b / "init.pid").read_text()))
        py = str(VENV_BIN / "python3")
        cases = [Case("bare interpreter (python3 -I -S -c pass)",
                      timed([py, "-I", "-S", "-c", "pass"], r.runc.env))]
        for rt in (r.runc, r.nvctk, *r.nct.values()):
            if rt is r.nct.get("jit-cdi") or rt is r.nct.get(NODRM):
                continue  # the same passthrough as cdi mode
            argv = bench.rt(rt, "list")
            out = subprocess.run(argv, env=rt.env, capture_output=True, text=True)
            if out.returncode != 0 or cid not in out.stdout:
                raise RuntimeError(f"{rt.name} list: {out.stdout}{out.stderr}")
            cases.append(Case(rt.name.split(" (")[0] + " list", timed(argv, rt.env)))
        return cases

    def release_held(self) -> None:
        if self.held is not None:
            cid, b, pid = self.held
            self.bench.force_delete(cid)
            os.waitpid(pid, 0)
            self.bench.drop_bundle(b)
            self.held = None


def timed(argv: list[str], env: dict[str, str]) -> Callable[[], float]:
    """A case that runs argv to its end (exit 0) and returns the seconds it took."""
    def one() -> float:
        t0 = time.perf_counter()
        rc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {rc}")
        return dt
    return one


def with_config_line(text: str, key: str, value: str) -> str:
    """`text` (TOML) with top-level `key` set to `value`: replaced where it is, else put
    first (a key appended at the end could land in a [table])."""
    line = f"{key} = {value}"
    lines = text.splitlines()
    found = [i for i, ln in enumerate(lines) if ln.split("=")[0].strip() == key]
    for i in found:
        lines[i] = line
    return "\n".join(lines if found else [line, *lines]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
