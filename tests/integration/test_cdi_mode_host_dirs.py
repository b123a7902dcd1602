"""nvctk-runtime's CDI mode: nothing created on a host directory bound into the
container, the CDI vendors a container may name, the driver's configuration files in both
modes. (The rest: test_cdi_mode_names.py, test_cdi_mode_runtime.py; shared:
tests/support/cdi_mode.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import support.cdi_mode as _cdi_mode
from nvctk.base.config import parse
from nvctk.base.errors import ConfigError
from nvctk.cdi import check, load
from nvctk.sim.host import SimHost
from support.cdi_mode import _bundle, _rootfs_bundle, _with
from support.runtime import RUNTIME, Env, create_argv, snapshot

env, spec_dir = _cdi_mode.env, _cdi_mode.spec_dir  # fixtures


def _real_runc_in_both_modes(test: Callable[..., None]) -> Callable[..., None]:
    """Slow, needs root and runc, once with mode "cdi" and once "legacy"."""
    test = pytest.mark.parametrize("mode", ["cdi", "legacy"])(test)
    test = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                              reason="needs root and runc")(test)
    return pytest.mark.slow(test)


def _mode_setup(sim_host: SimHost, spec_dir: Path, tmp_path: Path, mode: str) -> str:
    """A rootfs under tmp_path (its path) and c.toml there: the host's config in
    `mode`, reading CDI specs from spec_dir."""
    from nvctk.sim.rootfs import build_rootfs

    rootfs = build_rootfs(str(tmp_path / "rootfs"))
    base = _with(Path(sim_host.config_path).read_text(), cdi_spec_dirs=f'["{spec_dir}"]')
    (tmp_path / "c.toml").write_text(_with(base, mode=f'"{mode}"'))
    return rootfs


def _runc_run(b: Path, config: Path, root: Path) -> subprocess.CompletedProcess[str]:
    """`runc run` of bundle b through nvctk-runtime with config, its state under root;
    the container is deleted after, whatever happened."""
    cid = "nvctk-cdi-mode-" + uuid.uuid4().hex[:8]
    try:
        return subprocess.run([RUNTIME, "--root", str(root), "run", "--bundle", str(b), cid],
                              env={**os.environ, "NVCTK_CONFIG": str(config)},
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    finally:
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid],
                       capture_output=True, timeout=60)


# --- nothing created on a host directory bound into the container ---

_LIB = "/usr/lib/x86_64-linux-gnu"


def _bind_host_dir(b: Path, host: Path, at: str, *, ro: bool = False, after: list[Any] | None = None
                   ) -> None:
    spec = json.loads((b / "config.json").read_text())
    opts = ["rbind", "ro" if ro else "rw"]
    spec["mounts"].append({"destination": at, "type": "bind", "source": str(host), "options": opts})
    spec["mounts"] += after or []
    (b / "config.json").write_text(json.dumps(spec))


def _host_dir(tmp: Path) -> Path:
    d = tmp / "host-dir"
    d.mkdir()
    (d / "keep").write_text("the host's\n")
    return d


@pytest.mark.parametrize(("at", "what"), [
    (_LIB, "mount /usr/lib/x86_64-linux-gnu/"),       # the libraries (40 files before)
    ("/usr", "mount /usr/"),                           # parents too: lib/x86_64-linux-gnu/...
    ("/usr/bin", "mount /usr/bin/"),                   # the binaries
    ("/usr/share", "mount /usr/share/"),               # ICD and EGL files
    ("/run", "mount /run/"),                           # persistenced's and fabricmanager's sockets
    ("/dev", "deviceNode /dev/nvidia"),                # runc's mknod
], ids=["lib", "usr", "bin", "share", "run", "dev"])
@pytest.mark.parametrize("ro", [False, True], ids=["rw", "ro"])
def test_cdi_create_refuses_to_create_on_a_bound_host_dir(env: Env, spec_dir: Path, at: str,
                                                          what: str, ro: bool) -> None:
    """Before: runc made the CDI mounts' mount points (40 empty files at the library
    dir) in the host's directory; legacy mode's hook refuses the same start."""
    from support.fs import snapshot as tree
    from support.runtime import assert_clean_failure

    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])
    _bind_host_dir(b, host, at, ro=ro)
    before, spec_before = tree(host), snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"lies on the host directory {host}")
    assert what in r.stderr, r.stderr
    assert "nvctk creates nothing on a host directory bound into a container" in r.stderr
    assert tree(host) == before
    assert snapshot(b / "config.json") == spec_before


def test_cdi_create_refuses_a_link_on_a_bound_host_dir(env: Env, spec_dir: Path) -> None:
    """Every mount target already in the host's directory: the links hook would still
    create libcuda.so there."""
    from support.runtime import assert_clean_failure

    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    spec = load.load_spec_file(str(spec_dir / "nvidia.yaml"))
    edits = [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]
    for e in edits:
        for m in e.get("mounts", ()):
            if m["containerPath"].startswith(_LIB + "/"):
                (host / os.path.relpath(m["containerPath"], _LIB)).touch()
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])
    _bind_host_dir(b, host, _LIB)
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"link {_LIB}/libcuda.so lies on the host directory {host}")
    for e in edits:  # nothing left to create there: the create goes ahead
        for h in e.get("hooks", ()):
            for link in check._link_paths(h):
                if link.startswith(_LIB + "/"):
                    (host / os.path.relpath(link, _LIB)).touch()
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("at", ["/lib/x86_64-linux-gnu", "/lib", "/usr/../usr/lib//x86_64-linux-gnu/"])
def test_a_bind_reached_through_the_images_links_is_found(env: Env, spec_dir: Path,
                                                          rootfs: Callable[..., str],
                                                          at: str) -> None:
    """A merged-/usr image: /lib is a link to usr/lib, so a bind at /lib/x86_64-linux-gnu
    is where runc puts the CDI mounts of /usr/lib/x86_64-linux-gnu."""
    from support.fs import snapshot as tree
    from support.runtime import assert_clean_failure

    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"], rootfs=rootfs())
    assert os.path.islink(b / "rootfs/lib")
    _bind_host_dir(b, host, at)
    before = tree(host)
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"lies on the host directory {host}")
    assert tree(host) == before


@pytest.mark.parametrize("cover", ["tmpfs", "bind-of-a-fresh-dir"])
def test_cdi_create_is_fine_when_something_else_covers_the_bind(env: Env, spec_dir: Path,
                                                                cover: str) -> None:
    """A later mount at the same place hides the host's directory: runc creates the
    mount points on that one."""
    shutil.copytree(spec_dir, env.tmp / "cdi")
    host = _host_dir(env.tmp)
    fresh = env.tmp / "fresh"
    fresh.mkdir()
    over: dict[str, Any] = ({"destination": _LIB, "type": "tmpfs", "source": "tmpfs"}
                            if cover == "tmpfs" else
                            {"destination": "/usr", "type": "tmpfs", "source": "tmpfs"})
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])
    _bind_host_dir(b, host, _LIB, after=[over])
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(host)) == ["keep"]


@_real_runc_in_both_modes
def test_real_runc_creates_nothing_on_a_bound_host_dir(sim_host: SimHost, spec_dir: Path,
                                                       tmp_path: Path, mode: str) -> None:
    """Both modes, end to end: the start is refused and the host directory holds what
    it held."""
    from support.fs import snapshot as tree

    rootfs = _mode_setup(sim_host, spec_dir, tmp_path, mode)
    host = _host_dir(tmp_path)
    b = tmp_path / "b"
    spec = _rootfs_bundle(b, rootfs, ["true"], ["NVIDIA_VISIBLE_DEVICES=0"])
    spec["mounts"].append({"destination": _LIB, "type": "bind", "source": str(host),
                           "options": ["rbind", "rw"]})
    (b / "config.json").write_text(json.dumps(spec))
    before = tree(host)
    r = _runc_run(b, tmp_path / "c.toml", tmp_path / "runc-root")
    assert r.returncode != 0, r.stdout + r.stderr
    assert tree(host) == before


# --- CDI vendors a container may name ---------------------------------

_NET = {"cdiVersion": "0.5.0", "kind": "example.com/net",
        "devices": [{"name": "eth", "containerEdits": {"mounts": [
            {"hostPath": "/", "containerPath": "/host", "options": ["rbind", "rw"]}]}}]}


def _net_spec(env: Env, spec_dir: Path) -> None:
    shutil.copytree(spec_dir, env.tmp / "cdi")
    (env.tmp / "cdi" / "net.json").write_text(json.dumps(_NET))


@pytest.mark.parametrize(("envvars", "annotations", "mounts", "source"), [
    (["NVIDIA_VISIBLE_DEVICES=example.com/net=eth"], {}, [], "NVIDIA_VISIBLE_DEVICES"),
    (["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0,example.com/net=eth"], {}, [],
     "NVIDIA_VISIBLE_DEVICES"),
    (["NVIDIA_VISIBLE_DEVICES=NVIDIA.COM/gpu=0"], {}, [], "NVIDIA_VISIBLE_DEVICES"),
    (["NVIDIA_VISIBLE_DEVICES=nvidia.com.example.com/gpu=0"], {}, [], "NVIDIA_VISIBLE_DEVICES"),
    ([], {"cdi.k8s.io/x": "example.com/net=eth"}, [], "annotation cdi.k8s.io/x"),
    ([], {}, ["example.com/net=eth"], "/var/run/nvidia-container-devices mounts"),
], ids=["env", "env-mixed", "env-case", "env-lookalike", "annotation", "device-mount"])
def test_another_vendors_device_is_refused(env: Env, spec_dir: Path, envvars: list[str],
                                           annotations: dict[str, str], mounts: list[str],
                                           source: str) -> None:
    """Before: example.com/net=eth from the env bound the host's / read-write."""
    from support.runtime import assert_clean_failure

    _net_spec(env, spec_dir)
    if mounts:
        env.config.write_text(_with(env.config.read_text(), accept_volume_mount_devices="true"))
    b = _bundle(env.tmp, envvars)
    spec = json.loads((b / "config.json").read_text())
    spec["annotations"] = annotations
    spec["mounts"] += [{"destination": f"/var/run/nvidia-container-devices/{m}", "type": "bind",
                        "source": "/dev/null", "options": ["bind"]} for m in mounts]
    (b / "config.json").write_text(json.dumps(spec))
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, f"(from {source}): vendor ")
    assert "is not one nvctk applies devices of (cdi-vendors = ['nvidia.com', 'nvctk.io']" \
        in r.stderr, r.stderr
    assert snapshot(b / "config.json") == before


def test_an_operator_can_allow_another_vendor(env: Env, spec_dir: Path) -> None:
    _net_spec(env, spec_dir)
    env.config.write_text(_with(env.config.read_text(),
                                cdi_vendors='["nvidia.com", "example.com"]'))
    b = _bundle(env.tmp, ["NVIDIA_VISIBLE_DEVICES=example.com/net=eth"])
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    mounts = json.loads((b / "config.json").read_text())["mounts"]
    assert {"destination": "/host", "source": "/", "options": ["rbind", "rw"],
            "type": "bind"} in mounts


@pytest.mark.parametrize("value", ['["nvidia.com/gpu"]', '[""]', '["a b"]', '"nvidia.com"'])
def test_cdi_vendors_key_is_checked(value: str) -> None:
    with pytest.raises(ConfigError, match="cdi-vendors"):
        parse(f"cdi-vendors = {value}\n", "c.toml")


# --- the driver's configuration files in both modes ---------------------------

_CONFIG_FILES = ("/etc/OpenCL/vendors/nvidia.icd", "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json",
                 "/usr/share/egl/egl_external_platform.d/09_nvidia_wayland2.json",
                 "/usr/share/egl/egl_external_platform.d/20_nvidia_xcb.json",
                 "/usr/share/egl/egl_external_platform.d/20_nvidia_xlib.json",
                 "/usr/share/X11/xorg.conf.d/10-nvidia.conf",
                 "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf")


@_real_runc_in_both_modes
def test_config_files_reach_the_container_in_both_modes(sim_host: SimHost, spec_dir: Path,
                                                        tmp_path: Path, mode: str) -> None:
    """NVIDIA's spec mounts these seven; nvctk's did not (OpenCL found no platform)."""
    rootfs = _mode_setup(sim_host, spec_dir, tmp_path, mode)
    b = tmp_path / "b"
    script = "; ".join(f"test -s {f} && echo present {f}" for f in _CONFIG_FILES) + "; true"
    spec = _rootfs_bundle(b, rootfs, ["sh", "-c", script],
                          ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"])
    (b / "config.json").write_text(json.dumps(spec))
    r = _runc_run(b, tmp_path / "c.toml", tmp_path / "runc-root")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [x.split()[1] for x in r.stdout.splitlines() if x.startswith("present ")] == \
        list(_CONFIG_FILES)
