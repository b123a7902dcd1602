"""Copies of the venv's compiled launchers whose python3 is a wrapper of the test's.

The launcher runs `<its bin>/python3 -I -S -c ...`, so a wrapper there sees every
Python start: it counts them (the passthrough must not start Python) and can add
interpreter flags that -I would otherwise drop from the environment (-X importtime).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
VENV_BIN = Path(sys.executable).parent
BASE_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
PYVER = f"python{sys.version_info[0]}.{sys.version_info[1]}"
NAMES = ("nvctk", "nvctk-hook", "nvctk-runtime")


def launcher(name: str) -> Path:
    exe = VENV_BIN / name
    if not exe.is_file() or exe.read_bytes()[:4] != b"\x7fELF":
        pytest.skip(f"{exe} is not the compiled launcher: run `make venv`")
    return exe


class Launchers:
    """tmp/venv/bin: the launchers and a recording python3; nvctk and its dependencies
    through an editable install's path file (the repo, then the venv's packages)."""

    def __init__(self, tmp: Path, python_flags: tuple[str, ...] = ()) -> None:
        self.bin = tmp / "venv" / "bin"
        self.site = tmp / "venv" / "lib" / PYVER / "site-packages"
        self.bin.mkdir(parents=True)
        self.site.mkdir(parents=True)
        deps = sysconfig.get_paths()["purelib"]
        (self.site / "__editable__.nvctk-9.9.9.pth").write_text(f"{REPO}\n{deps}\n")
        for name in NAMES:
            shutil.copy2(launcher(name), self.bin / name)
        self.starts = tmp / "python-starts"
        self.args = tmp / "python-args"  # the last start's, NUL-separated
        flags = " ".join(python_flags)
        (self.bin / "python3").write_text(
            f"#!/bin/sh\necho start >> '{self.starts}'\nprintf '%s\\0' \"$@\" > '{self.args}'\n"
            f"exec '{BASE_PYTHON}' {flags} \"$@\"\n")
        (self.bin / "python3").chmod(0o755)

    def python_starts(self) -> int:
        return len(self.starts.read_text().splitlines()) if self.starts.exists() else 0

    def last_args(self) -> list[str]:
        return self.args.read_bytes().decode().split("\0")[:-1]
