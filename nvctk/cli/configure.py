"""`nvctk configure --runtime containerd|docker|crio [...] [--remove]`."""

from __future__ import annotations

import os

import click

from nvctk.base.errors import ConfigError
from nvctk.engines import common, containerd, crio, docker, restart
from nvctk.engines.changes import RESTART, plan_configure, plan_remove
from nvctk.engines.common import ConfigChanges, EngineRequest


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
@click.option("--restart-mode", type=click.Choice(restart.MODES), default="none",
              show_default=True,
              help="then make the engine take it: SIGHUP to it (containerd exits on it and "
                   "its service manager restarts it), systemctl restart, or nothing; and wait "
                   "until it answers with the runtime (without it, after --remove)")
@click.option("--socket", "engine_socket", metavar="PATH", default="",
              help="the engine's socket (default: " + ", ".join(
                  f"{k} {v}" for k, v in restart.SOCKETS.items()) + ")")
@click.option("--host-root", metavar="DIR", default="/", show_default=True,
              help="where the host's / is (systemd mode runs systemctl chrooted there)")
@click.option("--restart-timeout", type=click.FloatRange(min=0.1, max=3600), default=60,
              show_default=True, metavar="SECONDS",
              help="how long the engine may take to answer after the restart")
def configure(engine: str, config_file: str, drop_in: str, name: str, runtime_path: str,
              set_as_default: bool, cdi: bool, remove: bool, dry_run: bool, restart_mode: str,
              engine_socket: str, host_root: str, restart_timeout: float) -> None:
    """Add nvctk-runtime to containerd's, Docker's or CRI-O's config (or --remove it).

    Edits keep comments, order and every other setting; a second run changes no
    byte; the replaced file is kept as <file>.bak.
    """
    req = _request(name, runtime_path, set_as_default, cdi, config_file, drop_in, remove)
    plan = plan_remove(engine, req) if remove else plan_configure(engine, req)
    # with --dry-run stdout is the file(s) alone; what nvctk says goes to stderr
    say_err = dry_run
    for note in plan.notes:
        click.echo(f"nvctk: {note}", err=say_err)
    if dry_run:
        _show(plan)
        return
    how = restart.Restart(engine, restart_mode, engine_socket, host_root, timeout=restart_timeout)
    if restart_mode == "signal":
        restart.engine_pid(how.sock)  # an engine to signal, before anything is written
    if not plan.changed:
        click.echo(f"nvctk: {', '.join(c.path for c in plan.changes if c.new is not None) or 'nothing'}"
                   " already as wanted: nothing written")
        if restart_mode == "none":
            click.echo(f"nvctk: if {engine} has not been restarted since, restart it: "
                       f"{RESTART[engine]}")
        else:
            _take(how, name, not remove, only_if_needed=True)
        return
    for line in common.apply(plan):
        click.echo(f"nvctk: {line}")
    if restart_mode == "none":
        click.echo(f"nvctk: restart {engine} for this to take effect: {RESTART[engine]}")
        return
    _take_or_undo(how, engine, req, remove)


def _request(name: str, runtime_path: str, set_as_default: bool, cdi: bool, config_file: str,
             drop_in: str, remove: bool) -> EngineRequest:
    """The request of the command line, its runtime name and path checked."""
    if not name or any(c in name for c in "/\\\n\"'") or name.strip() != name:
        raise ConfigError(f"--name {name!r}: not a usable runtime name")
    if remove:
        # what remove compares against: nvctk-runtime may be gone already
        path = os.path.abspath(runtime_path) if runtime_path else ""
    elif runtime_path:
        path = common.check_runtime_path(runtime_path)
    else:
        path = common.default_runtime_path()
    return EngineRequest(name=name, runtime_path=path or "", set_as_default=set_as_default,
                         cdi=cdi, config=config_file, drop_in=drop_in)


def _show(plan: ConfigChanges) -> None:
    """--dry-run: the resulting file(s) on stdout (a header each when several)."""
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


def _take_or_undo(how: restart.Restart, engine: str, req: EngineRequest, remove: bool) -> None:
    """The engine made to take the written config; where it does not come back with the
    runtime, the config put back as it was (the change may be why) and the engine
    restarted again, then a failure saying so."""
    name = req.name
    try:
        _take(how, name, not remove)
    except restart.EngineError as e:
        if remove:
            raise
        for line in common.apply(plan_remove(engine, req)):
            click.echo(f"nvctk: undone: {line}")
        try:
            _take(how, name, False)
        except restart.EngineError as again:
            raise restart.EngineError(f"{e}; the config is restored, and {again}")
        raise restart.EngineError(f"{e}; nvctk's change is undone and {engine} restarted "
                                  "without it")


def _take(how: restart.Restart, name: str, present: bool, only_if_needed: bool = False) -> None:
    """The engine made to take its config (how.mode), then waited for until it answers
    with (present) or without the handler name."""
    if only_if_needed:
        try:
            if (name in restart.handlers(how.engine, how.sock)) == present:
                click.echo(f"nvctk: {how.engine} serves it as wanted")
                return
        except restart.EngineError:
            pass  # not answering: restarted below
    done = restart.poke(how)
    click.echo(f"nvctk: {done}; waiting until it answers {'with' if present else 'without'} "
               f"runtime {name!r}")
    restart.wait_for(how, name, present)
    click.echo(f"nvctk: {how.engine} answers {'with' if present else 'without'} runtime {name!r}")
