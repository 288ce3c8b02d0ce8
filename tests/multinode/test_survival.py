"""What survives a node's loss (ARCHITECTURE.md §5.1), on the three-node cluster
(``conftest.py``); runs last in the package, since the node stays lost. The
application's last config (``test_redeploy_and_workers.py``'s, or the package's own),
with the product's placement for it: an ingress on each worker (the default
``ingress.num_replicas: per_node``; each node's Serve proxy prefers its own node's
ingress) and a router on each (``num_routers: 2``, spread). After
``test_redeploy_and_workers.py`` the config already has that placement, and the deploy
here changes nothing."""

from __future__ import annotations

import copy
import time

import pytest

openai = pytest.importorskip("openai")

from tests.multinode.conftest import APP, MODEL, deploy_and_wait, health, metric_samples, per_replica  # noqa: E402

STREAMS = 4
STREAM_TOKENS = 96


def _streams_on(cluster, rid_to_node: dict[str, str]) -> dict[str, float]:
    """Requests each replica reports running or waiting, from one scrape."""
    families = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    counts = per_replica(metric_samples(cluster.head.url(), families))
    return {rid: counts.get(rid, 0.0) for rid in rid_to_node}


async def _streams(url: str, progress: list[int], during=None, key: str = "unused") -> list:
    """``STREAMS`` greedy streaming completions through ``url``; ``during(tasks)`` runs
    alongside. Each result: (text, usage, finish_reason), or the exception it raised."""
    import asyncio

    async def stream(client, i):
        text, usage, finish = [], None, None
        resp = await client.completions.create(
            model=MODEL, prompt=f"Stream {i}: the night train to the northern coast", max_tokens=STREAM_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in resp:
            for choice in chunk.choices:
                text.append(choice.text)
                progress[i] += 1
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        return "".join(text), usage, finish

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    tasks = [asyncio.ensure_future(stream(client, i)) for i in range(STREAMS)]
    if during is not None:
        try:
            await during(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
    return await asyncio.gather(*tasks, return_exceptions=True)




def _spread(config: dict) -> tuple[dict, str]:
    """``config`` with an ingress and a router on each worker; the API key it needs."""
    config = copy.deepcopy(config)
    app = config["applications"][0]
    app["deployments"] = [d for d in app.get("deployments", []) if d["name"] != "OpenAIIngress"]
    app["args"]["ingress"].pop("num_replicas", None)  # the default: one on each node with CPUs (the workers)
    app["args"]["llm_configs"][0]["num_routers"] = 2
    return config, app.get("runtime_env", {}).get("env_vars", {}).get("KVROUTE_API_KEY", "unused")


def test_streams_survive_sigkill_of_a_whole_worker_node(netns_cluster, kvroute_app):
    """Four greedy streams through the proxy of one worker, then every process of the
    other worker (raylet, agents, its engine replica, its ingress, its router) SIGKILLed:
    every stream still ends with all its tokens and the text of an undisturbed run (the
    surviving node's ingress resumes the cut ones on the surviving replica, routed by
    the surviving router), and requests after the kill are served through the
    survivor's and the head's proxies. (A stream that entered through the dead node's
    proxy or ingress dies with its connection: no process is left to resume it.)"""
    import asyncio

    cluster = netns_cluster
    config, key = _spread(kvroute_app["config"])
    placement = deploy_and_wait(cluster, config)
    assert sorted(placement.values()) == ["w1", "w2"], placement
    cluster.wait_for(lambda: sorted(cluster.node_of_ip(r["node_ip"]) for r in cluster.replicas(APP, "OpenAIIngress"))
                     == ["w1", "w2"], 120, "one ingress replica on each worker")  # fmt: skip
    # both routers of this generation answering (one may wait for the CPU an older
    # generation's router frees when it ends itself)
    generation = cluster.wait_for(lambda: (h := health(cluster.head.url()))["routers"] == "2/2" and h["generation"],
                                  150, "both routers answering")  # fmt: skip
    alive = cluster.alive_nodes()
    routers = sorted(cluster.node_of_id(a["node_id"], alive) for a in cluster.actors()
                     if (a.get("name") or "").startswith(f"kvroute-router:{APP}@{generation[:10]}"))  # fmt: skip
    assert routers == ["w1", "w2"], f"router actors on {routers}: not spread over the workers"
    victim, survivor = "w2", "w1"
    url = cluster.nodes[survivor].url()
    undisturbed = asyncio.run(_streams(url, [0] * STREAMS, key=key))
    assert all(isinstance(r, tuple) for r in undisturbed), undisturbed

    progress = [0] * STREAMS
    report: dict = {}

    async def chaos(tasks):
        deadline = time.monotonic() + 120
        while min(progress) < 3:  # every stream is under way
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), progress
            await asyncio.sleep(0.05)
        # where the streams run, from the replicas' own reports (about once a second);
        # the head's proxy sends each scrape to either ingress, so the largest count per
        # replica over the scrapes so far is kept
        seen: dict[str, float] = {}
        history: list = []

        def placed():
            counts = _streams_on(cluster, placement)
            if not history or history[-1][2] != counts:  # (seconds, chunks per stream, counts) at each change
                history.append((round(time.monotonic() - started, 1), list(progress), counts))
            assert not any(t.done() for t in tasks), f"a stream ended before the replicas reported it: {history}"
            for rid, n in counts.items():
                seen[rid] = max(seen.get(rid, 0.0), n)
            return sum(seen.values()) >= STREAMS and dict(seen)

        started = time.monotonic()
        running = await asyncio.to_thread(cluster.wait_for, placed, 30, "every stream in the replicas' counts", 0.2)
        report["running"] = {placement[rid]: n for rid, n in running.items()}
        report["progress_at_kill"] = list(progress)
        assert not any(t.done() for t in tasks), "a stream ended before the kill"
        report["killed_pids"] = await asyncio.to_thread(cluster.kill_node, victim)
        report["killed_at"] = time.monotonic()

    results = asyncio.run(_streams(url, progress, chaos, key=key))
    done_s = time.monotonic() - report["killed_at"]
    print(f"router actors on {routers}; killed {victim} ({len(report['killed_pids'])} processes); streams per "
          f"node at the kill: {report['running']}; chunks streamed then: {report['progress_at_kill']}; streams "
          f"ended {done_s:.1f} s after the kill")
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert report["running"].get(victim, 0) >= 1, f"no stream ran on {victim}: {report['running']}"
    for text, usage, finish in results:
        assert usage is not None and usage.completion_tokens == STREAM_TOKENS and finish == "length", (usage, finish)
    differ = [i for i, (a, b) in enumerate(zip(undisturbed, results)) if a[0] != b[0]]
    assert not differ, "streams differ from the undisturbed run:\n" + "\n".join(
        f"{i} (at the kill: {report['progress_at_kill'][i]} chunks)\n  undisturbed {undisturbed[i][0]!r}\n"
        f"  disturbed   {results[i][0]!r}" for i in differ)
    # after the kill: served through the survivor's and the head's proxies
    for entry in (survivor, "head"):
        client = openai.OpenAI(base_url=cluster.nodes[entry].url() + "/v1", api_key=key, max_retries=0, timeout=120)
        r = client.completions.create(model=MODEL, prompt="After the storm", max_tokens=4)
        assert r.usage.completion_tokens == 4
