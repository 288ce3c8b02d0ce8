"""What routing through the router actor costs a request, on a real local Ray cluster.

``kvroute bench cluster_overhead [--replicas 8] [--requests 2000]``
(also as ``ray job submit -- python -m kvroute.benchmarks cluster_overhead``).

1. **Added latency**: one ``rank`` call to the router actor from a caller process, the
   exact call the kvroute Serve request router makes per request, sequentially
   (p50 / p99). The router actor holds ``--replicas`` registered replicas whose
   directories are filled with ``--cached-blocks`` blocks each (synthetic snapshots: no
   model is loaded for this part, the replicas are names only, and their load figures
   come from the snapshots).
2. **Sustained decisions/s**: ``--concurrency`` rank calls kept in flight from the
   driver until ``--requests`` decisions are made.
3. **End to end** (``--e2e-model``, default the embedded SmolLM2; ``--e2e-requests 0``
   skips it): a two-replica Serve application, the same sequential 1-token requests
   through Serve's default power-of-two router and through kvroute's, time to first
   token p50 / p99 of each, side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import ray

from kvroute.benchmarks.common import write_result
from kvroute.cluster.router_actor import RouterActor
from kvroute.replica.block_hash import BlockHash, HashSpec, hash_blocks
from kvroute.replica.kv_events import LoadFigures
from kvroute.benchmarks import options

BLOCK = 16


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _router_part(args: argparse.Namespace) -> dict[str, Any]:
    spec = HashSpec(BLOCK, 1234, "bench")
    rng = random.Random(0)
    actor = RouterActor.remote(spec, "kvroute", {}, 3600.0)
    chains: list[list[BlockHash]] = []
    for r in range(args.replicas):
        hashes: list[BlockHash] = []
        for c in range(args.cached_blocks // 64):
            toks = [rng.randrange(50_000) for _ in range(64 * BLOCK)]
            chain = hash_blocks(spec, toks)
            hashes.extend(chain)
            chains.append(chain)
        load = LoadFigures(num_running=4, prefill_tokens_per_s=20_000.0, decode_step_s=0.02)
        ray.get(actor.register.remote(f"replica-{r}", spec, 4 * args.cached_blocks, hashes, 0, load))
    candidates = [f"replica-{r}" for r in range(args.replicas)]

    def request() -> tuple[list[BlockHash], int]:
        chain = rng.choice(chains)
        n = rng.choice((16, 32, 64))  # blocks of the request that hit a cached chain
        return chain[:n], n * BLOCK + 7

    for _ in range(50):  # warm up
        ray.get(actor.rank.remote(*request(), candidates))
    lat = []
    for _ in range(args.latency_requests):
        h, n = request()
        t = time.perf_counter()
        ray.get(actor.rank.remote(h, n, candidates))
        lat.append((time.perf_counter() - t) * 1e6)

    reqs = [request() for _ in range(args.requests)]
    t = time.perf_counter()
    inflight: list[Any] = []
    for h, n in reqs:
        inflight.append(actor.rank.remote(h, n, candidates))
        if len(inflight) >= args.concurrency:
            ready, rest = ray.wait(inflight, num_returns=len(inflight) // 2)
            ray.get(ready)
            inflight = rest
    ray.get(inflight)
    rate = len(reqs) / (time.perf_counter() - t)
    stats = ray.get(actor.stats.remote())
    ray.kill(actor)
    return {
        "rank_latency_us": {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "mean": statistics.mean(lat)},
        "decisions_per_s": rate,
        "directory_blocks": stats["directory_blocks"],
        "replicas": args.replicas,
    }


def _e2e_part(args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    from kvroute.cluster.client import KVRouteClient
    from kvroute.cluster.config import ClusterConfig
    from kvroute.cluster.replica_deployment import build_engine_deployment
    from kvroute.cluster.router_lookup import kill_router_actor
    from kvroute.replica.config import EngineConfig
    from kvroute.replica.sampling_params import SamplingParams

    serve.start(proxy_location="Disabled")
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 40_000) for _ in range(48)] for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out: dict[str, Any] = {}
    for router in ("power_of_two", "kvroute"):
        name = f"overhead-{router}"
        config = ClusterConfig(
            engine=EngineConfig(model=args.e2e_model, num_kv_blocks=512, max_model_len=1024),
            app_name=name,
            num_replicas=2,
            request_router=router,
        ).with_random_hash_seed()
        serve.run(build_engine_deployment(config), name=name, route_prefix=None)
        client = KVRouteClient.for_app(config)

        async def go() -> list[float]:
            for p in prompts:  # warm: every prompt cached somewhere
                await client.complete(p, params)
            ttft = []
            for i in range(args.e2e_requests):
                t = time.perf_counter()
                await client.complete(prompts[i % len(prompts)], params)
                ttft.append((time.perf_counter() - t) * 1e3)
            return ttft

        ttft = asyncio.run(go())
        out[router] = {"ttft_ms": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)}}
        serve.delete(name)
        kill_router_actor(config.router_actor_name)
    out["added_p50_ms"] = out["kvroute"]["ttft_ms"]["p50"] - out["power_of_two"]["ttft_ms"]["p50"]
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--cached-blocks", type=int, default=4096, help="directory blocks per replica")
    ap.add_argument("--latency-requests", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--e2e-model", default="smollm2-135m-instruct")
    ap.add_argument("--e2e-requests", type=int, default=200)
    options.add_output(ap, "cluster_overhead")


def run(args: argparse.Namespace) -> int:
    ray.init(address="auto" if _cluster_running() else None, include_dashboard=False, log_to_driver=False,
             logging_level="warning", num_cpus=None if _cluster_running() else 8)
    result: dict[str, Any] = {"router_actor": _router_part(args)}
    if args.e2e_requests:
        result["e2e"] = _e2e_part(args)
    r = result["router_actor"]
    summary = (
        f"rank p50 {r['rank_latency_us']['p50']:.0f} us p99 {r['rank_latency_us']['p99']:.0f} us, "
        f"{r['decisions_per_s']:.0f} decisions/s with {r['replicas']} replicas"
    )
    if "e2e" in result:
        e = result["e2e"]
        summary += (
            f"; e2e TTFT p50 kvroute {e['kvroute']['ttft_ms']['p50']:.1f} ms vs power-of-two "
            f"{e['power_of_two']['ttft_ms']['p50']:.1f} ms"
        )
    write_result("cluster_overhead", result, summary, args.out)
    return 0


def _cluster_running() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
