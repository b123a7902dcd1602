"""The monitor as a cluster runs it (issue 28), with containers run through nvctk-runtime and
real runc on a simulated host (tests/support/monitor.py's node):

- in its own GPU container, as deployments/monitor.yaml runs it (no capability, no new
  privileges, a read-only root, the host's pids, the runtime's state read-only, NODE_NAME
  set, a hostname of its own): it counts only the others, under the node's name;
- `kind` is what a container asked for, whatever its neighbours;
- MPS's pinned-memory limit is a cap, and what a GPU promised counts it;
- a bundle it cannot see is an error series and one log line, never "not nvctk's";
- the same container id under two runtime roots: two series, told apart by runtime_root;
- /healthz fails once collection stalls;
- `nvctk top` fits 80 columns and a pipe with every figure whole.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nvctk.base import config as nvconfig
from nvctk.edits_file import EDITS_FILE
from nvctk.monitor.collect import Collector
from nvctk.monitor.prom import render_text
from support.monitor import (
    HOLD,
    MIB,
    NODE_TESTS,
    NVCTK,
    REPO,
    RUNTIME,
    Node,
    node_in,
    serving,
    sim_counts,
)
from support.wait import until

pytestmark = NODE_TESTS

GIB = 1 << 30


def render(snap: Any, now: float, errors: dict[str, int]) -> list[Any]:
    """The snapshot's exposition as prometheus-client's parser reads it back."""
    return list(text_string_to_metric_families(render_text(snap, errors)))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with node_in(tmp_path_factory.mktemp("monitor-node")) as n:
        yield n


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _monitor_bundle(node: Node, port: int) -> Path:
    """The monitor's container as deployments/monitor.yaml makes it: a GPU container of
    nvctk's (NVIDIA_VISIBLE_DEVICES=all, its bundle edited by nvctk-runtime's create
    step), no capability, no new privileges, a read-only root, the host's pid namespace,
    the runtime's state read-only, NODE_NAME from the downward API and a hostname of its
    own (the Pod's). Its root is the host's /usr and this checkout, read-only: the
    monitor runs from the test's virtualenv; the simulated driver stands for the one the
    nvidia runtime would mount (its prestart hook is left out for that)."""
    from nvctk.runtime.create import prepare_bundle

    b = node.tmp / "monitor-bundle"
    root = b / "rootfs"
    for d in ("usr", "etc", "proc", "dev", "tmp", "run"):
        (root / d).mkdir(parents=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}"):
            os.symlink(os.readlink(f"/{link}"), root / link)
    subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
    spec = json.loads((b / "config.json").read_text())
    spec["root"] = {"path": "rootfs", "readonly": True}
    spec["hostname"] = "nvctk-monitor-x7k2p"
    spec["process"].update(
        terminal=False, cwd="/", noNewPrivileges=True, user={"uid": 0, "gid": 0},
        capabilities={k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
        args=[NVCTK, "monitor", "--listen", f"127.0.0.1:{port}", "--interval", "0.5",
              "--runtime-root", node.runc_root],
        env=["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility",
             f"NVCTK_CONFIG={node.sim.config_path}", "NODE_NAME=gpu-node-3"])
    ro = ["rbind", "ro", "nosuid", "nodev"]
    mounts = [m for m in spec["mounts"] if m["destination"] in ("/proc", "/dev", "/dev/pts")]
    for src in ("/usr", "/etc", str(REPO), str(node.tmp)):
        mounts.append({"destination": src, "type": "bind", "source": src, "options": ro})
    # the simulated driver's state: NVML's, writable as a driver's device is
    mounts.append({"destination": node.sim.root, "type": "bind", "source": node.sim.root,
                   "options": ["rbind", "rw"]})
    spec["mounts"] = mounts
    # hostPID, the Pod network: no pid namespace; the loopback for the test to reach it
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"]
                                   if n["type"] in ("mount", "uts", "ipc")]
    spec["linux"].pop("maskedPaths", None)
    (b / "config.json").write_text(json.dumps(spec))
    created = prepare_bundle(str(b), nvconfig.load(node.sim.config_path), argv0=RUNTIME)
    assert created.edits is not None and (b / EDITS_FILE).exists()
    spec = json.loads((b / "config.json").read_text())
    spec.pop("hooks", None)
    (b / "config.json").write_text(json.dumps(spec))
    return b


def test_the_monitor_in_its_gpu_container_counts_only_the_others(node: Node) -> None:
    g1 = node.sim.topology.gpus[1]
    whole = node.start({}, HOLD.format(100 * MIB), gpu=g1.uuid, wait_mem=100 * MIB)
    share = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "2g"}, HOLD.format(50 * MIB), gpu="0",
                       wait_mem=50 * MIB)
    port = _free_port()
    b = _monitor_bundle(node, port)
    cid = "nvctk-monitor-" + uuid.uuid4().hex[:8]
    log = node.tmp / f"{cid}.log"
    with open(log, "w") as f:
        r = subprocess.run(["runc", "--root", node.runc_root, "run", "--detach", "--bundle", str(b),
                            cid], stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=60)
    assert r.returncode == 0, log.read_text()
    url = f"http://127.0.0.1:{port}"
    try:
        def scraped() -> str | None:
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                    text: str = resp.read().decode()
            except OSError:
                assert node.init_pid(cid), log.read_text()
                return None
            return text if f'container_id="{whole}"' in text else None

        text = until(scraped, 60, "the monitor in its container to see the others")
        counts = sim_counts(node, [whole, share])
        with urllib.request.urlopen(url + "/api/snapshot", timeout=5) as resp:
            snapshot = resp.read().decode()
    finally:
        subprocess.run(["runc", "--root", node.runc_root, "kill", cid, "TERM"], capture_output=True)
        until(lambda: not node.init_pid(cid), 60, "the monitor to stop on SIGTERM")
        subprocess.run(["runc", "--root", node.runc_root, "delete", "--force", cid], capture_output=True)
        node.kill(whole)
        node.kill(share)
    out = log.read_text()
    assert "nvctk monitor: stopped" in out and "Traceback" not in out, out
    mem = {lb["container_id"]: (lb, v) for lb, v in _series(text, "nvctk_container_memory_used_bytes")}
    assert set(mem) == {whole, share}, "the monitor's own container is nobody's GPU share"
    assert abs(mem[whole][1] - counts.mem[whole]) <= MIB, snapshot
    assert mem[whole][0]["kind"] == "gpu"
    shares = {lb["gpu"]: v for lb, v in _series(text, "nvctk_gpu_shares")}
    assert shares == {"0": 1.0, "1": 1.0, "2": 0.0}
    sm = {lb["gpu"]: v for lb, v in _series(text, "nvctk_gpu_sm_promised_ratio")}
    assert sm["1"] == 1.0 and sm["2"] == 0.0
    hosts = {lb["Hostname"] for lb, _ in _series(text, "nvctk_gpu_memory_used_bytes")}
    assert hosts == {"gpu-node-3"}, "the node's name (NODE_NAME), not the Pod's hostname"
    assert {lb["Hostname"] for lb, _ in mem.values()} == {"gpu-node-3"}


def _collect(node: Node, roots: list[str] | None = None) -> Any:
    col = Collector(node.sim.root, roots or [node.runc_root])
    try:
        return col.collect()
    finally:
        col.close()


def test_kind_is_what_it_asked_for_whatever_its_neighbours(node: Node) -> None:
    """A whole GPU stays `gpu` when a second and third container get the same GPU
    (time-sliced replicas), and after they leave: one series for its whole life."""
    g1 = node.sim.topology.gpus[1]
    first = node.start({}, HOLD.format(20 * MIB), gpu=g1.uuid, wait_mem=20 * MIB)
    kinds = [{c.id: c.kind for c in _collect(node).containers}[first]]
    others = [node.start({}, HOLD.format(20 * MIB), gpu=g1.uuid, wait_mem=20 * MIB) for _ in range(2)]
    snap = _collect(node)
    kinds.append({c.id: c.kind for c in snap.containers}[first])
    assert next(g for g in snap.gpus if g.uuid == g1.uuid).shares == 3
    assert {c.kind for c in snap.containers if c.id in others} == {"gpu"}
    for cid in others:
        node.kill(cid)
    kinds.append({c.id: c.kind for c in _collect(node).containers}[first])
    node.kill(first)
    assert kinds == ["gpu", "gpu", "gpu"]


def test_mps_pinned_memory_is_a_cap(node: Node) -> None:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, by index or by UUID, with or without a thread
    percentage: the cap series, the row's cap, and the GPU's promised memory."""
    g0 = node.sim.topology.gpus[0]
    g1 = node.sim.topology.gpus[1]
    hold = HOLD.format(30 * MIB)
    by_index = node.start({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
                           "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}, hold, gpu=g0.uuid,
                          wait_mem=30 * MIB)
    by_uuid = node.start({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{g0.uuid}=3G"}, hold, gpu=g0.uuid,
                         wait_mem=30 * MIB)
    other_gpu = node.start({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G"}, hold, gpu=g1.uuid,
                           wait_mem=30 * MIB)
    try:
        snap = _collect(node)
    finally:
        for cid in (by_index, by_uuid, other_gpu):
            node.kill(cid)
    by_id = {c.id: c for c in snap.containers}
    got = {cid: (by_id[cid].kind, by_id[cid].devices[0].memory_limit, by_id[cid].devices[0].sm_limit)
           for cid in (by_index, by_uuid, other_gpu)}
    assert got == {by_index: ("mps", 2 * GIB, 0.4), by_uuid: ("mps", 3 * GIB, None),
                   other_gpu: ("mps", GIB, None)}
    g = next(x for x in snap.gpus if x.uuid == g0.uuid)
    assert g.memory_promised == 5 * GIB and g.shares == 2
    caps = {lb["container_id"]: v for m in render(snap, snap.time, {}) for lb, v in
            ((s.labels, s.value) for s in m.samples) if m.name == "nvctk_container_memory_limit_bytes"}
    assert caps == {by_index: 2 * GIB, by_uuid: 3 * GIB, other_gpu: GIB}


def test_an_unreadable_bundle_is_an_error_series_and_a_log_line(
        node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A live container whose bundle the monitor cannot see (its state dir not mounted,
    a file where the dir should be, a dir without the engine's config.json): a problem,
    an error counted by cause, one log line each; a bundle that is there without nvctk's
    plan stays quietly not nvctk's."""
    cid = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, HOLD.format(10 * MIB), gpu="0",
                     wait_mem=10 * MIB)
    try:
        st = json.loads((Path(node.runc_root) / cid / "state.json").read_text())
        not_a_dir = tmp_path / "file"
        not_a_dir.write_text("")
        empty = tmp_path / "empty"
        empty.mkdir()
        plain = tmp_path / "plain"  # a no-GPU container's bundle: config.json, no plan
        plain.mkdir()
        (plain / "config.json").write_text("{}")
        root = tmp_path / "root"
        for name, bundle in (("unmounted", tmp_path / "not-mounted" / cid), ("file", not_a_dir),
                             ("empty", empty), ("plain", plain)):
            labels = [lb for lb in st["config"]["labels"] if not lb.startswith("bundle=")]
            d = dict(st, config=dict(st["config"], labels=[*labels, f"bundle={bundle}"]))
            (root / name).mkdir(parents=True)
            (root / name / "state.json").write_text(json.dumps(d))
        col = Collector(node.sim.root, [str(root)])
        try:
            with caplog.at_level(logging.WARNING, logger="nvctk.monitor"):
                snaps = [col.collect(), col.collect()]
            errors = dict(col.errors_total)
        finally:
            col.close()
    finally:
        node.kill(cid)
    for snap in snaps:
        assert snap.containers == []
        assert len(snap.problems) == 3, snap.problems
        assert all("not readable" in p for p in snap.problems)
    assert errors == {"bundle": 6}
    warned = [r.getMessage() for r in caplog.records]
    for name in ("not-mounted", str(not_a_dir), str(empty)):
        assert sum(name in m for m in warned) == 1, (name, warned)
    assert not any(str(plain) in m for m in warned)
    samples = [s for m in render(snaps[-1], snaps[-1].time, errors) for s in m.samples]
    assert [(s.labels, s.value) for s in samples if s.name == "nvctk_monitor_errors_total"] == [
        ({"Hostname": snaps[-1].hostname, "cause": "bundle"}, 6)]
    assert [s.value for s in samples if s.name == "nvctk_monitor_problems"] == [3]


def test_one_id_under_two_runtime_roots_is_two_series(node: Node, tmp_path: Path) -> None:
    cid = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, HOLD.format(10 * MIB), gpu="0",
                     wait_mem=10 * MIB)
    try:
        twin = tmp_path / "other-runtime"
        (twin / cid).mkdir(parents=True)
        shutil.copy(Path(node.runc_root) / cid / "state.json", twin / cid / "state.json")
        snap = _collect(node, [node.runc_root, str(twin)])
    finally:
        node.kill(cid)
    seen: dict[tuple[tuple[str, str], ...], int] = {}
    for m in render(snap, snap.time, {}):
        for s in m.samples:
            key = (s.name, *sorted(s.labels.items()))
            seen[key] = seen.get(key, 0) + 1  # type: ignore[index]
    assert max(seen.values()) == 1, "two series with one label set"
    roots = {s.labels["runtime_root"] for m in render(snap, snap.time, {}) for s in m.samples
             if s.name == "nvctk_container_memory_limit_bytes" and s.labels["container_id"] == cid}
    assert roots == {node.runc_root, str(twin)}


def test_healthz_fails_once_collection_stalls(node: Node) -> None:
    """Healthy while snapshots come; 503 naming the stall once the latest is older than
    the limit, while /metrics still answers from it; healthy again when it resumes."""
    from nvctk.monitor.server import Monitor

    col = Collector(node.sim.root, [node.runc_root])
    mon = Monitor(col, 0.2, stale_after=1.0)
    release = threading.Event()
    stall = threading.Event()
    real_scan = col.discovery.scan

    def scan(host, problem):  # type: ignore[no-untyped-def]
        if stall.is_set():
            release.wait(60)
        return real_scan(host, problem)

    col.discovery.scan = scan  # type: ignore[method-assign]
    with serving(mon) as url:

        def health() -> tuple[int, str]:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=5) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        try:
            assert mon.wait_first(60)
            until(lambda: health()[0] == 200, 30, "healthy")
            stall.set()
            _, why = until(lambda: (h := health())[0] == 503 and h, 60, "/healthz to fail")
            assert "collection stalled" in why
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                assert r.status == 200
            stall.clear()
            release.set()
            until(lambda: health()[0] == 200, 60, "healthy again")
        finally:
            release.set()


def test_top_fits_80_columns_and_a_pipe_with_every_figure_whole(node: Node) -> None:
    """Piped (no terminal: 80 columns) and at COLUMNS=80: no line wider, no cut figure;
    an over-promised GPU says so."""
    g0 = node.sim.topology.gpus[0]
    started = [node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1088m", "CUDA_DEVICE_SM_LIMIT": "70"},
                          HOLD.format(20 * MIB), gpu="0", wait_mem=20 * MIB,
                          annotations={"io.kubernetes.pod.namespace": "team-with-a-long-name",
                                       "io.kubernetes.pod.name": "trainer-with-a-long-name-0",
                                       "io.kubernetes.container.name": "worker"})
               for _ in range(2)]
    try:
        for env in ({}, {"COLUMNS": "80"}):
            r = subprocess.run([NVCTK, "top", "--once", "--runtime-root", node.runc_root],
                               env={**os.environ, **node.sim.env, **env}, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            assert max(len(x) for x in lines) <= 80, r.stdout
            assert "…/" not in r.stdout and "/…" not in r.stdout, r.stdout
            rows = [x for x in lines if " vgpu " in x]
            assert len(rows) == 2 and all("/1088" in x and "%/70%" in x for x in rows), r.stdout
            assert f"GPU 0 · {g0.name}" in r.stdout and "OVER-PROMISED SM 140%" in r.stdout
    finally:
        for cid in started:
            node.kill(cid)


def test_top_live_in_an_80x24_terminal_scrolls_narrows_and_quits(node: Node) -> None:
    """`nvctk top` in a terminal of 80x24 (a pty): the view fits it and says which rows it
    shows; a digit narrows it to that GPU, q quits at once (exit 0), the terminal's mode
    restored."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    started = [node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, HOLD.format(8 * MIB), gpu=str(i),
                          wait_mem=8 * MIB) for i in (0, 1)]
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    before = termios.tcgetattr(sub)
    env = {k: v for k, v in {**os.environ, **node.sim.env}.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen([NVCTK, "top", "--interval", "0.5", "--runtime-root", node.runc_root],
                         env={**env, "TERM": "xterm"}, stdin=sub, stdout=sub, stderr=sub)
    seen = b""

    def shows(text: bytes) -> bool:
        nonlocal seen
        while select.select([main], [], [], 0)[0]:
            seen += os.read(main, 65536)
        return text in seen

    try:
        until(lambda: shows(b"of 2 \xc2\xb7 all GPUs \xc2\xb7 busiest first"), 60, "the live view")
        os.write(main, b"1")
        until(lambda: shows(b"1-1 of 1 \xc2\xb7 GPU 1 \xc2\xb7"), 60, "the view narrowed to GPU 1")
        os.write(main, b"q")
        assert p.wait(30) == 0, seen.decode(errors="replace")
        assert termios.tcgetattr(sub) == before  # cbreak undone
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(main)
        os.close(sub)
        for cid in started:
            node.kill(cid)


def test_the_monitor_reads_what_the_runtime_recorded(node: Node) -> None:
    """The container's devices are the ones nvctk-runtime recorded (Edits.selected), read by
    the one reader (load_edits): a request rewritten in its spec later does not move it to
    another GPU."""
    g0, g1 = node.sim.topology.gpus[0], node.sim.topology.gpus[1]
    cid = node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, HOLD.format(10 * MIB), gpu="0",
                     wait_mem=10 * MIB)
    try:
        state = json.loads((Path(node.runc_root) / cid / "state.json").read_text())
        (bundle,) = [Path(lb[len("bundle="):]) for lb in state["config"]["labels"]
                     if lb.startswith("bundle=")]
        spec = json.loads((bundle / "config.json").read_text())
        spec["process"]["env"] = [e for e in spec["process"]["env"]
                                  if not e.startswith("NVIDIA_VISIBLE_DEVICES=")]
        spec["process"]["env"].append(f"NVIDIA_VISIBLE_DEVICES={g1.uuid}")
        (bundle / "config.json").write_text(json.dumps(spec))
        snap = _collect(node)
    finally:
        node.kill(cid)
    (c,) = [c for c in snap.containers if c.id == cid]
    assert [(d.gpu_uuid, d.memory_limit) for d in c.devices] == [(g0.uuid, GIB)]
