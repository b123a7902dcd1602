"""NVIDIA's own toolkit (../shared/peers/nct, 1.20) against the simulated host.

`nvidia-ctk cdi generate` looks for every file of a driver install, loads the
mock NVML through go-nvml and reads the DRM nodes and links: on a complete host it
warns about nothing the host should have. It reads the DRM nodes from the running
kernel's /sys, so it runs where /sys shows the sim's PCI devices
(support.sim.show_sim_pci), as a real host's /sys shows its GPUs. What stays (each true of a real 550 host
too): libnvidia-sandboxutils is not part of driver 550, and /tmp/nvidia-mps
exists only while an MPS daemon runs (the sim has none).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from nvctk.sim import host
from support.sim import show_sim_pci

NCT_BIN = Path(__file__).resolve().parents[3] / "shared/peers/nct/bin"
NVIDIA_CTK = NCT_BIN / "nvidia-ctk"
VER = "550.54.15"

pytestmark = pytest.mark.skipif(
    not os.access(NVIDIA_CTK, os.X_OK), reason=f"NVIDIA's toolkit is not at {NCT_BIN}"
)

# warnings a real host with driver 550 and no MPS daemon gives as well
EXPECTED_WARNINGS = (
    re.compile(r"libnvidia-sandboxutils\.so\.1: not found"),
    re.compile(r"Failed to init nvsandboxutils: ERROR_LIBRARY_LOAD"),
    re.compile(r"Could not locate /tmp/nvidia-mps"),
)


@pytest.fixture(scope="module")
def nct_generate(
    sim_host: host.SimHost, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[str], dict[str, object]]:
    """The log lines and the spec of one `nvidia-ctk cdi generate` over the sim."""
    out = tmp_path_factory.mktemp("nct") / "nvidia.yaml"
    r = subprocess.run(
        [str(NVIDIA_CTK), "--debug", "cdi", "generate", f"--driver-root={sim_host.root}",
         f"--dev-root={sim_host.root}", f"--nvidia-cdi-hook-path={NCT_BIN / 'nvidia-cdi-hook'}",
         f"--output={out}"],
        capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: show_sim_pci(sim_host.root),
    )
    log = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 0, "\n".join(log[-30:])
    return log, yaml.safe_load(out.read_text())


def test_no_unexpected_warnings(nct_generate: tuple[list[str], dict[str, object]]) -> None:
    log, _ = nct_generate
    warnings = [line for line in log if "level=warning" in line]
    unexpected = [w for w in warnings if not any(p.search(w) for p in EXPECTED_WARNINGS)]
    assert not unexpected, "\n".join(unexpected)
    assert not [line for line in log if "Could not locate" in line and "nvidia-mps" not in line]
    assert not [line for line in log if "Failed to evaluate symlink" in line]


def test_drm_links_resolve(
    nct_generate: tuple[list[str], dict[str, object]], sim_host: host.SimHost
) -> None:
    """NCT reads each GPU's by-path links from the dev root and its DRM nodes from
    /sys/bus/pci/devices/<bus>/drm: each GPU's device in the spec has its card and
    render node."""
    log, spec = nct_generate
    text = "\n".join(log)
    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}  # type: ignore[attr-defined]
    for i, g in enumerate(sim_host.topology.gpus):
        bus = f"0000:{g.pci_bus_id.split(':', 1)[1].lower()}"
        for kind, node in (("card", f"card{g.minor}"), ("render", f"renderD{128 + g.minor}")):
            assert f"dri/by-path/pci-{bus}-{kind} -> ../{node}" in text
        nodes = {n["path"] for n in devices[str(i)]["deviceNodes"]}
        assert nodes == {f"/dev/nvidia{g.minor}", f"/dev/dri/card{g.minor}",
                         f"/dev/dri/renderD{128 + g.minor}"}


def test_spec_has_the_graphics_files(
    nct_generate: tuple[list[str], dict[str, object]], sim_host: host.SimHost
) -> None:
    _, spec = nct_generate
    edits = spec["containerEdits"]
    assert isinstance(edits, dict)
    mounted = {m["containerPath"] for m in edits["mounts"]}
    for want in (
        "/usr/lib/x86_64-linux-gnu/libnvidia-egl-gbm.so.1.1.1",
        "/usr/lib/x86_64-linux-gnu/libnvidia-egl-wayland2.so.1.0.0",
        f"/usr/lib/x86_64-linux-gnu/libnvidia-vulkan-producer.so.{VER}",
        "/usr/lib/x86_64-linux-gnu/libnvidia-nvvm70.so.4",
        "/usr/lib/xorg/modules/drivers/nvidia_drv.so",
        f"/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.{VER}",
        "/usr/bin/nvidia-imex",
        "/usr/share/egl/egl_external_platform.d/20_nvidia_xlib.json",
        "/usr/share/nvidia/nvoptix.bin",
        "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf",
        "/etc/OpenCL/vendors/nvidia.icd",
        "/etc/vulkan/icd.d/nvidia_icd.json",
        "/run/nvidia-fabricmanager/socket",
    ):
        assert want in mounted, want
    nodes = {d["path"] for d in edits["deviceNodes"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia-uvm"} <= nodes
    names = {d["name"] for d in spec["devices"]}  # type: ignore[attr-defined]
    assert {"0", "1", "all"} <= names
