"""Operator tools never destroy what they touch.

Every nvctk command that writes a file at a path an operator names (`cdi generate
--output`, `labels --output`) or at a path of its own in a shared directory (the
device plugin's socket in the kubelet's directory) replaces only what is its kind of
thing: a regular file (fileio.replace_regular_file), a socket. A character device, a
FIFO, a directory, a symlink or a socket where a file goes (or anything but a socket
where the socket goes) is a clear error, and is left exactly as it was.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import fileio
from nvctk.sim.host import SimHost
from support.fs import node_id, plant

KINDS = ["chardev", "blockdev", "fifo", "dir", "symlink", "socket"]


@pytest.mark.parametrize("kind", KINDS)
def test_replace_regular_file_refuses_every_other_kind(tmp_path: Path, kind: str) -> None:
    if kind.endswith("dev") and os.geteuid() != 0:
        pytest.skip("mknod needs root")
    out = tmp_path / "out"
    plant(out, kind)
    before = node_id(out)
    with pytest.raises(fileio.NotRegularFile, match="not a regular file; nvctk replaces only"):
        fileio.replace_regular_file(str(out), b"x\n")
    assert node_id(out) == before
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_replace_regular_file_replaces_a_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("old\n")
    fileio.replace_regular_file(str(out), b"new\n", 0o644)
    assert out.read_text() == "new\n" and stat.S_IMODE(out.stat().st_mode) == 0o644
    fileio.replace_regular_file(str(tmp_path / "fresh"), b"made\n")
    assert (tmp_path / "fresh").read_text() == "made\n"


# the commands that write a file at a path the operator names
WRITERS = {"cdi-generate": ["cdi", "generate", "--output"], "labels": ["labels", "--output"]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", list(WRITERS))
def test_no_command_replaces_what_is_not_a_regular_file(
        sim_host: SimHost, tmp_path: Path, run_nvctk: Callable[..., Any], command: str,
        kind: str) -> None:
    """Before: `nvctk labels --output /dev/null` replaced the host's /dev/null with a
    regular file (cdi generate already refused)."""
    out = tmp_path / "out"
    plant(out, kind)
    before = node_id(out)
    r = run_nvctk(*WRITERS[command], str(out), env={**os.environ, **sim_host.env},
                  config=sim_host.config_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert f"cannot write {out}: it is a" in r.stderr, r.stderr
    assert "not a regular file" in r.stderr, r.stderr
    assert node_id(out) == before
    assert sorted(os.listdir(tmp_path)) == sorted(["out", *(["target"] if kind == "symlink" else [])])


@pytest.mark.parametrize("command", list(WRITERS))
def test_every_command_writes_a_regular_file(sim_host: SimHost, tmp_path: Path,
                                             run_nvctk: Callable[..., Any], command: str) -> None:
    out = tmp_path / "out"
    out.write_text("old\n")
    r = run_nvctk(*WRITERS[command], str(out), env={**os.environ, **sim_host.env},
                  config=sim_host.config_path)
    assert r.returncode == 0, r.stderr
    assert out.read_text() != "old\n" and stat.S_IMODE(out.stat().st_mode) == 0o644


# --- the device plugin's socket ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dir", "file", "chardev", "fifo", "symlink"])
def test_device_plugin_leaves_what_is_not_a_socket(sim_host: SimHost, kind: str,
                                                   tmp_path_factory: pytest.TempPathFactory
                                                   ) -> None:
    """Before: a directory at the plugin's socket path was a traceback (unlink at start,
    again at stop); a file or device node there was removed."""
    from nvctk.k8s import gen

    gen.ensure()
    from nvctk.k8s.server import socket_name
    from support.kubelet import FakeKubelet

    kdir = tmp_path_factory.mktemp("kl")  # short: unix socket paths are limited
    at = kdir / socket_name("nvidia.com/gpu")
    if kind == "file":
        at.write_text("the operator's\n")
    else:
        plant(at, kind)
    before = node_id(at)
    kl = FakeKubelet(str(kdir)).start()
    try:
        r = subprocess.run(
            [sys.executable, "-c", "from nvctk.cli.device_plugin import device_plugin as d; d()",
             "--kubelet-dir", str(kdir)], env={**os.environ, **sim_host.env},
            capture_output=True, text=True, timeout=60)
    finally:
        kl.stop()
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"{at}: it is a" in r.stderr and "not a socket" in r.stderr, r.stderr
    assert node_id(at) == before


# --- nvctk sim init --force ----------------------------------------------------------------


@pytest.mark.parametrize("entries", [["usr"], ["etc", "lib"], ["run", "config.toml"]])
def test_sim_init_force_never_clears_what_is_not_a_sim(tmp_path: Path, entries: list[str],
                                                       run_nvctk: Callable[..., Any]) -> None:
    """Before: `nvctk sim init DIR --force` deleted DIR/usr, DIR/etc, DIR/lib, ... of any
    directory (a chroot, /var: its lib/ and run/)."""
    if os.geteuid() != 0:
        pytest.skip("nvctk sim init needs root")
    d = tmp_path / "operator"
    for e in entries:
        if e.endswith(".toml"):
            (d / e).parent.mkdir(parents=True, exist_ok=True)
            (d / e).write_text("# the operator's\n")
        else:
            (d / e).mkdir(parents=True)
            (d / e / "precious").write_text("the operator's\n")
    before = sorted((str(p.relative_to(d)), p.read_bytes() if p.is_file() else b"")
                    for p in d.rglob("*"))
    r = run_nvctk("sim", "init", str(d), "--force")
    assert r.returncode == 1, r.stderr
    assert "is not a simulated host nvctk built" in r.stderr and "Traceback" not in r.stderr
    assert sorted((str(p.relative_to(d)), p.read_bytes() if p.is_file() else b"")
                  for p in d.rglob("*")) == before
