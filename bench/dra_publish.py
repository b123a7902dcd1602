"""DRA ResourceSlice publishing on a simulated node of 8 GPUs x 7 MIG devices
(1g.10gb; 64 devices, 8 counter sets, 2 slices), through the official kubernetes
client to the API-server double of tests/support/apiserver.py on loopback (which
checks every slice against the 1.36 schema and limits in its request thread, so its
figures include a server's validation). Goal: publishing the node ≤ 1 s.

Per run, on a fresh double: NVML inventory (the simulated driver, nvctk.host.nvml),
building the pool (nvctk.dra.slices, pure), the first publish (list + 2 creates), a
change (a GPU unhealthy: list + 2 updates at the next generation), a sync with
nothing changed, and a resync check (one list). Median and max over --runs.

    flock /tmp/nvctk-heavy.lock .venv/bin/python bench/dra_publish.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from nvctk.dra.devices import DEFAULT_DRIVER  # noqa: E402
from nvctk.dra.kube import Kube  # noqa: E402
from nvctk.dra.publish import Publisher  # noqa: E402
from nvctk.dra.slices import node_pool  # noqa: E402
from nvctk.host import nvml  # noqa: E402
from nvctk.host.inventory import HostInfo  # noqa: E402
from nvctk.sim import host as simhost  # noqa: E402
from nvctk.sim.topology import make_topology  # noqa: E402
from support.apiserver import client_for, running  # noqa: E402

GOAL_MS = 1000.0


def ms(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1000


def one_run(sim_root: str, h: HostInfo) -> tuple[float, ...]:
    """The phases' times on a fresh double, in the order of main's table."""
    sick = {h.gpus[3].uuid: "XID 79"}
    with running() as api:
        p = Publisher(Kube(client_for(api)), "node-a", DEFAULT_DRIVER)
        t_inv = ms(lambda: nvml.query_host(sim_root))
        t_build = ms(lambda: node_pool(h, DEFAULT_DRIVER, {}))
        t_pub = ms(lambda: p.sync(h, {}))
        t_bad = ms(lambda: p.sync(h, sick))
        t_same = ms(lambda: p.sync(h, sick))
        t_check = ms(lambda: p.sync(h, sick, check=True))
        assert api.rejected() == [] and len(api.pool(DEFAULT_DRIVER, "node-a")) == 2
    return t_inv, t_build, t_pub, t_inv + t_build + t_pub, t_bad, t_same, t_check


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--output", default=str(ROOT / "bench/results/dra_publish.txt"))
    a = ap.parse_args()
    load = os.getloadavg()[0]
    phases: dict[str, list[float]] = {k: [] for k in (
        "NVML inventory (8 GPUs x 7 MIG)", "build the pool (pure)",
        "first publish: list + 2 creates", "node published: inventory + build + publish",
        "a GPU unhealthy: list + 2 updates", "sync, nothing changed", "resync check: 1 list")}
    names = list(phases)
    with tempfile.TemporaryDirectory(prefix="drabench-") as tmp:
        sim = simhost.init(f"{tmp}/h", make_topology(gpus=8, mig={
            i: ["1g.10gb"] * 7 for i in range(8)}))
        h = nvml.query_host(sim.root)
        devices = sum(1 + len(g.mig_devices) for g in h.gpus)
        for run in range(a.runs + 1):  # the first run warms imports and the schema cache
            times = one_run(sim.root, h)
            if run:
                for k, v in zip(names, times, strict=True):
                    phases[k].append(v)
    node = phases["node published: inventory + build + publish"]
    lines = [
        "# nvctk DRA ResourceSlice publishing (bench/dra_publish.py): the official kubernetes "
        "client to the API-server double on loopback (1.36 schema checks included),",
        f"# simulated NVML. {platform.node()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average {load:.1f} at the start "
        "(a machine shared by several engineers)",
        "",
        f"8 GPUs x 7 MIG (1g.10gb): {devices} devices, 8 counter sets, 2 ResourceSlices; "
        f"{a.runs} runs, median / max in ms",
        *(f"  {k:<48} {statistics.median(v):8.1f} {max(v):8.1f}" for k, v in phases.items()),
        "",
        f"goal: the node published <= {GOAL_MS:.0f} ms: median {statistics.median(node):.0f} ms, "
        f"max {max(node):.0f} ms: {'met' if max(node) <= GOAL_MS else 'NOT met'}",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(a.output).write_text(text)


if __name__ == "__main__":
    main()
