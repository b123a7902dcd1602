"""The deployments/ directory: the Grafana dashboard's PromQL queries, the manifests,
and DRA's CEL on published devices (the DeviceClasses' selectors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parents[2] / "deployments"


def grafana_queries() -> list[str]:
    import json

    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def manifests(name: str) -> list[dict[str, Any]]:
    """The documents of deployments/<name>."""
    import yaml

    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def cel_device(device: dict[str, Any], driver: str) -> dict[str, Any]:
    """A published device as DRA's CEL sees it (k8s.io/dynamic-resource-allocation/cel):
    `device.driver`, `device.attributes[domain][name]` and `device.capacity[domain][name]`
    by domain (an unqualified name is in the driver's), values unwrapped."""
    from support.apiserver import quantity

    def by_domain(items: dict[str, Any], value: Any) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, v in items.items():
            domain, _, ident = name.rpartition("/")
            out.setdefault(domain or driver, {})[ident] = value(v)
        return out

    return {"driver": driver,
            "allowMultipleAllocations": bool(device.get("allowMultipleAllocations")),
            "attributes": by_domain(device.get("attributes") or {},
                                    lambda a: next(iter(a.values()))),
            "capacity": by_domain(device.get("capacity") or {},
                                  lambda c: int(quantity(c["value"])))}


def cel_eval(expr: str, **activation: Any) -> Any:
    """expr evaluated by a CEL implementation (cel-python) on plain JSON values."""
    import celpy

    env = celpy.Environment()
    prog = env.program(env.compile(expr))
    return prog.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
