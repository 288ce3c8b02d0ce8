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
    """``serve deploy`` through the head's dashboard: one engine replica on each worker
    (Serve's view, Ray's state API and the processes' own namespaces agree), the
    ingress on the head, ``/health`` 200 on every node's proxy, and a completion through
    a worker's proxy."""
    cluster = netns_cluster
    placement = kvroute_app["placement"]
    assert sorted(placement.values()) == ["w1", "w2"], placement
    alive = cluster.alive_nodes()
    replicas = {r["replica_id"]: r for r in cluster.replicas(APP, "EngineReplica")}
    actors = {a["actor_id"]: a for a in cluster.actors()}
    for rid, node in placement.items():
        actor = actors[replicas[rid]["actor_id"]]  # Ray's own record of the replica's actor
        assert cluster.node_of_id(actor["node_id"], alive) == node, (rid, actor)
        assert actor["pid"] in cluster.nodes[node].pids(), f"replica {rid}'s process is not in {node}'s namespace"
        environ = dict(v.split("=", 1) for v in open(f"/proc/{actor['pid']}/environ").read().split("\0") if "=" in v)
        assert environ["KVROUTE_CACHE"] == str(cluster.nodes[node].cache), "the replica does not use its node's cache"
    ingress = cluster.replicas(APP, "OpenAIIngress")
    assert [cluster.node_of_ip(r["node_ip"]) for r in ingress] == ["head"], ingress
    assert ingress[0]["pid"] in cluster.head.pids()
    routers = [a for a in actors.values() if (a.get("name") or "").startswith(f"kvroute-router:{APP}")]
    assert routers, "no router actor alive"
    print("router actors on", sorted(cluster.node_of_id(a["node_id"], alive) for a in routers))
    for node in cluster.nodes.values():
        assert httpx.get(node.url() + "/health", timeout=30).status_code == 200, node.name
    r = _client(cluster.nodes["w1"].url()).completions.create(model=MODEL, prompt="The capital of France is",
                                                              max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def _running_on(cluster, rid_to_node: dict[str, str]) -> dict[str, float]:
    running = per_replica(metric_samples(cluster.head.url(), "vllm:num_requests_running"))
    return {rid: running.get(rid, 0.0) for rid in rid_to_node}


def test_shared_prefix_follows_its_replica_whatever_node_it_enters(netns_cluster, kvroute_app):
    """One long prefix (10+ blocks) sent four times, each time through another node's
    proxy: every request lands on the replica that holds it, and the later ones are
    served from its prefix cache."""
    cluster = netns_cluster
    head = cluster.head.url()
    prefix = "You are the archivist of a mountain library. Answer briefly and cite the shelf. " * 12
    prefix_tokens = len(httpx.post(head + "/tokenize", json={"prompt": prefix}, timeout=30).json()["tokens"])
    assert prefix_tokens >= 10 * 16, prefix_tokens
    done = lambda: per_replica(metric_samples(head, "vllm:request_success"), "_total")  # noqa: E731

    def settled():  # the counts once earlier requests are in the replicas' reports (about 1/s)
        first = done()
        time.sleep(1.5)
        return (first,) if done() == first else None

    (before,) = cluster.wait_for(settled, 30, "the replicas' request counts to settle", interval_s=0)
    entries = ["head", "w1", "w2", "w1"]
    outs = []
    for i, entry in enumerate(entries):
        r = _client(cluster.nodes[entry].url()).completions.create(
            model=MODEL, prompt=prefix + f"Question {i}: which shelf holds maps?", max_tokens=2, temperature=0)
        outs.append(r)
        if i == 0:
            time.sleep(0.5)  # the holder's KV events reach the router
    cached = [o.usage.prompt_tokens_details.cached_tokens for o in outs]
    full_blocks = (prefix_tokens - 1) // 16 * 16  # the prefix's full blocks (its last token may merge)
    assert cached[0] < full_blocks and all(c >= full_blocks for c in cached[1:]), (cached, full_blocks)

    def served():
        after = done()
        delta = {rid: after.get(rid, 0.0) - before.get(rid, 0.0) for rid in after}
        return delta if sum(delta.values()) >= len(entries) else None

    delta = cluster.wait_for(served, 30, "the four requests in the replicas' counts")
    nodes = kvroute_app["placement"]
    busy = {nodes.get(rid, rid): n for rid, n in delta.items() if n}
    assert list(busy.values()) == [len(entries)], f"requests per node: {busy}"
    print(f"prefix of {prefix_tokens} tokens: all {len(entries)} requests on {busy}; cached tokens {cached}")
