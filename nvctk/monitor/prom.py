"""The snapshot as Prometheus metrics: a custom prometheus-client Collector, so one scrape
renders one snapshot (every series of a scrape from the same moment).

Labels: per GPU `gpu` (NVML index), `UUID`, `modelName`, `Hostname` (dcgm-exporter's
names, so dashboards join); per container also `namespace`, `pod`, `container` (the
Kubernetes guideline's), `container_id`, `container_name`, `kind`, and `device_uuid`
(the MIG device's UUID for a MIG slice, else the GPU's), `resource` (the extended resource
the kubelet gave the container, where the pod-resources socket is read), `runtime_root` (the
runtime state dir it was found in: two runtimes may hold the same container id).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nvctk.monitor.model import Snapshot

GPU_LABELS = ["gpu", "UUID", "modelName", "Hostname"]
CTR_LABELS = ["gpu", "UUID", "device_uuid", "modelName", "Hostname", "namespace", "pod",
              "container", "container_id", "container_name", "kind", "resource", "runtime_root"]

# name -> help: the table in the README is this one
METRICS: dict[str, str] = {
    "nvctk_gpu_memory_used_bytes": "GPU memory in use, all processes (NVML)",
    "nvctk_gpu_memory_total_bytes": "GPU memory size",
    "nvctk_gpu_utilization_ratio": "GPU busy fraction, NVML's last sample",
    "nvctk_gpu_shares": "Containers holding this GPU or a part of it",
    "nvctk_gpu_memory_promised_bytes": "Memory promised to its containers (their caps; the whole GPU for uncapped ones)",
    "nvctk_gpu_sm_promised_ratio": "SM share promised to its containers (their limits; 1 per uncapped whole GPU)",
    "nvctk_gpu_healthy": "1 unless a critical XID was seen since the monitor started",
    "nvctk_gpu_last_xid": "The last XID seen (0: none)",
    "nvctk_gpu_xid_errors": "XID errors seen since the monitor started",
    "nvctk_container_memory_used_bytes": "Memory its processes hold on the device (NVML per-process)",
    "nvctk_container_memory_limit_bytes": "Its memory cap on the device (only capped containers)",
    "nvctk_container_memory_total_bytes": "The device's size (a MIG slice's or the GPU's)",
    "nvctk_container_sm_utilization_ratio": "Its share of the GPU's SM time over the last interval (NVML per-process samples)",
    "nvctk_container_sm_limit_ratio": "Its SM share limit (only limited containers)",
    "nvctk_container_processes": "Its processes on the device",
    "nvctk_container_last_kernel_seconds": "Seconds since its last kernel on the device (once one was seen)",
    "nvctk_monitor_collect_seconds": "How long the last snapshot took",
    "nvctk_monitor_snapshot_age_seconds": "Age of the snapshot this scrape shows",
    "nvctk_monitor_interval_seconds": "The span the SM shares of this snapshot cover",
    "nvctk_monitor_problems": "Causes that hid part of the last snapshot",
    "nvctk_monitor_errors": "Read failures since the monitor started, per kind of cause",
}


class SnapshotCollector(Collector):
    def __init__(self, latest: Callable[[], Snapshot | None], now: Callable[[], float],
                 errors: Callable[[], dict[str, int]] | None = None) -> None:
        self.latest = latest
        self.now = now
        self.errors = errors

    def describe(self) -> list[Metric]:
        return []  # the registry must not collect at registration

    def collect(self) -> Iterator[Metric]:
        snap = self.latest()
        if snap is None:
            return
        yield from render(snap, self.now(), self.errors() if self.errors else {})


def _g(name: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, METRICS[name], labels=labels)


def render(snap: Snapshot, now: float, errors: dict[str, int]) -> Iterator[Metric]:
    gm = {n: _g(n, GPU_LABELS) for n in METRICS if n.startswith("nvctk_gpu_") and n != "nvctk_gpu_xid_errors"}
    xid = CounterMetricFamily("nvctk_gpu_xid_errors", METRICS["nvctk_gpu_xid_errors"], labels=GPU_LABELS)
    models = {}
    for g in snap.gpus:
        lv = [str(g.index), g.uuid, g.name, snap.hostname]
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
        ):
            gm[name].add_metric(lv, float(value))
        xid.add_metric(lv, float(g.xid_errors))
    yield from gm.values()
    yield xid
    cm = {n: _g(n, CTR_LABELS) for n in METRICS if n.startswith("nvctk_container_")}
    for c in snap.containers:
        for d in c.devices:
            lv = [str(d.gpu_index), d.gpu_uuid, d.device_uuid, models.get(d.gpu_index, ""),
                  snap.hostname, c.namespace, c.pod, c.container, c.id, c.name, c.kind, c.resource,
                  c.runtime_root]
            cm["nvctk_container_memory_used_bytes"].add_metric(lv, float(d.memory_used))
            cm["nvctk_container_memory_total_bytes"].add_metric(lv, float(d.memory_total))
            cm["nvctk_container_sm_utilization_ratio"].add_metric(lv, d.sm_utilization)
            cm["nvctk_container_processes"].add_metric(lv, float(len(d.processes)))
            if d.memory_limit is not None:
                cm["nvctk_container_memory_limit_bytes"].add_metric(lv, float(d.memory_limit))
            if d.sm_limit is not None:
                cm["nvctk_container_sm_limit_ratio"].add_metric(lv, d.sm_limit)
            if d.last_kernel_seconds is not None:
                cm["nvctk_container_last_kernel_seconds"].add_metric(lv, d.last_kernel_seconds)
    yield from cm.values()
    for name, value in (("nvctk_monitor_collect_seconds", snap.collect_seconds),
                        ("nvctk_monitor_snapshot_age_seconds", max(0.0, now - snap.time)),
                        ("nvctk_monitor_interval_seconds", snap.interval),
                        ("nvctk_monitor_problems", float(len(snap.problems)))):
        m = GaugeMetricFamily(name, METRICS[name], labels=["Hostname"])
        m.add_metric([snap.hostname], value)
        yield m
    err = CounterMetricFamily("nvctk_monitor_errors", METRICS["nvctk_monitor_errors"],
                              labels=["Hostname", "cause"])
    for cause, n in sorted(errors.items()):
        err.add_metric([snap.hostname, cause], float(n))
    yield err
