"""The monitor at node scale (issue 21 §4): 8 simulated GPUs, 128 vGPU-shared containers
(16 per GPU), each with a process holding memory and having run kernels on the sim.

The containers are what the monitor reads of one: a runtime state.json naming a bundle
with config.json (the device request, Kubernetes annotations) and nvctk-plan.json (the
vGPU limits), and an init process in a cgroup of its own (the process on the GPU, a
vgpu_probe using the sim's libcuda). No runc: 128 real containers on a 2-core VM would
measure runc, not the monitor.

Measured: one collection (NVML + discovery + join), one Prometheus render, and their sum
(a scrape that collects, the worst case; `nvctk monitor` serves a scrape from the last
collection) as medians; then `nvctk monitor` itself over HTTP: /metrics latency and its
resident memory (VmRSS, VmHWM) after many collections.

    .venv/bin/python bench/monitor.py [-n 50] [--out bench/results/monitor.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "libvgpu" / "build" / "vgpu_probe"
MIB = 1 << 20
GPUS, PER_GPU = 8, 16
GOAL_MS, GOAL_RSS_MIB = 50.0, 60.0


def cgroup_root() -> tuple[Path, str]:
    """A cgroup hierarchy the bench can make children in: (its dir, its line prefix)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrls, _path = line.split(":", 2)
        if hid == "0":
            return Path("/sys/fs/cgroup"), line.rsplit(":", 1)[0]
        for c in ctrls.split(","):
            if c in ("pids", "cpu", "memory") and Path(f"/sys/fs/cgroup/{c}/cgroup.procs").exists():
                return Path(f"/sys/fs/cgroup/{c}"), line.rsplit(":", 1)[0]
    raise SystemExit("no cgroup hierarchy to place the bench's processes in")


def proc_start(pid: int) -> int:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return int(data[data.rindex(b")") + 2:].split()[19])


def build_node(tmp: Path, cg_base: Path, procs: list[subprocess.Popen[bytes]]) -> tuple[object, str]:
    from nvctk.edits import Plan, VgpuPlan
    from nvctk.sim import host
    from nvctk.sim.topology import make_topology

    sim = host.init(str(tmp / "host"), make_topology(gpus=GPUS, memory_mib=81920, seed="bench"))
    if not PROBE.exists():
        subprocess.run(["make", "-s", "-C", str(ROOT / "libvgpu")], check=True)
    root = tmp / "runc-root"
    env = {**os.environ, "LD_LIBRARY_PATH": sim.lib_dir}
    for g, gpu in enumerate(sim.topology.gpus):
        for k in range(PER_GPU):
            cid = f"bench-{g}-{k}"
            mem = (1 + k % 4) * 256
            p = subprocess.Popen([str(PROBE), "init", "ctx", str(g), "alloc", str(mem * MIB),
                                  "launch", "20", "wait"], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
            procs.append(p)
            cg = cg_base / cid
            cg.mkdir()
            (cg / "cgroup.procs").write_text(str(p.pid))
            assert p.stdout is not None
            out = b""
            while not out.startswith(b"ready"):
                out = p.stdout.readline()
                if not out or out.split()[1:2] not in ([b"0"], []):
                    raise SystemExit(f"vgpu_probe failed: {out!r}")
            b = tmp / "bundles" / cid
            b.mkdir(parents=True)
            limits = {"CUDA_DEVICE_MEMORY_LIMIT_0": str(4096 * MIB), "CUDA_DEVICE_SM_LIMIT_0": "6"}
            plan = Plan("550.54.15", ("utility", "compute"), (gpu.uuid,),
                        vgpu=VgpuPlan("/usr/lib/nvctk/libvgpu.so", "/run/nvctk/libvgpu.so",
                                      str(tmp / "state" / cid), "/run/nvctk/vgpu", limits))
            (b / "nvctk-plan.json").write_text(plan.to_json())
            (b / "config.json").write_text(json.dumps({
                "ociVersion": "1.1.0",
                "process": {"env": [f"NVIDIA_VISIBLE_DEVICES={gpu.uuid}",
                                    "CUDA_DEVICE_MEMORY_LIMIT=4g", "CUDA_DEVICE_SM_LIMIT=6"]},
                "annotations": {"io.kubernetes.cri.sandbox-namespace": "bench",
                                "io.kubernetes.cri.sandbox-name": f"pod-{g}-{k}",
                                "io.kubernetes.cri.container-name": "main"}}))
            d = root / cid
            d.mkdir(parents=True)
            (d / "state.json").write_text(json.dumps({
                "id": cid, "init_process_pid": p.pid, "init_process_start": proc_start(p.pid),
                "config": {"labels": [f"bundle={b}"]}}))
    return sim, str(root)


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=50, help="samples per figure")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "monitor.txt"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the simulated host's device nodes, cgroups)")
    from prometheus_client import generate_latest

    from nvctk.monitor.collect import Collector
    from nvctk.monitor.server import Monitor

    tmp = Path(tempfile.mkdtemp(prefix="nvctk-bench-monitor-"))
    procs: list[subprocess.Popen[bytes]] = []
    cg_base = cgroup_root()[0] / f"nvctk-bench-{os.getpid()}"
    cg_base.mkdir()
    mon_proc = None
    try:
        sim, root = build_node(tmp, cg_base, procs)
        root = f"containerd={root}"  # its containers carry containerd's CRI keys
        col = Collector(sim.root, [root])  # type: ignore[attr-defined]
        mon = Monitor(col, 1.0)
        snap = col.collect()
        nproc = sum(len(d.processes) for c in snap.containers for d in c.devices)
        if len(snap.containers) != GPUS * PER_GPU or nproc != GPUS * PER_GPU:
            raise SystemExit(f"the monitor sees {len(snap.containers)} containers, {nproc} processes")
        collect, render, both = [], [], []
        for _ in range(args.n):
            t0 = time.perf_counter()
            mon.latest = col.collect()
            t1 = time.perf_counter()
            body = generate_latest(mon.registry)
            t2 = time.perf_counter()
            collect.append(t1 - t0)
            render.append(t2 - t1)
            both.append(t2 - t0)
        series = sum(1 for ln in body.decode().splitlines() if ln and not ln.startswith("#"))
        col.close()

        # nvctk monitor itself: scrapes over HTTP and its memory after many collections
        log = tmp / "monitor.log"
        mon_proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "nvctk"), "monitor", "--listen", "127.0.0.1:0",
             "--interval", "0.2", "--runtime-root", root],
            env={**os.environ, "NVCTK_CONFIG": sim.config_path},  # type: ignore[attr-defined]
            stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115
        port = 0
        deadline = time.monotonic() + 60
        while not port:
            m = re.search(r"serving http://127\.0\.0\.1:(\d+)/", log.read_text())
            port = int(m.group(1)) if m else 0
            if time.monotonic() > deadline or mon_proc.poll() is not None:
                raise SystemExit(f"nvctk monitor did not start: {log.read_text()}")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/metrics"
        while b"nvctk_container_memory_used_bytes{" not in urllib.request.urlopen(url).read():
            time.sleep(0.05)
        http = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            urllib.request.urlopen(url).read()
            http.append(time.perf_counter() - t0)
        time.sleep(5)  # ~25 more collections before the memory is read
        status = Path(f"/proc/{mon_proc.pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
        hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

        lines = [
            f"# bench/monitor.py: {GPUS} simulated GPUs x {PER_GPU} vGPU-shared containers "
            f"({GPUS * PER_GPU} containers, {nproc} GPU processes); {series} series per scrape",
            f"# {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, python "
            f"{platform.python_version()}, n={args.n}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"collect (NVML + discovery + join), median   {median_ms(collect):7.2f} ms   "
            f"p90 {sorted(collect)[int(0.9 * (len(collect) - 1))] * 1000:.2f} ms",
            f"render (Prometheus text), median            {median_ms(render):7.2f} ms",
            f"scrape that collects (collect + render)     {median_ms(both):7.2f} ms   goal < {GOAL_MS:.0f} ms "
            f"{'OK' if median_ms(both) < GOAL_MS else 'MISSED'}",
            f"nvctk monitor /metrics over HTTP, median    {median_ms(http):7.2f} ms   "
            "(served from the last collection, every 0.2 s)",
            f"nvctk monitor resident memory               {rss:7.1f} MiB  (peak {hwm:.1f} MiB)   "
            f"goal < {GOAL_RSS_MIB:.0f} MiB {'OK' if hwm < GOAL_RSS_MIB else 'MISSED'}",
        ]
        text = "\n".join(lines) + "\n"
        print(text, end="")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    finally:
        if mon_proc is not None:
            mon_proc.send_signal(signal.SIGTERM)
            mon_proc.wait(30)
        for p in procs:
            p.kill()
            p.wait()
        for d in sorted(cg_base.glob("*")):
            if d.is_dir():
                d.rmdir()
        cg_base.rmdir()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
