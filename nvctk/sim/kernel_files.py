"""What the simulated kernel driver shows: its device nodes under dev (nvidia<minor>,
nvidiactl, nvidia-uvm*, nvidia-caps/*, dri/card<n> and renderD<128+n> with their
by-path links), /proc/driver/nvidia and /proc/devices, and the sysfs facts a GPU's DRM
nodes are found by; and the character-device majors it takes where the host's kernel
has none."""

from __future__ import annotations

import os
import stat

from nvctk.sim.errors import SimError
from nvctk.sim.topology import Topology

NVIDIA_MAJOR = 195
DRM_MAJOR = 226  # the kernel's fixed DRM major
DRM_RENDER_BASE = 128  # renderD<128 + n> beside card<n>
PCI_VENDOR, PCI_DEVICE, PCI_CLASS = "0x10de", "0x2330", "0x030200"  # as the mock NVML says (H100 SXM, 3D controller)


def used_char_majors(proc_devices: str = "/proc/devices") -> set[int]:
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
    used = used_char_majors(proc_devices) | {NVIDIA_MAJOR}
    candidates = [m for m in (*range(511, 383, -1), *range(254, 233, -1)) if m not in used]
    if len(candidates) < n:
        raise SimError("no free character-device majors for the simulated driver")
    return candidates[:n]



def write_file(path: str, content: str | bytes, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    os.chmod(path, mode)


def mknod(path: str, major: int, minor: int, mode: int = 0o666) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    except PermissionError:
        raise SimError(f"cannot create device node {path}: creating device nodes needs root")
    os.chmod(path, mode)  # not subject to the umask


def proc_bus_id(pci_bus_id: str) -> str:
    """NVML's 00000000:1B:00.0 -> procfs's 0000:1b:00.0."""
    domain, rest = pci_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def write_proc(root: str, topo: Topology, uvm_major: int, caps_major: int, drm_major: int) -> None:
    proc = os.path.join(root, "proc/driver/nvidia")
    v = topo.driver_version
    write_file(
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
    write_file(os.path.join(proc, "params"), "".join(f"{k}: {val}\n" for k, val in params.items()))
    write_file(os.path.join(proc, "registry"), 'Binary: ""\n')
    for g in topo.gpus:
        bus = proc_bus_id(g.pci_bus_id)
        write_file(
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
        write_file(os.path.join(proc, "gpus", bus, "power"), "Runtime D3 status:          Not supported\n")
        for m in g.mig_devices:
            gi_dir = os.path.join(proc, f"capabilities/gpu{g.minor}/mig/gi{m.gpu_instance}")
            write_file(os.path.join(gi_dir, "access"), f"DeviceFileMinor: {m.gi_cap_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
            write_file(
                os.path.join(gi_dir, f"ci{m.compute_instance}", "access"),
                f"DeviceFileMinor: {m.ci_cap_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
            )
    caps = os.path.join(proc, "capabilities/mig")
    write_file(os.path.join(caps, "config"), "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    write_file(os.path.join(caps, "monitor"), "DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    write_file(
        os.path.join(root, "proc/devices"),
        "Character devices:\n"
        f"{NVIDIA_MAJOR} nvidia-frontend\n"
        f"{uvm_major} nvidia-uvm\n"
        f"{caps_major} nvidia-caps\n"
        f"{drm_major} drm\n"
        "\nBlock devices:\n",
    )


def write_devices(root: str, topo: Topology, uvm_major: int, caps_major: int) -> None:
    dev = os.path.join(root, "dev")
    for g in topo.gpus:
        mknod(os.path.join(dev, f"nvidia{g.minor}"), NVIDIA_MAJOR, g.minor)
    mknod(os.path.join(dev, "nvidiactl"), NVIDIA_MAJOR, 255)
    mknod(os.path.join(dev, "nvidia-modeset"), NVIDIA_MAJOR, 254)
    mknod(os.path.join(dev, "nvidia-uvm"), uvm_major, 0)
    mknod(os.path.join(dev, "nvidia-uvm-tools"), uvm_major, 1)
    caps = os.path.join(dev, "nvidia-caps")
    mknod(os.path.join(caps, "nvidia-cap1"), caps_major, 1, 0o400)
    mknod(os.path.join(caps, "nvidia-cap2"), caps_major, 2, 0o444)
    for g in topo.gpus:
        for m in g.mig_devices:
            for minor in (m.gi_cap_minor, m.ci_cap_minor):
                mknod(os.path.join(caps, f"nvidia-cap{minor}"), caps_major, minor, 0o444)


def drm_nodes(g_minor: int) -> tuple[str, str]:
    """The DRM node names of the GPU with this minor: card<n>, renderD<128+n>
    (nvidia-drm numbers its nodes in probe order, as the nvidia minors are)."""
    return f"card{g_minor}", f"renderD{DRM_RENDER_BASE + g_minor}"


def write_drm(root: str, topo: Topology, drm_major: int) -> None:
    """/dev/dri/card<n> and renderD<128+n> per GPU with the udev by-path links
    (what NCT reads the DRM nodes of a bus id from, and its warning when absent),
    and the sysfs facts a GPU's DRM nodes are found by on a real host:
    sys/bus/pci/devices/<busid>/drm/{card<n>,renderD<m>}/dev ("226:n") and
    sys/class/drm/<node> links (NCT reads the host's real /sys, not the driver root)."""
    dev = os.path.join(root, "dev/dri")
    for g in topo.gpus:
        bus = proc_bus_id(g.pci_bus_id)
        card, render = drm_nodes(g.minor)
        mknod(os.path.join(dev, card), drm_major, g.minor, 0o660)
        mknod(os.path.join(dev, render), drm_major, DRM_RENDER_BASE + g.minor, 0o666)
        os.makedirs(os.path.join(dev, "by-path"), exist_ok=True)
        os.symlink(f"../{card}", os.path.join(dev, "by-path", f"pci-{bus}-card"))
        os.symlink(f"../{render}", os.path.join(dev, "by-path", f"pci-{bus}-render"))
        pci = os.path.join(root, "sys/devices/pci0000:00", bus)
        for name, value in (("vendor", PCI_VENDOR), ("device", PCI_DEVICE), ("class", PCI_CLASS)):
            write_file(os.path.join(pci, name), value + "\n")
        for node, minor in ((card, g.minor), (render, DRM_RENDER_BASE + g.minor)):
            write_file(os.path.join(pci, "drm", node, "dev"), f"{drm_major}:{minor}\n")
            os.makedirs(os.path.join(root, "sys/class/drm"), exist_ok=True)
            os.symlink(f"../../devices/pci0000:00/{bus}/drm/{node}", os.path.join(root, "sys/class/drm", node))
        os.makedirs(os.path.join(root, "sys/bus/pci/devices"), exist_ok=True)
        os.symlink(f"../../../devices/pci0000:00/{bus}", os.path.join(root, "sys/bus/pci/devices", bus))

