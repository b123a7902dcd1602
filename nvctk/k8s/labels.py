"""GPU-Feature-Discovery-style node labels (REFERENCE §8), written as a
Node Feature Discovery `features.d` file (`key=value` lines)."""

from __future__ import annotations

from typing import Any

from nvctk.base import fileio
from nvctk.host.inventory import HostInfo
from nvctk.k8s.config import PluginConfig

P = "nvidia.com/"
# the label every nvctk DaemonSet selects besides NFD's PCI vendor label (GPU Operator's
# name): kept current by `nvctk labels --node-name`
PRESENT = P + "gpu.present"
# the node annotation listing the labels nvctk set there (so it removes only its own)
OWNED = "nvctk.io/labels"
# compute capability major -> architecture family, as GFD names them
FAMILIES = {3: "kepler", 5: "maxwell", 6: "pascal", 7: "volta", 8: "ampere", 9: "hopper",
            10: "blackwell"}


def _family(major: int, minor: int) -> str:
    if (major, minor) >= (7, 5) and major == 7:
        return "turing"
    if (major, minor) == (8, 9):
        return "ada-lovelace"
    return FAMILIES.get(major, "undefined")


def node_labels(host: HostInfo, cfg: PluginConfig) -> dict[str, str]:
    out: dict[str, str] = {}
    gpus = host.gpus
    d = host.driver_version.split(".")
    out[P + "cuda.driver-version.full"] = host.driver_version
    out[P + "cuda.driver-version.major"] = d[0]
    out[P + "cuda.driver-version.minor"] = d[1] if len(d) > 1 else "0"
    out[P + "cuda.driver-version.revision"] = d[2] if len(d) > 2 else "0"
    c = host.cuda_version.split(".")
    out[P + "cuda.runtime-version.full"] = host.cuda_version
    out[P + "cuda.runtime-version.major"] = c[0]
    out[P + "cuda.runtime-version.minor"] = c[1] if len(c) > 1 else "0"
    out[P + "gpu.count"] = str(len(gpus))
    out[PRESENT] = "true" if gpus else "false"
    out[P + "mig.strategy"] = cfg.mig_strategy
    if not gpus:
        return out
    g = gpus[0]  # GFD labels the node by its first GPU (nodes are homogeneous)
    major, minor = (int(x) for x in g.compute_capability.split(".")[:2])
    product = g.name.replace(" ", "-")
    out[P + "gpu.memory"] = str(g.memory_mib)
    out[P + "gpu.family"] = _family(major, minor)
    out[P + "gpu.compute.major"] = str(major)
    out[P + "gpu.compute.minor"] = str(minor)
    out[P + "mig.capable"] = str((major, minor) in ((8, 0), (9, 0)) or g.mig_enabled).lower()
    migs = [m for x in gpus if x.mig_enabled for m in x.mig_devices]
    if cfg.mig_strategy == "single" and migs:
        m = migs[0]
        product = f"{product}-MIG-{m.profile}"
        out[P + "gpu.count"] = str(len(migs))
        out[P + "gpu.memory"] = str(m.memory_mib)
    if cfg.mig_strategy == "mixed":
        for prof in sorted({m.profile for m in migs}):
            same = [m for m in migs if m.profile == prof]
            out[f"{P}mig-{prof}.count"] = str(len(same))
            out[f"{P}mig-{prof}.memory"] = str(same[0].memory_mib)
    strategy, replicas = "none", 1
    if cfg.sharing == "time-slicing":
        strategy = "time-slicing"
        replicas = max(t.replicas for t in cfg.time_sliced)
        renamed = cfg.rename_by_default or any(t.rename for t in cfg.time_sliced)
        if not renamed:  # GFD marks a shared GPU in the product when its name is kept
            product += "-SHARED"
        for t in cfg.time_sliced:
            if t.name.startswith(P + "mig-"):
                out[f"{t.name}.replicas"] = str(t.replicas)
    elif cfg.sharing == "vgpu":
        strategy, replicas = "vgpu", cfg.vgpu_replicas
    elif cfg.sharing == "mps":
        strategy, replicas = "mps", 100
        out[P + "mps.memory-units"] = str(g.memory_mib // 1024)
    out[P + "gpu.product"] = product
    out[P + "gpu.sharing-strategy"] = strategy
    out[P + "gpu.replicas"] = str(replicas)
    return dict(sorted(out.items()))


def format_labels(labels: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in labels.items())


def write_labels(path: str, labels: dict[str, str]) -> None:
    """Atomically (NFD may read the file at any time), mode 0644; only a regular file
    (or nothing) is replaced (fileio.replace_regular_file: NotRegularFile otherwise)."""
    fileio.replace_regular_file(path, format_labels(labels).encode(), 0o644)


def node_patch(node: dict[str, Any], wanted: dict[str, str]
               ) -> tuple[dict[str, str | None], dict[str, str | None]] | None:
    """The merge patch (labels, annotations) that makes a Node (its API JSON) carry
    wanted and none of the labels nvctk set before and no longer wants (those the OWNED
    annotation lists; another's labels are never removed); None when it has them."""
    meta = node.get("metadata") or {}
    have: dict[str, str] = meta.get("labels") or {}
    owned = [k for k in ((meta.get("annotations") or {}).get(OWNED) or "").split(",") if k]
    labels: dict[str, str | None] = {k: v for k, v in wanted.items() if have.get(k) != v}
    labels.update({k: None for k in owned if k not in wanted and k in have})
    keys = ",".join(sorted(wanted))
    if not labels and ",".join(sorted(owned)) == keys:
        return None
    return labels, {OWNED: keys}
