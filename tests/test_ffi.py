"""nvctk.ffi against ctypes itself: the same types, layouts and calls."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvctk import ffi

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (ffi.c_int, ctypes.c_int),
        (ffi.c_uint, ctypes.c_uint),
        (ffi.c_long, ctypes.c_long),
        (ffi.c_ulong, ctypes.c_ulong),
        (ffi.c_uint64, ctypes.c_uint64),
        (ffi.c_size_t, ctypes.c_size_t),
        (ffi.c_char, ctypes.c_char),
        (ffi.c_char_p, ctypes.c_char_p),
        (ffi.c_void_p, ctypes.c_void_p),
    ],
)
def test_types_match_ctypes(ours: type, theirs: type) -> None:
    assert ffi.sizeof(ours) == ctypes.sizeof(theirs)
    assert ctypes.alignment(ours) == ctypes.alignment(theirs)
    assert ours._type_ == theirs._type_  # type: ignore[attr-defined]


def test_struct_layout_matches_ctypes() -> None:
    class Ours(ffi.Structure):
        _fields_ = [("a", ffi.c_uint64), ("b", ffi.c_int), ("rest", ffi.c_char * 13)]

    class Theirs(ctypes.Structure):
        _fields_ = [("a", ctypes.c_uint64), ("b", ctypes.c_int), ("rest", ctypes.c_char * 13)]

    assert ffi.sizeof(Ours) == ctypes.sizeof(Theirs)
    for name in ("a", "b", "rest"):
        assert getattr(Ours, name).offset == getattr(Theirs, name).offset


def test_syscall_returns_a_long() -> None:
    syscall = ffi.libc_function("syscall", ffi.c_long)
    assert syscall(ffi.c_long(39)) == os.getpid()  # SYS_getpid on x86_64


def test_errno_is_kept_for_get_errno(tmp_path: Path) -> None:
    umount2 = ffi.libc_function("umount2")
    assert umount2(ffi.c_char_p(str(tmp_path / "not-a-mount").encode()), ffi.c_int(0)) == -1
    assert ffi.get_errno() in (errno.EINVAL, errno.ENOENT)


def test_struct_filled_by_libc() -> None:
    class Statfs(ffi.Structure):
        _fields_ = [("f_type", ffi.c_long), ("_rest", ffi.c_char * 112)]

    buf = Statfs()
    fd = os.open("/proc", os.O_RDONLY)
    try:
        assert ffi.libc_function("fstatfs")(ffi.c_int(fd), ffi.byref(buf)) == 0
    finally:
        os.close(fd)
    assert buf.f_type == 0x9FA0  # PROC_SUPER_MAGIC


def test_importing_it_does_not_import_ctypes() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from nvctk import ffi; "
        "ffi.libc_function('syscall', ffi.c_long); print('ctypes' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
