"""libvgpu overhead and SM-share accuracy on the simulated driver, beside HAMi-core's where
its library is given (`make -C libvgpu bench` writes bench/results/vgpu_overhead.txt; it
passes HAMi-core's library when built, see the Makefile). Goals: the README's vGPU figures.

Side by side in one run, direct (no interposer) vs through libvgpu (and through HAMi-core
with --hami: its libvgpu.so preloaded the way HAMi runs it, its limits in the same env
variables, its own shared-cache file):
  - ns added per cuLaunchKernel with no SM limit (goal <= 10 ns): valid launches
    of a 0-us kernel, and launches the driver rejects at once (NULL function)
  - ns added per cuLaunchKernel under an SM limit of 50 % where the share is not
    binding (goal <= 30 ns); the limited device against an unlimited one in one
    process; the library's entry point against the driver's own in one process; and a
    greedy loop (which waits for its share)
  - ns added per cuMemAlloc_v2 + cuMemFree_v2 pair with a memory cap (goal <= 150 ns)
  - the first cuInit of a single process (from its first CUDA call), on a fresh
    accounting file and on one already in use, with the stages of libvgpu's first
    (build/libvgpu-trace.so), median and p90 (goal <= 200 us added at the median, the
    p90 <= 400 us); and with 64 processes of one container starting at once (goal
    <= 1 ms added at the median)
  - SM-share accuracy for 25/50/75 %, a 30/70 split of one GPU between two
    containers, and 50 % at grids 1 ... 1048576, with synchronous and
    asynchronous launches (goal: within 2 points)
  - the SM limiter's cost per launch in the launch patterns of issue 29 where the share
    does not bind (asynchronous 0-us kernels): greedy loops, bursts of 10, 100 and 1000
    after idle gaps of 0.1-10 ms, 4 streams, 4 threads on one context, cuGraphLaunch,
    cuLaunchKernelEx, cuLaunchCooperativeKernel (goal <= 30 ns), and one pattern without
    an SM limit: across processes, each library against no interposer (interleaved runs);
    and in one process, device 0 SM-limited against device 1 unlimited, burst by burst.
Runs are interleaved (direct, libvgpu, HAMi-core, the order rotating from one run to the
next) and pinned to one CPU. Each figure: the median of the per-run differences from
direct and their spread, [p25..p75] (interquartile range). 'ahead' compares the two
libraries run by run: the library whose per-run figure is lower in at least the middle half
of the runs (the interquartile range of the paired differences excludes 0); '=' where the
difference is within that spread. Needs root (device nodes).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vgpu_compare import (
    BENCH,
    CACHE,
    HAMI,
    ROOT,
    VG,
    H,
    Table,
    fig,
    hami_commit,
    hami_env,
    hami_how,
    interleaved,
    p90,
    run,
    storm_ahead,
)
from vgpu_patterns import patterns, sym_offset

from nvctk.sim.state import read_state
from nvctk.vgpu.ledger import SHM_SIZE


def nvctk_env(env: dict[str, str], cache: Path, uuids: list[str]) -> dict[str, str]:
    """env with the limits nvctk writes (a 40 GiB cap per GPU, the GPUs' UUIDs, the
    accounting file) in a limits file instead of the environment."""
    f = Path(f"{cache}.limits")
    f.write_text("".join(f"CUDA_DEVICE_MEMORY_LIMIT_{i}=40g\nNVCTK_VGPU_UUID_{i}={u}\n" for i, u in enumerate(uuids))
                 + f"CUDA_DEVICE_MEMORY_SHARED_CACHE={cache}\n")
    e = {k: v for k, v in env.items() if k not in ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE")}
    return {**e, "NVCTK_VGPU_LIMITS_FILE": str(f)}


def init_single(base: dict[str, str], lib: str | None, cache: Path, fresh: bool, trace: bool = False,
                uuids: list[str] | None = None) -> tuple[float, float, str]:
    """One process's first cuInit (ns from its first CUDA call, and of cuInit alone), with a 40 GiB cap, through
    lib (None: no interposer), on a fresh accounting file (libvgpu: zero-filled, as nvctk
    makes it; HAMi-core: none, it creates its own) or a used one; with trace, libvgpu's
    stages' line from libvgpu-trace.so; with uuids, libvgpu's limits in a limits file naming
    the GPUs (as nvctk writes it)."""
    e = base
    if lib == str(H.LIB):
        if fresh:
            with open(cache, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, SHM_SIZE)
        e = {**base, "LD_PRELOAD": str(H.BUILD / "libvgpu-trace.so") if trace else lib,
             "CUDA_DEVICE_MEMORY_LIMIT": "40g", CACHE: str(cache)}
        if uuids is not None:
            e = nvctk_env(e, cache, uuids)
    elif lib is not None:
        if fresh:
            cache.unlink(missing_ok=True)
        e = {**base, "LD_PRELOAD": lib, "CUDA_DEVICE_MEMORY_LIMIT": "40g", CACHE: str(cache)}
    cp = subprocess.run(["taskset", "-c", "1", str(BENCH), "init"], env=e, capture_output=True, text=True, check=True)
    total, alone = cp.stdout.split()[:2]
    return float(total), float(alone), cp.stderr.strip()


def init_storm(env: dict[str, str], n: int = 64) -> list[float]:
    procs = [subprocess.Popen([str(BENCH), "init"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for _ in range(n)]
    return [float(p.communicate()[0].split()[0]) for p in procs]


GRIDS = (1, 64, 4096, 65536, 1048576)


def sm_accuracy(driver: H.Driver, tmp: Path, lib: str, window: float = 12.0, tag: str = "",
                extra: dict[str, str] | None = None) -> dict[str, float]:
    """Each group is a simulated GPU of its own (a state file), so the groups run at once."""
    loop = ["launchfor", str(window + 3)]
    groups: dict[str, list[tuple[str, int, list[str]]]] = {
        "s25": [("25", 25, loop)], "s50": [("50", 50, loop)], "s75": [("75", 75, loop)],
        "split": [("30", 30, loop), ("70", 70, loop)],
        **{f"g{g}": [(f"grid{g}", 50, ["grid", str(g), *loop])] for g in GRIDS[1:]},
        "graph": [("graph", 50, ["graph", "1", "graphlaunchfor", str(window + 3)])],
    }
    procs = {}
    for state, members in groups.items():
        for label, pct, argv in members:
            env = driver.env(tmp / f"sm{tag}-{state}", NVSIM_KERNEL_US="2000", CUDA_DEVICE_SM_LIMIT=str(pct),
                             CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp / f"sm{tag}-cache-{label}"), LD_PRELOAD=lib,
                             **(extra or {}))
            procs[label] = (state, subprocess.Popen(
                [str(H.PROBE), "init", "ctx", "0", *argv],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def busy() -> dict[str, int]:
        res = {}
        for label, (state, p) in procs.items():
            s = read_state(tmp / f"sm{tag}-{state}").proc(p.pid, 0)
            res[label] = s.busy_ns if s else 0
        return res

    time.sleep(1.5)
    b0, t0 = busy(), time.monotonic()
    time.sleep(window)
    b1, t1 = busy(), time.monotonic()
    for _, p in procs.values():
        p.wait()
    return {k: 100 * (b1[k] - b0[k]) / ((t1 - t0) * 1e9) for k in procs}


class Run:
    """One run of the bench: the simulated driver, the libraries, the table and its lines.
    Each section is a method; main strings them together."""

    def __init__(self, args: argparse.Namespace, tmp: Path, hami: str | None, say: Callable[..., None]) -> None:
        self.args, self.tmp, self.hami, self.say, self.reps = args, tmp, hami, say, args.reps
        self.table = Table(say, hami)
        self.driver = H.make_driver(tmp / "sim", gpus=2, memory_mib=81920)
        self.base = self.driver.env(tmp / "state", NVSIM_KERNEL_US="0")
        self.capped = {**self.base, "LD_PRELOAD": str(H.LIB), "CUDA_DEVICE_MEMORY_LIMIT": "40g",
                       CACHE: str(tmp / "cache")}
        self.share: dict[str, dict[str, float]] = {}

    def libs(self, env: dict[str, str]) -> dict[str, dict[str, str]]:
        """direct, libvgpu with env, and HAMi-core with the same limits where given."""
        return {"direct": self.base, VG: env, **({HAMI: hami_env(env, self.hami)} if self.hami else {})}

    def measure(self, env: dict[str, str], argv: list[str], reps: int = 0) -> dict[str, list[float]]:
        return interleaved(self.libs(env), lambda e: run(e, *argv), reps or self.reps)

    def head(self, tmpfs: str | None) -> None:
        say, hami = self.say, self.hami
        say(f"libvgpu overhead on the simulated driver  ({platform.node()}, {os.cpu_count()} CPUs, "
            f"{time.strftime('%Y-%m-%d')})")
        say(f"HAMi-core beside it: {hami} ({hami_commit(hami)})" if hami else f"HAMi-core: not measured; {hami_how()}")
        say(f"{self.reps} interleaved runs of each, pinned to CPU 1; 'added' = the median of (library - direct) "
            "per run, [p25..p75] of them")
        say(f"files in {tmpfs or tempfile.gettempdir()}; load average at start {os.getloadavg()[0]:.1f} "
            "(other work shares the machine: the direct runs see the same load)")
        say()

    def launches(self) -> None:
        """cuLaunchKernel without and with an SM limit, across processes and in one."""
        table, say, tmp = self.table, self.say, self.tmp
        table.row("cuLaunchKernel, no SM limit, valid 0-us kernel, ns", self.measure(self.capped, ["launch", "1000000"]),
                  "<= 10")
        table.row("cuLaunchKernel, no SM limit, rejected (NULL function), ns",
                  self.measure(self.capped, ["launchnull", "2000000"]), "<= 10")
        limited = {**self.capped, "CUDA_DEVICE_SM_LIMIT": "50", CACHE: str(tmp / "cache-sm")}
        table.row("cuLaunchKernel, SM limit 50 %, share not binding, ns", self.measure(limited, ["launchgap", "300000"]),
                  "<= 30")
        say("  (0-us kernel, blocks of 1000 launches 0.5 ms apart: the limiter's cost, not its waiting; libvgpu")
        say("   charges most launches their shape's estimate with no lock or driver call; the first of a shape")
        say("   and a random few (1 in 2 at first, then 1 in 16 to 1 in 1024 by the kernel's cost) are timed)")
        one = {**self.capped, "CUDA_DEVICE_SM_LIMIT_0": "50", CACHE: str(tmp / "cache-sm2")}
        # a fresh simulator state per run: the mock scans its process table per launch, and
        # with the dead runs' rows before it the two devices' rows cost differently
        l2: dict[str, list[float]] = {VG: [], HAMI: []}
        for i in range(self.reps):
            for k, e in self.libs(one).items():
                if k != "direct":
                    l2[k].append(run({**e, "NVSIM_STATE": str(tmp / f"state-l2-{k}-{i}")}, "launch2", "301"))
        table.pair("  the same, SM-limited device vs an unlimited one, one process", {k: v for k, v in l2.items() if v},
                   note="the limiter alone: HAMi-core's unlimited device pays part of its cost too; the row below is all")
        say("  (blocks of 1000 launches 0.5 ms apart alternating between the two devices: robust to the")
        say("   machine's load)")
        off = sym_offset(self.driver, "cuLaunchKernel")
        ls = interleaved({k: e for k, e in self.libs(limited).items() if k != "direct"},
                         lambda e: run(e, "launchself", off, "301"), self.reps)
        table.pair("  the same, the library vs the driver own cuLaunchKernel, one process", ls)
        say("  (blocks of 1000 launches 0.5 ms apart, alternating between the entry point cuGetProcAddress")
        say("   gives and the driver's own: all of the library's cost, robust to the machine's load)")
        self.greedy(limited)

    def greedy(self, limited: dict[str, str]) -> None:
        greedy = self.measure(limited, ["launch", "300000"], max(3, self.reps // 3))
        self.table.row("cuLaunchKernel, SM limit 50 %, greedy loop, ns", greedy, note="see its share below")
        shares = {k: 100 * statistics.median(greedy["direct"]) / statistics.median(v) for k, v in greedy.items()}
        self.say("  (includes waiting for the share: the synchronous simulator's events time a 0-us kernel as its")
        self.say("   launch call, ~0.4 us of 'device time', so a greedy loop held to 50 % spends about half its time")
        self.say(f"   in launches: direct/library here {shares[VG]:.0f} % libvgpu"
                 + (f", {shares[HAMI]:.0f} % HAMi-core" if self.hami else "") + ")")
        self.table.row("cuMemAlloc_v2 + cuMemFree_v2 (4 KiB) with a cap, ns",
                       self.measure(self.capped, ["alloc", "200000"]), "<= 150")

    def first_init(self) -> None:
        """One process's first cuInit, four ways, then its p90s and libvgpu's stages."""
        uuids_all = self.driver.uuids
        variants = ((True, None, "fresh accounting file"), (False, None, "file in use"),
                    (True, uuids_all, "limits file naming the GPUs, fresh"),
                    (False, uuids_all, "limits file naming the GPUs, in use"))
        p90s: list[tuple[str, dict[str, list[float]]]] = []
        for fresh, uuids, what in variants:
            res, tot = self.init_runs(fresh, uuids)
            self.table.row(f"first cuInit, one process, {what}, us", res, "<= 200", scale=1e3)
            self.table.row("  the same from the first CUDA call, us", tot, scale=1e3,
                           key=f"first cuInit, {what}, from the first CUDA call, us")
            p90s.append((what, res))
        for what, res in p90s:
            self.say(f"  p90 of the {self.reps} runs, {what}, us: direct {p90(res['direct']) / 1e3:.1f}, "
                     + ", ".join(f"{k} {p90(v) / 1e3:.1f}" for k, v in res.items() if k != "direct")
                     + "  (goal <= 400 added)")
        self.say("  ('from the first CUDA call': dlopen of libcuda.so.1, cuGetProcAddress, cuInit: HAMi-core sets up")
        self.say("   its shared region at the first call into it, before cuInit. Env only: NVML maps CUDA devices to")
        self.say("   the container's GPUs; nvctk's limits file can name their UUIDs (NVCTK_VGPU_UUID_<i>), and then")
        self.say("   libvgpu does not load NVML; HAMi-core has no limits file)")
        for uuids, what in ((None, "env only"), (uuids_all, "limits file naming the GPUs")):
            self.init_stages(uuids, what)

    def init_runs(self, fresh: bool, uuids: list[str] | None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """cuInit alone and from the first CUDA call, per library, the runs interleaved."""
        tmp, hami = self.tmp, self.hami
        res: dict[str, list[float]] = {"direct": [], VG: [], HAMI: []}
        tot: dict[str, list[float]] = {"direct": [], VG: [], HAMI: []}
        for i in range(self.reps):
            runs = [("direct", None, tmp / "single-direct", None),
                    (VG, str(H.LIB), tmp / f"single{'-u' if uuids else ''}-{i if fresh else 0}", uuids)]
            if hami and uuids is None:  # HAMi-core has no limits file: env only
                runs.append((HAMI, hami, tmp / f"single-hami-{i if fresh else 0}", None))
            for k, lib, cache, u in runs[i % len(runs):] + runs[:i % len(runs)]:
                t_all, t_init, _ = init_single(self.base, lib, cache, fresh, uuids=u)
                tot[k].append(t_all)
                res[k].append(t_init)
        return {k: v for k, v in res.items() if v}, {k: v for k, v in tot.items() if v}

    def init_stages(self, uuids: list[str] | None, what: str) -> None:
        stages = [init_single(self.base, str(H.LIB), self.tmp / f"trace{'-u' if uuids else ''}-{i}", True, trace=True,
                              uuids=uuids)[2] for i in range(self.reps)]
        self.say(f"  stages of libvgpu's first cuInit ({what}, fresh file), us, median of "
                 f"{len(stages)} (build/libvgpu-trace.so; 'real_cuinit' is the driver's own):")
        parsed = [dict(kv.split("=") for kv in line.split()[1:]) for line in stages
                  if line.startswith("vgpu-init-trace")]
        if parsed:
            self.say("   " + "  ".join(f"{k} {statistics.median(float(p[k]) for p in parsed):.1f}" for k in parsed[0]))

    def storms(self) -> None:
        """64 processes of one container at once, env only and with a limits file."""
        for uuids, what in ((None, "env only"), (self.driver.uuids, "limits file")):
            storm: dict[str, list[float]] = {"direct": [], VG: [], HAMI: []}
            for i in range(3):
                storm["direct"] += init_storm(self.base)
                c = self.tmp / f"storm{'-u' if uuids else ''}{i}"
                e = {**self.capped, CACHE: str(c)}
                storm[VG] += init_storm(nvctk_env(e, c, uuids) if uuids else e)
                if self.hami and uuids is None:
                    storm[HAMI] += init_storm(hami_env(e, self.hami))
            storm = {k: v for k, v in storm.items() if v}
            # per-process figures are not paired run by run: compare medians, the p25..p75 of each
            added = {k: [x - statistics.median(storm["direct"]) for x in v] for k, v in storm.items() if k != "direct"}
            self.say(f"first cuInit from the first CUDA call, 64 processes of one container at once ({what}), ms: "
                     f"direct {statistics.median(storm['direct']) / 1e6:.3f}; added, median [p25..p75] of the 3x64 "
                     "processes: " + ", ".join(f"{k} {fig([x / 1e6 for x in v], 1, 3).strip()} (p90 {p90(v) / 1e6:.3f})"
                                               for k, v in added.items()) + "  (goal <= 1)")
            if HAMI in added:
                self.table.verdicts.append((f"first cuInit, 64 processes at once ({what}), ms",
                                            fig([x / 1e6 for x in added[VG]], 1, 3),
                                            fig([x / 1e6 for x in added[HAMI]], 1, 3),
                                            storm_ahead(added[VG], added[HAMI])))

    def shares(self) -> None:
        """SM-share accuracy, synchronous and asynchronous launches, each library in turn."""
        say = self.say
        for tag, title, extra in (
            ("", "synchronous launches (the mock's default)", {}),
            ("-async", "asynchronous launches (NVSIM_ASYNC=1: the call returns at once, as on a real GPU)",
             {"NVSIM_ASYNC": "1"}),
        ):
            say()
            say(f"SM share, {title}:")
            say("  greedy launch loop, 2 ms kernels, busy time from the mock's counters over 12 s; goal +-2 points,")
            say("  never over" + ("; HAMi-core's right after libvgpu's, the same way" if self.hami else ""))
            got = {VG: sm_accuracy(self.driver, self.tmp, str(H.LIB), tag=tag, extra=extra)}
            if self.hami:
                got[HAMI] = sm_accuracy(self.driver, self.tmp, self.hami, tag=tag + "-hami", extra=extra)
            self.share[tag] = got.get(HAMI, {})
            say(f"{'limit %':>8} " + " ".join(f"{k + ' %':>12} {'error':>7}" for k in got))
            for k in ("25", "50", "75"):
                say(f"{k:>8} " + " ".join(f"{g[k]:12.1f} {g[k] - int(k):7.1f}" for g in got.values()))
            say(f"{'30/70':>8} " + " ".join(f"{g['30']:5.1f}/{g['70']:5.1f} {g['30'] - 30:4.1f}/{g['70'] - 70:4.1f}"
                                             for g in got.values()) + "   (two containers, one GPU)")
            say("  50 % at grids " + ", ".join(str(g) for g in GRIDS)
                + " (the simulated kernel's time does not depend on it):")
            for k, g in got.items():
                say(f"   {k:10} " + "  ".join(f"{gr}: {g['50' if gr == 1 else f'grid{gr}']:.1f}" for gr in GRIDS))
            say("  50 % with cuGraphLaunch (a 1-node graph): "
                + ", ".join(f"{k} {g['graph']:.1f}" for k, g in got.items()))


# the parts --only may pick, in the order a full run makes them
PARTS = ("patterns", "launches", "init", "storms", "shares")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--pattern-reps", type=int, default=7)
    ap.add_argument("--hami", default=None, help="HAMi-core's libvgpu.so, measured beside libvgpu")
    ap.add_argument("--pattern", default="", help="only the launch patterns whose name has this text")
    ap.add_argument("--only", choices=PARTS, action="append", default=None, help="only this part (repeatable)")
    args = ap.parse_args()
    hami: str | None = str(Path(args.hami).resolve()) if args.hami else None
    if hami and not Path(hami).is_file():
        sys.exit(f"--hami {args.hami}: no such file; {hami_how()}")
    H.build()
    subprocess.run(["make", "-s", "-C", str(H.LIBVGPU), "build/vgpu_overhead", "build/libvgpu-trace.so"], check=True)
    lines: list[str] = []
    started = time.monotonic()

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    # the accounting files on tmpfs, as nvctk's state dir (/run/nvctk) is on a normal host
    # (this VM's /run and /tmp are on its ext4 disk, where a fresh file's first writes
    # go through the journal)
    tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-", dir=tmpfs) as t:
        b = Run(args, Path(t), hami, say)
        b.head(tmpfs)
        parts = args.only or PARTS
        if "patterns" in parts:
            patterns(b.driver, b.tmp, args.pattern_reps, hami, b.table, args.pattern)
            say()
        if "launches" in parts or "init" in parts:
            b.table.header()
        for part, step in (("launches", b.launches), ("init", b.first_init), ("storms", b.storms),
                           ("shares", b.shares)):
            if part in parts:
                step()
        say()
        summary(b.table, hami, b.share, say)
    say(f"load average at the end {os.getloadavg()[0]:.1f}; the run took {time.monotonic() - started:.0f} s")
    if args.out:
        Path(ROOT / args.out if not os.path.isabs(args.out) else args.out).write_text("\n".join(lines) + "\n")


def summary(table: Table, hami: str | None, share: dict[str, dict[str, float]] | None,
            say: Callable[[str], None]) -> None:
    """Pattern by pattern, which library is ahead beyond the spread, and what HAMi-core's
    limiter held meanwhile."""
    if not hami:
        return
    say("Summary, libvgpu beside HAMi-core (added cost, median [p25..p75]; 'ahead' beyond the spread):")
    for label, v, h, verdict in table.verdicts:
        say(f"  {label:70} {v:>24} {h:>24}  {verdict}")
    counts = {k: sum(1 for *_, x in table.verdicts if x.split(" ")[0] == k) for k in (VG, HAMI, "=")}
    say(f"  libvgpu ahead {counts[VG]}, HAMi-core ahead {counts[HAMI]}, within the spread {counts['=']}")
    if share:
        s = share.get("-async") or share.get("")
        if s:
            say("  HAMi-core's SM limit meanwhile (asynchronous, 2 ms kernels): 50 % held at "
                + ", ".join(f"grid {g} {s['50' if g == 1 else f'grid{g}']:.0f} %" for g in GRIDS)
                + f"; 25/75 % at grid 1: {s['25']:.0f}/{s['75']:.0f} %; the 30/70 split {s['30']:.0f}/{s['70']:.0f} %;"
                f" 50 % with cuGraphLaunch {s['graph']:.0f} %")
            say("  (its launch is charged its grid's block count, not its time, against tokens a thread refills every")
            say("   120 ms from NVML's utilization: a launch reads no clock and times nothing, and a kernel of few")
            say("   blocks runs unthrottled; libvgpu's launch after idle: its presence marker is renewed ahead by a")
            say("   helper thread; a new shape is timed often for its first ~8000 launches (a half, halving every 4")
            say("   samples), which this bench's short runs (600-40000 launches a shape) still include)")


if __name__ == "__main__":
    main()
