"""nvctk._sys (nvctk/_sys.c): the compiled syscall module of the hook and the runtime.

Each wrapper is called for real; the ones that change the mount namespace run in a
child python that unshares its own first, so this process's mounts never change.
"""

from __future__ import annotations

import errno
import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nvctk import _sys
from nvctk.base import mounts
from nvctk.hook import mount

REPO = Path(__file__).resolve().parents[2]
ROOT = os.geteuid() == 0


def _child(code: str) -> dict[str, object]:
    """Run code (which fills `out`) in a fresh python -I -S; returns out."""
    script = (f"import json, os, sys\nsys.path.insert(0, {str(REPO)!r})\n"
              "from nvctk import _sys\nfrom nvctk.base import mounts\nfrom nvctk.hook import mount\nout = {}\n" + textwrap.dedent(code)
              + "\nprint(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def _status_text(field: str) -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split()[1]
    raise AssertionError(field)


def _status(field: str) -> int:
    return int(_status_text(field), 16)


# --- it is the compiled module, and nothing slower stands in for it ------------------


def test_sys_is_a_compiled_extension_module() -> None:
    """No pure-Python fallback exists: nvctk._sys is the C extension built from _sys.c."""
    spec = _sys.__spec__
    assert spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)
    assert _sys.__file__ is not None
    assert _sys.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert not (REPO / "nvctk" / "ffi.py").exists()


def test_start_path_imports_neither_ctypes_nor_prctl() -> None:
    """The hook's and the create path's modules reach the
    kernel through nvctk._sys only: no ctypes, no python-prctl."""
    out = _child("""
        import nvctk.hook.caps, nvctk.hook.mount, nvctk.hook.prestart, nvctk.runtime.create
        out["mods"] = sorted(sys.modules)
    """)
    mods = set(out["mods"])  # type: ignore[arg-type]
    assert "nvctk._sys" in mods
    assert not mods & {"ctypes", "_ctypes", "ctypes.util", "prctl", "_prctl", "nvctk.ffi"}


def test_errors_are_oserror_with_the_syscall_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as ei:
        _sys.umount2(str(tmp_path / "nope"), 0)
    assert ei.value.errno == errno.ENOENT
    assert ei.value.strerror == f"umount2: {os.strerror(errno.ENOENT)}"
    with pytest.raises(ValueError):  # an embedded NUL never reaches the kernel
        _sys.umount2("a\0b", 0)
    with pytest.raises(TypeError):
        _sys.setns("0", 0)  # type: ignore[arg-type]


# --- one test per wrapper -------------------------------------------------------------


def test_openat2_resolves_in_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("mine")
    (tmp_path / "esc").symlink_to("/etc")
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = _sys.openat2(root, "esc/passwd", os.O_RDONLY | os.O_CLOEXEC, 0, mount.IN_ROOT)
        try:
            assert os.read(fd, 10) == b"mine"  # /etc of the root, not the host's
        finally:
            os.close(fd)
        with pytest.raises(OSError) as ei:
            _sys.openat2(root, "../x", os.O_RDONLY, 0, mount.RESOLVE_BENEATH)
        assert ei.value.errno == errno.EXDEV and ei.value.strerror.startswith("openat2: ")
        fd = _sys.openat2(root, "new", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                          0o640, mount.BENEATH_NOLINKS)
        os.close(fd)
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o640 & ~_umask()
    finally:
        os.close(root)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_fstatfs_type(tmp_path: Path) -> None:
    fd = os.open("/proc/self", os.O_PATH)
    try:
        assert _sys.fstatfs_type(fd) == mounts.PROC_SUPER_MAGIC
    finally:
        os.close(fd)
    with pytest.raises(OSError) as ei:
        _sys.fstatfs_type(10_000)
    assert ei.value.errno == errno.EBADF and ei.value.strerror.startswith("fstatfs: ")


def test_mount_id_is_statx_s_and_agrees_with_fdinfo(tmp_path: Path) -> None:
    # statx answers on this kernel (>= 5.8): the hook's ~30 lookups a start never fall
    # back to reading /proc/self/fdinfo unnoticed; both name the same mount
    (tmp_path / "f").write_text("")
    ids = set()
    for p in ("/", "/proc", "/dev", "/sys", str(tmp_path), str(tmp_path / "f")):
        fd = os.open(p, os.O_PATH | os.O_CLOEXEC)
        try:
            got = _sys.mount_id(fd)
            assert got >= 0, f"statx gave no mount id for {p}"
            assert got == mounts.mount_id_from_fdinfo(fd) == mounts.mount_id(fd)
            ids.add(got)
        finally:
            os.close(fd)
    assert len(ids) >= 3  # /proc, /sys and / are different mounts
    with pytest.raises(OSError) as e:
        _sys.mount_id(9999)
    assert e.value.errno == errno.EBADF


def test_prctl_reads_and_sets() -> None:
    assert _sys.prctl(39) == int(_status_text("NoNewPrivs"))  # PR_GET_NO_NEW_PRIVS
    with pytest.raises(OSError) as ei:
        _sys.prctl(1, 10_000)  # PR_SET_PDEATHSIG with no such signal
    assert ei.value.errno == errno.EINVAL and ei.value.strerror.startswith("prctl: ")
    out = _child("_sys.prctl(38, 1); out['nnp'] = _sys.prctl(39)")  # PR_SET_NO_NEW_PRIVS
    assert out == {"nnp": 1}


def test_capget_matches_proc_status() -> None:
    eff, perm, inh = _sys.capget()
    assert (eff, perm, inh) == (_status("CapEff"), _status("CapPrm"), _status("CapInh"))


@pytest.mark.skipif(not ROOT, reason="needs root (capabilities to give up)")
def test_capset_lowers_and_cannot_raise_again() -> None:
    out = _child("""
        eff, perm, inh = _sys.capget()
        keep = perm & ~(1 << 21)  # CAP_SYS_ADMIN given up
        _sys.capset(0, keep, 0)
        out['after'] = list(_sys.capget())
        out['keep'] = keep
        try:
            _sys.capset(0, perm, 0)
        except PermissionError as e:
            out['err'] = e.strerror
    """)
    assert out["after"] == [0, out["keep"], 0]
    assert out["err"] == f"capset: {os.strerror(errno.EPERM)}"


@pytest.mark.skipif(not ROOT, reason="needs root (mount namespaces)")
def test_mount_api_in_a_private_namespace(tmp_path: Path) -> None:
    """unshare, mount (propagation), fsopen/fsconfig/fsmount, open_tree, mount_setattr,
    move_mount, umount2 and setns, in a child's own mount namespace."""
    src, dst, dst2 = tmp_path / "src", tmp_path / "dst", tmp_path / "dst2"
    for d in (src, dst, dst2):
        d.mkdir()
    (src / "f").write_text("from src")
    out = _child(f"""
        host_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        _sys.unshare(mounts.CLONE_NEWNS)
        _sys.mount(None, "/", None, mounts.MS_REC | mounts.MS_PRIVATE, None)
        def mounted(path):
            return [l.split()[5] for l in open("/proc/self/mountinfo") if l.split()[4] == path]
        # a tmpfs, made detached and filled through its fd
        fs = _sys.fsopen("tmpfs", mounts.FSOPEN_CLOEXEC)
        _sys.fsconfig(fs, mounts.FSCONFIG_SET_STRING, "size", "1m", 0)
        _sys.fsconfig(fs, mounts.FSCONFIG_CMD_CREATE, None, None, 0)
        t = _sys.fsmount(fs, mounts.FSMOUNT_CLOEXEC, 0)
        os.close(fs)
        out["tmpfs_type"] = _sys.fstatfs_type(t) == mounts.TMPFS_MAGIC
        to = os.open({str(dst2)!r}, os.O_PATH | os.O_CLOEXEC)
        _sys.move_mount(t, "", to, "", mounts.MOVE_MOUNT_F_EMPTY_PATH | mounts.MOVE_MOUNT_T_EMPTY_PATH)
        out["tmpfs_opts"] = mounted({str(dst2)!r})
        # a bind clone of src, read-only while detached, attached onto dst
        tree = _sys.open_tree(mounts.AT_FDCWD, {str(src)!r}, mounts.OPEN_TREE_CLONE | os.O_CLOEXEC)
        _sys.mount_setattr(tree, "", mounts.AT_EMPTY_PATH, mounts.MOUNT_ATTR_RDONLY, 0, 0, 0)
        to = os.open({str(dst)!r}, os.O_PATH | os.O_CLOEXEC)
        _sys.move_mount(tree, "", to, "", mounts.MOVE_MOUNT_F_EMPTY_PATH | mounts.MOVE_MOUNT_T_EMPTY_PATH)
        out["bind_opts"] = mounted({str(dst)!r})
        out["read"] = open({str(dst / "f")!r}).read()
        try:
            open({str(dst / "g")!r}, "w")
        except OSError as e:
            out["write_errno"] = e.errno
        _sys.umount2({str(dst)!r}, mounts.MNT_DETACH)
        out["after_umount"] = mounted({str(dst)!r})
        _sys.setns(host_ns, mounts.CLONE_NEWNS)
        out["host_sees"] = mounted({str(dst2)!r})
    """)
    assert out["tmpfs_type"] is True
    assert len(out["tmpfs_opts"]) == 1  # type: ignore[arg-type]
    (opts,) = out["bind_opts"]  # type: ignore[misc]
    assert opts.split(",")[0] == "ro"
    assert out["read"] == "from src" and out["write_errno"] == errno.EROFS
    assert out["after_umount"] == [] and out["host_sees"] == []
    assert not (dst / "f").exists()  # nothing leaked into this namespace
