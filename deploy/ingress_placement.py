"""Where the HTTP ingress replicas run. ``ingress.num_replicas: per_node`` (the default)
puts one on every node that can host one (its ``num_cpus``), at most one per node: each
node's Serve proxy prefers its own node's ingress, so a node's loss cuts only the
streams that entered there, and no node's requests cross to another node to be parsed.

The count is taken from the cluster's alive nodes when the application is built (where
the build has no Ray connection, one): a node that joins later gets its ingress at the
next deploy. A Serve config that pins the ingress to some nodes (its ``deployments:``
override with custom resources) sets a count instead.
"""

from __future__ import annotations

from typing import Any


def ingress_options(num_replicas: int | str, num_cpus: float, max_replicas_per_node: int | None) -> dict[str, Any]:
    """Serve's ``num_replicas`` and ``max_replicas_per_node`` for an ingress spec."""
    if num_replicas == "per_node":
        count, per_node = hosting_nodes(num_cpus), max_replicas_per_node or 1
    else:
        count, per_node = int(num_replicas), max_replicas_per_node
    return {"num_replicas": count, **({"max_replicas_per_node": per_node} if per_node else {})}


def hosting_nodes(num_cpus: float) -> int:
    """The alive nodes with at least ``num_cpus`` CPUs (at least one)."""
    import ray

    if not ray.is_initialized():
        return 1
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= num_cpus]
    return max(1, len(nodes))
