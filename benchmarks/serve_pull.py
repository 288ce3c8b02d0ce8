"""A routed pull through the Serve application against recomputing: two real replicas
(SmolLM2-135M, fp32, one torch thread each), a 2,000-token prefix cached on one of them.
A request sent to the other with a decision naming the holder (``pull_from``) pulls the
prefix there (``cluster/route_pull.py``) and computes only its question; the same
request sent there cold recomputes the whole prompt. Both go through the kvroute
request router with the decision given (the ranking it would reuse), and their time to
first token is taken at the caller. Then one request goes through the router's own
decision (``KVRouteClient``) while the holder is busy prefilling another long prompt:
the router prices pull against recompute against waiting and says what it chose.

Reports the median first-token times, their ratio, the pulls' bytes and seconds at the
replica, whether every greedy output equals the holder's undisturbed run, and the
routed request's decision.

    kvroute bench serve_pull          # 2,000-token prefix, 3 repeats
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import ray
from ray import serve

from kvroute.benchmarks import options
from kvroute.benchmarks.common import write_result
from kvroute.cluster.client import KVRouteClient
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.messages import FirstDelta, GenerateRequest, ReplicaCall
from kvroute.cluster.replica_deployment import build_engine_deployment
from kvroute.cluster.router_lookup import kill_router_actor
from kvroute.replica.block_hash import hash_blocks
from kvroute.replica.config import EngineConfig
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteDecision

APP = "kvbench-pull"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared with the undisturbed run")
    ap.add_argument("--repeats", type=int, default=3)
    options.add_seed(ap)
    options.add_output(ap, "serve_pull")


async def _first_token(handle, request: GenerateRequest, route: RouteDecision | None) -> dict:
    """Seconds to the first token at the caller, the output, cached and pulled tokens."""
    start, first, tokens, cached, pulled, served = time.perf_counter(), None, [], 0, 0, None
    kwargs = {} if route is None else {"route": route}
    async for item in handle.options(stream=True).generate.remote(request, **kwargs):
        if isinstance(item, FirstDelta):
            pulled, served, item = item.outcome.pulled_tokens, item.outcome.served_by, item.delta
        if first is None and item.token_ids:
            first = time.perf_counter() - start
        tokens += item.token_ids
        cached = item.num_cached_tokens
    return {"ttft_s": first or 0.0, "tokens": tokens, "cached": cached, "pulled": pulled, "served_by": served}


class _Bench:
    def __init__(self, config: ClusterConfig, args: argparse.Namespace) -> None:
        self.config, self.args = config, args
        self.handle = serve.get_deployment_handle(config.deployment_name, app_name=APP)
        self.greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        self.rng = random.Random(args.seed)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 40_000) for _ in range(n)]

    def request(self, prompt: list[int]) -> GenerateRequest:
        return GenerateRequest(f"bench-{time.monotonic_ns()}", prompt, self.greedy, hash_blocks(self.config.hash_spec, prompt))

    async def reset(self, *rids: str) -> None:
        for rid in rids:
            while not (await self.handle.reset_prefix_cache.remote(ReplicaCall(rid)))["reset"]:
                await asyncio.sleep(0.1)

    async def repeat(self, src: str, dst: str) -> dict:
        """One repeat: the holder computes the prompt; the other replica recomputes it
        cold, then (its cache emptied) pulls the prefix and computes the question."""
        a = self.args
        prompt = self.prompt(a.prefix_len + a.question_len)
        await self.reset(src, dst)
        ref = await _first_token(self.handle, self.request(prompt), RouteDecision(src, 0, "cold"))
        cold = await _first_token(self.handle, self.request(prompt), RouteDecision(dst, 0, "cold"))
        await self.reset(dst)
        pull = RouteDecision(dst, a.prefix_len, "pull", pull_from=src, pull_tokens=a.prefix_len)  # type: ignore[arg-type]
        pulled = await _first_token(self.handle, self.request(prompt), pull)
        return {"reference": ref, "cold": cold, "pull": pulled}

    async def routed(self, src: str, dst: str) -> dict:
        """The router's own choice for a prompt whose prefix ``src`` holds while ``src``
        prefills another long prompt (sent first, through the same router)."""
        a = self.args
        await self.reset(src, dst)
        prompt = self.prompt(a.prefix_len + a.question_len)
        ref = await _first_token(self.handle, self.request(prompt), RouteDecision(src, 0, "cold"))
        busy = self.request(self.prompt(a.prefix_len))
        load = asyncio.ensure_future(_first_token(self.handle, busy, RouteDecision(src, 0, "cold")))
        await asyncio.sleep(0.5)  # the holder's queue reaches the router
        client = KVRouteClient.for_app(self.config)
        start, first, tokens, outcomes = time.perf_counter(), None, [], []
        async for d in client.generate(prompt, self.greedy, on_route=outcomes.append):
            if first is None and d.token_ids:
                first = time.perf_counter() - start
            tokens += d.token_ids
        await load
        outcome = outcomes[0] if outcomes else None
        decision = outcome.decision if outcome is not None else None
        return {"ttft_s": first, "served_by": None if outcome is None else outcome.served_by,
                "reason": None if decision is None else decision.reason,
                "pull_from": None if decision is None else decision.pull_from,
                "pulled": 0 if outcome is None else outcome.pulled_tokens, "greedy_equal": tokens == ref["tokens"]}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    bs = args.block_size
    blocks = 3 * (-(-(args.prefix_len + args.question_len + args.new_tokens) // bs)) + 16
    engine = EngineConfig(model=args.model, dtype=args.dtype, block_size=bs, num_kv_blocks=blocks)
    config = ClusterConfig(engine=engine, app_name=APP, num_replicas=2, num_cpus_per_replica=1.0, torch_threads=1,
                           router_num_cpus=0.1, heartbeat_s=0.2).with_random_hash_seed()  # fmt: skip
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        serve.start()
        serve.run(build_engine_deployment(config), name=APP, route_prefix=None)
        result = asyncio.run(_measure(config, args))
    finally:
        serve.delete(APP)
        kill_router_actor(config.router_actor_name)
        ray.shutdown()
    write_result("serve_pull", result, _summary(result, args), args.out)
    return 0 if result["greedy_equal"] else 1


async def _measure(config: ClusterConfig, args: argparse.Namespace) -> dict:
    bench = _Bench(config, args)
    router = ray.get_actor(config.router_actor_name, namespace="kvroute")
    while len(await router.replicas.remote()) < 2:
        await asyncio.sleep(0.2)
    src, dst = sorted(await router.replicas.remote())
    await bench.repeat(src, dst)  # warm-up: both replicas step once, the pull path's handle is made
    runs = [await bench.repeat(src, dst) for _ in range(args.repeats)]
    routed = await bench.routed(src, dst)
    med = statistics.median
    cold, pull = med(r["cold"]["ttft_s"] for r in runs), med(r["pull"]["ttft_s"] for r in runs)
    equal = all(r[k]["tokens"] == r["reference"]["tokens"] for r in runs for k in ("cold", "pull"))
    report = await bench.handle.debug_state.remote(ReplicaCall(dst))
    metrics = (await router.metrics.remote())["replicas"].get(dst, {}).get("kv_transfer")
    return {
        "model": args.model, "dtype": args.dtype, "prefix_len": args.prefix_len, "question_len": args.question_len,
        "block_size": args.block_size, "repeats": args.repeats,
        "recompute_ttft_s": cold, "pull_ttft_s": pull, "ratio": pull / cold, "greedy_equal": equal,
        "pulled_tokens": [r["pull"]["pulled"] for r in runs], "cached_after_pull": [r["pull"]["cached"] for r in runs],
        "runs": [{k: {f: v for f, v in r[k].items() if f != "tokens"} for k in r} for r in runs],
        "routed": routed, "dst_state": {k: report[k] for k in ("blocks_in_use", "num_kv_blocks")},
        "dst_transfer_metrics": metrics, "decisions_by_reason": (await router.stats.remote())["decisions_by_reason"],
    }  # fmt: skip


def _summary(r: dict, args: argparse.Namespace) -> str:
    rt = r["routed"]
    return (f"{args.prefix_len}-token prefix through Serve (2 replicas): pull + first token {r['pull_ttft_s']:.3f}s vs "
            f"recompute {r['recompute_ttft_s']:.3f}s: {r['ratio']:.3f}x; greedy equal: {r['greedy_equal']}; "
            f"routed while the holder is busy: {rt['reason']} (pulled {rt['pulled']}, first token {rt['ttft_s']:.3f}s)")


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
