"""One cap shared by many processes: concurrency and faults (SIGKILL mid
allocation, death while holding the accounting lock)."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libvgpu" / "tests"))
import harness as H

from nvctk import vgpu
from nvctk.sim.state import read_state

MIB = H.MIB


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    H.build()
    return H.make_driver(tmp_path_factory.mktemp("vgpu-conc"), gpus=1, memory_mib=8192)


def churn_env(driver: H.Driver, tmp_path: Path, cap: str = "256m") -> dict[str, str]:
    return {
        **driver.env(tmp_path / "state", NVSIM_CONTEXT_RESERVE_MIB="1"),
        "NVCTK_VGPU_CONTEXT_RESERVE": "1m",
        "CUDA_DEVICE_MEMORY_LIMIT": cap,
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache"),
        "LD_PRELOAD": str(H.LIB),
    }


def container_used(tmp_path: Path) -> int:
    return sum(u.used for u in vgpu.read_usage(tmp_path / "cache").values())


def test_32_processes_x_1000_never_exceed_the_cap(driver: H.Driver, tmp_path: Path) -> None:
    env = churn_env(driver, tmp_path)
    cap = 256 * MIB
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        # the GPU memory the container's live processes hold, as the mock counts
        # it (an exited process's context stays charged until the mock reaps it)
        while not stop.is_set():
            try:
                live = read_state(tmp_path / "state", live_only=True).procs
                peak[0] = max(peak[0], sum(p.mem_used for p in live))
            except (OSError, ValueError):
                pass
            time.sleep(0.001)

    t = threading.Thread(target=watch)
    t.start()
    procs = [
        subprocess.Popen([str(H.STRESS), "churn", "1000", "16", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(32)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    stop.set()
    t.join()
    assert [p.returncode for p in procs] == [0] * 32, outs
    refused = sum(int(o.split()[2]) for o in outs)
    assert refused > 0, "the cap was never reached: the test proves nothing"
    assert 0 < peak[0] <= cap
    assert container_used(tmp_path) == 0
    assert sum(p.mem_used for p in read_state(tmp_path / "state", live_only=True).procs) == 0


def test_sigkill_mid_allocation_leaks_nothing(driver: H.Driver, tmp_path: Path) -> None:
    env = churn_env(driver, tmp_path)
    rnd = random.Random(7)
    procs = [
        subprocess.Popen([str(H.STRESS), "churn", "100000000", "16", str(i)], env=env, stdout=subprocess.DEVNULL)
        for i in range(8)
    ]
    time.sleep(0.5)
    for p in procs:
        time.sleep(rnd.random() * 0.05)
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
    # the dead members' usage is reclaimed: a newcomer gets the whole cap
    env.pop("LD_PRELOAD")
    r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB)).stdout)
    assert int(r["fill"][0][1]) == 255 * MIB
    assert container_used(tmp_path) == 0


def test_death_holding_the_lock_hangs_nobody(driver: H.Driver, tmp_path: Path) -> None:
    env = churn_env(driver, tmp_path)
    env.pop("LD_PRELOAD")
    assert H.probe(env, "init").returncode == 0  # creates the accounting file
    holder = subprocess.Popen([str(H.STRESS), "churn", "100000000", "16", "1"], env={**env, "LD_PRELOAD": str(H.LIB)},
                              stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    out = subprocess.run([str(H.STRESS), "lockdie", str(tmp_path / "cache")], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "locked" and out.returncode == -signal.SIGKILL
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    t0 = time.monotonic()
    r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB), timeout=20).stdout)
    assert time.monotonic() - t0 < 10
    assert int(r["fill"][0][1]) == 255 * MIB


def _start_time(pid: int) -> int:
    """/proc/<pid>/stat field 22, as libvgpu keys its slots."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        data = f.read()
    return int(data[data.rindex(")") + 2 :].split()[19])


def _plant_slot(cache: Path, uuid: str, slot: int, pid: int, start: int, pidns: int, used: int) -> None:
    """Writes a process slot holding `used` bytes on `uuid` into an accounting
    file nobody has open (its lock untouched), with the device total to match."""
    fd = os.open(cache, os.O_RDWR)
    try:
        data = os.pread(fd, vgpu.SHM_SIZE, 0)
        for e in range(vgpu.MAX_DEV):
            off = vgpu.DEVS_OFFSET + e * vgpu._DEV.size
            dev = list(vgpu._DEV.unpack_from(data, off))
            if dev[0].split(b"\0", 1)[0].decode() == uuid:
                break
        else:
            raise AssertionError(f"{uuid} not in {cache}")
        off_s = vgpu.SLOTS_OFFSET + slot * vgpu._SLOT.size
        assert struct.unpack_from("<i", data, off_s)[0] == 0, "slot taken"
        used_v = [0] * vgpu.MAX_DEV
        cap_v = [0] * vgpu.MAX_DEV
        used_v[e] = used
        cap_v[e] = dev[2]  # the container's cap: the slot makes nothing stricter
        os.pwrite(fd, vgpu._SLOT.pack(pid, 0, start, pidns, *used_v, *cap_v, *([0] * vgpu.MAX_DEV), pid), off_s)
        dev[1] += used
        os.pwrite(fd, vgpu._DEV.pack(*dev), off)
    finally:
        os.close(fd)


def _ofd_lock(fd: int, byte: int) -> None:
    """An open-file-description write lock on one byte, as a slot's owner holds."""
    f_ofd_setlk = getattr(fcntl, "F_OFD_SETLK", 37)
    fcntl.fcntl(fd, f_ofd_setlk, struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))


@pytest.mark.parametrize(
    "owner,reclaimed",
    [
        ("pid-reused", True),  # a live process has the pid now: another start time
        ("dead", True),
        ("live", False),  # the slot's own process, alive
        ("other-pidns", False),  # a pid of another namespace cannot be checked here
    ],
)
def test_slots_are_keyed_by_pid_and_start_time(driver: H.Driver, tmp_path: Path, owner: str, reclaimed: bool) -> None:
    """A slot is its process's by pid *and* start time: a slot left by a dead
    process whose pid a live process has taken since is reclaimed (its usage
    credited back), not adopted; a live owner's slot is kept. The slot's lock
    byte is held throughout (as when the dead owner's accounting file
    descriptor lives on in a forked child), so pid and start time decide."""
    env = churn_env(driver, tmp_path, cap="1g")
    env.pop("LD_PRELOAD")
    cache = tmp_path / "cache"
    cap, stale = 1024 * MIB, 300 * MIB
    assert H.probe(env, "init").returncode == 0  # creates the accounting file (device entry included)
    sleeper = subprocess.Popen(["sleep", "60"])
    holder_fd = os.open(cache, os.O_RDWR)
    try:
        pid, start = sleeper.pid, _start_time(sleeper.pid)
        pidns = os.stat("/proc/self/ns/pid").st_ino
        if owner == "pid-reused":
            start += 1
        elif owner == "dead":
            sleeper.kill()
            sleeper.wait()
        elif owner == "other-pidns":
            start, pidns = start + 1, pidns + 1
        _plant_slot(cache, driver.uuids[0], 0, pid, start, pidns, stale)
        _ofd_lock(holder_fd, (1 << 30) + 0)  # VGPU_SLOT_LOCKBASE + slot
        if owner == "live":
            assert container_used(tmp_path) == stale  # read_usage counts it too
        elif owner != "other-pidns":
            assert container_used(tmp_path) == 0
        r = H.parse(H.probe(env, "init", "ctx", "0", "meminfo", "fill", str(MIB)).stdout)
        left = 0 if reclaimed else stale
        assert int(r["meminfo"][0][1]) == cap - MIB - left  # libvgpu reaps when a process attaches
        assert int(r["fill"][0][1]) == cap - MIB - left
        data = os.pread(holder_fd, vgpu.SHM_SIZE, 0)
        assert vgpu._SLOT.unpack_from(data, vgpu.SLOTS_OFFSET)[0] == (0 if reclaimed else pid)
        devs = [vgpu._DEV.unpack_from(data, vgpu.DEVS_OFFSET + e * vgpu._DEV.size) for e in range(vgpu.MAX_DEV)]
        assert sum(d[1] for d in devs) == left  # the device total too, after the probe left
    finally:
        os.close(holder_fd)
        sleeper.kill()
        sleeper.wait()
