"""What the `nvctk` subcommands share: the effective config of one invocation."""

from __future__ import annotations

import click

from nvctk.base import config as nvconfig


def load_config(ctx: click.Context) -> nvconfig.Config:
    """The effective config for this invocation (--config, NVCTK_CONFIG, default path,
    then nvctk's own options over it), loaded once."""
    root = ctx.find_root()
    obj = root.obj if isinstance(root.obj, dict) else {}
    if "config" not in obj:
        # the command line's (or the container's env's) settings over the file's
        obj["config"] = nvconfig.overridden(
            nvconfig.load(obj.get("config_path")), obj.get("overrides") or {},
            "the command line (--driver-root, ... or NVCTK_DRIVER_ROOT, ...)")
        root.obj = obj
    cfg: nvconfig.Config = obj["config"]
    return cfg


def load_node_config(ctx: click.Context) -> nvconfig.Config:
    """load_config, and the driver checked where it says (a node component's start: a
    DaemonSet's log then says which root is wrong and what to do)."""
    from nvctk.host.paths import check_driver_root  # start time: node commands only

    cfg = load_config(ctx)
    check_driver_root(cfg)
    return cfg
