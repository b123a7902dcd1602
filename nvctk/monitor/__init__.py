"""Per-container GPU metrics: who uses which GPU, how much, against which cap.

collect (NVML + the runtimes' state -> a Snapshot), prom (Prometheus), top (terminal),
server (`nvctk monitor`: /metrics, /api/snapshot, the dashboard page).
"""
