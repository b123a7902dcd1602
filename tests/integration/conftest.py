"""Fixtures shared by this directory's test modules."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nvctk.sim.host import SimHost
from support.runtime import RUNTIME, bundle_maker


# the bad-input tests' (test_runtime_bad_input_*.py): a bundle maker whose container
# echoes, and the real runc where the promise is about runc (GPU errors in its --log)
@pytest.fixture
def bundle(tmp_path: Path, rootfs: Callable[..., str]) -> Callable[..., Path]:
    return bundle_maker(tmp_path, rootfs, ["sh", "-c", "echo container-ran"])


@pytest.fixture
def real_runc(tmp_path: Path, sim_host: SimHost) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    root = tmp_path / "runc-root"
    ids: list[str] = []

    def run(b: Path, cid: str, config: str | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
        ids.append(cid)
        return subprocess.run(
            [RUNTIME, "--root", str(root), "--log", str(b / "runc-log.json"), "--log-format",
             "json", "run", "--bundle", str(b), cid],
            env={**os.environ, "NVCTK_CONFIG": config or sim_host.config_path},
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    yield run
    for cid in ids:
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid],
                       capture_output=True, timeout=60)
