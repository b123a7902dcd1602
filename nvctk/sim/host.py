"""`nvctk sim init DIR`: a complete simulated NVIDIA host in a directory.

DIR becomes a driver root (REFERENCE §3, §4):

- usr/lib/x86_64-linux-gnu: the mock libnvidia-ml and libcuda (compiled by
  nvctk.sim.build) and ELF stubs with the real SONAMEs for every other driver
  library; usr/lib/i386-linux-gnu: 32-bit stubs of the same (compat32);
  etc/ld.so.cache written by the host's real `ldconfig -r DIR`;
- usr/bin: nvidia-smi (mock) and stand-ins for the other driver binaries;
- dev: real character nodes (nvidia<minor>, nvidiactl, nvidia-modeset on 195;
  nvidia-uvm*, nvidia-caps/* on majors the host's /proc/devices does not use;
  dri/card<n>, dri/renderD<128+n> on 226 unless the host has DRM, with the
  dri/by-path/pci-<busid>-{card,render} links);
- proc: driver/nvidia/{version,params,registry,gpus/<busid>/information,
  capabilities/...} and a `devices` file naming the sim's majors;
- sys: bus/pci/devices/<busid> (vendor, device, class, drm/<node>/dev) and
  class/drm/<node>, the facts a GPU's DRM nodes are found by;
- lib/firmware/nvidia/<ver>/gsp_*.bin, run/nvidia-persistenced/socket,
  run/nvidia-fabricmanager/socket, run/nvidia-sim (the shared GPU state), the
  graphics/display files (EGL platform, Vulkan, X11, OpenCL configs, X modules);
- config.toml (driver-root = DIR, ...) and topology.json.

The 32-bit stub libraries are written directly as minimal ELF shared objects
(nvctk.sim.elf); the device nodes, procfs and sysfs files by nvctk.sim.kernel_files.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from types import ModuleType

from nvctk.base import config as nvconfig
from nvctk.base.errors import NvctkError
from nvctk.sim.elf import elf_stub, read_soname
from nvctk.sim.errors import SimError
from nvctk.sim.kernel_files import (
    DRM_MAJOR,
    NVIDIA_MAJOR,
    drm_nodes,
    pick_free_majors,
    used_char_majors,
    write_devices,
    write_drm,
    write_file,
    write_proc,
)
from nvctk.sim.topology import Topology

LIB64 = "usr/lib/x86_64-linux-gnu"
LIB32 = "usr/lib/i386-linux-gnu"
BIN = "usr/bin"
SAMPLES = "usr/share/nvidia-sim"  # test programs that belong in containers, not the driver
HOST_LDCONFIG = "/sbin/ldconfig"

# what callers name as nvctk.sim.host.<name>, the pieces built beside it included
__all__ = [
    "BIN", "DRM_MAJOR", "EXTRA_LIBRARIES", "FIRMWARE", "HOST_LDCONFIG", "LIB32", "LIB64",
    "MOCK_LIBRARIES", "NVIDIA_MAJOR", "SAMPLES", "SIM_ENTRIES", "STUB_BINARIES",
    "STUB_LIBRARIES", "STUB_LIBRARIES_32", "XORG_MODULES", "SimError", "SimHost", "drm_nodes",
    "elf_stub", "init", "load", "pick_free_majors", "read_soname", "sim_config",
]

# The driver's libraries other than the two mocks, with their SONAMEs ("{v}" = the
# driver version). Mirrors nvctk.host.driver's capability lists.
STUB_LIBRARIES: dict[str, str] = {
    # utility
    "libnvidia-cfg": "libnvidia-cfg.so.1",
    "libnvidia-nscq": "libnvidia-nscq.so.2",
    # compute
    "libcudadebugger": "libcudadebugger.so.1",
    "libnvidia-opencl": "libnvidia-opencl.so.1",
    "libnvidia-gpucomp": "libnvidia-gpucomp.so.{v}",
    "libnvidia-ptxjitcompiler": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-fatbinaryloader": "libnvidia-fatbinaryloader.so.{v}",
    "libnvidia-allocator": "libnvidia-allocator.so.1",
    "libnvidia-compiler": "libnvidia-compiler.so.{v}",
    "libnvidia-pkcs11": "libnvidia-pkcs11.so.{v}",
    "libnvidia-pkcs11-openssl3": "libnvidia-pkcs11-openssl3.so.{v}",
    "libnvidia-nvvm": "libnvidia-nvvm.so.4",
    # video
    "libvdpau_nvidia": "libvdpau_nvidia.so.1",
    "libnvidia-encode": "libnvidia-encode.so.1",
    "libnvidia-opticalflow": "libnvidia-opticalflow.so.1",
    "libnvcuvid": "libnvcuvid.so.1",
    # graphics / display
    "libnvidia-eglcore": "libnvidia-eglcore.so.{v}",
    "libnvidia-glcore": "libnvidia-glcore.so.{v}",
    "libnvidia-tls": "libnvidia-tls.so.{v}",
    "libnvidia-glsi": "libnvidia-glsi.so.{v}",
    "libnvidia-fbc": "libnvidia-fbc.so.1",
    "libnvidia-ifr": "libnvidia-ifr.so.1",
    "libnvidia-rtcore": "libnvidia-rtcore.so.{v}",
    "libnvoptix": "libnvoptix.so.1",
    "libGLX_nvidia": "libGLX_nvidia.so.0",
    "libEGL_nvidia": "libEGL_nvidia.so.0",
    "libGLESv2_nvidia": "libGLESv2_nvidia.so.2",
    "libGLESv1_CM_nvidia": "libGLESv1_CM_nvidia.so.1",
    "libnvidia-glvkspirv": "libnvidia-glvkspirv.so.{v}",
    "libnvidia-cbl": "libnvidia-cbl.so.{v}",
    # ngx
    "libnvidia-ngx": "libnvidia-ngx.so.1",
}
MOCK_LIBRARIES = {"libnvidia-ml": "libnvidia-ml.so.1", "libcuda": "libcuda.so.1"}
# Further 64-bit files of a driver install that NVIDIA's toolkit looks for (file
# name -> SONAME): the EGL external platform libraries carry their own versions,
# libnvidia-nvvm70 (the NVVM 7.0 compiler kept beside libnvidia-nvvm) its SONAME's.
EXTRA_LIBRARIES: dict[str, str] = {
    "libnvidia-egl-gbm.so.1.1.1": "libnvidia-egl-gbm.so.1",
    "libnvidia-egl-wayland.so.1.1.13": "libnvidia-egl-wayland.so.1",
    "libnvidia-egl-wayland2.so.1.0.0": "libnvidia-egl-wayland2.so.1",
    "libnvidia-egl-xcb.so.1.0.0": "libnvidia-egl-xcb.so.1",
    "libnvidia-egl-xlib.so.1.0.0": "libnvidia-egl-xlib.so.1",
    "libnvidia-vulkan-producer.so.{v}": "libnvidia-vulkan-producer.so.{v}",
    "libnvidia-nvvm70.so.4": "libnvidia-nvvm70.so.4",
}
# X server modules, outside the loader's paths (path -> SONAME)
XORG_MODULES: dict[str, str] = {
    "usr/lib/xorg/modules/drivers/nvidia_drv.so": "nvidia_drv.so",
    "usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.{v}": "libglxserver_nvidia.so.{v}",
}
# 32-bit copies (compat32): what NVIDIA ships for i386
STUB_LIBRARIES_32 = (
    "libnvidia-ml", "libcuda", "libnvidia-opencl", "libnvidia-ptxjitcompiler",
    "libnvidia-allocator", "libnvidia-nvvm", "libnvidia-gpucomp", "libvdpau_nvidia",
    "libnvidia-encode", "libnvidia-opticalflow", "libnvcuvid", "libnvidia-eglcore",
    "libnvidia-glcore", "libnvidia-tls", "libnvidia-glsi", "libnvidia-fbc",
    "libGLX_nvidia", "libEGL_nvidia", "libGLESv2_nvidia", "libGLESv1_CM_nvidia",
    "libnvidia-glvkspirv",
)
STUB_BINARIES = (
    "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager",
    "nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
    "nvidia-xconfig", "nvidia-imex", "nvidia-imex-ctl",
)
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
# what `--force` clears before rebuilding (never anything else in DIR)
SIM_ENTRIES = ("usr", "dev", "proc", "sys", "lib", "run", "etc", "config.toml", "topology.json", "nvctk.log")


# ---------------------------------------------------------------- the host


@dataclass(frozen=True)
class SimHost:
    """A built simulated host. Paths are absolute host paths."""

    root: str
    topology: Topology
    uvm_major: int
    caps_major: int
    drm_major: int = DRM_MAJOR

    @property
    def config_path(self) -> str:
        return os.path.join(self.root, "config.toml")

    @property
    def lib_dir(self) -> str:
        return os.path.join(self.root, LIB64)

    @property
    def lib32_dir(self) -> str:
        return os.path.join(self.root, LIB32)

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.root, BIN)

    @property
    def dev_dir(self) -> str:
        return os.path.join(self.root, "dev")

    @property
    def proc_dir(self) -> str:
        return os.path.join(self.root, "proc/driver/nvidia")

    @property
    def state_dir(self) -> str:
        """The shared GPU state's directory (bound into containers at /run/nvidia-sim)."""
        return os.path.join(self.root, "run/nvidia-sim")

    @property
    def sample(self) -> str:
        """The cuda-vectoradd test program (for container rootfs, see nvctk.sim.rootfs)."""
        return os.path.join(self.root, SAMPLES, "cuda-vectoradd")

    @property
    def env(self) -> dict[str, str]:
        """Environment that points nvctk tools at this sim."""
        return {"NVCTK_CONFIG": self.config_path}


def _bind_socket(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if len(os.fsencode(path)) < 100:
            s.bind(path)
        else:  # sun_path is 108 bytes: go through the directory's fd
            fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                s.bind(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
            finally:
                os.close(fd)
    finally:
        s.close()


def _write_graphics_configs(root: str, topo: Topology) -> None:
    v = topo.driver_version
    egl = {"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}
    write_file(os.path.join(root, "usr/share/glvnd/egl_vendor.d/10_nvidia.json"), json.dumps(egl, indent=4) + "\n")
    vk = {
        "file_format_version": "1.0.0",
        "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": "1.3.277"},
    }
    write_file(os.path.join(root, "usr/share/vulkan/icd.d/nvidia_icd.json"), json.dumps(vk, indent=4) + "\n")
    layers = {
        "file_format_version": "1.0.0",
        "layer": {
            "name": "VK_LAYER_NV_optimus", "type": "INSTANCE", "library_path": "libGLX_nvidia.so.0",
            "api_version": "1.3.277", "implementation_version": "1",
            "description": f"NVIDIA Optimus layer ({v})",
        },
    }
    write_file(
        os.path.join(root, "usr/share/vulkan/implicit_layer.d/nvidia_layers.json"),
        json.dumps(layers, indent=4) + "\n",
    )
    # the names other packagings use (older drivers put the layers file in icd.d,
    # RPMs name the ICD file per architecture): NCT looks for each of them
    write_file(os.path.join(root, "usr/share/vulkan/icd.d/nvidia_layers.json"), json.dumps(layers, indent=4) + "\n")
    write_file(os.path.join(root, "usr/share/vulkan/icd.d/nvidia_icd.x86_64.json"), json.dumps(vk, indent=4) + "\n")
    platforms = {
        "15_nvidia_gbm.json": "libnvidia-egl-gbm.so.1",
        "10_nvidia_wayland.json": "libnvidia-egl-wayland.so.1",
        "09_nvidia_wayland2.json": "libnvidia-egl-wayland2.so.1",
        "20_nvidia_xcb.json": "libnvidia-egl-xcb.so.1",
        "20_nvidia_xlib.json": "libnvidia-egl-xlib.so.1",
    }
    for name, lib in platforms.items():
        doc = {"file_format_version": "1.0.0", "ICD": {"library_path": lib}}
        write_file(os.path.join(root, "usr/share/egl/egl_external_platform.d", name), json.dumps(doc, indent=4) + "\n")
    write_file(os.path.join(root, "usr/share/nvidia/nvoptix.bin"), b"NVSIM-OPTIX\0" + v.encode() + b"\0")
    xorg = (
        'Section "OutputClass"\n    Identifier "nvidia"\n    MatchDriver "nvidia-drm"\n'
        '    Driver "nvidia"\n    Option "AllowEmptyInitialConfiguration"\n'
        '    ModulePath "/usr/lib/xorg/modules"\nEndSection\n'
    )
    write_file(os.path.join(root, "usr/share/X11/xorg.conf.d/10-nvidia.conf"), xorg)
    write_file(os.path.join(root, "usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"), xorg)
    write_file(os.path.join(root, "etc/OpenCL/vendors/nvidia.icd"), "libnvidia-opencl.so.1\n")


def _write_stubs(root: str, topo: Topology) -> None:
    v = topo.driver_version
    lib64 = os.path.join(root, LIB64)
    lib32 = os.path.join(root, LIB32)
    os.makedirs(lib64, exist_ok=True)
    os.makedirs(lib32, exist_ok=True)
    build = _builder()
    for name, soname in STUB_LIBRARIES.items():
        # gcc-linked stubs (nvctk.sim.build); 32-bit ones are written directly (no multilib)
        build.build_stub_library(os.path.join(lib64, f"{name}.so.{v}"), soname.format(v=v))
    for fname, soname in EXTRA_LIBRARIES.items():
        build.build_stub_library(os.path.join(lib64, fname.format(v=v)), soname.format(v=v))
    for path, soname in XORG_MODULES.items():
        build.build_stub_library(os.path.join(root, path.format(v=v)), soname.format(v=v))
    sonames = {**STUB_LIBRARIES, **MOCK_LIBRARIES}
    for name in STUB_LIBRARIES_32:
        write_file(os.path.join(lib32, f"{name}.so.{v}"), elf_stub(sonames[name].format(v=v), bits=32), 0o755)


def _builder() -> ModuleType:
    try:  # start time: the mock builder (hashlib, apilist) only where a sim is built
        from nvctk.sim import build
    except ImportError as e:
        raise SimError(f"the mock driver builder (nvctk.sim.build) is not available: {e}")
    return build


def _build_mocks(root: str, topo: Topology) -> None:
    build = _builder()
    try:
        build.build_driver(topo, root, os.path.join(root, LIB64), os.path.join(root, BIN))
    except NvctkError:
        raise
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        raise SimError(f"building the mock driver failed: {e}")
    # the CUDA sample belongs in containers, not in the driver's bin dir
    os.makedirs(os.path.join(root, SAMPLES), exist_ok=True)
    os.replace(os.path.join(root, BIN, "cuda-vectoradd"), os.path.join(root, SAMPLES, "cuda-vectoradd"))
    # the programs not simulated: ELF executables, as the driver's are
    stub = os.path.join(root, BIN, build.STUB_PROGRAM)
    for name in STUB_BINARIES:
        shutil.copy2(stub, os.path.join(root, BIN, name))
    os.unlink(stub)


def _run_ldconfig(root: str, ldconfig: str) -> None:
    write_file(os.path.join(root, "etc/ld.so.conf"), f"/{LIB64}\n/{LIB32}\n")
    try:
        r = subprocess.run([ldconfig, "-r", root], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise SimError(f"cannot run {ldconfig}: {e.strerror}")
    if r.returncode != 0 or not os.path.isfile(os.path.join(root, "etc/ld.so.cache")):
        raise SimError(f"{ldconfig} -r {root} failed: {r.stderr.strip()}")


def sim_config(root: str, ldconfig: str = HOST_LDCONFIG) -> nvconfig.Config:
    return nvconfig.Config(
        driver_root=root,
        ldconfig=ldconfig,
        log_file=os.path.join(root, "nvctk.log"),
        log_level="debug",
        state_dir=os.path.join(root, "run/nvctk"),
        authority_key=os.path.join(root, "etc/nvctk-authority.key"),
        extra_mounts=(nvconfig.ExtraMount(os.path.join(root, "run/nvidia-sim"), "/run/nvidia-sim"),),
    )


def _prepare_dir(root: str, force: bool) -> None:
    if os.path.realpath(root) == "/":
        raise SimError("refusing to build a simulated host in /")
    if os.path.exists(root) and not os.path.isdir(root):
        raise SimError(f"{root} exists and is not a directory")
    os.makedirs(root, exist_ok=True)
    present = os.listdir(root)
    if present and not force:
        raise SimError(f"{root} is not empty (use --force to rebuild a simulated host there)")
    ours = [n for n in SIM_ENTRIES if n in present]
    if ours:
        # --force replaces a simulated host's entries, never someone's usr/, etc/, lib/
        try:
            load(root)
        except SimError:
            raise SimError(f"{root} holds {', '.join(ours)} but is not a simulated host nvctk "
                           "built (no readable topology.json): --force rebuilds only a "
                           "simulated host; nothing was removed")
    _clear(root)


def _clear(root: str) -> None:
    for name in SIM_ENTRIES:
        p = os.path.join(root, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


def init(directory: str, topology: Topology, *, force: bool = False, ldconfig: str = HOST_LDCONFIG) -> SimHost:
    """Build the simulated host for `topology` in `directory` (see the module doc).
    Refuses a non-empty directory unless `force`, which replaces only the sim's own
    entries. Needs root (device nodes)."""
    root = os.path.abspath(directory)
    if os.geteuid() != 0:
        raise SimError("nvctk sim init needs root: it creates device nodes")
    _prepare_dir(root, force)
    try:
        return _build(root, topology, ldconfig)
    except BaseException:
        _clear(root)  # no half-built sim that looks usable
        raise


def _build(root: str, topology: Topology, ldconfig: str) -> SimHost:
    uvm_major, caps_major, spare = pick_free_majors(3)
    # the real DRM major where this host has no DRM driver; else one that opens nothing
    drm_major = spare if DRM_MAJOR in used_char_majors() else DRM_MAJOR
    os.makedirs(os.path.join(root, "run/nvidia-sim"), exist_ok=True)
    os.makedirs(os.path.join(root, "run/nvctk"), exist_ok=True)
    try:
        _write_stubs(root, topology)
    except (OSError, RuntimeError, ValueError) as e:
        raise SimError(f"building the driver's stub libraries failed: {e}")
    _build_mocks(root, topology)
    _run_ldconfig(root, ldconfig)
    write_devices(root, topology, uvm_major, caps_major)
    write_drm(root, topology, drm_major)
    write_proc(root, topology, uvm_major, caps_major, drm_major)
    _write_graphics_configs(root, topology)
    fw = os.path.join(root, "lib/firmware/nvidia", topology.driver_version)
    for name in FIRMWARE:
        write_file(os.path.join(fw, name), b"NVSIM-GSP\0" + name.encode() + b"\0")
    _bind_socket(os.path.join(root, "run/nvidia-persistenced/socket"))
    _bind_socket(os.path.join(root, "run/nvidia-fabricmanager/socket"))
    write_file(os.path.join(root, "topology.json"), topology.to_json() + "\n")
    write_file(
        os.path.join(root, "config.toml"),
        "# nvctk configuration of the simulated host built by `nvctk sim init`\n"
        f"# use it with: export NVCTK_CONFIG={os.path.join(root, 'config.toml')}\n"
        + nvconfig.render(sim_config(root, ldconfig)),
    )
    return SimHost(root, topology, uvm_major, caps_major, drm_major)


def load(directory: str) -> SimHost:
    """The SimHost of an already built directory (topology.json and proc/devices)."""
    root = os.path.abspath(directory)
    try:
        with open(os.path.join(root, "topology.json")) as f:
            topo = Topology.from_json(f.read())
    except (OSError, ValueError, KeyError) as e:
        raise SimError(f"{root} is not a simulated host: {e}")
    majors: dict[str, int] = {}
    try:
        with open(os.path.join(root, "proc/devices")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0].isdigit():
                    majors[parts[1]] = int(parts[0])
    except OSError as e:
        raise SimError(f"{root} is not a simulated host: {e}")
    return SimHost(
        root, topo, majors.get("nvidia-uvm", 0), majors.get("nvidia-caps", 0), majors.get("drm", DRM_MAJOR)
    )
