"""What a unit test may not start: one of nvctk's executables (tests/unit/conftest.py
refuses it; such a test belongs in tests/integration)."""

from __future__ import annotations

import itertools
import os
from typing import Any

NVCTK_EXECUTABLES = frozenset({"nvctk", "nvctk-runtime", "nvctk-hook"})


class SpawnsNvctk(AssertionError):
    pass


def nvctk_argv(args: Any) -> bool:
    """Whether a Popen argv (a list, or one string) starts one of nvctk's executables."""
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = os.fsdecode(args).split()
    else:
        argv = [os.fsdecode(a) for a in args]
    if not argv:
        return False
    if os.path.basename(argv[0]) in NVCTK_EXECUTABLES:
        return True
    return any(a == "-m" and b.startswith("nvctk.cli") for a, b in itertools.pairwise(argv))
