"""`nvctk monitor` with the real parts: a real Prometheus server (Debian's package) scraping it
while capped, whole-GPU and MIG containers run on the simulated host; every PromQL query of
the Grafana dashboard answered by that Prometheus; the dashboard page in headless chromium
(selenium + chromedriver), its numbers read from the rendered page. All checked against the
simulated GPU's own counters. The node, the monitor and Prometheus:
tests/support/monitornode.py; the dashboards users import (--compat):
test_monitor_e2e_dashboards.py.

Set NVCTK_DOCS_SCREENSHOT=1 to write the page's screenshots at 1400 and 700 px to
docs/monitor-dashboard-1400.png and -700.png (the README's); they always go to the test's
tmp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import support.monitornode as _monitornode
from support.monitor import MIB, FakePodResources, Node, sim_counts
from support.monitornode import K8S, REPO
from support.prometheus import PROMETHEUS, Monitor, Prometheus, get
from support.wait import until as wait_until

node = _monitornode.node  # fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                       reason="needs root (sim device nodes) and runc"),
]


CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def monitor(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitor]:
    m = Monitor(node, tmp_path_factory.mktemp("monitor-proc"))
    yield m
    m.stop()


@pytest.fixture(scope="module")
def prometheus(monitor: Monitor, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if PROMETHEUS is None:
        pytest.skip("needs Debian's prometheus package (make setup installs it)")
    p = Prometheus(f"127.0.0.1:{monitor.port}", tmp_path_factory.mktemp("prometheus"))
    yield p
    p.stop()


@pytest.mark.exclusive  # an SM share over wall time
def test_prometheus_series_match_the_simulated_gpu(node: Node, prometheus: Prometheus) -> None:
    n = len(node.expect)
    wait_until(lambda: len(prometheus.query("nvctk_container_memory_used_bytes")) == n
               and len(prometheus.query("nvctk_container_sm_utilization_ratio[6s]")) == n
               and all(len(s["values"]) >= 5 for s in
                       prometheus.query("nvctk_container_sm_utilization_ratio[6s]")),
               90, "6 s of every container's series in Prometheus")
    a = sim_counts(node)
    time.sleep(6)  # the span the SM shares are compared over (a measurement, not a wait)
    b = sim_counts(node)
    mem = {s["metric"]["container_id"]: float(s["value"][1])
           for s in prometheus.query("nvctk_container_memory_used_bytes")}
    sm = {s["metric"]["container_id"]: float(s["value"][1]) for s in prometheus.query(
        "avg_over_time(nvctk_container_sm_utilization_ratio[6s])")}
    labels = {s["metric"]["container_id"]: s["metric"]
              for s in prometheus.query("nvctk_container_memory_used_bytes")}
    for cid, want in node.expect.items():
        assert abs(mem[cid] - b.mem[cid]) <= MIB, cid
        busy = (b.busy[cid] - a.busy[cid]) / ((b.time - a.time) * 1e9)
        assert abs(sm[cid] - busy) <= 0.05, (cid, sm[cid], busy)
        lb = labels[cid]
        assert lb["device_uuid"] == want["device"] and lb["kind"] == want["kind"]
        assert lb["UUID"] in {g.uuid for g in node.sim.topology.gpus}
    pod = next(lb for lb in labels.values() if lb.get("pod"))
    assert (pod["namespace"], pod["pod"], pod["container"]) == ("team-a", "trainer-0", "worker")
    caps = {s["metric"]["container_id"]: float(s["value"][1])
            for s in prometheus.query("nvctk_container_memory_limit_bytes")}
    assert caps == {cid: w["mem_cap"] for cid, w in node.expect.items() if w.get("mem_cap")}
    gpus = prometheus.query("nvctk_gpu_memory_used_bytes")
    assert {s["metric"]["UUID"] for s in gpus} == {g.uuid for g in node.sim.topology.gpus}


def test_target_labels_as_prometheus_operator_sets_them(
        node: Node, monitor: Monitor, tmp_path: Path) -> None:
    """prometheus-operator gives every series of a ServiceMonitor's target the labels of the
    Pod it scrapes: the monitor's own namespace, pod, container. With the shipped
    ServiceMonitor's honorLabels the series keep their own (the Pod that holds the GPU);
    without it (the job beside, as monitor.yaml was) they name the monitor's Pod and the
    real ones become exported_*: the shipped dashboards' {{pod}} legends were wrong."""
    if PROMETHEUS is None:
        pytest.skip("needs Debian's prometheus package (make setup installs it)")
    from support.deployments import manifests

    (sm,) = [d for d in manifests("monitor.yaml") if d["kind"] == "ServiceMonitor"]
    (endpoint,) = sm["spec"]["endpoints"]
    target = f"127.0.0.1:{monitor.port}"
    operator = {"namespace": "nvctk-system", "pod": "nvctk-monitor-x7k2p", "container": "monitor",
                "service": "nvctk-monitor", "endpoint": endpoint["port"]}

    def job(name: str, honor: bool) -> dict[str, Any]:
        return {"job_name": name, "honor_labels": honor,
                "static_configs": [{"targets": [target], "labels": operator}]}

    p = Prometheus(target, tmp_path, jobs=[job("shipped", endpoint.get("honorLabels", False)),
                                           job("without-honor-labels", False)])
    try:
        sel = 'nvctk_container_memory_used_bytes{job="%s",container_id!=""}'
        wait_until(lambda: len(p.query(sel % "shipped")) == len(node.expect)
                   and len(p.query(sel % "without-honor-labels")) == len(node.expect),
                   90, "both jobs' container series")
        pods = {(s["metric"].get("namespace", ""), s["metric"].get("pod", ""))
                for s in p.query(sel % "shipped")}
        assert ("team-a", "trainer-0") in pods and ("nvctk-system", "nvctk-monitor-x7k2p") not in pods
        (gpu0,) = [s["metric"] for s in p.query('nvctk_gpu_shares{job="shipped",gpu="0"}')]
        assert gpu0["Hostname"] == json.loads(get(monitor.url + "/api/snapshot"))["hostname"]
        # the control: what a ServiceMonitor without honorLabels made of the same series
        plain = p.query(sel % "without-honor-labels")
        assert {s["metric"]["pod"] for s in plain} == {"nvctk-monitor-x7k2p"}
        assert "trainer-0" in {s["metric"].get("exported_pod") for s in plain}
        # the shipped dashboard's panels whose legends name the Pod name the GPU's Pod
        dash = json.loads((REPO / "deployments/grafana-dashboard.json").read_text())
        per_pod = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])
                   if "{{pod}}" in t.get("legendFormat", "")]
        assert per_pod
        for q in per_pod:
            expr = q.replace("$Hostname", ".*").replace('"}', '",job="shipped"}')
            named = {s["metric"].get("pod") for s in p.query(expr)}
            assert "trainer-0" in named and "nvctk-monitor-x7k2p" not in named, q
    finally:
        p.stop()


def test_every_grafana_query_returns_data(node: Node, prometheus: Prometheus) -> None:
    from support.deployments import grafana_queries

    wait_until(lambda: [len(s["values"]) >= 3 for s in
                        prometheus.query("nvctk_gpu_xid_errors_total[20s]")][:1] == [True],
               90, "a few scrapes")
    for q in grafana_queries():
        expr = q.replace("$Hostname", ".*").replace("$__rate_interval", "1m")
        assert prometheus.query(expr), q


def chrome(tmp: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    assert CHROMIUM
    opts.binary_location = CHROMIUM
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
              "--window-size=1500,1300"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)


def test_dashboard_page_shows_the_simulated_gpu(node: Node, monitor: Monitor, tmp_path: Path) -> None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (make setup installs them)")
    pytest.importorskip("selenium")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    drv = chrome(tmp_path)
    try:
        drv.get(monitor.url + "/")
        n = len(node.expect)
        WebDriverWait(drv, 60).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr[data-container]")) == n)
        first = drv.find_element(By.TAG_NAME, "body").get_attribute("data-updated")
        # it refreshes itself
        WebDriverWait(drv, 30).until(
            lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-updated") != first)
        counts = sim_counts(node)
        rows = drv.find_elements(By.CSS_SELECTOR, "tr[data-container]")
        for row in rows:
            cid = row.get_attribute("data-container")
            want = node.expect[cid]
            assert row.get_attribute("data-device") == want["device"]
            shown = row.find_element(By.CSS_SELECTOR, "td[data-field=memory]").text
            used_mib = int(shown.split("/")[0])
            assert abs(used_mib * MIB - counts.mem[cid]) <= MIB, (cid, shown)
            if want.get("mem_cap"):
                assert shown.split("/")[1].strip() == str(want["mem_cap"] // MIB)
            sm_text = row.find_element(By.CSS_SELECTOR, "td[data-field=sm]").text
            if want.get("sm_cap"):
                assert sm_text.endswith(f"/ {want['sm_cap'] * 100:.1f} %"), sm_text
            if not want["busy"]:
                assert sm_text.startswith("0.0 "), sm_text
        assert "team-a/trainer-0/worker" in drv.find_element(By.ID, "gpus").text
        cards = drv.find_elements(By.CSS_SELECTOR, "div.gpu")
        assert [c.get_attribute("data-uuid") for c in cards] == [g.uuid for g in node.sim.topology.gpus]
        for width in (1400, 700):  # the README's: a wide window and a narrow one, whole page
            drv.set_window_size(width, 1000)
            height = drv.execute_script("return document.documentElement.scrollHeight")
            drv.set_window_size(width, height + 120)  # the window's frame takes a little
            shot = tmp_path / f"monitor-dashboard-{width}.png"
            drv.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000
            if os.environ.get("NVCTK_DOCS_SCREENSHOT") == "1":
                shutil.copy(shot, REPO / "docs" / shot.name)
    finally:
        drv.quit()


def test_the_page_shows_names_as_text_fits_700px_and_flags_over_promised(
        node: Node, monitor: Monitor, tmp_path: Path) -> None:
    """Pod names with markup, HTML, terminal controls and a bidi override are the text
    they are (controls escaped); at 700 px nothing overflows sideways; GPU 0, promised
    more SM share than it has (the standard containers' 80 % and these five's 25 % each;
    a memory-only cap promises none), is flagged, the others are not."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (make setup installs them)")
    pytest.importorskip("selenium")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from nvctk.base.errors import literal

    names = ["[/]", "<img src=x onerror=\"document.title='owned'\">", "\x1b]0;pwned\x07",
             "job\u202egpj.exe", "a\u0085b"]
    started = {node.start({"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_SM_LIMIT": "25"},
                          f"vgpu_probe init ctx 0 alloc {16 * MIB} sleep 600000", gpu="0",
                          wait_mem=16 * MIB, annotations={**K8S, "io.kubernetes.cri.container-name": name}): name
               for name in names}
    drv = chrome(tmp_path)
    try:
        drv.set_window_size(700, 1000)
        drv.get(monitor.url + "/")
        WebDriverWait(drv, 60).until(lambda d: all(
            d.find_elements(By.CSS_SELECTOR, f"tr[data-container='{cid}']") for cid in started))
        for cid, name in started.items():
            row = drv.find_element(By.CSS_SELECTOR, f"tr[data-container='{cid}']")
            who = row.find_element(By.CSS_SELECTOR, "td[data-field=who]").text
            assert who.replace("\n", "") == f"team-a/trainer-0/{literal(name)}", (name, who)
        assert not drv.find_elements(By.CSS_SELECTOR, "#gpus img")
        assert drv.title == "nvctk GPU shares"
        wide, view = drv.execute_script(
            "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert wide <= view, (wide, view)
        flags = {c.get_attribute("data-gpu"): [e.text for e in c.find_elements(
            By.CSS_SELECTOR, "[data-field=over-promised]")] for c in drv.find_elements(By.CSS_SELECTOR, "div.gpu")}
        assert len(flags["0"]) == 1 and "SM " in flags["0"][0], flags
        assert flags["1"] == [] and flags["2"] == [], flags
        drv.save_screenshot(str(tmp_path / "monitor-dashboard-700.png"))
    finally:
        drv.quit()
        for cid in started:
            node.kill(cid)


def _page_rows(node: Node, tmp_path: Path, sock: Path, pods: list[dict[str, object]],
               ready: str) -> dict[str, tuple[list[str], bool]]:
    """The page of `nvctk monitor --pod-resources-socket` with a kubelet answering `pods`,
    once an element `ready` (a CSS selector) is on it: who -> (its claim lines, whether
    it is flagged as outside the kubelet's allocations)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    kubelet = FakePodResources(sock, pods)
    mon = Monitor(node, tmp_path, "--pod-resources-socket", str(sock))
    drv = chrome(tmp_path)
    try:
        drv.get(mon.url + "/")
        WebDriverWait(drv, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ready))
        return {r.find_element(By.CSS_SELECTOR, "td[data-field=who]").text.split("\n")[0]: (
                    [e.text for e in r.find_elements(By.CSS_SELECTOR, "[data-field=claim]")],
                    bool(r.find_elements(By.CSS_SELECTOR, "[data-field=outside]")))
                for r in drv.find_elements(By.CSS_SELECTOR, "tr[data-container]")}
    finally:
        drv.quit()
        mon.stop()
        kubelet.stop()


def test_the_page_names_the_dra_claim_the_kubelet_reports(node: Node, tmp_path: Path) -> None:
    """`nvctk monitor --pod-resources-socket`: the claim the kubelet reports for a Pod's
    container is shown under its name on the page; containers without one show none.
    A Pod's GPU container the kubelet allocated nothing is flagged (issue 39)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (make setup installs them)")
    pytest.importorskip("selenium")
    from support.daemons import short_dir

    with short_dir("nvctk-pr-") as d:
        shown = _page_rows(node, tmp_path, d / "kubelet.sock", [{
            "name": "trainer-0", "namespace": "team-a", "containers": [{
                "name": "worker", "dynamic_resources": [{
                    "claim_name": "gpu-share", "claim_namespace": "team-a", "claim_resources": [
                        {"driver_name": "gpu.nvctk.io", "pool_name": "node1",
                         "device_name": "gpu-0"}]}]}]}], "[data-field=claim]")
        assert shown.pop("team-a/trainer-0/worker") == (["claim team-a/gpu-share"], False), shown
        # the rest: no claim, and no Pod's (nothing to flag)
        assert shown and all(v == ([], False) for v in shown.values()), shown
        # a kubelet that allocated trainer-0 nothing: its GPU is flagged
        shown = _page_rows(node, tmp_path, d / "kubelet2.sock", [], "[data-field=outside]")
        assert [who for who, (_, out) in shown.items() if out] == ["team-a/trainer-0/worker"]
