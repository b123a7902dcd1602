"""The monitor's parts without a node: the Prometheus rendering of a snapshot (names,
units, labels, what an idle or uncapped container gets), the runtimes' state formats,
non-blocking reads, cgroup ancestry, the pod-resources messages on the wire."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from nvctk.monitor import containers
from nvctk.monitor.collect import _parents, last_kernel_seconds
from nvctk.monitor.model import ContainerSample, DeviceUse, GpuSample, Snapshot
from nvctk.monitor.prom import CTR_LABELS, GPU_LABELS, METRICS, age_text, render_text

GIB, MIB = 1 << 30, 1 << 20


def snapshot() -> Snapshot:
    g = GpuSample(index=0, uuid="GPU-a", name="H100", memory_total=80 * GIB, memory_used=3 * GIB,
                  utilization=0.5, shares=2, memory_promised=81 * GIB, sm_promised=1.3,
                  xid_errors=2, last_xid=79, healthy=False)
    capped = ContainerSample(id="c1", name="worker", kind="vgpu", runtime_root="/run/runc",
                             namespace="ns", pod="p", container="worker", resource="nvidia.com/vgpu",
                             devices=[DeviceUse(0, "GPU-a", "GPU-a", 2 * GIB, 80 * GIB, GIB * 1,
                                                0.25, 0.3, [101, 102], 1.5)])
    idle = ContainerSample(id="c2", name="c2", kind="gpu", runtime_root="/run/runc",
                           devices=[DeviceUse(0, "GPU-a", "GPU-a", 0, 80 * GIB, None, 0.0, None)])
    return Snapshot(time=100.0, interval=5.0, hostname="node1", driver_version="550",
                    gpus=[g], containers=[capped, idle], collect_seconds=0.01)


def render(snap: Snapshot, now: float, errors: dict[str, int]) -> list[Metric]:
    """The text a scrape gets, read back by prometheus-client's own parser."""
    return list(text_string_to_metric_families(render_text(snap, errors) + age_text(snap, now)))


def samples(snap: Snapshot) -> dict[tuple[str, str], tuple[dict[str, str], float]]:
    out = {}
    for m in render(snap, 103.0, {"nvml": 3}):
        for s in m.samples:
            out[(s.name, s.labels.get("container_id", s.labels.get("cause", "")))] = (s.labels, s.value)
    return out


def test_names_units_and_labels() -> None:
    got = samples(snapshot())
    names = {n for n, _ in got}
    # base units in the names, _ratio for fractions, _total on counters
    for n in names:
        assert n.startswith("nvctk_")
        assert not n.endswith("_mib") and "percent" not in n
    assert {"nvctk_gpu_xid_errors_total", "nvctk_monitor_errors_total"} <= names
    labels, v = got[("nvctk_container_memory_used_bytes", "c1")]
    assert v == 2 * GIB
    assert set(labels) == set(CTR_LABELS)
    assert (labels["namespace"], labels["pod"], labels["container"], labels["UUID"], labels["gpu"],
            labels["resource"], labels["modelName"], labels["Hostname"]) == (
        "ns", "p", "worker", "GPU-a", "0", "nvidia.com/vgpu", "H100", "node1")
    assert got[("nvctk_container_sm_utilization_ratio", "c1")][1] == 0.25
    assert got[("nvctk_container_sm_limit_ratio", "c1")][1] == 0.3
    assert got[("nvctk_container_processes", "c1")][1] == 2
    assert got[("nvctk_container_last_kernel_seconds", "c1")][1] == 1.5
    gl, gv = got[("nvctk_gpu_healthy", "")]
    assert set(gl) == set(GPU_LABELS) and gv == 0
    assert got[("nvctk_gpu_last_xid", "")][1] == 79
    assert got[("nvctk_monitor_snapshot_age_seconds", "")][1] == 3.0
    assert got[("nvctk_monitor_errors_total", "nvml")][1] == 3


def test_an_idle_uncapped_container_reports_zero_and_no_cap() -> None:
    got = samples(snapshot())
    assert got[("nvctk_container_memory_used_bytes", "c2")][1] == 0
    assert got[("nvctk_container_sm_utilization_ratio", "c2")][1] == 0
    assert ("nvctk_container_memory_limit_bytes", "c2") not in got
    assert ("nvctk_container_sm_limit_ratio", "c2") not in got
    assert ("nvctk_container_last_kernel_seconds", "c2") not in got


def test_every_metric_has_help() -> None:
    for m in render(snapshot(), 100.0, {}):
        assert m.documentation == METRICS[m.name], m.name


def test_runtime_state_formats(tmp_path: Path) -> None:
    runc = tmp_path / "state.json"
    runc.write_text(json.dumps({"init_process_pid": 42, "init_process_start": 777,
                                "config": {"labels": ["a=b", "bundle=/b/one"]}}))
    assert containers._runtime_state(str(runc)) == ("/b/one", 42, 777)
    crun = tmp_path / "status"
    crun.write_text(json.dumps({"pid": 43, "process-start-time": 0, "bundle": "/b/two"}))
    assert containers._runtime_state(str(crun)) == ("/b/two", 43, None)  # 0: unknown
    for bad in ({"init_process_pid": 42, "config": {"labels": []}},
                {"init_process_pid": "42", "config": {"labels": ["bundle=/x"]}},
                {"init_process_pid": 0, "config": {"labels": ["bundle=/x"]}}):
        runc.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            containers._runtime_state(str(runc))


def test_a_fifo_or_oversized_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def read() -> None:
        with pytest.raises(ValueError, match="not a regular file"):
            containers._read_regular(str(fifo))
        done.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set()
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(ValueError, match="larger than"):
        containers._read_regular(str(big), limit=100)


def test_cgroup_ancestry() -> None:
    assert _parents("4:cpu:/kubepods/pod1/ctr") == [
        "4:cpu:/kubepods/pod1/ctr", "4:cpu:/kubepods/pod1", "4:cpu:/kubepods"]
    assert _parents("0::/") == []  # the root says nothing about ownership
    assert _parents("garbage") == []


def test_last_kernel_seconds() -> None:
    assert last_kernel_seconds(5_000_000, None) is None
    assert last_kernel_seconds(5_000_000, 3_000_000) == 2.0
    assert last_kernel_seconds(5_000_000, 6_000_000) == 0.0  # a sample stamped ahead: never < 0


def test_pod_resources_messages_decode_the_kubelets_wire_format() -> None:
    """Bytes as the kubelet sends them (hand-encoded protobuf: field numbers of v1's
    api.proto, unknown fields such as cpu_ids included) decode to what is read."""
    from nvctk.monitor.podresources import messages

    def ld(field: int, data: bytes) -> bytes:  # a length-delimited field
        return bytes([field << 3 | 2, len(data)]) + data

    dev = ld(1, b"nvidia.com/vgpu") + ld(2, b"GPU-a::1") + ld(2, b"GPU-a::2")
    ctr = ld(1, b"train") + ld(2, dev) + bytes([3 << 3 | 0, 7])  # + cpu_ids = 7 (unknown here)
    pod = ld(1, b"job") + ld(2, b"ml") + ld(3, ctr)
    _, resp = messages()
    msg = resp.FromString(ld(1, pod))
    (p,) = msg.pod_resources
    (c,) = p.containers
    (d,) = c.devices
    assert (p.name, p.namespace, c.name, d.resource_name, list(d.device_ids)) == (
        "job", "ml", "train", "nvidia.com/vgpu", ["GPU-a::1", "GPU-a::2"])


def _claims_answer(containers: list[dict[str, object]], ns: str = "ml") -> object:
    """A ListPodResourcesResponse of the monitor's own descriptor (what the kubelet sends)."""
    from google.protobuf import json_format

    from nvctk.monitor.podresources import messages

    _, resp = messages()
    msg = json_format.ParseDict({"pod_resources": [
        {"name": "job", "namespace": ns, "containers": containers}]}, resp())
    # on the wire and back: the field numbers are what the kubelet's bytes carry
    return resp.FromString(msg.SerializeToString())


def _dyn(name: str, ns: str, *devices: tuple[str, str, str]) -> dict[str, object]:
    return {"claim_name": name, "claim_namespace": ns, "claim_resources": [
        {"driver_name": drv, "pool_name": pool, "device_name": dev,
         "cdi_devices": [{"name": f"{drv}/claim={dev}"}]} for drv, pool, dev in devices]}


GPU_DRV = "gpu.nvctk.dev"


@pytest.mark.parametrize(("container", "want_claims", "label", "resource"), [
    # one claim, one device
    ({"name": "train", "dynamic_resources": [_dyn("gpu-a", "ml", (GPU_DRV, "node1", "gpu-0"))]},
     [("ml/gpu-a", GPU_DRV, "node1", "gpu-0", (f"{GPU_DRV}/claim=gpu-0",))], "ml/gpu-a", ""),
    # two claims given out of order, one with two devices: each claim once, sorted
    ({"name": "train", "dynamic_resources": [
        _dyn("z-mig", "ml", (GPU_DRV, "node1", "gpu-1-mig-1g"), (GPU_DRV, "node1", "gpu-1-mig-2g")),
        _dyn("a-share", "ml", (GPU_DRV, "node1", "gpu-0-share"))]},
     [("ml/z-mig", GPU_DRV, "node1", "gpu-1-mig-1g", (f"{GPU_DRV}/claim=gpu-1-mig-1g",)),
      ("ml/z-mig", GPU_DRV, "node1", "gpu-1-mig-2g", (f"{GPU_DRV}/claim=gpu-1-mig-2g",)),
      ("ml/a-share", GPU_DRV, "node1", "gpu-0-share", (f"{GPU_DRV}/claim=gpu-0-share",))],
     "ml/a-share,ml/z-mig", ""),
    # a device plugin's resource and a claim side by side
    ({"name": "train", "devices": [{"resource_name": "nvidia.com/vgpu", "device_ids": ["GPU-a::1"]}],
      "dynamic_resources": [_dyn("gpu-a", "ml", (GPU_DRV, "node1", "gpu-0"))]},
     [("ml/gpu-a", GPU_DRV, "node1", "gpu-0", (f"{GPU_DRV}/claim=gpu-0",))], "ml/gpu-a",
     "nvidia.com/vgpu"),
    # a claim the kubelet names before any device is prepared; a namespace left out is the Pod's
    ({"name": "train", "dynamic_resources": [{"claim_name": "pending"}]},
     [("ml/pending", "", "", "", ())], "ml/pending", ""),
    # no claim name: nothing to name
    ({"name": "train", "dynamic_resources": [{"claim_namespace": "ml"}]}, None, "", ""),
])
def test_pod_resources_name_each_containers_dra_claims(
        container: dict[str, object], want_claims: list[tuple[object, ...]] | None, label: str,
        resource: str) -> None:
    from nvctk.monitor.podresources import assignments

    got = assignments(_claims_answer([container, {"name": "sidecar"}]))
    assert ("ml", "job", "sidecar") not in got  # got nothing: not listed
    if want_claims is None:
        assert got == {}
        return
    a = got[("ml", "job", "train")]
    assert [(c.claim, c.driver, c.pool, c.device, c.cdi_devices) for c in a.claims] == want_claims
    assert (a.claim, a.resource) == (label, resource)


def test_pod_resources_claims_wire_format() -> None:
    """Hand-encoded bytes with v1 api.proto's numbers (DynamicResource 5; claim_name 2,
    claim_namespace 3, claim_resources 4; driver 2, pool 3, device 4; share_id 5 unknown)."""
    from nvctk.monitor.podresources import assignments, messages

    def ld(field: int, data: bytes) -> bytes:
        return bytes([field << 3 | 2, len(data)]) + data

    res = ld(1, ld(1, b"d/claim=x")) + ld(2, b"drv") + ld(3, b"pool") + ld(4, b"dev") + ld(5, b"s1")
    dyn = ld(2, b"c1") + ld(3, b"ns2") + ld(4, res)
    ctr = ld(1, b"train") + ld(5, dyn)
    _, resp = messages()
    got = assignments(resp.FromString(ld(1, ld(1, b"job") + ld(2, b"ml") + ld(3, ctr))))
    (c,) = got[("ml", "job", "train")].claims
    assert (c.claim, c.driver, c.pool, c.device, c.cdi_devices) == ("ns2/c1", "drv", "pool", "dev",
                                                                   ("d/claim=x",))


def test_the_claim_label_on_every_container_series() -> None:
    snap = snapshot()
    snap.containers[0].claim = "ml/a,ml/b"
    got = samples(snap)
    assert "claim" in CTR_LABELS
    for (name, cid), (labels, _) in got.items():
        if name.startswith("nvctk_container_"):
            assert labels["claim"] == {"c1": "ml/a,ml/b", "c2": ""}[cid], (name, cid)
    assert json.loads(json.dumps(snap.to_dict()))["containers"][0]["claim"] == "ml/a,ml/b"


@pytest.mark.parametrize(("text", "engine", "pattern"), [
    ("/run/containerd/runc/*", "containerd", "/run/containerd/runc/*"),
    ("/run/k3s/containerd/runc/k8s.io", "containerd", "/run/k3s/containerd/runc/k8s.io"),
    ("/run/docker/runtime-runc/*", "docker", "/run/docker/runtime-runc/*"),
    ("/run/runc", "crio", "/run/runc"),
    ("/run/crun", "crio", "/run/crun"),
    ("containerd=/srv/state", "containerd", "/srv/state"),
    ("crio=/run/containerd/runc/x", "crio", "/run/containerd/runc/x"),  # said, not guessed
    ("none=/run/runc", "none", "/run/runc"),
    ("/srv/a=b", "crio", "/srv/a=b"),  # not an engine's name: a path with '='
])
def test_a_runtime_roots_engine(text: str, engine: str, pattern: str) -> None:
    assert containers.parse_root(text) == containers.RuntimeRoot(pattern, engine)


def test_only_the_engines_own_keys_name_a_pod() -> None:
    ann = {"io.kubernetes.cri.sandbox-namespace": "kube-system", "io.kubernetes.cri.sandbox-name": "x",
           "io.kubernetes.cri.container-name": "c", "io.kubernetes.cri.sandbox-uid": "u1",
           "io.kubernetes.pod.namespace": "ml", "io.kubernetes.pod.name": "p",
           "io.kubernetes.container.name": "w", "io.kubernetes.pod.uid": "u2"}
    assert containers._identity(ann, "containerd") == ("kube-system", "x", "c", "u1")
    assert containers._identity(ann, "crio") == ("ml", "p", "w", "u2")
    assert containers._identity(ann, "docker") == ("", "", "", "")
    assert containers._identity({"io.kubernetes.pod.name": 7}, "crio") == ("", "", "", "")


@pytest.mark.parametrize(("name", "shown"), [
    ("plain/name-0", "plain/name-0"),
    ("[/]", "[/]"),
    ("\x1b]0;t\x07", "\\x1b]0;t\\x07"),
    ("a\x9bb\x7f", "a\\x9bb\\x7f"),
    ("r\u202el", "r\\u202el"),
    ("l\u2028m", "l\\u2028m"),
    ("日本", "日本"),
])
def test_a_name_is_shown_as_text(name: str, shown: str) -> None:
    from nvctk.base.errors import literal

    assert literal(name) == shown


def test_top_never_reads_markup_and_fits_80_columns() -> None:
    from rich.console import Console

    from nvctk.monitor.top import render as top

    snap = snapshot()
    snap.containers[0].namespace = "[/]"
    snap.containers[0].pod = "\x1b]8;;http://x/\x1b\\p\x1b]8;;\x1b\\"
    snap.containers[0].claim = "ml/" + "c" * 60 + "\x1b[2J"
    console = Console(width=80, file=open(os.devnull, "w"), markup=False, emoji=False,  # noqa: SIM115
                      record=True)
    console.print(top(snap, 80))
    text = console.export_text()
    assert text.count("[/]/\\x1b]8;;") == 1  # the name as it is, escaped where a control
    assert "\x1b" not in text
    assert max(len(x) for x in text.splitlines()) <= 80
    assert "OVER-PROMISED SM 130%, memory 82944/81920 MiB" in text.replace("\n", " ")
    # the claim on its own line(s), escaped, within the width
    assert "claimml/" + "c" * 60 + "\\x1b[2J" in "".join(text.split())


@pytest.mark.parametrize(("value", "want"), [
    ("0=2G", {"0": 2 << 30}),
    ("0=1G, 1=512M", {"0": 1 << 30, "1": 512 << 20}),
    ("GPU-abc=3G", {"GPU-abc": 3 << 30}),
])
def test_mps_pinned_memory_limits(value: str, want: dict[str, int]) -> None:
    from nvctk.request.parse import mps_memory_limits

    assert mps_memory_limits(value) == want


@pytest.mark.parametrize("value", ["0", "0=", "x=1G", "0=0", "0=-1G", "\u0661=1G"])
def test_bad_mps_pinned_memory_limits(value: str) -> None:
    from nvctk.request.parse import mps_memory_limits

    with pytest.raises(ValueError):
        mps_memory_limits(value)


def _gpu_host() -> tuple[HostInfo, containers.GpuNodes]:
    mig = MigInfo(0, "MIG-a", 1, 0, "3g.40gb", 40000)
    host = HostInfo("550.54.15", "12.4", (
        GpuInfo(0, "GPU-0", "A100", 0, "00000000:01:00.0", 81920, "8.0", "nvidia", True, (mig,)),
        GpuInfo(1, "GPU-1", "A100", 1, "00000000:02:00.0", 81920, "8.0", "nvidia", False)))
    return host, {(195, 0): "GPU-0", (195, 1): "GPU-1", (510, 4): "MIG-a"}


def _spec(devices: list[tuple[int, int]], rules: list[dict[str, object]]) -> dict[str, object]:
    return {"linux": {"devices": [{"path": f"/dev/x{mi}", "type": "c", "major": ma, "minor": mi}
                                  for ma, mi in devices],
                      "resources": {"devices": rules}}}


DENY_ALL = {"allow": False, "access": "rwm"}


def test_gpus_held_by_their_nodes_in_the_spec() -> None:
    """A container without nvctk's record holds the GPUs and MIG devices whose nodes
    (by device number, whatever their path) its spec lists, in NVML order; nvidiactl and
    other nodes name none; a privileged container (every device allowed) none."""
    host, nodes = _gpu_host()
    held = containers.held_gpus
    assert held(_spec([(195, 255), (195, 1), (195, 0), (510, 4)], [DENY_ALL]), nodes,
                host) == ["GPU-0", "MIG-a", "GPU-1"]
    assert held(_spec([(195, 255), (511, 0)], [DENY_ALL]), nodes, host) == []
    assert held(_spec([(195, 1)], [DENY_ALL, {"allow": True, "access": "rwm"}]), nodes,
                host) == []
    # every device allowed, then denied again: only what it was given
    assert held(_spec([(195, 1)], [{"allow": True, "type": "a"}, DENY_ALL]), nodes,
                host) == ["GPU-1"]
    assert held({"linux": "x"}, nodes, host) == []


@pytest.mark.parametrize(("answered", "pod", "resource", "claim", "want"), [
    (True, "p", "", "", True),  # a Pod's GPU the kubelet gave nothing for: flagged
    (True, "p", "nvidia.com/vgpu", "", False),
    (True, "p", "", "ml/share", False),
    (False, "p", "", "", False),  # the kubelet not asked (or no answer): nothing known
    (True, "", "", "", False),  # not a Pod's: nobody allocates it
])
def test_a_gpu_outside_the_kubelets_allocations_is_flagged(
        answered: bool, pod: str, resource: str, claim: str, want: bool) -> None:
    """Issue 39: a Pod's container holding a GPU with no device-plugin resource and no
    DRA claim (its env chose it, on a node left open) is flagged in /metrics and top."""
    from rich.console import Console

    from nvctk.monitor.allocation import FLAG, METRIC, outside_allocations
    from nvctk.monitor.top import render as top

    snap = snapshot()
    c = snap.containers[0]
    c.pod, c.resource, c.claim = pod, resource, claim
    assert outside_allocations(c, answered) is want
    c.outside_allocations = outside_allocations(c, answered)
    got = samples(snap)
    assert ((METRIC, "c1") in got) is want and (METRIC, "c2") not in got
    if want:
        labels, v = got[(METRIC, "c1")]
        assert v == 1 and labels["pod"] == "p" and labels["UUID"] == "GPU-a"
    console = Console(width=80, file=open(os.devnull, "w"), markup=False, emoji=False,  # noqa: SIM115
                      record=True)
    console.print(top(snap, 80))
    # (the name column folds it at 80 columns)
    assert (FLAG.replace(" ", "") in "".join(console.export_text().split())) is want


def _node_of_1024() -> Snapshot:
    """8 GPUs x 128 capped shares, their SM use spread so that the busiest are on the last
    GPU and the idlest on the first."""
    gpus = [GpuSample(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", memory_total=80 * GIB,
                      memory_used=GIB, utilization=0.5, shares=128) for i in range(8)]
    ctrs = [ContainerSample(id=f"c{i}-{j}", name=f"c{i}-{j}", kind="vgpu", runtime_root="/run/runc",
                            namespace="ml", pod=f"job-{i}-{j}", container="w", devices=[
                                DeviceUse(i, f"GPU-{i}", f"GPU-{i}", MIB * j, 80 * GIB, GIB,
                                          (i * 128 + j) / 1024 / 8, 0.125)])
            for i in range(8) for j in range(128)]
    return Snapshot(time=1.0, interval=2.0, hostname="node", driver_version="550.54.15", gpus=gpus,
                    containers=ctrs)


def test_top_at_80x24_reaches_every_gpu_and_container_busiest_first() -> None:
    """The live view at 80x24 with 1024 containers: every GPU on a line of its own, the
    container rows that fit, the busiest first; scrolling reaches the last one, a digit
    narrows to that GPU; no line wider than 80, none beyond the 24th."""
    from rich.console import Console

    from nvctk.monitor.top import View, fit, render, rows_of

    snap = _node_of_1024()

    def screen(view: View) -> list[str]:
        console = Console(width=80, height=24, file=open(os.devnull, "w"),  # noqa: SIM115
                          markup=False, emoji=False, record=True)
        console.print(render(snap, 80, 24, view))
        lines = console.export_text().splitlines()
        assert len(lines) <= 24 and max(len(x) for x in lines) <= 80, "\n".join(lines)
        return lines

    def shown(lines: list[str]) -> list[str]:
        return [w for x in lines for w in x.split() if w.startswith("ml/job-")]

    view = View()
    lines = screen(view)
    assert [x.split()[0] for x in lines if x.split()[:1] and x.split()[-1].endswith("%")
            and "H100" in x] == [str(i) for i in range(8)]  # every GPU
    page = fit(snap, 24)
    assert len(shown(lines)) == page >= 5
    assert shown(lines)[0] == "ml/job-7-127/w"  # the busiest
    rows = rows_of(snap)
    assert [d.sm_utilization for _, d in rows] == sorted((d.sm_utilization for _, d in rows), reverse=True)
    assert f"1-{page} of 1024 · all GPUs · busiest first" in " ".join(lines)
    # a page down, then the bottom: the idlest is reached
    assert view.key(" ", page, 1024, 8) and shown(screen(view))[0] == f"ml/job-7-{127 - page}/w"
    assert view.key("G", page, 1024, 8)
    assert shown(screen(view))[-1] == "ml/job-0-0/w"
    # GPU 3 only, from its busiest
    assert view.key("3", page, 1024, 8)
    lines = screen(view)
    assert shown(lines)[0] == "ml/job-3-127/w" and "of 128 · GPU 3 ·" in " ".join(lines)
    assert view.key("a", page, 1024, 8) and view.gpu is None
    assert not view.key("q", page, 1024, 8)
