"""NVIDIA's toolkit in bench/container_start.py: its CDI spec from `nvidia-ctk cdi
generate` and nvidia-container-runtime's config (read from NVIDIA_CTK_CONFIG_FILE_PATH:
nothing is written to /etc); the device nodes a spec gives a GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml  # reads nvctk's JSON spec as well as NCT's YAML

NODRM = "cdi without DRM"  # NCT cdi mode, its spec made where /sys lacks the sim's GPUs


def nct_generate(nct_bin: Path, sim_root: str, out: Path) -> None:
    """`nvidia-ctk cdi generate` for the simulated host into `out`."""
    out.parent.mkdir()
    subprocess.run([str(nct_bin / "nvidia-ctk"), "cdi", "generate",
                    f"--driver-root={sim_root}", f"--dev-root={sim_root}",
                    f"--nvidia-cdi-hook-path={nct_bin / 'nvidia-cdi-hook'}",
                    f"--output={out}"], check=True, capture_output=True)


def nct_config(mode: str, sim: str, spec_dir: Path, nct_bin: Path) -> str:
    return f"""accept-nvidia-visible-devices-envvar-when-unprivileged = true
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"
[nvidia-container-cli]
root = "{sim}"
ldconfig = "@/sbin/ldconfig"
load-kmods = false
[nvidia-container-runtime]
log-level = "info"
mode = "{mode}"
runtimes = ["runc"]
[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["{spec_dir}"]
[nvidia-ctk]
path = "{nct_bin / 'nvidia-ctk'}"
"""


def spec_nodes(path: Path, device: str = "0") -> str:
    """The container paths of a CDI spec's device nodes for `device`, as one string."""
    spec = yaml.safe_load(path.read_text())
    edits = [spec.get("containerEdits", {}),
             *(d["containerEdits"] for d in spec["devices"] if d["name"] == device)]
    return " ".join(sorted(n["path"] for e in edits for n in e.get("deviceNodes", ())))
