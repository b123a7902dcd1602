"""`nvctk device-plugin`: the kubelet device plugin (logic in nvctk.k8s)."""

from __future__ import annotations

import logging
import sys

import click

from nvctk.base.errors import NvctkError
from nvctk.k8s import DEFAULT_KUBELET_DIR

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.host.inventory import HostInfo
    from nvctk.k8s.config import PluginConfig


def setup(config_file: str | None) -> tuple[PluginConfig, str, HostInfo]:
    import dataclasses

    from nvctk.base import config as nvconfig
    from nvctk.host import nvml
    from nvctk.k8s import config as dpconfig
    from nvctk.vgpu.authority import load_key

    cfg = dpconfig.load(config_file)
    nv = nvconfig.load()
    driver_root = cfg.driver_root or nv.driver_root
    host = nvml.query_host(driver_root)
    cfg = dataclasses.replace(cfg, authority_key=nv.authority_key)
    if cfg.sharing == "vgpu":
        try:  # made now, so the runtime can check the first share's annotation
            load_key(nv.authority_key, create=True)
        except OSError as e:
            raise NvctkError(f"{nv.authority_key}: cannot make nvctk's authority key: {e.strerror}")
    return cfg, driver_root, host


@click.command("device-plugin")
@click.option("--kubelet-dir", default=DEFAULT_KUBELET_DIR, show_default=True, metavar="DIR",
              help="the kubelet's device-plugins directory (kubelet.sock)")
@click.option("--config", "config_file", default=None, metavar="FILE",
              help="the plugin's YAML config (default: whole GPUs, envvar)")
def device_plugin(kubelet_dir: str, config_file: str | None) -> None:
    """Kubernetes device plugin (API v1beta1): advertise GPUs, MIG devices and shares."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s nvctk-device-plugin %(levelname)s %(message)s")
    try:
        from nvctk.k8s import resources
        from nvctk.k8s.server import Manager

        cfg, driver_root, host = setup(config_file)
        res = resources.build(cfg, host)
        if not res:
            raise NvctkError("no GPU to advertise on this node")
        for r in res:
            click.echo(f"advertising {r.name}: {len(r.devices)} device(s)", err=True)
        mgr = Manager(res, cfg, driver_root, host, kubelet_dir)
        mgr.install_signal_handlers()
        mgr.run()
    except NvctkError as e:
        raise click.ClickException(str(e))
    click.echo("device plugin stopped", err=True)
