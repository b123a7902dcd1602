"""The snapshot as Prometheus text: every series of a scrape from the same snapshot, the
text rendered once per snapshot (Exposition) and served to every scrape of it; with
--compat, HAMi's and dcgm-exporter's series beside nvctk's (nvctk.monitor.compat).

Labels: per GPU `gpu` (NVML index), `UUID`, `modelName`, `Hostname` (dcgm-exporter's
names, so dashboards join); per container also `namespace`, `pod`, `container` (the
Kubernetes guideline's), `container_id`, `container_name`, `kind`, and `device_uuid`
(the MIG device's UUID for a MIG slice, else the GPU's), `resource` (the extended resource
the kubelet gave the container, where the pod-resources socket is read), `claim` (its DRA
ResourceClaims as "namespace/name", ','-joined and sorted, from the same answer; empty for
none), `runtime_root` (the
runtime state dir it was found in: two runtimes may hold the same container id).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterable

from nvctk.host.inventory import HostInfo
from nvctk.monitor import allocation, compat
from nvctk.monitor.exposition import EOF_LINE, Segment, Writer, join, label_set
from nvctk.monitor.model import Snapshot

GPU_LABELS = ["gpu", "UUID", "modelName", "Hostname"]
CTR_LABELS = ["gpu", "UUID", "device_uuid", "modelName", "Hostname", "namespace", "pod",
              "container", "container_id", "container_name", "kind", "resource", "claim", "runtime_root"]

# name -> help: the table in the README is this one
METRICS: dict[str, str] = {
    "nvctk_gpu_memory_used_bytes": "GPU memory in use, all processes (NVML)",
    "nvctk_gpu_memory_total_bytes": "GPU memory size",
    "nvctk_gpu_utilization_ratio": "GPU busy fraction, NVML's last sample",
    "nvctk_gpu_shares": "Containers holding this GPU or a part of it",
    "nvctk_gpu_memory_promised_bytes": "Memory promised to its containers (their caps; the whole GPU for uncapped ones)",
    "nvctk_gpu_sm_promised_ratio": "SM share promised to its containers (their SM limits, a MIG slice's part; 1 per whole GPU with no cap; none for a memory-only cap)",
    "nvctk_gpu_healthy": "1 unless a critical XID was seen since the monitor started",
    "nvctk_gpu_last_xid": "The last XID seen (0: none)",
    "nvctk_gpu_xid_errors": "XID errors seen since the monitor started",
    "nvctk_container_memory_used_bytes": "Memory its processes hold on the device (NVML per-process)",
    "nvctk_container_memory_limit_bytes": "Its memory cap on the device (only capped containers)",
    "nvctk_container_memory_total_bytes": "The MIG slice's size (only MIG slices: a whole GPU's is nvctk_gpu_memory_total_bytes)",
    "nvctk_container_sm_utilization_ratio": "Its share of the GPU's SM time over the last interval (NVML per-process samples)",
    "nvctk_container_sm_limit_ratio": "Its SM share limit (only limited containers)",
    "nvctk_container_processes": "Its processes on the device",
    "nvctk_container_last_kernel_seconds": "Seconds since its last kernel on the device (once one was seen)",
    allocation.METRIC: allocation.HELP,
    "nvctk_monitor_collect_seconds": "How long the last snapshot took",
    "nvctk_monitor_snapshot_age_seconds": "Age of the snapshot this scrape shows",
    "nvctk_monitor_interval_seconds": "The span the SM shares of this snapshot cover",
    "nvctk_monitor_problems": "Causes that hid part of the last snapshot",
    "nvctk_monitor_errors": "Read failures since the monitor started, per kind of cause",
}


GZIP_LEVEL = 1  # a scrape's text shrinks 25x at level 1 already (1024 containers); higher levels cost more CPU
COUNTERS = {"nvctk_gpu_xid_errors": "counter", "nvctk_monitor_errors": "counter"}
GPU_FAMILIES = [n for n in METRICS if n.startswith("nvctk_gpu_")]
CTR_FAMILIES = [n for n in METRICS if n.startswith("nvctk_container_")]


def render_text(snap: Snapshot, errors: dict[str, int]) -> str:
    """nvctk's own series of the snapshot, but its age (that is the scrape's: age_text)."""
    return render(snap, errors).text()


def render(snap: Snapshot, errors: dict[str, int]) -> Writer:
    w = Writer()
    for n in GPU_FAMILIES:  # declared first: a family is there even with no GPU
        w.family(n, METRICS[n], COUNTERS.get(n, "gauge"))
    models = {}
    for g in snap.gpus:
        lv = label_set(GPU_LABELS, [str(g.index), g.uuid, g.name, snap.hostname])
        models[g.index] = g.name
        for name, value in (
            ("nvctk_gpu_memory_used_bytes", g.memory_used),
            ("nvctk_gpu_memory_total_bytes", g.memory_total),
            ("nvctk_gpu_utilization_ratio", g.utilization),
            ("nvctk_gpu_shares", g.shares),
            ("nvctk_gpu_memory_promised_bytes", g.memory_promised),
            ("nvctk_gpu_sm_promised_ratio", g.sm_promised),
            ("nvctk_gpu_healthy", 1 if g.healthy else 0),
            ("nvctk_gpu_last_xid", g.last_xid),
            ("nvctk_gpu_xid_errors", g.xid_errors),
        ):
            w.add(name, METRICS[name], lv, value, COUNTERS.get(name, "gauge"))
    for n in CTR_FAMILIES:
        w.family(n, METRICS[n])
    for c in snap.containers:
        for d in c.devices:
            lv = label_set(CTR_LABELS, [
                str(d.gpu_index), d.gpu_uuid, d.device_uuid, models.get(d.gpu_index, ""),
                snap.hostname, c.namespace, c.pod, c.container, c.id, c.name, c.kind, c.resource,
                c.claim, c.runtime_root])
            ctr(w, "nvctk_container_memory_used_bytes", lv, d.memory_used)
            if d.device_uuid != d.gpu_uuid:  # a slice: a whole GPU's size is the GPU's series
                ctr(w, "nvctk_container_memory_total_bytes", lv, d.memory_total)
            ctr(w, "nvctk_container_sm_utilization_ratio", lv, d.sm_utilization)
            ctr(w, "nvctk_container_processes", lv, len(d.processes))
            if d.memory_limit is not None:
                ctr(w, "nvctk_container_memory_limit_bytes", lv, d.memory_limit)
            if d.sm_limit is not None:
                ctr(w, "nvctk_container_sm_limit_ratio", lv, d.sm_limit)
            if d.last_kernel_seconds is not None:
                ctr(w, "nvctk_container_last_kernel_seconds", lv, d.last_kernel_seconds)
            if c.outside_allocations:
                ctr(w, allocation.METRIC, lv, 1)
    host = label_set(["Hostname"], [snap.hostname])
    for name, value in (("nvctk_monitor_collect_seconds", snap.collect_seconds),
                        ("nvctk_monitor_interval_seconds", snap.interval),
                        ("nvctk_monitor_problems", len(snap.problems))):
        w.add(name, METRICS[name], host, value)
    w.family("nvctk_monitor_errors", METRICS["nvctk_monitor_errors"], "counter")  # even with none
    for cause, count in sorted(errors.items()):
        w.add("nvctk_monitor_errors", METRICS["nvctk_monitor_errors"],
              label_set(["Hostname", "cause"], [snap.hostname, cause]), count, "counter")
    return w


def ctr(w: Writer, name: str, labels: str, value: float | int) -> None:
    w.add(name, METRICS[name], labels, value)


def age_text(snap: Snapshot, now: float, openmetrics: bool = False) -> str:
    name = "nvctk_monitor_snapshot_age_seconds"
    w = Writer()
    w.add(name, METRICS[name], label_set(["Hostname"], [snap.hostname]), max(0.0, now - snap.time))
    return w.text(openmetrics)


class Exposition:
    """/metrics: a snapshot's families are rendered once, joined (and gzip'd) in the format
    asked and kept for the next scrapes (a scrape of an unchanged snapshot renders only its
    age); a second format asked of one snapshot renders it again, once, for every other
    format after it; the compat families asked for (compat.FORMATS) are rendered from the
    same snapshot. The last two snapshots' bodies are kept and read without the render
    lock: the one scrapes are served while the next is made ready (Monitor renders a new
    snapshot before it shows it) never waits on that render. gzip: the snapshot's member and
    the age's are two gzip members, one stream to any gzip reader (RFC 1952)."""

    def __init__(self, compat_formats: Iterable[str] = (), host: HostInfo | None = None) -> None:
        self.formats = tuple(sorted(set(compat_formats)))
        self.host = host
        self._lock = threading.Lock()  # one render at a time
        # (snapshot, its bodies: (openmetrics, gzip) -> bytes), the newest last, two at most
        self._made: list[tuple[Snapshot, dict[tuple[bool, bool], bytes]]] = []
        # a snapshot's families, kept once a second format was asked of it (a scraper asks
        # in one format: they are dropped after its first body otherwise)
        self._segments: tuple[Snapshot, list[Segment]] | None = None

    def body(self, snap: Snapshot | None, now: float, errors: dict[str, int],
             openmetrics: bool = False, gzipped: bool = False) -> bytes:
        if snap is None:
            return b""
        key = (openmetrics, gzipped)
        head = self._cached(snap, key)
        if head is None:
            with self._lock:
                head = self._cached(snap, key) or self._make(snap, errors, key)
        tail = (age_text(snap, now, openmetrics) + (EOF_LINE if openmetrics else "")).encode()
        return head + (gzip.compress(tail, GZIP_LEVEL, mtime=0) if gzipped else tail)

    def _cached(self, snap: Snapshot, key: tuple[bool, bool]) -> bytes | None:
        for made, bodies in self._made:
            if made is snap:
                return bodies.get(key)
        return None

    def _make(self, snap: Snapshot, errors: dict[str, int], key: tuple[bool, bool]) -> bytes:
        bodies = next((b for made, b in self._made if made is snap), None)
        segments = self._segments[1] if self._segments and self._segments[0] is snap else None
        if segments is None:
            segments = render(snap, errors).segments()
            for fmt in self.formats:
                segments += compat.writer(fmt, snap, self.host).segments()
        head = join(segments, key[0]).encode()
        if key[1]:
            head = gzip.compress(head, GZIP_LEVEL, mtime=0)
        self._segments = (snap, segments) if bodies else None
        if bodies is None:
            bodies = {}
            self._made = [*[m for m in self._made if m[0].time <= snap.time][-1:], (snap, bodies)]
        bodies[key] = head
        return head
