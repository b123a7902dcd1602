"""`nvctk config default|show`."""

from __future__ import annotations

import os

import click

from nvctk.base import config as nvconfig
from nvctk.cli.common import load_config


@click.group()
def config() -> None:
    """Print nvctk's configuration."""


@config.command()
@click.option("--kubernetes", is_flag=True,
              help="a Kubernetes node's: a container's env selects no GPU; the device "
                   "plugin's mounts and CDI devices do")
def default(kubernetes: bool) -> None:
    """Every key with its default value and a comment (a valid config file)."""
    click.echo(f"# nvctk configuration ({nvconfig.DEFAULT_PATH}); NVCTK_CONFIG overrides the path")
    if kubernetes:
        click.echo("# for a Kubernetes node: GPUs only from the kubelet's allocations "
                   "(device plugin mounts, CDI), never from a container's env")
    cfg = nvconfig.Config(**(nvconfig.KUBERNETES_NODE if kubernetes else {}))
    click.echo(nvconfig.render(cfg), nl=False)


@config.command()
@click.pass_context
def show(ctx: click.Context) -> None:
    """The effective configuration (file values over defaults)."""
    cfg = load_config(ctx)
    path = (ctx.find_root().obj or {}).get("config_path") or nvconfig.config_path()
    if cfg.path:
        click.echo(f"# effective configuration from {cfg.path}")
    elif os.path.exists(path):
        click.echo(f"# effective configuration from {path}")
    else:
        click.echo(f"# effective configuration: defaults ({path} does not exist)")
    click.echo(nvconfig.render(cfg, comments=False), nl=False)
