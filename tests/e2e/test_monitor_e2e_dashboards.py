"""`nvctk monitor --compat hami,dcgm`: the dashboards users import, unchanged, answered by
a real Prometheus scraping the monitor on the simulated host (tests/support/monitornode.py):
every panel shows, its figures are the simulated driver's; HAMi's legacy dashboard works
without its relabeling. The rest of the monitor with real parts: test_monitor_e2e.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import support.monitornode as _monitornode
from nvctk.sim.state import read_state, state_path
from support.monitor import MIB, Node, sim_counts
from support.monitornode import REPO
from support.prometheus import PROMETHEUS, Monitor, Prometheus, get
from support.wait import until as wait_until

node = _monitornode.node  # fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                       reason="needs root (sim device nodes) and runc"),
]


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
