"""kvroute on a real three-node Ray cluster (head + two workers, each node in its own
network namespace: ``conftest.py``), through the official ``openai`` client against
Serve's HTTP proxy on a node."""

from __future__ import annotations

import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.multinode.conftest import APP, MODEL, metric_samples, per_replica  # noqa: E402


def _client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_serve_deploy_places_replicas_on_the_workers(netns_cluster, kvroute_app):
    cluster = netns_cluster
    placement = kvroute_app["placement"]
    assert sorted(placement.values()) == ["w1", "w2"], placement
    ingress = cluster.replicas(APP, "OpenAIIngress")
    assert [cluster.node_of_ip(r["node_ip"]) for r in ingress] == ["head"], ingress
    for node in cluster.nodes.values():
        assert httpx.get(node.url() + "/health", timeout=30).status_code == 200, node.name
    r = _client(cluster.nodes["w1"].url()).completions.create(model=MODEL, prompt="The capital of France is",
                                                              max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
