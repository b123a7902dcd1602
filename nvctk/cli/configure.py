"""`nvctk configure --runtime containerd|docker|crio [...] [--remove]`."""

from __future__ import annotations

import os

import click

from nvctk.base.errors import ConfigError
from nvctk.engines import common, containerd, crio, docker
from nvctk.engines.changes import RESTART, plan_configure, plan_remove
from nvctk.engines.common import EngineRequest


@click.command()
@click.option("--runtime", "engine", required=True,
              type=click.Choice(["containerd", "docker", "crio"]),
              help="the container engine to configure")
@click.option("--config", "config_file", metavar="PATH", default="",
              help=f"the engine's config file (default: {containerd.DEFAULT_CONFIG}, "
                   f"{docker.DEFAULT_CONFIG}, {crio.DEFAULT_CONFIG}; CRI-O's is only read)")
@click.option("--drop-in", metavar="PATH", default="",
              help="put the runtime into this drop-in file (containerd: and import it from "
                   f"the main file; CRI-O: always a drop-in, default {crio.DEFAULT_DROP_IN})")
@click.option("--name", default="nvidia", show_default=True,
              help="the runtime's name (a Kubernetes RuntimeClass's handler)")
@click.option("--runtime-path", metavar="PATH", default="",
              help="nvctk-runtime's absolute path (default: the one installed beside nvctk, "
                   "else the one on PATH)")
@click.option("--set-as-default", is_flag=True, help="make it the engine's default runtime")
@click.option("--cdi", is_flag=True, help="enable CDI in the engine too")
@click.option("--remove", is_flag=True, help="undo what configure added")
@click.option("--dry-run", is_flag=True,
              help="print the resulting file(s) on stdout and write nothing")
def configure(engine: str, config_file: str, drop_in: str, name: str, runtime_path: str,
              set_as_default: bool, cdi: bool, remove: bool, dry_run: bool) -> None:
    """Add nvctk-runtime to containerd's, Docker's or CRI-O's config (or --remove it).

    Edits keep comments, order and every other setting; a second run changes no
    byte; the replaced file is kept as <file>.bak.
    """
    if not name or any(c in name for c in "/\\\n\"'") or name.strip() != name:
        raise ConfigError(f"--name {name!r}: not a usable runtime name")
    if remove:
        # what remove compares against: nvctk-runtime may be gone already
        path = os.path.abspath(runtime_path) if runtime_path else ""
    elif runtime_path:
        path = common.check_runtime_path(runtime_path)
    else:
        path = common.default_runtime_path()
    req = EngineRequest(name=name, runtime_path=path or "", set_as_default=set_as_default, cdi=cdi,
                  config=config_file, drop_in=drop_in)
    plan = plan_remove(engine, req) if remove else plan_configure(engine, req)
    # with --dry-run stdout is the file(s) alone; what nvctk says goes to stderr
    say_err = dry_run
    for note in plan.notes:
        click.echo(f"nvctk: {note}", err=say_err)
    if dry_run:
        changed = [c for c in plan.changes if c.changed]
        shown = changed or [c for c in plan.changes if c.new is not None][-1:]
        for c in shown:
            if len(shown) > 1:
                click.echo(f"==> {c.path} <==")
            if c.new is None:
                click.echo(f"nvctk: would remove {c.path}", err=True)
            else:
                click.echo(c.new.decode("utf-8", "replace"), nl=False)
        click.echo("nvctk: dry run: nothing written", err=True)
        return
    if not plan.changed:
        click.echo(f"nvctk: {', '.join(c.path for c in plan.changes if c.new is not None) or 'nothing'}"
                   " already as wanted: nothing written")
        click.echo(f"nvctk: if {engine} has not been restarted since, restart it: {RESTART[engine]}")
        return
    for line in common.apply(plan):
        click.echo(f"nvctk: {line}")
    click.echo(f"nvctk: restart {engine} for this to take effect: {RESTART[engine]}")
