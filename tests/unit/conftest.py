"""Unit tests are plain data: they start no nvctk executable (nvctk, nvctk-runtime,
nvctk-hook or `python -m nvctk.cli...`); those belong in tests/integration. Python
subprocesses that import nvctk (import-cost checks) and other tools are fine."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from support.unitguard import SpawnsNvctk, nvctk_argv


@pytest.fixture(autouse=True)
def _no_nvctk_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        if nvctk_argv(args):
            raise SpawnsNvctk(f"a unit test started {args!r}: move it to tests/integration")
        real(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)
    yield
