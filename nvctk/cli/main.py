"""`nvctk`: the host CLI. Thin: one module per command group, logic lives in nvctk/.

Errors that carry a user message (NvctkError) print as one line,
"nvctk: <message>", on stderr and exit 1; no tracebacks.
"""

from __future__ import annotations

import sys

import click

from nvctk.base.errors import NvctkError
from nvctk.cli import (
    cdi_cmd,
    config_cmd,
    configure,
    device_plugin,
    dra_plugin,
    info,
    labels,
    monitor_cmd,
    sim,
    vgpu_cmd,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nvctk", prog_name="nvctk", message="%(prog)s %(version)s")
@click.option(
    "--config",
    "config_path",
    metavar="PATH",
    default=None,
    help="config file (default: $NVCTK_CONFIG, else /etc/nvctk/config.toml)",
)
@click.option("--driver-root", metavar="DIR", default=None, envvar="NVCTK_DRIVER_ROOT",
              help="where this process sees the driver (a node component's container: the "
                   "host's driver root mounted there); over the config's driver-root")
@click.option("--host-driver-root", metavar="DIR", default=None,
              envvar="NVCTK_HOST_DRIVER_ROOT",
              help="where that driver is on the host (written into CDI specs; default: the "
                   "config's driver-root when --driver-root moves it, else driver-root)")
@click.option("--hook-path", metavar="PATH", default=None, envvar="NVCTK_HOOK_PATH",
              help="nvctk-hook as the host runs it (written into CDI specs)")
@click.option("--vgpu-library", metavar="PATH", default=None, envvar="NVCTK_VGPU_LIBRARY",
              help="libvgpu.so as the host has it")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, driver_root: str | None,
        host_driver_root: str | None, hook_path: str | None, vgpu_library: str | None) -> None:
    """nvctk: give containers NVIDIA GPUs, whole or in shares."""
    ctx.obj = {"config_path": config_path,
               "overrides": {"driver-root": driver_root, "host-driver-root": host_driver_root,
                             "hook-path": hook_path, "vgpu-library": vgpu_library}}


cli.add_command(info.info)
cli.add_command(config_cmd.config)
cli.add_command(configure.configure)
cli.add_command(sim.sim)
cli.add_command(vgpu_cmd.vgpu)
cli.add_command(cdi_cmd.cdi_group)
cli.add_command(device_plugin.device_plugin)
cli.add_command(dra_plugin.dra_plugin)
cli.add_command(labels.labels)
cli.add_command(monitor_cmd.top)
cli.add_command(monitor_cmd.monitor)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="nvctk")
    except NvctkError as e:
        click.echo(f"nvctk: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
