"""fileio's one temp-file writer (write_temp) and the writers on top of it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nvctk.base import fileio


def test_the_temp_file_follows_like(tmp_path: Path) -> None:
    orig = tmp_path / "daemon.json"
    orig.write_bytes(b"{}")
    orig.chmod(0o600)
    tmp = Path(fileio.write_temp(str(tmp_path / "daemon.json.bak"), b"old", like=str(orig)))
    assert tmp.parent == tmp_path and tmp.read_bytes() == b"old"
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o600
    # no `like`: the target's own mode; none there: 0644; an explicit mode wins
    assert stat.S_IMODE(Path(fileio.write_temp(str(orig), b"x")).stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(fileio.write_temp(str(tmp_path / "new"), b"x")).stat().st_mode) \
        == 0o644
    assert stat.S_IMODE(Path(fileio.write_temp(str(orig), b"x", 0o640)).stat().st_mode) == 0o640


def test_atomic_write_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")
    target.chmod(0o640)
    fileio.atomic_write(str(target), b"new")
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    # a rename that fails (a directory in the way) takes its temp file with it
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"")
    with pytest.raises(OSError):
        fileio.atomic_write(str(tmp_path / "d"), b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]


def test_replace_regular_file_replaces_only_a_regular_file(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(fileio.NotRegularFile, match="a symbolic link"):
        fileio.replace_regular_file(str(link), b"x")
    assert link.is_symlink() and not (tmp_path / "elsewhere").exists()
    fileio.replace_regular_file(str(tmp_path / "out"), b"x")
    assert (tmp_path / "out").read_bytes() == b"x"


def test_read_path_refuses_a_fifo_without_waiting(tmp_path: Path) -> None:
    """A FIFO where a driver's /proc file is (make_proc_mask reads version, registry) is an
    error at once: a blocking open left the hook's worker, and the server waiting on it,
    for ever (test_driver_file_fifo_hangs_no_gpu_create's server outlived the test)."""
    import subprocess
    import sys

    os.mkfifo(tmp_path / "version")
    code = ("import sys; from nvctk.base.fileio import read_path\n"
            "try: read_path(sys.argv[1])\n"
            "except OSError as e: print(e.strerror)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "version")],
                         capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == "not a regular file", out
    assert fileio.read_path("/proc/self/mountinfo")  # a kernel file still reads
