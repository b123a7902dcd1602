"""This node as the DRA plugin sees it: nvctk's config, the GPUs, nvctk's CDI forms of
them (made once: a claim's spec is written from them), the XID watcher's health."""

from __future__ import annotations

import os
import re

from nvctk.base import config as nvconfig
from nvctk.cdi import generate as cdi_generate
from nvctk.dra.claims import ClaimSource
from nvctk.dra.devices import node_devices
from nvctk.dra.driver import API_TIMEOUT, CdiForms, Driver, Inventory, Shares
from nvctk.dra.record import Records
from nvctk.dra.slices import DEFAULT_TAINTS, TaintPolicy
from nvctk.host import nvml
from nvctk.host.inventory import HostInfo, proc_bus_id
from nvctk.host.paths import find_hook, spec_hook_env, vgpu_library
from nvctk.k8s.health import Health

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.dra import kube

RECORDS_DIR = "claims"  # below <plugins-dir>/<driver>
_PCIE_ROOT = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}")


def sick(health: Health, policy: TaintPolicy) -> set[str]:
    """The devices whose health the policy taints: the ones prepare refuses."""
    return {u for u, why in health.snapshot().items() if policy.effect(why) is not None}


def claim_source(kubeconfig: str | None) -> kube.Kube:
    """The API server's claims (nvctk.dra.kube: the official client, with retry)."""
    from nvctk.dra import kube  # the client costs ~0.2 s to import: the plugin's only

    return kube.Kube(kube.load_client(kubeconfig))


def cdi_forms(cfg: nvconfig.Config, host: HostInfo, config_path: str | None) -> CdiForms:
    """nvctk's CDI forms of every GPU and MIG device (what `nvctk cdi generate` writes),
    by uuid; the hook finds nvctk's config as `nvctk cdi generate`'s does."""
    common, devices = cdi_generate.host_edits(cfg, host, ("uuid",))
    return CdiForms(common, {names[0]: e for names, e in devices}, find_hook(cfg),
                    spec_hook_env(cfg, config_path))


def pcie_roots(driver_root: str, host: HostInfo) -> dict[str, str]:
    """sysfs bus id -> the PCIe root complex it hangs off ("pci0000:17"), as
    <root>/sys/bus/pci/devices/<bus id> resolves; a GPU sysfs does not show is left out."""
    out: dict[str, str] = {}
    for g in host.gpus:
        bus = proc_bus_id(g.pci_bus_id)
        try:
            real = os.path.realpath(os.path.join(driver_root, "sys/bus/pci/devices", bus),
                                    strict=True)
        except OSError:
            continue
        root = next((p for p in real.split("/") if _PCIE_ROOT.fullmatch(p)), None)
        if root is not None:
            out[bus] = root
    return out


def make_driver(name: str, node_name: str, source: ClaimSource, plugins_dir: str,
                cdi_dir: str, health: Health, api_timeout: float = API_TIMEOUT,
                cfg: nvconfig.Config | None = None, host: HostInfo | None = None,
                config_path: str | None = None, policy: TaintPolicy = DEFAULT_TAINTS
                ) -> tuple[Driver, HostInfo, str]:
    """(the driver, the host, its driver root). config_path: the nvctk config the hooks
    of the claims' specs load (default: $NVCTK_CONFIG, else theirs). policy: which
    unhealthy devices are tainted, and so refused (a non-fatal XID's are not)."""
    config_path = config_path or os.environ.get("NVCTK_CONFIG")
    cfg = cfg or nvconfig.load(config_path)
    host = host or nvml.query_host(cfg.driver_root)
    forms = cdi_forms(cfg, host, config_path)
    records = Records(os.path.join(plugins_dir, name, RECORDS_DIR))
    root = cfg.driver_root
    inventory = Inventory(lambda: nvml.query_host(root),
                          lambda h: cdi_forms(cfg, h, config_path), host)
    driver = Driver(name, node_name, node_devices(host), forms, source, records, cdi_dir,
                    Shares(cfg.state_dir, vgpu_library(cfg), cfg.driver_root,
                           nvconfig.host_driver_root(cfg)),
                    unhealthy=lambda: sick(health, policy), api_timeout=api_timeout,
                    inventory=inventory)
    return driver, host, cfg.driver_root
