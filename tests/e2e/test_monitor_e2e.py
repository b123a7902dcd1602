"""`nvctk monitor` with the real parts: a real Prometheus server (Debian's package) scraping it
while capped, whole-GPU and MIG containers run on the simulated host; every PromQL query of
the Grafana dashboard answered by that Prometheus; the dashboard page in headless chromium
(selenium + chromedriver), its numbers read from the rendered page. All checked against the
simulated GPU's own counters.

Set NVCTK_DOCS_SCREENSHOT=1 to write the page's screenshots at 1400 and 700 px to
docs/monitor-dashboard-1400.png and -700.png (the README's); they always go to the test's
tmp dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.state import read_state, state_path
from support.monitor import MIB, FakePodResources, Node, sim_counts, standard_containers
from support.prometheus import PROMETHEUS, Monitor, Prometheus, get
from support.wait import until as wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                       reason="needs root (sim device nodes) and runc"),
]

BIN = os.path.dirname(sys.executable)
REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
K8S = {"io.kubernetes.cri.sandbox-namespace": "team-a", "io.kubernetes.cri.sandbox-name": "trainer-0",
       "io.kubernetes.cri.container-name": "worker", "io.kubernetes.cri.sandbox-uid": "1234-5678"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("monitor-e2e"))
    try:
        standard_containers(n)
        g0 = n.sim.topology.gpus[0]
        # a container as containerd's CRI makes them: its Pod's identity in the annotations
        n.start({"CUDA_DEVICE_MEMORY_LIMIT": "3g", "CUDA_DEVICE_SM_LIMIT": "25"},
                f"vgpu_probe init ctx 0 alloc {700 * MIB} launchfor 100000", gpu="0",
                wait_mem=700 * MIB, annotations=K8S, kind="vgpu", device=g0.uuid,
                mem_cap=3 << 30, sm_cap=0.25, min_mem=700 * MIB, busy=True)
        yield n
    finally:
        n.cleanup()


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


# --- nvctk monitor --compat hami,dcgm: the dashboards users import, unchanged ---------------

DASHBOARDS = REPO.parent / "shared" / "peers" / "dashboards"
DASHBOARD_FILES = {"dcgm": DASHBOARDS / "dcgm-exporter" / "dcgm-exporter-dashboard.json",
                   "hami": DASHBOARDS / "hami" / "hami-vgpu-dashboard.json"}
COMPAT_QUERIES = REPO / "tests" / "support" / "data" / "compat-queries.json"  # HAMi's legacy one


@pytest.fixture(scope="module")
def compat_pods(node: Node) -> dict[str, tuple[str, int]]:
    """Pod name -> (namespace, GPU index) of every Pod container: the fixture's trainer-0
    (a share of GPU 0) and two more, another share of GPU 0 and a MIG slice of GPU 2. GPU 1
    is held by a container outside Kubernetes only."""
    g2 = node.sim.topology.gpus[2]
    for ns, pod_name, ctr, env, gpu, alloc in (
        ("team-b", "infer-0", "server", {"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_SM_LIMIT": "15"},
         "0", 250),
        ("team-b", "slice-0", "main", {}, g2.mig_devices[1].uuid, 150),
    ):
        node.start(env, f"vgpu_probe init ctx 0 alloc {alloc * MIB} launchfor 100000", gpu=gpu,
                   wait_mem=alloc * MIB, annotations={
                       "io.kubernetes.cri.sandbox-namespace": ns, "io.kubernetes.cri.sandbox-name": pod_name,
                       "io.kubernetes.cri.container-name": ctr})
    return {"trainer-0": ("team-a", 0), "infer-0": ("team-b", 0), "slice-0": ("team-b", 2)}


@pytest.fixture(scope="module")
def compat_prometheus(node: Node, compat_pods: dict[str, tuple[str, int]],
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, str]]:
    """A plain Prometheus (no relabeling: nothing HAMi's or dcgm-exporter's scrape configs
    add) scraping `nvctk monitor --compat hami,dcgm`."""
    if PROMETHEUS is None:
        pytest.skip("needs Debian's prometheus package (make setup installs it)")
    mon = Monitor(node, tmp_path_factory.mktemp("monitor-compat"), "--compat", "hami,dcgm")
    try:
        hostname = json.loads(get(mon.url + "/api/snapshot"))["hostname"]
        p = Prometheus(f"127.0.0.1:{mon.port}", tmp_path_factory.mktemp("prometheus-compat"))
        try:
            gpus = {str(g.index) for g in node.sim.topology.gpus}
            # every Pod's and GPU's series, GPM's rates (from the second snapshot) among them
            wait_until(lambda: len(p.query("hami_vgpu_memory_used_bytes")) == len(compat_pods)
                       and {s["metric"]["gpu"] for s in p.query("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")} == gpus
                       and len(p.query("hami_container_device_utilization_ratio[5s]")) == len(compat_pods),
                       90, "every Pod's and GPU's compat series in Prometheus")
            yield p, hostname
        finally:
            p.stop()
    finally:
        mon.stop()


_REGEX_SPECIAL = re.compile(r"([$^*{}\[\]'+?.()|])")


def _regex_escape(value: str) -> str:
    """Grafana's prometheusSpecialRegexEscape: a backslash before each regex character,
    itself escaped for the PromQL string the value lands in."""
    return _REGEX_SPECIAL.sub(r"\\\\\1", value.replace("\\", "\\\\\\\\"))


def _substitute(expr: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):  # $node before $n
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def grafana_variables(prom: Prometheus, variables: list[dict[str, Any]]) -> dict[str, str]:
    """The dashboard's query variables resolved as Grafana resolves them, in order, each at
    its default (no saved selection: "All" where includeAll, else the first value):
    label_values(M, L) is GET /api/v1/label/L/values?match[]=M with the earlier variables
    substituted; a multi/All value is every value regex-escaped, one as itself, several
    as (a|b), **none as ()** (which matches nothing but series without L)."""
    out: dict[str, str] = {}
    for v in variables:
        if v.get("type") != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q)
        assert m, f"variable {v['name']}: {q}"
        match, label = _substitute(m.group(1), out), m.group(2)
        url = (f"{prom.url}/api/v1/label/{label}/values?"
               + urllib.parse.urlencode({"match[]": match, "start": time.time() - 3600}))
        found: list[str] = sorted(json.loads(get(url))["data"])
        if v.get("includeAll") or v.get("multi"):
            esc = [_regex_escape(x) for x in found]
            out[v["name"]] = esc[0] if len(esc) == 1 else "(" + "|".join(esc) + ")"
        else:
            out[v["name"]] = found[0] if found else ""
    return out


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def panel_data(prom: Prometheus, dashboard: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Panel title -> what its queries return, as Grafana asks: an instant query for an
    instant target, else a range query over the last minute; every variable resolved."""
    values = grafana_variables(prom, dashboard["templating"]["list"])
    out: dict[str, list[dict[str, Any]]] = {}
    for p in _panels(dashboard):
        if p.get("type") == "row" or not p.get("targets"):
            continue
        got: list[dict[str, Any]] = []
        for t in p["targets"]:
            expr = _substitute(t["expr"], values)
            if t.get("instant"):
                got += prom.query(expr)
            else:
                now = time.time()
                body = json.loads(get(prom.url + "/api/v1/query_range?" + urllib.parse.urlencode(
                    {"query": expr, "start": now - 60, "end": now, "step": 1})))
                assert body["status"] == "success", (p["title"], expr, body)
                got += body["data"]["result"]
        out[p["title"]] = got
    return out


@pytest.mark.parametrize("which", ["dcgm", "hami"])
def test_the_dashboards_operators_import_show_every_panel(
        node: Node, compat_pods: dict[str, tuple[str, int]],
        compat_prometheus: tuple[Prometheus, str], which: str) -> None:
    """dcgm-exporter's and HAMi's published dashboards (../shared/peers/dashboards, unchanged)
    against a plain Prometheus scraping `nvctk monitor --compat hami,dcgm`, with their
    variables resolved as Grafana resolves them: every panel has data (an empty variable
    is an empty panel, and fails here)."""
    path = DASHBOARD_FILES[which]
    if not path.exists():
        pytest.skip(f"needs ../shared/peers/dashboards ({path} absent)")
    prom, _ = compat_prometheus
    data = panel_data(prom, json.loads(path.read_text()))
    assert len(data) == {"dcgm": 8, "hami": 15}[which]
    empty = [title for title, got in data.items() if not got]
    assert not empty, f"panels without data: {empty}"


def test_the_dashboards_figures_are_the_simulated_drivers(
        node: Node, compat_pods: dict[str, tuple[str, int]],
        compat_prometheus: tuple[Prometheus, str]) -> None:
    """What the dashboards show is the simulated node: framebuffer used per GPU (MiB) and
    each Pod's vGPU memory (bytes) equal the sim's own counts; utilizations are NVML's
    (nvctk's own series, from the same scrape); the scheduler panels count the node's
    GPUs, their memory and the containers holding them; and the Pod series name the right
    Pods on the right GPUs, one series per Pod on a shared GPU as dcgm-exporter's do."""
    prom, hostname = compat_prometheus
    dash = {k: json.loads(p.read_text()) for k, p in DASHBOARD_FILES.items() if p.exists()}
    if len(dash) < 2:
        pytest.skip("needs ../shared/peers/dashboards")
    topo = node.sim.topology
    st = read_state(state_path(node.sim.root), live_only=True)
    # dcgm-exporter's "GPU Framebuffer Mem Used", at its latest point, per GPU
    fb = panel_data(prom, dash["dcgm"])["GPU Framebuffer Mem Used"]
    last = {(s["metric"]["gpu"], s["metric"].get("pod", "")): float(s["values"][-1][1]) for s in fb
            if not s["metric"].get("GPU_I_ID")}
    for g in topo.gpus:
        want = st.gpus[g.index].mem_used // MIB
        assert {v for (i, _), v in last.items() if i == str(g.index)} == {want}, (g.index, last)
    # shared GPU 0: a series per Pod on it, each the whole GPU's; GPU 1: no Pod, one series
    assert {p for (i, p) in last if i == "0"} == {p for p, (_, g) in compat_pods.items() if g == 0}
    assert [p for (i, p) in last if i == "1"] == [""]
    # HAMi's "Top 10 containers by vGPU memory": each Pod's own bytes, the sim's
    top = panel_data(prom, dash["hami"])["Top 10 containers by vGPU memory"]
    ids = {(s["metric"]["namespace"], s["metric"]["pod"]): s["metric"]["container_id"]
           for s in prom.query('nvctk_container_memory_used_bytes{pod!=""}')}
    counts = sim_counts(node, list(ids.values()))
    got = {(s["metric"]["namespace"], s["metric"]["pod"]): float(s["value"][1]) for s in top}
    assert got == {k: counts.mem[cid] for k, cid in ids.items()}
    assert {p for _, p in got} == set(compat_pods)
    # the scheduler's overview: the node's GPUs, their memory, the containers holding them
    hami = {t: panel_data(prom, dash["hami"])[t] for t in ("Physical GPUs", "Total GPU memory",
                                                          "Shared containers")}
    assert float(hami["Physical GPUs"][0]["value"][1]) == len(topo.gpus)
    assert float(hami["Total GPU memory"][0]["value"][1]) == sum(g.memory_mib * MIB for g in topo.gpus)
    holders = sum(1 for cid in node.procs if node.init_pid(cid))
    assert float(hami["Shared containers"][0]["value"][1]) == holders
    # the figures are nvctk's own, in the others' units (one scrape: one evaluation time)
    for expr in (
        "hami_container_device_utilization_ratio - on (namespace, pod, container) "
        "round(100 * nvctk_container_sm_utilization_ratio{pod!=\"\"})",
        "hami_host_gpu_utilization_ratio - on (device_uuid) "
        'label_replace(round(100 * nvctk_gpu_utilization_ratio), "device_uuid", "$1", "UUID", "(.*)")',
        'DCGM_FI_DEV_GPU_UTIL - on (gpu) group_left round(100 * nvctk_gpu_utilization_ratio)',
        "hami_gpu_memory_allocated_bytes - on (device_uuid) "
        'label_replace(nvctk_gpu_memory_promised_bytes, "device_uuid", "$1", "UUID", "(.*)")',
    ):
        res = prom.query(expr)
        assert res and all(float(s["value"][1]) == 0 for s in res), (expr, res)
    sl = [s["metric"] for s in prom.query('DCGM_FI_DEV_FB_USED{GPU_I_ID!=""}')]
    mig = topo.gpus[2].mig_devices[1]
    assert [(m["pod"], m["GPU_I_PROFILE"]) for m in sl] == [("slice-0", mig.profile)]
    assert {s["metric"]["Hostname"] for s in prom.query("DCGM_FI_DEV_GPU_TEMP")} == {hostname}


def test_hamis_legacy_dashboard_without_its_relabeling(
        node: Node, compat_pods: dict[str, tuple[str, int]],
        compat_prometheus: tuple[Prometheus, str]) -> None:
    """HAMi's legacy dashboard filters on node_name, which HAMi's scrape config adds by
    relabeling: its HAMi panels fill from a plain Prometheus (node_name is on the series);
    its dcgm-exporter panels need that relabeling, as with dcgm-exporter itself."""
    prom, hostname = compat_prometheus
    data = json.loads(COMPAT_QUERIES.read_text())
    gpus = {str(g.index) for g in node.sim.topology.gpus}
    names = grafana_variables(prom, [{"name": "node_name", "type": "query", "query": data["queries"][5]["expr"]}])
    assert names == {"node_name": hostname}
    for q in data["queries"][:3]:
        res = prom.query(_substitute(q["expr"], {**names, "gpu": ".*"}))
        labels = [s["metric"] for s in res]
        got = ({lb.get("podname") for lb in labels} if q["expect"] == "pods"
               else {lb.get("deviceidx") for lb in labels})
        assert got == (set(compat_pods) if q["expect"] == "pods" else gpus), q
