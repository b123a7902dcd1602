"""`nvctk monitor --compat hami,dcgm` without a node: HAMi's and dcgm-exporter's names,
units and label names from a snapshot (the facts are theirs: HAMi cmd/vGPUmonitor/metrics.go,
dcgm-exporter etc/default-counters.csv), read back by prometheus-client's own parser; and
the text of a snapshot rendered once however many scrapes read it."""

from __future__ import annotations

import gzip
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from nvctk.monitor import compat, prom
from nvctk.monitor.model import ContainerSample, DeviceUse, GpuHealth, GpuSample, Snapshot
from nvctk.monitor.prom import Exposition

GIB, MIB = 1 << 30, 1 << 20
MIG_UUID = "MIG-s1"


def host() -> HostInfo:
    mig = MigInfo(0, MIG_UUID, 3, 0, "1g.10gb", 9856)
    return HostInfo(driver_version="550.54.15", cuda_version="12.4", gpus=(
        GpuInfo(0, "GPU-a", "NVIDIA H100", 0, "00000000:1B:00.0", 81920, "9.0", "nvidia", False, ()),
        GpuInfo(1, "GPU-b", "NVIDIA H100", 1, "00000000:1C:00.0", 81920, "9.0", "nvidia", False, ()),
        GpuInfo(2, "GPU-c", "NVIDIA H100", 2, "00000000:1D:00.0", 81920, "9.0", "nvidia", True, (mig,)),
    ))


GPM = {"graphics": 0.37, "sm_active": 0.36, "sm_occupancy": 0.18, "tensor": 0.15, "dram": 0.11,
       "pcie_tx": 2.5e9, "pcie_rx": 1e10}


def health(i: int) -> GpuHealth:
    """GPU 1 is a GPU without GPM (no profile) whose driver reports no temperature."""
    return GpuHealth(temperature=None if i == 1 else 51 + i, power=312.5, power_limit=700.0,
                     energy=123456789, sm_clock=1980, memory_clock=2619, memory_reserved=512 * MIB,
                     memory_copy_utilization=0.2, encoder_utilization=0.0, decoder_utilization=0.0,
                     pcie_replays=3, ecc_corrected=4, ecc_uncorrected=0, rows_remapped_corrected=1,
                     rows_remapped_uncorrected=0, row_remap_failure=False,
                     profile={} if i == 1 else GPM)


def snapshot() -> Snapshot:
    gpus = [GpuSample(index=i, uuid=u, name="NVIDIA H100", memory_total=80 * GIB,
                      memory_used=(i + 1) * GIB + 5 * MIB, utilization=0.37, last_xid=79 if i == 0 else 0,
                      shares=[2, 1, 1][i], memory_promised=[83 * GIB, 80 * GIB, 9856 * MIB][i],
                      sm_promised=[0.25, 1.0, 1 / 7][i], health=health(i))
            for i, u in enumerate(("GPU-a", "GPU-b", "GPU-c"))]

    def pod(cid: str, name: str, dev: DeviceUse, ns: str = "team") -> ContainerSample:
        return ContainerSample(id=cid, name=name, kind="vgpu", runtime_root="/run/runc",
                               namespace=ns, pod=f"{name}-pod", container=name, devices=[dev])

    return Snapshot(time=100.0, interval=1.0, hostname="node1", driver_version="550.54.15", gpus=gpus,
                    containers=[
        # two capped shares of GPU 0, one idle; a whole GPU 1 outside Kubernetes; a MIG slice
        pod("c1", "train", DeviceUse(0, "GPU-a", "GPU-a", 700 * MIB, 80 * GIB, 3 * GIB, 0.25, 0.3,
                                     [11], 1.7)),
        pod("c2", "idle", DeviceUse(0, "GPU-a", "GPU-a", 0, 80 * GIB, None, 0.0, None)),
        ContainerSample(id="c3", name="c3", kind="gpu", runtime_root="/run/runc",
                        devices=[DeviceUse(1, "GPU-b", "GPU-b", GIB, 80 * GIB, None, 0.5, None, [13])]),
        pod("c4", "slice", DeviceUse(2, "GPU-c", MIG_UUID, 300 * MIB, 9856 * MIB, None, 0.12, None, [14])),
        # the same Pod container listed twice (a restart seen mid-way): one set of series
        pod("c5", "train", DeviceUse(0, "GPU-a", "GPU-a", 1, 80 * GIB, None, 0.0, None)),
    ])


def series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    keys = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in keys, f"duplicate series {key}: Prometheus would refuse the scrape"
            keys.add(key)
            # the parser adds _total to a counter's samples; dcgm-exporter's have none
            name = s.name.removesuffix("_total") if s.name.startswith("DCGM_") else s.name
            out.setdefault(name, []).append((s.labels, s.value))
    return out


def test_hami_names_units_and_labels() -> None:
    got = series(compat.render("hami", snapshot(), host()))
    (gl, gv), *_ = got["hami_host_gpu_memory_used_bytes"]
    assert gl == {"zone": "vGPU", "node": "node1", "device_index": "0", "device_uuid": "GPU-a",
                  "device_type": "NVIDIA-NVIDIA H100"} and gv == GIB + 5 * MIB
    assert {v for _, v in got["hami_host_gpu_utilization_ratio"]} == {37}  # HAMi's 0-100
    assert {v for _, v in got["HostCoreUtilization"]} == {37}
    legacy_host = got["HostGPUMemoryUsage"][0][0]
    # node_name on the series: HAMi's legacy dashboard filters on it without HAMi's relabeling
    assert set(legacy_host) == {"zone", "nodeid", "deviceidx", "deviceuuid", "devicetype", "node_name"}
    assert legacy_host["node_name"] == "node1"

    def by_pod(name: str) -> dict[str, tuple[dict[str, str], float]]:
        return {lb.get("pod", lb.get("podname", "")): (lb, v) for lb, v in got.get(name, [])}

    used = by_pod("hami_vgpu_memory_used_bytes")
    assert set(used) == {"train-pod", "idle-pod", "slice-pod"}  # Pods only; each once
    lb, v = used["train-pod"]
    assert lb == {"zone": "vGPU", "namespace": "team", "pod": "train-pod", "container": "train",
                  "vdevice_index": "0", "device_uuid": "GPU-a"} and v == 700 * MIB
    assert by_pod("hami_container_device_memory_bytes")["train-pod"][1] == 700 * MIB
    assert by_pod("hami_vgpu_memory_limit_bytes")["train-pod"][1] == 3 * GIB
    assert by_pod("hami_vgpu_memory_limit_bytes")["idle-pod"][1] == 80 * GIB  # uncapped: the device
    assert by_pod("hami_vgpu_memory_limit_bytes")["slice-pod"][1] == 9856 * MIB
    assert by_pod("hami_container_device_utilization_ratio")["train-pod"][1] == 25  # 0-100
    assert by_pod("hami_container_last_kernel_elapsed_seconds").keys() == {"train-pod"}
    assert by_pod("hami_container_last_kernel_elapsed_seconds")["train-pod"][1] == 1  # whole seconds
    assert by_pod("hami_vgpu_memory_used_bytes")["slice-pod"][0]["device_uuid"] == "GPU-c"
    old = by_pod("vGPU_device_memory_usage_in_bytes")["train-pod"]
    assert old == ({"zone": "vGPU", "podnamespace": "team", "podname": "train-pod", "ctrname": "train",
                    "vdeviceid": "0", "deviceuuid": "GPU-a", "node_name": "node1"}, 700 * MIB)
    assert by_pod("vGPU_device_memory_limit_in_bytes")["train-pod"][1] == 3 * GIB
    assert by_pod("Device_utilization_desc_of_container")["train-pod"][1] == 25
    assert by_pod("Device_last_kernel_of_container")["train-pod"][1] == 1
    desc = by_pod("Device_memory_desc_of_container")["train-pod"]
    assert (desc[0]["context"], desc[0]["module"], desc[0]["data"], desc[0]["offset"], desc[1]) == (
        "0", "0", str(700 * MIB), "0", 700 * MIB)


def test_dcgm_names_units_and_labels() -> None:
    got = series(compat.render("dcgm", snapshot(), host()))
    fb = got["DCGM_FI_DEV_FB_USED"]
    gpu0 = [(lb, v) for lb, v in fb if lb["gpu"] == "0"]
    # a shared GPU: one series per Pod container on it, each the whole GPU's figure (MiB)
    assert sorted(lb["pod"] for lb, _ in gpu0) == ["idle-pod", "train-pod"]
    assert {v for _, v in gpu0} == {1029}  # 1 GiB + 5 MiB
    lb = gpu0[0][0]
    assert {k: lb[k] for k in ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
                               "DCGM_FI_DRIVER_VERSION", "namespace", "container")} == {
        "gpu": "0", "UUID": "GPU-a", "pci_bus_id": "00000000:1B:00.0", "device": "nvidia0",
        "modelName": "NVIDIA H100", "Hostname": "node1", "DCGM_FI_DRIVER_VERSION": "550.54.15",
        "namespace": "team", "container": lb["pod"].removesuffix("-pod")}
    # a GPU no Pod holds: one series, no Pod labels
    gpu1 = [lb for lb, _ in fb if lb["gpu"] == "1"]
    assert len(gpu1) == 1 and "pod" not in gpu1[0]
    free = {(lb["gpu"], lb.get("pod", "")): v for lb, v in got["DCGM_FI_DEV_FB_FREE"]}
    assert free[("1", "")] == 80 * 1024 - 2053
    assert {v for _, v in got["DCGM_FI_DEV_GPU_UTIL"]} == {37}
    # profiling: GPM's, only where the GPU has it (GPU 1 has none: absent, not 0)
    prof = {lb["gpu"]: v for lb, v in got["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] if "GPU_I_ID" not in lb}
    assert prof == {"0": 0.37, "2": 0.37}
    for name, key in (("DCGM_FI_PROF_SM_ACTIVE", "sm_active"), ("DCGM_FI_PROF_SM_OCCUPANCY", "sm_occupancy"),
                      ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor"), ("DCGM_FI_PROF_DRAM_ACTIVE", "dram"),
                      ("DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx"), ("DCGM_FI_PROF_PCIE_RX_BYTES", "pcie_rx")):
        assert {lb["gpu"]: v for lb, v in got[name]} == {"0": GPM[key], "2": GPM[key]}, name
    # the board: dcgm-exporter's units (W, MHz, mJ, MiB, %), absent where NVML has none
    one = {name: {lb["gpu"]: v for lb, v in got[name] if lb.get("pod") != "idle-pod"} for name in got}
    assert one["DCGM_FI_DEV_GPU_TEMP"] == {"0": 51, "2": 53}
    assert one["DCGM_FI_DEV_POWER_USAGE"]["1"] == 312.5
    assert one["DCGM_FI_DEV_SM_CLOCK"]["0"] == 1980 and one["DCGM_FI_DEV_MEM_CLOCK"]["0"] == 2619
    assert one["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]["0"] == 123456789
    assert one["DCGM_FI_DEV_FB_RESERVED"]["0"] == 512 and one["DCGM_FI_DEV_MEM_COPY_UTIL"]["0"] == 20
    assert one["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"]["0"] == 3 and one["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"]["0"] == 4
    assert one["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"]["0"] == 1
    assert one["DCGM_FI_DEV_ROW_REMAP_FAILURE"]["0"] == 0
    # dcgm-exporter's counters keep their field's name (no _total), typed counter
    text = compat.render("dcgm", snapshot(), host())
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in text
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text and "_total{" not in text
    assert {v for lb, v in got["DCGM_FI_DEV_XID_ERRORS"] if lb["gpu"] == "0"} == {79}
    # the MIG slice: its own series with the GPU instance's id and profile
    sl = [(lb, v) for lb, v in fb if "GPU_I_ID" in lb]
    assert len(sl) == 1
    lb, v = sl[0]
    assert (lb["gpu"], lb["GPU_I_ID"], lb["GPU_I_PROFILE"], lb["pod"], v) == ("2", "3", "1g.10gb", "slice-pod", 300)
    assert [v for lb, v in got["DCGM_FI_DEV_FB_FREE"] if "GPU_I_ID" in lb] == [9856 - 300]
    assert [v for lb, v in got["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] if "GPU_I_ID" in lb] == [0.12]


def test_hami_scheduler_series_say_what_the_node_handed_out() -> None:
    """HAMi's scheduler series (its dashboard's $node and host panels need them), from the
    snapshot's shares: one series per GPU, labels node, device_uuid, device_index,
    device_type; allocated memory the caps handed out; cores and memory ratios 0-100."""
    got = series(compat.render("hami", snapshot(), host()))
    by_gpu = {name: {lb["device_index"]: (lb, v) for lb, v in got[name]} for name in (
        "hami_gpu_memory_limit_bytes", "hami_gpu_memory_allocated_bytes", "hami_gpu_shared_count",
        "hami_gpu_core_allocated_ratio", "hami_node_gpu_memory_allocated_ratio")}
    lb, v = by_gpu["hami_gpu_memory_limit_bytes"]["0"]
    assert lb == {"node": "node1", "device_uuid": "GPU-a", "device_index": "0",
                  "device_type": "NVIDIA-NVIDIA H100"} and v == 80 * GIB
    lb, v = by_gpu["hami_gpu_memory_allocated_bytes"]["0"]
    assert lb["device_cores"] == "25" and v == 83 * GIB
    assert {i: v for i, (_, v) in by_gpu["hami_gpu_shared_count"].items()} == {"0": 2, "1": 1, "2": 1}
    assert {i: v for i, (_, v) in by_gpu["hami_gpu_core_allocated_ratio"].items()} == {"0": 25, "1": 100, "2": 14}
    ratio = {i: v for i, (_, v) in by_gpu["hami_node_gpu_memory_allocated_ratio"].items()}
    assert ratio["0"] == pytest.approx(100 * 83 / 80) and ratio["1"] == 100
    old = {lb["deviceidx"]: (lb, v) for lb, v in got["GPUDeviceMemoryAllocated"]}
    assert old["0"] == ({"zone": "vGPU", "nodeid": "node1", "deviceidx": "0", "deviceuuid": "GPU-a",
                         "node_name": "node1", "devicecores": "25"}, 83 * GIB)


def test_formats_parsed_and_refused() -> None:
    assert compat.parse_formats("hami,dcgm") == ("dcgm", "hami")
    assert compat.parse_formats(" DCGM ") == ("dcgm",)
    for bad in ("", "hami,nvml", ","):
        with pytest.raises(ValueError, match="not a list of dcgm, hami"):
            compat.parse_formats(bad)


def test_a_snapshot_is_rendered_once_for_all_its_scrapes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = prom.render

    def counted(snap: Snapshot, errors: dict[str, int]) -> Any:
        calls.append(snap)
        return real(snap, errors)

    monkeypatch.setattr(prom, "render", counted)
    ex = Exposition(("dcgm", "hami"), host())
    a, b = snapshot(), snapshot()
    first = ex.body(a, 101.0, {})
    again = ex.body(a, 107.0, {})
    assert calls == [a]
    # the same series, only the snapshot's age moved on with the scrape
    age = "nvctk_monitor_snapshot_age_seconds"
    assert [ln for ln in first.decode().splitlines() if not ln.startswith(age)] == [
        ln for ln in again.decode().splitlines() if not ln.startswith(age)]
    assert series(again.decode())[age][0][1] == 7.0
    ex.body(b, 108.0, {})
    assert calls == [a, b]
    text = ex.body(b, 108.0, {}).decode()
    got = series(text)  # nvctk's and both compat formats in one valid exposition
    assert {"nvctk_container_memory_used_bytes", "hami_vgpu_memory_used_bytes",
            "DCGM_FI_DEV_FB_USED"} <= set(got)
    # a whole GPU's size is the GPU's series; a slice has its own
    assert [lb["container_id"] for lb, _ in got["nvctk_container_memory_total_bytes"]] == ["c4"]
    # another format of the same snapshot renders it once more (the families are kept only
    # until a first body is joined: a scraper asks in one format), then serves every other:
    # OpenMetrics (strictly parsed: counter families without _total, dcgm-exporter's
    # counters `unknown`, # EOF) and gzip
    om = ex.body(b, 108.0, {}, openmetrics=True).decode()
    assert calls == [a, b, b] and om.endswith("# EOF\n")
    fams = {f.name: f for f in om_families(om)}
    assert fams["nvctk_gpu_xid_errors"].type == "counter"
    assert [s.name for s in fams["nvctk_gpu_xid_errors"].samples][:1] == ["nvctk_gpu_xid_errors_total"]
    assert fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].type == "unknown"
    assert {n for n in fams if not n.startswith("nvctk_monitor")} >= {
        f.name.removesuffix("_total") for f in text_string_to_metric_families(text)
        if not f.name.startswith("nvctk_monitor")}
    for openmetrics in (False, True):
        plain = ex.body(b, 109.0, {}, openmetrics)
        packed = ex.body(b, 109.0, {}, openmetrics, gzipped=True)
        assert gzip.decompress(packed) == plain and len(packed) < len(plain) / 3
    assert calls == [a, b, b]


@pytest.mark.parametrize("accept, encoding, om, gz", [
    # Prometheus 2.x's defaults
    ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1", "gzip", True, True),
    ("text/plain;version=0.0.4;q=1,*/*;q=0.1", "identity", False, False),  # scrape_protocols text
    ("", "", False, False),  # curl
    ("application/openmetrics-text;q=0", "gzip;q=0, deflate", False, False),
    ("*/*", "x-gzip", False, True),
    ("application/openmetrics-text; version=1.0.0; q=0.9, text/plain; q=0.9", "*", True, True),
])
def test_format_and_encoding_as_asked(accept: str, encoding: str, om: bool, gz: bool) -> None:
    from nvctk.monitor.server import accepts_gzip, prefers_openmetrics

    assert (prefers_openmetrics(accept), accepts_gzip(encoding)) == (om, gz)



def test_a_shown_snapshot_is_served_while_the_next_one_renders() -> None:
    """Monitor renders a new snapshot before it shows it; scrapes of the one shown are
    served from its kept body meanwhile, never waiting on that render (its lock)."""
    import threading

    ex = Exposition(("dcgm", "hami"), host())
    shown, nxt = snapshot(), snapshot()
    nxt.time = shown.time + 5
    want = ex.body(shown, 101.0, {}, True, True)
    with ex._lock:  # the next snapshot's render under way
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(ex.body(shown, 101.0, {}, True, True)))
        t.start()
        t.join(30)
        assert got == [want], "a scrape waited on another snapshot's render"
    ex.body(nxt, 106.0, {}, True, True)
    assert ex.body(shown, 101.0, {}, True, True) == want  # both kept: the shown and the next
