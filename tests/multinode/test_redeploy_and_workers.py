"""Operating kvroute on the three-node cluster (``conftest.py``): the workers mode
with a ``serve-replica`` worker on another node publishing KV events on its own
address; a ``serve deploy`` of a changed config (engine, router count, an API key from
the application's ``runtime_env``, the ingress spread over the workers) while requests
stream; an unchanged redeploy that keeps every replica. Runs after ``test_multinode.py`` and leaves the application in its
last config (the package's cluster ends after it)."""

from __future__ import annotations

import asyncio
import copy
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.multinode.conftest import APP, MODEL, health, serve_config, wait_fleet  # noqa: E402

KEY = "multinode-secret-key"
WORKERS_APP = "kvworkers"
PROMPT = "A long shared prefix for the cache: " + " ".join(f"item{i} is stored in bay {i * 7 % 13};" for i in range(30))


def _client(url: str, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _workers_app(worker_ip: str) -> dict:
    """A workers-mode application in front of one ``serve-replica`` on ``worker_ip``,
    its ingress on the head (route prefix ``/w``)."""
    return {
        "name": WORKERS_APP, "route_prefix": "/w", "import_path": "kvroute.deploy.app:build_app",
        "args": {
            "app_name": WORKERS_APP,
            "llm_configs": [{"model_loading_config": {"model_id": MODEL, "model_source": MODEL},
                             "engine_kwargs": {"block_size": 16}, "router_num_cpus": 0.1}],
            "workers": [{"url": f"http://{worker_ip}:8101", "kv_events_endpoint": f"tcp://{worker_ip}:5557"}],
            "worker_poll_interval_s": 0.5,
        },
        "deployments": [{"name": "OpenAIIngress", "num_replicas": 1,
                         "ray_actor_options": {"num_cpus": 0, "resources": {"kvroute_ingress": 1}}}],
    }  # fmt: skip


def test_workers_mode_routes_to_a_worker_on_another_node_from_its_own_events(netns_cluster, kvroute_app):
    """A ``serve-replica`` worker on w1 publishing its KV events on w1's address; the
    workers application beside the main one: the pool (on whatever node Ray chose)
    subscribes across nodes, ``/admin/workers`` shows the worker up with its events
    flowing, and a repeated prefix comes back cached as the router predicted."""
    cluster = netns_cluster
    w1 = cluster.nodes["w1"]
    worker = cluster.spawn("w1", [str(cluster.bin_dir / "kvroute"), "serve-replica", "--model", MODEL, "--host", "0.0.0.0",
                                  "--port", "8101", "--dtype", "float32", "--num-kv-blocks", "128",
                                  "--max-model-len", "1024", "--kv-events-config",
                                  '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'])  # fmt: skip
    config = serve_config()
    config["applications"].append(_workers_app(w1.ip))
    base = cluster.head.url() + "/w"
    try:
        cluster.wait_for(lambda: httpx.get(f"http://{w1.ip}:8101/health", timeout=5).status_code == 200, 120,
                         "the serve-replica worker up")  # fmt: skip
        cluster.serve_deploy(config)

        def described():
            data = httpx.get(base + "/admin/workers", timeout=10).json()["data"]
            return data if data and data[0]["state"] == "up" and data[0]["kv_events"] is True else None

        (entry,) = cluster.wait_for(described, 180, "the worker up with its KV events subscribed")
        assert entry["id"].startswith(w1.ip), entry
        client = _client(base)
        first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens > 64

        def cached():
            r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens

        # the worker's events reach the pool's subscriber across nodes; the hit is the worker's own
        hit = cluster.wait_for(cached, 30, "a cached prefix on the worker", interval_s=0.5)
        assert hit >= 64 and httpx.get(base + "/admin/workers", timeout=10).json()["data"][0]["kv_events_messages"] > 0
    finally:
        cluster.serve_deploy(serve_config())  # the workers application removed
        worker.kill()
        worker.wait(timeout=30)


def test_a_changed_config_redeploys_under_load_and_an_unchanged_one_keeps_the_fleet(netns_cluster, kvroute_app):
    """While four streams run, ``serve deploy`` of a changed config: another engine
    setting (a new generation of replicas and routers), two routers instead of one, an
    ingress on each worker instead of one on the head, and an API key that reaches the
    ingress only through the application's ``runtime_env.env_vars`` (with
    ``require_api_key``). No stream fails; afterwards the
    new generation serves with both routers, the key is enforced, routing is
    cache-aware; a second deploy of the same config keeps every replica."""
    cluster = netns_cluster
    head = cluster.head.url()
    before = health(head)
    assert before["status_code"] == 200 and before["routers"] == "1/1"
    # the ingress where the product places it, one on each worker (test_survival.py's
    # placement, so its deploy of this config changes nothing and starts no new generation)
    new = serve_config(engine_kwargs={"max_num_seqs": 6}, pin_ingress_to_head=False, ingress={"require_api_key": True})
    app = new["applications"][0]
    app["args"]["llm_configs"][0]["num_routers"] = 2
    app["runtime_env"] = {"env_vars": {"KVROUTE_API_KEY": KEY}}

    async def streams() -> list:
        client = openai.AsyncOpenAI(base_url=head + "/v1", api_key=KEY, max_retries=0, timeout=300)

        async def one(i: int):
            resp = await client.completions.create(model=MODEL, prompt=f"Redeploy stream {i}: once upon a time",
                                                   max_tokens=48, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
            usage = None
            async for chunk in resp:
                usage = chunk.usage or usage
            return usage.completion_tokens

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.sleep(1.0)  # every stream under way
        await asyncio.to_thread(cluster.serve_deploy, new)
        return await asyncio.gather(*tasks, return_exceptions=True)

    started, deployed_after = time.monotonic(), time.time() - 1.0
    results = asyncio.run(streams())
    assert results == [48] * 4, results
    placement = wait_fleet(cluster, APP, 2, timeout_s=300, deployed_after=deployed_after)
    fleet_s = time.monotonic() - started
    cluster.wait_for(lambda: sorted(cluster.node_of_ip(r["node_ip"]) for r in cluster.replicas(APP, "OpenAIIngress"))
                     == ["w1", "w2"], 120, "the default placement: an ingress on each node with CPUs")  # fmt: skip
    # the new generation's second router may wait for the CPU the old router frees when it
    # ends itself (idle_exit_s after the old replicas and ingress are gone)
    after = cluster.wait_for(lambda: (h := health(head))["routers"] == "2/2" and h, 150, "both new routers answering")
    assert after["generation"] != before["generation"], after
    routers = sorted(a["name"] for a in cluster.actors() if (a.get("name") or "").startswith(f"kvroute-router:{APP}@")
                     and after["generation"][:10] in a["name"])  # fmt: skip
    assert len(routers) == 2, routers
    print(f"redeploy under load: streams {results}, new fleet {placement} {fleet_s:.1f} s later, both new routers "
          f"answering {time.monotonic() - started:.1f} s later")
    with pytest.raises(openai.AuthenticationError):
        _client(head).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    client = _client(head, KEY)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    cached = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
              .usage.prompt_tokens_details.cached_tokens for _ in range(3)]  # fmt: skip
    assert min(cached) >= 64, cached  # the new routers' directory sends the prefix to its holder

    replicas = {r["replica_id"] for r in cluster.replicas(APP, "EngineReplica")}
    cluster.serve_deploy(copy.deepcopy(new))  # the same config again: nothing replaced
    time.sleep(3)
    assert {r["replica_id"] for r in cluster.replicas(APP, "EngineReplica")} == replicas
    assert health(head)["generation"] == after["generation"]
    kvroute_app.update(placement=placement, config=copy.deepcopy(new))
