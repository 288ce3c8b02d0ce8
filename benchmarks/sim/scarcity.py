"""kvroute against its peers where caches are scarce, in the simulator.

    kvroute bench scarcity [--cases b2b,lora-scarce,zipf,gsp,multi-tenant,multi-turn,failure]
        [--policies kvroute,prefix_affinity_ray] [--loads 0.85,0.95] [--kwargs '{"scarcity": false}']
        [--seed 0] [--out results/scarcity.json]

Cases (all virtual time, ``benchmarks/sim``): ``b2b`` is llm-d's B2B on 16 replicas
with the shared prefixes at 73 % of the fleet's KV (``fleet_matrix``'s scenario, scale
0.5); ``lora-scarce`` is ``lora_zipf`` on 4 replicas with 4 adapter slots each and 16
adapters; ``mooncake`` replays the synthetic Mooncake-format trace of the tests
(``tests/fixtures/mooncake_small.jsonl``, 64 tokens per id) on 4 replicas with its
timestamps compressed to the load and 400 KV blocks per replica; the others are ``fleet_matrix``'s scenarios on 16 replicas at the profile's
KV. ``--kwargs`` (JSON) goes to the ``kvroute`` policy only, so one invocation compares
a rule switched on and off (``--policies kvroute,kvroute:legacy`` runs both: the
``legacy`` label applies ``{"scarcity": false}``). Per run: token hit rate (and the
trace's infinite-cache ideal), TTFT p50/p90/p99, output tokens/s, prediction error,
adapter loads per 1k, and the reuse split (available / captured / delivered).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from kvroute.benchmarks import options
from kvroute.benchmarks import workloads as W
from kvroute.benchmarks.sim.capacity import estimate_capacity
from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
from kvroute.benchmarks.traces import load_mooncake
from kvroute.replica.profiles import get_profile

BLOCK_SIZE = 16
TRACE = Path(__file__).parents[2] / "tests" / "fixtures" / "mooncake_small.jsonl"
LABELS = {"legacy": {"scarcity": False}, "noevict": {"eviction": False}, "nobalance": {"balance_prefixes": False}}  # ``policy:label`` -> kvroute kwargs


@dataclasses.dataclass(frozen=True)
class Case:
    workload: str
    kwargs: dict[str, Any]
    replicas: int = 16
    kv_fraction: float = 0.0  # size KV so the shared prefixes fill this share of the fleet's
    max_loras: int = 0
    fail: bool = False
    kv_blocks: int = 0  # per replica (0: from kv_fraction or the profile)


CASES = {
    "b2b": Case("b2b", {"scale": 0.5}, kv_fraction=0.73),
    "b2b-over": Case("b2b", {"scale": 0.5}, kv_fraction=1.5),
    "b2b-short": Case("b2b", {"scale": 0.5, "len_scale": 0.25, "output_len": 32}, kv_fraction=0.73),
    "lora-scarce": Case("lora-zipf", {"num_adapters": 16, "num_requests": 1024}, replicas=4, max_loras=4),
    "lora": Case("lora-zipf", {"num_requests": 2048}, max_loras=8),
    "gsp": Case("generated-shared-prefix", {"scale": 0.5}),
    "zipf": Case("zipf", {"scale": 0.5}),
    "multi-tenant": Case("multi-tenant", {"scale": 0.5}),
    "multi-turn": Case("multi-turn", {"scale": 0.5}),
    "mooncake": Case("mooncake", {"tokens_per_id": 64, "max_output_len": 128}, replicas=4, kv_blocks=400),
    "failure": Case("generated-shared-prefix", {"scale": 0.5}, fail=True),
}


def case_config(case: Case, workload: W.Workload, profile: Any) -> SimConfig:
    """The fleet of ``case``: KV sized to its fraction (or the profile's), room for a
    few whole requests at least."""
    blocks = case.kv_blocks or profile.kv_blocks_per_replica
    if case.kv_fraction:
        prefix_blocks = workload.num_groups * (workload.shared_prefix_tokens // BLOCK_SIZE)
        blocks = math.ceil(prefix_blocks / (case.kv_fraction * case.replicas))
    biggest = max(-(-(r.num_prompt_tokens + r.output_len) // BLOCK_SIZE) for r in workload.requests)
    return SimConfig(num_replicas=case.replicas, kv_blocks=max(blocks, 4 * biggest), block_size=BLOCK_SIZE,
                     max_num_batched_tokens=8192, max_num_seqs=256, max_loras=case.max_loras)  # fmt: skip


def summarize(m: dict[str, Any]) -> dict[str, Any]:
    r = m["reuse"]
    return {
        "hit": round(m["hit_rate"], 4), "p50_s": m["ttft_p50_s"], "p90_s": m["ttft_p90_s"], "p99_s": m["ttft_p99_s"],
        "tok_s": round(m["output_tokens_per_s"], 1), "pred_err": round(m["pred_cached_err"], 4),
        "available": round(r["available_share"], 4), "captured": round(r["captured_share"], 4),
        "delivered": round(r["delivered_share"], 4), "loads_per_1k": round(m["adapter_loads_per_1k"], 1),
        "completed": m["completed"], "reasons": m["reasons"],
    }  # fmt: skip


def run_case(name: str, policies: Sequence[str], loads: Sequence[float], kwargs: dict[str, Any], seed: int,
             verbose: bool = True) -> list[dict[str, Any]]:  # fmt: skip
    case = CASES[name]
    profile = get_profile("gpu_h100_llama3_8b")
    if case.workload == "mooncake":  # the synthetic trace of the tests, its bursts compressed to the load
        base = load_mooncake(TRACE, **case.kwargs)
    else:
        base = W.make_workload(case.workload, seed=seed, **case.kwargs)
    cfg = case_config(case, base, profile)
    cap = estimate_capacity(base, profile, cfg)
    rows = []
    for load in loads:
        if case.workload == "mooncake":
            span = max(r.arrival_s for r in base.requests)
            wl = load_mooncake(TRACE, compression=load * cap["capacity_rps"] * span / len(base), **case.kwargs)
        else:
            wl = W.with_poisson_arrivals(base, load * cap["capacity_rps"], seed=seed)
        at = cfg
        if case.fail:
            mid = 0.5 * max(r.arrival_s for r in wl.requests)
            at = dataclasses.replace(cfg, failing_replicas=max(1, cfg.num_replicas // 8), fail_at_s=mid)
        for spec in policies:
            pol, _, label = spec.partition(":")
            kw = {**kwargs, **LABELS.get(label, {})} if pol == "kvroute" else {}
            t0 = time.perf_counter()
            s = summarize(Simulation(wl, pol, profile, at, **kw).run())
            row = {"case": name, "load": load, "policy": spec, "ideal_hit": round(cap["ideal_hit_rate"], 4), **s,
                   "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
            rows.append(row)
            if verbose:
                print(line(row), file=sys.stderr, flush=True)
    return rows


def line(r: dict[str, Any]) -> str:
    return (f"{r['case']:12s} {r['load']:.2f} {r['policy']:22s} hit {r['hit']:.3f} (ideal {r['ideal_hit']:.3f}; "
            f"avail {r['available']:.3f} capt {r['captured']:.3f} deliv {r['delivered']:.3f}) "
            f"p50 {1e3 * r['p50_s']:.0f} p90 {1e3 * r['p90_s']:.0f} p99 {1e3 * r['p99_s']:.0f} ms "
            f"{r['tok_s']:.0f} tok/s err {r['pred_err']:.3f} loads/1k {r['loads_per_1k']:.1f} ({r['wall_s']}s)")  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", default="b2b,lora-scarce")
    p.add_argument("--policies", default="kvroute,prefix_affinity_ray")
    p.add_argument("--loads", default="0.85,0.95")
    p.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the kvroute policy")
    options.add_seed(p)
    options.add_output(p, "scarcity")


def run(args: argparse.Namespace) -> int:
    rows = []
    for name in options.csv(args.cases):
        rows += run_case(name, options.csv(args.policies), [float(x) for x in options.csv(args.loads)], json.loads(args.kwargs),
                         args.seed)  # fmt: skip
    options.result_file("scarcity", args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
