"""Device plugin speed and scale on simulated nodes, over real gRPC with
the fake kubelet of tests/support/kubelet.py:

- 8 GPUs x 7 MIG devices (migStrategy mixed: nvidia.com/mig-1g.10gb, 56 devices);
- 8 GPUs x 16 vGPU shares (nvidia.com/vgpu, 128 devices);
for each: ListAndWatch first-response latency and message size, Allocate latency
(median, p99; one container, 1 device / 4 shares); then the time from an injected
XID to the Unhealthy update reaching the kubelet's stream (goal < 1 s).

    .venv/bin/python bench/deviceplugin.py [--allocs N] [--output bench/results/deviceplugin.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from nvctk.k8s import gen  # noqa: E402

gen.ensure()

from nvctk.host import nvml  # noqa: E402
from nvctk.k8s import config as dpconfig  # noqa: E402
from nvctk.k8s import resources  # noqa: E402
from nvctk.k8s.server import Manager  # noqa: E402
from nvctk.sim import events, host  # noqa: E402
from nvctk.sim.topology import make_topology  # noqa: E402
from support.kubelet import FakeKubelet, pb  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def node(tmp: str, name: str, topo: Any, conf: dict[str, Any], allocs: int,
         per_alloc: int, xids: bool) -> list[str]:
    sim = host.init(f"{tmp}/{name}", topo)
    cfg = dpconfig.parse({"version": "v1", **conf})
    info = nvml.query_host(sim.root)
    res = resources.build(cfg, info)
    kdir = tempfile.mkdtemp(prefix="kl", dir="/tmp")
    kl = FakeKubelet(kdir).start()
    mgr = Manager(res, cfg, sim.root, info, kdir, health_events=xids)
    t = threading.Thread(target=mgr.run, daemon=True)
    t.start()
    out: list[str] = []
    try:
        kl.wait_for([r.name for r in res], timeout=30)
        if mgr.watcher:
            mgr.watcher.ready.wait(10)
        r = res[0]
        p = kl.plugins[r.name]
        p.wait_list()
        # ListAndWatch: a fresh stream's first response, as a kubelet (re)connecting sees it
        lw, size = [], 0
        for _ in range(20):
            t0 = time.perf_counter()
            stream = p.stub.ListAndWatch(pb.Empty())
            first = next(stream)
            lw.append(time.perf_counter() - t0)
            stream.cancel()
            size = first.ByteSize()
        ids = list(r.devices)
        lat = []
        for i in range(allocs):
            k = (i * per_alloc) % (len(ids) - per_alloc + 1)
            req = pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=ids[k:k + per_alloc])])
            t0 = time.perf_counter()
            p.stub.Allocate(req)
            lat.append(time.perf_counter() - t0)
        out += [
            f"{name}: {r.name}, {len(r.devices)} devices advertised",
            f"  ListAndWatch first response: {len(first.devices)} devices, {size} bytes; "
            f"latency median {statistics.median(lw) * 1e3:.2f} ms, max {max(lw) * 1e3:.2f} ms "
            f"(20 streams)",
            f"  Allocate ({per_alloc} id(s)/container), {allocs} calls: median "
            f"{statistics.median(lat) * 1e3:.2f} ms, p99 {pct(lat, 99) * 1e3:.2f} ms",
        ]
        if xids:
            out.append(xid_latency(sim.root, topo, r, p))
    finally:
        mgr.stop()
        t.join(10)
        kl.stop()
    return out


def xid_latency(sim_root: str, topo: Any, r: Any, p: Any) -> str:
    """XID 79 injected on each GPU of resource r: how long until the kubelet's stream
    (plugin p) shows its first device Unhealthy."""
    times = []
    for g in topo.gpus:
        ids_g = [d for d in r.devices.values() if d.unit.gpu_uuid == g.uuid]
        if not ids_g:
            continue
        want = ids_g[0].id
        t0 = time.monotonic()
        events.inject_xid(sim_root, g.index, 79)
        p.wait_list(lambda d, w=want: d.get(w) == "Unhealthy", timeout=5)
        times.append(time.monotonic() - t0)
    return (f"  XID 79 -> Unhealthy on the kubelet's stream, {len(times)} GPUs: "
            f"median {statistics.median(times) * 1e3:.1f} ms, max "
            f"{max(times) * 1e3:.1f} ms (goal < 1000 ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--allocs", type=int, default=1000)
    ap.add_argument("--output", default=str(ROOT / "bench/results/deviceplugin.txt"))
    a = ap.parse_args()
    lines = [
        "# nvctk device plugin benchmark (bench/deviceplugin.py): real gRPC over unix sockets,",
        "# fake kubelet in the same process, simulated NVML. "
        f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="dpbench-") as tmp:
        lines += node(tmp, "8 GPUs x 7 MIG", make_topology(gpus=8, mig={
            i: ["1g.10gb"] * 7 for i in range(8)}), {"flags": {"migStrategy": "mixed"}},
            a.allocs, 1, xids=True)
        lines.append("")
        lines += node(tmp, "8 GPUs x 16 vGPU shares", make_topology(gpus=8),
                      {"sharing": {"vgpu": {"replicas": 16}}}, a.allocs, 4, xids=True)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(a.output).write_text(text)


if __name__ == "__main__":
    main()
