"""How tests start the nvctk CLI: the venv's `nvctk` launcher beside this Python, or the
module when the launcher is not built."""

from __future__ import annotations

import os
import shutil
import sys


def nvctk_exe() -> list[str]:
    exe = shutil.which("nvctk", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "nvctk.cli.main"]
