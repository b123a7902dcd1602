"""`nvctk cdi generate|list`: CDI specs for this host's GPUs (logic in nvctk.cdi.generate,
nvctk.cdi.load)."""

from __future__ import annotations

import os
import sys

import click

from nvctk.cdi import generate as cdi_generate
from nvctk.cdi import load
from nvctk.cli.common import load_node_config


@click.group()
def cdi_group() -> None:
    """Container Device Interface specs (for podman, containerd/CRI-O with CDI)."""


@cdi_group.command()
@click.option("--output", metavar="FILE", default=None,
              help="write the spec here (atomically, mode 0644); default: stdout")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default=None,
              help="default: from FILE's extension, else yaml")
@click.option("--device-name-strategy", "strategies", multiple=True,
              type=click.Choice(list(cdi_generate.STRATEGIES)),
              help="repeatable; default: index and uuid (as NVIDIA's toolkit)")
@click.option("--vendor", default=load.VENDOR, show_default=True)
@click.option("--class", "cls", default=load.CLASS, show_default=True)
@click.pass_context
def generate(ctx: click.Context, output: str | None, fmt: str | None,
             strategies: tuple[str, ...], vendor: str, cls: str) -> None:
    """A spec with one device per GPU and per MIG device, plus `all`."""
    from nvctk.host import nvml
    from nvctk.host.paths import find_hook, spec_hook_env

    for what, value in (("vendor", vendor), ("class", cls)):
        if not value or "/" in value or "=" in value:
            raise click.BadParameter(f"{value!r} (no '/' or '=', not empty)", param_hint=what)
    if fmt is None:
        fmt = "json" if output and output.endswith(".json") else "yaml"
    cfg = load_node_config(ctx)
    host = nvml.query_host(cfg.driver_root)
    root = ctx.find_root().obj or {}
    config_path = root.get("config_path") or os.environ.get("NVCTK_CONFIG")
    env = list(spec_hook_env(cfg, config_path))
    spec = cdi_generate.cdi_spec(cfg, host, find_hook(cfg), strategies=strategies or
                                 ("index", "uuid"), vendor=vendor, cls=cls, hook_env=env)
    data = cdi_generate.dump(spec, "json" if fmt == "json" else "yaml")
    if output is None:
        sys.stdout.buffer.write(data)
        return
    cdi_generate.write_spec(output, data)
    n = len(spec["devices"])
    click.echo(f"wrote {output}: {spec['kind']}, {n} device name(s), cdiVersion "
               f"{spec['cdiVersion']}", err=True)
    if vendor not in cfg.cdi_vendors:
        click.echo(f"note: nvctk-runtime applies devices of cdi-vendors {list(cfg.cdi_vendors)} "
                   f"only: add {vendor} there for containers to name {spec['kind']} devices "
                   "(CDI engines read the spec themselves)", err=True)


@cdi_group.command("list")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR",
              help=f"repeatable; default: {' and '.join(load.SPEC_DIRS)}")
def list_cmd(spec_dirs: tuple[str, ...]) -> None:
    """The qualified device names (vendor/class=name) the specs define."""
    names, warnings = load.list_devices(spec_dirs or load.SPEC_DIRS)
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    for n in names:
        click.echo(n)


cdi_group.name = "cdi"
