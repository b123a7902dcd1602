"""The alerts a GPU node ships with (deployments/monitor-alerts.yaml): checked by
`promtool check rules`, loaded by a real Prometheus (Debian's package) scraping `nvctk
monitor` on a simulated node, and each one made to fire by making its condition there:
a container at its memory cap, one held to its SM limit, a GPU promised more SM than it
has, an XID (an application fault, then a GPU fallen off the bus), a runtime state the
monitor cannot read, a driver call that hangs (the snapshot goes stale), the monitor
stopped (not scraped). The rules' expressions are the file's; their `for:` is dropped, so
each fires at its first evaluation. And that Prometheus scraping the monitor over TLS with
basic auth (--web-config-file), as an exporter's scrape config does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nvctk.sim.events import inject_xid
from nvctk.sim.state import state_path
from support.monitor import MIB, Node, node_in
from support.prometheus import PASSWORD, PROMETHEUS, PROMTOOL, Monitor, Prometheus, get, web_config
from support.wait import until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                       reason="needs root (sim device nodes) and runc"),
    pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                       reason="needs Debian's prometheus package (make setup installs it)"),
]

RULES = Path(__file__).resolve().parents[2] / "deployments" / "monitor-alerts.yaml"
POD = {"io.kubernetes.cri.sandbox-namespace": "team-a", "io.kubernetes.cri.sandbox-name": "job-0",
       "io.kubernetes.cri.container-name": "main"}

# holds the sim's state lock, as a driver call that never returns holds the driver: every
# NVML query that needs it waits (the lock is robust: it is free again once this dies)
HOLD_LOCK = """
import ctypes, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
mm = mmap.mmap(fd, 0)
lock = ctypes.addressof(ctypes.c_char.from_buffer(mm, 16))  # nvsim_state.lock
assert ctypes.CDLL(None).pthread_mutex_lock(ctypes.c_void_p(lock)) == 0
print("held", flush=True)
sys.stdin.read()
"""


def rule_file(tmp: Path) -> Path:
    """The PrometheusRule's groups as a plain rule file, each `for:` dropped."""
    doc = yaml.safe_load(RULES.read_text())
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    for g in groups:
        for r in g["rules"]:
            r.pop("for", None)
    out = tmp / "rules.yml"
    out.write_text(json.dumps({"groups": groups}))
    return out


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with node_in(tmp_path_factory.mktemp("monitor-alerts")) as n:
        yield n


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    doc = yaml.safe_load(RULES.read_text())
    plain = tmp_path / "shipped.yml"
    plain.write_text(json.dumps({"groups": doc["spec"]["groups"]}))  # for: and all
    r = subprocess.run([str(PROMTOOL), "check", "rules", str(plain)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 8 rules found" in r.stdout, r.stdout


@pytest.mark.exclusive  # an SM share over wall time
def test_each_alert_fires_when_its_condition_is_made(node: Node, tmp_path: Path) -> None:
    g0 = node.sim.topology.gpus[0]
    # a runtime root with a state the monitor cannot read: a problem it reports
    broken = tmp_path / "broken-root" / "ctr"
    broken.mkdir(parents=True)
    (broken / "state.json").write_text("{broken")
    mon = Monitor(node, tmp_path, "--runtime-root", str(tmp_path / "broken-root"))
    (tmp_path / "prometheus").mkdir()
    prom = Prometheus(f"127.0.0.1:{mon.port}", tmp_path / "prometheus", job="nvctk-monitor",
                      rules=[rule_file(tmp_path)])
    holder: subprocess.Popen[str] | None = None
    try:
        until(lambda: "NvctkMonitorProblems" in prom.firing(), 60, "NvctkMonitorProblems")
        assert prom.firing() == {"NvctkMonitorProblems"}
        # 192 MiB held under a 200 MiB cap (128 allocated, 64 the context's); kernels back to
        # back under a 20 % SM limit; a share promised 90 % of the SM: GPU 0 is promised 110 %
        node.start({"CUDA_DEVICE_MEMORY_LIMIT": "200m"}, f"vgpu_probe init ctx 0 alloc {128 * MIB} "
                   "sleep 600000", gpu="0", wait_mem=192 * MIB, annotations=POD)
        node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_SM_LIMIT": "20",
                    "NVSIM_KERNEL_US": "2000"},  # kernels long beside their launch: the share is used
                   f"vgpu_probe init ctx 0 alloc {8 * MIB} launchfor 600000", gpu="0",
                   wait_mem=8 * MIB, annotations={**POD, "io.kubernetes.cri.sandbox-name": "job-1"})
        node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_SM_LIMIT": "90"},
                   f"vgpu_probe init ctx 0 alloc {8 * MIB} sleep 600000", gpu=g0.uuid,
                   wait_mem=8 * MIB, annotations={**POD, "io.kubernetes.cri.sandbox-name": "job-2"})
        shares = {"NvctkContainerAtMemoryCap", "NvctkContainerSMShareSaturated", "NvctkGPUOverPromised"}
        until(lambda: shares <= prom.firing(), 90, f"{shares} to fire")
        at_cap = [a["labels"] for a in json.loads(get(prom.url + "/api/v1/alerts"))["data"]["alerts"]
                  if a["labels"]["alertname"] == "NvctkContainerAtMemoryCap"]
        assert [lb["pod"] for lb in at_cap] == ["job-0"]
        # an application's fault (XID 13) on GPU 1: an XID, the GPU still there
        inject_xid(node.sim.root, 1, 13)
        until(lambda: "NvctkGPUXid" in prom.firing(), 60, "NvctkGPUXid")
        assert "NvctkGPULost" not in prom.firing()
        inject_xid(node.sim.root, 1, 79)  # fallen off the bus
        until(lambda: "NvctkGPULost" in prom.firing(), 60, "NvctkGPULost")
        # a hanging driver call: collection stalls, scrapes show an ageing snapshot
        assert "NvctkMonitorStale" not in prom.firing()
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(state_path(node.sim.root))],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        until(lambda: "NvctkMonitorStale" in prom.firing(), 90, "NvctkMonitorStale")
        holder.kill()
        holder.wait(30)
        # the monitor stopped: not scraped
        assert "NvctkMonitorDown" not in prom.firing()
        mon.proc.send_signal(signal.SIGSTOP)
        try:
            until(lambda: "NvctkMonitorDown" in prom.firing(), 60, "NvctkMonitorDown")
        finally:
            mon.proc.send_signal(signal.SIGCONT)
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait(30)
        prom.stop()
        mon.stop()


def test_prometheus_scrapes_over_tls_with_basic_auth(node: Node, tmp_path: Path) -> None:
    import re

    cfg = web_config(tmp_path)
    log = tmp_path / "monitor.log"
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "nvctk"), "monitor",
                             "--listen", "127.0.0.1:0", "--interval", "1", "--web-config-file", str(cfg),
                             "--runtime-root", node.runc_root], env={**os.environ, **node.sim.env},
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115
    try:
        port = until(lambda: re.search(r"serving https://127\.0\.0\.1:(\d+)/", log.read_text()), 60,
                     "the monitor to listen").group(1)
        job = {"job_name": "nvctk-monitor", "scheme": "https",
               "tls_config": {"ca_file": str(tmp_path / "tls.crt")},
               "basic_auth": {"username": "prometheus", "password": PASSWORD},
               "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
        wrong = {**job, "job_name": "wrong-password", "basic_auth": {"username": "prometheus", "password": "x"}}
        (tmp_path / "prometheus").mkdir()
        prom = Prometheus("", tmp_path / "prometheus", jobs=[job, wrong])
        try:
            until(lambda: prom.query('nvctk_gpu_memory_used_bytes{job="nvctk-monitor"}'), 60,
                  "the series scraped over TLS")
            until(lambda: prom.query('up{job="wrong-password"} == 0'), 60, "the wrong password's scrape")
            assert not prom.query('nvctk_gpu_memory_used_bytes{job="wrong-password"}')
        finally:
            prom.stop()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0

