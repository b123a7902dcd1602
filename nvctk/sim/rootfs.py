"""A small glibc-based container rootfs for tests and the demo.

Built from the host: Debian's static busybox (with its applets as symlinks), the
host's glibc (libc, ld.so, libm, libpthread, libdl, librt), the loader config
and a cache written by the host's ldconfig. Files are copied, not hard-linked, so
a container writing into its rootfs can never change the host's files.

Layout, debian=True (like a debian:12 image, merged /usr):
    bin -> usr/bin, sbin -> usr/sbin, lib -> usr/lib, lib64 -> usr/lib64
    usr/bin/busybox + applet links         usr/lib/x86_64-linux-gnu/<glibc>
    usr/lib64/ld-linux-x86-64.so.2 -> ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    etc/{debian_version, os-release, passwd, group, ld.so.conf, ld.so.conf.d/, ld.so.cache}
    empty proc dev sys tmp run root; usr/local/bin/cuda-vectoradd when with_sample
debian=False (a RHEL-like image): glibc in usr/lib64, no /etc/debian_version, so
nvctk puts driver libraries in /usr/lib64 (REFERENCE §4).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping

from nvctk.base.errors import NvctkError

BUSYBOX = "/bin/busybox"
HOST_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")
GLIBC = ("libc.so.6", "ld-linux-x86-64.so.2", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1")
SAMPLE_PATH = "/usr/local/bin/cuda-vectoradd"
DEBIAN_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
OTHER_LIB_DIR = "/usr/lib64"


class RootfsError(NvctkError):
    pass


@functools.cache
def busybox_applets(busybox: str = BUSYBOX) -> tuple[str, ...]:
    try:
        out = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RootfsError(f"cannot run {busybox} (apt-get install busybox-static): {e}")
    return tuple(a for a in out.split() if a and "/" not in a and a != "busybox")


def _host_file(name: str) -> str:
    for d in HOST_LIB_DIRS:
        p = os.path.join(d, name)
        if os.path.exists(p):
            return os.path.realpath(p)
    raise RootfsError(f"the host has no {name} in {', '.join(HOST_LIB_DIRS)}")


def _write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _copy(src: str, dst: str, mode: int | None = None) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, mode if mode is not None else os.stat(src).st_mode & 0o7777)


def container_lib_dir(rootfs: str) -> str:
    """Where nvctk puts driver libraries in this rootfs (REFERENCE §4)."""
    debian = os.path.exists(os.path.join(rootfs, "etc/debian_version"))
    return DEBIAN_LIB_DIR if debian else OTHER_LIB_DIR


def build_rootfs(
    path: str,
    *,
    debian: bool = True,
    with_sample: str | None = None,
    files: Mapping[str, str] | None = None,
    ldconfig: str = "/sbin/ldconfig",
) -> str:
    """Build a rootfs at `path` (created; must not exist or be empty) and return it.

    with_sample: host path of the cuda-vectoradd program (SimHost.sample), copied to
    /usr/local/bin/cuda-vectoradd. files: extra {container path: host path} copies.
    """
    root = os.path.abspath(path)
    if os.path.exists(root) and os.listdir(root):
        raise RootfsError(f"{root} is not empty")
    lib_dir = DEBIAN_LIB_DIR if debian else OTHER_LIB_DIR
    _make_tree(root, lib_dir)
    # busybox and its applets
    _copy(BUSYBOX, os.path.join(root, "usr/bin/busybox"), 0o755)
    for applet in busybox_applets():
        os.symlink("busybox", os.path.join(root, "usr/bin", applet))
    # glibc
    for name in GLIBC:
        _copy(_host_file(name), os.path.join(root, lib_dir.lstrip("/"), name), 0o755)
    _write_etc(root, debian)
    if with_sample:
        if not os.path.isfile(with_sample):
            raise RootfsError(f"sample program {with_sample} does not exist")
        _copy(with_sample, os.path.join(root, SAMPLE_PATH.lstrip("/")), 0o755)
    for container_path, host_path in (files or {}).items():
        _copy(host_path, os.path.join(root, container_path.lstrip("/")))

    r = subprocess.run([ldconfig, "-r", root], capture_output=True, text=True)
    if r.returncode != 0:
        raise RootfsError(f"{ldconfig} -r {root} failed: {r.stderr.strip()}")
    return root


def _make_tree(root: str, lib_dir: str) -> None:
    """The directories of a usr-merged image, with their modes and links."""
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o755)
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/local/bin", lib_dir.lstrip("/"),
              "etc/ld.so.conf.d", "proc", "dev", "sys", "run", "root", "var", "home"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    os.chmod(os.path.join(root, "root"), 0o700)
    os.makedirs(os.path.join(root, "var/tmp"), exist_ok=True)
    os.chmod(os.path.join(root, "var/tmp"), 0o1777)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"),
                         ("lib64", "usr/lib64"), ("var/run", "../run")):
        os.symlink(target, os.path.join(root, link))


def _write_etc(root: str, debian: bool) -> None:
    """/etc of a Debian image (and its loader link), or of an RPM one: what the
    library directory nvctk picks and the image's ldconfig read."""
    if debian:
        os.symlink(
            "../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
            os.path.join(root, "usr/lib64/ld-linux-x86-64.so.2"),
        )
        _write(os.path.join(root, "etc/debian_version"), "12.5\n")
        _write(
            os.path.join(root, "etc/os-release"),
            'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'
            'VERSION_ID="12"\nID=debian\n',
        )
        _write(
            os.path.join(root, "etc/ld.so.conf.d/x86_64-linux-gnu.conf"),
            "# Multiarch support\n/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n"
            "/usr/lib/x86_64-linux-gnu\n",
        )
    else:
        _write(
            os.path.join(root, "etc/os-release"),
            'NAME="nvctk test image"\nID=nvctk-test\nID_LIKE="rhel fedora"\nVERSION_ID="9"\n',
        )
        _write(os.path.join(root, "etc/ld.so.conf.d/lib64.conf"), "/usr/lib64\n/usr/local/lib64\n")
    _write(os.path.join(root, "etc/ld.so.conf.d/libc.conf"), "/usr/local/lib\n")
    _write(os.path.join(root, "etc/ld.so.conf"), "include /etc/ld.so.conf.d/*.conf\n")
    _write(
        os.path.join(root, "etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    )
    _write(os.path.join(root, "etc/group"), "root:x:0:\nnogroup:x:65534:\n")
    _write(os.path.join(root, "etc/hostname"), "nvctk-test\n")
