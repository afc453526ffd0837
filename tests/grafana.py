"""Reading a Grafana dashboard's JSON model: the PromQL its panels query."""

from __future__ import annotations


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every panel target's PromQL expression, in panel order."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
