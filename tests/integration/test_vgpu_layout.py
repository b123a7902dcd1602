"""shm.h is the one source of the accounting file's and the ledger's layout:
nvctk.vgpu's view of it is compared with what a program compiled against shm.h
prints (offsetof, sizeof, constants), so any drift on either side fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.vgpu import ledger


def test_python_layout_is_shm_h() -> None:
    H.build()
    out = subprocess.run([str(H.BUILD / "vgpu_layout")], capture_output=True, text=True, check=True).stdout
    c = {}
    for line in out.splitlines():
        name, value = line.rsplit(" ", 1)
        c[name] = int(value)
    assert c == ledger.SHM_LAYOUT


def test_the_reader_uses_the_layout() -> None:
    """read_usage unpacks the device entries at the offsets the layout names."""
    assert ledger._DEV.size == ledger.SHM_LAYOUT["sizeof(struct vgpu_shm_dev)"]
    assert ledger.SHM_LAYOUT["sizeof(struct vgpu_shm)"] == ledger.SHM_SIZE
    assert ledger.SHM_LAYOUT["vgpu_shm.devs"] == ledger.DEVS_OFFSET
