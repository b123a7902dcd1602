"""What bench/vgpu_overhead.py's measures share: where the bench client and HAMi-core's
library are, HAMi-core's env, the runs interleaved, and the side-by-side table with its
verdicts (a library is "ahead" where the interquartile range of the paired per-run
differences excludes 0)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "libvgpu" / "tests"))
import harness as H  # noqa: E402

BENCH = H.BUILD / "vgpu_overhead"
CACHE = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
VG, HAMI = "libvgpu", "HAMi-core"
HAMI_BUILD = ROOT.parent / "shared" / "peers" / "hami-core" / "build.sh"


def hami_how() -> str:
    """How to get HAMi-core's library where --hami was not given (CI checkouts have ../shared)."""
    how = (f"build it with {HAMI_BUILD} MIRROR_GIT_DIR SIM_DIR OUT_DIR (its README says how)" if HAMI_BUILD.is_file()
           else "build it from github.com/Project-HAMi/HAMi-core without the CUDA toolkit: CMake with its build.sh's "
           "options and -O2, cuda.h and nvml.h from NVIDIA's nvidia-cuda-runtime-cu12 and nvidia-nvml-dev-cu12 "
           "wheels, linked against a simulated host's (nvctk sim init) libcuda.so.1 and libnvidia-ml.so.1; CI "
           "checkouts have a script for it in ../shared/peers/hami-core/build.sh")
    return how + ", then: make -C libvgpu bench HAMI=OUT_DIR/build-O2/libvgpu.so"


def hami_env(env: dict[str, str], lib: str) -> dict[str, str]:
    """libvgpu's env for a measure, for HAMi-core: its library preloaded, the same limit
    variables (HAMi's names), a shared-cache file of its own (HAMi-core creates and sizes it)."""
    e = {k: v for k, v in env.items() if k != "NVCTK_VGPU_LIMITS_FILE"}
    e["LD_PRELOAD"] = lib
    if CACHE in e:
        e[CACHE] = e[CACHE] + ".hami"
    return e


def quartiles(v: list[float]) -> tuple[float, float, float]:
    """median, p25, p75 of v."""
    if len(v) < 2:
        return v[0], v[0], v[0]
    q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return med, q1, q3


def fig(v: list[float], width: int = 8, prec: int = 1) -> str:
    med, q1, q3 = quartiles(v)
    return f"{med:{width}.{prec}f} [{q1:.{prec}f}..{q3:.{prec}f}]"


def ahead(v: list[float], h: list[float]) -> str:
    """Which library is ahead (lower), run by run: 'libvgpu' / 'HAMi-core' where the
    interquartile range of the paired differences excludes 0, '=' otherwise."""
    _, q1, q3 = quartiles([a - b for a, b in zip(v, h, strict=True)])
    return VG if q3 < 0 else HAMI if q1 > 0 else "="


def interleaved(envs: dict[str, dict[str, str]], run1: Callable[[dict[str, str]], float],
                reps: int) -> dict[str, list[float]]:
    """reps runs of each env, interleaved, the order rotating (so none always goes first)."""
    names = list(envs)
    res: dict[str, list[float]] = {k: [] for k in names}
    for r in range(reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            res[k].append(run1(envs[k]))
    return res


def run(env: dict[str, str], *args: str) -> float:
    out = subprocess.run(["taskset", "-c", "1", str(BENCH), *args], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


class Table:
    """The side-by-side rows: direct, each library's added cost [spread], which is ahead.
    Keeps every verdict for the summary at the end."""

    def __init__(self, say: Callable[[str], None], hami: str | None) -> None:
        self.say, self.hami = say, hami
        self.verdicts: list[tuple[str, str, str, str]] = []  # (measure, libvgpu, HAMi-core, ahead)

    def header(self, first: str = "measure") -> None:
        hcol = f"{HAMI + ' added':>26} {'ahead':>9}" if self.hami else ""
        self.say(f"{first:58} {'direct':>9} {VG + ' added':>26} {hcol} {'goal':>7}")

    def row(self, label: str, res: dict[str, list[float]], goal: str = "", scale: float = 1.0,
            note: str = "", key: str = "") -> None:
        d = [x / scale for x in res["direct"]]
        added = {k: [x / scale - y for x, y in zip(v, d, strict=True)] for k, v in res.items() if k != "direct"}
        self.pair(label, added, goal, f"{statistics.median(d):9.1f}", note, key=key)

    def pair(self, label: str, added: dict[str, list[float]], goal: str = "", direct: str = "",
             note: str = "", tail: str = "", key: str = "") -> None:
        v = added[VG]
        cols = f"{direct:>9} {fig(v, 8):>26}"
        if self.hami and HAMI in added:
            h = added[HAMI]
            verdict = ahead(v, h)
            cols += f" {fig(h, 8):>26} {verdict:>9}"
            self.verdicts.append((key or label.strip(), fig(v, 1), fig(h, 1), verdict + (f" ({note})" if note else "")))
        elif self.hami:
            cols += f" {'-':>26} {'':>9}"
        self.say(f"{label:58} {cols} {goal:>7}{tail}")



def p90(v: list[float]) -> float:
    """The 90th percentile (nearest rank) of v."""
    return sorted(v)[min(len(v) - 1, int(len(v) * 0.9))]


def hami_commit(lib: str) -> str:
    """HAMi-core's commit and build, from what ../shared/peers/hami-core/build.sh leaves
    beside its builds (OUT_DIR/hami_commit.txt, OUT_DIR/build-<variant>/libvgpu.so)."""
    p = Path(lib).resolve()
    f = p.parents[1] / "hami_commit.txt"
    commit = f.read_text().strip()[:12] if f.is_file() else "commit unknown"
    return f"{commit}, build {p.parent.name.removeprefix('build-')}"


def storm_ahead(v: list[float], h: list[float]) -> str:
    """For unpaired samples: a library is ahead where its p75 is below the other's p25."""
    _, v1, v3 = quartiles(v)
    _, h1, h3 = quartiles(h)
    return VG if v3 < h1 else HAMI if h3 < v1 else "="
