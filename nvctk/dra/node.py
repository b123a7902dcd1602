"""This node as the DRA plugin sees it: nvctk's config, the GPUs, nvctk's CDI forms of
them (made once: a claim's spec is written from them), the XID watcher's health."""

from __future__ import annotations

import os

from nvctk.base import config as nvconfig
from nvctk.cdi import generate as cdi_generate
from nvctk.dra.claims import ClaimSource
from nvctk.dra.devices import node_devices
from nvctk.dra.driver import API_TIMEOUT, CdiForms, Driver, Inventory, Shares
from nvctk.dra.record import Records
from nvctk.host import nvml
from nvctk.host.inventory import HostInfo
from nvctk.host.paths import find_hook, vgpu_library
from nvctk.k8s.health import Health

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.dra import kube

RECORDS_DIR = "claims"  # below <plugins-dir>/<driver>


def claim_source(kubeconfig: str | None) -> kube.Kube:
    """The API server's claims (nvctk.dra.kube: the official client, with retry)."""
    from nvctk.dra import kube  # the client costs ~0.2 s to import: the plugin's only

    return kube.Kube(kube.load_client(kubeconfig))


def cdi_forms(cfg: nvconfig.Config, host: HostInfo, config_path: str | None) -> CdiForms:
    """nvctk's CDI forms of every GPU and MIG device (what `nvctk cdi generate` writes),
    by uuid; the hook finds nvctk's config as `nvctk cdi generate`'s does."""
    common, devices = cdi_generate.host_edits(cfg, host, ("uuid",))
    env = (f"NVCTK_CONFIG={os.path.abspath(config_path)}",) if config_path else ()
    return CdiForms(common, {names[0]: e for names, e in devices}, find_hook(cfg), env)


def make_driver(name: str, node_name: str, source: ClaimSource, plugins_dir: str,
                cdi_dir: str, health: Health, api_timeout: float = API_TIMEOUT,
                cfg: nvconfig.Config | None = None, host: HostInfo | None = None,
                config_path: str | None = None) -> tuple[Driver, HostInfo, str]:
    """(the driver, the host, its driver root). config_path: the nvctk config the hooks
    of the claims' specs load (default: $NVCTK_CONFIG, else theirs)."""
    config_path = config_path or os.environ.get("NVCTK_CONFIG")
    cfg = cfg or nvconfig.load(config_path)
    host = host or nvml.query_host(cfg.driver_root)
    forms = cdi_forms(cfg, host, config_path)
    records = Records(os.path.join(plugins_dir, name, RECORDS_DIR))
    root = cfg.driver_root
    inventory = Inventory(lambda: nvml.query_host(root),
                          lambda h: cdi_forms(cfg, h, config_path), host)
    driver = Driver(name, node_name, node_devices(host), forms, source, records, cdi_dir,
                    Shares(cfg.state_dir, vgpu_library(cfg), cfg.driver_root),
                    unhealthy=lambda: set(health.unhealthy), api_timeout=api_timeout,
                    inventory=inventory)
    return driver, host, cfg.driver_root
