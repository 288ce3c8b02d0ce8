"""Routers side by side on ONE set of engine replicas: the same workload, at the same
request rates, through kvroute's router, round robin, power of two (Ray Serve's
default) and Ray Serve LLM's real ``PrefixCacheAffinityRouter``; and, where the
``sglang-router`` / ``vllm-router`` packages are installed, SGLang's and vLLM's real
routers (``--policy cache_aware``) in front of single-engine servers (``kvroute
serve-replica``) on the same engine settings.

How one fleet serves every router: the engine deployment gets a pinned Serve
``version`` that ignores the router fields (``replica_version``), so redeploying the
application with another ``request_router_config`` / ``router_policy`` only
reconfigures the running replicas (Serve's ``NeedsActorReconfigure`` update); the
HTTP ingress, which holds the handle whose request router routes, is replaced and so
builds the new router. Before every run each replica's prefix cache is reset, and its
LoRA adapter slots emptied (``EngineReplica.reset_prefix_cache``, addressed through a control handle built while
kvroute's request router was active), the router actor's directory is emptied and
Ray's prefix-tree actor is killed, so every router starts cold. The JSON records the
replica ids seen in every run: they must be the same set.

Each kind of fleet is a ``Fleet`` (``ServeFleet``, ``ExternalFleet``): ``start(router)``
serves that router from cold caches and gives its base URL; one loop runs every router
at every rate. With ``--emulate PROFILE [--time-scale K]`` the replicas are emulated
(``replica/emulated.py``: real scheduler and KV cache, the profile's step times × K)
and every reported time is in unscaled seconds.

Outputs (``--out-dir``, default ``results/compare_routers/<workload>``): one JSON per
router and rate, ``combined.json`` (table rows + target ratios), ``table.md`` and PNG
plots (``ttft_cdf.png``, ``hit_rate.png``, ``ttft_vs_rate.png``).

Locally (starts a Ray cluster):
    python -m kvroute.benchmarks.compare_routers --gsp-num-groups 16 ...
As a Ray job (``ray start --head --num-cpus 4``; Ray 2.60 token auth, see the README):
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m kvroute.benchmarks.compare_routers ...
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from kvroute.benchmarks import cpu_account, serving
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.external_fleet import ExternalFleet
from kvroute.benchmarks.fleets import (
    EXTERNAL_ROUTERS, ONE_ROUTER, SERVE_ROUTERS, SERVED_NAME, Fleet, ServeFleet, external_available, per_replica,
)
from kvroute.benchmarks.router_report import format_rows, write_outputs
from kvroute.deploy.cli import parse_engine_kwargs


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.compare_routers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or checkpoint folder")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--max-ongoing-requests", type=int, default=64)
    p.add_argument("--engine-kwargs", default='{"block_size": 16}', help="EngineConfig fields as JSON (every router's engines)")
    p.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="emulated replicas with this step-time profile (replica/profiles.py); see --time-scale")
    p.add_argument("--routers", default=None,
                   help=f"comma list of {SERVE_ROUTERS + tuple(EXTERNAL_ROUTERS)} (default: the four Serve routers, plus "
                        "sglang_router / vllm_router where the sglang-router / vllm-router package is installed)")
    p.add_argument("--kill-replicas", type=int, default=0, help="replicas that die mid-run (each comes back empty)")
    p.add_argument("--add-replicas", type=int, default=0,
                   help="scale-out: every run starts with --replicas minus this many, which join mid-run")
    p.add_argument("--event-at", type=float, default=0.5,
                   help="when replicas die or join (or a router dies), as a fraction of the trace's arrival span")
    p.add_argument("--ingresses", type=int, default=1,
                   help="I ingresses, the clients spread evenly over them: I Serve ingresses sharing the engines "
                        "and routers, I external router processes in front of the same replicas")
    p.add_argument("--num-routers", type=int, default=None,
                   help=f"kvroute's router actors (default: one per ingress; {ONE_ROUTER} always runs one)")
    p.add_argument("--kill-router", action="store_true",
                   help="kvroute only: the busiest of its router actors dies at --event-at (not restarted)")
    p.add_argument("--window-s", type=float, default=60.0,
                   help="the hit rate of the requests that start this long (unscaled s) after the event is reported")
    p.add_argument("--request-rates", default=None, help="comma list of request rates to sweep (default: --request-rate)")
    p.add_argument("--app-name", default="kvroute-bench")
    p.add_argument("--deployment-name", default="EngineReplica", help=argparse.SUPPRESS)
    p.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, as in a Ray job, else start one)")
    p.add_argument("--out-dir", default=None, help="default: results/compare_routers/<workload>")
    p.add_argument("--label", default=None)
    serving.add_workload_args(p)
    serving.add_load_args(p)
    return p


def _settings(args: argparse.Namespace, routers: list[str]) -> tuple[dict[str, Any], serving.LoadConfig]:
    """The engines' settings (one hash seed for every redeploy; emulation) and the load."""
    engine_kwargs = parse_engine_kwargs(args.engine_kwargs)
    engine_kwargs.setdefault("hash_seed", secrets.randbits(63))
    if args.emulate:
        engine_kwargs["emulate"] = args.emulate
    if args.time_scale != 1.0:
        engine_kwargs.setdefault("time_scale", args.time_scale)
    if engine_kwargs.get("time_scale", 1.0) != args.time_scale:
        raise ValueError(f"--time-scale {args.time_scale} and engine_kwargs time_scale {engine_kwargs['time_scale']} differ")
    config = dataclasses.replace(serving.load_config_from_args(args), block_size=int(engine_kwargs.get("block_size", 16)))
    if any(r in EXTERNAL_ROUTERS for r in routers) and config.prompt_format == "tokens":
        # sglang-router and vllm-router take text prompts only (their OpenAI schema has no token-id
        # prompt): every router gets the same decoded text, so the runs stay comparable
        print("compare_routers: an external router is in the run: sending text prompts to every router", flush=True)
        config = dataclasses.replace(config, prompt_format="text")
    return engine_kwargs, config


def _routers(args: argparse.Namespace) -> list[str]:
    routers = [r.strip() for r in args.routers.split(",")] if args.routers else [
        *SERVE_ROUTERS, *(r for r in EXTERNAL_ROUTERS if external_available(r))]
    known = (*SERVE_ROUTERS, ONE_ROUTER, *EXTERNAL_ROUTERS)
    unknown = [r for r in routers if r not in known]
    if unknown:
        raise ValueError(f"unknown routers {unknown}; choose from {known}")
    missing = [r for r in routers if r in EXTERNAL_ROUTERS and not external_available(r)]
    if missing:
        raise ValueError(f"{missing} not installed (pip install {' '.join(r.replace('_', '-') for r in missing)})")
    if args.ingresses < 1 or (args.num_routers is not None and args.num_routers < 1):
        raise ValueError(f"--ingresses and --num-routers must be >= 1, got {args.ingresses} and {args.num_routers}")
    if args.kill_router and (routers != ["kvroute"] or (args.num_routers or args.ingresses) < 2):
        raise ValueError("--kill-router needs --routers kvroute and at least 2 router actors (--ingresses or --num-routers): "
                         "the others take over")
    return routers


def _join_ray(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    address = args.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        pass  # a caller (a test, a notebook) already joined a cluster
    elif address:
        ray.init(address=address, logging_level="warning")
    else:  # logical CPUs: room for every replica, ingress and router even on a small machine
        routers = args.num_routers or args.ingresses
        need = int(math.ceil(args.replicas * args.num_cpus_per_replica + 0.5 * routers + 0.1 * args.ingresses + 2))
        # address="local": a new cluster even where an old `ray start` left its address behind
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": "127.0.0.1", "port": args.http_port})


async def _measure(fleet: Fleet, base_urls: list[str], workload: wl.Workload, config: serving.LoadConfig,
                   decode: Any, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """One benchmark, its clients spread over ``base_urls``; at ``--event-at`` × the
    trace's arrival span, ``--kill-replicas`` replicas die (and come back empty),
    ``--add-replicas`` join and ``--kill-router`` kills a router actor, while it runs."""
    bench = asyncio.ensure_future(serving.benchmark(base_urls, workload, config, SERVED_NAME, decode))
    events: dict[str, Any] = {"killed_replicas": [], "added_replicas": [], "killed_routers": []}
    if args.kill_replicas or args.add_replicas or args.kill_router:
        span = max(r.arrival_s for r in serving.with_arrivals(workload, config.request_rate, config.arrival, config.seed).requests)
        await asyncio.sleep(args.event_at * span * config.time_scale)
        if not bench.done() and args.kill_replicas:
            events["killed_replicas"] = await asyncio.to_thread(fleet.kill_replicas, args.kill_replicas)
        if not bench.done() and args.add_replicas:
            events["added_replicas"] = await asyncio.to_thread(fleet.add_replicas, args.add_replicas)
        if not bench.done() and args.kill_router:
            events["killed_routers"] = [await asyncio.to_thread(fleet.kill_router)]
        events["event_s"] = args.event_at * span  # unscaled, as the results' start times
        print(f"  at {args.event_at:.0%} of the arrivals: " + ", ".join(f"{k} {v}" for k, v in events.items() if v), flush=True)
    return await bench, events


def after_event(r: dict[str, Any], event_s: float, window_s: float) -> dict[str, Any]:
    """The completed requests that started within ``window_s`` after the event: their
    ids and prefix-cache hit rate (the same ids' rate in an undisturbed run compares)."""
    picked = [i for i, (t, err) in enumerate(zip(r["start_times"], r["errors"])) if not err and event_s <= t < event_s + window_s]
    return {"after_event_request_ids": [r["request_ids"][i] for i in picked],
            "after_event_hit_rate": window_hit_rate(r, [r["request_ids"][i] for i in picked])}  # fmt: skip


def window_hit_rate(r: dict[str, Any], request_ids: Sequence[str]) -> Optional[float]:
    """Cached / prompt tokens over ``request_ids`` of run ``r`` (None: no prompt tokens)."""
    at = {rid: i for i, rid in enumerate(r["request_ids"])}
    idx = [at[rid] for rid in request_ids if rid in at and not r["errors"][at[rid]]]
    prompt = sum(r["input_lens"][i] for i in idx)
    return sum(r["cached_lens"][i] or 0 for i in idx) / prompt if prompt else None


def per_ingress(r: dict[str, Any], ingresses: int) -> list[int]:
    """Completed requests per ingress (the client's side of the spread)."""
    counts = [0] * ingresses
    for i, err in zip(r["ingresses"], r["errors"]):
        counts[i] += not err
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = serving.workload_from_args(args)
    routers = _routers(args)
    if not 0 <= args.add_replicas < args.replicas:
        raise ValueError(f"--add-replicas must be in [0, --replicas), got {args.add_replicas}")
    engine_kwargs, config = _settings(args, routers)
    decode = serving.decoder(args.tokenizer or (args.model if config.prompt_format == "text" else None))
    rates = [float(x) for x in args.request_rates.split(",")] if args.request_rates else [args.request_rate]
    label = args.label or workload.name
    out_dir = Path(args.out_dir) if args.out_dir else Path(os.environ.get("KVROUTE_RESULTS", "results")) / "compare_routers" / label

    serve_fleet, external_fleet = ServeFleet(args, engine_kwargs), ExternalFleet(args, engine_kwargs)
    fleets: dict[str, Fleet] = {r: external_fleet if r in EXTERNAL_ROUTERS else serve_fleet for r in routers}
    if any(f is serve_fleet for f in fleets.values()):
        _join_ray(args)
        if routers[0] != "kvroute":
            serve_fleet.start("kvroute")  # the control handle must be built under kvroute's request router
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    try:
        for rate in rates:
            for router in routers:
                fleet = fleets[router]
                info = fleet.start(router)
                print(f"compare_routers: {router} at {rate} req/s ({len(workload)} requests)…", flush=True)
                before, routing_before = fleet.counters(), fleet.router_counters()
                cpu_before, t0 = cpu_account.snapshot(), time.perf_counter()
                r, events = asyncio.run(_measure(fleet, info["base_urls"], workload, dataclasses.replace(config, request_rate=rate),
                                                 decode, args))  # fmt: skip
                cpu = cpu_account.usage(cpu_before, cpu_account.snapshot(), time.perf_counter() - t0)
                run_info = {"router": router, **info, **events, "cpu": cpu, "fleet_cpu_cores": cpu["cores"],
                            "ingresses": args.ingresses, "requests_per_ingress": per_ingress(r, args.ingresses)}  # fmt: skip
                if "event_s" in events:
                    run_info.update(after_event(r, events["event_s"], args.window_s))
                print(f"  fleet CPU: {cpu_account.describe(cpu)}", flush=True)
                if before is not None:
                    time.sleep(1.5)  # the replicas' last metrics report
                    run_info["per_replica"] = spread = per_replica(before, fleet.counters() or {})
                    print("  per replica (requests, prompt, cached, adapter loads): " + "; ".join(
                        f"{rid}: {c['requests']:.0f}, {c['prompt_tokens']:.0f}, {c['cached_tokens']:.0f}, "
                        f"{c.get('adapter_loads', 0):.0f}" for rid, c in spread.items()), flush=True)  # fmt: skip
                if fleet.kind == "serve":
                    run_info["peer_staleness_ms"] = fleet.peer_staleness_ms()
                if routing_before is not None:
                    after = fleet.router_counters() or {}
                    run_info["routing"] = routing = {k: v - routing_before.get(k, 0.0) for k, v in sorted(after.items())}
                    print("  routing: " + ", ".join(f"{k} {v:.0f}" for k, v in routing.items() if v), flush=True)
                results[f"{router}_rate{rate:g}"] = {**run_info, **r}
                print(f"  {router}: {serving.summary_line(r)}", flush=True)
    finally:
        for fleet in {id(f): f for f in fleets.values()}.values():
            fleet.close()  # (one external router at a time: each start() stops the one before)
    meta = {
        "label": label, "workload": workload.name, "workload_params": workload.params, "model": args.model,
        "replicas": args.replicas, "ingresses": args.ingresses, "num_routers": args.num_routers,
        "torch_threads": args.torch_threads, "engine_kwargs": engine_kwargs,
        "routers": routers, "request_rates": rates, "max_concurrency": config.max_concurrency,
        "same_replicas_for_every_serve_router": bool(serve_fleet.replica_ids), "replica_ids": serve_fleet.replica_ids,
        "wall_s": time.perf_counter() - t_start,
    }
    from kvroute.benchmarks.common import machine

    meta["machine"] = machine()
    combined = write_outputs(out_dir, results, meta)
    print(format_rows(combined["rows"]))
    for t in combined["targets"]:
        print("targets:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}))
    combined["out_dir"] = str(out_dir)
    return combined


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        combined = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t = combined["targets"][-1] if combined["targets"] else {}
    line = ", ".join(f"{k} {v:.3f}" for k, v in t.items() if isinstance(v, float) and k != "rate")
    errors = sum(r["failed"] for r in combined["rows"])
    print(f"compare_routers[{combined['label']}]: {len(combined['rows'])} runs, {errors} errors; {line}  [{combined['out_dir']}]")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
