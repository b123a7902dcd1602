"""A directory tree's contents and mtimes, to assert that something left it untouched."""

from __future__ import annotations

import os
import socket
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


def plant(path: Path, kind: str) -> None:
    """Make path a file system object of kind (chardev, blockdev, fifo, dir, symlink,
    socket): what an operator may have at a path nvctk writes."""
    if kind == "chardev":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # as /dev/null
    elif kind == "blockdev":
        os.mknod(path, 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
        (path / "keep").write_text("the operator's\n")
    elif kind == "symlink":
        (path.parent / "target").write_text("the operator's\n")
        path.symlink_to(path.parent / "target")
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()


def node_id(path: Path) -> tuple[int, int, int, list[str] | None]:
    """What must not change when nvctk refuses to replace path."""
    st = os.lstat(path)
    return (st.st_mode, st.st_ino, st.st_rdev,
            sorted(os.listdir(path)) if stat.S_ISDIR(st.st_mode) else None)
