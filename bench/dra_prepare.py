"""DRA plugin: NodePrepareResources / NodeUnprepareResources latency (issue 27) on a
simulated 8-GPU node, over real gRPC with the fake kubelet of tests/support/drakubelet.py,
the claim read by the official `kubernetes` client from the API-server double of
tests/support/apiserver.py on loopback (the read is part of each prepare, as on a node).

Each prepare is a new claim (a kubelet prepares each claim once; a retry is answered from
the record, measured apart): one whole GPU, eight whole GPUs, one 2 GiB share (its ledger
a tmpfs of its own), eight shares; then 50 claims (whole GPUs, round robin over the
eight) in one NodePrepareResources, as a kubelet sends a Pod's claims. Goals: p50 <=
25 ms for one device, <= 100 ms for eight; 50 claims in one request <= 0.5 s.

    flock /tmp/nvctk-heavy.lock .venv/bin/python bench/dra_prepare.py [--claims N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from nvctk.k8s import gen  # noqa: E402

gen.ensure()

from nvctk.base.config import Config  # noqa: E402
from nvctk.dra.kube import Kube, Retry  # noqa: E402
from nvctk.dra.node import make_driver  # noqa: E402
from nvctk.dra.server import Plugin  # noqa: E402
from nvctk.host import nvml  # noqa: E402
from nvctk.k8s.health import Health  # noqa: E402
from nvctk.sim import host  # noqa: E402
from nvctk.sim.topology import make_topology  # noqa: E402
from support import apiserver  # noqa: E402
from support.apiserver import client_for, running  # noqa: E402
from support.drakubelet import FakeDraKubelet  # noqa: E402

DRIVER = "gpu.nvctk.io"
NODE = "bench-node"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def claim(name: str, devices: list[str], share: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {"shareID": "s1", "consumedCapacity": {"memory": "2Gi"}} if share else {}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "bench", "name": name},
            "spec": {"devices": {"requests": [{"name": "gpu"}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d, **extra}
                for d in devices]}}}}


def ms(xs: list[float]) -> str:
    return (f"p50 {statistics.median(xs) * 1e3:.2f} ms, p99 {pct(xs, 99) * 1e3:.2f} ms, "
            f"max {max(xs) * 1e3:.2f} ms")


def batch(api: Any, kl: FakeDraKubelet, rounds: int, claims: int = 50) -> list[str]:
    """`claims` claims in one request, `rounds` times: the request's wall time."""
    took, again, unprep = [], [], []
    for r in range(rounds):
        refs = []
        for i in range(claims):
            name = f"b{r}-{i}"
            obj = api.add_claim(claim(name, [f"gpu-{i % 8}"], False))
            refs.append(("bench", name, obj["metadata"]["uid"]))
        t0 = time.perf_counter()
        got = kl.prepare(refs)
        took.append(time.perf_counter() - t0)
        assert len(got) == claims and not any(a.error for a in got.values()), got
        t0 = time.perf_counter()
        kl.prepare(refs)
        again.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert set(kl.unprepare(refs).values()) == {""}
        unprep.append(time.perf_counter() - t0)
    return [f"{claims} whole-GPU claims in one request, {rounds} requests:",
            f"  NodePrepareResources   {ms(took)} (goal <= 500 ms)",
            f"  again (the records)    {ms(again)}",
            f"  NodeUnprepareResources {ms(unprep)}"]


def cases(api: Any, kl: FakeDraKubelet, claims: int) -> list[str]:
    """Claims of 1 and 8 whole GPUs and of 1 and 8 shares, each prepared, prepared again
    (the kubelet's retry: from the record) and unprepared, one by one."""
    lines: list[str] = []
    for label, n, share in [("1 whole GPU", 1, False), ("8 whole GPUs", 8, False),
                            ("1 share (2 GiB)", 1, True), ("8 shares (2 GiB each)", 8, True)]:
        prep, again, unprep = [], [], []
        for i in range(claims):
            name = f"c{n}{int(share)}-{i}"
            obj = api.add_claim(claim(name, [f"gpu-{g}" for g in range(n)], share))
            ref = [("bench", name, obj["metadata"]["uid"])]
            t0 = time.perf_counter()
            got = kl.prepare(ref)
            prep.append(time.perf_counter() - t0)
            assert not next(iter(got.values())).error, got
            t0 = time.perf_counter()
            kl.prepare(ref)  # the kubelet's retry: from the record
            again.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert kl.unprepare(ref) == {ref[0][2]: ""}
            unprep.append(time.perf_counter() - t0)
        goal = " (goal p50 <= 25 ms)" if n == 1 else " (goal p50 <= 100 ms)"
        lines += [f"{label}, {claims} claims:",
                  f"  NodePrepareResources   {ms(prep)}{goal}",
                  f"  again (the record)     {ms(again)}",
                  f"  NodeUnprepareResources {ms(unprep)}"]
    return lines


def main() -> None:
    # http.server sends a response's headers and body as two segments: with Nagle on,
    # the body waits for the client's delayed ACK (40 ms) on a kept-alive connection, a
    # cost of the double, not of an API server (Go's net/http writes one buffered
    # response); measured with it, every prepare took 40 ms more
    apiserver._Handler.disable_nagle_algorithm = True
    ap = argparse.ArgumentParser()
    ap.add_argument("--claims", type=int, default=200, help="claims per case")
    ap.add_argument("--output", default=str(ROOT / "bench/results/dra_prepare.txt"))
    a = ap.parse_args()
    load = os.getloadavg()
    lines = [
        "# nvctk DRA plugin benchmark (bench/dra_prepare.py): real gRPC over unix sockets,",
        "# fake kubelet in the same process, each claim read through the official kubernetes",
        "# client from the API-server double on loopback (TCP_NODELAY: see the script),",
        "# simulated NVML, 8 GPUs; each prepare a new claim, each retry from the record.",
        f"# {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="drab", dir="/tmp") as tmp, running() as api:
        sim = host.init(f"{tmp}/sim", make_topology(gpus=8))
        cfg = Config(driver_root=sim.root, hook_path="/usr/bin/nvctk-hook",
                     state_dir=f"{tmp}/state", authority_key=f"{tmp}/authority.key")
        info = nvml.query_host(sim.root)
        health = Health()
        kube = Kube(client_for(api), Retry(attempts=3, base=0.01, cap=0.05, deadline=10))
        t0 = time.perf_counter()
        driver, _, _ = make_driver(DRIVER, NODE, kube, f"{tmp}/p", f"{tmp}/cdi", health,
                                   cfg=cfg, host=info)
        startup = time.perf_counter() - t0
        plugin = Plugin(driver, health, f"{tmp}/p", f"{tmp}/r")
        plugin.start()
        kl = FakeDraKubelet(f"{tmp}/r")
        kl.register(DRIVER)
        lines.append(f"plugin start (NVML inventory done): nvctk's CDI forms of 8 GPUs "
                     f"{startup * 1e3:.1f} ms")
        try:
            lines += cases(api, kl, a.claims)
            lines += batch(api, kl, rounds=max(3, a.claims // 20))
        finally:
            kl.close()
            plugin.stop()
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(a.output).write_text(text)


if __name__ == "__main__":
    main()
