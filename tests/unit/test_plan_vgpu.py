"""plan.vgpu on plain records: limits x GPU memory x the node's share x the image's libc
x libvgpu found or not; the preload entries kept, the pins, the seccomp decision."""

from __future__ import annotations

from typing import Any

import pytest

from nvctk.base.config import Config
from nvctk.base.errors import ConfigError, NvctkError, RequestError, SpecError
from nvctk.edits import Edits
from nvctk.host.image import ImageFacts
from nvctk.host.inventory import GpuInfo, MigInfo
from nvctk.host.select import Selected
from nvctk.plan.vgpu import kept_preload_entries, plan_vgpu, vgpu_pins
from nvctk.request.parse import Request
from nvctk.vgpu import authority

MIG = MigInfo(0, "MIG-aaaa", 1, 0, "1g.10gb", 9856)
GPU = GpuInfo(0, "GPU-0000", "NVIDIA H100", 0, "00000000:17:00.0", 81559, "9.0", "nvidia", False)
GPU1 = GpuInfo(1, "GPU-1111", "NVIDIA A100", 1, "00000000:2a:00.0", 40960, "8.0", "nvidia", True,
               (MIG,))
KEY = b"k" * authority.KEY_BYTES
LIB = "/opt/nvctk/libvgpu.so"
STATE = "/run/nvctk/0123456789abcdef-c1"
CFG = Config(authority_key="/etc/nvctk/authority.key")
GLIBC = ImageFacts("/rootfs", True, False, "glibc", ())
G = 1 << 30


def share(*devices: tuple[str, int, int], key: bytes = KEY) -> tuple[tuple[str, str], ...]:
    return (authority.make("nvidia.com/gpu", list(devices), key),)


def plan(env: dict[str, str], selected: list[Selected], *, image: ImageFacts = GLIBC,
         vgpu_authority: tuple[tuple[str, str | None], ...] = (),
         key: bytes | NvctkError | None = KEY, library: str | NvctkError = LIB) -> Any:
    request = Request(devices=("0",), env=env, vgpu_authority=vgpu_authority)
    return plan_vgpu(request, selected, CFG, image, authority_key=key, library=library,
                     state_dir=STATE)


# env, devices, the node's share -> limits (the non-zero ones), or the error's text
CASES: list[tuple[dict[str, str], list[Selected], tuple[tuple[str, str | None], ...],
                  dict[str, str] | str | None]] = [
    ({}, [Selected(GPU)], (), None),
    ({"NVCTK_VGPU_X": "1"}, [Selected(GPU)], (), None),  # read, but no limit
    ({"CUDA_DEVICE_MEMORY_LIMIT": "8g"}, [Selected(GPU)], (),
     {"CUDA_DEVICE_MEMORY_LIMIT_0": str(8 * G)}),
    # libvgpu's index is NVML order in the container: GPU 0 before GPU 1's MIG device
    ({"CUDA_DEVICE_MEMORY_LIMIT_1": "1g"}, [Selected(GPU1, MIG), Selected(GPU)], (),
     {"CUDA_DEVICE_MEMORY_LIMIT_1": str(G)}),
    ({"CUDA_DEVICE_MEMORY_LIMIT_1": "10g"}, [Selected(GPU1, MIG), Selected(GPU)], (),
     "CUDA_DEVICE_MEMORY_LIMIT_1=10g: above the memory of the container's GPU 1 (MIG-aaaa, 9856 MiB)"),
    ({"CUDA_DEVICE_MEMORY_LIMIT_2": "1g"}, [Selected(GPU)], (), "CUDA_DEVICE_MEMORY_LIMIT_2"),
    # the node's share alone, and the env tightening it (never loosening)
    ({}, [Selected(GPU)], share(("GPU-0000", 4 * G, 50)),
     {"CUDA_DEVICE_MEMORY_LIMIT_0": str(4 * G), "CUDA_DEVICE_SM_LIMIT_0": "50"}),
    ({"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_SM_LIMIT": "90"}, [Selected(GPU)],
     share(("GPU-0000", 4 * G, 50)),
     {"CUDA_DEVICE_MEMORY_LIMIT_0": str(2 * G), "CUDA_DEVICE_SM_LIMIT_0": "50"}),
    ({}, [Selected(GPU)], share(("GPU-0000", 100 * G, 0)),
     "the node's vGPU share (102400 MiB): above the memory"),
    ({}, [Selected(GPU), Selected(GPU1)], share(("GPU-0000", G, 0)),
     "but the container also gets GPU-1111"),
    ({}, [Selected(GPU)], share(("GPU-0000", G, 0), key=b"x" * 32), "does not verify"),
]


@pytest.mark.parametrize(("env", "selected", "granted", "want"), CASES)
def test_limits(env: dict[str, str], selected: list[Selected],
                granted: tuple[tuple[str, str | None], ...],
                want: dict[str, str] | str | None) -> None:
    if isinstance(want, str):
        with pytest.raises(RequestError) as e:
            plan(env, selected, vgpu_authority=granted)
        assert want in str(e.value)
        return
    v = plan(env, selected, vgpu_authority=granted)
    if want is None:
        assert v is None
        return
    uuids = {k: x for k, x in v.limits.items() if k.startswith("NVCTK_VGPU_UUID_")}
    assert {k: x for k, x in v.limits.items() if x != "0" and k not in uuids} == want
    # libvgpu's device map by UUID: whole GPUs only (a MIG device: NVML's order)
    assert uuids == ({} if any(s.mig for s in selected) else
                     {f"NVCTK_VGPU_UUID_{i}": s.gpu.uuid for i, s in enumerate(selected)})
    assert (v.library, v.state_dir) == (LIB, STATE)
    assert v.mounts[0].host_path == f"{STATE}/ro" and v.mounts[1].host_path == LIB


@pytest.mark.parametrize(("image", "error"), [
    (GLIBC, None),
    (ImageFacts("/r", libc=None), None),  # not looked at: not checked
    (ImageFacts("/r", libc="musl"), "the image uses musl"),
    (ImageFacts("/r", libc="none"), "the image has no glibc dynamic loader"),
])
def test_the_image_must_honour_ld_so_preload(image: ImageFacts, error: str | None) -> None:
    env = {"CUDA_DEVICE_SM_LIMIT": "20"}
    if error is None:
        assert plan(env, [Selected(GPU)], image=image) is not None
        return
    with pytest.raises(RequestError, match=f"CUDA_DEVICE_SM_LIMIT is set but GPU limits cannot "
                                           f"be enforced in this container: {error}"):
        plan(env, [Selected(GPU)], image=image)


def test_discovery_s_errors_are_raised_only_for_a_limit() -> None:
    """A missing libvgpu, an unreadable key or image preload file: errors for a container
    with a limit only (discovery keeps them, the plan decides)."""
    missing = ConfigError("GPU limits need libvgpu.so")
    bad_key = RequestError("authority key is not owned by root")
    bad_preload = ImageFacts("/r", libc="glibc", preload_entries=SpecError("/r: a FIFO"))
    assert plan({}, [Selected(GPU)], library=missing, key=bad_key, image=bad_preload) is None
    with pytest.raises(ConfigError, match="libvgpu"):
        plan({"CUDA_DEVICE_SM_LIMIT": "20"}, [Selected(GPU)], library=missing)
    with pytest.raises(RequestError, match="not owned by root"):
        plan({}, [Selected(GPU)], vgpu_authority=share(("GPU-0000", G, 0)), key=bad_key)
    with pytest.raises(SpecError, match="a FIFO"):
        plan({"CUDA_DEVICE_SM_LIMIT": "20"}, [Selected(GPU)], image=bad_preload)


@pytest.mark.parametrize(("entries", "kept"), [
    ((), ()),
    (("/usr/lib/libfoo.so",), ("/usr/lib/libfoo.so",)),
    # libvgpu comes first and once; the image's own, each once, in their order
    (("/run/nvctk/libvgpu.so", "/a.so", "/b.so", "/a.so"), ("/a.so", "/b.so")),
])
def test_the_image_s_preload_entries_kept(entries: tuple[str, ...], kept: tuple[str, ...]) -> None:
    image = ImageFacts("/r", libc="glibc", preload_entries=entries)
    assert plan({"CUDA_DEVICE_SM_LIMIT": "20"}, [Selected(GPU)], image=image).preload_entries == kept
    assert kept_preload_entries("/run/nvctk/libvgpu.so", entries) == kept


def test_pins_and_seccomp_follow_the_vgpu() -> None:
    """The dirs the vGPU mounts land in are pinned (/run/nvctk, /etc/ld.so.preload), and a
    vGPU container gets the user-namespace seccomp rule; a plain GPU container neither."""
    v = plan({"CUDA_DEVICE_SM_LIMIT": "20"}, [Selected(GPU)],
             image=ImageFacts("/r", libc="glibc", root_readonly=True))
    assert vgpu_pins(v) == ("etc", "run") and vgpu_pins(None) == ()
    assert v.root_readonly is True
    with_vgpu = Edits("550", ("compute",), (), vgpu=v, pins=vgpu_pins(v), seccomp_block_userns=True)
    assert with_vgpu.seccomp_block_userns and with_vgpu.pins == ("etc", "run")


def test_a_dra_claims_vgpu_is_its_ledger_bound_as_a_containers_state() -> None:
    """A DRA share claim's vGPU part (its CDI spec's): the claim's ledger laid out as a
    container's state dir, so every container of the claim binds the same ro/limits and
    rw/cache (one cap), libvgpu and the preload read-only, and pins /etc and /run."""
    from nvctk.plan.vgpu import claim_vgpu

    ledger = "/run/nvctk/dra/c-1"
    v = claim_vgpu(LIB, ledger, {"CUDA_DEVICE_MEMORY_LIMIT_0": str(2 * G)})
    binds = {m.container_path: (m.host_path, m.read_only) for m in v.mounts}
    assert binds == {
        "/run/nvctk": (f"{ledger}/ro", True),
        "/run/nvctk/libvgpu.so": (LIB, True),
        "/run/nvctk/vgpu": (f"{ledger}/rw", False),
        "/run/nvctk/vgpu/limits": (f"{ledger}/ro/limits", True),
        "/run/nvctk/vgpu/cache": (f"{ledger}/rw/cache", False),
        "/etc/ld.so.preload": (f"{ledger}/ro/ld.so.preload", True)}
    assert all(m.required for m in v.mounts) and v.preload_entries == ()
    assert vgpu_pins(v) == ("etc", "run")
    # a device plugin share's mounts are its own state dir's
    plain = plan({}, [Selected(GPU)], vgpu_authority=share(("GPU-0000", G, 0)))
    assert {m.host_path for m in plain.mounts} >= {f"{STATE}/ro/limits", f"{STATE}/rw/cache"}


@pytest.mark.parametrize("devices", ["GPU-0000", "void"])
def test_an_old_dra_grant_in_the_env_never_gives_a_gpu(devices: str) -> None:
    """NVCTK_DRA_SHARE (a DRA share's grant before shares became plain CDI) is no longer
    read: a GPU container carrying one is refused rather than run uncapped; without a
    GPU it is nothing."""
    from nvctk.request.parse import request_from_spec

    spec = {"process": {"env": [f"NVIDIA_VISIBLE_DEVICES={devices}",
                                "NVCTK_DRA_SHARE=c-1 {}"]}}
    if devices == "void":
        assert request_from_spec(spec, CFG) is None
        return
    with pytest.raises(RequestError, match=r"^NVCTK_DRA_SHARE: a DRA share prepared by an nvctk "
                       r"dra-plugin older .* refused, it would run uncapped"):
        request_from_spec(spec, CFG)
