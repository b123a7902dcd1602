"""One cap shared by many processes: concurrency and faults (SIGKILL mid
allocation, death while holding the accounting lock, slots keyed by pid and start time).
A hostile container and the accounting file: test_vgpu_concurrency_hostile.py."""

from __future__ import annotations

import contextlib
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
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

import support.concurrency as _concurrency
from nvctk.sim.state import read_state
from nvctk.vgpu import ledger
from support import wait
from support.concurrency import MIB

driver = _concurrency.driver  # fixture


def churn_env(driver: H.Driver, tmp_path: Path, cap: str = "256m") -> dict[str, str]:
    return {
        **driver.env(tmp_path / "state", NVSIM_CONTEXT_RESERVE_MIB="1"),
        "NVCTK_VGPU_CONTEXT_RESERVE": "1m",
        "CUDA_DEVICE_MEMORY_LIMIT": cap,
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache"),
        "LD_PRELOAD": str(H.LIB),
    }


def container_used(tmp_path: Path) -> int:
    return sum(u.used for u in ledger.read_usage(tmp_path / "cache").values())


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


def _wait_in_state(tmp_path: Path, procs: list[subprocess.Popen[Any]]) -> None:
    """Until the simulated driver has seen each of procs (a slot in its state: the
    process got as far as a context)."""
    seen: set[int] = set()

    def all_seen() -> bool:
        with contextlib.suppress(OSError, ValueError):
            seen.update(p.pid for p in read_state(tmp_path / "state").procs)
        for p in procs:
            assert p.poll() is None, f"{p.args} exited {p.returncode}"
        return seen >= {p.pid for p in procs}

    wait.until(all_seen, 30, "every process to get a context")


def test_sigkill_mid_allocation_leaks_nothing(driver: H.Driver, tmp_path: Path) -> None:
    env = churn_env(driver, tmp_path)
    rnd = random.Random(7)
    procs = [
        subprocess.Popen([str(H.STRESS), "churn", "100000000", "16", str(i)], env=env, stdout=subprocess.DEVNULL)
        for i in range(8)
    ]
    _wait_in_state(tmp_path, procs)  # every churner has a context: the kills land mid-run
    for p in procs:
        time.sleep(rnd.random() * 0.05)  # the kill's jitter: the test's (seeded) input
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
    _wait_in_state(tmp_path, [holder])  # churning: it takes the lock over and over
    out = subprocess.run([str(H.STRESS), "lockdie", str(tmp_path / "cache")], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "locked" and out.returncode == -signal.SIGKILL
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # a hang on the dead holder's lock fails here: the probe's own timeout
    r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB), timeout=20).stdout)
    assert int(r["fill"][0][1]) == 255 * MIB


def _start_time(pid: int) -> int:
    """/proc/<pid>/stat field 22, as libvgpu keys its slots."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        data = f.read()
    return int(data[data.rindex(")") + 2 :].split()[19])


def _plant_slot(cache: Path, uuid: str, slot: int, pid: int, start: int, pidns: int, used: int,
                mem_cap: int) -> None:
    """Writes a process slot claiming `used` bytes and a cap of `mem_cap` on `uuid`
    into an accounting file nobody has open (its lock untouched)."""
    fd = os.open(cache, os.O_RDWR)
    try:
        data = os.pread(fd, ledger.SHM_SIZE, 0)
        for e in range(ledger.MAX_DEV):
            off = ledger.DEVS_OFFSET + e * ledger._DEV.size
            dev = list(ledger._DEV.unpack_from(data, off))
            if dev[0].split(b"\0", 1)[0].decode() == uuid:
                break
        else:
            raise AssertionError(f"{uuid} not in {cache}")
        off_s = ledger.SLOTS_OFFSET + slot * ledger._SLOT.size
        assert struct.unpack_from("<i", data, off_s)[0] == 0, "slot taken"
        used_v = [0] * ledger.MAX_DEV
        cap_v = [0] * ledger.MAX_DEV
        used_v[e] = used
        cap_v[e] = mem_cap
        os.pwrite(fd, ledger._SLOT.pack(pid, 0, start, pidns, *used_v, *cap_v, *([0] * ledger.MAX_DEV), pid, 0), off_s)
        dev[1] += used
        dev[2] = mem_cap
        os.pwrite(fd, ledger._DEV.pack(*dev), off)
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
    process whose pid a live process has taken since is reclaimed (its stricter
    cap goes with it), not adopted; a live owner's slot is kept and its cap holds.
    The slot's lock byte is held throughout (as when the dead owner's accounting
    file descriptor lives on in a forked child), so pid and start time decide.
    The bytes a slot claims are never counted: usage lives in the lock ledger."""
    env = churn_env(driver, tmp_path, cap="1g")
    env.pop("LD_PRELOAD")
    cache = tmp_path / "cache"
    cap, strict = 1024 * MIB, 300 * MIB
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
        _plant_slot(cache, driver.uuids[0], 0, pid, start, pidns, 600 * MIB, strict)
        _ofd_lock(holder_fd, (1 << 30) + 0)  # VGPU_SLOT_LOCKBASE + slot
        assert container_used(tmp_path) == 0  # what the file claims is no usage
        r = H.parse(H.probe(env, "init", "ctx", "0", "meminfo", "fill", str(MIB)).stdout)
        limit = cap if reclaimed else strict  # libvgpu reaps when a process attaches
        assert int(r["meminfo"][0][2]) == limit
        assert int(r["fill"][0][1]) == limit - MIB  # the planted 600 MiB took nothing
        data = os.pread(holder_fd, ledger.SHM_SIZE, 0)
        assert ledger._SLOT.unpack_from(data, ledger.SLOTS_OFFSET)[0] == (0 if reclaimed else pid)
    finally:
        os.close(holder_fd)
        sleeper.kill()
        sleeper.wait()
