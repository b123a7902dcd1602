"""plan.mounts and plan.make on plain records: a whole form from discovery's facts and
the invocation's context, with no host behind them (every path here is a string nothing
looks at)."""

from __future__ import annotations

import pytest

from nvctk.base.config import Config, ExtraMount
from nvctk.base.errors import RequestError
from nvctk.edits import HOOK_PATH_ENV, NVIDIA_HOOK_NAMES, DeviceNode, Edits
from nvctk.host.driver import DriverFiles
from nvctk.host.facts import CdiEdit, CdiFacts, Context, DeviceFacts, Facts
from nvctk.host.image import ImageFacts
from nvctk.host.inventory import GpuInfo, HostInfo
from nvctk.host.select import select_devices
from nvctk.plan.make import check_cdi_request, plan_container
from nvctk.plan.mounts import plan_mounts
from nvctk.request.parse import Request

V = "550.54.15"
ROOT = "/drv"
LIB = f"{ROOT}/usr/lib/x86_64-linux-gnu"
FILES = DriverFiles(
    ROOT, V,
    libraries={"utility": (f"{LIB}/libnvidia-ml.so.{V}",), "compute": (f"{LIB}/libcuda.so.{V}",),
               "graphics": (f"{LIB}/libGLX_nvidia.so.{V}",)},
    libraries32=(f"{ROOT}/usr/lib/i386-linux-gnu/libcuda.so.{V}",
                 f"{ROOT}/usr/lib/i386-linux-gnu/libGLX_nvidia.so.{V}"),
    binaries={"utility": (f"{ROOT}/usr/bin/nvidia-smi",)},
    sockets={"utility": (f"{ROOT}/var/run/nvidia-persistenced/socket",)},
    proc_dir=f"{ROOT}/proc/driver/nvidia", dev_dir=f"{ROOT}/dev",
)
GPU0_UUID = "GPU-0000"
GPU = GpuInfo(0, GPU0_UUID, "NVIDIA H100", 0, "00000000:1B:00.0", 81559, "9.0", "nvidia", False)
GPU1 = GpuInfo(1, "GPU-0001", "NVIDIA H100", 1, "00000000:1C:00.0", 81559, "9.0", "nvidia", False)
HOST = HostInfo(V, "12.4", (GPU, GPU1))
NODES: dict[str, tuple[int, int] | str | None] = {
    "nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia1": (195, 1), "nvidia-uvm": (510, 0),
    "nvidia-uvm-tools": (510, 1), "nvidia-modeset": None}
EXTRA = (ExtraMount("/etc/hosts.nv", "/etc/nv/hosts"), ExtraMount("/opt/nv", "/opt/nv", True),
         ExtraMount("/x/libcuda", f"/usr/lib64/libcuda.so.{V}"))  # a driver file's path: it loses


def mounts(caps: tuple[str, ...], *, mps_dir: str | None = None, env: dict[str, str] | None = None,
           kinds: dict[str, str] | None = None) -> dict[str, tuple[str, str, bool]]:
    got = plan_mounts(Request(capabilities=caps, env=env or {}), FILES, "/usr/lib64", "/usr/lib",
                      mps_dir=mps_dir, extra_mounts=EXTRA, extra_mount_kinds=kinds)
    return {m.container_path: (m.host_path, m.kind, m.read_only) for m in got}


@pytest.mark.parametrize(("caps", "mps_dir", "env", "mps_at"), [
    (("utility",), f"{ROOT}/tmp/nvidia-mps", {}, None),  # no compute: no MPS
    (("compute",), None, {}, None),  # the host has no pipe dir
    (("compute",), f"{ROOT}/tmp/nvidia-mps", {}, "/tmp/nvidia-mps"),
    (("video",), f"{ROOT}/tmp/nvidia-mps", {"CUDA_MPS_PIPE_DIRECTORY": "/mps"}, "/mps"),
    (("compute",), f"{ROOT}/tmp/nvidia-mps", {"CUDA_MPS_PIPE_DIRECTORY": "/"}, None),
    (("compute",), f"{ROOT}/tmp/nvidia-mps", {"CUDA_MPS_PIPE_DIRECTORY": "rel"}, None),
])
def test_mps_mount(caps: tuple[str, ...], mps_dir: str | None, env: dict[str, str],
                   mps_at: str | None) -> None:
    got = {p: v for p, v in mounts(caps, mps_dir=mps_dir, env=env).items() if v[1] == "dir"
           and v[0] == mps_dir}
    assert got == ({} if mps_at is None else {mps_at: (mps_dir, "dir", False)})


def test_extra_mounts_take_their_kind_from_discovery_and_driver_files_win() -> None:
    got = mounts(("compute",), kinds={"/etc/hosts.nv": "file", "/opt/nv": "dir"})
    assert got["/etc/nv/hosts"] == ("/etc/hosts.nv", "file", False)
    assert got["/opt/nv"] == ("/opt/nv", "dir", True)
    assert got[f"/usr/lib64/libcuda.so.{V}"][0] == f"{LIB}/libcuda.so.{V}"  # first wins
    # a path discovery did not see (missing): a dir, as before
    assert mounts(("compute",))["/etc/nv/hosts"][1] == "dir"


@pytest.mark.parametrize(("caps", "want32"), [
    (("compute",), set()),
    (("compute", "compat32"), {f"/usr/lib/libcuda.so.{V}"}),
    (("compute", "graphics", "compat32"), {f"/usr/lib/libcuda.so.{V}",
                                           f"/usr/lib/libGLX_nvidia.so.{V}"}),
])
def test_32bit_libraries_of_the_capabilities(caps: tuple[str, ...], want32: set[str]) -> None:
    assert {p for p in mounts(caps) if p.startswith("/usr/lib/")} == want32


DEBIAN = ImageFacts("/rootfs", True)


def facts(image: ImageFacts = DEBIAN, devices: tuple[str, ...] = ("0",), **kw: object) -> Facts:
    selected = tuple(select_devices(Request(devices=devices), HOST))
    return Facts(HOST, selected, FILES, DeviceFacts(f"{ROOT}/dev", NODES), image, **kw)  # type: ignore[arg-type]


CONTEXT = Context("/usr/bin/nvctk-hook", runtime_root="/run/runc")
CFG = Config(driver_root=ROOT, hook_timeout=9, log_file="/var/log/nvctk.log", log_level="debug")


def make(env: dict[str, str] | None = None, f: Facts | None = None,
         caps: tuple[str, ...] = ("compute", "utility"), context: Context = CONTEXT) -> Edits:
    request = Request(devices=("0",), capabilities=caps, env=env or {})
    return plan_container(request, CFG, f or facts(), context)


def test_a_plain_gpu_form() -> None:
    e = make()
    assert [d.path for d in e.devices] == ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm",
                                           "/dev/nvidia-uvm-tools"]
    assert e.lib_dir == "/usr/lib/x86_64-linux-gnu"  # a Debian image
    assert f"/usr/lib/x86_64-linux-gnu/libcuda.so.{V}" in {m.container_path for m in e.mounts}
    assert [(s.container_path, s.target) for s in e.symlinks] == [
        ("/usr/lib/x86_64-linux-gnu/libcuda.so", "libcuda.so.1")]
    assert e.proc_mask is not None and e.proc_mask.gpu_bus_ids == ("0000:1b:00.0",)
    assert [h.entry() for h in e.hooks] == [{"path": "/usr/bin/nvctk-hook",
                                             "args": ["nvctk-hook", "prestart"],
                                             "env": [HOOK_PATH_ENV], "timeout": 9}]
    # the decisions the writers only execute
    assert e.remove_hooks == tuple(NVIDIA_HOOK_NAMES)
    assert e.selected == (GPU0_UUID,)  # what was selected, recorded for readers
    assert e.seccomp_block_userns is False and e.pins == () and e.vgpu is None and e.env == {}
    assert e.log is not None and (e.log.file, e.log.level) == ("/var/log/nvctk.log", "debug")
    assert Edits.from_json(e.to_json()) == e  # what the hook reads back


def test_a_vgpu_form() -> None:
    f = facts(ImageFacts("/rootfs", False, True, "glibc", ("/usr/lib/libfoo.so",)),
              vgpu_library="/opt/libvgpu.so")
    e = make({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, f,
             context=CONTEXT.replace(vgpu_state_dir="/run/nvctk/abc-c1",
                                     nvctk_config="/etc/nvctk/config.toml"))
    assert e.vgpu is not None and e.vgpu.state_dir == "/run/nvctk/abc-c1"
    assert e.vgpu.preload_entries == ("/usr/lib/libfoo.so",) and e.vgpu.root_readonly
    assert e.lib_dir == "/usr/lib64"  # not Debian
    assert e.env == {"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/run/nvctk/vgpu/cache"}
    assert e.seccomp_block_userns is True and e.pins == ("etc", "run")
    assert [h.args for h in e.hooks] == [("nvctk-hook", "prestart"),
                                         ("nvctk-hook", "poststop", "--runtime-root", "/run/runc")]
    assert all(h.env == (HOOK_PATH_ENV, "NVCTK_CONFIG=/etc/nvctk/config.toml") for h in e.hooks)
    assert Edits.from_json(e.to_json()) == e


def test_a_missing_modeset_node_is_left_out_even_for_display() -> None:
    """nvidia-modeset is missing on this host (headless hosts have none: seen on an H100
    with driver 580, where `cdi generate` failed for it): a display request gets the rest."""
    assert "/dev/nvidia-modeset" not in [d.path for d in make(caps=("display",)).devices]


def test_a_multi_gpu_form_records_the_devices_in_libvgpus_order() -> None:
    """The form records what the runtime selected, in the order libvgpu indexes the
    devices (NVML order), whatever order the container named them in."""
    request = Request(devices=("1", "0"), capabilities=("compute",))
    e = plan_container(request, CFG, facts(devices=("1", "0")), CONTEXT)
    assert e.gpu_uuids == (HOST.gpus[1].uuid, HOST.gpus[0].uuid)  # the container's order
    assert e.selected == (HOST.gpus[0].uuid, HOST.gpus[1].uuid)  # libvgpu's
    assert Edits.from_json(e.to_json()).selected == e.selected


def test_a_cdi_form_gets_one_prestart_hook_only_for_hook_work() -> None:
    """CDI mode: the devices' edits as discovery read them; nvctk adds its prestart
    hook when the form leaves the hook work, and says where the hook logs."""
    request = Request(cdi_devices=("nvidia.com/gpu=0",))
    node = DeviceNode("/dev/nvidia0", "/dev/nvidia0", 195, 0)
    nodes_only = CdiEdit("s.json: device 0", True, {"deviceNodes": [{"path": "/dev/nvidia0"}]},
                         (node,))
    e = plan_container(request, CFG, CdiFacts((nodes_only,)), CONTEXT)
    assert e.hooks == () and e.log is not None and e.log.level == "debug"
    assert e.devices == (node,) and e.origin == "cdi"
    ldconfig = {"hookName": "createRuntime", "path": "/usr/bin/nvctk-hook",
                "args": ["nvctk-hook", "cdi-edits", "--folder", "/usr/lib64"]}
    e = plan_container(request, CFG, CdiFacts((nodes_only.replace(edits={"hooks": [ldconfig]}),)),
                       CONTEXT)
    assert [h.args for h in e.hooks] == [("nvctk-hook", "prestart")]
    assert (e.lib_dir, e.ldconfig) == ("/usr/lib64", CFG.ldconfig)


def test_a_cdi_request_refuses_vgpu_limits() -> None:
    request = Request(cdi_devices=("nvidia.com/gpu=0",), env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    with pytest.raises(RequestError, match="CUDA_DEVICE_MEMORY_LIMIT: vGPU limits are not "
                                           "supported in CDI mode"):
        check_cdi_request(request)
    check_cdi_request(request.replace(env={"CUDA_DEVICE_MEMORY_LIMIT": ""}))  # unset
