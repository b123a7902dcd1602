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
def default() -> None:
    """Every key with its default value and a comment (a valid config file)."""
    click.echo(f"# nvctk configuration ({nvconfig.DEFAULT_PATH}); NVCTK_CONFIG overrides the path")
    click.echo(nvconfig.render(nvconfig.Config()), nl=False)


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
