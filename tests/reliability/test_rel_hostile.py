"""Issue 13 §1, hostile images beyond tests/integration/test_image_hostile.py, through the real
nvctk-runtime + runc (GPU containers with a vGPU cap: the hook's whole path).

- a symlink race: helper threads flip path components the hook walks (the library dir,
  /etc, /usr/bin) between the image's directory and a symlink to a decoy host
  directory while containers start, start after start;
- FIFOs and device nodes where the hook expects files;
- huge and deep paths, symlink loops;
- megabytes of env;
- host directories bound read-write where the hook writes.

Each start ends in success or a clean refusal (no traceback, no internal error, no
hang); the decoy host directory's digest (names, modes, sizes, mtimes, bytes) and the
host's mount table never change. Attempts and escapes (a changed decoy) are counted.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support import reliability as relkit
from support.reliability import Checked

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, device nodes)")]

LIB = "usr/lib/x86_64-linux-gnu"
GPU_ENV = ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_DEVICE_MEMORY_LIMIT=512m"]


@pytest.fixture
def decoy(tmp_path: Path) -> Path:
    return relkit.make_decoy(tmp_path / "decoy")


def test_symlink_race(sim_host: Any, rootfs: Any, tmp_path: Path, decoy: Path) -> None:
    starts = relkit.n(12, 300)
    stop = threading.Event()
    flips = [0]
    died: list[str] = []
    with relkit.lab(tmp_path, sim_host.config_path) as la:
        b = la.bundle(None, GPU_ENV, ["/bin/sh", "-c", "true"], base=str(rootfs()))
        root = b / "rootfs"
        ck = Checked(la, decoy, sim_host.root)

        def flipper(rel: str, target: str, seed: int) -> None:
            rng = random.Random(seed)
            path, aside = root / rel, root / (rel + ".aside")
            try:
                while not stop.is_set():
                    os.rename(path, aside)
                    try:
                        os.symlink(target, path)
                    except FileExistsError:  # the hook made it anew in the gap: no flip
                        _put_back(aside, path)
                        continue
                    flips[0] += 1
                    time.sleep(rng.uniform(0, 0.004))
                    os.unlink(path)
                    _put_back(aside, path)
                    time.sleep(rng.uniform(0, 0.03))
            except BaseException as e:  # a dead flipper would quietly weaken the race
                died.append(f"{rel}: {e!r}")
                stop.set()

        ck.start(b)
        assert ck.started == 1, "the image does not start even without the race"
        ts = [threading.Thread(target=flipper, args=a) for a in (
            (LIB, str(decoy / "lib"), 1), ("etc", str(decoy), 2),
            ("usr/bin", "../../" * 8 + str(decoy).lstrip("/"), 3))]
        for t in ts:
            t.start()
        try:
            for _ in range(starts):
                ck.start(b)
        finally:
            stop.set()
            for t in ts:
                t.join()
        assert died == [], died
    relkit.record("hostile", "symlink race (lib dir, /etc, /usr/bin flipped to a host dir)",
                  attempts=ck.attempts, started=ck.started, refused=ck.refused,
                  flips=flips[0], escapes=0, refusals=ck.reasons)


def _put_back(aside: Path, path: Path) -> None:
    """The image's own directory back in place. In the gap the hook may have made the
    path anew (a mount target's parent, inside the rootfs: allowed); that goes first."""
    for i in range(100):
        try:
            os.rename(aside, path)
            return
        except OSError:
            if not path.is_dir() or path.is_symlink():
                raise
        made = path.with_name(f"{path.name}.made{i}")
        os.rename(path, made)  # whole, even if the hook is still filling it
        shutil.rmtree(made, ignore_errors=True)
    raise AssertionError(f"{path} kept coming back")


def _fifo(p: Path) -> None:
    p.parent.mkdir(exist_ok=True)
    if p.is_symlink() or p.exists():
        p.unlink()
    os.mkfifo(p)


def _devnode(p: Path) -> None:
    if p.is_symlink() or p.exists():
        p.unlink()
    os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers


def _libcuda(root: Path) -> Path:
    return root / LIB / "libcuda.so.1"


SPECIAL: dict[str, Callable[[Path], None]] = {
    "ld.so.cache FIFO": lambda r: _fifo(r / "etc/ld.so.cache"),
    "ld.so.cache /dev/zero node": lambda r: _devnode(r / "etc/ld.so.cache"),
    "ld.so.preload FIFO": lambda r: _fifo(r / "etc/ld.so.preload"),
    "libcuda.so.1 FIFO": lambda r: _fifo(_libcuda(r)),
    "libcuda.so.1 /dev/zero node": lambda r: _devnode(_libcuda(r)),
    "nvidia-smi FIFO": lambda r: _fifo(r / "usr/bin/nvidia-smi"),
    "/run/nvctk FIFO": lambda r: _fifo(r / "run/nvctk"),
}


def _deep(r: Path) -> None:
    # a library dir 64 levels of 200-byte names down (12.8 KB: past PATH_MAX), made
    # through dir fds; the image links its library dir into the middle of it
    (r / "deep").mkdir()
    fd = os.open(r / "deep", os.O_RDONLY | os.O_DIRECTORY)
    names = []
    for i in range(64):
        name = f"{i:03d}" + "d" * 197
        names.append(name)
        os.mkdir(name, dir_fd=fd)
        nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    shutil.rmtree(r / LIB)
    os.symlink("../../deep/" + "/".join(names[:15]), r / LIB)


def _loop(r: Path) -> None:
    shutil.rmtree(r / LIB)
    for i in range(45):
        os.symlink(f"/l{i + 1}", r / f"l{i}")
    os.symlink("/l0", r / "l45")
    os.symlink("/l0", r / LIB)


def _long_link(r: Path) -> None:
    (r / "etc/ld.so.cache").unlink(missing_ok=True)
    os.symlink("/" + "a/" * 2040 + "x", r / "etc/ld.so.cache")


SPECIAL.update({"library dir past PATH_MAX": _deep, "library dir symlink loop": _loop,
                "ld.so.cache 4 KiB link target": _long_link})


def test_special_files_and_paths(sim_host: Any, rootfs: Any, tmp_path: Path,
                                 decoy: Path) -> None:
    base = str(rootfs())
    outcomes: dict[str, str] = {}
    with relkit.lab(tmp_path, sim_host.config_path) as la:
        ck = Checked(la, decoy, sim_host.root)
        for name, poison in SPECIAL.items():
            b = la.bundle(None, GPU_ENV, ["/bin/sh", "-c", "true"], base=base)
            poison(b / "rootfs")
            err = ck.start(b)
            outcomes[name] = "refused: " + err.strip()[-160:] if err.strip() else "started"
    print(outcomes)
    relkit.record("hostile", "FIFOs, device nodes, deep paths, link loops where files are "
                  "expected", attempts=ck.attempts, started=ck.started, refused=ck.refused,
                  hangs=0, escapes=0, cases=len(SPECIAL), refusals=ck.reasons)


def test_megabytes_of_env(sim_host: Any, rootfs: Any, tmp_path: Path, decoy: Path) -> None:
    base = str(rootfs())
    big = [f"JUNK{i}={'x' * 2000}" for i in range(2048)]  # 4 MiB
    cases = {
        "4 MiB of env + a GPU": [*GPU_ENV, *big],
        "1 MiB NVIDIA_VISIBLE_DEVICES": ["NVIDIA_VISIBLE_DEVICES=" + "0," * (1 << 19)],
        "1 MiB CUDA_DEVICE_MEMORY_LIMIT": ["NVIDIA_VISIBLE_DEVICES=0",
                                           "CUDA_DEVICE_MEMORY_LIMIT=" + "9" * (1 << 20)],
        "100k NVIDIA_REQUIRE_ terms": ["NVIDIA_VISIBLE_DEVICES=0",
                                       "NVIDIA_REQUIRE_X=" + "cuda>=1 " * 100000],
    }
    took: dict[str, float] = {}
    with relkit.lab(tmp_path, sim_host.config_path) as la:
        ck = Checked(la, decoy, sim_host.root)
        for name, env in cases.items():
            b = la.bundle(None, env, ["/bin/sh", "-c", "true"], base=base)
            t0 = time.monotonic()
            ck.start(b, timeout=60)
            took[name] = round(time.monotonic() - t0, 3)
    relkit.record("hostile", "megabytes of env (4 MiB total, 1 MiB values)",
                  attempts=ck.attempts, started=ck.started, refused=ck.refused,
                  slowest_s=max(took.values()), escapes=0, refusals=ck.reasons)


BINDS = ["/etc", f"/{LIB}", "/usr/bin", "/run", "/usr/lib/firmware", "/run/nvctk",
         "/etc/ld.so.conf.d"]


def test_writes_steered_onto_rw_host_binds(sim_host: Any, rootfs: Any, tmp_path: Path,
                                           decoy: Path) -> None:
    base = str(rootfs())
    with relkit.lab(tmp_path, sim_host.config_path) as la:
        ck = Checked(la, decoy, sim_host.root)
        for dest in BINDS:
            for extra in ([], ["CUDA_MPS_PIPE_DIRECTORY=" + dest]):
                def edit(spec: dict[str, Any], dest: str = dest) -> None:
                    spec["mounts"].append({"destination": dest, "type": "bind",
                                           "source": str(decoy), "options": ["rbind", "rw"]})

                b = la.bundle(None, [*GPU_ENV, *extra], ["/bin/sh", "-c", "true"],
                              base=base, edit=edit)
                ck.start(b)
    relkit.record("hostile", "host dirs bound read-write where the hook writes",
                  attempts=ck.attempts, started=ck.started, refused=ck.refused, escapes=0,
                  refusals=ck.reasons)
