"""Take one snapshot of the node: GPUs and per-process figures from NVML, the containers
from their runtimes' host-side state, joined through each process's cgroup.

Trusted sources only: NVML (the driver's own per-process memory and utilization
samples, processes by host pid), /proc, the runtime's state, the bundle nvctk wrote
its plan beside. Nothing a container can write decides another container's
numbers: a container's processes are matched by their cgroup, which only the
runtime sets. Any part that cannot be read is left out of this snapshot, its cause
logged once (until it clears), and the rest goes on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nvctk.base.errors import literal
from nvctk.hook.procs import parent_of
from nvctk.host import nvml
from nvctk.host.inventory import HostInfo
from nvctk.monitor.allocation import outside_allocations
from nvctk.monitor.containers import (
    DEFAULT_RUNTIME_ROOTS,
    Container,
    Device,
    Discovery,
    gpu_nodes,
    proc_start,
)
from nvctk.monitor.health import Health
from nvctk.monitor.model import ContainerSample, DeviceUse, GpuSample, Snapshot

if TYPE_CHECKING:  # grpc is imported only with --pod-resources-socket
    from nvctk.monitor.podresources import Assigned

log = logging.getLogger("nvctk.monitor")

IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})  # application faults (deviceplugin.health)
XID_EVENT = 0x8
MAX_SAMPLE_AGE_US = 10_000_000  # ask NVML for samples at most this far back


def cgroup_paths(pid: int) -> list[str]:
    """The process's cgroups as "hierarchy:controllers:path" lines (v1 and v2 alike)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except OSError:
        return []


def _parents(line: str) -> list[str]:
    """line and the same hierarchy's ancestors of its path (a container's processes may
    sit in sub-cgroups of it), nearest first; never the hierarchy's root."""
    head, sep, path = line.rpartition(":")
    out = []
    while sep and path not in ("", "/"):
        out.append(f"{head}:{path}")
        path = os.path.dirname(path)
    return out


def own_ancestry() -> set[tuple[int, int | None]]:
    """(pid, start) of this process and its ancestors: the container the monitor runs
    in has one of them as its init (with hostPID, as NVML and the runtimes see it)."""
    out = set()
    pid = os.getpid()
    for _ in range(64):  # a chain of parents, bounded
        if pid <= 1:
            break
        out.add((pid, proc_start(pid)))
        ppid = parent_of(pid)
        if ppid == pid:
            break
        pid = ppid
    return out


def last_kernel_seconds(now_us: int, last_active_us: int | None) -> float | None:
    """Seconds since the container's last kernel on a device: from the end of the last
    NVML utilization sample in which its processes ran kernels (trusted; its resolution
    is the sample span, one collection interval). The one place to switch to what
    libvgpu publishes (container-written: the container's own claim) where it sees
    launches more finely."""
    if last_active_us is None:
        return None
    return max(0.0, (now_us - last_active_us) / 1e6)


class Collector:
    """Holds NVML open for the monitor's life and takes snapshots."""

    def __init__(self, driver_root: str, runtime_roots: tuple[str, ...] | list[str] = DEFAULT_RUNTIME_ROOTS,
                 host: HostInfo | None = None, pod_resources: str | None = None) -> None:
        self.driver_root = driver_root
        self.host = host if host is not None else nvml.query_host(driver_root)
        mod = nvml.held(driver_root)
        self.nv: Any = mod
        self.handles = {g.index: mod.nvmlDeviceGetHandleByUUID(g.uuid) for g in self.host.gpus}
        self.health = Health(mod, self.handles)
        # the GPUs' device nodes: containers given a GPU without nvctk (a DRA claim's
        # whole GPU or MIG device) are found by them (read once, as the inventory is)
        self.discovery = Discovery(runtime_roots, gpu_nodes(driver_root, self.host))
        # the node's name: in a Pod without host network the hostname is the Pod's
        # (the DaemonSet sets NODE_NAME from the downward API, as for dcgm-exporter)
        self.hostname = os.environ.get("NODE_NAME") or socket.gethostname()
        self._own = own_ancestry()
        self._lock = threading.Lock()  # one collection at a time
        self._last_seen: dict[int, int] = {}  # GPU index -> NVML sample timestamp (us)
        self._last_active: dict[tuple[str, str], int] = {}  # (container, device) -> us
        self._xids: dict[int, tuple[int, int]] = {}  # GPU index -> (count, last)
        self._unhealthy: set[int] = set()
        self._cg_cache: dict[tuple[int, int | None], list[str]] = {}
        self._logged: set[str] = set()
        self._problems: dict[str, str] = {}
        self.errors_total: dict[str, int] = {}  # cause kind -> count (a counter)
        self._events = self._open_events()
        self.podres: Any = None
        if pod_resources:
            # start time: grpc only with --pod-resources-socket
            from nvctk.monitor.podresources import PodResources

            self.podres = PodResources(pod_resources)

    # --- problems: logged once per cause, counted every time -----------------------------
    def problem(self, cause: str, message: str) -> None:
        self._problems[cause] = message
        kind = cause.split(":", 1)[0]
        self.errors_total[kind] = self.errors_total.get(kind, 0) + 1
        if cause not in self._logged:
            self._logged.add(cause)
            log.warning("%s (logged once until it clears)", literal(message))

    def _open_events(self) -> Any:
        nv = self.nv
        try:
            evset = nv.nvmlEventSetCreate()
            for h in self.handles.values():
                nv.nvmlDeviceRegisterEvents(h, XID_EVENT, evset)
            return evset
        except nv.NVMLError as e:
            self.problem("xid", f"XID events not watched: {e}")
            return None

    def _drain_xids(self) -> None:
        nv = self.nv
        if self._events is None:
            return
        uuid_index = {g.uuid: g.index for g in self.host.gpus}
        for _ in range(1000):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                return  # timeout: drained
            if data.eventType != XID_EVENT:
                continue
            uuid = nv.nvmlDeviceGetUUID(data.device)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            i = uuid_index.get(uuid)
            if i is None:
                continue
            n, _ = self._xids.get(i, (0, 0))
            self._xids[i] = (n + 1, int(data.eventData))
            if int(data.eventData) not in IGNORED_XIDS:
                self._unhealthy.add(i)

    # --- NVML per GPU ------------------------------------------------------------------
    def _gpu(self, index: int, now_us: int) -> tuple[GpuSample, list[tuple[int, int]], dict[int, tuple[int, int]]]:
        """The GPU, its processes (host pid, bytes) and their samples (pid -> (smUtil %, ts))."""
        nv = self.nv
        h = self.handles[index]
        info = next(g for g in self.host.gpus if g.index == index)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        try:
            util = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        except nv.NVMLError:
            util = 0.0
        procs = [(int(p.pid), int(p.usedGpuMemory or 0))
                 for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
        since = self._last_seen.get(index, 0)
        if since and since < now_us - MAX_SAMPLE_AGE_US:
            since = now_us - MAX_SAMPLE_AGE_US
        acc: dict[int, tuple[int, int, int]] = {}  # pid -> (sum of smUtil, samples, last ts)
        seen = 0
        try:
            for s in nv.nvmlDeviceGetProcessUtilization(h, since):
                ts = int(s.timeStamp)
                # the real driver may answer one sample per sample period: their mean
                u, n, t = acc.get(s.pid, (0, 0, 0))
                acc[s.pid] = (u + int(s.smUtil), n + 1, max(t, ts))
                seen = max(seen, ts)
        except nv.NVMLError as e:
            if e.value != nv.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no kernel since `since`
                self.problem(f"nvml-utilization:{index}", f"GPU {index}: process utilization: {e}")
        samples = {pid: (round(u / n), t) for pid, (u, n, t) in acc.items()}
        # the next samples start where these end; with none, nothing ran until now
        self._last_seen[index] = seen or now_us
        count, last = self._xids.get(index, (0, 0))
        g = GpuSample(index=index, uuid=info.uuid, name=info.name, memory_total=int(mem.total),
                      memory_used=int(mem.used), utilization=util,
                      healthy=index not in self._unhealthy, xid_errors=count, last_xid=last,
                      mig=bool(info.mig_devices), health=self.health.read(index))
        return g, procs, samples

    # --- pid -> container ------------------------------------------------------------------
    def _container_cgroups(self, containers: list[Container]) -> dict[str, Container]:
        """cgroup line -> container, from each container's init process. Lines the host's
        init or the monitor itself share (a hierarchy the runtime did not split) say
        nothing about who owns a process and are left out."""
        out: dict[str, Container] = {}
        keep = set()
        common = set(cgroup_paths(1)) | set(cgroup_paths(os.getpid()))
        for c in containers:
            key = (c.init_pid, c.init_start)
            keep.add(key)
            lines = self._cg_cache.get(key)
            if lines is None:
                lines = [ln for ln in cgroup_paths(c.init_pid) if _parents(ln) and ln not in common]
                if lines:
                    self._cg_cache[key] = lines
            for ln in lines:
                out[ln] = c
        for key in set(self._cg_cache) - keep:
            del self._cg_cache[key]
        return out

    @staticmethod
    def _owner(pid: int, by_cgroup: dict[str, Container]) -> Container | None:
        for line in cgroup_paths(pid):
            for cand in _parents(line):
                c = by_cgroup.get(cand)
                if c is not None:
                    return c
        return None

    # --- the snapshot ------------------------------------------------------------------------
    def collect(self) -> Snapshot:
        with self._lock:
            return self._collect()

    def _collect(self) -> Snapshot:
        t0 = time.monotonic()
        now = time.time()
        now_us = int(now * 1e6)
        prev = dict(self._last_seen)
        self._problems = {}
        self._drain_xids()
        gpus: dict[int, GpuSample] = {}
        procs: dict[int, list[tuple[int, int]]] = {}
        samples: dict[int, dict[int, tuple[int, int]]] = {}
        for index in sorted(self.handles):
            try:
                gpus[index], procs[index], samples[index] = self._gpu(index, now_us)
            except Exception as e:
                self.problem(f"nvml:{index}", f"GPU {index}: {e}")
        # the monitor's own container (its Pod gets the driver through the nvidia runtime)
        # holds no GPU work of anyone's: never a share
        containers = [c for c in self.discovery.scan(self.host, self.problem)
                      if (c.init_pid, c.init_start) not in self._own]
        resources, kubelet_answered = self._kubelet_resources()
        owned = self._owned(procs, self._container_cgroups(containers))
        out: list[ContainerSample] = []
        live_keys: set[tuple[str, str]] = set()
        for c in containers:
            # what it asked for, for its whole life: its neighbours change nvctk_gpu_shares,
            # never its own series
            got = resources.get((c.namespace, c.pod, c.k8s_container))
            cs = ContainerSample(id=c.id, name=c.name, kind=c.base_kind, runtime_root=c.runtime_root,
                                 namespace=c.namespace, pod=c.pod, container=c.k8s_container,
                                 pod_uid=c.pod_uid,
                                 resource=got.resource if got else "", claim=got.claim if got else "")
            used_gpu: set[int] = set()
            for i, d in enumerate(c.devices):
                # a container's processes on a GPU count once, on its first device there
                pids = [] if d.gpu_index in used_gpu else owned.get((c.id, d.gpu_index), [])
                used_gpu.add(d.gpu_index)
                live_keys.add((c.id, d.device_uuid))
                cs.devices.append(self._device_use(c, i, d, pids, procs, samples, gpus, now_us))
            cs.outside_allocations = outside_allocations(cs, kubelet_answered)
            out.append(cs)
        for key in set(self._last_active) - live_keys:
            del self._last_active[key]
        self._logged &= set(self._problems)  # a cause that cleared is logged again if it recurs
        # the span the SM shares cover: from the previous samples' end to this one's
        spans = [(self._last_seen[i] - prev[i]) / 1e6 for i in self._last_seen if i in prev
                 and self._last_seen[i] > prev[i]]
        interval = max(spans) if spans else 1.0
        return Snapshot(time=now, interval=interval, hostname=self.hostname,
                        driver_version=self.host.driver_version,
                        gpus=[gpus[i] for i in sorted(gpus)], containers=out,
                        collect_seconds=time.monotonic() - t0,
                        problems=sorted(self._problems.values()))

    def _kubelet_resources(self) -> tuple[dict[tuple[str, str, str], Assigned], bool]:
        """What the kubelet assigned each container (namespace, pod, container), and
        whether it answered; a problem when it did not (only the names are lost)."""
        if self.podres is None:
            return {}, False
        try:
            return self.podres.list(), True
        except Exception as e:  # absent, hanging (deadline), refusing: names only are lost
            code = getattr(e, "code", None)
            why = (code().name if callable(code) else
                   "absent" if isinstance(e, FileNotFoundError) else type(e).__name__)
            self.problem(f"pod-resources:{why}", f"kubelet pod-resources {self.podres.socket}: "
                         f"{getattr(e, 'details', lambda: None)() or e}")
            return {}, False

    def _owned(self, procs: dict[int, list[tuple[int, int]]],
               by_cgroup: dict[str, Container]) -> dict[tuple[str, int], list[int]]:
        """(container id, GPU index) -> its processes there."""
        owned: dict[tuple[str, int], list[int]] = {}
        for index, plist in procs.items():
            for pid, _mem in plist:
                c = self._owner(pid, by_cgroup)
                if c is not None:
                    owned.setdefault((c.id, index), []).append(pid)
        return owned

    def _device_use(self, c: Container, i: int, d: Device, pids: list[int],
                    procs: dict[int, list[tuple[int, int]]],
                    samples: dict[int, dict[int, tuple[int, int]]],
                    gpus: dict[int, GpuSample], now_us: int) -> DeviceUse:
        """Container c's use of its i-th device d (its processes there: pids), with its
        caps; the GPU's shares and promises counted in gpus."""
        mem_by_pid = dict(procs.get(d.gpu_index, []))
        smp = samples.get(d.gpu_index, {})
        mem_used = sum(mem_by_pid.get(p, 0) for p in pids)
        sm = sum(smp[p][0] for p in pids if p in smp) / 100.0
        key = (c.id, d.device_uuid)
        active = [smp[p][1] for p in pids if p in smp and smp[p][0] > 0]
        if active:
            self._last_active[key] = max(active)
        mem_cap = c.memory_limits[i] if i < len(c.memory_limits) else 0
        mps_mem = c.mps_memory[i] if i < len(c.mps_memory) else 0
        if mps_mem and (not mem_cap or mps_mem < mem_cap):
            mem_cap = mps_mem  # MPS's pinned-memory limit caps it as well
        sm_cap = c.sm_limits[i] if i < len(c.sm_limits) else 0
        if not sm_cap and c.mps_percent is not None:
            sm_cap = c.mps_percent
        use = DeviceUse(
            gpu_index=d.gpu_index, gpu_uuid=d.gpu_uuid, device_uuid=d.device_uuid,
            memory_used=mem_used, memory_total=d.memory_total,
            memory_limit=mem_cap or None, sm_utilization=min(1.0, sm),
            sm_limit=sm_cap / 100.0 if sm_cap else None, processes=sorted(pids),
            last_kernel_seconds=last_kernel_seconds(now_us, self._last_active.get(key)),
        )
        g = gpus.get(d.gpu_index)
        if g is not None:
            g.shares += 1
            g.memory_promised += mem_cap or d.memory_total
            # a memory-only cap promises memory, no SM share (it takes what is free,
            # as HAMi counts a Pod without gpucores): only a whole GPU, uncapped, is all
            g.sm_promised += (sm_cap / 100.0 if sm_cap else
                              d.memory_total / g.memory_total if d.mig else
                              0.0 if mem_cap else 1.0)
        return use

    def close(self) -> None:
        nv = self.nv
        if self.podres is not None:
            self.podres.close()
        try:
            self.health.close()
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def run_every(interval: float, fn: Callable[[], None], stop: threading.Event) -> threading.Thread:
    """Calls fn now and then every `interval` seconds until stop is set (a daemon thread)."""
    def loop() -> None:
        while True:
            try:
                fn()
            except Exception:  # the loop must outlive any one failure
                log.exception("collection failed")
            if stop.wait(interval):
                return
    t = threading.Thread(target=loop, name="nvctk-monitor-collect", daemon=True)
    t.start()
    return t


__all__ = ["Collector", "cgroup_paths", "last_kernel_seconds", "proc_start", "run_every"]
