"""The deployments/ directory: the Grafana dashboard's PromQL queries."""

from __future__ import annotations

from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "deployments"


def grafana_queries() -> list[str]:
    import json

    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
