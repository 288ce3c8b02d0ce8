"""Routers at many ingresses, simulated: the curve past what 2 cores emulate.

    kvroute bench router_scale [--ingresses 1,2,4,8,16,32,64] [--replicas 16]
        [--scenarios b2b,zipf,multi-tenant] [--loads 0.85,0.95] [--peer-delay 0.002]
        [--router-decision-s 0.0005] [--profile gpu_h100_llama3_8b] [--scale 1.0] [--len-scale 1.0]
        [--output-len 0] [--out-dir results/router_scale]

Clients are spread evenly over I ingresses. Every router takes ``--router-decision-s``
per decision, in order, so one router saturates past 1 / that many requests/s. Each
cell runs, on the same trace and fleet (``fleet_matrix``'s scenarios, profiles and KV
sizing):

- ``kvroute/1``: one router for every ingress;
- ``kvroute/N=I``: I routers, each fed every replica's KV events and load, their
  decisions reaching the others ``--peer-delay`` later; every ingress asks them in one
  order, passing over a router with ``SPILL_AT`` of its decisions waiting
  (``cluster/router_choice.py``: what kvroute's ingresses do);
- ``kvroute/N=I-own``: the same routers, each ingress asking its own (kvroute's first
  design, kept to show what the lag costs);
- ``kvroute/indep``: I routers that never hear each other's decisions (exact cache,
  but each sees only its own in-flight load);
- ``sglang_router``, ``vllm_router``: I independent instances of their cache-aware
  policies (``router/policies``), each with its own tree of the prompts it routed, the
  way their users scale them;
- ``prefix_affinity_ray``: Ray's PrefixCacheAffinityRouter, whose tree actor all
  ingress replicas share (one router).

Per cell: hit rate, TTFT p50/p90/p99, throughput, the predicted-vs-delivered cached
tokens error, the spills and the busiest router's share of the decisions; and the issue's targets: kvroute/N=I at I against kvroute at I = 1 (hit
≥ 0.98 ×, p90 ≤ 1.1 ×), and against the best peer at the same I (p90 ≤ 0.5 × where the
peers' per-instance trees lose hits). Outputs ``router_scale.json`` and ``table.md``
in ``--out-dir``; one summary line. Simulated, not measured: say so when quoting.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Optional

from kvroute.benchmarks import options
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.common import write_result
from kvroute.benchmarks.fleet_matrix import (
    BLOCK_SIZE, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, SCENARIOS, is_trace, kv_blocks_of, stamped,
)
from kvroute.benchmarks.router_report import markdown_table

# variant -> (simulator policy, routers at I ingresses (None: I), peer delay (None: --peer-delay; -1: never),
#             router choice: "first" (one order for every ingress, spilling: kvroute) or "own" (each ingress its router))
VARIANTS: dict[str, tuple[str, Optional[int], Optional[float], str]] = {
    "kvroute/1": ("kvroute", 1, 0.0, "first"),
    "kvroute/N=I": ("kvroute", None, None, "first"),
    "kvroute/N=I-own": ("kvroute", None, None, "own"),
    "kvroute/indep": ("kvroute", None, -1.0, "own"),
    "sglang_router": ("cache_aware_sglang", None, -1.0, "own"),
    "vllm_router": ("cache_aware_vllm", None, -1.0, "own"),
    "prefix_affinity_ray": ("prefix_affinity_ray", 1, 0.0, "first"),
}
PEERS = ("sglang_router", "vllm_router", "prefix_affinity_ray")
METRICS = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "output_tokens_per_s", "pred_cached_err")
ROW_COLS = [("scenario", "scenario", "{}"), ("load", "load", "{:.2f}"), ("I", "ingresses", "{}"), ("router", "variant", "{}"),
            ("N", "routers", "{}"), ("hit", "hit_rate", "{:.3f}"), ("p50 s", "ttft_p50_s", "{:.3f}"),
            ("p90 s", "ttft_p90_s", "{:.3f}"), ("p99 s", "ttft_p99_s", "{:.3f}"), ("tok/s", "output_tokens_per_s", "{:.0f}"),
            ("pred err", "pred_cached_err", "{:.3f}"), ("spills", "spills", "{}"),
            ("busiest router", "busiest_router", "{:.2f}"), ("errors", "errors", "{}")]  # fmt: skip
TARGET_COLS = [("scenario", "scenario", "{}"), ("load", "load", "{:.2f}"), ("I", "ingresses", "{}"),
               ("hit / I=1", "hit_vs_I1", "{:.3f}"), ("p90 / I=1", "p90_vs_I1", "{:.2f}"), ("best peer", "best_peer", "{}"),
               ("p90 / best peer", "p90_vs_best_peer", "{:.2f}"), ("hit / best peer", "hit_vs_best_peer", "{:.2f}")]  # fmt: skip


def run_cell(workload: wl.Workload, profile: Any, cfg: Any, variant: str, ingresses: int, peer_delay: float) -> dict[str, Any]:
    from kvroute.benchmarks.sim.simulator import Simulation

    policy, routers, delay, choice = VARIANTS[variant]
    at = dataclasses.replace(cfg, num_routers=routers or ingresses, peer_delay_s=peer_delay if delay is None else delay,
                             num_ingresses=ingresses, router_choice=choice)  # fmt: skip
    t0 = time.perf_counter()
    m = Simulation(workload, policy, profile, at).run()
    row = {k: m[k] for k in METRICS}
    row.update(variant=variant, ingresses=ingresses, routers=at.num_routers, wall_s=round(time.perf_counter() - t0, 2),
               errors=m["num_requests"] - m["completed"], spills=m["router_spills"],
               busiest_router=max(m["decisions_per_router"]) / max(sum(m["decisions_per_router"]), 1))  # fmt: skip
    return row


def run_scenario(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvroute.benchmarks.sim.capacity import estimate_capacity
    from kvroute.benchmarks.sim.simulator import SimConfig
    from kvroute.replica.profiles import get_profile

    profile = get_profile(args.profile)
    cut = {("max_output_len" if is_trace(name) else "output_len"): args.output_len} if args.output_len else {}
    kwargs = {**SCENARIOS[name].workload_kwargs, **cut}  # (a trace's answers are cut, not set)
    workload = wl.make_workload(SCENARIOS[name].dataset, seed=args.seed, scale=args.scale, len_scale=args.len_scale, **kwargs)
    cfg = SimConfig(num_replicas=args.replicas, kv_blocks=kv_blocks_of(name, workload, args.replicas, profile.kv_blocks_per_replica),
                    block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                    router_decision_s=args.router_decision_s)  # fmt: skip
    capacity = estimate_capacity(workload, profile, cfg)["capacity_rps"]
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        at_rate = stamped(workload, load * capacity, args.seed)  # (a trace keeps its own arrival times)
        for ingresses in (int(x) for x in args.ingresses.split(",")):
            for variant in args.variants.split(","):
                row = run_cell(at_rate, profile, cfg, variant, ingresses, args.peer_delay)
                row.update(scenario=name, load=load, rate=round(load * capacity, 3))
                rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scenario, load, I): kvroute/N=I against kvroute at I = 1 and the best peer."""
    by = {(r["scenario"], r["load"], r["ingresses"], r["variant"]): r for r in rows}
    out = []
    for (scen, load, i, variant), r in sorted(by.items()):
        base = by.get((scen, load, 1, "kvroute/N=I"))
        if variant != "kvroute/N=I" or base is None:
            continue
        peers = [by[(scen, load, i, p)] for p in PEERS if (scen, load, i, p) in by]
        best = min(peers, key=lambda p: p["ttft_p90_s"]) if peers else None
        out.append({
            "scenario": scen, "load": load, "ingresses": i,
            "hit_vs_I1": r["hit_rate"] / max(base["hit_rate"], 1e-12),
            "p90_vs_I1": r["ttft_p90_s"] / max(base["ttft_p90_s"], 1e-12),
            "best_peer": best and best["variant"],
            "p90_vs_best_peer": best and r["ttft_p90_s"] / max(best["ttft_p90_s"], 1e-12),
            "hit_vs_best_peer": best and r["hit_rate"] / max(best["hit_rate"], 1e-12),
        })  # fmt: skip
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ingresses", default="1,2,4,8,16,32,64")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--scenarios", default="b2b,zipf,multi-tenant")
    p.add_argument("--loads", default="0.85,0.95")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--peer-delay", type=float, default=0.002, help="seconds until a decision reaches the other routers")
    p.add_argument("--router-decision-s", type=float, default=0.0005,
                   help="a router's time per decision, every router's (kvroute's: ~75 us of its code + ~450 us of Ray's call)")
    p.add_argument("--profile", default="gpu_h100_llama3_8b")
    options.add_trace(p)
    p.add_argument("--output-len", type=int, default=0, help="every answer's length (0: the scenario's own)")
    options.add_output(p, "router_scale", folder=True)


def run(args: argparse.Namespace) -> int:
    for v in options.csv(args.variants):
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; one of {sorted(VARIANTS)}")
    rows = [row for name in options.csv(args.scenarios) for row in run_scenario(name, args)]
    checks = targets(rows)
    out = options.result_folder("router_scale", args.out_dir)
    (out / "table.md").write_text(markdown_table(rows, ROW_COLS) + "\n\n" + markdown_table(checks, TARGET_COLS) + "\n")
    widest = max((c for c in checks if c["ingresses"] == max(int(x) for x in args.ingresses.split(","))), default=None,
                 key=lambda c: c["p90_vs_I1"])  # fmt: skip
    summary = "router_scale (simulated): " + (
        f"{len(rows)} cells; at I={widest['ingresses']} kvroute/N=I worst p90 {widest['p90_vs_I1']:.2f}x and hit "
        f"{widest['hit_vs_I1']:.3f}x of I=1 ({widest['scenario']} @ {widest['load']})" if widest else f"{len(rows)} cells"
    )
    write_result("router_scale", {"args": vars(args), "rows": rows, "targets": checks}, summary, str(out / "router_scale.json"))
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
