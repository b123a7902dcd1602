"""What loading nvctk's config costs a process (`python3 -I -S`, as the launchers run).

Cases, side by side in one run (medians of N interleaved process starts):
  bare            python3 -I -S -c pass
  config miss     config.load of the simulated host's config: tomllib + the checks
  config hit      the same with the parsed-config cache filled: JSON + the checks
  imports only    the modules of each case (`-X importtime` self-sum, best of 3)
Also the import cost of the value-type and JSON choices (docs/decisions.md):
dataclasses, typing, json, nvctk.base.jsonio, and msgspec when importable.

Run as root (only root writes the cache): python bench/config_load.py [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nvctk.base import config as nvconfig  # noqa: E402
from nvctk.base import stamped  # noqa: E402


def _env(cache: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env[nvconfig.CACHE_VAR] = cache
    return env


def _time(code: str, env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-I", "-S", "-c", code], env=env, check=True)
    return (time.perf_counter() - t) * 1000


def _self_sum(code: str, env: dict[str, str]) -> tuple[int, float]:
    best = None
    for _ in range(3):
        r = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", "-c", code],
                           env=env, check=True, capture_output=True, text=True)
        rows = [line.split("|") for line in r.stderr.splitlines() if line.startswith("import time:")]
        us = [int(row[0].split(":")[1]) for row in rows[1:]]
        got = (len(us), sum(us) / 1000)
        best = got if best is None or got[1] < best[1] else best
    assert best is not None
    return best


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    from nvctk.sim import host

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.toml"
        cfg.write_text(nvconfig.render(host.sim_config(tmp + "/host"), comments=True))
        hit_cache, miss_cache = tmp + "/hit", tmp + "/miss"
        os.makedirs(hit_cache, 0o755)
        os.makedirs(miss_cache, 0o755)
        time.sleep(stamped.RACY_NS / 1e9 + 0.01)  # settled: the stamp can be cached
        nvconfig.load_stat(str(cfg), {nvconfig.CACHE_VAR: hit_cache})
        assert os.listdir(hit_cache), "not cached: run as root"
        load = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from nvctk.base import config; "
                f"config.load({str(cfg)!r})")
        # the miss case must stay a miss: a cache dir nobody may write into
        os.chmod(miss_cache, 0o777)
        cases = {
            "bare": ("pass", hit_cache),
            "config miss (tomllib)": (load, miss_cache),
            "config hit (cache)": (load, hit_cache),
        }
        mods = ["dataclasses", "typing", "json", "tomllib", "nvctk.base.jsonio"]
        try:
            subprocess.run([sys.executable, "-I", "-S", "-c", "import msgspec"], check=True,
                           capture_output=True)
            mods.append("msgspec")
        except subprocess.CalledProcessError:
            pass
        for m in mods:
            code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import {m}"
                    if m.startswith("nvctk") else f"import {m}")
            cases[f"import {m}"] = (code, hit_cache)
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(n):
            for k, (code, cache) in cases.items():
                times[k].append(_time(code, _env(cache)))
        bare = statistics.median(times["bare"])
        print(f"python {sys.version.split()[0]}, {n} interleaved starts per case, medians")
        print(f"{'case':28} {'process ms':>10} {'- bare':>8} {'modules':>8} {'self-sum ms':>12}")
        for k, (code, cache) in cases.items():
            med = statistics.median(times[k])
            count, ms = _self_sum(code, _env(cache))
            print(f"{k:28} {med:10.1f} {med - bare:+8.1f} {count:8d} {ms:12.1f}")
        hit = statistics.median(times["config hit (cache)"])
        miss = statistics.median(times["config miss (tomllib)"])
        print(f"the cache saves {miss - hit:.1f} ms per process that loads the config")


if __name__ == "__main__":
    main()
