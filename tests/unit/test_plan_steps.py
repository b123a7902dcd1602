"""The planning steps and the spec edits on plain data: no root, no simulated host.

Each planning step (nvctk.plan.{select,devices,mounts,vgpu,hooks,make}) is a function
of the request, the host inventory (records), the driver's files (a DriverFiles record)
and discovery's other facts; none reads the host, so no path here needs to exist or
not. nvctk.spec.apply.apply is the one place a plan meets a spec. Tables of inputs and
the edits they must give.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nvctk.base.config import Config
from nvctk.base.errors import RequestError
from nvctk.edits import PRELOAD, DeviceNode, Edits, Hook, Mount, with_server
from nvctk.host.driver import DriverFiles
from nvctk.host.image import ImageFacts
from nvctk.host.inventory import GpuInfo
from nvctk.host.select import Selected
from nvctk.plan import hooks as plan_hooks
from nvctk.plan import mounts as plan_mounts
from nvctk.plan import vgpu as plan_vgpu
from nvctk.request.parse import Request
from nvctk.spec import apply as spec_edits
from nvctk.spec.record import AppliedRecord, Seal
from support.records import apply_as_create

V = "550.54.15"
ROOT = "/driver"  # a plain string: planning never looks at it
LIB = f"{ROOT}/usr/lib/x86_64-linux-gnu"
FILES = DriverFiles(
    ROOT, V,
    libraries={"utility": (f"{LIB}/libnvidia-ml.so.{V}", f"{LIB}/libnvidia-cfg.so.{V}"),
               "compute": (f"{LIB}/libcuda.so.{V}", f"{LIB}/libnvidia-opencl.so.{V}"),
               "graphics": (f"{LIB}/libGLX_nvidia.so.{V}",)},
    binaries={"utility": (f"{ROOT}/usr/bin/nvidia-smi",)},
    firmware=(f"{ROOT}/lib/firmware/nvidia/{V}/gsp.bin",),
    sockets={"utility": (f"{ROOT}/var/run/nvidia-persistenced/socket",)},
)
GPU = GpuInfo(0, "GPU-aaaa", "NVIDIA H100", 0, "00000000:17:00.0", 81559, "9.0", "nvidia", False)
GPU1 = GpuInfo(1, "GPU-bbbb", "NVIDIA H100", 1, "00000000:2a:00.0", 81559, "9.0", "nvidia", False)


def mounts_of(caps: tuple[str, ...], mps_dir: str | None = None, **req: Any) -> dict[str, Mount]:
    request = Request(devices=("0",), capabilities=caps, **req)
    return {m.container_path: m for m in plan_mounts.plan_mounts(
        request, FILES, "/usr/lib/x86_64-linux-gnu", "/usr/lib", mps_dir=mps_dir)}


# capabilities -> (container paths that must be there, the required ones among them)
MOUNT_CASES: list[tuple[tuple[str, ...], set[str], set[str]]] = [
    (("utility",), {"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + V, "/usr/bin/nvidia-smi",
                    "/run/nvidia-persistenced/socket", f"/lib/firmware/nvidia/{V}/gsp.bin"},
     {"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + V}),
    (("compute",), {"/usr/lib/x86_64-linux-gnu/libcuda.so." + V},
     {"/usr/lib/x86_64-linux-gnu/libcuda.so." + V}),
    (("compute", "utility"), {"/usr/lib/x86_64-linux-gnu/libcuda.so." + V,
                              "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + V},
     {"/usr/lib/x86_64-linux-gnu/libcuda.so." + V,
      "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + V}),
    # display brings graphics; nothing of it is required
    (("display",), {"/usr/lib/x86_64-linux-gnu/libGLX_nvidia.so." + V}, set()),
]


@pytest.mark.parametrize(("caps", "present", "required"), MOUNT_CASES)
def test_plan_mounts_marks_what_a_container_needs(caps: tuple[str, ...], present: set[str],
                                                  required: set[str]) -> None:
    got = mounts_of(caps)
    assert present <= set(got)
    assert {p for p, m in got.items() if m.required} == required
    sock = got.get("/run/nvidia-persistenced/socket")
    if sock is not None:  # IPC: writable, never executable
        assert (sock.kind, sock.read_only, sock.noexec) == ("socket", False, True)


def test_plan_mounts_ignores_the_images_mps_pipe_dir_on_the_host_side() -> None:
    """The image's CUDA_MPS_PIPE_DIRECTORY names only the place inside the container;
    the host side is discovery's (the host's pipe dir, or None: no mount)."""
    got = mounts_of(("compute",), env={"CUDA_MPS_PIPE_DIRECTORY": "/etc"})
    assert "/etc" not in got and not any(m.host_path == "/etc" for m in got.values())
    got = mounts_of(("compute",), f"{ROOT}/tmp/nvidia-mps", env={"CUDA_MPS_PIPE_DIRECTORY": "/etc"})
    assert got["/etc"].host_path == f"{ROOT}/tmp/nvidia-mps"  # never the image's /etc
    assert (got["/etc"].kind, got["/etc"].read_only, got["/etc"].noexec) == ("dir", False, True)


@pytest.mark.parametrize(("names", "links"), [
    ([f"libcuda.so.{V}"], {"libcuda.so": "libcuda.so.1"}),
    ([f"libGLX_nvidia.so.{V}"], {"libGLX_indirect.so.0": f"libGLX_nvidia.so.{V}"}),
    ([f"libnvidia-ml.so.{V}"], {}),
])
def test_plan_symlinks(names: list[str], links: dict[str, str]) -> None:
    lib = "/usr/lib64"
    mounts = [Mount(f"/h/{n}", f"{lib}/{n}") for n in names]
    got = plan_mounts.plan_symlinks(mounts, lib, V)
    assert {s.container_path.rsplit("/", 1)[1]: s.target for s in got} == links


@pytest.mark.parametrize(("debian", "lib"), [(True, "/usr/lib/x86_64-linux-gnu"),
                                              (False, "/usr/lib64")])
def test_lib_dir_from_image_facts(debian: bool, lib: str) -> None:
    assert plan_mounts.container_lib_dirs(ImageFacts("/r", debian))[0] == lib


VGPU_CASES: list[tuple[dict[str, str], list[Selected], dict[str, str] | str | None]] = [
    ({}, [Selected(GPU)], None),  # no limit: no vGPU
    ({"CUDA_DEVICE_MEMORY_LIMIT": "0"}, [Selected(GPU)], None),  # 0 = no limit
    ({"CUDA_DEVICE_MEMORY_LIMIT": "8g"}, [Selected(GPU)],
     {"CUDA_DEVICE_MEMORY_LIMIT_0": str(8 << 30)}),
    ({"CUDA_DEVICE_SM_LIMIT": "25"}, [Selected(GPU)], {"CUDA_DEVICE_SM_LIMIT_0": "25"}),
    ({"CUDA_DEVICE_MEMORY_LIMIT_1": "1g"}, [Selected(GPU), Selected(GPU1)],
     {"CUDA_DEVICE_MEMORY_LIMIT_1": str(1 << 30)}),
    ({"CUDA_DEVICE_MEMORY_LIMIT": "100g"}, [Selected(GPU)], "above the memory"),
    ({"CUDA_DEVICE_SM_LIMIT": "101"}, [Selected(GPU)], "CUDA_DEVICE_SM_LIMIT"),
]


@pytest.mark.parametrize(("env", "selected", "want"), VGPU_CASES)
def test_plan_vgpu(env: dict[str, str], selected: list[Selected],
                   want: dict[str, str] | str | None) -> None:
    request = Request(devices=("0",), env=env)
    cfg = Config(state_dir="/run/test-nvctk")

    def plan() -> Any:
        return plan_vgpu.plan_vgpu(request, selected, cfg, ImageFacts(root_readonly=True),
                                   library="/opt/nvctk/libvgpu.so",
                                   state_dir="/run/test-nvctk/0123456789abcdef-c1")

    if isinstance(want, str):
        with pytest.raises(RequestError, match=want):
            plan()
        return
    v = plan()
    if want is None:
        assert v is None
        return
    uuids = {k: val for k, val in v.limits.items() if k.startswith("NVCTK_VGPU_UUID_")}
    limits = {k: val for k, val in v.limits.items() if k not in uuids}
    assert {k: val for k, val in limits.items() if val != "0"} == want  # 0: no limit
    # libvgpu maps CUDA's devices by the UUIDs the file names (no NVML at its cuInit)
    assert uuids == {f"NVCTK_VGPU_UUID_{i}": s.gpu.uuid for i, s in enumerate(selected)}
    assert v.library == "/opt/nvctk/libvgpu.so" and v.root_readonly is True
    assert v.state_dir.startswith("/run/test-nvctk/")
    # the plan says every vGPU mount, in order, all required, the last over ld.so.preload
    assert [m.container_path for m in v.mounts] == [
        "/run/nvctk", "/run/nvctk/libvgpu.so", "/run/nvctk/vgpu", "/run/nvctk/vgpu/limits",
        "/run/nvctk/vgpu/cache", PRELOAD]
    assert all(m.required for m in v.mounts)
    assert [m.read_only for m in v.mounts] == [True, True, False, True, False, True]
    assert v.mounts[0].host_path == f"{v.state_dir}/ro"
    assert plan_vgpu.vgpu_env(v) == {"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/run/nvctk/vgpu/cache"}


@pytest.mark.parametrize(("vgpu", "stages"), [(False, ["prestart"]),
                                               (True, ["prestart", "poststop"])])
def test_plan_hooks(vgpu: bool, stages: list[str]) -> None:
    hooks = plan_hooks.plan_hooks("/usr/bin/nvctk-hook", 7, "/etc/c.toml", vgpu, "/b/rel/root")
    assert [h.stage for h in hooks] == stages
    assert hooks[0].entry() == {"path": "/usr/bin/nvctk-hook", "args": ["nvctk-hook", "prestart"],
                                "env": [spec_edits.HOOK_PATH_ENV, "NVCTK_CONFIG=/etc/c.toml"],
                                "timeout": 7}
    if vgpu:  # the runtime root as discovery made it (absolute)
        assert hooks[1].args == ("nvctk-hook", "poststop", "--runtime-root", "/b/rel/root")


def test_the_runtime_names_its_server_in_the_prestart_only() -> None:
    """After planning, the runtime names its prestart server in the form (edits.with_server,
    nvctk.hook.served); the poststop and a foreign hook never get it."""
    foreign = Hook("createRuntime", "/x", ("x",))
    form = Edits("", (), (), hooks=(*plan_hooks.plan_hooks("/h", 60, None, True, "/r"), foreign))
    served = with_server(form, "0123abcd")
    assert [h.args for h in served.hooks] == [
        ("nvctk-hook", "prestart", "--served", "0123abcd"),
        ("nvctk-hook", "poststop", "--runtime-root", "/r"), ("x",)]
    assert served.hooks[0].env == form.hooks[0].env and served.hooks[0].timeout == 60
    assert with_server(Edits("", (), ()), "0123abcd").hooks == ()


def test_plan_hooks_refuse_a_root_that_is_not_utf8() -> None:
    with pytest.raises(RequestError, match="not UTF-8"):
        plan_hooks.plan_hooks("/h", 60, None, True, "/run/\udcffx")


# --- applying a plan to a spec ------------------------------------------------------------

NODE = DeviceNode("/dev/nvidia0", "/dev/nvidia0", 195, 0)
PRE = Hook("prestart", "/usr/bin/nvctk-hook", ("nvctk-hook", "prestart"),
           (spec_edits.HOOK_PATH_ENV,), 60)
POST = Hook("poststop", "/usr/bin/nvctk-hook", ("nvctk-hook", "poststop", "--runtime-root", "/r"),
            (spec_edits.HOOK_PATH_ENV,), 60)


def base_spec() -> dict[str, Any]:
    return {"process": {"env": ["PATH=/bin", "A=1"]},
            "hooks": {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook",
                                    "args": ["nvidia-container-runtime-hook", "prestart"]},
                                   {"path": "/x", "args": ["x"]}]},
            "linux": {}}


def test_apply_puts_exactly_the_plan_into_the_spec() -> None:
    plan = Edits(V, ("compute",), ("GPU-aaaa",), devices=(NODE,), hooks=(PRE,),
                env={"NVCTK_X": "1"})
    spec = base_spec()
    edits, removed = spec_edits.apply(spec, plan, None, Seal(b"k" * 32, "/bundle"))
    assert removed == 1  # NVIDIA's own hook gives way to ours
    assert spec["hooks"]["prestart"] == [{"path": "/x", "args": ["x"]}, PRE.entry()]
    assert spec["linux"]["devices"] == [spec_edits.device_entry(NODE)]
    assert spec["linux"]["resources"]["devices"] == [spec_edits.cgroup_rule(NODE)]
    assert spec["process"]["env"] == ["PATH=/bin", "A=1", "NVCTK_X=1"]
    assert "seccomp" not in spec["linux"]  # no vGPU, no rules
    record = json.loads(spec["annotations"][spec_edits.EDITS_ANNOTATION])
    assert record["env"] == ["NVCTK_X=1"] and len(record["devices"]) == 1
    assert edits.env == ["NVCTK_X=1"]


def test_apply_twice_is_applying_once_and_a_smaller_plan_takes_the_rest_out(tmp_path: Path) -> None:
    big = Edits(V, ("compute",), ("GPU-aaaa",), devices=(NODE,), hooks=(PRE, POST),
               env={"NVCTK_X": "1"})
    once = base_spec()
    state = tmp_path / "state"  # the key of the record's MAC: an unsigned env entry stays
    apply_as_create(once, big, tmp_path, state)
    twice = json.loads(json.dumps(once))
    apply_as_create(twice, big, tmp_path, state)
    assert twice == once
    small = Edits(V, ("utility",), ("GPU-aaaa",), hooks=(PRE,))
    apply_as_create(twice, small, tmp_path, state)
    assert twice["process"]["env"] == ["PATH=/bin", "A=1"]
    assert twice["linux"]["devices"] == [] and twice["linux"]["resources"]["devices"] == []
    assert twice["hooks"]["poststop"] == []  # the vGPU's poststop went with the vGPU
    assert twice["hooks"]["prestart"][-1] == PRE.entry()


def test_a_state_dir_without_a_key_leaves_a_plain_gpu_record_unsigned(tmp_path: Path) -> None:
    """A read-only or broken state dir never stops a GPU container without a cap: a
    plain GPU record (NVIDIA nodes and rules only) needs no key and gets none; a record
    naming more (a vGPU's variables, seccomp rules; CDI entries) cannot go unsigned."""
    (tmp_path / "file").write_text("")
    broken = tmp_path / "file" / "state"
    plain = Edits(V, ("compute",), ("GPU-aaaa",), devices=(NODE,), hooks=(PRE,))
    spec = base_spec()
    apply_as_create(spec, plain, tmp_path, broken)
    assert "mac" not in json.loads(spec["annotations"][spec_edits.EDITS_ANNOTATION])
    with_env = plain.replace(env={"NVCTK_X": "1"})
    with pytest.raises(OSError):
        apply_as_create(base_spec(), with_env, tmp_path, broken)
    with pytest.raises(ValueError, match="needs the edits key"):
        spec_edits.record_edits(base_spec(), AppliedRecord(seccomp={"created": False}), None)
    signed = base_spec()
    apply_as_create(signed, with_env, tmp_path, tmp_path / "state")
    assert "mac" in json.loads(signed["annotations"][spec_edits.EDITS_ANNOTATION])
