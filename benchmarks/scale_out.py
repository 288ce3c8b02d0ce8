"""Scale-out under load through the Serve application: emulated replicas serve tenants
whose long system prompts are shared by their requests (popularity Zipf over the
tenants), Poisson arrivals; after ``--before-s`` one more replica joins, and the run goes
on for ``--window-s`` after the new replica serves. Once with the joining replica's
warm-up off (``ClusterConfig.fleet_prefixes`` 0), once on (``--fleet-prefixes``).

Reports, over the requests that start within the window after the join: the new
replica's prefix-cache hit rate (cached / prompt tokens) beside the fleet's, its share
of the requests, its first ten requests' hit rate, the fleet's TTFT p50/p90, and the
warm-up's prefixes, tokens and seconds. Every time is emulated seconds: the engines'
steps and transfers take ``--time-scale`` times their profile's time and the arrivals
and the schedule are stretched alike, so the 2-core box's own costs (Ray, the router,
this client) shrink beside the engines'.

    kvroute bench scale_out                     # 3 replicas + 1, x3, both settings
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import threading
import time

import ray
from ray import serve

from kvroute.benchmarks import options
from kvroute.benchmarks.common import write_result
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.messages import FirstDelta, GenerateRequest, ReplicaCall
from kvroute.cluster.replica_deployment import build_engine_deployment, replica_version
from kvroute.cluster.router_lookup import kill_router_actor
from kvroute.replica.block_hash import hash_blocks
from kvroute.replica.config import EngineConfig
from kvroute.replica.sampling_params import SamplingParams

APP = "kvbench-scaleout"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct", help="its config only: the engines are emulated")
    ap.add_argument("--emulate", default="gpu_h100_llama3_8b")
    ap.add_argument("--time-scale", type=float, default=3.0)
    ap.add_argument("--replicas", type=int, default=3, help="before the join (one more joins)")
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rate", type=float, default=24.0, help="requests per emulated second")
    ap.add_argument("--before-s", type=float, default=30.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    options.add_policy_kwargs(ap)
    ap.add_argument("--settings", default="0,8", help="the runs' ClusterConfig.fleet_prefixes (0: no warm-up)")
    options.add_seed(ap)
    options.add_output(ap, "scale_out")


class _Load:
    """The client: tenants' requests at Poisson arrivals through the kvroute request router."""

    def __init__(self, config: ClusterConfig, args: argparse.Namespace) -> None:
        self.config, self.args = config, args
        self.handle = serve.get_deployment_handle(config.deployment_name, app_name=config.app_name)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        rng = random.Random(args.seed)
        self.systems = [[rng.randrange(100, 40_000) for _ in range(args.prefix_len)] for _ in range(args.tenants)]
        self.weights = [1.0 / (i + 1) ** args.zipf for i in range(args.tenants)]
        self.rng = random.Random(args.seed + 1)
        self.records: list[dict] = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Emulated seconds since the start."""
        return (time.perf_counter() - self.t0) / self.args.time_scale

    async def one(self) -> None:
        tenant = self.rng.choices(range(self.args.tenants), self.weights)[0]
        prompt = self.systems[tenant] + [self.rng.randrange(100, 40_000) for _ in range(self.args.question_len)]
        request = GenerateRequest(f"so-{time.monotonic_ns()}", prompt, self.params, hash_blocks(self.config.hash_spec, prompt))
        rec = {"start": self.now(), "tenant": tenant, "prompt": len(prompt), "cached": 0, "served_by": None, "ttft": None}
        try:
            async for item in self.handle.options(stream=True).generate.remote(request):
                if isinstance(item, FirstDelta):
                    rec["served_by"], item = item.outcome.served_by, item.delta
                if rec["ttft"] is None and item.token_ids:
                    rec["ttft"] = self.now() - rec["start"]
                rec["cached"] = item.num_cached_tokens
        except Exception as exc:  # counted, not fatal
            rec["error"] = repr(exc)
        self.records.append(rec)

    async def drive(self, until: threading.Event) -> None:
        tasks = []
        while not until.is_set():
            tasks.append(asyncio.ensure_future(self.one()))
            await asyncio.sleep(self.rng.expovariate(self.args.rate) * self.args.time_scale)
        await asyncio.gather(*tasks)


def _deploy(config: ClusterConfig, replicas: int) -> None:
    config = dataclasses.replace(config, num_replicas=replicas)
    serve.run(build_engine_deployment(config, version=replica_version(config)), name=config.app_name, route_prefix=None)


async def _one_setting(args: argparse.Namespace, prefixes: int) -> dict:
    engine = EngineConfig(model=args.model, block_size=16, num_kv_blocks=8192, emulate=args.emulate,
                          time_scale=args.time_scale)  # fmt: skip
    # an application per setting: this process's handle keeps the request router of an app's first deployment
    config = ClusterConfig(engine=engine, app_name=f"{APP}-{prefixes}", num_replicas=args.replicas, num_cpus_per_replica=0.25,
                           router_num_cpus=0.25, router_policy_kwargs=args.policy_kwargs,
                           fleet_prefixes=prefixes).with_random_hash_seed()  # fmt: skip
    _deploy(config, args.replicas)
    router = ray.get_actor(config.router_actor_name, namespace="kvroute")
    try:
        while len(await router.replicas.remote()) < args.replicas:
            await asyncio.sleep(0.2)
        load, stop = _Load(config, args), threading.Event()
        driver = asyncio.ensure_future(load.drive(stop))
        await asyncio.sleep(args.before_s * args.time_scale)
        old = set(await router.replicas.remote())
        joined_at = load.now()
        await asyncio.to_thread(_deploy, config, args.replicas + 1)
        ready_at = load.now()
        (new,) = set(await router.replicas.remote()) - old
        await asyncio.sleep(args.window_s * args.time_scale)
        stop.set()
        await driver
        state = await load.handle.debug_state.remote(ReplicaCall(new))
        stats = await router.stats.remote()
    finally:
        serve.delete(config.app_name)
        kill_router_actor(config.router_actor_name)
    out = _report(load.records, new, joined_at, ready_at, args.window_s, state["kv_transfer"], prefixes)
    out["router"] = {k: stats[k] for k in ("decisions", "decisions_by_reason", "warmup_plans", "warmup_moves")}
    return out


def _hit(recs: list[dict]) -> float | None:
    prompt = sum(r["prompt"] for r in recs)
    return sum(r["cached"] for r in recs) / prompt if prompt else None


def _report(records: list[dict], new: str, joined_at: float, ready_at: float, window_s: float, xfer: dict,
            prefixes: int) -> dict:  # fmt: skip
    ok = [r for r in records if "error" not in r]
    window = sorted((r for r in ok if ready_at <= r["start"] < ready_at + window_s), key=lambda r: r["start"])
    mine = [r for r in window if r["served_by"] == new]
    ttfts = sorted(r["ttft"] for r in window if r["ttft"] is not None)
    new_hit, fleet_hit = _hit(mine), _hit(window)
    return {
        "fleet_prefixes": prefixes, "requests": len(records), "errors": len(records) - len(ok),
        "join_s": round(ready_at - joined_at, 3), "window_requests": len(window), "new_requests": len(mine),
        "new_hit_rate": new_hit, "fleet_hit_rate": fleet_hit, "new_first10_hit_rate": _hit(mine[:10]),
        "ratio": new_hit / fleet_hit if new_hit is not None and fleet_hit else None,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "warmup": {k: xfer[k] for k in ("warmup_prefixes", "warmup_blocks", "warmup_tokens", "warmup_skipped", "warmup_s")},
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        serve.start()
        runs = [asyncio.run(_one_setting(args, int(p))) for p in options.csv(args.settings)]
    finally:
        ray.shutdown()
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": runs}
    write_result("scale_out", result, _summary(runs, args), args.out)
    return 0


def _summary(runs: list[dict], args: argparse.Namespace) -> str:
    def one(r: dict) -> str:
        f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        return (f"warm-up {r['fleet_prefixes']}: new {f(r['new_hit_rate'])} (first 10 {f(r['new_first10_hit_rate'])}, "
                f"{r['new_requests']}/{r['window_requests']} req) vs fleet {f(r['fleet_hit_rate'])} = {f(r['ratio'])}x, "
                f"TTFT p50/p90 {f(r['ttft_p50_s'])}/{f(r['ttft_p90_s'])} s, warmed {r['warmup']['warmup_tokens']} tok "
                f"in {r['warmup']['warmup_s']:.2f} s")  # fmt: skip
    return (f"{args.replicas}+1 replicas x{args.time_scale:g} at {args.rate:g}/s {args.policy_kwargs or ''}, "
            f"first {args.window_s:g} s: " + "; ".join(map(one, runs)))


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
