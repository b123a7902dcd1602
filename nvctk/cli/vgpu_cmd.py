"""`nvctk vgpu gc`: reclaim the vGPU state of containers that no longer exist."""

from __future__ import annotations

import click

from nvctk.cli.common import load_config


@click.group()
def vgpu() -> None:
    """GPU sharing (libvgpu) state on this host."""


@vgpu.command()
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="age after which a state dir without owner metadata is removed "
                   "(default: 300)")
@click.pass_context
def gc(ctx: click.Context, grace: float | None) -> None:
    """Remove the state dirs whose creator is gone and whose runtime has no such container.

    nvctk-runtime does this at every vGPU create and nvctk-hook in every poststop;
    this command is for a host where neither runs any more.
    """
    from nvctk.vgpu import gc as vgpu_gc

    cfg = load_config(ctx)
    errors: list[str] = []
    removed = vgpu_gc.collect(cfg, grace=vgpu_gc.GC_GRACE_S if grace is None else grace,
                              errors=errors)
    for message in errors:
        click.echo(f"nvctk: left in place: {message}", err=True)
    for path in removed:
        click.echo(f"removed {path}")
    click.echo(f"{len(removed)} stale vGPU state dir(s) removed from {cfg.state_dir}")
