"""Keeps this node's ResourceSlices in sync with its GPUs (nvctk.dra.slices builds
them; nvctk.dra.kube writes them).

A change of the pool (a GPU gone or back, a changed MIG layout, a device unhealthy)
writes every slice of the pool again at the next generation, then deletes the slices
it no longer needs: consumers use only a pool's highest generation, and count its
slices, so they never see a mix. A sync with nothing changed writes nothing; every
`resync` seconds the slices are listed again, and one that someone else changed or
deleted is written again.

The server's answer to each write is compared with what was sent: fields of a
feature it does not know (1.34, 1.35) come back missing, and the pool is published
again without that feature (nvctk.dra.slices.Features says what then stays safe).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from nvctk.dra.kube import Kube, KubeError
from nvctk.dra.slices import ALL, DEFAULT_TAINTS, Features, Pool, TaintPolicy, node_pool, slices
from nvctk.host.inventory import HostInfo
from nvctk.k8s.health import Health

log = logging.getLogger("nvctk.dra")

RESYNC_S = 30.0  # how often the slices are listed again (and the GPUs queried)


def dropped_features(sent: dict[str, Any], got: dict[str, Any]) -> set[str]:
    """The Features fields whose API fields the server dropped from sent."""
    out = set()
    s, g = sent.get("spec") or {}, got.get("spec") or {}
    if s.get("sharedCounters") and not g.get("sharedCounters"):
        out.add("counters")
    got_devices = {d.get("name"): d for d in g.get("devices") or ()}
    for d in s.get("devices") or ():
        back = got_devices.get(d["name"], {})
        if d.get("allowMultipleAllocations") and not back.get("allowMultipleAllocations"):
            out.add("shares")
        if d.get("consumesCounters") and not back.get("consumesCounters"):
            out.add("counters")
        if d.get("taints") and not back.get("taints"):
            out.add("taints")
    return out


class Publisher:
    def __init__(self, kube: Kube, node: str, driver: str,
                 features: Features = ALL, policy: TaintPolicy = DEFAULT_TAINTS,
                 pcie_roots: Callable[[HostInfo], Mapping[str, str]] | None = None) -> None:
        self.kube = kube
        self.node = node
        self.driver = driver
        self.features = features
        self.policy = policy  # an unhealthy device's taint effect
        self.pcie_roots = pcie_roots  # the GPUs' PCIe roots (sysfs: read per sync)
        self.generation = 0  # the pool's generation last written
        self.pool: Pool | None = None  # what was last written
        self.versions: dict[str, str] = {}  # slice name -> its resourceVersion after our write
        self.stopping = threading.Event()

    def sync(self, host: HostInfo, unhealthy: Mapping[str, str], check: bool = False) -> bool:
        """Publish the pool of host (unhealthy: uuid -> reason) if it changed, or if
        check and the server's slices are not the ones last written. True when it
        wrote. KubeError when the server refused or stayed away (the next sync
        writes the pool again)."""
        roots = self.pcie_roots(host) if self.pcie_roots is not None else None
        pool = node_pool(host, self.driver, unhealthy, self.features, self.policy, roots)
        if pool == self.pool and not check:
            return False
        existing = {s["metadata"]["name"]: s for s in self.kube.list_slices(self.driver, self.node)}
        if pool == self.pool and {n: s["metadata"].get("resourceVersion")
                                  for n, s in existing.items()} == self.versions:
            return False
        self.pool = None  # until every slice of the new generation is written
        gen = max([self.generation, *(s["spec"]["pool"]["generation"]
                                      for s in existing.values())]) + 1
        want = slices(pool, self.node, self.driver, gen)
        versions: dict[str, str] = {}
        dropped: set[str] = set()
        for obj in want:
            name = obj["metadata"]["name"]
            old = existing.get(name)
            if old is None:
                got = self.kube.create_slice(obj)
            else:
                obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                got = self.kube.update_slice(obj)
            versions[name] = got["metadata"]["resourceVersion"]
            dropped |= dropped_features(obj, got)
        for name in sorted(set(existing) - set(versions)):
            self.kube.delete_slice(name)
        self.generation, self.pool, self.versions = gen, pool, versions
        log.info("published %d devices of %s in %d ResourceSlices (generation %d)",
                 len(pool.devices), self.node, len(want), gen)
        if dropped:
            log.warning("the API server dropped the fields of %s (its feature gates are "
                        "off): publishing without them", ", ".join(sorted(dropped)))
            self.features = dataclasses.replace(self.features, **dict.fromkeys(dropped, False))
            self.sync(host, unhealthy)
        return True

    def run(self, host_source: Callable[[], HostInfo], health: Health,
            resync: float = RESYNC_S) -> None:
        """Sync until stop(): at once, on each health change, and every resync
        seconds (querying the GPUs again: one gone or a new MIG layout)."""
        host: HostInfo | None = None
        check = True
        while not self.stopping.is_set():
            try:
                host = host_source()
            except Exception as e:  # NVML down: keep publishing what was last seen
                log.error("cannot query the GPUs: %s", e)
            with health.changed:
                seen = health.generation
                unhealthy = health.snapshot()
            if host is not None:
                try:
                    self.sync(host, unhealthy, check=check)
                    check = False
                except KubeError as e:
                    log.error("cannot publish the ResourceSlices of %s: %s", self.node, e)
                    check = True
                except (KeyError, TypeError, ValueError) as e:  # an answer of the wrong shape
                    log.error("cannot publish the ResourceSlices of %s: the API server's "
                              "answer is malformed (%r)", self.node, e)
                    check = True
            if not self._wait(health, seen, resync):
                check = True  # the timeout: list the slices again

    def _wait(self, health: Health, seen: int, timeout: float) -> bool:
        """Until health moves past generation seen, or stop(); False on the timeout."""
        with health.changed:
            return health.changed.wait_for(
                lambda: health.generation != seen or self.stopping.is_set(), timeout)

    def stop(self, health: Health) -> None:
        self.stopping.set()
        health.wake()
