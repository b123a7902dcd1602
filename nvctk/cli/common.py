"""What the `nvctk` subcommands share: the effective config of one invocation."""

from __future__ import annotations

import click

from nvctk.base import config as nvconfig


def load_config(ctx: click.Context) -> nvconfig.Config:
    """The effective config for this invocation (--config, NVCTK_CONFIG, default path),
    loaded once."""
    root = ctx.find_root()
    obj = root.obj if isinstance(root.obj, dict) else {}
    if "config" not in obj:
        obj["config"] = nvconfig.load(obj.get("config_path"))
        root.obj = obj
    cfg: nvconfig.Config = obj["config"]
    return cfg
