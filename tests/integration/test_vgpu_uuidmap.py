"""libvgpu maps CUDA devices to the container's GPUs by the UUIDs the limits file
names (NVCTK_VGPU_UUID_<i>, written by the host, read-only in the container), so
its first cuInit need not load NVML; without them NVML's order is used. The
environment cannot set them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

MIB = 1 << 20
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (device nodes)")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    H.build()
    return H.make_driver(tmp_path_factory.mktemp("uuidmap") / "sim", gpus=2, memory_mib=4096)


def totals(env: dict[str, str]) -> tuple[int, list[int]]:
    cp = H.probe(env, "init", "totalmem", "0", "totalmem", "1")
    r = H.parse(cp.stdout)
    rc = int(r["init"][0][0])
    return rc, [int(v[1]) // MIB for v in r.get("totalmem", [])]


def limits(tmp_path: Path, *lines: str) -> dict[str, str]:
    f = tmp_path / "limits"
    f.write_text("\n".join(["CUDA_DEVICE_MEMORY_LIMIT_0=256m", "CUDA_DEVICE_MEMORY_LIMIT_1=512m", *lines]) + "\n")
    return {"NVCTK_VGPU_LIMITS_FILE": str(f)}


def test_the_limits_files_uuids_decide_the_mapping(driver: H.Driver, tmp_path: Path) -> None:
    """The file says container GPU 0 is NVML's second GPU: its cap follows the UUID."""
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     **limits(tmp_path, f"NVCTK_VGPU_UUID_0={driver.uuids[1]}", f"NVCTK_VGPU_UUID_1={driver.uuids[0]}"))
    assert totals(env) == (0, [512, 256])


def test_without_uuids_nvml_order_is_used(driver: H.Driver, tmp_path: Path) -> None:
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), **limits(tmp_path))
    assert totals(env) == (0, [256, 512])


def test_a_device_the_file_does_not_name_gets_the_strictest_cap(driver: H.Driver, tmp_path: Path) -> None:
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     **limits(tmp_path, f"NVCTK_VGPU_UUID_1={driver.uuids[0]}"))
    assert totals(env) == (0, [512, 256])  # device 1 is unnamed: the strictest, 256m
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     **limits(tmp_path, f"NVCTK_VGPU_UUID_0={driver.uuids[1]}"))
    assert totals(env) == (0, [256, 256])


def test_the_environment_cannot_remap(driver: H.Driver, tmp_path: Path) -> None:
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     CUDA_DEVICE_MEMORY_LIMIT_0="256m", CUDA_DEVICE_MEMORY_LIMIT_1="512m",
                     NVCTK_VGPU_UUID_0=driver.uuids[1], NVCTK_VGPU_UUID_1=driver.uuids[0])
    assert totals(env) == (0, [256, 512])


@pytest.mark.parametrize("value", ["", "GPU 1", "GPU-" + "a" * 80, "GPU-1;x"])
def test_a_malformed_uuid_fails_closed(driver: H.Driver, tmp_path: Path, value: str) -> None:
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     **limits(tmp_path, f"NVCTK_VGPU_UUID_0={value}"))
    cp = H.probe(env, "init")
    assert H.parse(cp.stdout)["init"][0][0] == "1", cp.stdout + cp.stderr  # CUDA_ERROR_INVALID_VALUE
    assert "NVCTK_VGPU_UUID_0" in cp.stderr


@pytest.mark.parametrize("with_file", [False, True], ids=["env-only", "limits-file"])
def test_nvml_calling_its_own_entry_points_does_not_deadlock(
        driver: H.Driver, tmp_path: Path, with_file: bool) -> None:
    """Seen on a real driver (580, H100): its nvmlInit_v2 and nvmlInit call nvmlInitWithFlags
    by its exported name, which the preload binds to libvgpu's wrapper. Entering the wrapper
    from inside libvgpu's own NVML resolution (the env-only cuInit maps GPUs through NVML)
    waited on that resolution forever: cuInit and nvidia-smi hung. The simulated NVML now
    makes the same inner call; every way in must return, capped."""
    extra = limits(tmp_path) if with_file else {"CUDA_DEVICE_MEMORY_LIMIT_0": "256m",
                                                "CUDA_DEVICE_MEMORY_LIMIT_1": "512m"}
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), **extra)
    assert totals(env) == (0, [256, 512])  # cuInit first: libvgpu resolves NVML itself
    cp = H.probe(env, "nvmlmem", "1", timeout=20)  # nvmlInit_v2 first: the inner call
    assert cp.returncode == 0, cp.stderr
    assert H.parse(cp.stdout)["nvmlmem"][0][:2] == ["0", str(512 * MIB)]
    smi = subprocess.run([str(driver.root / "bin" / "nvidia-smi"), "--query-gpu=memory.total",
                          "--format=csv,noheader"], env={**env, "LD_PRELOAD": str(H.LIB)},
                         capture_output=True, text=True, timeout=20)
    assert smi.returncode == 0, smi.stderr
    assert smi.stdout.split() == ["256", "MiB", "512", "MiB"]
