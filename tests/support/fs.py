"""A directory tree's contents and mtimes, to assert that something left it untouched."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def snapshot(path: Path) -> dict[str, tuple[bytes | str, int]]:
    """Bytes (or link targets) and mtimes of everything under path."""
    out: dict[str, tuple[bytes | str, int]] = {str(path): ("", os.lstat(path).st_mtime_ns)}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[p] = (os.readlink(p), st.st_mtime_ns)
            elif stat.S_ISREG(st.st_mode):
                out[p] = (Path(p).read_bytes(), st.st_mtime_ns)
            else:
                out[p] = ("dir", st.st_mtime_ns)
    return out
