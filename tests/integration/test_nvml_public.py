"""nvctk.host.nvml uses pynvml through its public names only: it neither
stands a fake ctypes.util into sys.modules nor clears pynvml's private cache, and a
process can still ask several driver roots (each library gets its own pynvml)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from nvctk.host import nvml
from nvctk.sim import host

REPO = Path(__file__).resolve().parents[2]


class _Recording(dict):  # type: ignore[type-arg]
    cleared = 0

    def clear(self) -> None:
        type(self).cleared += 1
        super().clear()


def test_private_function_cache_is_never_cleared(
    sim_host: host.SimHost, make_sim: Callable[..., host.SimHost],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = make_sim(gpus=1, driver_version="535.104.05", cuda_version="12.2")
    monkeypatch.setattr(nvml.pynvml, "_nvmlGetFunctionPointer_cache", _Recording())
    a = nvml.query_host(sim_host.root)
    b = nvml.query_host(other.root)
    assert nvml.query_host(sim_host.root) == a and b.driver_version == "535.104.05"
    assert _Recording.cleared == 0
    # each library path is bound to one pynvml module, never swapped under it
    mods = {id(mod) for mod, _lib in nvml._bound.values()}
    assert len(mods) == len(nvml._bound) >= 2


def test_import_leaves_sys_modules_alone() -> None:
    """pynvml got the real ctypes.util (the old stand-in saved its import on a cache miss)."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import nvctk.host.nvml, ctypes.util; "
            "print(ctypes.util.__file__, nvctk.host.nvml.pynvml.find_library is "
            "ctypes.util.find_library)")
    r = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    path, same = r.stdout.split()
    assert path.endswith("ctypes/util.py") and same == "True"
