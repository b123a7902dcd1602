"""What tests/integration/test_vgpu_concurrency*.py share: one simulated driver per module
with libvgpu built (support.libvgpu.driver_of)."""

from __future__ import annotations

import pytest

from support.libvgpu import H, driver_of

MIB = H.MIB


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    return driver_of(tmp_path_factory, "vgpu-conc")
