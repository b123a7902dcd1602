"""One cap shared by many processes, against a hostile container: nothing done to the
accounting file, the limits file or the ledger's lock gets more memory or crashes anyone
(a full tmpfs fails closed); launches and cuInit touch the file as little as they can.
Concurrency and faults: test_vgpu_concurrency.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

import support.concurrency as _concurrency
from nvctk.sim.state import read_state
from nvctk.vgpu import ledger
from nvctk.vgpu import limits as vgpu
from support.concurrency import MIB

driver = _concurrency.driver  # fixture


# ---- a hostile container: nothing done to files gets more memory or crashes anyone ----

RESERVE = 64 * MIB  # libvgpu's default per-context reserve, the mock's too


def limits_env(driver: H.Driver, d: Path, cap: str = "512m", reserve: str | None = None) -> dict[str, str]:
    """A container's layout outside a container: the limits file (the ledger's
    file) and the accounting file beside it, in d."""
    values = {"CUDA_DEVICE_MEMORY_LIMIT_0": str(vgpu.parse_memory(cap))}
    if reserve is not None:
        values[vgpu.RESERVE_VAR] = str(vgpu.parse_memory(reserve))
    vgpu.write_limits_file(d / "limits", values, cache=str(d / "cache"))
    return {**driver.env(d / "state"), "NVCTK_VGPU_LIMITS_FILE": str(d / "limits"), "LD_PRELOAD": str(H.LIB)}


def _start_holder(env: dict[str, str], nbytes: int, after: list[str]) -> subprocess.Popen[str]:
    p = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "alloc", str(nbytes), "wait", *after], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    while line and "ready" not in line:
        line = p.stdout.readline()
    assert line, "the holder exited before holding its memory"
    return p


def _attack(cache: Path, how: str, uid: int) -> None:
    """What any process of the container can do to its accounting file."""
    code = {
        "zero": f"import os; fd = os.open({str(cache)!r}, os.O_WRONLY); os.pwrite(fd, bytes({ledger.SHM_SIZE}), 0)",
        "garbage": f"import os; fd = os.open({str(cache)!r}, os.O_WRONLY); os.pwrite(fd, os.urandom({ledger.SHM_SIZE}), 0)",
        "truncate": f"import os; os.truncate({str(cache)!r}, 0)",
        "replace": f"import os; open({str(cache) + '.new'!r}, 'wb').close(); os.rename({str(cache) + '.new'!r}, {str(cache)!r})",
    }[how]
    pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid else []
    subprocess.run([*pre, sys.executable, "-c", code], check=True, timeout=30)


@pytest.mark.parametrize("uid", [0, 1000])
@pytest.mark.parametrize("how", ["zero", "garbage", "truncate", "replace"])
def test_tampered_accounting_file_gets_no_memory_and_crashes_nobody(driver: H.Driver, how: str, uid: int) -> None:
    """A holds 300 MiB under a 512m cap; another process of the container (root,
    or uid 1000) zeroes, scribbles over, truncates or replaces the accounting
    file. B still gets only cap - 300 MiB - both contexts' reserves, and neither
    A nor B dies of a signal (the file was mmapped: truncation SIGBUSed them)."""
    d = Path(tempfile.mkdtemp(prefix="vgpu-tamper-"))
    try:
        d.chmod(0o777)  # uid 1000 may write and rename here, as in the container's accounting dir
        env = limits_env(driver, d)
        holder = _start_holder(env, 300 * MIB, ["alloc", str(MIB), "free", "meminfo"])
        try:
            _attack(d / "cache", how, uid)
            cp = H.probe(env, "init", "ctx", "0", "fill", str(MIB), "meminfo")
            assert cp.returncode == 0, cp.stderr
            r = H.parse(cp.stdout)
            assert int(r["fill"][0][1]) == 512 * MIB - 300 * MIB - 2 * RESERVE
            out, err = holder.communicate("\n", timeout=30)
            assert holder.returncode == 0, err  # not killed by SIGBUS
            rh = H.parse(out)
            assert rh["alloc"][0][0] == "0"  # A goes on allocating within the cap (B has gone)
        finally:
            holder.kill()
            holder.wait()
        # and the ledger shows nothing left once both are gone
        assert sum(ledger.read_ledger(d / "limits")) == 0
    finally:
        shutil.rmtree(d)


def test_usage_is_read_from_the_ledger_not_the_file(driver: H.Driver, tmp_path: Path) -> None:
    env = limits_env(driver, tmp_path)
    holder = _start_holder(env, 100 * MIB, [])
    try:
        _attack(tmp_path / "cache", "zero", 0)
        usage = ledger.read_usage(tmp_path / "cache", tmp_path / "limits")
        assert [u.used for u in usage.values()] == [RESERVE + 100 * MIB]  # "window-0": the UUIDs went
        assert ledger.read_ledger(tmp_path / "limits")[0] == RESERVE + 100 * MIB
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("short", [False, True])
def test_full_tmpfs_fails_closed_without_sigbus(driver: H.Driver, tmp_path: Path, short: bool) -> None:
    """The accounting file on a full tmpfs (new, or short: not preallocated):
    cuInit fails with a CUDA error and a message naming the file, no SIGBUS."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        cache = mnt / "cache"
        if short:
            cache.write_bytes(b"\0" * 100)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"x" * 4096)
        os.close(fd)
        env = {**driver.env(tmp_path / "state"), "CUDA_DEVICE_MEMORY_LIMIT": "512m",
               "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(cache)}
        cp = H.probe(env, "init", "ctx", "0", "alloc", str(MIB))
        assert cp.returncode == 0, cp.stderr  # no signal
        r = H.parse(cp.stdout)
        assert r["init"][0][0] != "0" and r["ctx"][0][0] != "0" and r["alloc"][0][0] != "0"
        assert str(cache) in cp.stderr and "cannot allocate" in cp.stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_killed_holder_lease_vanishes_at_once(driver: H.Driver, tmp_path: Path) -> None:
    env = limits_env(driver, tmp_path)
    holder = _start_holder(env, 300 * MIB, [])
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # a wait on the dead holder's lease fails here: the probe's own timeout
    r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB), timeout=5).stdout)
    assert int(r["fill"][0][1]) == 512 * MIB - RESERVE


def test_cap_exact_under_concurrency_with_a_limits_file(driver: H.Driver, tmp_path: Path) -> None:
    """The churn of test_32_processes_x_1000_never_exceed_the_cap, 16 processes,
    leases on a limits file: refusals happen and the driver never holds more than
    the cap; a newcomer then gets exactly the whole cap."""
    env = {**limits_env(driver, tmp_path, "256m", reserve="1m"), "NVSIM_CONTEXT_RESERVE_MIB": "1"}
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                live = read_state(tmp_path / "state", live_only=True).procs
                peak[0] = max(peak[0], sum(p.mem_used for p in live))
            time.sleep(0.001)

    t = threading.Thread(target=watch)
    t.start()
    procs = [subprocess.Popen([str(H.STRESS), "churn", "500", "16", str(i)], env=env, stdout=subprocess.PIPE,
                              text=True) for i in range(16)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    stop.set()
    t.join()
    assert [p.returncode for p in procs] == [0] * 16, outs
    assert sum(int(o.split()[2]) for o in outs) > 0, "the cap was never reached"
    assert 0 < peak[0] <= 256 * MIB
    r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB)).stdout)
    assert int(r["fill"][0][1]) == 255 * MIB
    assert sum(ledger.read_ledger(tmp_path / "limits")) == 0


def _in_container_paths(tmp_path: Path, limits: Path | None, *probe: str) -> subprocess.CompletedProcess[str]:
    """Runs the probe with libvgpu preloaded from /run/nvctk/libvgpu.so, in a
    mount namespace of its own where /run/nvctk is a fresh tmpfs (the limits
    file copied to /run/nvctk/vgpu/limits if given)."""
    script = (
        "set -e; mount --make-rprivate /; mount -t tmpfs tmpfs /run/nvctk; mkdir /run/nvctk/vgpu; "
        'touch /run/nvctk/libvgpu.so; mount --bind "$LIB" /run/nvctk/libvgpu.so; '
        + ('cp "$LIMITS" /run/nvctk/vgpu/limits; ' if limits else "")
        + 'LD_PRELOAD=/run/nvctk/libvgpu.so exec "$@"'
    )
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(H.PROBE), *probe], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "LIB": str(H.LIB), "LIMITS": str(limits or "")})


def test_hidden_limits_file_fails_closed(driver: H.Driver, tmp_path: Path) -> None:
    """Loaded from nvctk's container path without its limits file (hidden: a
    mount over it), libvgpu refuses to run rather than run uncapped; with the
    file in place the cap holds (the same setup works)."""
    os.makedirs("/run/nvctk", exist_ok=True)
    env = {k: v for k, v in driver.env(tmp_path / "state").items()}
    vgpu.write_limits_file(tmp_path / "limits", {"CUDA_DEVICE_MEMORY_LIMIT_0": str(256 * MIB)})
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        cp = _in_container_paths(tmp_path, tmp_path / "limits", "init", "ctx", "0", "fill", str(MIB))
        assert cp.returncode == 0, cp.stderr
        assert int(H.parse(cp.stdout)["fill"][0][1]) == 256 * MIB - RESERVE
        cp = _in_container_paths(tmp_path, None, "init", "ctx", "0", "alloc", str(MIB))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert cp.returncode == 0, cp.stderr
    r = H.parse(cp.stdout)
    assert r["init"][0][0] != "0" and r["alloc"][0][0] != "0"
    assert "/run/nvctk/vgpu/limits is missing" in cp.stderr


@pytest.mark.exclusive  # bounds an elapsed time
@pytest.mark.slow
def test_ledger_lock_held_forever_fails_closed(driver: H.Driver, tmp_path: Path) -> None:
    """A container process holding the ledger's flock forever (it can: flock
    works on its read-only descriptor) only makes its own container's CUDA
    calls fail, after 10 s, with a message; nothing hangs or runs uncapped."""
    env = limits_env(driver, tmp_path)
    locker = subprocess.Popen([str(H.STRESS), "lockhold", str(tmp_path / "limits")], stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        cp = H.probe(env, "init", "ctx", "0", "alloc", str(MIB), timeout=60)
        assert 9 < time.monotonic() - t0 < 30
        assert cp.returncode == 0, cp.stderr
        r = H.parse(cp.stdout)
        assert r["init"][0][0] != "0" and r["alloc"][0][0] != "0"
        assert "held by another process" in cp.stderr
    finally:
        locker.kill()
        locker.wait()


def _file_syscalls(env: dict[str, str], *args: str,
                   trace: tuple[str, ...] = ("pread64", "pwrite64")
                   ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Runs the probe under strace; returns it and its calls of `trace`, each line
    `PID call(...) = result`."""
    if not shutil.which("strace"):
        pytest.skip("needs strace")
    log = Path(tempfile.mkdtemp(prefix="vgpu-strace-")) / "log"
    try:
        cp = subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=" + ",".join(trace),
                             "-o", str(log), str(H.PROBE), *args],
                            env=env, capture_output=True, text=True, timeout=120)
        calls = [ln for ln in log.read_text().splitlines() if any(f"{t}(" in ln for t in trace)]
    finally:
        shutil.rmtree(log.parent)
    return cp, calls


def test_gated_launches_rarely_touch_the_accounting_file(driver: H.Driver, tmp_path: Path) -> None:
    """Under an SM limit a launch is gated on this process's slice of the token
    bucket: the file is read and written at most every 2 ms or when the slice runs
    out, not on every launch (each one took its lock, a read and a write: +5.5 us)."""
    env = {**driver.env(tmp_path / "state", NVSIM_KERNEL_US="0"), "CUDA_DEVICE_SM_LIMIT": "50",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache"), "LD_PRELOAD": str(H.LIB)}
    cp, calls = _file_syscalls(env, "init", "ctx", "0", "launch", "20000")
    assert cp.returncode == 0, cp.stderr
    assert H.parse(cp.stdout)["launch"][0] == ["0", "20000"]
    syncs = [c for c in calls if "pread64(" in c and c.endswith(", 2176, 0) = 2176")]  # header + devices
    assert 0 < len(syncs) < 2000, f"{len(syncs)} reads of the token bucket for 20000 launches"


def test_a_process_reads_its_own_start_time_from_its_task_entry(driver: H.Driver, tmp_path: Path) -> None:
    """cuInit keys this process's slot by its start time, read from
    /proc/<pid>/task/<pid>/stat: /proc/<pid>/stat of the reader's own process first
    brings its whole CPU time up to date, and a process whose time slice is spent is
    switched out right there (64 processes starting at once waited ~1 ms in it)."""
    env = {**driver.env(tmp_path / "state"), "CUDA_DEVICE_MEMORY_LIMIT": "256m",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache"), "LD_PRELOAD": str(H.LIB)}
    cp, calls = _file_syscalls(env, "init", trace=("open", "openat"))
    assert cp.returncode == 0, cp.stderr
    own = [(m[1], m[2], m[3]) for c in calls
           if (m := re.match(r'(\d+) +open(?:at)?\(.*"/proc/(\d+)(/task/\d+)?/stat"', c)) and m[1] == m[2]]
    assert own and all(task for _, _, task in own), own


def test_first_cuinit_reads_only_the_live_slots(driver: H.Driver, tmp_path: Path) -> None:
    """cuInit reads the header, the device entries and the slots below the high-
    water mark, not the whole 354 KiB file (twice: 64 processes starting together
    queued behind those reads); a forged low mark hides no live slot's lock."""
    env = {**driver.env(tmp_path / "state"), "CUDA_DEVICE_MEMORY_LIMIT": "256m",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache"), "LD_PRELOAD": str(H.LIB)}
    holder = _start_holder(env, MIB, [])
    try:
        cp, calls = _file_syscalls(env, "init")
        assert cp.returncode == 0, cp.stderr
        sizes = [int(c.rsplit("=", 1)[1]) for c in calls if "pread64(" in c]
        assert sizes and max(sizes) < 16384, sizes
        # a container process forges the mark down to 0: the holder keeps its slot
        # (its lock guards it), and a newcomer still attaches beside it
        fd = os.open(tmp_path / "cache", os.O_WRONLY)
        os.pwrite(fd, struct.pack("<I", 0), 16)
        os.close(fd)
        r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB)).stdout)
        assert int(r["fill"][0][1]) == 256 * MIB - MIB - 2 * 64 * MIB
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("content", ["zeros", "garbage"])
def test_initialising_the_file_writes_only_header_and_devices(driver: H.Driver, tmp_path: Path,
                                                              content: str) -> None:
    """The first process on a fresh (nvctk preallocates zeros) or overwritten file
    writes the header and the device entries (2 KiB), not all 354 KiB (0.6 ms of
    the first cuInit); the slots left as they were are never read as live, and
    the cap still holds for processes attaching after it."""
    cache = tmp_path / "cache"
    cache.write_bytes(bytes(ledger.SHM_SIZE) if content == "zeros" else os.urandom(ledger.SHM_SIZE))
    env = {**driver.env(tmp_path / "state"), "CUDA_DEVICE_MEMORY_LIMIT": "256m",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(cache), "LD_PRELOAD": str(H.LIB)}
    cp, calls = _file_syscalls(env, "init")
    assert cp.returncode == 0, cp.stderr
    writes = [int(c.rsplit("=", 1)[1]) for c in calls if "pwrite64(" in c]
    assert writes and max(writes) <= ledger.SLOTS_OFFSET, writes
    holder = _start_holder(env, 100 * MIB, [])
    try:
        r = H.parse(H.probe(env, "init", "ctx", "0", "fill", str(MIB)).stdout)
        assert int(r["fill"][0][1]) == 256 * MIB - 100 * MIB - 2 * 64 * MIB
    finally:
        holder.kill()
        holder.wait()
