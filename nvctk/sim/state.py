"""Read the simulated GPUs' shared state file (csrc/nvsim_state.h) from Python.

The mocks (libcuda, libnvidia-ml) keep per-GPU memory and kernel counters and a
slot per process in one mmapped file; tests read it to check what happened on
the "GPU". The layout mirrors the C structs for x86-64 glibc, where
pthread_mutex_t is 40 bytes; tests/integration/test_sim_nvml_state.py compares OFFSETS with
offsetof() from a compiled program.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x4E565349
VERSION = 4
MAX_GPUS = 16
MAX_PROCS = 1280
STATE_REL = "run/nvidia-sim/state"  # under the sim dir
STATE_CONTAINER = "/run/nvidia-sim/state"
MUTEX_SIZE = 40  # sizeof(pthread_mutex_t), x86-64 glibc
# a slot's owner holds an OFD write lock on byte LOCK_BASE + slot (nvsim_state.c)
LOCK_BASE = 1 << 30

_HEADER = struct.Struct(f"<4I{MUTEX_SIZE}x")  # magic, version, ngpus, nprocs, lock
# run_lock, mem_total, mem_used, busy_ns, kernels, last_busy_end_ns,
# window_start_ns, window_busy_ns, last_util_pct, _pad
_GPU = struct.Struct(f"<{MUTEX_SIZE}x7Q2I")
# pid, gpu, start_time, mem_used, busy_ns, kernels, host_pid, _pad, pidns
_PROC = struct.Struct("<iI4QiIQ")

# per-process utilization history (struct nvsim_hist): last, period[HIST], busy[HIST]
HIST = 128
HIST_PERIOD_NS = 100_000_000
_HIST_SIZE = 8 + 2 * 8 * HIST

GPUS_OFFSET = _HEADER.size
PROCS_OFFSET = GPUS_OFFSET + MAX_GPUS * _GPU.size
HIST_OFFSET = PROCS_OFFSET + MAX_PROCS * _PROC.size
STATE_SIZE = HIST_OFFSET + MAX_PROCS * _HIST_SIZE

# offsetof() of the C fields, for the layout test
OFFSETS: dict[str, int] = {
    "sizeof(struct nvsim_state)": STATE_SIZE,
    "sizeof(struct nvsim_gpu)": _GPU.size,
    "sizeof(struct nvsim_proc)": _PROC.size,
    "nvsim_state.lock": 16,
    "nvsim_state.gpus": GPUS_OFFSET,
    "nvsim_state.procs": PROCS_OFFSET,
    "nvsim_state.hist": HIST_OFFSET,
    "sizeof(struct nvsim_hist)": _HIST_SIZE,
    "nvsim_gpu.mem_total": MUTEX_SIZE,
    "nvsim_gpu.mem_used": MUTEX_SIZE + 8,
    "nvsim_gpu.busy_ns": MUTEX_SIZE + 16,
    "nvsim_gpu.kernels": MUTEX_SIZE + 24,
    "nvsim_gpu.last_busy_end_ns": MUTEX_SIZE + 32,
    "nvsim_gpu.window_start_ns": MUTEX_SIZE + 40,
    "nvsim_gpu.window_busy_ns": MUTEX_SIZE + 48,
    "nvsim_gpu.last_util_pct": MUTEX_SIZE + 56,
    "nvsim_proc.pid": 0,
    "nvsim_proc.gpu": 4,
    "nvsim_proc.start_time": 8,
    "nvsim_proc.mem_used": 16,
    "nvsim_proc.busy_ns": 24,
    "nvsim_proc.kernels": 32,
    "nvsim_proc.host_pid": 40,
    "nvsim_proc.pidns": 48,
}


class StateError(ValueError):
    """The file is not a sim state file of this layout version."""


@dataclass(frozen=True)
class GpuState:
    index: int  # topology index
    mem_total: int  # bytes
    mem_used: int  # bytes, all processes
    busy_ns: int  # total kernel time
    kernels: int
    last_busy_end_ns: int  # CLOCK_MONOTONIC
    window_start_ns: int
    window_busy_ns: int
    last_util_pct: int


@dataclass(frozen=True)
class ProcSlot:
    slot: int
    pid: int  # the owner's pid, in its own pid namespace
    host_pid: int  # first NSpid entry (the host's pid when its /proc showed it)
    gpu: int  # topology index
    mem_used: int  # bytes
    busy_ns: int
    kernels: int
    start_time: int  # clock ticks since boot
    pidns: int  # inode of the owner's pid namespace


@dataclass(frozen=True)
class SimState:
    gpus: tuple[GpuState, ...]
    procs: tuple[ProcSlot, ...]  # used slots only (a dead owner's stays until reaped)

    def procs_on(self, gpu: int) -> list[ProcSlot]:
        return [p for p in self.procs if p.gpu == gpu]

    def proc(self, pid: int, gpu: int | None = None) -> ProcSlot | None:
        """The slot of `pid` (on `gpu` when given), matching pid or host_pid."""
        for p in self.procs:
            if pid in (p.pid, p.host_pid) and (gpu is None or p.gpu == gpu):
                return p
        return None


def state_path(sim_root: str | os.PathLike[str]) -> Path:
    """Where the mocks of the sim at sim_root keep their state on the host."""
    return Path(sim_root) / STATE_REL


def parse_state(data: bytes) -> SimState:
    if len(data) < STATE_SIZE:
        raise StateError(f"state file is {len(data)} bytes, expected {STATE_SIZE}")
    magic, version, ngpus, nprocs = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise StateError(
            f"not a sim state file of version {VERSION} (magic {magic:#x}, v{version})"
        )
    if ngpus > MAX_GPUS or nprocs != MAX_PROCS:
        raise StateError(f"bad state header: ngpus={ngpus} nprocs={nprocs}")
    gpus = []
    for i in range(ngpus):
        v = _GPU.unpack_from(data, GPUS_OFFSET + i * _GPU.size)
        gpus.append(GpuState(i, *v[:8]))
    procs = []
    for i in range(MAX_PROCS):
        pid, gpu, start, mem, busy, kernels, host_pid, _pad, pidns = _PROC.unpack_from(
            data, PROCS_OFFSET + i * _PROC.size
        )
        if pid:
            procs.append(ProcSlot(i, pid, host_pid, gpu, mem, busy, kernels, start, pidns))
    return SimState(tuple(gpus), tuple(procs))


def _slot_alive(fd: int, slot: int) -> bool:
    # struct flock on x86-64: l_type, l_whence (short), l_start, l_len (off_t), l_pid (int)
    req = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, LOCK_BASE + slot, 1, 0)
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, req)
    return struct.unpack("hhqqi4x", res)[0] != fcntl.F_UNLCK


def read_state(path: str | os.PathLike[str], live_only: bool = False) -> SimState:
    """A snapshot of the state file (fields are read without the C lock, so a
    concurrent update may show half-done; each field itself is whole).

    Slots of dead processes stay in the file until a mock reaps them (NVML does on
    every memory or process query); live_only=True leaves them out, judging
    liveness as the mocks do, by the owner's lock on its slot."""
    with open(path, "rb") as f:
        snap = parse_state(f.read(STATE_SIZE))
        if not live_only:
            return snap
        procs = tuple(p for p in snap.procs if _slot_alive(f.fileno(), p.slot))
    return SimState(snap.gpus, procs)
