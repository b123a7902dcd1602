"""The monitor at node scale: 8 simulated GPUs x 128 vGPU-shared
containers (1024), each a Pod's, each with a process holding memory and having run
kernels on the sim.

The containers are what the monitor reads of one: a runtime state.json naming a bundle
with config.json (the device request, Kubernetes annotations) and nvctk-edits.json (the
vGPU limits), and an init process in a cgroup of its own (the process on the GPU, a
vgpu_probe using the sim's libcuda). No runc: 1024 real containers on a 2-core VM would
measure runc, not the monitor.

Measured, as medians: one collection (NVML + discovery + join); the render of a new
snapshot (nvctk's series, and with --compat hami,dcgm), which only the first scrape of a
snapshot pays; a scrape of an unchanged snapshot (the cached text and its age); then
`nvctk monitor --compat hami,dcgm` itself over HTTP: /metrics latency and its resident
memory; then `nvctk monitor` with the shipped DaemonSet's arguments while a real
Prometheus scrapes it: scrape latency as Prometheus asks (p90, max), the gzip'd size and
the monitor's memory, against the goals printed. With --soak SECONDS, the monitor then runs that long while containers end and
new ones start, its memory read every minute.

    flock /tmp/nvctk-heavy.lock .venv/bin/python bench/monitor.py [-n 50] [--soak 1800] \
        [--per-gpu 128] [--out bench/results/monitor.txt]
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
GPUS, PER_GPU = 8, 128
GOAL_MS, GOAL_COLLECT_MS = 50.0, 100.0
CHURN_S = 0.5  # soak: a container ends and another starts this often


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


class Node:
    """The simulated host and the containers on it, each as the monitor reads one."""

    def __init__(self, tmp: Path, cg_base: Path) -> None:
        from nvctk.sim import host
        from nvctk.sim.topology import make_topology

        self.tmp, self.cg_base = tmp, cg_base
        self.sim = host.init(str(tmp / "host"), make_topology(gpus=GPUS, memory_mib=81920, seed="bench"))
        if not PROBE.exists():
            subprocess.run(["make", "-s", "-C", str(ROOT / "libvgpu")], check=True)
        self.root = tmp / "runc-root"
        self.env = {**os.environ, "LD_LIBRARY_PATH": self.sim.lib_dir}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.serial = 0

    def fill(self, per_gpu: int) -> None:
        for g in range(GPUS):
            for k in range(per_gpu):
                self.start(g, k)

    def start(self, g: int, k: int) -> str:
        """A container on GPU g: its process holds memory and ran kernels on the sim."""
        from nvctk.edits import Edits, Vgpu

        gpu = self.sim.topology.gpus[g]
        self.serial += 1
        cid = f"bench-{g}-{k}-{self.serial}"
        mem = (1 + k % 4) * 64
        p = subprocess.Popen([str(PROBE), "init", "ctx", str(g), "alloc", str(mem * MIB),
                              "launch", "20", "wait"], env=self.env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
        self.procs[cid] = p
        cg = self.cg_base / cid
        cg.mkdir()
        (cg / "cgroup.procs").write_text(str(p.pid))
        assert p.stdout is not None
        out = b""
        while not out.startswith(b"ready"):
            out = p.stdout.readline()
            if not out or out.split()[1:2] not in ([b"0"], []):
                raise SystemExit(f"vgpu_probe failed ({cid}, {len(self.procs)} running): {out!r}")
        b = self.tmp / "bundles" / cid
        b.mkdir(parents=True)
        limits = {"CUDA_DEVICE_MEMORY_LIMIT_0": str(4096 * MIB), "CUDA_DEVICE_SM_LIMIT_0": "6"}
        plan = Edits("550.54.15", ("utility", "compute"), (gpu.uuid,),
                    vgpu=Vgpu("/usr/lib/nvctk/libvgpu.so", "/run/nvctk/libvgpu.so",
                                  str(self.tmp / "state" / cid), "/run/nvctk/vgpu", limits))
        (b / "nvctk-edits.json").write_text(plan.to_json())
        (b / "config.json").write_text(json.dumps({
            "ociVersion": "1.1.0",
            "process": {"env": [f"NVIDIA_VISIBLE_DEVICES={gpu.uuid}",
                                "CUDA_DEVICE_MEMORY_LIMIT=4g", "CUDA_DEVICE_SM_LIMIT=6"]},
            "annotations": {"io.kubernetes.cri.sandbox-namespace": "bench",
                            "io.kubernetes.cri.sandbox-name": f"pod-{g}-{k}-{self.serial}",
                            "io.kubernetes.cri.container-name": "main"}}))
        d = self.root / cid
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({
            "id": cid, "init_process_pid": p.pid, "init_process_start": proc_start(p.pid),
            "config": {"labels": [f"bundle={b}"]}}))
        return cid

    def stop(self, cid: str) -> None:
        """The container ends and its runtime deletes it: process, state, bundle, cgroup."""
        p = self.procs.pop(cid)
        p.kill()
        p.wait()
        shutil.rmtree(self.root / cid)
        shutil.rmtree(self.tmp / "bundles" / cid)
        (self.cg_base / cid).rmdir()

    def close(self) -> None:
        for cid in list(self.procs):
            self.stop(cid)


def serve(node: Node, tmp: Path, interval: float, compat: str) -> tuple[subprocess.Popen[bytes], str]:
    """`nvctk monitor` on the node; returns it and its base URL once it shows a container."""
    log = tmp / f"monitor-{time.monotonic_ns()}.log"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "nvctk"), "monitor", "--listen", "127.0.0.1:0",
         "--interval", str(interval), "--runtime-root", f"containerd={node.root}"],
        env={**os.environ, "NVCTK_CONFIG": node.sim.config_path, "NVCTK_MONITOR_COMPAT": compat},
        stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115
    port = 0
    deadline = time.monotonic() + 60
    while not port:
        m = re.search(r"serving http://127\.0\.0\.1:(\d+)/", log.read_text())
        port = int(m.group(1)) if m else 0
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"nvctk monitor did not start: {log.read_text()}")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    while b"nvctk_container_memory_used_bytes{" not in get(url + "/metrics"):
        time.sleep(0.05)
    return proc, url


def get(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
        data: bytes = r.read()
        return data


# what Prometheus 2.x asks for: OpenMetrics first, gzip
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
              "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip"}
GOAL_P90_MS, GOAL_MAX_MS, GOAL_RSS_MIB, GOAL_GZIP_MB = 30.0, 100.0, 64.0, 1.0


def shipped_args() -> tuple[float, str]:
    """The interval and --compat of the shipped DaemonSet (deployments/monitor.yaml)."""
    import yaml

    for doc in yaml.safe_load_all((ROOT / "deployments" / "monitor.yaml").read_text()):
        if doc and doc.get("kind") == "DaemonSet":
            (c,) = doc["spec"]["template"]["spec"]["containers"]
            cmd = c["command"]
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            return float(cmd[cmd.index("--interval") + 1]), env.get("NVCTK_MONITOR_COMPAT", "")
    raise SystemExit("no DaemonSet in deployments/monitor.yaml")


def with_prometheus(node: Node, tmp: Path, n: int) -> list[str]:
    """`nvctk monitor` with the shipped arguments, a real Prometheus (Debian's) scraping it
    every second meanwhile; n scrapes of ours as Prometheus asks (OpenMetrics, gzip), one
    every 0.2 s: their latency, the gzip'd size, the monitor's memory after."""
    interval, compat = shipped_args()
    proc, url = serve(node, tmp, interval, compat)
    prom = None
    try:
        exe = shutil.which("prometheus")
        if exe:
            cfg = tmp / "prometheus.yml"
            cfg.write_text(json.dumps({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                                       "scrape_configs": [{"job_name": "nvctk-monitor", "static_configs": [
                                           {"targets": [url.removeprefix("http://")]}]}]}))
            prom = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                     "--web.listen-address=127.0.0.1:0", "--log.level=error"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(5)  # its first scrapes (and the WAL's start) before ours are timed
        lat, size = [], 0
        for _ in range(n):
            t0 = time.perf_counter()
            body = get(url + "/metrics", PROMETHEUS_HEADERS)
            lat.append(time.perf_counter() - t0)
            size = len(body)
            time.sleep(0.2)  # spread over several collections, as scrapes are
        rss, hwm = memory_mib(proc.pid)  # before a plain scrape adds its format's text
        plain = len(get(url + "/metrics"))
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    xs = sorted(lat)
    p90, worst = xs[int(0.9 * (len(xs) - 1))] * 1000, xs[-1] * 1000
    ok = {True: "OK", False: "MISSED"}
    return [
        f"shipped arguments (deployments/monitor.yaml): --interval {interval:g}, --compat {compat or '(none)'}; "
        f"{'a real Prometheus scraping it every 1 s' if prom is not None else 'NO Prometheus (not installed)'}",
        f"scrape as Prometheus asks (OpenMetrics, gzip), n={n}: median {median_ms(lat):6.2f} ms   "
        f"p90 {p90:6.2f} ms (goal <= {GOAL_P90_MS:.0f}: {ok[p90 <= GOAL_P90_MS]})   "
        f"max {worst:6.2f} ms (goal <= {GOAL_MAX_MS:.0f}: {ok[worst <= GOAL_MAX_MS]})",
        f"scrape size: {size / 1e6:.2f} MB gzip'd (goal <= {GOAL_GZIP_MB:g}: {ok[size / 1e6 <= GOAL_GZIP_MB]}), "
        f"{plain / 1e6:.2f} MB plain ({plain / size:.1f}x)",
        f"resident memory after: {rss:.1f} MiB (goal <= {GOAL_RSS_MIB:.0f}: {ok[rss <= GOAL_RSS_MIB]}), "
        f"peak {hwm:.1f} MiB",
    ]


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of the process, MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
    return rss, hwm


def soak(node: Node, tmp: Path, seconds: float, per_gpu: int) -> list[str]:
    """`nvctk monitor --compat hami,dcgm` collecting every second while containers come
    and go (one ends and a new one starts every CHURN_S, GPUs in turn), scraped as
    Prometheus would (/metrics every 5 s, the page's /api/snapshot every 2 s); its
    resident memory read every minute (every tenth of the soak when shorter)."""
    proc, url = serve(node, tmp, 1.0, "hami,dcgm")
    try:
        t0 = time.monotonic()
        step = min(60.0, seconds / 10)
        readings: list[tuple[float, float]] = []
        next_read = t0 + step
        next_scrape = next_page = t0
        churned = 0
        while (now := time.monotonic()) < t0 + seconds:
            g = churned % GPUS
            old = next(c for c in node.procs if c.startswith(f"bench-{g}-"))
            node.stop(old)
            node.start(g, churned % per_gpu)
            churned += 1
            if now >= next_scrape:
                get(url + "/metrics")
                next_scrape += 5
            if now >= next_page:
                get(url + "/api/snapshot")
                next_page += 2
            if now >= next_read:
                readings.append((now - t0, memory_mib(proc.pid)[0]))
                next_read += step
            time.sleep(CHURN_S)  # the churn's pace, not a synchronisation
        rss_end, hwm = memory_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    first = readings[0][1] if readings else rss_end
    mid = [r for t, r in readings if t >= seconds / 2] or [rss_end]
    return [
        f"soak: {seconds / 60:.1f} min, {churned} containers ended and replaced "
        f"({len(node.procs)} live), collection every 1 s, --compat hami,dcgm",
        f"soak resident memory (MiB), every {step:.0f} s    " + " ".join(f"{r:.1f}" for _, r in readings),
        f"soak resident memory: first reading {first:.1f} MiB, second half {min(mid):.1f}-{max(mid):.1f} MiB, "
        f"end {rss_end:.1f} MiB, peak {hwm:.1f} MiB",
    ]


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def write(lines: list[str], out: str) -> None:
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=50, help="samples per figure")
    ap.add_argument("--per-gpu", type=int, default=PER_GPU, help="containers per GPU")
    ap.add_argument("--soak", type=float, default=0, metavar="SECONDS",
                    help="then run nvctk monitor this long with containers coming and going")
    ap.add_argument("--soak-only", action="store_true",
                    help="only the soak (it measures memory, not time: it may run beside other work)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "monitor.txt"))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the simulated host's device nodes, cgroups)")
    tmp = Path(tempfile.mkdtemp(prefix="nvctk-bench-monitor-"))
    cg_base = cgroup_root()[0] / f"nvctk-bench-{os.getpid()}"
    cg_base.mkdir()
    node: Node | None = None
    try:
        node = Node(tmp, cg_base)
        node.fill(args.per_gpu)
        n_ctr = GPUS * args.per_gpu
        if args.soak_only:
            lines = [f"# bench/monitor.py --soak-only: {GPUS} simulated GPUs x {args.per_gpu} vGPU-shared "
                     f"containers ({n_ctr}, each a Pod's); {platform.node()} {platform.machine()} "
                     f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                     *soak(node, tmp, args.soak, args.per_gpu)]
            write(lines, args.out)
            return
        timed = in_process(node, args.n, args.per_gpu)
        served = over_http(node, tmp, args.n)
        lines = [timed[0], machine_line(args.n), *timed[1:], *served]
        lines += with_prometheus(node, tmp, args.n)
        if args.soak:
            lines += soak(node, tmp, args.soak, args.per_gpu)
        write(lines, args.out)
    finally:
        if node is not None:
            node.close()
        for d in sorted(cg_base.glob("*")):
            if d.is_dir():
                d.rmdir()
        cg_base.rmdir()
        shutil.rmtree(tmp, ignore_errors=True)


def machine_line(n: int) -> str:
    """The report's second header line: the machine, and its load average now (the end)."""
    return (f"# {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, python "
            f"{platform.python_version()}, n={n}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"load average {os.getloadavg()[0]:.2f} at the end (other engineers' work on the same VM)")


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] * 1000


def in_process(node: Node, n: int, per_gpu: int) -> list[str]:
    """The collection and the rendering, timed in this process: the report's first header
    line and its first figures."""
    # start time: the monitor's modules after the root check (as before)
    from nvctk.monitor.collect import Collector
    from nvctk.monitor.prom import Exposition

    n_ctr = GPUS * per_gpu
    col = Collector(node.sim.root, [f"containerd={node.root}"])  # containerd's keys: its Pods
    snap = col.collect()
    nproc = sum(len(d.processes) for c in snap.containers for d in c.devices)
    if len(snap.containers) != n_ctr or nproc != n_ctr:
        raise SystemExit(f"the monitor sees {len(snap.containers)} containers, {nproc} processes")
    plain, full = Exposition(), Exposition(("dcgm", "hami"), col.host)
    collect: list[float] = []
    render: list[float] = []
    render_all: list[float] = []
    cached: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        snap = col.collect()
        t1 = time.perf_counter()
        plain.body(snap, time.time(), {})
        t2 = time.perf_counter()
        body = full.body(snap, time.time(), {})
        t3 = time.perf_counter()
        full.body(snap, time.time(), {})
        t4 = time.perf_counter()
        collect.append(t1 - t0)
        render.append(t2 - t1)
        render_all.append(t3 - t2)
        cached.append(t4 - t3)
    own = plain.body(snap, time.time(), {}).decode()
    series = sum(1 for ln in own.splitlines() if ln and not ln.startswith("#"))
    series_all = sum(1 for ln in body.decode().splitlines() if ln and not ln.startswith("#"))
    col.close()
    first = median_ms(render_all) + median_ms(cached)
    return [
        f"# bench/monitor.py: {GPUS} simulated GPUs x {per_gpu} vGPU-shared containers "
        f"({n_ctr} containers, {nproc} GPU processes, each a Pod's); {series} series per scrape, "
        f"{series_all} with --compat hami,dcgm",
        f"collect (NVML + discovery + join), median   {median_ms(collect):7.2f} ms   p90 {p90(collect):.2f} ms   "
        f"goal <= {GOAL_COLLECT_MS:.0f} ms {'OK' if median_ms(collect) <= GOAL_COLLECT_MS else 'MISSED'}",
        f"render a new snapshot, nvctk's series       {median_ms(render):7.2f} ms   p90 {p90(render):.2f} ms",
        f"render a new snapshot, with hami,dcgm       {median_ms(render_all):7.2f} ms   p90 {p90(render_all):.2f} ms",
        f"scrape of an unchanged snapshot (cached)    {median_ms(cached):7.2f} ms",
        f"first scrape of a snapshot, with hami,dcgm  {first:7.2f} ms   goal <= {GOAL_MS:.0f} ms "
        f"{'OK' if first <= GOAL_MS else 'MISSED'}",
    ]


def over_http(node: Node, tmp: Path, n: int) -> list[str]:
    """nvctk monitor itself: scrapes over HTTP and its memory after many collections."""
    mon_proc, url = serve(node, tmp, 0.2, "hami,dcgm")
    try:
        http = []
        for _ in range(n):
            t0 = time.perf_counter()
            get(url + "/metrics")
            http.append(time.perf_counter() - t0)
        time.sleep(5)  # ~25 more collections before the memory is read
        rss, hwm = memory_mib(mon_proc.pid)
    finally:
        mon_proc.send_signal(signal.SIGTERM)
        mon_proc.wait(30)
    return [
        f"nvctk monitor --compat hami,dcgm /metrics over HTTP, median {median_ms(http):7.2f} ms   p90 {p90(http):.2f} ms   "
        "(a collection every 0.2 s)",
        f"nvctk monitor resident memory               {rss:7.1f} MiB  (peak {hwm:.1f} MiB)",
    ]


if __name__ == "__main__":
    main()
