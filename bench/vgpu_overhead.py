"""libvgpu overhead and SM-share accuracy on the simulated driver (`make -C libvgpu bench`
writes bench/results/vgpu_overhead.txt). Goals: the README's vGPU figures.

Side by side in one run, direct (no interposer) vs through libvgpu:
  - ns added per cuLaunchKernel with no SM limit (goal <= 10 ns): valid launches
    of a 0-us kernel, and launches the driver rejects at once (NULL function)
  - ns added per cuLaunchKernel under an SM limit of 50 % where the share is not
    binding (goal <= 30 ns); the limited device against an unlimited one in one
    process; libvgpu's entry point against the driver's own in one process; and a
    greedy loop (which waits for its share)
  - ns added per cuMemAlloc_v2 + cuMemFree_v2 pair with a memory cap (goal <= 150 ns)
  - the first cuInit of a single process, on a fresh
    accounting file and on one already in use, with the stages of the first
    (build/libvgpu-trace.so), median and p90 (goal <= 200 us added at the median, the
    p90 <= 400 us); and with 64 processes of one container starting at once (goal
    <= 1 ms added at the median)
  - SM-share accuracy for 25/50/75 %, a 30/70 split of one GPU between two
    containers, and 50 % at grids 1 ... 1048576, with synchronous and
    asynchronous launches (goal: within 2 points)
  - the SM limiter's cost per launch in the launch patterns of issue 29 where the share
    does not bind (asynchronous 0-us kernels): greedy loops, bursts of 10, 100 and 1000
    after idle gaps of 0.1-10 ms, 4 streams, 4 threads on one context, cuGraphLaunch,
    cuLaunchKernelEx, cuLaunchCooperativeKernel (goal <= 30 ns): in one process, device
    0 SM-limited against device 1 unlimited, burst by burst; and across processes,
    libvgpu against no interposer (interleaved runs). Median and spread (min-max) of
    the runs.
Runs are interleaved (direct, libvgpu, direct, ...) and pinned to one CPU; the
figures are medians of the per-pair differences. Needs root (device nodes).
HAMi-core is measured beside libvgpu only where --hami names its library
(libvgpu.so of HAMi-core, preloaded the same way); it is not available on this
machine (its source cannot be fetched here), and the output says so.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "libvgpu" / "tests"))
import harness as H  # noqa: E402

from nvctk.sim.state import read_state  # noqa: E402
from nvctk.vgpu.ledger import SHM_SIZE  # noqa: E402

BENCH = H.BUILD / "vgpu_overhead"


def run(env: dict[str, str], *args: str) -> float:
    out = subprocess.run(["taskset", "-c", "1", str(BENCH), *args], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def paired(direct: dict[str, str], vgpu: dict[str, str], args: list[str], reps: int) -> tuple[float, float, float]:
    d, v, diff = [], [], []
    for _ in range(reps):
        a, b = run(direct, *args), run(vgpu, *args)
        d.append(a)
        v.append(b)
        diff.append(b - a)
    return statistics.median(d), statistics.median(v), statistics.median(diff)


# (name, client arguments, pairs of bursts per run) for the pattern mode
PATTERNS: list[tuple[str, list[str], int]] = [
    ("greedy loop (blocks of 1000, no idle)", ["kernel", "1000", "0"], 60),
    *((f"bursts of {b} after {g / 1000:g} ms idle", ["kernel", str(b), str(g)],
       max(20, min(400, int(600_000 / (g + b * 0.5)))))
      for b in (10, 100, 1000) for g in (100, 1000, 10000)),
    ("4 streams in turn, bursts of 100 after 1 ms", ["streams", "100", "1000"], 300),
    ("4 threads on one context, bursts of 100 after 1 ms", ["kernel", "100", "1000"], 150),
    ("cuGraphLaunch (1 node), bursts of 100 after 1 ms", ["graph", "100", "1000"], 300),
    ("cuLaunchKernelEx, bursts of 100 after 1 ms", ["ex", "100", "1000"], 300),
    ("cuLaunchCooperativeKernel, bursts of 100 after 1 ms", ["coop", "100", "1000"], 300),
]


def patterns(driver: H.Driver, tmp: Path, reps: int, hami: str | None, say: Callable[[str], None]) -> None:
    """The SM limiter's cost in each launch pattern: in one process (device 0 limited
    vs device 1 not, burst by burst), and libvgpu vs no interposer (interleaved runs)."""
    say("SM limiter's cost per launch by pattern (SM limit 50 % on GPU 0, asynchronous 0-us kernels:")
    say("  the share never binds); ns; median [min-max] of the runs; goal <= 30")
    say(f"{'pattern':52} {'limited vs unlimited':>22} {'libvgpu vs none':>22}")
    for i, (name, argv, n) in enumerate(PATTERNS):
        threads = ["4"] if name.startswith("4 threads") else []
        inproc, vsnone = [], []
        for r in range(reps):
            st = {"NVSIM_STATE": str(tmp / f"state-pat-{i}-{r}")}
            base = driver.env(tmp / "x", NVSIM_KERNEL_US="0", NVSIM_ASYNC="1", **st)
            lim = {**base, "LD_PRELOAD": str(H.LIB), "CUDA_DEVICE_SM_LIMIT_0": "50",
                   "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp / f"cache-pat-{i}-{r}")}
            none = run_pattern(base, [*argv, str(n), *threads])
            vg = run_pattern(lim, [*argv, str(n), *threads])
            inproc.append(vg[0])
            vsnone.append(vg[1] - none[1])

        def fmt(v: list[float]) -> str:
            return f"{statistics.median(v):7.1f} [{min(v):6.1f}-{max(v):6.1f}]"
        say(f"{name:52} {fmt(inproc):>22} {fmt(vsnone):>22}")
    say("  ('limited vs unlimited': bursts alternate between the two devices in one process, so the")
    say("   machine's load cancels; 'vs none': the same client without libvgpu, runs interleaved)")
    if hami:
        say(f"HAMi-core ({hami}): not measured by this version of the bench")
    else:
        say("HAMi-core: not measured (no --hami library given; HAMi-core is not available on this machine)")


def run_pattern(env: dict[str, str], argv: list[str]) -> tuple[float, float]:
    out = subprocess.run(["taskset", "-c", "1", str(BENCH), "pattern", *argv], env=env, capture_output=True,
                         text=True, check=True)
    a, b = out.stdout.split()[:2]
    return float(a), float(b)


def launch_offset(driver: H.Driver) -> str:
    """cuLaunchKernel's offset in the simulated libcuda (hex), for the 'launchself' mode."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(Path(driver.libdir) / "libcuda.so.1")],
                         capture_output=True, text=True, check=True).stdout
    return next(line.split()[0] for line in out.splitlines() if line.split()[-1:] == ["cuLaunchKernel"])


def nvctk_env(env: dict[str, str], cache: Path, uuids: list[str]) -> dict[str, str]:
    """env with the limits nvctk writes (a 40 GiB cap per GPU, the GPUs' UUIDs, the
    accounting file) in a limits file instead of the environment."""
    f = Path(f"{cache}.limits")
    f.write_text("".join(f"CUDA_DEVICE_MEMORY_LIMIT_{i}=40g\nNVCTK_VGPU_UUID_{i}={u}\n" for i, u in enumerate(uuids))
                 + f"CUDA_DEVICE_MEMORY_SHARED_CACHE={cache}\n")
    e = {k: v for k, v in env.items() if k not in ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE")}
    return {**e, "NVCTK_VGPU_LIMITS_FILE": str(f)}


def init_single(env: dict[str, str], cache: Path, fresh: bool, trace: bool = False,
                uuids: list[str] | None = None) -> tuple[float, str]:
    """One process's first cuInit (ns), on a fresh (zero-filled, as nvctk makes it) or a
    used accounting file; with trace, the stages' line from libvgpu-trace.so; with
    uuids, the limits in a limits file naming the GPUs (as nvctk writes it)."""
    if fresh and "CUDA_DEVICE_MEMORY_SHARED_CACHE" in env:
        with open(cache, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, SHM_SIZE)
    e = {**env, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(cache)} if "LD_PRELOAD" in env else env
    if uuids is not None and "LD_PRELOAD" in env:
        e = nvctk_env(e, cache, uuids)
    if trace:
        e = {**e, "LD_PRELOAD": str(H.BUILD / "libvgpu-trace.so")}
    cp = subprocess.run(["taskset", "-c", "1", str(BENCH), "init"], env=e, capture_output=True, text=True, check=True)
    return float(cp.stdout.split()[0]), cp.stderr.strip()


def p90(v: list[float]) -> float:
    """The 90th percentile (nearest rank) of v."""
    return sorted(v)[min(len(v) - 1, int(len(v) * 0.9))]


def init_storm(env: dict[str, str], n: int = 64) -> list[float]:
    procs = [subprocess.Popen([str(BENCH), "init"], env=env, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    return [float(p.communicate()[0]) for p in procs]


GRIDS = (1, 64, 4096, 65536, 1048576)


def sm_accuracy(driver: H.Driver, tmp: Path, window: float = 12.0, tag: str = "",
                extra: dict[str, str] | None = None) -> dict[str, float]:
    """Each group is a simulated GPU of its own (a state file), so the groups run at once."""
    groups: dict[str, list[tuple[str, int, int]]] = {
        "s25": [("25", 25, 1)], "s50": [("50", 50, 1)], "s75": [("75", 75, 1)],
        "split": [("30", 30, 1), ("70", 70, 1)],
        **{f"g{g}": [(f"grid{g}", 50, g)] for g in GRIDS[1:]},
    }
    procs = {}
    for state, members in groups.items():
        for label, pct, grid in members:
            env = driver.env(tmp / f"sm{tag}-{state}", NVSIM_KERNEL_US="2000", CUDA_DEVICE_SM_LIMIT=str(pct),
                             CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp / f"sm{tag}-cache-{label}"), LD_PRELOAD=str(H.LIB),
                             **(extra or {}))
            procs[label] = (state, subprocess.Popen(
                [str(H.PROBE), "init", "ctx", "0", "grid", str(grid), "launchfor", str(window + 3)],
                env=env, stdout=subprocess.DEVNULL))

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--hami", default=None, help="HAMi-core's libvgpu.so, measured beside libvgpu")
    ap.add_argument("--only", choices=["patterns"], default=None, help="only this part")
    args = ap.parse_args()
    H.build()
    subprocess.run(["make", "-s", "-C", str(H.LIBVGPU), "build/vgpu_overhead", "build/libvgpu-trace.so"], check=True)
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    # the accounting files on tmpfs, as nvctk's state dir (/run/nvctk) is on a normal host
    # (this VM's /run and /tmp are on its ext4 disk, where a fresh file's first writes
    # go through the journal)
    tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-", dir=tmpfs) as t:
        tmp = Path(t)
        driver = H.make_driver(tmp / "sim", gpus=2, memory_mib=81920)
        base = driver.env(tmp / "state", NVSIM_KERNEL_US="0")
        capped = {**base, "LD_PRELOAD": str(H.LIB), "CUDA_DEVICE_MEMORY_LIMIT": "40g",
                  "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp / "cache")}
        say(f"libvgpu overhead on the simulated driver  ({platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')})")
        say(f"medians of {args.reps} interleaved run pairs, pinned to CPU 1; 'added' = median of (libvgpu - direct)")
        say(f"files in {tmpfs or tempfile.gettempdir()}; load average at start {os.getloadavg()[0]:.1f} "
            "(other work shares the machine: the direct runs see the same load)")
        say()
        patterns(driver, tmp, max(5, args.reps // 3), args.hami, say)
        say()
        if args.only == "patterns":
            say(f"load average at the end {os.getloadavg()[0]:.1f}")
            if args.out:
                Path(ROOT / args.out if not os.path.isabs(args.out) else args.out).write_text("\n".join(lines) + "\n")
            return
        say(f"{'measure':58} {'direct':>10} {'libvgpu':>10} {'added':>10} {'goal':>8}")
        d, v, a = paired(base, capped, ["launch", "1000000"], args.reps)
        say(f"{'cuLaunchKernel, no SM limit, valid 0-us kernel, ns':58} {d:10.1f} {v:10.1f} {a:10.1f} {'<= 10':>8}")
        d, v, a = paired(base, capped, ["launchnull", "2000000"], args.reps)
        say(f"{'cuLaunchKernel, no SM limit, rejected (NULL function), ns':58} {d:10.1f} {v:10.1f} {a:10.1f} {'<= 10':>8}")
        limited = {**capped, "CUDA_DEVICE_SM_LIMIT": "50", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp / "cache-sm")}
        d, v, a = paired(base, limited, ["launchgap", "300000"], args.reps)
        say(f"{'cuLaunchKernel, SM limit 50 %, share not binding, ns':58} {d:10.1f} {v:10.1f} {a:10.1f} {'<= 30':>8}")
        say("  (0-us kernel, blocks of 1000 launches 0.5 ms apart: the limiter's cost, not its waiting; most")
        say("   launches are charged their shape's estimate with no lock or driver call; the first of a shape")
        say("   and a random few (1 in 2 at first, then 1 in 16 to 1 in 1024 by the kernel's cost) are timed)")
        one = {**capped, "CUDA_DEVICE_SM_LIMIT_0": "50", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp / "cache-sm2")}
        # a fresh simulator state per run: the mock scans its process table per launch, and
        # with the dead runs' rows before it the two devices' rows cost differently
        l2 = statistics.median(run({**one, "NVSIM_STATE": str(tmp / f"state-l2-{i}")}, "launch2", "301")
                               for i in range(args.reps))
        say(f"{'  the same, SM-limited device vs an unlimited one, one process, ns':58} {'':10} {'':10} {l2:10.1f}")
        say("  (blocks of 1000 launches 0.5 ms apart alternating between the two devices: robust to the")
        say("   machine's load)")
        off = launch_offset(driver)
        ls = statistics.median(run(limited, "launchself", off, "301") for _ in range(args.reps))
        say(f"{'  the same, libvgpu vs the driver own cuLaunchKernel, one process, ns':58} {'':10} {'':10} {ls:10.1f}")
        say("  (blocks of 1000 launches 0.5 ms apart, alternating between the entry point cuGetProcAddress")
        say("   gives and the driver's own: all of libvgpu's cost, robust to the machine's load)")
        d, v, a = paired(base, limited, ["launch", "300000"], max(3, args.reps // 3))
        say(f"{'cuLaunchKernel, SM limit 50 %, greedy loop, ns':58} {d:10.1f} {v:10.1f} {a:10.1f}")
        say("  (includes waiting for the share: the synchronous simulator's events time a 0-us kernel as its")
        say("   launch call, ~0.4 us of 'device time', so a greedy loop is held to 50 % of its time in launches)")
        d, v, a = paired(base, capped, ["alloc", "200000"], args.reps)
        say(f"{'cuMemAlloc_v2 + cuMemFree_v2 (4 KiB) with a cap, ns':58} {d:10.1f} {v:10.1f} {a:10.1f} {'<= 150':>8}")
        variants = (
            (True, None, "fresh accounting file"), (False, None, "file in use"),
            (True, driver.uuids, "limits file naming the GPUs, fresh"),
            (False, driver.uuids, "limits file naming the GPUs, in use"),
        )
        for fresh, uuids, what in variants:
            dd, vv = [], []
            for i in range(args.reps):
                dd.append(init_single(base, tmp / "single-direct", fresh)[0])
                vv.append(init_single(capped, tmp / f"single{'-u' if uuids else ''}-{i if fresh else 0}", fresh,
                                      uuids=uuids)[0])
            md, mv = statistics.median(dd) / 1e3, statistics.median(vv) / 1e3
            say(f"{'first cuInit, one process, ' + what + ', us':58} {md:10.1f} {mv:10.1f} {mv - md:10.1f} {'<= 200':>8}")
            pd, pv = p90(dd) / 1e3, p90(vv) / 1e3
            say(f"{'  (p90 of the ' + str(len(vv)) + ' runs), us':58} {pd:10.1f} {pv:10.1f} {pv - pd:10.1f} {'<= 400':>8}")
        say("  (env only: NVML maps CUDA devices to the container's GPUs; nvctk's limits file can name their")
        say("   UUIDs (NVCTK_VGPU_UUID_<i>), and then NVML is not loaded)")
        for uuids, what in ((None, "env only"), (driver.uuids, "limits file naming the GPUs")):
            stages = [init_single(capped, tmp / f"trace{'-u' if uuids else ''}-{i}", True, trace=True, uuids=uuids)[1]
                      for i in range(args.reps)]
            say(f"  stages of the first cuInit ({what}, fresh file), us, median of "
                f"{len(stages)} (build/libvgpu-trace.so; 'real_cuinit' is the driver's own):")
            parsed = [dict(kv.split("=") for kv in line.split()[1:]) for line in stages
                      if line.startswith("vgpu-init-trace")]
            if parsed:
                say("   " + "  ".join(f"{k} {statistics.median(float(p[k]) for p in parsed):.1f}" for k in parsed[0]))
        for uuids, what in ((None, "env only"), (driver.uuids, "limits file")):
            dd, vv = [], []
            for i in range(3):
                dd += init_storm(base)
                c = tmp / f"storm{'-u' if uuids else ''}{i}"
                e = {**capped, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(c)}
                vv += init_storm(nvctk_env(e, c, uuids) if uuids else e)
            md, mv = statistics.median(dd) / 1e6, statistics.median(vv) / 1e6
            say(f"{'first cuInit, 64 processes of one container at once (' + what + '), ms':58} {md:10.3f} {mv:10.3f} "
                f"{mv - md:10.3f} {'<= 1':>8}")
            say(f"{'  (p90 of the 3x64 processes), ms':58} {p90(dd) / 1e6:10.3f} {p90(vv) / 1e6:10.3f}")
        for tag, title, extra in (
            ("", "synchronous launches (the mock's default)", {}),
            ("-async", "asynchronous launches (NVSIM_ASYNC=1: the call returns at once, as on a real GPU)",
             {"NVSIM_ASYNC": "1"}),
        ):
            say()
            say(f"SM share, {title}:")
            say("  greedy launch loop, 2 ms kernels, busy time from the mock's counters over 12 s; goal +-2 points")
            got = sm_accuracy(driver, tmp, tag=tag, extra=extra)
            say(f"{'limit %':>8} {'measured %':>11} {'error (points)':>15}")
            for k in ("25", "50", "75"):
                say(f"{k:>8} {got[k]:11.1f} {got[k] - int(k):15.1f}")
            say(f"{'30/70':>8} {got['30']:5.1f}/{got['70']:5.1f} {got['30'] - 30:7.1f}/{got['70'] - 70:5.1f}   (two containers, one GPU)")
            say("  50 % at grids " + ", ".join(str(g) for g in GRIDS) + " (the simulated kernel's time does not depend on it):")
            say("   " + "  ".join(f"{g}: {got['50' if g == 1 else f'grid{g}']:.1f}" for g in GRIDS))
        say()
        say(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.out:
        Path(ROOT / args.out if not os.path.isabs(args.out) else args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
