"""A node component in a container sees the driver where its Pod mounts it and writes
the host's paths (config host-driver-root, nvctk's --driver-root/--hook-path), as plain
data: the overrides' checks and the form's translation."""

from __future__ import annotations

import pytest

from nvctk.base import config as nvconfig
from nvctk.base.errors import ConfigError
from nvctk.edits import DeviceNode, Edits, Mount, host_path_of, on_host

WHERE = "the command line"


def test_host_driver_root_defaults_to_driver_root() -> None:
    cfg = nvconfig.Config(driver_root="/run/nvidia/driver")
    assert cfg.host_driver_root == ""
    assert nvconfig.host_driver_root(cfg) == "/run/nvidia/driver"
    text = nvconfig.render(cfg)
    assert 'host-driver-root = ""' in text
    assert nvconfig.parse(text, "f") == cfg


def test_file_sets_host_driver_root() -> None:
    cfg = nvconfig.parse('driver-root = "/driver-root"\nhost-driver-root = "/"\n', "f")
    assert (cfg.driver_root, nvconfig.host_driver_root(cfg)) == ("/driver-root", "/")
    with pytest.raises(ConfigError, match="host-driver-root must be an absolute path or empty"):
        nvconfig.parse('host-driver-root = "run/nvidia"\n', "f")


def test_moved_driver_root_keeps_the_files_as_the_hosts() -> None:
    host = nvconfig.Config(driver_root="/run/nvidia/driver")
    cfg = nvconfig.overridden(host, {"driver-root": "/driver-root"}, WHERE)
    assert cfg.driver_root == "/driver-root"
    assert nvconfig.host_driver_root(cfg) == "/run/nvidia/driver"
    # both given: as given
    cfg = nvconfig.overridden(host, {"driver-root": "/driver-root", "host-driver-root": "/"},
                              WHERE)
    assert nvconfig.host_driver_root(cfg) == "/"
    # none given: the file's, unchanged
    assert nvconfig.overridden(host, {"driver-root": None, "hook-path": None}, WHERE) is host


def test_override_hook_and_library() -> None:
    cfg = nvconfig.overridden(nvconfig.Config(), {
        "hook-path": "/usr/local/nvctk/bin/nvctk-hook",
        "vgpu-library": "/usr/local/nvctk/lib/nvctk/libvgpu.so"}, WHERE)
    assert cfg.hook_path == "/usr/local/nvctk/bin/nvctk-hook"
    assert cfg.vgpu_library == "/usr/local/nvctk/lib/nvctk/libvgpu.so"


@pytest.mark.parametrize("key, value, message", [
    ("driver-root", "driver-root", "driver-root must be an absolute path"),
    ("driver-root", "", "driver-root must be an absolute path"),
    ("hook-path", "nvctk-hook", "hook-path must be an absolute path or empty"),
    ("host-driver-root", "/a\0b", "must not contain a NUL"),
    ("state-dir", "/x", "state-dir cannot be set there"),
])
def test_bad_override_names_key_and_source(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        nvconfig.overridden(nvconfig.Config(), {key: value}, WHERE)
    assert str(e.value).startswith(WHERE)


@pytest.mark.parametrize("seen, host, path, want", [
    ("/driver-root", "/", "/driver-root/dev/nvidia0", "/dev/nvidia0"),
    ("/driver-root", "/", "/driver-root", "/"),
    ("/driver-root", "/run/nvidia/driver", "/driver-root/usr/lib/x86_64-linux-gnu/libcuda.so.1",
     "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
    ("/host/run/nvidia/driver", "/run/nvidia/driver", "/host/run/nvidia/driver/dev/nvidiactl",
     "/run/nvidia/driver/dev/nvidiactl"),
    # outside the driver root: the host's already (the config's extra mounts)
    ("/driver-root", "/", "/srv/models", "/srv/models"),
    # a sibling that shares the prefix is not under the root
    ("/driver-root", "/", "/driver-rootx/lib", "/driver-rootx/lib"),
    ("/", "/", "/dev/nvidia0", "/dev/nvidia0"),
])
def test_host_path_of(seen: str, host: str, path: str, want: str) -> None:
    assert host_path_of(seen, host, path) == want


def test_on_host_moves_sources_not_container_paths() -> None:
    e = Edits("550.54.15", ("compute",), (),
              devices=(DeviceNode("/dev/nvidia0", "/driver-root/dev/nvidia0", 195, 0),),
              mounts=(Mount("/driver-root/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),
                      Mount("/srv/data", "/data")))
    out = on_host(e, "/driver-root", "/run/nvidia/driver")
    assert [(d.path, d.host_path) for d in out.devices] == [
        ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0")]
    assert [(m.host_path, m.container_path) for m in out.mounts] == [
        ("/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"), ("/srv/data", "/data")]
    assert on_host(e, "/", "/") is e
