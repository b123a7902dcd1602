"""The monitor on a simulated host, with containers run through nvctk-runtime and
real runc: its snapshot, `nvctk top --once --json`, bad input. Every figure is judged
against the simulated GPU's own counters (its per-process memory and busy time in the
shared state file), never against libvgpu's bookkeeping.

The Prometheus server and browser tests live in tests/e2e/test_monitor_e2e.py, the CRI Pods
in tests/e2e/test_monitor_cri.py; the node is tests/support/monitor.py's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.monitor.collect import Collector
from nvctk.monitor.containers import Discovery, load_container
from support.monitor import MIB, FakePodResources, Node, serving, sim_counts, standard_containers

# every test here shares a node of real runc containers (seconds to start): all slow;
# tests/unit/test_monitor_parts.py has the quick ones
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                                 reason="needs root (sim device nodes) and runc")]

BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("monitor"))
    try:
        standard_containers(n)
        yield n
    finally:
        n.cleanup()


def _devices(snap, cid):  # type: ignore[no-untyped-def]
    c = next((c for c in snap.containers if c.id == cid), None)
    assert c is not None, f"{cid} not in the snapshot: {[x.id for x in snap.containers]}"
    return c


@pytest.mark.exclusive  # an SM share over wall time
def test_snapshot_matches_the_simulated_gpu(node: Node) -> None:
    """Memory within 1 MiB and SM share within 5 points of the sim's counters, for
    several capped containers on one GPU (one idle), a whole GPU and a MIG device."""
    col = Collector(node.sim.root, [node.runc_root])
    try:
        col.collect()
        a = sim_counts(node)
        snap = node.collect_after(col, 4.0)
        b = sim_counts(node)
    finally:
        col.close()
    span = b.time - a.time
    for cid, want in node.expect.items():
        c = _devices(snap, cid)
        assert c.kind == want["kind"], (cid, c.kind)
        assert len(c.devices) == 1
        d = c.devices[0]
        assert d.device_uuid == want["device"]
        mem = b.mem[cid]
        assert abs(d.memory_used - mem) <= MIB, (cid, d.memory_used, mem)
        assert mem >= want["min_mem"]
        busy = (b.busy[cid] - a.busy[cid]) / (span * 1e9)
        assert abs(d.sm_utilization - busy) <= 0.05, (cid, d.sm_utilization, busy)
        assert d.memory_limit == want.get("mem_cap")
        assert d.sm_limit == want.get("sm_cap")
        assert len(d.processes) == b.procs[cid]
        if want["busy"]:
            assert d.sm_utilization > 0.05 and d.last_kernel_seconds is not None
        else:
            assert d.sm_utilization == 0.0  # idle: 0, not nothing
    # host pids: every container's process is its own entry (not all "pid 1")
    pids = [p for c in snap.containers for d in c.devices for p in d.processes]
    assert len(pids) == len(set(pids)) >= len(node.expect)
    assert all(p != 1 for p in pids)
    g0 = snap.gpus[0]
    capped = [w for w in node.expect.values() if w["device"] == g0.uuid]
    assert g0.shares == len(capped)
    assert g0.memory_promised == sum(w["mem_cap"] for w in capped)
    # a memory-only cap promises no SM share (issue 36): only the SM limits count
    assert any(w["sm_cap"] is None for w in capped)
    assert abs(g0.sm_promised - sum(w["sm_cap"] or 0.0 for w in capped)) < 1e-9


def test_top_json_matches_the_simulated_gpu(node: Node) -> None:
    r = subprocess.run([os.path.join(BIN, "nvctk"), "top", "--json", "--runtime-root",
                        node.runc_root], env={**os.environ, **node.sim.env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    counts = sim_counts(node)
    by_id = {c["id"]: c for c in snap["containers"]}
    for cid in node.expect:
        d = by_id[cid]["devices"][0]
        assert abs(d["memory_used"] - counts.mem[cid]) <= MIB
    assert [g["uuid"] for g in snap["gpus"]] == [g.uuid for g in node.sim.topology.gpus]
    # the terminal view renders the same snapshot
    r = subprocess.run([os.path.join(BIN, "nvctk"), "top", "--once", "--runtime-root",
                        node.runc_root], env={**os.environ, **node.sim.env, "COLUMNS": "160"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for cid in node.expect:
        assert cid[:24] in r.stdout


def test_ended_container_disappears_within_one_interval(node: Node) -> None:
    col = Collector(node.sim.root, [node.runc_root])
    try:
        cid = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, "vgpu_probe init ctx 0 alloc "
                         f"{64 * MIB} sleep 600000", gpu="0", wait_mem=64 * MIB)
        assert any(c.id == cid for c in col.collect().containers)
        node.kill(cid)
        # runc keeps a stopped container's state until delete: it has ended all the same
        assert not any(c.id == cid for c in col.collect().containers)
    finally:
        col.close()


def test_garbage_from_a_container_changes_no_other_number(node: Node) -> None:
    """A capped container overwrites what it can write (its accounting file) with garbage
    and a huge claim: the monitor does not read it, the others' numbers stay exact and
    its own stay the sim's."""
    cid = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"},
                     f"vgpu_probe init ctx 0 alloc {32 * MIB} sleep 600000", gpu="0",
                     wait_mem=32 * MIB)
    garbage = ("head -c 400000 /dev/urandom > /run/nvctk/vgpu/cache && "
               "printf 'GPU-%s' $(head -c 60 /dev/zero | tr '\\0' f) >> /run/nvctk/vgpu/cache && "
               "echo done")
    r = subprocess.run(["runc", "--root", node.runc_root, "exec", cid, "/bin/sh", "-c", garbage],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "done", r.stderr
    col = Collector(node.sim.root, [node.runc_root])
    try:
        snap = col.collect()
    finally:
        col.close()
        counts = sim_counts(node)
        node.kill(cid)
    assert not snap.problems, snap.problems
    for c in snap.containers:
        want = counts.mem.get(c.id)
        if want is not None:
            assert abs(c.devices[0].memory_used - want) <= MIB, c.id
    mine = _devices(snap, cid).devices[0]
    assert mine.memory_used < 1 << 30


def test_bad_runtime_state_is_logged_once_and_the_rest_goes_on(
        node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A corrupt state.json, a bundle whose config.json is unreadable, a container dir
    that vanishes: left out, each logged once; the real containers are all there."""
    root = tmp_path / "root"
    shutil.copytree(node.runc_root, root, symlinks=True,
                    ignore=shutil.ignore_patterns("*.sock", "exec.fifo"))
    (root / "corrupt").mkdir()
    (root / "corrupt" / "state.json").write_text('{"init_process_pid": 1, "config": ')
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "nvctk-edits.json").write_text("{not json")
    (bundle / "config.json").write_text("{}")
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "state.json")  # would block a plain open() for ever
    (root / "deep").mkdir()
    (root / "deep" / "state.json").write_text("[" * 100000)
    (root / "badplan").mkdir()
    (root / "badplan" / "state.json").write_text(json.dumps(
        {"init_process_pid": os.getpid(), "config": {"labels": [f"bundle={bundle}"]}}))
    # crun's state (<root>/<id>/status) of one of the running containers, under another id
    some = next(iter(node.expect))
    st = json.loads((Path(node.runc_root) / some / "state.json").read_text())
    bundle_of = next(lb[7:] for lb in st["config"]["labels"] if lb.startswith("bundle="))
    crun = tmp_path / "crun"
    (crun / "crunctr").mkdir(parents=True)
    (crun / "crunctr" / "status").write_text(json.dumps({
        "pid": st["init_process_pid"], "process-start-time": st["init_process_start"],
        "cgroup-path": "", "rootfs": "rootfs", "bundle": bundle_of, "created": "now"}))
    col = Collector(node.sim.root, [str(root), str(tmp_path / "absent"), str(crun)])
    try:
        with caplog.at_level(logging.WARNING, logger="nvctk.monitor"):
            s1 = col.collect()
            s2 = col.collect()
    finally:
        col.close()
    for snap in (s1, s2):
        assert {c.id for c in snap.containers} >= {*node.expect, "crunctr"}
        twin = {c.id: c for c in snap.containers}
        # (one cgroup, two records: its processes count for one of them)
        assert [(d.device_uuid, d.memory_limit, d.sm_limit) for d in twin["crunctr"].devices] == \
            [(d.device_uuid, d.memory_limit, d.sm_limit) for d in twin[some].devices]
        assert len(snap.problems) == 4, snap.problems
    warned = [r.getMessage() for r in caplog.records]
    for name in ("corrupt", "fifo", "deep"):
        assert sum(f"/{name}/" in m for m in warned) == 1, (name, warned)
    assert sum("badplan" in m or "nvctk-plan" in m for m in warned) == 1


def test_container_state_vanishing_mid_read(node: Node, tmp_path: Path) -> None:
    """The state file goes between the listing and the read: that container is skipped
    quietly (it has ended), the others stay."""
    d = Discovery([node.runc_root])
    calls = []
    real = load_container

    def vanish(root: str, cid: str, path: str, host, engine, nodes):  # type: ignore[no-untyped-def]
        calls.append(cid)
        if len(calls) == 1:
            raise FileNotFoundError(path)
        return real(root, cid, path, host, engine, nodes)

    import nvctk.monitor.containers as mod

    problems: list[str] = []
    orig = mod.load_container
    mod.load_container = vanish
    try:
        got = d.scan(node.host, lambda cause, msg: problems.append(cause))
    finally:
        mod.load_container = orig
    assert len(got) == len(node.live_ids()) - 1
    assert len(problems) == 1


def test_a_scrape_never_waits_for_a_stuck_collection(node: Node) -> None:
    """A collection that hangs (here: its container discovery blocked) leaves /metrics
    answering from the last snapshot, its age growing, well within a second."""
    import threading
    import urllib.request

    from nvctk.monitor.server import Monitor

    col = Collector(node.sim.root, [node.runc_root])
    mon = Monitor(col, 0.2)
    release = threading.Event()
    stuck = threading.Event()
    real_scan = col.discovery.scan
    calls = []

    def scan(host, problem):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 1:
            stuck.set()
            release.wait(60)
        return real_scan(host, problem)

    col.discovery.scan = scan  # type: ignore[method-assign]
    with serving(mon) as url:
        try:
            assert mon.wait_first(60)
            assert stuck.wait(60)
            for path in ("/metrics", "/api/snapshot", "/"):
                # a scan stuck behind a hung runtime must not hold the answer (timeout=1)
                with urllib.request.urlopen(url + path, timeout=1) as r:
                    body = r.read()
                assert r.status == 200, path
            text = body if path == "/" else b""
            assert b"<title>nvctk GPU shares</title>" in text
            with urllib.request.urlopen(url + "/metrics", timeout=1) as r:
                metrics = r.read().decode()
            for cid in node.expect:
                assert f'container_id="{cid}"' in metrics
            assert "nvctk_monitor_snapshot_age_seconds" in metrics
        finally:
            release.set()


def test_time_sliced_replicas_and_an_mps_share_appear(node: Node) -> None:
    """Two more containers on the whole GPU 1 (time-sliced replicas: three shares, each
    still the whole GPU it asked for), an MPS share on GPU 0 (its thread percentage is
    its SM limit)."""
    g0, g1, _ = node.sim.topology.gpus
    hold = "vgpu_probe init ctx 0 alloc {} sleep 600000"
    started = [node.start({}, hold.format(50 * MIB), gpu=g1.uuid, wait_mem=50 * MIB)
               for _ in range(2)]
    started.append(node.start({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, hold.format(70 * MIB),
                              gpu=g0.uuid, wait_mem=70 * MIB))
    col = Collector(node.sim.root, [node.runc_root])
    try:
        snap = col.collect()
        counts = sim_counts(node)
    finally:
        col.close()
        for cid in started:
            node.kill(cid)
    by_id = {c.id: c for c in snap.containers}
    on_g1 = [c for c in snap.containers if c.devices[0].gpu_uuid == g1.uuid]
    assert len(on_g1) == 3 and {c.kind for c in on_g1} == {"gpu"}
    mps = by_id[started[2]]
    assert mps.kind == "mps" and mps.devices[0].sm_limit == 0.5
    for cid in started:
        assert abs(by_id[cid].devices[0].memory_used - counts.mem[cid]) <= MIB
    g = next(x for x in snap.gpus if x.uuid == g1.uuid)
    assert g.shares == 3


def _assert_faults_lost_only_the_resource(snaps: list[Any], cid: str, node: Node,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Collections through a socket that hangs or is absent: one problem each, every
    container still listed, only the resource lost; one warning per cause."""
    for s in snaps:
        assert len(s.problems) == 1 and "pod-resources" in s.problems[0], s.problems
        ids = {c.id for c in s.containers}
        assert ids >= {cid, *node.expect}
        assert next(c for c in s.containers if c.id == cid).resource == ""
    warned = [r.getMessage() for r in caplog.records if "pod-resources" in r.getMessage()]
    assert len(warned) == 2, warned  # the hang once, the absence once
    assert "Deadline Exceeded" in warned[0] and "no kubelet pod-resources socket" in warned[1]


def test_pod_resources_name_the_resource_and_its_faults_hide_nothing(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet's pod-resources answer names the resource a Pod's container got; a
    socket that is absent or hangs loses only that name, logged once per cause."""
    import socket

    from support.daemons import short_dir

    hung: list[Any] = []
    absent: list[Any] = []
    g0 = node.sim.topology.gpus[0]
    ann = {"io.kubernetes.cri.sandbox-namespace": "ml", "io.kubernetes.cri.sandbox-name": "job-1",
           "io.kubernetes.cri.container-name": "train"}
    cid = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, f"vgpu_probe init ctx 0 alloc {20 * MIB} "
                     "sleep 600000", gpu=g0.uuid, wait_mem=20 * MIB, annotations=ann)
    try:
        with short_dir("nvctk-pr-") as d:
            sock = d / "kubelet.sock"
            kubelet = FakePodResources(sock, [{"name": "job-1", "namespace": "ml", "containers": [
                {"name": "train", "devices": [{"resource_name": "nvidia.com/vgpu",
                                               "device_ids": [f"{g0.uuid}::3"]}]}]}])
            # containerd's keys name the Pod under a containerd root
            col = Collector(node.sim.root, [f"containerd={node.runc_root}"],
                            pod_resources=str(sock))
            try:
                snap = col.collect()
                assert kubelet.calls == 1
            finally:
                col.close()
                kubelet.stop()
            by_id = {c.id: c for c in snap.containers}
            assert by_id[cid].resource == "nvidia.com/vgpu"
            assert (by_id[cid].namespace, by_id[cid].pod, by_id[cid].container) == (
                "ml", "job-1", "train")
            assert all(by_id[c].resource == "" for c in node.expect)  # not Pods
            assert not snap.problems
            # a listening socket that never answers: the deadline, then the rest
            hang_path = d / "hang.sock"
            hang = socket.socket(socket.AF_UNIX)
            hang.bind(str(hang_path))
            hang.listen(16)
            with caplog.at_level(logging.WARNING, logger="nvctk.monitor"):
                for path in (hang_path, d / "absent.sock"):
                    col = Collector(node.sim.root, [f"containerd={node.runc_root}"],
                                    pod_resources=str(path))
                    try:
                        (hung if path == hang_path else absent).extend(
                            col.collect() for _ in range(2))
                    finally:
                        col.close()
            hang.close()
    finally:
        node.kill(cid)
    _assert_faults_lost_only_the_resource(hung + absent, cid, node, caplog)


def _claim_labels(metrics: str) -> dict[str, set[str]]:
    """Container id -> the `claim` labels of its nvctk_container_* series."""
    from prometheus_client.parser import text_string_to_metric_families

    claims: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(metrics):
        if fam.name.startswith("nvctk_container_"):
            for smp in fam.samples:
                claims.setdefault(smp.labels["container_id"], set()).add(smp.labels["claim"])
    return claims


def _top_once(node: Node, sock: Path) -> subprocess.CompletedProcess[str]:
    """`nvctk top --once` on 80 columns with the kubelet's pod-resources socket."""
    return subprocess.run([os.path.join(BIN, "nvctk"), "top", "--once", "--runtime-root",
                           f"containerd={node.runc_root}", "--pod-resources-socket", str(sock)],
                          env={**os.environ, **node.sim.env, "COLUMNS": "80"},
                          capture_output=True, text=True, timeout=60)


def test_a_dra_claim_is_named_in_metrics_snapshot_and_top(node: Node) -> None:
    """A container the kubelet reports as holding DRA claims (pod-resources
    dynamic_resources) carries them in the `claim` label of its series, in /api/snapshot
    and in `nvctk top`; a container the kubelet names no claim for carries none, whatever
    its own env says."""
    import urllib.request

    from nvctk.monitor.server import Monitor
    from support.daemons import short_dir

    g0 = node.sim.topology.gpus[0]
    ann = {"io.kubernetes.cri.sandbox-namespace": "ml", "io.kubernetes.cri.sandbox-name": "job-dra",
           "io.kubernetes.cri.container-name": "train"}
    cid = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"},
                     f"vgpu_probe init ctx 0 alloc {20 * MIB} sleep 600000", gpu=g0.uuid,
                     wait_mem=20 * MIB, annotations=ann)
    # the same Pod's other container: the kubelet gave it nothing; its env claims a claim
    other = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g", "NVCTK_DRA_CLAIM": "ml/gpu-share"},
                       f"vgpu_probe init ctx 0 alloc {20 * MIB} sleep 600000", gpu=g0.uuid,
                       wait_mem=20 * MIB, annotations={**ann, "io.kubernetes.cri.container-name": "side"})
    claim = {"claim_name": "gpu-share", "claim_namespace": "ml", "claim_resources": [
        {"driver_name": "gpu.nvctk.dev", "pool_name": "node1", "device_name": "gpu-0-share",
         "cdi_devices": [{"name": "gpu.nvctk.dev/claim=ml-gpu-share"}]}]}
    extra = {"claim_name": "a-extra", "claim_namespace": "ml", "claim_resources": []}
    try:
        with short_dir("nvctk-pr-") as d:
            sock = d / "kubelet.sock"
            kubelet = FakePodResources(sock, [{"name": "job-dra", "namespace": "ml", "containers": [
                {"name": "train", "dynamic_resources": [claim, extra]}, {"name": "side"}]}])
            try:
                mon = Monitor(Collector(node.sim.root, [f"containerd={node.runc_root}"],
                                        pod_resources=str(sock)), 0.5)
                with serving(mon) as url:
                    assert mon.wait_first(60)
                    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                        metrics = r.read().decode()
                    with urllib.request.urlopen(url + "/api/snapshot", timeout=10) as r:
                        snap = json.loads(r.read())
                r = _top_once(node, sock)
            finally:
                kubelet.stop()
    finally:
        node.kill(cid)
        node.kill(other)
    claims = _claim_labels(metrics)
    assert claims[cid] == {"ml/a-extra,ml/gpu-share"}
    assert claims[other] == {""}
    assert all(claims[c] == {""} for c in node.expect)
    by_id = {c["id"]: c for c in snap["containers"]}
    assert (by_id[cid]["claim"], by_id[other]["claim"]) == ("ml/a-extra,ml/gpu-share", "")
    assert r.returncode == 0, r.stderr
    assert max(len(x) for x in r.stdout.splitlines()) <= 80
    flat = "".join(r.stdout.split())
    assert "ml/job-dra/train" in flat and "claimml/a-extra,ml/gpu-share" in flat
    assert flat.count("claim") == 1  # the side container names none


def test_cli_without_containers_and_with_a_bad_listen(tmp_path: Path) -> None:
    from nvctk.sim import host
    from nvctk.sim.topology import make_topology

    sim = host.init(str(tmp_path / "host"), make_topology(gpus=2, seed="monitor-cli"))
    env = {**os.environ, **sim.env}
    r = subprocess.run([os.path.join(BIN, "nvctk"), "top", "--json", "--runtime-root",
                        str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["containers"] == [] and snap["problems"] == []
    assert [(g["uuid"], g["shares"], g["memory_used"]) for g in snap["gpus"]] == [
        (g.uuid, 0, 0) for g in sim.topology.gpus]
    r = subprocess.run([os.path.join(BIN, "nvctk"), "monitor", "--listen", "nowhere"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == "nvctk: --listen nowhere: not HOST:PORT"
