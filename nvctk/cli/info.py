"""`nvctk info [--json]`: the driver, its GPUs and MIG devices, and the driver's files."""

from __future__ import annotations

import json
from typing import Any

import click

from nvctk.base.config import ALL_CAPABILITIES
from nvctk.cli.common import load_config
from nvctk.host import driver, nvml


def info_dict(driver_root: str) -> dict[str, Any]:
    # Live NVML, never nvctk.host.cache's inventory cache: `nvctk info` is the diagnostic
    # that shows what the driver says now, also when the cache would be stale.
    host = nvml.query_host(driver_root)
    files = driver.discover_files(driver_root, host.driver_version)
    out = host.to_dict()
    out["driver_root"] = files.driver_root
    out["files"] = {cap: files.for_capabilities([cap]) for cap in ALL_CAPABILITIES}
    out["firmware"] = list(files.firmware)
    out["proc_dir"] = files.proc_dir
    out["dev_dir"] = files.dev_dir
    return out


def _human(d: dict[str, Any], list_files: bool) -> str:
    lines = [
        f"driver root:    {d['driver_root']}",
        f"driver version: {d['driver_version']}",
        f"CUDA version:   {d['cuda_version']}",
        f"GPUs:           {len(d['gpus'])}",
    ]
    for g in d["gpus"]:
        lines.append(
            f"  GPU {g['index']}: {g['name']} ({g['uuid']}) minor {g['minor']}, "
            f"bus {g['pci_bus_id']}, {g['memory_mib']} MiB, "
            f"compute {g['compute_capability']}, brand {g['brand']}"
            + (", MIG enabled" if g["mig_enabled"] else "")
        )
        for m in g["mig_devices"]:
            lines.append(
                f"    MIG {g['index']}:{m['index']}: {m['profile']} ({m['uuid']}) "
                f"GI {m['gpu_instance']} CI {m['compute_instance']}, {m['memory_mib']} MiB"
            )
    lines.append("files:" + ("" if list_files else " (--files lists them)"))
    for cap, paths in [*d["files"].items(), ("firmware", d["firmware"])]:
        lines.append(f"  {cap}: {len(paths)}")
        if list_files:
            lines += [f"    {p}" for p in paths]
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--files", "list_files", is_flag=True, help="list every driver file's path")
@click.pass_context
def info(ctx: click.Context, as_json: bool, list_files: bool) -> None:
    """Show the host's NVIDIA driver, GPUs, MIG devices and driver files."""
    cfg = load_config(ctx)
    d = info_dict(cfg.driver_root)
    click.echo(json.dumps(d, indent=2) if as_json else _human(d, list_files))
