"""A simulated node for the monitor's tests (tests/*/test_monitor*.py): a sim host with a
capped-share GPU, a whole GPU and a MIG GPU, containers started through nvctk-runtime and
real runc, and the sim's own per-container counters to judge the monitor against."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nvctk.host import nvml
from nvctk.host.inventory import HostInfo
from nvctk.sim import host
from nvctk.sim.rootfs import build_rootfs
from nvctk.sim.state import read_state, state_path
from nvctk.sim.topology import make_topology
from support.runc import gpu_bundle
from support.wait import until as wait_until

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)
RUNTIME = os.path.join(BIN, "nvctk-runtime")
PROBE = REPO / "libvgpu" / "build" / "vgpu_probe"
NVCTK = os.path.join(BIN, "nvctk")
MIG = {2: ["1g.10gb", "2g.20gb"]}
HOLD = "vgpu_probe init ctx 0 alloc {} sleep 600000"  # a container holding {} bytes, idle
# the monitor's node tests: real runc containers, seconds to start
NODE_TESTS = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                                 reason="needs root (sim device nodes) and runc")]


def pidns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


@dataclass
class Counts:
    time: float
    mem: dict[str, int] = field(default_factory=dict)  # container id -> bytes (sim)
    busy: dict[str, int] = field(default_factory=dict)  # container id -> busy ns (sim)
    procs: dict[str, int] = field(default_factory=dict)


class Node:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.sim = host.init(str(tmp / "host"), make_topology(gpus=3, mig=MIG, seed="monitor"))
        self.host: HostInfo = nvml.query_host(self.sim.root)
        self.runc_root = str(tmp / "runc-root")
        self.base = build_rootfs(str(tmp / "rootfs"), with_sample=self.sim.sample)
        subprocess.run(["make", "-s", "-C", str(REPO / "libvgpu")], check=True, capture_output=True)
        shutil.copy(PROBE, os.path.join(self.base, "usr/local/bin/vgpu_probe"))
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.expect: dict[str, dict[str, Any]] = {}
        self.n = 0

    def bundle(self, env: dict[str, str], script: str, gpu: str,
               annotations: dict[str, str] | None = None) -> Path:
        self.n += 1

        def annotate(spec: dict[str, Any]) -> None:
            if annotations:
                spec["annotations"] = annotations

        return gpu_bundle(self.tmp / f"bundle{self.n}", self.base, script, gpu, env, annotate)

    def init_pid(self, cid: str) -> int | None:
        r = subprocess.run(["runc", "--root", self.runc_root, "state", cid],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return None
        st = json.loads(r.stdout)
        return int(st["pid"]) if st.get("status") == "running" else None

    def start(self, env: dict[str, str], script: str, gpu: str, wait_mem: int = 0,
              annotations: dict[str, str] | None = None, **expect: Any) -> str:
        """Runs a container; returns once its processes hold wait_mem bytes on the sim."""
        cid = "mon-" + uuid.uuid4().hex[:10]
        b = self.bundle(env, script, gpu, annotations)
        p = subprocess.Popen([RUNTIME, "--root", self.runc_root, "run", "--bundle", str(b), cid],
                             env={**os.environ, **self.sim.env}, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs[cid] = p

        def holds() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"{cid} exited {p.returncode}: {p.stdout.read() if p.stdout else ''}")
            return sim_counts(self, [cid]).mem.get(cid, 0) >= wait_mem

        wait_until(holds, 60, f"{cid} to hold {wait_mem} bytes")
        if expect:
            self.expect[cid] = expect
        return cid

    def kill(self, cid: str) -> None:
        subprocess.run(["runc", "--root", self.runc_root, "kill", cid, "KILL"], capture_output=True)
        p = self.procs.pop(cid, None)
        if p is not None:
            p.wait(30)
        subprocess.run(["runc", "--root", self.runc_root, "delete", "--force", cid],
                       capture_output=True)
        self.expect.pop(cid, None)

    def live_ids(self) -> list[str]:
        return [c for c in self.procs if self.init_pid(c)]

    def collect_after(self, col: Any, seconds: float) -> Any:
        """A snapshot whose SM shares cover at least `seconds` (a measurement span)."""
        time.sleep(seconds)
        return col.collect()

    def cleanup(self) -> None:
        for cid in list(self.procs):
            self.kill(cid)


@contextmanager
def node_in(tmp: Path) -> Iterator[Node]:
    """A Node in tmp whose containers are all gone at the end."""
    n = Node(tmp)
    try:
        yield n
    finally:
        n.cleanup()


def sim_counts(node: Node, ids: list[str] | None = None) -> Counts:
    """The sim's own per-container figures: its live process slots whose pid namespace is
    the container's (the container's init's)."""
    ns = {}
    for cid in ids if ids is not None else list(node.procs):
        pid = node.init_pid(cid)
        inode = pidns(pid) if pid else None
        if inode:
            ns[inode] = cid
    out = Counts(time=time.time())
    st = read_state(state_path(node.sim.root), live_only=True)
    for p in st.procs:
        cid = ns.get(p.pidns)
        if cid is None:
            continue
        out.mem[cid] = out.mem.get(cid, 0) + p.mem_used
        out.busy[cid] = out.busy.get(cid, 0) + p.busy_ns
        out.procs[cid] = out.procs.get(cid, 0) + 1
    for cid in ns.values():
        out.mem.setdefault(cid, 0)
        out.busy.setdefault(cid, 0)
        out.procs.setdefault(cid, 0)
    return out


def sim_mem_of(snap: Any, sim_root: str) -> dict[str, int]:
    """Container id -> the memory the sim counts for a snapshot's containers: its live
    process slots in the pid namespaces of each container's GPU processes."""
    st = read_state(state_path(sim_root), live_only=True)
    return {c.id: sum(s.mem_used for s in st.procs if s.pidns in {
        pidns(pid) for pid in c.devices[0].processes}) for c in snap.containers}


def standard_containers(node: Node) -> None:
    """Capped shares on GPU 0 (two busy under different SM limits, one idle), a whole
    GPU 1 running kernels, a MIG device of GPU 2."""
    g0, g1, g2 = node.sim.topology.gpus
    mig = g2.mig_devices[0]
    busy = "launchfor 100000"
    for mem, sm, alloc, work in ((1 << 30, 20, 200, busy), (2 << 30, 35, 300, busy),
                                 (512 << 20, 0, 100, "sleep 100000000")):
        env = {"CUDA_DEVICE_MEMORY_LIMIT": f"{mem // MIB}m"}
        if sm:
            env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
        node.start(env, f"vgpu_probe init ctx 0 alloc {alloc * MIB} {work}", gpu="0",
                   wait_mem=alloc * MIB, kind="vgpu", device=g0.uuid, mem_cap=mem,
                   sm_cap=sm / 100 if sm else None, min_mem=alloc * MIB, busy=bool(sm))
    node.start({}, f"vgpu_probe init ctx 0 alloc {400 * MIB} {busy}", gpu=g1.uuid,
               wait_mem=400 * MIB, kind="gpu", device=g1.uuid, min_mem=400 * MIB, busy=True)
    node.start({}, f"vgpu_probe init ctx 0 alloc {300 * MIB} {busy}", gpu=mig.uuid,
               wait_mem=300 * MIB, kind="mig", device=mig.uuid, min_mem=300 * MIB, busy=True)


@contextmanager
def serving(mon: Any) -> Iterator[str]:
    """mon (nvctk.monitor.server.Monitor) collecting, served on a loopback port: its URL;
    at the end the server and collection stopped, the collector closed (unblock a
    collection the test holds before the block ends)."""
    from nvctk.monitor.server import make_server

    srv = make_server(mon, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        mon.start()
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        mon.stop.set()
        if mon.thread is not None:
            mon.thread.join(30)
        srv.shutdown()
        srv.server_close()
        mon.collector.close()


class FakePodResources:
    """The kubelet's pod-resources service (v1.PodResourcesLister/List) on a unix socket,
    built from the monitor's own descriptor: the answers a kubelet gives."""

    def __init__(self, sock: Path, pods: list[dict[str, object]]) -> None:
        from concurrent import futures

        import grpc
        from google.protobuf import json_format

        from nvctk.monitor.podresources import messages

        req, resp = messages()
        self.pods = pods  # what List answers: the test may change it
        self.calls = 0

        def list_(request: object, context: object) -> object:
            self.calls += 1
            return json_format.ParseDict({"pod_resources": self.pods}, resp())

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(
                list_, request_deserializer=req.FromString,
                response_serializer=resp.SerializeToString)}),))
        self.server.add_insecure_port(f"unix://{sock}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)
