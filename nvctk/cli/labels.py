"""`nvctk labels`: GPU Feature Discovery style node labels (nvctk.k8s.labels)."""

from __future__ import annotations

import click

from nvctk.base.errors import NvctkError
from nvctk.base.fileio import NotRegularFile
from nvctk.cli.common import load_node_config


@click.command("labels")
@click.option("--output", default=None, metavar="FILE",
              help="write here atomically (e.g. /etc/kubernetes/node-feature-discovery/"
                   "features.d/nvctk); default: stdout")
@click.option("--config", "config_file", default=None, metavar="FILE",
              help="the device plugin's YAML config (sharing and MIG strategy labels)")
@click.pass_context
def labels(ctx: click.Context, output: str | None, config_file: str | None) -> None:
    """GPU Feature Discovery style node labels."""
    # start time: NVML and the plugin's config, for this command only
    from nvctk.k8s import labels as lb
    from nvctk.k8s.node import setup

    try:
        cfg, _root, host = setup(config_file, load_node_config(ctx))
        out = lb.node_labels(host, cfg)
    except NvctkError as e:
        raise click.ClickException(str(e))
    if output is None:
        click.echo(lb.format_labels(out), nl=False)
    else:
        try:
            lb.write_labels(output, out)
        except NotRegularFile as e:
            raise click.ClickException(f"cannot write {e}")
        except OSError as e:
            raise click.ClickException(f"{output}: cannot write: {e.strerror or e}")
