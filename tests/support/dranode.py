"""What the DRA kubelet plugin's gRPC tests (tests/integration/test_dra_grpc_*.py) share:
claims as the API server sends them, a plugin with its fake kubelet
(tests/support/drakubelet.py) and its dirs (`Node`, made by the `start` fixture), CDI
resolution of its specs, this driver's sharing configs, NVML asked from a new process."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.base.config import Config
from nvctk.base.errors import NvctkError
from nvctk.cdi import load
from nvctk.dra.devices import DEFAULT_DRIVER
from nvctk.dra.node import make_driver
from nvctk.dra.server import Plugin
from nvctk.host import nvml
from nvctk.host.inventory import HostInfo
from nvctk.k8s.health import Health, XidWatcher
from nvctk.sim.host import SimHost
from support.drakubelet import FakeDraKubelet

DRIVER = DEFAULT_DRIVER
NODE = "node-a"
HOOK = "/usr/bin/nvctk-hook"


def claim(name: str, uid: str, results: list[dict[str, Any]], ns: str = "default",
          config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) as the API server sends it, allocated."""
    devices: dict[str, Any] = {"results": results}
    if config is not None:
        devices["config"] = config
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": ns, "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu"}]}},
            "status": {"allocation": {"devices": devices}}}


def result(device: str, request: str = "gpu", driver: str = DRIVER, pool: str = NODE,
           **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


class Node:
    """One plugin with its fake kubelet and its dirs."""

    def __init__(self, top: Path, sim: SimHost, source: Any, health: bool) -> None:
        self.plugins_dir, self.registry_dir, self.cdi_dir = (
            str(top / d) for d in ("plugins", "registry", "cdi"))
        os.makedirs(self.cdi_dir, exist_ok=True)
        self.sim = sim
        self.source = source
        self.health = Health()
        self.state_dir = str(top / "state")
        cfg = Config(driver_root=sim.root, hook_path=HOOK, state_dir=self.state_dir,
                     authority_key=str(top / "authority.key"))
        self.cfg = cfg
        self.host = nvml.query_host(sim.root)
        self.driver, _, _ = make_driver(DRIVER, NODE, source, self.plugins_dir, self.cdi_dir,
                                        self.health, cfg=cfg, host=self.host)
        inventory = self.driver.inventory
        assert inventory is not None
        # as the plugin's command does: XIDs mapped to the devices as they are now
        watcher = XidWatcher(sim.root, lambda: inventory.host, self.health) if health else None
        self.plugin = Plugin(self.driver, self.health, self.plugins_dir, self.registry_dir,
                             watcher)
        self.plugin.start()
        if watcher is not None:
            assert watcher.ready.wait(10)
        self.kubelet = FakeDraKubelet(self.registry_dir)
        self.kubelet.register(DRIVER)

    def specs(self) -> list[str]:
        return sorted(os.listdir(self.cdi_dir))

    def stop(self) -> None:
        self.kubelet.close()
        self.plugin.stop()

    def unprepare_all(self) -> None:
        """What a test left prepared (a failed assert): no ledger tmpfs outlives it."""
        for uid in self.driver.prepared_uids():
            try:
                self.driver.unprepare("", "", uid)
            except NvctkError:
                pass


Start = Callable[..., Node]


@pytest.fixture
def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Start]:
    made: list[Node] = []

    def go(sim: SimHost, source: Any, health: bool = False, top: Path | None = None) -> Node:
        # a short path: unix socket paths are limited to 107 bytes
        n = Node(top or tmp_path_factory.mktemp("dra"), sim, source, health)
        made.append(n)
        return n

    yield go
    for n in made:
        n.stop()
        n.unprepare_all()
    for n in made:
        # shutdown removes both sockets
        assert not os.path.exists(n.plugin.endpoint)
        assert not os.path.exists(n.plugin.reg_path)


def _resolve(node: Node, ids: list[str]) -> list[load.Resolved]:
    return load.resolve(tuple(ids), (node.cdi_dir,))


def _sharing(strategy: str, request: str | None = None) -> dict[str, Any]:
    """This driver's opaque GpuConfig with that sharing strategy (for one request, or all)."""
    return {**({"requests": [request]} if request else {}), "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig",
                                         "sharing": {"strategy": strategy}}}}


def _mps(request: str | None = None) -> dict[str, Any]:
    return _sharing("MPS", request)


def _share(name: str, capacity: dict[str, str], device: str = "gpu-1") -> dict[str, Any]:
    """Claim `name` (uid-<name>) of one share of device (s1) consuming capacity."""
    return claim(name, f"uid-{name}", [result(device, shareID="s1", consumedCapacity=capacity)])


def _query_in_a_new_process(root: str) -> Callable[[], HostInfo]:
    """NVML's answer for the driver root from a new process: a process keeps the
    simulated NVML library it loaded, built for the layout it was made with (the
    real driver answers a changed layout in the same process)."""
    import json
    import sys

    def query() -> HostInfo:
        out = subprocess.run([sys.executable, "-c", "import json, sys; from nvctk.host import nvml; "
                              "print(json.dumps(nvml.query_host(sys.argv[1]).to_dict()))", root],
                             capture_output=True, text=True, check=True, timeout=60).stdout
        return HostInfo.from_dict(json.loads(out))

    return query
