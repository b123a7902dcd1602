"""`nvctk device-plugin`'s start on a simulated host: the node's authority key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvctk.sim.topology import make_topology


def test_plugin_start_makes_the_node_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nvctk device-plugin` with vGPU sharing makes the node's authority key (nvctk's
    config authority-key, root-only) before the first Allocate, and hands its path to
    Allocate; without vGPU sharing it makes none."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    from nvctk.base import config as nvconfig
    from nvctk.k8s import node
    from nvctk.sim import host

    sim = host.init(str(tmp_path / "h"), make_topology(gpus=1))
    monkeypatch.setenv("NVCTK_CONFIG", sim.config_path)
    key = Path(sim.root) / "etc/nvctk-authority.key"
    plain = tmp_path / "plain.yaml"
    plain.write_text("version: v1\n")
    c, _, _ = node.setup(str(plain), nvconfig.load())
    assert c.authority_key == str(key) and not key.exists()
    shared = tmp_path / "vgpu.yaml"
    shared.write_text("version: v1\nsharing: {vgpu: {replicas: 2}}\n")
    c, _, _ = node.setup(str(shared), nvconfig.load())
    assert c.authority_key == str(key)
    assert key.stat().st_mode & 0o7777 == 0o600 and key.stat().st_size == 32
