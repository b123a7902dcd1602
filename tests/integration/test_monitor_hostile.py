"""The monitor against what a Pod author or any Pod on the network can do (issue 25,
families 4-7), with containers run through nvctk-runtime and real runc on a simulated
host (tests/support/monitor.py's node):

4. identity: only the keys the container's own engine sets name its Pod (containerd's
   under a containerd runtime root, CRI-O's under CRI-O's); the other engine's keys,
   which pass from a Pod's annotations into its spec, never do;
5. names: shown as text in `nvctk top` and in the log, never as markup or terminal
   controls (the page: tests/e2e/test_monitor_e2e.py);
6. connections: a thousand idle ones cost no thread each, a slow head is cut at its
   deadline, the monitor answers meanwhile and stops cleanly, with no traceback; held
   requests (half-sent heads, slow bodies, idle connections, a mix; issue 34, family 4)
   never shut out a scrape, and no client gets a truncated answer;
7. --listen: every odd value is one line naming the flag.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import select
import signal
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nvctk.monitor.collect import Collector
from nvctk.monitor.prom import render_text
from nvctk.monitor.server import Monitor, MonitorServer, bind
from support.monitor import HOLD, MIB, NODE_TESTS, NVCTK, Node, node_in
from support.wait import until

pytestmark = NODE_TESTS

CRIO = {"io.kubernetes.pod.namespace": "ml", "io.kubernetes.pod.name": "trainer-7",
        "io.kubernetes.container.name": "worker", "io.kubernetes.pod.uid": "uid-crio"}
CONTAINERD = {"io.kubernetes.cri.sandbox-namespace": "ml", "io.kubernetes.cri.sandbox-name": "trainer-8",
              "io.kubernetes.cri.container-name": "worker", "io.kubernetes.cri.sandbox-uid": "uid-ctd"}
# what a Pod writes into its annotations to pass for another Pod
AS_CONTAINERD = {"io.kubernetes.cri.sandbox-namespace": "kube-system",
                 "io.kubernetes.cri.sandbox-name": "coredns-5d78c9869d-x2x7q",
                 "io.kubernetes.cri.container-name": "coredns",
                 "io.kubernetes.cri.sandbox-uid": "uid-forged"}
AS_CRIO = {"io.kubernetes.pod.namespace": "kube-system", "io.kubernetes.pod.name": "coredns-5d78c9869d-x2x7q",
           "io.kubernetes.container.name": "coredns", "io.kubernetes.pod.uid": "uid-forged"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with node_in(tmp_path_factory.mktemp("monitor-hostile")) as n:
        yield n


def _start(node: Node, annotations: dict[str, str], mib: int = 16) -> str:
    return node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, HOLD.format(mib * MIB), gpu="0",
                      wait_mem=mib * MIB, annotations=annotations)


def _identities(node: Node, root: str) -> dict[str, tuple[str, str, str, str]]:
    col = Collector(node.sim.root, [root])
    try:
        snap = col.collect()
    finally:
        col.close()
    labels = {}
    for m in text_string_to_metric_families(render_text(snap, {})):
        for s in m.samples:
            if s.name == "nvctk_container_memory_used_bytes":
                labels[s.labels["container_id"]] = (s.labels["namespace"], s.labels["pod"],
                                                    s.labels["container"])
    out = {}
    for c in snap.containers:
        assert labels[c.id] == (c.namespace, c.pod, c.container)  # the series say the same
        out[c.id] = (c.namespace, c.pod, c.container, c.pod_uid)
    return out


# --- 4: identity --------------------------------------------------------------------------
def test_identity_comes_only_from_the_keys_its_engine_sets(node: Node) -> None:
    """CRI-O copies a Pod's annotations into its containers' specs: containerd's keys
    there (all of them, or one) are the Pod's own writing and name nothing. Under a
    containerd root it is the other way round (pod_annotations can pass CRI-O's keys);
    under Docker's, no key names a Pod."""
    on_crio = {
        "all-forged": _start(node, {**AS_CONTAINERD, **CRIO}),
        "namespace-forged": _start(node, {**CRIO, "io.kubernetes.cri.sandbox-namespace": "kube-system"}),
        "name-and-uid-forged": _start(node, {**CRIO, "io.kubernetes.cri.sandbox-name": "etcd-0",
                                             "io.kubernetes.cri.sandbox-uid": "uid-forged"}),
        "container-forged": _start(node, {**CRIO, "io.kubernetes.cri.container-name": "etcd"}),
    }
    on_containerd = _start(node, {**AS_CRIO, **CONTAINERD})
    try:
        want_crio = ("ml", "trainer-7", "worker", "uid-crio")
        # /run/runc and /run/crun are CRI-O's by their path; here the root is named
        for root in (f"crio={node.runc_root}", node.runc_root):
            got = _identities(node, root)
            assert {k: got[cid] for k, cid in on_crio.items()} == {k: want_crio for k in on_crio}, root
        got = _identities(node, f"containerd={node.runc_root}")
        assert got[on_containerd] == ("ml", "trainer-8", "worker", "uid-ctd")
        got = _identities(node, f"docker={node.runc_root}")
        assert set(got.values()) == {("", "", "", "")}
        # the terminal view names the same Pods
        r = subprocess.run([NVCTK, "top", "--json", "--runtime-root", node.runc_root],
                           env={**os.environ, **node.sim.env}, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        shown = {c["id"]: (c["namespace"], c["pod"]) for c in json.loads(r.stdout)["containers"]}
        assert {shown[cid] for cid in on_crio.values()} == {("ml", "trainer-7")}
    finally:
        for cid in [*on_crio.values(), on_containerd]:
            node.kill(cid)


# --- 5: names are text ----------------------------------------------------------------------
HOSTILE_NAMES = {
    "markup-close": "[/]",
    "markup-style": "[bold red]admin[/bold red]",
    "osc-title": "\x1b]0;pwned\x07",
    "clear-screen": "x\x1b[2J\x1b[H",
    "hyperlink": "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\",
    "bidi": "job\u202egpj.exe",
    "emoji-code": ":pile_of_poo:",
    "c1-csi": "y\x9b31m",
}


def test_names_are_shown_as_text_in_top_and_the_log(
        node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Pods named with rich markup, OSC/CSI sequences (title, clear screen, hyperlink),
    a C1 control, a bidi override, an emoji code: `nvctk top --once` prints each one
    literally, escaped where it is a control, at 80 columns and wide alike, and nothing
    it prints acts on a terminal."""
    from nvctk.base.errors import literal

    started = [_start(node, {**CRIO, "io.kubernetes.container.name": name})
               for name in HOSTILE_NAMES.values()]
    try:
        for columns in ("80", "200"):
            r = subprocess.run([NVCTK, "top", "--once", "--runtime-root", node.runc_root],
                               env={**os.environ, **node.sim.env, "COLUMNS": columns},
                               capture_output=True, timeout=60)
            assert r.returncode == 0, r.stderr.decode()
            out = r.stdout.decode()
            # no control character at all (rich styles nothing when piped)
            assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", out), out
            if columns == "200":  # wide: every name on one line, as the text it is
                for name in HOSTILE_NAMES.values():
                    assert f"ml/trainer-7/{literal(name)}" in out, (name, out)
            else:
                assert max(len(x) for x in out.splitlines()) <= 80
    finally:
        for cid in started:
            node.kill(cid)
    # the log: a state dir named with controls, unreadable, is logged once, as text
    root = tmp_path / "root"
    bad = root / "ctr\x1b]0;pwned\x07\x1b[2J"
    bad.mkdir(parents=True)
    (bad / "state.json").write_text("{broken")
    col = Collector(node.sim.root, [str(root)])
    try:
        with caplog.at_level(logging.WARNING, logger="nvctk.monitor"):
            snap = col.collect()
    finally:
        col.close()
    assert len(snap.problems) == 1
    (msg,) = [r.getMessage() for r in caplog.records if "ctr" in r.getMessage()]
    assert "\x1b" not in msg and "\x07" not in msg and "ctr\\x1b]0;pwned\\x07\\x1b[2J" in msg


# --- 6: idle connections ---------------------------------------------------------------------
def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


class MonitorProc:
    """`nvctk monitor` on a free loopback port, its log in a file."""

    def __init__(self, node: Node, tmp: Path, *args: str) -> None:
        self.log = tmp / "monitor.log"
        self.proc = subprocess.Popen(
            [NVCTK, "monitor", "--listen", "127.0.0.1:0", "--interval", "0.5",
             "--runtime-root", node.runc_root, *args],
            env={**os.environ, **node.sim.env}, stdout=subprocess.DEVNULL,
            stderr=open(self.log, "w"))  # noqa: SIM115 - the child keeps it
        m = until(lambda: self._serving(), 60, "the monitor to listen")
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        until(lambda: b"nvctk_gpu_memory_used_bytes" in _get(self.url + "/metrics"), 60,
              "the first snapshot")

    def _serving(self) -> re.Match[str] | None:
        assert self.proc.poll() is None, self.log.read_text()
        return re.search(r"serving http://127\.0\.0\.1:(\d+)/", self.log.read_text())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def _get(url: str, method: str = "GET") -> bytes:
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        data: bytes = r.read()
        return data


def test_idle_connections_neither_pin_nor_stop_the_monitor(node: Node, tmp_path: Path) -> None:
    """1,200 idle connections (more than the monitor keeps) and a head sent byte by byte
    never completed: the monitor keeps a handful of threads and little memory, answers
    /metrics, HEAD and the page meanwhile, drops the slow head at its deadline, and on
    SIGTERM closes them all and exits 0 with no traceback in its log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if hard < want + 200:
        pytest.skip(f"needs {want + 200} descriptors (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want + 200), hard))
    mon = MonitorProc(node, tmp_path)
    idle: list[socket.socket] = []
    try:
        base_threads = _threads(mon.proc.pid)
        for _ in range(want):
            idle.append(socket.create_connection(("127.0.0.1", mon.port), timeout=10))
        slow = socket.create_connection(("127.0.0.1", mon.port), timeout=30)
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head never finished
        # the monitor answers every kind of request while they sit there
        until(lambda: b"nvctk_gpu_memory_used_bytes" in _get(mon.url + "/metrics"), 60,
              "/metrics to answer beside the idle connections")
        body = _get(mon.url + "/metrics")
        req = urllib.request.Request(mon.url + "/metrics", method="HEAD")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and r.read() == b""
            assert int(r.headers["Content-Length"]) > 0
            assert r.headers["Content-Type"].startswith("text/plain")
        assert b"<title>nvctk GPU shares</title>" in _get(mon.url + "/")
        assert len(body) > 0
        assert _threads(mon.proc.pid) <= base_threads + 2, "a thread per connection"
        assert _rss_mib(mon.proc.pid) < 100
        # the unfinished head is cut at its deadline: 408, then the close
        slow.settimeout(60)
        got = b""
        while chunk := slow.recv(4096):
            got += chunk
        assert got.startswith(b"HTTP/1.1 408"), got
        slow.close()
        # the oldest idle connections were closed to make room: the monitor holds a bounded number
        closed = 0
        for s in idle[:50]:
            s.settimeout(10)
            try:
                closed += s.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 1
        assert closed == 50
    finally:
        code = mon.stop()
        for s in idle:
            s.close()
    log = mon.log.read_text()
    assert code == 0, log
    assert "Traceback" not in log and "Fatal Python error" not in log, log
    assert "nvctk monitor: stopped" in log


# --- 6: held requests (issue 34, family 4) -------------------------------------------------
HELD = 300  # more than the monitor keeps open (MAX_CONNECTIONS, 256)
KEPT = 256


def _hold(port: int, kind: str) -> socket.socket:
    """A connection that holds its place: idle, half a head, or a whole head and part of
    its body."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if kind == "half-head":
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    elif kind == "slow-body":
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\npart")
    return s


def _ended(socks: list[socket.socket]) -> int:
    """How many of socks the monitor is done with: closed (or answered 408/413, then
    closed); a held connection has nothing else to read."""
    return len(select.select(socks, [], [], 0)[0])


@pytest.mark.parametrize("mix", [
    {"half-head": HELD},
    {"slow-body": HELD},
    {"idle": HELD},
    {"half-head": 140, "slow-body": 140, "idle": 20},
])
def test_held_requests_never_shut_out_a_scrape(node: Node, tmp_path: Path, mix: dict[str, int]) -> None:
    """More connections than the monitor keeps, each holding its place (half-sent heads,
    bodies sent in part, idle ones, a mix): every scrape that follows is answered whole,
    8 of 8, while they are still within their deadlines; the connections closed to make
    room are those waiting on their client the longest."""
    mon = MonitorProc(node, tmp_path)
    held: list[socket.socket] = []
    try:
        for kind, n in mix.items():
            held += [_hold(mon.port, kind) for _ in range(n)]
        # the monitor has taken them all in once it closed as many as it does not keep
        until(lambda: _ended(held) >= HELD - KEPT, 60, f"{HELD - KEPT} connections closed")
        for _ in range(8):
            body = _get(mon.url + "/metrics")  # urllib checks Content-Length
            assert b"nvctk_gpu_memory_used_bytes" in body
        # room was made by closing the oldest
        n = _ended(held)
        assert _ended(held[:n]) == n
    finally:
        for s in held:
            s.close()
        code = mon.stop()
    assert code == 0 and "Traceback" not in mon.log.read_text()


@pytest.mark.parametrize("request_head", [
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\n\r\n",
])
def test_an_answer_is_never_cut_by_its_close(node: Node, request_head: bytes) -> None:
    """A client that asks for the close (Connection: close, or HTTP/1.0) on a node whose
    socket buffers are small (the monitor's send buffer, the client's receive buffer):
    /metrics arrives whole, as many bytes as Content-Length says, every time."""
    started = [_start(node, {**CRIO, "io.kubernetes.pod.name": f"p{i}"}, mib=1) for i in range(6)]
    mon = Monitor(Collector(node.sim.root, [node.runc_root]), 0.5, compat=("hami", "dcgm"))
    sock = bind("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the connections inherit it
    srv = MonitorServer(mon, sock)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        mon.start()
        until(lambda: mon.wait_first(1), 60, "the first snapshot")
        for _ in range(3):
            got = _read_to_close(srv.server_address[1], request_head)
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
            assert length > 32 << 10  # more than the buffers hold: the end waits in the monitor's
            assert len(body) == length
    finally:
        for cid in started:
            node.kill(cid)
        mon.stop.set()
        srv.shutdown()
        srv.server_close()
        mon.collector.close()


def _read_to_close(port: int, request: bytes) -> bytes:
    """What the monitor sends for request to a client with a small receive buffer
    reading 1 KiB at a time, up to the close."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.settimeout(30)
    got = bytearray()
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(request)
        while chunk := s.recv(1024):
            got += chunk
    finally:
        s.close()
    return bytes(got)


def test_metrics_in_the_format_and_encoding_asked(node: Node, tmp_path: Path) -> None:
    """As Prometheus asks (OpenMetrics first, gzip): an OpenMetrics body ending in # EOF,
    gzip'd, Vary naming both headers; as curl asks (nothing): the text format, plain; the
    same series either way."""
    import gzip

    mon = MonitorProc(node, tmp_path, "--compat", "hami,dcgm")
    try:
        req = urllib.request.Request(mon.url + "/metrics", headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
            "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as r:
            packed = r.read()
            assert r.headers["Content-Encoding"] == "gzip"
            assert r.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
            assert r.headers["Vary"] == "Accept, Accept-Encoding"
        om = gzip.decompress(packed).decode()
        assert om.endswith("# EOF\n") and len(packed) < len(om) / 3
        with urllib.request.urlopen(mon.url + "/metrics", timeout=10) as r:
            assert r.headers["Content-Encoding"] is None
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            text = r.read().decode()
        series = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and ln[0] != "#"}
        assert series == {ln.split("{")[0].split(" ")[0] for ln in om.splitlines() if ln and ln[0] != "#"}
    finally:
        assert mon.stop() == 0


# --- 7: --listen ------------------------------------------------------------------------------
@pytest.mark.parametrize("value, why", [
    ("127.0.0.1:99999", "port 99999 out of range (0-65535)"),
    ("127.0.0.1:65536", "port 65536 out of range (0-65535)"),
    ("256.1.1.1:9400", "not an address, nor a name this host resolves"),
    ("::1:9400", "an IPv6 address goes in brackets, [ADDR]:PORT"),
    ("[::1:9400", "want [IPv6]:PORT for an IPv6 address"),
    ("[fe80::zz]:9400", "not an address, nor a name this host resolves"),
    ("127.0.0.1:", "not HOST:PORT"),
    ("127.0.0.1:94OO", "not HOST:PORT"),
    ("127.0.0.1:-1", "not HOST:PORT"),
    ("127.0.0.1:\u0669\u0664", "not HOST:PORT"),  # Arabic-Indic digits: isdigit(), not a port
    ("192.0.2.1:9400", "cannot listen there (Cannot assign requested address)"),
    ("in-use", "cannot listen there (Address already in use)"),
])
def test_an_odd_listen_value_is_one_line_naming_the_flag(node: Node, value: str, why: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        if value == "in-use":
            value = f"127.0.0.1:{taken.getsockname()[1]}"
        r = subprocess.run([NVCTK, "monitor", "--listen", value, "--runtime-root", node.runc_root],
                           env={**os.environ, **node.sim.env}, capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"nvctk: --listen {value}: ") and why in line, line


def test_ipv6_and_names_listen_or_say_why(node: Node, tmp_path: Path) -> None:
    """[::1]:0 and localhost:0 serve (where the host has IPv6 loopback) or fail in one
    line naming the flag: never a traceback."""
    for value in ("[::1]:0", "localhost:0"):
        p = subprocess.Popen([NVCTK, "monitor", "--listen", value, "--runtime-root", node.runc_root],
                             env={**os.environ, **node.sim.env}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        try:
            assert p.stderr is not None
            first = p.stderr.readline()
            if first.startswith("nvctk monitor: serving http://"):
                p.send_signal(signal.SIGTERM)
                rest = p.stderr.read()
                assert p.wait(60) == 0 and "Traceback" not in rest, rest
            else:
                assert first.startswith(f"nvctk: --listen {value}: "), first
                assert p.wait(60) == 1
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
