"""`nvctk device-plugin`: the kubelet device plugin (logic in nvctk.k8s)."""

from __future__ import annotations

import logging
import sys

import click

from nvctk.base.errors import NvctkError
from nvctk.cli.common import load_node_config
from nvctk.k8s.kubelet import DEFAULT_KUBELET_DIR


@click.command("device-plugin")
@click.option("--kubelet-dir", default=DEFAULT_KUBELET_DIR, show_default=True, metavar="DIR",
              help="the kubelet's device-plugins directory (kubelet.sock)")
@click.option("--config", "config_file", default=None, metavar="FILE",
              help="the plugin's YAML config (default: whole GPUs, envvar)")
@click.pass_context
def device_plugin(ctx: click.Context, kubelet_dir: str, config_file: str | None) -> None:
    """Kubernetes device plugin (API v1beta1): advertise GPUs, MIG devices and shares."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s nvctk-device-plugin %(levelname)s %(message)s")
    try:
        # start time: grpc and NVML, for this command only (not `nvctk --help` or others)
        from nvctk.k8s import resources
        from nvctk.k8s.node import setup
        from nvctk.k8s.server import Manager

        cfg, driver_root, host = setup(config_file, load_node_config(ctx))
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
