"""The SM limiter's cost per launch in the launch patterns of issue 29, each library beside
no interposer and beside the driver's own entry point (bench/vgpu_overhead.py's first
part)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vgpu_compare import BENCH, CACHE, HAMI, VG, H, Table, fig, hami_env

# (name, client arguments, pairs of bursts per run, SM-limited) for the pattern mode
PATTERNS: list[tuple[str, list[str], int, bool]] = [
    ("no SM limit: bursts of 100 after 1 ms idle", ["kernel", "100", "1000"], 300, False),
    ("greedy loop (blocks of 1000, no idle)", ["kernel", "1000", "0"], 60, True),
    *((f"bursts of {b} after {g / 1000:g} ms idle", ["kernel", str(b), str(g)],
       max(20, min(400, int(600_000 / (g + b * 0.5)))), True)
      for b in (10, 100, 1000) for g in (100, 1000, 10000)),
    ("4 streams in turn, bursts of 100 after 1 ms", ["streams", "100", "1000"], 300, True),
    ("4 threads on one context, bursts of 100 after 1 ms", ["kernel", "100", "1000"], 150, True),
    ("cuGraphLaunch (1 node), bursts of 100 after 1 ms", ["graph", "100", "1000"], 300, True),
    ("cuLaunchKernelEx, bursts of 100 after 1 ms", ["ex", "100", "1000"], 300, True),
    ("cuLaunchCooperativeKernel, bursts of 100 after 1 ms", ["coop", "100", "1000"], 300, True),
]


# what HAMi-core (8f3a89c's src/cuda) does not limit at all: the figure is its wrapper's cost alone
PATTERN_NOTES = {"graph": "HAMi-core does not limit cuGraphLaunch",
                 "coop": "HAMi-core's cuLaunchCooperativeKernel calls no limiter; here the simulated driver "
                         "re-enters its cuLaunchKernel"}


# the driver's own entry point a pattern's kind launches through (the "self" figure); the
# simulated cuLaunchKernelEx and cuLaunchCooperativeKernel re-enter cuLaunchKernel through
# the PLT, i.e. through the interposer: no clean own entry point for them
OWN = {"kernel": "cuLaunchKernel", "streams": "cuLaunchKernel", "graph": "cuGraphLaunch"}


def patterns(driver: H.Driver, tmp: Path, reps: int, hami: str | None, table: Table,
             only: str = "") -> None:
    """The SM limiter's cost in each launch pattern: each library vs no interposer
    (interleaved runs); in one process, each library's entry point vs the driver's own
    (all of its cost) and the limited device vs the unlimited one (the limiter's own)."""
    say = table.say
    say("SM limiter's cost per launch by pattern (SM limit 50 % on GPU 0, asynchronous 0-us kernels:")
    say(f"  the share never binds); ns added per launch, median [p25..p75] of {reps} runs; goal <= 30")
    say(f"{'pattern':58} {'':9} {VG + ' added':>26}" + (f" {HAMI + ' added':>26} {'ahead':>9}" if hami else "")
        + f" {'goal':>7}   limited vs unlimited device: {VG}" + (f", {HAMI}" if hami else ""))
    offs = {k: sym_offset(driver, f) for k, f in OWN.items()}
    for i, (name, argv, n, limited) in enumerate(PATTERNS):
        if only not in name:  # --pattern: those whose name has this text
            continue
        threads = ["4"] if name.startswith("4 threads") else ["1"]
        own = [offs[argv[0]]] if argv[0] in offs else []
        clocked = argv[0] == "kernel" and int(argv[2]) >= 1000 and threads == ["1"] and limited
        inproc: dict[str, list[float]] = {VG: [], HAMI: []}
        vsnone: dict[str, list[float]] = {VG: [], HAMI: []}
        self_: dict[str, list[float]] = {VG: [], HAMI: []}
        clock: list[float] = []
        for r in range(reps):
            st = {"NVSIM_STATE": str(tmp / f"state-pat-{i}-{r}")}
            base = driver.env(tmp / "x", NVSIM_KERNEL_US="0", NVSIM_ASYNC="1", **st)
            lim = {**base, "LD_PRELOAD": str(H.LIB), CACHE: str(tmp / f"cache-pat-{i}-{r}"),
                   **({"CUDA_DEVICE_SM_LIMIT_0": "50"} if limited else {})}
            envs = {"direct": base, VG: lim, **({HAMI: hami_env(lim, hami)} if hami else {})}
            got: dict[str, list[float]] = {}
            names = list(envs)
            for k in names[r % len(names):] + names[:r % len(names)]:
                got[k] = run_pattern(envs[k], [*argv, str(n), *threads, *(own if k != "direct" else [])])
            if clocked:
                clock.append(run_pattern(base, ["clock", *argv[1:], str(n), "1"])[0])
            for k in envs:
                if k != "direct":
                    inproc[k].append(got[k][0])
                    vsnone[k].append(got[k][1] - got["direct"][1])
                    if own:
                        self_[k].append(got[k][2])
        note = PATTERN_NOTES.get(argv[0], "") if limited else "no SM limit"
        table.pair(name, {k: v for k, v in vsnone.items() if v}, "<= 30" if limited else "<= 10", note=note,
                   tail=f"   {fig(inproc[VG], 1)}" + (f", {fig(inproc[HAMI], 1)}" if hami else ""))
        if own:
            table.pair(f"  in one process, vs the driver's own {OWN[argv[0]]}", {k: v for k, v in self_.items() if v},
                       note=note, key=f"{name}: in one process, vs the driver's own")
        if clock:
            say(f"{'  no interposer: a coarse clock read before each launch':58} {'':9} {fig(clock, 8):>26}")
    say("  ('added': the same client without an interposer, runs interleaved; 'in one process, vs the")
    say("   driver's own': a third burst, through the driver's entry point itself, so the machine's load")
    say("   cancels: all of the library's cost; 'limited vs unlimited device': bursts alternate between")
    say("   the devices in one process: the limiter's own cost (for HAMi-core not all of it: its")
    say("   unlimited device's launch asks the driver for the current device too); 'a coarse clock read':")
    say("   no interposer, device 0's launches each after a CLOCK_MONOTONIC_COARSE read, vs device 1's")
    say("   without: the read libvgpu's fast path makes and HAMi-core's does not, to which issue 29 traced")
    say("   the cold bursts' cost; it is a few ns: the cost was the marker renewal it leads to, docs/decisions.md)")


def run_pattern(env: dict[str, str], argv: list[str]) -> list[float]:
    out = subprocess.run(["taskset", "-c", "1", str(BENCH), "pattern", *argv], env=env, capture_output=True,
                         text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def sym_offset(driver: H.Driver, name: str) -> str:
    """A function's offset in the simulated libcuda (hex): the driver's own entry point."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(Path(driver.libdir) / "libcuda.so.1")],
                         capture_output=True, text=True, check=True).stdout
    return next(line.split()[0] for line in out.splitlines() if line.split()[-1:] == [name])
