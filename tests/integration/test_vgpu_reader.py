"""nvctk.vgpu.state.read_container_usage: a container's usage per device and per
process, read from the host. Memory comes from the kernel's lock table (each
process's leases, seen in /proc/<pid>/fdinfo), so a forged accounting file
changes only the fields the records mark as the container's own claim."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.vgpu import ledger
from nvctk.vgpu import state as vgpu_state

MIB = H.MIB
RESERVE = 64 * MIB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (device nodes, other processes' fdinfo)")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    H.build()
    return H.make_driver(tmp_path_factory.mktemp("vgpu-reader"), gpus=2, memory_mib=4096)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A state dir laid out as nvctk.vgpu.state makes it: ro/limits, rw/cache."""
    (tmp_path / "ro").mkdir()
    (tmp_path / "rw").mkdir()
    (tmp_path / "ro" / "limits").write_text(
        f"CUDA_DEVICE_MEMORY_LIMIT=536870912\nCUDA_DEVICE_SM_LIMIT=50\n"
        f"CUDA_DEVICE_MEMORY_SHARED_CACHE={tmp_path / 'rw' / 'cache'}\n")
    return tmp_path


@pytest.fixture
def holders(driver: H.Driver, state: Path, tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    env = driver.env(tmp_path / "sim", NVCTK_VGPU_LIMITS_FILE=str(state / "ro" / "limits"), LD_PRELOAD=str(H.LIB))
    procs = []
    for args in (["ctx", "0", "alloc", str(100 * MIB)], ["ctx", "1", "alloc", str(50 * MIB)]):
        p = subprocess.Popen([str(H.PROBE), "init", *args, "launch", "3", "wait"], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(p)
        assert p.stdout is not None
        out = []
        for line in p.stdout:
            out.append(line)
            if line.startswith("ready"):
                break
        assert any(x.startswith("alloc 0") for x in out), out
    try:
        yield procs
    finally:
        for p in procs:
            p.communicate("\n", timeout=30)


def test_devices_and_processes(driver: H.Driver, state: Path, holders: list[subprocess.Popen[str]]) -> None:
    recs = vgpu_state.read_container_usage(state)
    devs = {r.window: r for r in recs if r.kind == "device"}
    procs = {(r.pid, r.window): r.memory for r in recs if r.kind == "process"}
    p0, p1 = (p.pid for p in holders)
    # near the cap no slack is leased: the leases are exactly the bytes held
    assert procs == {(p0, 0): RESERVE + 100 * MIB, (p1, 1): RESERVE + 50 * MIB}
    assert devs[0].memory == RESERVE + 100 * MIB and devs[1].memory == RESERVE + 50 * MIB
    assert devs[0].uuid == driver.uuids[0] and devs[1].uuid == driver.uuids[1]
    assert devs[0].mem_cap == 512 * MIB and devs[0].sm_pct == 50
    assert devs[0].claimed == ledger.UsageRecord.CLAIMED
    assert all(r.claimed == () for r in recs if r.kind == "process")


@pytest.mark.parametrize("forgery", ["zeros", "garbage", "truncated", "replaced-by-fifo"])
def test_a_forged_accounting_file_changes_only_claims(state: Path, holders: list[subprocess.Popen[str]],
                                                      forgery: str) -> None:
    before = [r for r in vgpu_state.read_container_usage(state) if r.kind == "process"]
    cache = state / "rw" / "cache"
    if forgery == "zeros":
        cache.write_bytes(bytes(ledger.SHM_SIZE))
    elif forgery == "garbage":
        cache.write_bytes(os.urandom(ledger.SHM_SIZE))
    elif forgery == "truncated":
        cache.write_bytes(b"")
    else:
        cache.unlink()
        os.mkfifo(cache)
    recs = vgpu_state.read_container_usage(state)
    assert [r for r in recs if r.kind == "process"] == before
    devs = [r for r in recs if r.kind == "device"]
    assert sorted(r.memory for r in devs) == sorted(r.memory for r in before)
    assert all(r.claimed == () for r in devs)
