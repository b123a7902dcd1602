"""host.select and plan.select on plain inventory records: which devices a request names."""

from __future__ import annotations

import pytest

from nvctk.base.errors import UnknownDeviceError
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo, proc_bus_id
from nvctk.host.select import resolve_device, select_devices
from nvctk.plan.select import requirement_facts, vgpu_devices
from nvctk.request.parse import Request, asks_for_vgpu, expanded_capabilities

MIG_A = MigInfo(0, "MIG-aaaa", 1, 0, "3g.40gb", 40000)
MIG_B = MigInfo(1, "MIG-bbbb", 2, 0, "3g.40gb", 40000)
GPU0 = GpuInfo(0, "GPU-0000", "NVIDIA H100", 0, "00000000:1B:00.0", 81559, "9.0", "nvidia", False)
GPU1 = GpuInfo(1, "GPU-1111", "NVIDIA A100", 3, "00000000:2A:00.0", 40960, "8.0", "nvidia", True,
               (MIG_A, MIG_B))
HOST = HostInfo("550.54.15", "12.4", (GPU0, GPU1))


@pytest.mark.parametrize(("ident", "want"), [
    ("0", "GPU-0000"),
    ("1", "GPU-1111"),
    ("GPU-1111", "GPU-1111"),
    ("gpu-1111", "GPU-1111"),  # UUIDs in any case
    ("MIG-bbbb", "MIG-bbbb"),
    ("1:0", "MIG-aaaa"),  # GPU index : MIG index
    ("00000000:1B:00.0", "GPU-0000"),
    ("0000:1b:00.0", "GPU-0000"),  # procfs's form
    ("0000:2a:00.0", "GPU-1111"),
])
def test_resolve_device(ident: str, want: str) -> None:
    assert resolve_device(ident, HOST, "NVIDIA_VISIBLE_DEVICES").name == want


@pytest.mark.parametrize("ident", [
    "2", "GPU-2222", "MIG-cccc", "1:5", "0:0",  # 0 has no MIG devices
    "0000:ff:00.0", "\u0660",  # Arabic-Indic zero: not an index
    "0000:1b:00.0.0", "99999999999",
])
def test_an_unknown_device_names_the_host_s_gpus(ident: str) -> None:
    with pytest.raises(UnknownDeviceError, match=r"in NVIDIA_VISIBLE_DEVICES \(this host has "
                                                 r"GPUs 0 \(GPU-0000\), 1 \(GPU-1111\)\)"):
        resolve_device(ident, HOST, "NVIDIA_VISIBLE_DEVICES")


def test_no_gpu_on_the_host_says_so() -> None:
    with pytest.raises(UnknownDeviceError, match="none: the host has no GPU"):
        resolve_device("0", HostInfo("550.54.15", "12.4", ()), "NVIDIA_VISIBLE_DEVICES")


@pytest.mark.parametrize(("request_", "want"), [
    (Request(devices=("1", "0")), ["GPU-1111", "GPU-0000"]),  # container order
    (Request(devices=("0", "GPU-0000", "0000:1b:00.0")), ["GPU-0000"]),  # one device, 3 names
    (Request(devices=()), []),  # none: driver files only
    (Request(all_devices=True), ["GPU-0000", "GPU-1111", "MIG-aaaa", "MIG-bbbb"]),
    (Request(devices=("MIG-bbbb", "1")), ["MIG-bbbb", "GPU-1111"]),
])
def test_select_devices(request_: Request, want: list[str]) -> None:
    assert [s.name for s in select_devices(request_, HOST)] == want


def test_vgpu_devices_are_in_nvml_order() -> None:
    sel = select_devices(Request(devices=("MIG-bbbb", "1", "0", "MIG-aaaa")), HOST)
    assert [s.name for s in vgpu_devices(sel)] == ["GPU-0000", "GPU-1111", "MIG-aaaa", "MIG-bbbb"]


def test_requirement_facts_per_device() -> None:
    facts = requirement_facts(HOST, select_devices(Request(devices=("0", "MIG-aaaa")), HOST))
    assert [(f.arch, f.brand, f.gpu) for f in facts] == [
        ("9.0", "nvidia", "GPU 0 (GPU-0000)"), ("8.0", "nvidia", "GPU 1 (MIG-aaaa)")]
    assert [(f.cuda, f.driver, f.arch) for f in requirement_facts(HOST, [])] == [
        ("12.4", "550.54.15", None)]


@pytest.mark.parametrize(("nvml", "proc"), [("00000000:1B:00.0", "0000:1b:00.0"),
                                             ("0001:AF:00.1", "0001:af:00.1")])
def test_proc_bus_id(nvml: str, proc: str) -> None:
    assert proc_bus_id(nvml) == proc


@pytest.mark.parametrize(("request_", "asks"), [
    (Request(), False),
    (Request(env={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}), False),
    (Request(env={"CUDA_DEVICE_MEMORY_LIMIT": "0"}), True),  # read: whether it limits is the plan's
    (Request(env={"NVCTK_VGPU_X": ""}), True),
    (Request(vgpu_authority=(("nvctk.io/vgpu.gpu", None),)), True),
])
def test_asks_for_vgpu(request_: Request, asks: bool) -> None:
    """What makes discovery read the vGPU facts (the image's libc, the key, libvgpu)."""
    assert asks_for_vgpu(request_) is asks


@pytest.mark.parametrize(("caps", "want"), [
    (("utility",), ["utility"]), (("video",), ["video", "compute"]),
    (("display",), ["display", "graphics"]), (("video", "compute"), ["video", "compute"])])
def test_expanded_capabilities(caps: tuple[str, ...], want: list[str]) -> None:
    assert expanded_capabilities(caps) == want
