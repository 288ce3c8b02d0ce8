"""Where the ingress replicas go (``deploy/ingress_placement.py``): ``per_node`` counts the
alive nodes of the cluster the build is connected to that have the CPUs for one, at most
one per node; a count is taken as given. (The three-node placement is checked in
``tests/multinode/test_redeploy_and_workers.py``.)"""

from __future__ import annotations

import pytest
import ray

from kvroute.deploy.app_config import parse_args
from kvroute.deploy.ingress_placement import hosting_nodes, ingress_options


LLM = [{"model_loading_config": {"model_id": "m"}}]


def test_a_count_is_taken_as_given_and_per_node_is_the_default():
    assert parse_args({"llm_configs": LLM}).ingress.num_replicas == "per_node"
    assert ingress_options(3, 0.5, None) == {"num_replicas": 3}
    assert ingress_options(3, 0.5, 2) == {"num_replicas": 3, "max_replicas_per_node": 2}
    with pytest.raises(ValueError, match="num_replicas"):
        parse_args({"llm_configs": LLM, "ingress": {"num_replicas": "every_node"}})
    with pytest.raises(ValueError, match="num_replicas"):
        parse_args({"llm_configs": LLM, "ingress": {"num_replicas": 0}})


def test_per_node_counts_the_nodes_that_can_host_one(ray_cluster):
    """On the session's one-node cluster of 8 CPUs."""
    assert ray.is_initialized()
    assert ingress_options("per_node", 0.5, None) == {"num_replicas": 1, "max_replicas_per_node": 1}
    assert hosting_nodes(8) == 1 and hosting_nodes(9) == 1  # a node without the CPUs is not counted; one at least
    assert len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 9]) == 0
    assert ingress_options("per_node", 0.5, 2)["max_replicas_per_node"] == 2

