"""This node as the device plugin and `nvctk labels` see it: the plugin's config, the
driver root, the GPUs."""

from __future__ import annotations

import dataclasses

from nvctk.base import config as nvconfig
from nvctk.base.errors import NvctkError
from nvctk.host import nvml
from nvctk.host.inventory import HostInfo
from nvctk.k8s import config as dpconfig
from nvctk.k8s.config import PluginConfig
from nvctk.vgpu.authority import load_key


def setup(config_file: str | None, nv: nvconfig.Config) -> tuple[PluginConfig, str, HostInfo]:
    """nv: nvctk's effective config (nvctk.cli.common.load_config)."""
    cfg = dpconfig.load(config_file)
    driver_root = cfg.driver_root or nv.driver_root
    host = nvml.query_host(driver_root)
    # the file's driverRoot is the host's own view; nvctk's may be a container's
    on_host = driver_root if cfg.driver_root else nvconfig.host_driver_root(nv)
    cfg = dataclasses.replace(cfg, authority_key=nv.authority_key, host_driver_root=on_host)
    if cfg.sharing == "vgpu":
        try:  # made now, so the runtime can check the first share's annotation
            load_key(nv.authority_key, create=True)
        except OSError as e:
            raise NvctkError(f"{nv.authority_key}: cannot make nvctk's authority key: {e.strerror}")
    return cfg, driver_root, host
