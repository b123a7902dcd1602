"""libvgpu's own test harness (libvgpu/tests/harness.py: the library built, a simulated
driver of its own) for nvctk's tests of libvgpu."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H


def driver_of(factory: pytest.TempPathFactory, name: str) -> H.Driver:
    """libvgpu built and a simulated driver of 1 GPU of 8 GiB; skips without root."""
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    H.build()
    return H.make_driver(factory.mktemp(name), gpus=1, memory_mib=8192)
