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
and every reported time is in unscaled seconds, which leaves out nearly all of the routing
layer's own wall time: ``--overhead-from DATA_PATH_JSON`` (or ``--overhead-measure``) adds
each router's real-speed added latency beside them (``benchmarks/real_speed.py``).

Outputs (``--out-dir``, default ``results/compare_routers/<label>``, the label defaulting to the workload's name): one JSON per
router and rate, ``combined.json`` (table rows + target ratios), ``table.md`` and PNG
plots (``ttft_cdf.png``, ``hit_rate.png``, ``ttft_vs_rate.png``).

Locally (starts a Ray cluster):
    kvroute bench compare_routers --gsp-num-groups 16 ...
As a Ray job (``ray start --head --num-cpus 4``; Ray 2.60 token auth, see docs/cluster.md):
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m kvroute.benchmarks compare_routers ...
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvroute.benchmarks import cpu_account, options, real_speed, serving
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.external_fleet import ExternalFleet
from kvroute.benchmarks.fleet_probes import per_replica
from kvroute.benchmarks.fleets import (
    EXTERNAL_ROUTERS, ONE_ROUTER, SERVE_ROUTERS, SERVED_NAME, Fleet, FleetConfig, ServeFleet, external_available,
    fleet_from_args,
)
from kvroute.benchmarks.real_speed import RouterOverhead
from kvroute.benchmarks.router_report import after_event, format_rows, joined_hit, per_ingress, write_outputs
from kvroute.benchmarks.serving_config import LoadConfig


@dataclass(frozen=True)
class CompareConfig:
    """One comparison: ``workload`` offered as ``load`` says at each of ``request_rates``
    (default: ``load.request_rate``) through each of ``routers`` (default: the Serve
    routers, plus the external ones that are installed) on ``fleet``'s replicas, whose
    engines take ``engine_kwargs`` (emulating the profile ``emulate`` at
    ``load.time_scale``). At ``event_at`` × the arrival span, ``kill_replicas`` replicas
    die, ``fleet.add_replicas`` join and, with ``kill_router``, a router actor dies;
    ``window_s``: the hit-rate window after that event. With ``overhead``, the rows and
    ratios also count each router's real-speed added latency."""

    workload: wl.Workload
    load: LoadConfig
    fleet: FleetConfig = FleetConfig()
    request_rates: tuple[float, ...] = ()
    routers: tuple[str, ...] = ()
    engine_kwargs: dict[str, Any] = field(default_factory=lambda: {"block_size": 16})
    emulate: Optional[str] = None
    tokenizer: Optional[str] = None
    kill_replicas: int = 0
    event_at: float = 0.5
    kill_router: bool = False
    window_s: float = 60.0
    out_dir: Optional[str] = None
    label: Optional[str] = None
    overhead: Optional[RouterOverhead] = None  # each router's real-speed added latency (benchmarks/real_speed.py)


# ---------------------------------------------------------------------- CLI
def add_args(p: argparse.ArgumentParser) -> None:
    f = options.add_fleet(p, replicas=2, cpus_per_replica=1.0, app_name="kvroute-bench")
    f.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or checkpoint folder")
    f.add_argument("--torch-threads", type=int, default=1)
    f.add_argument("--max-ongoing-requests", type=int, default=64)
    f.add_argument("--deployment-name", default="EngineReplica", help=argparse.SUPPRESS)
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
    options.add_output(p, "compare_routers", folder=True)
    p.add_argument("--label", default=None, help="the run's name and its folder under --out-dir's default (default: the workload's)")
    serving.add_workload_args(p)
    serving.add_load_args(p)
    real_speed.add_args(p)


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    from kvroute.deploy.cli import parse_engine_kwargs

    fleet = fleet_from_args(args, model=args.model, torch_threads=args.torch_threads, max_ongoing_requests=args.max_ongoing_requests,
                            add_replicas=args.add_replicas, ingresses=args.ingresses, num_routers=args.num_routers,
                            deployment_name=args.deployment_name)  # fmt: skip
    routers = options.csv(args.routers) or [*SERVE_ROUTERS, *(r for r in EXTERNAL_ROUTERS if external_available(r))]
    overhead = real_speed.from_args(args, routers, options.result_folder("compare_routers", args.out_dir), args.time_scale)
    return CompareConfig(
        workload=serving.workload_from_args(args), load=serving.load_config_from_args(args), fleet=fleet, overhead=overhead,
        request_rates=tuple(float(x) for x in options.csv(args.request_rates)), routers=tuple(options.csv(args.routers)),
        engine_kwargs=parse_engine_kwargs(args.engine_kwargs), emulate=args.emulate, tokenizer=args.tokenizer,
        kill_replicas=args.kill_replicas, event_at=args.event_at, kill_router=args.kill_router, window_s=args.window_s,
        out_dir=args.out_dir, label=args.label,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    combined = compare(config_from_args(args))
    t = combined["targets"][-1] if combined["targets"] else {}
    line = ", ".join(f"{k} {v:.3f}" for k, v in t.items() if isinstance(v, float) and k != "rate")
    errors = sum(r["failed"] for r in combined["rows"])
    print(f"compare_routers[{combined['label']}]: {len(combined['rows'])} runs, {errors} errors; {line}{_ttft_note(combined)}  "
          f"[{combined['out_dir']}]")  # fmt: skip
    return 0 if errors == 0 else 1


def _ttft_note(combined: dict[str, Any]) -> str:
    """With the routers' real-speed added latency: each router's TTFT p50/p90/p99 at the
    last rate, unscaled as measured and with its added latency (none: nothing)."""
    if "router_overhead" not in combined:
        return ""
    top = combined["rows"][-1]["rate"] if combined["rows"] else None
    parts = []
    for r in (r for r in combined["rows"] if r["rate"] == top):
        def ms(suffix: str) -> str:
            return "/".join("n/a" if r.get(k + suffix) is None else f"{r[k + suffix]:.0f}" for k in ("ttft_median_ms", "ttft_p90_ms", "ttft_p99_ms"))

        tail = (f" -> {ms(real_speed.SUFFIX)} with {r['router_added_system']} +{r['router_added_p50_ms']:.1f}/"
                f"+{r['router_added_p99_ms']:.1f}") if r.get("router_added_system") else " (no real-speed figure)"  # fmt: skip
        parts.append(f"{r['router']} {ms('')}{tail}")
    return "; TTFT p50/p90/p99 ms (emulated, unscaled) -> + the router's real-speed added latency: " + "; ".join(parts)


# ---------------------------------------------------------------------- kept fleets
_kept: Optional["KeptFleet"] = None


def kept_fleet() -> Optional["KeptFleet"]:
    """The ``KeptFleet`` whose block is running, if any."""
    return _kept


class KeptFleet:
    """Opt-in for a caller that runs several comparisons in one process (a test module):
    inside ``with KeptFleet(hash_seed):``, ``compare`` takes its Serve fleet from here
    and leaves it deployed at the end, so the next comparison with the same
    ``FleetConfig`` (``add_replicas`` aside) and engine settings only swaps the router
    (a reconfigure; every run still starts from cold caches) instead of starting the
    engine replicas anew. ``hash_seed`` is every engine's block-hash seed: a comparison
    otherwise draws one, which is another engine version and so new replicas. One
    fleet at a time (other settings close the kept one); a failed comparison and
    leaving the block close it. Without it each comparison deploys and deletes its own
    fleet (the command line never keeps one)."""

    def __init__(self, hash_seed: int) -> None:
        self.hash_seed = hash_seed
        self._fleet: Optional[ServeFleet] = None
        self._key: Any = None

    def serve_fleet(self, fleet: FleetConfig, engine_kwargs: dict[str, Any]) -> ServeFleet:
        """The kept fleet for these settings (started by its first ``start``)."""
        key = (dataclasses.replace(fleet, add_replicas=0), json.dumps(engine_kwargs, sort_keys=True, default=str))
        if self._fleet is not None and key == self._key:
            self._fleet.reuse(fleet)
        else:
            self.close()
            self._fleet, self._key = ServeFleet(fleet, engine_kwargs), key
        return self._fleet

    def close(self) -> None:
        """Delete the kept fleet's applications and router actors."""
        fleet, self._fleet, self._key = self._fleet, None, None
        if fleet is not None:
            fleet.close()

    def __enter__(self) -> "KeptFleet":
        global _kept
        if _kept is not None:
            raise RuntimeError("a KeptFleet is already active")
        _kept = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _kept
        _kept = None
        self.close()


# ---------------------------------------------------------------------- the comparison
def _settings(cfg: CompareConfig, routers: list[str]) -> tuple[dict[str, Any], LoadConfig]:
    """The engines' settings (one hash seed for every redeploy; emulation) and the load."""
    engine_kwargs = dict(cfg.engine_kwargs)
    kept = kept_fleet()
    engine_kwargs.setdefault("hash_seed", kept.hash_seed if kept else secrets.randbits(63))
    time_scale = cfg.load.time_scale
    if cfg.emulate:
        engine_kwargs["emulate"] = cfg.emulate
    if time_scale != 1.0:
        engine_kwargs.setdefault("time_scale", time_scale)
    if engine_kwargs.get("time_scale", 1.0) != time_scale:
        raise ValueError(f"--time-scale {time_scale} and engine_kwargs time_scale {engine_kwargs['time_scale']} differ")
    config = dataclasses.replace(cfg.load, block_size=int(engine_kwargs.get("block_size", 16)))
    if any(r in EXTERNAL_ROUTERS for r in routers) and config.prompt_format == "tokens":
        # sglang-router and vllm-router take text prompts only (their OpenAI schema has no token-id
        # prompt): every router gets the same decoded text, so the runs stay comparable
        print("compare_routers: an external router is in the run: sending text prompts to every router", flush=True)
        config = dataclasses.replace(config, prompt_format="text")
    return engine_kwargs, config


def _routers(cfg: CompareConfig) -> list[str]:
    fleet = cfg.fleet
    routers = list(cfg.routers) or [*SERVE_ROUTERS, *(r for r in EXTERNAL_ROUTERS if external_available(r))]
    known = (*SERVE_ROUTERS, ONE_ROUTER, *EXTERNAL_ROUTERS)
    unknown = [r for r in routers if r not in known]
    if unknown:
        raise ValueError(f"unknown routers {unknown}; choose from {known}")
    missing = [r for r in routers if r in EXTERNAL_ROUTERS and not external_available(r)]
    if missing:
        raise ValueError(f"{missing} not installed (pip install {' '.join(r.replace('_', '-') for r in missing)})")
    if fleet.ingresses < 1 or (fleet.num_routers is not None and fleet.num_routers < 1):
        raise ValueError(f"--ingresses and --num-routers must be >= 1, got {fleet.ingresses} and {fleet.num_routers}")
    if cfg.kill_router and (routers != ["kvroute"] or (fleet.num_routers or fleet.ingresses) < 2):
        raise ValueError("--kill-router needs --routers kvroute and at least 2 router actors (--ingresses or --num-routers): "
                         "the others take over")
    if not 0 <= fleet.add_replicas < fleet.replicas:
        raise ValueError(f"--add-replicas must be in [0, --replicas), got {fleet.add_replicas}")
    return routers


def _join_ray(fleet: FleetConfig) -> None:
    import ray
    from ray import serve

    address = fleet.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        pass  # a caller (a test, a notebook) already joined a cluster
    elif address:
        ray.init(address=address, logging_level="warning")
    else:  # logical CPUs: room for every replica, ingress and router even on a small machine
        routers = fleet.num_routers or fleet.ingresses
        need = int(math.ceil(fleet.replicas * fleet.num_cpus_per_replica + 0.5 * routers + 0.1 * fleet.ingresses + 2))
        # address="local": a new cluster even where an old `ray start` left its address behind
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": "127.0.0.1", "port": fleet.http_port})


async def _measure(fleet: Fleet, base_urls: list[str], config: LoadConfig, decode: Any,
                   cfg: CompareConfig) -> tuple[dict[str, Any], dict[str, list[str]]]:  # fmt: skip
    """One benchmark, its clients spread over ``base_urls``; at ``event_at`` × the
    trace's arrival span, ``kill_replicas`` replicas die (and come back empty),
    ``add_replicas`` join and ``kill_router`` kills a router actor, while it runs."""
    workload = cfg.workload
    bench = asyncio.ensure_future(serving.benchmark(base_urls, workload, config, SERVED_NAME, decode))
    events: dict[str, Any] = {"killed_replicas": [], "added_replicas": [], "killed_routers": []}
    if cfg.kill_replicas or cfg.fleet.add_replicas or cfg.kill_router:
        span = max(r.arrival_s for r in serving.with_arrivals(workload, config.request_rate, config.arrival, config.seed).requests)
        await asyncio.sleep(cfg.event_at * span * config.time_scale)
        if not bench.done() and cfg.kill_replicas:
            events["killed_replicas"] = await asyncio.to_thread(fleet.kill_replicas, cfg.kill_replicas)
        if not bench.done() and cfg.fleet.add_replicas:
            events["added_replicas"] = await asyncio.to_thread(fleet.add_replicas, cfg.fleet.add_replicas)
        if not bench.done() and cfg.kill_router:
            events["killed_routers"] = [await asyncio.to_thread(fleet.kill_router)]
        events["event_s"] = cfg.event_at * span  # unscaled, as the results' start times
        print(f"  at {cfg.event_at:.0%} of the arrivals: " + ", ".join(f"{k} {v}" for k, v in events.items() if v), flush=True)
    return await bench, events


def _one_run(fleet: Fleet, router: str, rate: float, config: LoadConfig, decode: Any, cfg: CompareConfig) -> dict[str, Any]:
    """``router`` at ``rate`` from cold caches: the run's results and what the fleet
    and its routers counted meanwhile."""
    info = fleet.start(router)
    print(f"compare_routers: {router} at {rate} req/s ({len(cfg.workload)} requests)…", flush=True)
    before, routing_before = fleet.counters(), fleet.router_counters()
    cpu_before, t0 = cpu_account.snapshot(), time.perf_counter()
    r, events = asyncio.run(_measure(fleet, info["base_urls"], dataclasses.replace(config, request_rate=rate), decode, cfg))
    cpu = cpu_account.usage(cpu_before, cpu_account.snapshot(), time.perf_counter() - t0)
    ingresses = cfg.fleet.ingresses
    run_info = {"router": router, **info, **events, "cpu": cpu, "fleet_cpu_cores": cpu["cores"],
                "ingresses": ingresses, "requests_per_ingress": per_ingress(r, ingresses)}  # fmt: skip
    if "event_s" in events:
        run_info.update(after_event(r, events["event_s"], cfg.window_s))
    print(f"  fleet CPU: {cpu_account.describe(cpu)}", flush=True)
    if before is not None:
        time.sleep(1.5)  # the replicas' last metrics report
        run_info["per_replica"] = spread = per_replica(before, fleet.counters() or {})
        if events.get("added_replicas"):
            run_info.update(joined_hit(spread, events["added_replicas"]))
        print("  per replica (requests, prompt, cached, adapter loads): " + "; ".join(
            f"{rid}: {c['requests']:.0f}, {c['prompt_tokens']:.0f}, {c['cached_tokens']:.0f}, "
            f"{c.get('adapter_loads', 0):.0f}" for rid, c in spread.items()), flush=True)  # fmt: skip
    if fleet.kind == "serve":
        run_info["peer_staleness_ms"] = fleet.peer_staleness_ms()
    if routing_before is not None:
        after = fleet.router_counters() or {}
        run_info["routing"] = routing = {k: v - routing_before.get(k, 0.0) for k, v in sorted(after.items())}
        print("  routing: " + ", ".join(f"{k} {v:.0f}" for k, v in routing.items() if v), flush=True)
    print(f"  {router}: {serving.summary_line(r)}", flush=True)
    return {**run_info, **r}


def compare(cfg: CompareConfig) -> dict[str, Any]:
    """Every router at every rate; writes the runs, ``combined.json``, ``table.md`` and
    the plots to the output folder and returns the combined result."""
    routers = _routers(cfg)
    engine_kwargs, config = _settings(cfg, routers)
    if cfg.overhead is not None and not config.time_scale > 1:  # at real speed the TTFTs already hold it
        raise ValueError(f"--overhead-from / --overhead-measure: for emulated runs at --time-scale > 1, got {config.time_scale:g}")
    decode = serving.decoder(cfg.tokenizer or (cfg.fleet.model if config.prompt_format == "text" else None))
    rates = list(cfg.request_rates) or [config.request_rate]
    label = cfg.label or cfg.workload.name
    out_dir = Path(cfg.out_dir) if cfg.out_dir else options.results_dir("compare_routers") / label

    kept = kept_fleet() if any(r not in EXTERNAL_ROUTERS for r in routers) else None
    serve_fleet = kept.serve_fleet(cfg.fleet, engine_kwargs) if kept else ServeFleet(cfg.fleet, engine_kwargs)
    external_fleet = ExternalFleet(cfg.fleet, engine_kwargs)
    fleets: dict[str, Fleet] = {r: external_fleet if r in EXTERNAL_ROUTERS else serve_fleet for r in routers}
    if any(f is serve_fleet for f in fleets.values()):
        _join_ray(cfg.fleet)
        if routers[0] not in ("kvroute", ONE_ROUTER) and not serve_fleet.has_control:
            serve_fleet.start("kvroute")  # the control handle must be built under kvroute's request router
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    try:
        for rate in rates:
            for router in routers:
                results[f"{router}_rate{rate:g}"] = _one_run(fleets[router], router, rate, config, decode, cfg)
    except BaseException:
        if kept:
            kept.close()  # a failed comparison leaves nothing behind for the next
        raise
    finally:
        for fleet in {id(f): f for f in fleets.values()}.values():
            if not (kept and fleet is serve_fleet):  # a kept fleet stays up for the next comparison
                fleet.close()  # (one external router at a time: each start() stops the one before)
    from kvroute.benchmarks.common import machine

    workload, f = cfg.workload, cfg.fleet
    meta = {
        "label": label, "workload": workload.name, "workload_params": workload.params, "model": f.model,
        "replicas": f.replicas, "ingresses": f.ingresses, "num_routers": f.num_routers,
        "torch_threads": f.torch_threads, "engine_kwargs": engine_kwargs,
        "routers": routers, "request_rates": rates, "max_concurrency": config.max_concurrency,
        "same_replicas_for_every_serve_router": bool(serve_fleet.replica_ids), "replica_ids": serve_fleet.replica_ids,
        "wall_s": time.perf_counter() - t_start, "machine": machine(),
    }  # fmt: skip
    combined = write_outputs(out_dir, results, meta, cfg.overhead)
    print(format_rows(combined["rows"]))
    if cfg.overhead is not None:
        print(cfg.overhead.note(routers))
    for t in combined["targets"]:
        print("targets:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}))
    combined["out_dir"] = str(out_dir)
    return combined


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
