"""Discovery's readers on small private trees (no root: device nodes are links to
/dev/null and /dev/zero, which os.stat follows; a regular file stands for a bad node)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvctk.base.config import Config, ExtraMount
from nvctk.base.errors import ConfigError
from nvctk.host import discover, paths
from nvctk.host.driver import DriverFiles
from nvctk.host.inventory import GpuInfo, MigInfo

MIG = MigInfo(0, "MIG-aaaa", 1, 2, "3g.40gb", 40000)
GPU = GpuInfo(0, "GPU-0000", "NVIDIA A100", 4, "00000000:1B:00.0", 40960, "8.0", "nvidia", True,
              (MIG,))
NULL = os.stat("/dev/null").st_rdev


@pytest.fixture
def root(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    (dev / "nvidiactl").symlink_to("/dev/null")
    (dev / "nvidia4").symlink_to("/dev/null")
    (dev / "nvidia-uvm").write_text("")  # not a node
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu4/mig/gi1"
    (caps / "ci2").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 12\nDeviceFileMode: 292\n")
    (caps / "ci2/access").write_text("DeviceFileMode: 292\n")
    (dev / "nvidia-caps/nvidia-cap12").symlink_to("/dev/null")
    (tmp_path / "proc/devices").write_text("Character devices:\n  1 mem\n237 nvidia-caps\n")
    drm = tmp_path / "sys/bus/pci/devices/0000:1b:00.0/drm"
    for name in ("card1", "renderD128", "controlD64"):
        (drm / name).mkdir(parents=True)
    return tmp_path


def files(root: Path) -> DriverFiles:
    return DriverFiles(str(root), "550.54.15", proc_dir=str(root / "proc/driver/nvidia"),
                       dev_dir=str(root / "dev"))


def test_device_facts(root: Path) -> None:
    got = discover.device_facts(files(root), [(GPU, None), (GPU, MIG)], ("graphics",),
                                mig_config=True)
    null = (os.major(NULL), os.minor(NULL))
    assert got.nodes["nvidiactl"] == got.nodes["nvidia4"] == null
    assert got.nodes["nvidia-uvm"] == "not a character device"
    assert got.nodes["nvidia-uvm-tools"] is None and got.nodes["dri/card1"] is None
    assert got.drm == {"0000:1b:00.0": ("card1", "renderD128")}  # controlD64 is no node of ours
    gi, ci = "gpu4/mig/gi1/access", "gpu4/mig/gi1/ci2/access"
    assert got.cap_minors[gi] == 12 and got.nodes["nvidia-caps/nvidia-cap12"] == null
    assert "has no DeviceFileMinor line" in str(got.cap_minors[ci])
    assert "cannot read the MIG capability minor" in str(got.cap_minors["mig/config"])
    assert got.proc_majors == {}  # no caps node found missing: /proc/devices not read


def test_proc_devices_is_read_when_a_caps_node_is_missing(root: Path) -> None:
    (root / "dev/nvidia-caps/nvidia-cap12").unlink()
    got = discover.device_facts(files(root), [(GPU, MIG)], ("utility",))
    assert got.nodes["nvidia-caps/nvidia-cap12"] is None
    assert got.proc_majors == {"mem": 1, "nvidia-caps": 237}


def test_no_drm_lookup_without_graphics(root: Path) -> None:
    assert discover.device_facts(files(root), [(GPU, None)], ("compute",)).drm == {}


def test_a_fifo_is_never_read(root: Path) -> None:
    access = root / "proc/driver/nvidia/capabilities/mig/monitor"
    access.parent.mkdir(parents=True)
    os.mkfifo(access)
    got = discover.device_facts(files(root), [], ("utility",), mig_monitor=True)
    assert "cannot read" in str(got.cap_minors["mig/monitor"])  # and it returned


def test_mps_dir_is_a_real_dir_only(tmp_path: Path) -> None:
    assert discover.mps_dir(str(tmp_path)) is None
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp/nvidia-mps").symlink_to(tmp_path / "elsewhere")
    assert discover.mps_dir(str(tmp_path)) is None  # a link someone planted in /tmp
    (tmp_path / "tmp/nvidia-mps").unlink()
    (tmp_path / "tmp/nvidia-mps").mkdir()
    assert discover.mps_dir(str(tmp_path)) == str(tmp_path / "tmp/nvidia-mps")


def test_extra_mount_kinds(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    cfg = Config(extra_mounts=(ExtraMount(str(tmp_path / "f"), "/f"),
                               ExtraMount(str(tmp_path), "/d"),
                               ExtraMount(str(tmp_path / "missing"), "/m")))
    assert discover.extra_mount_kinds(cfg) == {str(tmp_path / "f"): "file", str(tmp_path): "dir",
                                               str(tmp_path / "missing"): "dir"}


@pytest.mark.parametrize(("given", "want"), [
    (None, "/run/runc"), ("/run/x/", "/run/x"), ("/run/../run/y", "/run/y")])
def test_runtime_root_is_absolute(given: str | None, want: str) -> None:
    assert paths.absolute_runtime_root(given) == want


def test_relative_runtime_root_is_against_the_cwd(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert paths.absolute_runtime_root("r") == str(tmp_path / "r")


def test_or_error_keeps_an_nvctk_error_for_the_plan() -> None:
    def fail() -> str:
        raise ConfigError("no libvgpu")

    got = discover.or_error(fail)
    assert isinstance(got, ConfigError) and str(got) == "no libvgpu"
    assert discover.or_error(lambda: "x") == "x"


# --- the image ----------------------------------------------------------------------------


def rootfs(tmp_path: Path, files: dict[str, str]) -> Path:
    r = tmp_path / "rootfs"
    r.mkdir(exist_ok=True)
    for rel, text in files.items():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_text(text)
    return r


@pytest.mark.parametrize(("files_", "debian", "libc"), [
    ({}, False, "none"),
    ({"etc/debian_version": "12\n", "lib64/ld-linux-x86-64.so.2": ""}, True, "glibc"),
    ({"lib/ld-linux-aarch64.so.1": ""}, False, "glibc"),
    ({"lib/ld-musl-x86_64.so.1": "", "lib64/ld-linux-x86-64.so.2": ""}, False, "musl"),
])
def test_image_facts(tmp_path: Path, files_: dict[str, str], debian: bool, libc: str) -> None:
    from nvctk.host.image import image_facts

    r = rootfs(tmp_path, files_)
    spec = {"root": {"path": "rootfs", "readonly": True}}
    plain = image_facts(spec, str(tmp_path))
    assert (plain.rootfs, plain.debian, plain.root_readonly, plain.libc) == (
        str(r), debian, True, None)  # the vGPU facts only for a vGPU request
    assert image_facts(spec, str(tmp_path), vgpu=True).libc == libc


def test_image_preload_entries(tmp_path: Path) -> None:
    from nvctk.host.image import image_facts

    rootfs(tmp_path, {"etc/ld.so.preload": "/a.so # c\n/b.so:/c.so\n"})
    got = image_facts({"root": {"path": "rootfs"}}, str(tmp_path), vgpu=True)
    assert got.preload_entries == ("/a.so", "/b.so", "/c.so")


def test_an_unreadable_preload_file_is_kept_as_the_error(tmp_path: Path) -> None:
    from nvctk.base.errors import SpecError
    from nvctk.host.image import image_facts

    r = rootfs(tmp_path, {})
    (r / "etc").mkdir()
    os.mkfifo(r / "etc/ld.so.preload")  # never opened for reading: the create would hang
    got = image_facts({"root": {"path": "rootfs"}}, str(tmp_path), vgpu=True)
    assert isinstance(got.preload_entries, SpecError)
    assert "is not a regular file" in str(got.preload_entries)


# --- nvctk-hook's path ------------------------------------------------------------------------


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_hook_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nvctk.host.paths import find_hook

    runtime = _exe(tmp_path / "bin/nvctk-runtime")
    on_path = _exe(tmp_path / "path/nvctk-hook")
    (tmp_path / "dir-first/nvctk-hook").mkdir(parents=True)  # a directory is no executable
    _exe(tmp_path / "noexec/nvctk-hook").chmod(0o644)
    monkeypatch.setenv("PATH", f"{tmp_path}/noexec:{tmp_path}/dir-first:{tmp_path}/path")
    assert find_hook(Config(hook_path="/opt/h")) == "/opt/h"  # the config first
    assert find_hook(Config(), str(runtime)) == str(on_path)  # none beside: PATH's
    beside = _exe(tmp_path / "bin/nvctk-hook")
    assert find_hook(Config(), str(runtime)) == str(beside)


def test_find_hook_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nvctk.host.paths import find_hook

    with pytest.raises(ConfigError, match="hook-path must be absolute"):
        find_hook(Config(hook_path="rel/h"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="cannot find nvctk-hook"):
        find_hook(Config(), str(tmp_path / "nvctk-runtime"))
