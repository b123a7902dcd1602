"""The edits form's round trips: to JSON and back (what the runtime saves
for the hook), and through a CDI spec (`cdi generate`'s writer, then CDI mode's reader)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nvctk.cdi import generate, load, resolve
from nvctk.edits import (
    NVIDIA_HOOK_NAMES,
    VGPU_PINS,
    CdiHookArgs,
    DeviceNode,
    Edits,
    Hook,
    LogSettings,
    Mount,
    Symlink,
    Vgpu,
    cdi_hook_args,
)
from nvctk.plan.cdi import cdi_edits

HOOK = "/opt/nvctk/bin/nvctk-hook"


def _form(tmp_path: Path) -> tuple[Edits, list[tuple[list[str], Edits]]]:
    (tmp_path / "mps").mkdir()
    common = Edits(
        "550.1", (), (),
        devices=(DeviceNode("/dev/nvidiactl", "/h/dev/nvidiactl", 195, 255),),
        mounts=(Mount("/h/libcuda.so.550.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.550.1"),
                Mount("/h/socket", "/run/nvidia-persistenced/socket", "file", read_only=False,
                      noexec=True),
                Mount(str(tmp_path / "mps"), "/tmp/nvidia-mps", "dir", read_only=False,
                      noexec=True),
                Mount("/h/extra", "/extra", "file", read_only=False)),
        symlinks=(Symlink("/usr/lib/x86_64-linux-gnu/libcuda.so", "libcuda.so.1"),),
        lib_dir="/usr/lib/x86_64-linux-gnu", ldconfig="/sbin/ldconfig", env={"A": "1"})
    gpu0 = Edits("550.1", (), (), devices=(
        DeviceNode("/dev/nvidia0", "/h/dev/nvidia0", 195, 0),
        DeviceNode("/dev/dri/card1", "/h/dev/dri/card1", 226, 1, file_mode=0o660)),
        symlinks=(Symlink("/dev/dri/by-path/pci-0000:01:00.0-card", "../card1"),), ldconfig="")
    return common, [(["0", "GPU-a"], gpu0)]


def test_json_round_trip_keeps_every_field() -> None:
    vgpu = Vgpu("/lib/libvgpu.so", "/usr/lib/libvgpu.so", "/run/s", "/run/nvctk/vgpu",
                {"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, root_readonly=True,
                mounts=(Mount("/run/s/ro", "/run/nvctk", "dir", required=True),),
                preload_entries=("/usr/lib/libfoo.so",))
    e = Edits("550.1", ("compute",), ("GPU-a",),
              devices=(DeviceNode("/dev/x", "/h/x", 1, 3, "u", None, None, 5, "rw"),),
              mounts=(Mount("/a", "/b", options=("ro", "bind"), fs_type="bind"),),
              hooks=(Hook("prestart", HOOK, ("nvctk-hook", "prestart"), ("PATH=/bin",), 5),),
              vgpu=vgpu, log=LogSettings("/var/log/nvctk.log", "debug", "json"))
    back = Edits.from_json(e.to_json())
    assert back == e
    # the decisions the writers only execute are in the form, with today's defaults
    assert back.remove_hooks == NVIDIA_HOOK_NAMES
    assert back.seccomp_block_userns is True and back.pins == VGPU_PINS
    plain = Edits("550.1", (), ())
    assert (plain.seccomp_block_userns, plain.pins) == (False, ())
    assert Edits.from_json(plain.to_json()) == plain


def test_cdi_spec_round_trip(tmp_path: Path) -> None:
    """generate's spec, as JSON and read back by CDI mode, is the form again: per device
    the common edits and the device's own; one nvctk-hook createRuntime hook each."""
    common, devices = _form(tmp_path)
    spec = generate.make_spec(common, devices, HOOK)
    d = tmp_path / "specs"
    d.mkdir()
    (d / "nvctk.json").write_bytes(generate.dump(spec, "json"))
    assert json.loads((d / "nvctk.json").read_text()) == spec
    for name in ("0", "GPU-a", "all"):
        back = cdi_edits(resolve.read_devices(load.resolve((f"nvidia.com/gpu={name}",),
                                                           (str(d),))), "/sbin/ldconfig")
        gpu0 = devices[0][1]
        assert back.devices == (*common.devices, *gpu0.devices)
        assert back.mounts == common.mounts
        assert back.symlinks == (*common.symlinks, *gpu0.symlinks)
        assert (back.ldconfig, back.lib_dir, back.env) == ("/sbin/ldconfig", common.lib_dir,
                                                           common.env)
        assert back.hooks == ()
    hooks = [dev["containerEdits"]["hooks"] for dev in spec["devices"]]
    assert all(len(h) == 1 and h[0]["args"][1] == "cdi-edits" for h in hooks)
    assert "hooks" not in spec["containerEdits"]


def test_a_foreign_spec_stays_verbatim(tmp_path: Path) -> None:
    """Another spec's mounts and hooks (NVIDIA's nvidia-cdi-hook) are kept as they are:
    runc and that hook do them, not nvctk's hook."""
    hook = {"hookName": "createRuntime", "path": "/usr/bin/nvidia-cdi-hook",
            "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib64"]}
    mount = {"hostPath": "/h/libcuda.so", "containerPath": "/usr/lib64/libcuda.so",
             "options": ["ro", "nosuid", "nodev", "bind"]}
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "0", "containerEdits": {"deviceNodes": [
                {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]}}],
            "containerEdits": {"mounts": [mount], "hooks": [hook]}}
    d = tmp_path / "specs"
    d.mkdir()
    (d / "nvidia.json").write_text(json.dumps(spec))
    e = cdi_edits(resolve.read_devices(load.resolve(("nvidia.com/gpu=0",), (str(d),))),
                  "/sbin/x")
    assert e.mounts == (Mount("/h/libcuda.so", "/usr/lib64/libcuda.so",
                              options=("ro", "nosuid", "nodev", "bind")),)
    assert e.hooks == (Hook("createRuntime", "/usr/bin/nvidia-cdi-hook",
                            tuple(hook["args"])),)
    assert (e.symlinks, e.ldconfig) == ((), "")
    assert not e.has_hook_work()  # no nvctk prestart hook for a foreign spec


@pytest.mark.parametrize(("cmd", "args", "links", "folder", "pins"), [
    ("cdi-edits", ["--link", "a::/x", "--folder", "/l"], (Symlink("/x", "a"),), "/l", ()),
    ("cdi-edits", ["--folder", "/l"], (), "/l", ()),
    ("cdi-edits", ["--pin", "etc", "--pin", "run", "--pin", "etc", "--folder", "/l"], (), "/l",
     ("etc", "run")),
    ("cdi-edits", ["--pin", "run"], (), None, ("run",)),
    ("create-symlinks", ["--link", "a::/x", "--link", "b::/y"],
     (Symlink("/x", "a"), Symlink("/y", "b")), None, ()),
    ("update-ldcache", ["--folder", "/l"], (), "/l", ()),
])
def test_cdi_hook_args(cmd: str, args: list[str], links: tuple[Symlink, ...],
                       folder: str | None, pins: tuple[str, ...]) -> None:
    assert cdi_hook_args(cmd, args) == CdiHookArgs(links, folder, pins)


@pytest.mark.parametrize(("cmd", "args", "why"), [
    ("cdi-edits", ["--pin", "usr"], "--pin 'usr': want one of etc, run"),
    ("cdi-edits", ["--pin", "/etc"], "want one of etc, run"),
    ("update-ldcache", ["--pin", "etc"], "unexpected argument '--pin'"),
])
def test_cdi_hook_pins_only_a_vgpus_dirs(cmd: str, args: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        cdi_hook_args(cmd, args)
