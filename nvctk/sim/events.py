"""NVML events on the simulated host: inject an XID that the mock NVML's event
sets (nvmlEventSetWait_v2) report, as a real driver reports a GPU fault.

The mock reads fixed 24-byte records from the events file beside the shared
state file (csrc/nvml_mock.c, "event sets"); an append of one record is atomic
(O_APPEND, one write), so concurrent injectors and readers never see half a record.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

EVENTS_REL = "run/nvidia-sim/events"  # under the sim dir, beside state.STATE_REL
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of a whole-GPU event
_REC = struct.Struct("<4IQ")  # gpu, gi, ci, pad, xid


def events_path(sim_root: str | os.PathLike[str]) -> Path:
    return Path(sim_root) / EVENTS_REL


def inject_xid(sim_root: str | os.PathLike[str], gpu: int, xid: int,
               gpu_instance: int | None = None, compute_instance: int | None = None) -> None:
    """Raise XID `xid` on topology GPU `gpu` (on one MIG instance when gpu_instance
    is given) for every event set of the sim at sim_root created before now."""
    if not 0 <= gpu < 1 << 32 or not 0 <= xid < 1 << 64:
        raise ValueError(f"gpu {gpu} / xid {xid} out of range")
    gi = NO_INSTANCE if gpu_instance is None else gpu_instance
    ci = NO_INSTANCE if compute_instance is None else compute_instance
    path = events_path(sim_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, _REC.pack(gpu, gi, ci, 0, xid))
    finally:
        os.close(fd)
