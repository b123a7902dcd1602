"""`nvctk labels`: GPU Feature Discovery style node labels (nvctk.k8s.labels), written for
Node Feature Discovery's features.d and/or set on this node through the API server."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from nvctk.base.errors import NvctkError
from nvctk.base.fileio import NotRegularFile
from nvctk.cli.common import load_node_config


@click.command("labels")
@click.option("--output", default=None, metavar="FILE",
              help="write here atomically (e.g. /etc/kubernetes/node-feature-discovery/"
                   "features.d/nvctk); default: stdout, unless --node-name")
@click.option("--config", "config_file", default=None, metavar="FILE",
              help="the device plugin's YAML config (sharing and MIG strategy labels)")
@click.option("--node-name", default=None, metavar="NAME",
              help="set the labels on this Node through the API server (and remove those "
                   "nvctk set there before and no longer applies; no one else's)")
@click.option("--kubeconfig", default=None, metavar="FILE",
              help="with --node-name: the API server's kubeconfig (default: in-cluster)")
@click.option("--interval", type=click.FloatRange(min=0, max=86400), default=0,
              metavar="SECONDS", help="keep them current: again every SECONDS until SIGTERM "
                                      "(default 0: once)")
@click.pass_context
def labels(ctx: click.Context, output: str | None, config_file: str | None,
           node_name: str | None, kubeconfig: str | None, interval: float) -> None:
    """GPU Feature Discovery style node labels."""
    # start time: NVML and the plugin's config, for this command only
    from nvctk.k8s import labels as lb
    from nvctk.k8s.node import setup

    kube: Any = None
    if node_name:
        from nvctk.dra.kube import Kube, load_client  # start time: the API client, here only

        kube = Kube(load_client(kubeconfig))
    stop = threading.Event()
    if interval:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    last = ""
    while True:
        try:
            cfg, _root, host = setup(config_file, load_node_config(ctx))
            out = lb.node_labels(host, cfg)
            if output is not None:
                lb.write_labels(output, out)
            elif kube is None:
                click.echo(lb.format_labels(out), nl=False)
            if kube is not None:
                patch = lb.node_patch(kube.get_node(node_name), out)
                if patch is not None:
                    kube.patch_node_metadata(node_name, *patch)
                    click.echo(f"node {node_name}: labels set ({len(out)}), "
                               f"{sum(v is None for v in patch[0].values())} removed", err=True)
            last = ""
        except (NvctkError, NotRegularFile, OSError) as e:
            why = f"cannot write {e}" if isinstance(e, NotRegularFile) else (
                f"{output}: cannot write: {e.strerror or e}" if isinstance(e, OSError) else str(e))
            if not interval:
                raise click.ClickException(why)
            if why != last:  # a lasting cause logged once, its end by the next success
                click.echo(f"nvctk labels: {why} (again in {interval:g} s)", err=True)
            last = why
        if not interval or stop.wait(interval):
            return
