"""`nvctk sim init DIR`: build a simulated NVIDIA host (see nvctk.sim.host)."""

from __future__ import annotations

import click

from nvctk.sim import host
from nvctk.sim.topology import MIG_PROFILES, make_topology


def _parse_mig(values: tuple[str, ...]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for v in values:
        gpu, sep, profiles = v.partition(":")
        if not sep or not gpu.strip().isdigit() or not profiles.strip():
            raise click.BadParameter(
                f"{v!r}: expected GPU:PROFILE[,PROFILE...], e.g. 0:3g.40gb,1g.10gb", param_hint="--mig"
            )
        out.setdefault(int(gpu), []).extend(p.strip() for p in profiles.split(",") if p.strip())
    return out


@click.group()
def sim() -> None:
    """The simulated NVIDIA host (tests and demos on machines without a GPU)."""


@sim.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--gpus", type=click.IntRange(0, 16), default=2, show_default=True)
@click.option(
    "--mig",
    multiple=True,
    metavar="GPU:PROFILE[,PROFILE...]",
    help=f"MIG devices of a GPU (repeatable); profiles: {', '.join(MIG_PROFILES)}",
)
@click.option("--driver-version", default="550.54.15", show_default=True)
@click.option("--cuda-version", default="12.4", show_default=True)
@click.option("--memory-mib", type=click.IntRange(1024), default=81920, show_default=True,
              help="memory per GPU")
@click.option("--product", default="NVIDIA H100 80GB HBM3", show_default=True,
              help="GPU product name")
@click.option("--force", is_flag=True, help="rebuild in a non-empty DIR")
def init(
    directory: str, gpus: int, mig: tuple[str, ...], driver_version: str, cuda_version: str,
    memory_mib: int, product: str, force: bool,
) -> None:
    """Write a complete simulated host to DIR, with DIR/config.toml pointing at it."""
    try:
        topo = make_topology(
            gpus=gpus, mig=_parse_mig(mig), driver_version=driver_version,
            cuda_version=cuda_version, memory_mib=memory_mib, product=product,
        )
    except ValueError as e:
        raise host.SimError(str(e))
    h = host.init(directory, topo, force=force)
    nmig = sum(len(g.mig_devices) for g in topo.gpus)
    click.echo(
        f"simulated host in {h.root}: driver {topo.driver_version}, CUDA {topo.cuda_version}, "
        f"{len(topo.gpus)} GPU(s), {nmig} MIG device(s)"
    )
    click.echo(f"use it with: export NVCTK_CONFIG={h.config_path}")
