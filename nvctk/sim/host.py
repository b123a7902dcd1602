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

The stub libraries are written directly as minimal ELF shared objects (ELF64
x86-64 and ELF32 i386): loadable by the dynamic loader and readable by
ldconfig and objdump, built in microseconds and without a multilib compiler.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import subprocess
from dataclasses import dataclass
from types import ModuleType

from nvctk.base import config as nvconfig
from nvctk.base.errors import NvctkError
from nvctk.sim.topology import Topology

LIB64 = "usr/lib/x86_64-linux-gnu"
LIB32 = "usr/lib/i386-linux-gnu"
BIN = "usr/bin"
SAMPLES = "usr/share/nvidia-sim"  # test programs that belong in containers, not the driver
NVIDIA_MAJOR = 195
HOST_LDCONFIG = "/sbin/ldconfig"

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
DRM_MAJOR = 226  # the kernel's fixed DRM major
DRM_RENDER_BASE = 128  # renderD<128 + n> beside card<n>
PCI_VENDOR, PCI_DEVICE, PCI_CLASS = "0x10de", "0x2330", "0x030200"  # as the mock NVML says (H100 SXM, 3D controller)
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
# what `--force` clears before rebuilding (never anything else in DIR)
SIM_ENTRIES = ("usr", "dev", "proc", "sys", "lib", "run", "etc", "config.toml", "topology.json", "nvctk.log")


class SimError(NvctkError):
    pass


# ---------------------------------------------------------------- ELF stubs


def elf_stub(soname: str, *, bits: int = 64, needed: tuple[str, ...] = ("libc.so.6",)) -> bytes:
    """A minimal ELF shared object (x86-64 or i386) whose dynamic section names
    `soname`: one RW PT_LOAD, PT_DYNAMIC, PT_GNU_STACK (non-exec), a SysV hash
    table, an empty symbol table, and section headers for the tools."""
    if bits not in (32, 64):
        raise ValueError(bits)
    is64 = bits == 64
    e = "<"
    ehdr_size, phent, shent = (64, 56, 64) if is64 else (52, 32, 40)
    sym_size, dyn_fmt = (24, e + "qQ") if is64 else (16, e + "iI")
    dyn_size = struct.calcsize(dyn_fmt)
    align = 8 if is64 else 4

    def pad(b: bytearray, to: int) -> None:
        b.extend(b"\0" * (-len(b) % to))

    dynstr = bytearray(b"\0")
    offsets: dict[str, int] = {}
    for s in (*needed, soname):
        offsets[s] = len(dynstr)
        dynstr += s.encode() + b"\0"
    shstr = bytearray(b"\0")
    sh_names: dict[str, int] = {}
    for s in (".hash", ".dynsym", ".dynstr", ".dynamic", ".shstrtab"):
        sh_names[s] = len(shstr)
        shstr += s.encode() + b"\0"

    nph = 3
    body = bytearray(ehdr_size + nph * phent)  # headers filled in at the end
    pad(body, align)
    hash_off = len(body)
    body += struct.pack(e + "4I", 1, 1, 0, 0)  # nbucket, nchain, bucket[0], chain[0]
    pad(body, align)
    dynsym_off = len(body)
    body += b"\0" * sym_size
    dynstr_off = len(body)
    body += dynstr
    pad(body, align)
    dyn_off = len(body)
    tags = [(1, offsets[n]) for n in needed] + [
        (14, offsets[soname]),  # DT_SONAME
        (4, hash_off),  # DT_HASH
        (5, dynstr_off),  # DT_STRTAB
        (6, dynsym_off),  # DT_SYMTAB
        (10, len(dynstr)),  # DT_STRSZ
        (11, sym_size),  # DT_SYMENT
        (0, 0),  # DT_NULL
    ]
    for tag, val in tags:
        body += struct.pack(dyn_fmt, tag, val)
    dyn_len = len(body) - dyn_off
    load_size = len(body)
    shstr_off = len(body)
    body += shstr
    pad(body, align)
    sh_off = len(body)

    def shdr(
        name: int, typ: int, flags: int, off: int, size: int, link: int, al: int, ent: int,
        info: int = 0,
    ) -> bytes:
        if is64:
            return struct.pack(e + "IIQQQQIIQQ", name, typ, flags, off, off, size, link, info, al, ent)
        return struct.pack(e + "10I", name, typ, flags, off, off, size, link, info, al, ent)

    SHF_WRITE, SHF_ALLOC = 1, 2
    body += b"\0" * shent
    body += shdr(sh_names[".hash"], 5, SHF_ALLOC, hash_off, 16, 2, align, 4)
    body += shdr(sh_names[".dynsym"], 11, SHF_ALLOC, dynsym_off, sym_size, 3, align, sym_size, 1)
    body += shdr(sh_names[".dynstr"], 3, SHF_ALLOC, dynstr_off, len(dynstr), 0, 1, 0)
    body += shdr(sh_names[".dynamic"], 6, SHF_WRITE | SHF_ALLOC, dyn_off, dyn_len, 3, align, dyn_size)
    # .shstrtab is not loaded: its sh_addr must be 0
    sh_str = (
        struct.pack(e + "IIQQQQIIQQ", sh_names[".shstrtab"], 3, 0, 0, shstr_off, len(shstr), 0, 0, 1, 0)
        if is64
        else struct.pack(e + "10I", sh_names[".shstrtab"], 3, 0, 0, shstr_off, len(shstr), 0, 0, 1, 0)
    )
    body += sh_str
    nsh = 6

    ident = b"\x7fELF" + bytes([2 if is64 else 1, 1, 1, 0]) + b"\0" * 8
    machine = 62 if is64 else 3
    if is64:
        ehdr = ident + struct.pack(
            e + "HHIQQQIHHHHHH", 3, machine, 1, 0, ehdr_size, sh_off, 0, ehdr_size, phent, nph,
            shent, nsh, 5,
        )
        PF_R, PF_W = 4, 2
        ph = struct.pack(e + "IIQQQQQQ", 1, PF_R | PF_W, 0, 0, 0, load_size, load_size, 0x1000)
        ph += struct.pack(e + "IIQQQQQQ", 2, PF_R | PF_W, dyn_off, dyn_off, dyn_off, dyn_len, dyn_len, 8)
        ph += struct.pack(e + "IIQQQQQQ", 0x6474E551, PF_R | PF_W, 0, 0, 0, 0, 0, 16)
    else:
        ehdr = ident + struct.pack(
            e + "HHIIIIIHHHHHH", 3, machine, 1, 0, ehdr_size, sh_off, 0, ehdr_size, phent, nph,
            shent, nsh, 5,
        )
        PF_R, PF_W = 4, 2
        ph = struct.pack(e + "8I", 1, 0, 0, 0, load_size, load_size, PF_R | PF_W, 0x1000)
        ph += struct.pack(e + "8I", 2, dyn_off, dyn_off, dyn_off, dyn_len, dyn_len, PF_R | PF_W, 4)
        ph += struct.pack(e + "8I", 0x6474E551, 0, 0, 0, 0, 0, PF_R | PF_W, 16)
    body[: len(ehdr) + len(ph)] = ehdr + ph
    return bytes(body)


def read_soname(path: str) -> str | None:
    """DT_SONAME of an ELF file (32 or 64-bit, little-endian), via its program headers."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path}: not an ELF file")
    is64 = data[4] == 2
    if is64:
        phoff, phent, phnum = struct.unpack_from("<Q", data, 32)[0], *struct.unpack_from("<HH", data, 54)
        ph_fmt, dyn_fmt = "<IIQQQQQQ", "<qQ"
    else:
        phoff, phent, phnum = struct.unpack_from("<I", data, 28)[0], *struct.unpack_from("<HH", data, 42)
        ph_fmt, dyn_fmt = "<8I", "<iI"
    loads, dynamic = [], None
    for i in range(phnum):
        fields = struct.unpack_from(ph_fmt, data, phoff + i * phent)
        if is64:
            ptype, _fl, off, vaddr, _pa, filesz = fields[:6]
        else:
            ptype, off, vaddr, _pa, filesz = fields[:5]
        if ptype == 1:
            loads.append((vaddr, off, filesz))
        elif ptype == 2:
            dynamic = (off, filesz)
    if dynamic is None:
        return None

    def v2o(addr: int) -> int:
        for vaddr, off, size in loads:
            if vaddr <= addr < vaddr + size:
                return addr - vaddr + off
        raise ValueError(f"{path}: address {addr:#x} is not in a PT_LOAD segment")

    step = struct.calcsize(dyn_fmt)
    strtab = soname = None
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], step):
        tag, val = struct.unpack_from(dyn_fmt, data, pos)
        if tag == 0:
            break
        if tag == 5:
            strtab = val
        elif tag == 14:
            soname = val
    if strtab is None or soname is None:
        return None
    start = v2o(strtab) + soname
    return data[start : data.index(b"\0", start)].decode()


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


def _used_char_majors(proc_devices: str = "/proc/devices") -> set[int]:
    used: set[int] = set()
    try:
        with open(proc_devices) as f:
            text = f.read()
    except OSError:
        return used
    for line in text.split("Block devices:")[0].splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            used.add(int(parts[0]))
    return used


def pick_free_majors(n: int, proc_devices: str = "/proc/devices") -> list[int]:
    """n character-device majors the running kernel does not use (from the dynamic
    ranges 234-254 and 384-511, highest first), so a node made with one opens nothing."""
    used = _used_char_majors(proc_devices) | {NVIDIA_MAJOR}
    candidates = [m for m in (*range(511, 383, -1), *range(254, 233, -1)) if m not in used]
    if len(candidates) < n:
        raise SimError("no free character-device majors for the simulated driver")
    return candidates[:n]


def _write(path: str, content: str | bytes, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    os.chmod(path, mode)


def _mknod(path: str, major: int, minor: int, mode: int = 0o666) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    except PermissionError:
        raise SimError(f"cannot create device node {path}: creating device nodes needs root")
    os.chmod(path, mode)  # not subject to the umask


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


def _proc_bus_id(pci_bus_id: str) -> str:
    """NVML's 00000000:1B:00.0 -> procfs's 0000:1b:00.0."""
    domain, rest = pci_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def _write_proc(root: str, topo: Topology, uvm_major: int, caps_major: int, drm_major: int) -> None:
    proc = os.path.join(root, "proc/driver/nvidia")
    v = topo.driver_version
    _write(
        os.path.join(proc, "version"),
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  (nvctk simulated driver)\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n",
    )
    params = {
        "ResmanDebugLevel": "4294967295", "RmLogonRC": "1", "ModifyDeviceFiles": "1",
        "DeviceFileUID": "0", "DeviceFileGID": "0", "DeviceFileMode": "438",
        "InitializeSystemMemoryAllocations": "1", "UsePageAttributeTable": "4294967295",
        "EnableMSI": "1", "EnablePCIeGen3": "0", "MemoryPoolSize": "0", "KMallocHeapMaxSize": "0",
        "VMallocHeapMaxSize": "0", "IgnoreMMIOCheck": "0", "EnableStreamMemOPs": "0",
        "EnableUserNUMAManagement": "1", "NvLinkDisable": "0", "RmProfilingAdminOnly": "1",
        "PreserveVideoMemoryAllocations": "0", "EnableS0ixPowerManagement": "0",
        "DynamicPowerManagement": "3", "RegisterPCIDriver": "1", "EnablePCIERelaxedOrderingMode": "0",
        "EnableGpuFirmware": "18", "EnableDbgBreakpoint": "0", "OpenRmEnableUnsupportedGpus": "1",
        "DmaRemapPeerMmio": "1",
    }
    _write(os.path.join(proc, "params"), "".join(f"{k}: {val}\n" for k, val in params.items()))
    _write(os.path.join(proc, "registry"), 'Binary: ""\n')
    for g in topo.gpus:
        bus = _proc_bus_id(g.pci_bus_id)
        _write(
            os.path.join(proc, "gpus", bus, "information"),
            f"Model: \t\t {g.name}\n"
            f"IRQ:   \t\t {100 + g.index}\n"
            f"GPU UUID: \t {g.uuid}\n"
            "Video BIOS: \t 96.00.5e.00.01\n"
            "Bus Type: \t PCIe\n"
            "DMA Size: \t 52 bits\n"
            "DMA Mask: \t 0xfffffffffffff\n"
            f"Bus Location: \t {bus}\n"
            f"Device Minor: \t {g.minor}\n"
            f"GPU Firmware: \t {v}\n"
            "GPU Excluded:\t No\n",
        )
        _write(os.path.join(proc, "gpus", bus, "power"), "Runtime D3 status:          Not supported\n")
        for m in g.mig_devices:
            gi_dir = os.path.join(proc, f"capabilities/gpu{g.minor}/mig/gi{m.gpu_instance}")
            _write(os.path.join(gi_dir, "access"), f"DeviceFileMinor: {m.gi_cap_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
            _write(
                os.path.join(gi_dir, f"ci{m.compute_instance}", "access"),
                f"DeviceFileMinor: {m.ci_cap_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
            )
    caps = os.path.join(proc, "capabilities/mig")
    _write(os.path.join(caps, "config"), "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    _write(os.path.join(caps, "monitor"), "DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    _write(
        os.path.join(root, "proc/devices"),
        "Character devices:\n"
        f"{NVIDIA_MAJOR} nvidia-frontend\n"
        f"{uvm_major} nvidia-uvm\n"
        f"{caps_major} nvidia-caps\n"
        f"{drm_major} drm\n"
        "\nBlock devices:\n",
    )


def _write_devices(root: str, topo: Topology, uvm_major: int, caps_major: int) -> None:
    dev = os.path.join(root, "dev")
    for g in topo.gpus:
        _mknod(os.path.join(dev, f"nvidia{g.minor}"), NVIDIA_MAJOR, g.minor)
    _mknod(os.path.join(dev, "nvidiactl"), NVIDIA_MAJOR, 255)
    _mknod(os.path.join(dev, "nvidia-modeset"), NVIDIA_MAJOR, 254)
    _mknod(os.path.join(dev, "nvidia-uvm"), uvm_major, 0)
    _mknod(os.path.join(dev, "nvidia-uvm-tools"), uvm_major, 1)
    caps = os.path.join(dev, "nvidia-caps")
    _mknod(os.path.join(caps, "nvidia-cap1"), caps_major, 1, 0o400)
    _mknod(os.path.join(caps, "nvidia-cap2"), caps_major, 2, 0o444)
    for g in topo.gpus:
        for m in g.mig_devices:
            for minor in (m.gi_cap_minor, m.ci_cap_minor):
                _mknod(os.path.join(caps, f"nvidia-cap{minor}"), caps_major, minor, 0o444)


def drm_nodes(g_minor: int) -> tuple[str, str]:
    """The DRM node names of the GPU with this minor: card<n>, renderD<128+n>
    (nvidia-drm numbers its nodes in probe order, as the nvidia minors are)."""
    return f"card{g_minor}", f"renderD{DRM_RENDER_BASE + g_minor}"


def _write_drm(root: str, topo: Topology, drm_major: int) -> None:
    """/dev/dri/card<n> and renderD<128+n> per GPU with the udev by-path links
    (what NCT reads the DRM nodes of a bus id from, and its warning when absent),
    and the sysfs facts a GPU's DRM nodes are found by on a real host:
    sys/bus/pci/devices/<busid>/drm/{card<n>,renderD<m>}/dev ("226:n") and
    sys/class/drm/<node> links (NCT reads the host's real /sys, not the driver root)."""
    dev = os.path.join(root, "dev/dri")
    for g in topo.gpus:
        bus = _proc_bus_id(g.pci_bus_id)
        card, render = drm_nodes(g.minor)
        _mknod(os.path.join(dev, card), drm_major, g.minor, 0o660)
        _mknod(os.path.join(dev, render), drm_major, DRM_RENDER_BASE + g.minor, 0o666)
        os.makedirs(os.path.join(dev, "by-path"), exist_ok=True)
        os.symlink(f"../{card}", os.path.join(dev, "by-path", f"pci-{bus}-card"))
        os.symlink(f"../{render}", os.path.join(dev, "by-path", f"pci-{bus}-render"))
        pci = os.path.join(root, "sys/devices/pci0000:00", bus)
        for name, value in (("vendor", PCI_VENDOR), ("device", PCI_DEVICE), ("class", PCI_CLASS)):
            _write(os.path.join(pci, name), value + "\n")
        for node, minor in ((card, g.minor), (render, DRM_RENDER_BASE + g.minor)):
            _write(os.path.join(pci, "drm", node, "dev"), f"{drm_major}:{minor}\n")
            os.makedirs(os.path.join(root, "sys/class/drm"), exist_ok=True)
            os.symlink(f"../../devices/pci0000:00/{bus}/drm/{node}", os.path.join(root, "sys/class/drm", node))
        os.makedirs(os.path.join(root, "sys/bus/pci/devices"), exist_ok=True)
        os.symlink(f"../../../devices/pci0000:00/{bus}", os.path.join(root, "sys/bus/pci/devices", bus))


def _write_graphics_configs(root: str, topo: Topology) -> None:
    v = topo.driver_version
    egl = {"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}
    _write(os.path.join(root, "usr/share/glvnd/egl_vendor.d/10_nvidia.json"), json.dumps(egl, indent=4) + "\n")
    vk = {
        "file_format_version": "1.0.0",
        "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": "1.3.277"},
    }
    _write(os.path.join(root, "usr/share/vulkan/icd.d/nvidia_icd.json"), json.dumps(vk, indent=4) + "\n")
    layers = {
        "file_format_version": "1.0.0",
        "layer": {
            "name": "VK_LAYER_NV_optimus", "type": "INSTANCE", "library_path": "libGLX_nvidia.so.0",
            "api_version": "1.3.277", "implementation_version": "1",
            "description": f"NVIDIA Optimus layer ({v})",
        },
    }
    _write(
        os.path.join(root, "usr/share/vulkan/implicit_layer.d/nvidia_layers.json"),
        json.dumps(layers, indent=4) + "\n",
    )
    # the names other packagings use (older drivers put the layers file in icd.d,
    # RPMs name the ICD file per architecture): NCT looks for each of them
    _write(os.path.join(root, "usr/share/vulkan/icd.d/nvidia_layers.json"), json.dumps(layers, indent=4) + "\n")
    _write(os.path.join(root, "usr/share/vulkan/icd.d/nvidia_icd.x86_64.json"), json.dumps(vk, indent=4) + "\n")
    platforms = {
        "15_nvidia_gbm.json": "libnvidia-egl-gbm.so.1",
        "10_nvidia_wayland.json": "libnvidia-egl-wayland.so.1",
        "09_nvidia_wayland2.json": "libnvidia-egl-wayland2.so.1",
        "20_nvidia_xcb.json": "libnvidia-egl-xcb.so.1",
        "20_nvidia_xlib.json": "libnvidia-egl-xlib.so.1",
    }
    for name, lib in platforms.items():
        doc = {"file_format_version": "1.0.0", "ICD": {"library_path": lib}}
        _write(os.path.join(root, "usr/share/egl/egl_external_platform.d", name), json.dumps(doc, indent=4) + "\n")
    _write(os.path.join(root, "usr/share/nvidia/nvoptix.bin"), b"NVSIM-OPTIX\0" + v.encode() + b"\0")
    xorg = (
        'Section "OutputClass"\n    Identifier "nvidia"\n    MatchDriver "nvidia-drm"\n'
        '    Driver "nvidia"\n    Option "AllowEmptyInitialConfiguration"\n'
        '    ModulePath "/usr/lib/xorg/modules"\nEndSection\n'
    )
    _write(os.path.join(root, "usr/share/X11/xorg.conf.d/10-nvidia.conf"), xorg)
    _write(os.path.join(root, "usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"), xorg)
    _write(os.path.join(root, "etc/OpenCL/vendors/nvidia.icd"), "libnvidia-opencl.so.1\n")


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
        _write(os.path.join(lib32, f"{name}.so.{v}"), elf_stub(sonames[name].format(v=v), bits=32), 0o755)


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
    _write(os.path.join(root, "etc/ld.so.conf"), f"/{LIB64}\n/{LIB32}\n")
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
    drm_major = spare if DRM_MAJOR in _used_char_majors() else DRM_MAJOR
    os.makedirs(os.path.join(root, "run/nvidia-sim"), exist_ok=True)
    os.makedirs(os.path.join(root, "run/nvctk"), exist_ok=True)
    try:
        _write_stubs(root, topology)
    except (OSError, RuntimeError, ValueError) as e:
        raise SimError(f"building the driver's stub libraries failed: {e}")
    _build_mocks(root, topology)
    _run_ldconfig(root, ldconfig)
    _write_devices(root, topology, uvm_major, caps_major)
    _write_drm(root, topology, drm_major)
    _write_proc(root, topology, uvm_major, caps_major, drm_major)
    _write_graphics_configs(root, topology)
    fw = os.path.join(root, "lib/firmware/nvidia", topology.driver_version)
    for name in FIRMWARE:
        _write(os.path.join(fw, name), b"NVSIM-GSP\0" + name.encode() + b"\0")
    _bind_socket(os.path.join(root, "run/nvidia-persistenced/socket"))
    _bind_socket(os.path.join(root, "run/nvidia-fabricmanager/socket"))
    _write(os.path.join(root, "topology.json"), topology.to_json() + "\n")
    _write(
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
