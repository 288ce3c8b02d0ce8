"""Routers at fleet scale on emulated replicas: a scenario matrix.

    kvroute bench fleet_matrix [--replicas 16] [--profile gpu_h100_llama3_8b]
        [--time-scale 10] [--scenarios gsp,b2b,b2b-over,zipf,multi-tenant,failure,multi-turn,scale-out]
        [--loads 0.6,0.85,0.95,1.2] [--routers kvroute,prefix_affinity_ray,power_of_two,sglang_router,vllm_router]
        [--scale 1.0] [--host-kv-factor 0] [--sim-only] [--out-dir results/fleet_matrix]
    (as a Ray job: RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m kvroute.benchmarks fleet_matrix ...)

Every router gets the same fleet shape (``--replicas`` replicas emulating ``--profile``:
the real scheduler and KV cache, the profile's step times × ``--time-scale``; see
``replica/emulated.py``), cold caches and the same trace (fixed seed, Poisson arrivals;
a replayed trace's own arrival times for ``mooncake``) at each load, a fraction of the
scenario's capacity as the simulator estimates it for that fleet. Serve routers run on
one Serve application (``compare_routers.ServeFleet``), sglang-router and vllm-router in
front of ``kvroute serve-replica --emulate`` processes (``ExternalFleet``). Next to each
measured run stands the simulator's prediction for the same scenario, rate and fleet
(the peer routers by their re-implementations in ``router/policies``). Times are
unscaled seconds; ``--overhead-from DATA_PATH_JSON`` (or ``--overhead-measure``) adds each
router's real-speed added latency beside them and in the ratios (``benchmarks/real_speed.py``).

Scenarios: ``gsp`` (SGLang's generated-shared-prefix defaults), ``b2b`` (llm-d's B2B with
the prefixes filling ~73% of the fleet's KV), ``b2b-over`` (the prefixes at ~150% of it),
``zipf`` (Zipf-skewed groups, s = 1.1), ``multi-tenant`` (32 tenants over 4 system
prompts, each with its own ``cache_salt``), ``failure`` (gsp with 1 of 8 replicas killed
at mid-run and replaced empty), ``multi-turn`` (growing chat histories), ``scale-out``
(gsp on 3/4 of the replicas, the last quarter joining empty at mid-run; loads are
fractions of the whole fleet's capacity, so the first half runs over the smaller
fleet's). These are the default ``--scenarios``.

``mooncake`` (asked for by name) replays a Mooncake-format trace (JSON lines of
``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``; see
``benchmarks/traces.py``), by default the tests' 200-request synthetic one
(``tests/fixtures/mooncake_small.jsonl``), 64 tokens per hash id, answers cut to 128
tokens; ``--trace PATH`` replays another, ``--tokens-per-id`` and ``--max-output-len``
size it, ``--scale`` keeps its first requests and ``--len-scale`` multiplies the tokens
per id. Its requests keep the trace's arrival times, scaled by one factor so their mean
rate is the load's (the bursts kept: ``serving.with_arrivals(..., "trace")``), in the
measured runs and the simulator alike. Each replica's KV is sized so the trace's distinct
prompt blocks (what an infinite cache would hold) are at least ``kv_pressure`` = 1.3
times the fleet's, but room for 4 of its biggest requests at least (``trace_kv_pressure``
in the rows is the pressure reached: on many replicas that floor can bring it below 1).
Each row carries ``ideal_hit_rate``, the trace's own infinite-cache hit rate in whole
hash ids (``traces.ideal_hit_rate``), beside every router's hit; the measured rows'
``best_hit_rate`` is the same ceiling counted in 16-token blocks of the prompts sent (at
least as high: it also credits a request that shares part of an id's tokens).

``fork`` (asked for by name): N sub-agents branching from one long prefix at once
(``fork_workload.py``: 8 parents of 40K tokens, 43 sub-agents each, released together when
their parent ends); kvroute may pull the prefix to other replicas
(``router/policies/kv_pull_pricing.py``), ``--policy-kwargs '{"pulls": false}'`` runs it
without. The emulated replicas report their profile's pull figures and act on pulls, and
the simulator mirrors them (``SimConfig(pulls=True)``).

``--sim-only`` fills the whole matrix (every router, load and scenario) from the
simulator alone in minutes, with no Ray and no replicas: the rows then hold the
predictions, and the measured columns repeat them. There ``--routers`` may also name
``kvroute:LABEL``, kvroute with the options ``VARIANTS[LABEL]`` added to
``--policy-kwargs`` (``kvroute:nopulls``: ``{"pulls": false}``), so one invocation runs
a rule on and off beside the peers; a variant is kvroute's, never a peer, in the targets.

Outputs: ``matrix.json`` (every run, its prediction, the targets), ``table.md``, and per
scenario the compare_routers outputs (``<scenario>/``: JSON per run, plots). One
summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from kvroute.benchmarks import options, real_speed, serving
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.fleets import fleet_from_args
from kvroute.benchmarks.router_report import markdown_table, plus_router_cols
from kvroute.benchmarks.serving_config import quiet_load


@dataclass(frozen=True)
class Scenario:
    dataset: str
    workload_kwargs: dict[str, Any] = field(default_factory=dict)
    kv_fraction: Optional[float] = None  # size each replica's KV so the shared prefixes fill this share of the fleet's
    kv_pressure: Optional[float] = None  # size it so the distinct prompt blocks are this many times the fleet's KV
    kill_fraction: float = 0.0  # this share of the replicas dies at mid-run and comes back empty
    add_fraction: float = 0.0  # this share of the replicas joins at mid-run (the run starts without them)


SCENARIOS = {
    "gsp": Scenario("generated-shared-prefix"),
    "b2b": Scenario("b2b", kv_fraction=0.73),
    "b2b-over": Scenario("b2b", kv_fraction=1.5),
    "zipf": Scenario("zipf", {"s": 1.1}),
    "multi-tenant": Scenario("multi-tenant"),
    "failure": Scenario("generated-shared-prefix", kill_fraction=1 / 8),
    "multi-turn": Scenario("multi-turn"),
    "scale-out": Scenario("generated-shared-prefix", add_fraction=1 / 4),
    "mooncake": Scenario("mooncake", {"tokens_per_id": 64, "max_output_len": 128}, kv_pressure=1.3),
    "fork": Scenario("fork"),
}
DEFAULT_SCENARIOS = ("gsp", "b2b", "b2b-over", "zipf", "multi-tenant", "failure", "multi-turn", "scale-out")
# the simulator's stand-in for each router
SIM_POLICY = {"kvroute": "kvroute", "prefix_affinity_ray": "prefix_affinity_ray", "power_of_two": "power_of_two",
              "round_robin": "round_robin", "sglang_router": "cache_aware_sglang", "vllm_router": "cache_aware_vllm"}
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256
# --sim-only: ``kvroute:LABEL`` runs kvroute with these options added to --policy-kwargs
VARIANTS: dict[str, dict[str, Any]] = {"nopulls": {"pulls": False}}


def sim_key(router: str) -> str:
    """The simulator's stand-in for ``router`` (``kvroute:LABEL``: ``kvroute:LABEL``)."""
    base, _, label = router.partition(":")
    return SIM_POLICY[base] + (f":{label}" if label else "")


def is_ours(router: str) -> bool:
    """kvroute or one of its ``--sim-only`` variants (never a peer in the targets)."""
    return router.partition(":")[0] == "kvroute"


def workload_of(name: str, scale: float, len_scale: float, seed: int, **kwargs: Any) -> wl.Workload:
    """Scenario ``name``'s workload; ``kwargs`` override its generator's arguments."""
    s = SCENARIOS[name]
    return wl.make_workload(s.dataset, seed=seed, scale=scale, len_scale=len_scale, **{**s.workload_kwargs, **kwargs})


def is_trace(name: str) -> bool:
    """Whether scenario ``name`` replays a trace file (``--trace`` and its options apply)."""
    return SCENARIOS[name].dataset == "mooncake"


def trace_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """For a trace scenario, the ``--trace`` / ``--tokens-per-id`` / ``--max-output-len``
    given (0: the trace's own answer lengths) as its workload's arguments; else none."""
    if not is_trace(name):
        return {}
    out: dict[str, Any] = {}
    if getattr(args, "trace", None):
        out["path"] = args.trace
    if getattr(args, "tokens_per_id", None):
        out["tokens_per_id"] = args.tokens_per_id
    if getattr(args, "max_output_len", None) is not None:
        out["max_output_len"] = args.max_output_len or None
    return out


def arrival_of(workload: wl.Workload) -> str:
    """How the workload's requests arrive: ``trace`` (its own times, scaled to the rate)
    where it says they come from a trace, else Poisson."""
    return "trace" if workload.params.get("arrival") == "trace" else "poisson"


def stamped(workload: wl.Workload, rate: float, seed: int) -> wl.Workload:
    """``workload`` arriving at ``rate``, as the measured runs offer it."""
    return serving.with_arrivals(workload, rate, arrival_of(workload), seed)


def distinct_blocks(workload: wl.Workload) -> int:
    """The workload's distinct full prompt blocks: what one infinite cache would hold."""
    from kvroute.replica.block_hash import HashSpec, hash_blocks

    spec = HashSpec(BLOCK_SIZE, 0, "fleet_matrix")
    seen: set[int] = set()
    for r in workload.requests:
        seen.update(hash_blocks(spec, r.prompt_token_ids, r.cache_salt, lora_name=r.lora_name))
    return len(seen)


def kv_blocks_of(name: str, workload: wl.Workload, replicas: int, profile_blocks: int) -> int:
    """Per-replica KV blocks: the profile's, or sized so the shared prefixes fill the
    scenario's share of the fleet (``kv_fraction``), or so the distinct prompt blocks
    are ``kv_pressure`` times the fleet's KV; room for a few whole requests at least."""
    s = SCENARIOS[name]
    blocks = profile_blocks
    if s.kv_fraction:
        prefix_blocks = workload.num_groups * (workload.shared_prefix_tokens // BLOCK_SIZE)
        blocks = math.ceil(prefix_blocks / (s.kv_fraction * replicas))
    elif s.kv_pressure:  # rounded down: the pressure reached is at least the scenario's
        blocks = max(1, math.floor(distinct_blocks(workload) / (s.kv_pressure * replicas)))
    biggest = max(-(-(r.num_prompt_tokens + r.output_len) // BLOCK_SIZE) for r in workload.requests)
    return max(blocks, 4 * biggest)


def predict(workload: wl.Workload, profile: Any, replicas: int, kv_blocks: int, rates: Sequence[float],
            routers: Sequence[str], seed: int, joining: int = 0, failing: int = 0,
            host_kv_blocks: int = 0, policy_kwargs: dict[str, Any] | None = None,
            ) -> tuple[float, dict[tuple[str, float], dict[str, Any]]]:  # fmt: skip
    """(the whole fleet's capacity in req/s, the simulator's metrics per (router, rate));
    at half the arrival span ``joining`` replicas join and ``failing`` die and come back
    empty; each replica has a host KV tier of ``host_kv_blocks``; the kvroute policy
    takes ``policy_kwargs`` (a ``kvroute:LABEL`` router, ``VARIANTS[LABEL]`` too)."""
    from kvroute.benchmarks.sim.capacity import estimate_capacity
    from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
    from kvroute.cluster.config import ClusterConfig

    # as the emulated Serve replicas, which act on pulls and, under kvroute's router, warm up when they join
    cfg = SimConfig(num_replicas=replicas, kv_blocks=kv_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                    max_num_seqs=MAX_NUM_SEQS, pulls=True, warmup_prefixes=ClusterConfig.fleet_prefixes)  # fmt: skip
    capacity = estimate_capacity(workload, profile, cfg)["capacity_rps"]
    out = {}
    for rate in rates:
        at_rate = stamped(workload, rate, seed)
        mid = 0.5 * max(r.arrival_s for r in at_rate.requests)
        at = dataclasses.replace(cfg, joining_replicas=joining, join_at_s=mid, failing_replicas=failing, fail_at_s=mid,
                                 host_kv_blocks=host_kv_blocks)  # fmt: skip
        for key in sorted({sim_key(r) for r in routers}):
            policy, _, label = key.partition(":")
            kwargs = {**(policy_kwargs or {}), **VARIANTS.get(label, {})} if policy == "kvroute" else {}
            warm = at if policy == "kvroute" else dataclasses.replace(at, warmup_prefixes=0)  # the peers know no hot prefixes
            out[(key, rate)] = Simulation(at_rate, policy, profile, warm, **kwargs).run()
    return capacity, out


def _share(fraction: float, replicas: int) -> int:
    """That share of the replicas, at least one where the share is not zero."""
    return max(1, round(fraction * replicas)) if fraction else 0


def run_scenario(name: str, args: argparse.Namespace, routers: list[str], out: Path,
                 overhead: Optional[real_speed.RouterOverhead] = None) -> list[dict[str, Any]]:  # fmt: skip
    from kvroute.benchmarks import compare_routers
    from kvroute.replica.profiles import get_profile

    profile = get_profile(args.profile)
    s = SCENARIOS[name]
    workload = workload_of(name, args.scale, args.len_scale, args.seed, **trace_kwargs(name, args))
    kv_blocks = kv_blocks_of(name, workload, args.replicas, profile.kv_blocks_per_replica)
    capacity, _ = predict(workload, profile, args.replicas, kv_blocks, [], routers, args.seed)
    loads = [float(x) for x in options.csv(args.loads)]
    rates = [round(f * capacity, 3) for f in loads]
    host_blocks = round(args.host_kv_factor * kv_blocks)
    _, sim = predict(workload, profile, args.replicas, kv_blocks, rates, routers, args.seed,
                     joining=_share(s.add_fraction, args.replicas), failing=_share(s.kill_fraction, args.replicas),
                     host_kv_blocks=host_blocks, policy_kwargs=args.policy_kwargs)  # fmt: skip
    head = {"scenario": name, "capacity_rps": capacity, "kv_blocks_per_replica": kv_blocks,
            "host_kv_blocks_per_replica": host_blocks, "arrival": arrival_of(workload),
            "ideal_hit_rate": workload.params.get("ideal_hit_rate")}  # fmt: skip
    if s.kv_pressure:
        head["trace_kv_pressure"] = distinct_blocks(workload) / (kv_blocks * args.replicas)
    if args.sim_only:
        rows = [{**head, "load": load, **sim_as_measured(router, rate, sim[(sim_key(router), rate)]),
                 **sim_columns(router, sim[(sim_key(router), rate)])}
                for load, rate in zip(loads, rates) for router in routers]  # fmt: skip
        return [overhead.annotate(r) for r in rows] if overhead else rows
    engine_kwargs = {"block_size": BLOCK_SIZE, "num_kv_blocks": kv_blocks, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                     "max_model_len": profile.max_model_len, "host_kv_blocks": host_blocks}  # fmt: skip
    combined = compare_routers.compare(compare_routers.CompareConfig(
        workload=workload, load=quiet_load(timeout_s=args.timeout_s, seed=args.seed, time_scale=args.time_scale,
                                           arrival=arrival_of(workload)),
        fleet=fleet_from_args(args, add_replicas=_share(s.add_fraction, args.replicas)), request_rates=tuple(rates),
        routers=tuple(routers), engine_kwargs=engine_kwargs, emulate=args.profile,
        kill_replicas=_share(s.kill_fraction, args.replicas), event_at=0.5, out_dir=str(out / name), label=name,
        overhead=overhead,
    ))  # fmt: skip
    rows = []
    for row in combined["rows"]:
        load = loads[rates.index(row["rate"])]
        predicted = sim[(sim_key(row["router"]), row["rate"])]
        rows.append({**head, "load": load, **row, **sim_columns(row["router"], predicted)})
    return rows


def sim_columns(router: str, m: dict[str, Any]) -> dict[str, Any]:
    """The simulator's prediction ``m`` for ``router``, as the matrix's ``sim_*`` columns."""
    return {"sim_policy": sim_key(router), "sim_ttft_p90_ms": m["ttft_p90_s"] * 1000,
            "sim_ttft_p99_ms": m["ttft_p99_s"] * 1000, "sim_hit_rate": m["hit_rate"],
            "sim_out_tok_s": m["output_tokens_per_s"], "sim_available_rate": m["reuse"]["available_share"],
            "sim_captured_rate": m["reuse"]["captured_share"]}  # fmt: skip


def sim_as_measured(router: str, rate: float, m: dict[str, Any]) -> dict[str, Any]:
    """A ``--sim-only`` row's measured columns: the simulator's metrics ``m`` under
    compare_routers' keys (no TPOT: the simulator does not time tokens per request)."""
    return {
        "router": router, "rate": rate, "completed": m["completed"], "failed": m["num_requests"] - m["completed"],
        "hit_rate": m["hit_rate"], "ttft_median_ms": m["ttft_p50_s"] * 1000, "ttft_p90_ms": m["ttft_p90_s"] * 1000,
        "ttft_p99_ms": m["ttft_p99_s"] * 1000, "tpot_median_ms": math.nan, "out_tok_s": m["output_tokens_per_s"],
        "pred_cached_err": m["pred_cached_err"], "requests_per_replica": m["requests_per_replica"],
        "available_rate": m["reuse"]["available_share"], "captured_rate": m["reuse"]["captured_share"],
        "joined": m.get("joined"),  # scale-out: the joiners' first minute (hit rate, the fleet's, their share)
        "pulls": m.get("pulls"), "reasons": m.get("reasons"),  # (pulled tokens are hits: cached when the request runs)
    }  # fmt: skip


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario and load: kvroute's p90/p99 TTFT and throughput against the best peer
    (by p90), its hit rate against the best peer's (by hit: ``hit_over_best_peer``),
    and the simulator's error on kvroute's p90; where the rows carry the
    routers' real-speed added latency, the p90/p99 ratios again with it
    (``*_plus_router``, ``real_speed.versus_best_peer``)."""
    out = []
    for key in sorted({(r["scenario"], r["load"]) for r in rows}):
        at = {r["router"]: r for r in rows if (r["scenario"], r["load"]) == key}
        k = at.get("kvroute")
        peers = {n: r for n, r in at.items() if not is_ours(n) and r["completed"]}
        if k is None or not peers:
            continue
        best = min(peers, key=lambda n: peers[n]["ttft_p90_ms"] or math.inf)
        b = peers[best]
        plus = real_speed.versus_best_peer(k, peers)
        best_hit = max(peers, key=lambda n: peers[n]["hit_rate"])
        out.append({
            "scenario": key[0], "load": key[1], "best_peer": best,
            "best_hit_peer": best_hit, "hit_over_best_peer": k["hit_rate"] / max(peers[best_hit]["hit_rate"], 1e-9),
            "p90_over_best_peer": k["ttft_p90_ms"] / max(b["ttft_p90_ms"], 1e-9),
            "p99_over_best_peer": k["ttft_p99_ms"] / max(b["ttft_p99_ms"], 1e-9),
            "throughput_over_best_peer": k["out_tok_s"] / max(b["out_tok_s"], 1e-9),
            "sim_p90_error": abs(k["sim_ttft_p90_ms"] - k["ttft_p90_ms"]) / max(k["ttft_p90_ms"], 1e-9),
            "errors": sum(r["failed"] for r in at.values()),
            **({"best_peer_plus_router": plus["best"], "p90_over_best_peer_plus_router": plus["ratios"]["ttft_p90_ms"],
                "p99_over_best_peer_plus_router": plus["ratios"]["ttft_p99_ms"],
                "counted_without_added": plus["counted_without_added"]} if plus else {}),
        })  # fmt: skip
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    cols = [("scenario", "scenario", "{}"), ("load", "load", "{:.2f}"), ("router", "router", "{}"), ("ok", "completed", "{}"),
            ("err", "failed", "{}"), ("hit", "hit_rate", "{:.3f}"), ("ideal", "ideal_hit_rate", "{:.3f}"),
            ("avail", "available_rate", "{:.3f}"), ("capt", "captured_rate", "{:.3f}"), ("TTFT p50 ms", "ttft_median_ms", "{:.0f}"),
            ("p90", "ttft_p90_ms", "{:.0f}"), ("p99", "ttft_p99_ms", "{:.0f}"), ("TPOT ms", "tpot_median_ms", "{:.1f}"),
            ("out tok/s", "out_tok_s", "{:.0f}"), ("sim p90", "sim_ttft_p90_ms", "{:.0f}"), ("sim hit", "sim_hit_rate", "{:.3f}"),
            ("pred err", "pred_cached_err", "{:.3f}"), ("CPU cores", "cpu_cores", "{:.2f}")]
    return markdown_table(rows, cols + plus_router_cols(rows))


def add_args(p: argparse.ArgumentParser) -> None:
    f = options.add_fleet(p, replicas=16, cpus_per_replica=0.05, app_name="kvroute-fleet", time_scale=10.0)
    f.add_argument("--profile", default="gpu_h100_llama3_8b", help="the step profile the replicas emulate")
    f.add_argument("--host-kv-factor", type=float, default=0.0,
                   help="each replica gets a host KV tier of this many times its device blocks (0: none)")
    options.add_trace(p)
    t = p.add_argument_group("replayed trace (the mooncake scenario)")
    t.add_argument("--trace", default=None, metavar="PATH",
                   help="a Mooncake-format JSON-lines trace (default: tests/fixtures/mooncake_small.jsonl)")
    t.add_argument("--tokens-per-id", type=int, default=None, help="tokens per hash id (default 64; the trace's are 512)")
    t.add_argument("--max-output-len", type=int, default=None,
                   help="cut every answer to this length (default 128; 0: the trace's own lengths)")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help=f"a comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--loads", default="0.6,0.85,0.95,1.2", help="fractions of each scenario's estimated capacity")
    p.add_argument("--routers", default="kvroute,prefix_affinity_ray,power_of_two,sglang_router,vllm_router")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--sim-only", action="store_true",
                   help="the simulator's predictions alone, for every router and load (no Ray, no replicas; minutes)")
    options.add_output(p, "fleet_matrix", folder=True)
    real_speed.add_args(p)


def run(args: argparse.Namespace) -> int:
    scenarios, routers = options.csv(args.scenarios), options.csv(args.routers)
    unknown = [s for s in scenarios if s not in SCENARIOS]
    bad = [r for r in routers if r.partition(":")[0] not in SIM_POLICY
           or (":" in r and not (is_ours(r) and r.partition(":")[2] in VARIANTS and args.sim_only))]
    if unknown or bad:
        raise ValueError(f"unknown scenarios {unknown} (choose from {sorted(SCENARIOS)}) or routers {bad} (from {sorted(SIM_POLICY)}; "
                         f"with --sim-only also kvroute:LABEL, LABEL in {sorted(VARIANTS)})")
    t0, out = time.perf_counter(), options.result_folder("fleet_matrix", args.out_dir)
    overhead = real_speed.from_args(args, routers, out, None if args.sim_only else args.time_scale)
    if overhead is not None and "kvroute" in overhead.mapping:  # a kvroute variant pays kvroute's routing layer
        variants = {r: overhead.mapping["kvroute"] for r in routers if is_ours(r) and r not in overhead.mapping}
        overhead = dataclasses.replace(overhead, mapping={**overhead.mapping, **variants})
    rows: list[dict[str, Any]] = []
    for name in scenarios:
        rows += run_scenario(name, args, routers, out, overhead)
    tg = targets(rows)
    from kvroute.benchmarks.common import machine

    result = {"benchmark": "fleet_matrix", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args),
              "replicas": args.replicas, "profile": args.profile, "time_scale": args.time_scale, "scale": args.scale, "len_scale": args.len_scale,
              "sim_only": args.sim_only,
              "routers": routers, "scenarios": scenarios, "rows": rows, "targets": tg, "machine": machine(),
              "wall_s": time.perf_counter() - t0, "router_overhead": overhead and overhead.describe()}  # fmt: skip
    (out / "matrix.json").write_text(json.dumps(result, indent=1))
    (out / "table.md").write_text(table(rows) + "\n")
    print(table(rows))
    errors = sum(r["failed"] for r in rows)
    ours = sum(r["failed"] for r in rows if is_ours(r["router"]))
    # a peer's errors are a measured outcome (requests lost with a killed replica, or
    # refused by replicas it overloaded: 429 at max_queued_requests, 503 when no first
    # token comes in time); kvroute's mean something went wrong

    worst = max((t["p90_over_best_peer"] for t in tg), default=float("nan"))
    name = "fleet_matrix (simulated)" if args.sim_only else "fleet_matrix"
    plus, how = "", "simulated" if args.sim_only else f"emulated x{args.time_scale:g}, unscaled"
    if overhead is not None:
        worst_plus = max((t["p90_over_best_peer_plus_router"] for t in tg if "p90_over_best_peer_plus_router" in t), default=math.nan)
        plus = f", {worst_plus:.2f} with each router's real-speed added latency ({overhead.note(routers)})"
    print(f"{name}: {len(scenarios)} scenarios x {len(routers)} routers, {len(rows)} runs, {errors} errors "
          f"({ours} kvroute's); worst kvroute p90 / best peer {worst:.2f} ({how}){plus}  [{out}]")  # fmt: skip
    return 0 if ours == 0 else 1


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
