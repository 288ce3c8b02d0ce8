"""Compare routing policies on simulated replicas.

    kvroute bench sim [--workloads generated-shared-prefix,b2b:len_scale=0.25,zipf]
        [--replicas 8] [--policies all] [--fractions 0.5,0.7,0.85,0.95 | --rates 10,20]
        [--scale 1.0] [--len-scale 1.0] [--hardware gpu|cpu|PROFILE] [--seed 0] [--out-dir results/sim]

For each workload: estimate the fleet's capacity from the cost model (see
``sim.capacity.estimate_capacity``), then run every policy at each rate (fractions of
capacity unless ``--rates`` gives requests/s). Writes ``sim.json`` and, when matplotlib
is installed, ``<workload>_ttft_p90.png`` and ``<workload>_hit_rate.png``; prints one
summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from kvroute.benchmarks import options
from kvroute.benchmarks import workloads as W
from kvroute.benchmarks.sim.capacity import estimate_capacity
from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
from kvroute.replica.profiles import PROFILES, StepProfile, cpu_measured, gpu_h100_llama3_8b

# --hardware: "gpu" / "cpu" or any step profile by name (replica/profiles.PROFILES)
COST_MODELS = {"gpu": gpu_h100_llama3_8b, "cpu": cpu_measured, **PROFILES}

ALL_POLICIES = [
    "kvroute", "round_robin", "power_of_two", "cache_aware_sglang", "cache_aware_vllm", "prefix_affinity_ray",
    "weighted_scorers_gie", "consistent_hash", "oracle",
]  # fmt: skip
B2B_KV_FRACTION = 0.73  # llm-d: the shared prefixes fill ~73% of the fleet's KV cache


def kv_blocks_for(workload: W.Workload, cost: StepProfile, args: argparse.Namespace) -> int:
    """Per-replica KV capacity in blocks: explicit, or sized so the workload's shared
    prefixes fill ``kv_fraction`` of the fleet, or the hardware's capacity x len_scale."""
    bs = args.block_size
    biggest = max(-(-(r.num_prompt_tokens + r.output_len) // bs) for r in workload.requests)
    if args.kv_blocks:
        blocks = args.kv_blocks
    else:
        frac = args.kv_fraction if args.kv_fraction else (B2B_KV_FRACTION if workload.name == "b2b" else None)
        if frac:
            prefix_blocks = workload.num_groups * (workload.shared_prefix_tokens // bs)
            blocks = math.ceil(prefix_blocks / (frac * args.replicas))
        else:
            blocks = int(cost.kv_blocks_per_replica * args.len_scale)
    return max(blocks, 4 * biggest)  # room for a few whole requests at least


def parse_workloads(spec: str, args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """``name[:scale=X:len_scale=Y]`` comma list: per-workload overrides of the scale flags."""
    out = []
    for item in (w.strip() for w in spec.split(",")):
        if not item:
            continue
        name, *opts = item.split(":")
        a = argparse.Namespace(**vars(args))
        for o in opts:
            key, _, val = o.partition("=")
            key = key.replace("-", "_")
            if key not in ("scale", "len_scale", "kv_blocks", "kv_fraction", "host_kv_factor"):
                raise ValueError(f"unknown per-workload option {key!r} in {item!r}")
            setattr(a, key, type(getattr(args, key))(val))
        out.append((name, a))
    return out


def run_workload(name: str, args: argparse.Namespace, cost: StepProfile, policies: list[str]) -> dict[str, Any]:
    base = W.make_workload(name, seed=args.seed, scale=args.scale, len_scale=args.len_scale)
    cfg = SimConfig(
        num_replicas=args.replicas,
        kv_blocks=kv_blocks_for(base, cost, args),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        event_delay_s=args.event_delay,
        num_routers=args.num_routers,
        peer_delay_s=args.peer_delay,
    )
    cfg = dataclasses.replace(cfg, host_kv_blocks=round(args.host_kv_factor * cfg.kv_blocks))
    cap = estimate_capacity(base, cost, cfg)
    if args.rates:
        rates = [float(x) for x in args.rates.split(",")]
    else:
        rates = W.rate_sweep(cap["capacity_rps"], [float(x) for x in args.fractions.split(",")])
    runs = []
    for rate in rates:
        wl = W.with_poisson_arrivals(base, rate, seed=args.seed)
        for pol in policies:
            t0 = time.perf_counter()
            m = Simulation(wl, pol, cost, cfg).run()
            m.update(rate=rate, fraction=rate / cap["capacity_rps"], wall_s=round(time.perf_counter() - t0, 2))
            runs.append(m)
            if args.verbose:
                print(
                    f"  {name} rate={rate:.2f} {pol:22s} hit={m['hit_rate']:.3f} p90={m['ttft_p90_s']:.3f}s "
                    f"p99={m['ttft_p99_s']:.3f}s host={m['host_hit_rate']:.3f} tput={m['output_tokens_per_s']:.0f} err={m['pred_cached_err']:.3f} "
                    f"done={m['completed']}/{m['num_requests']} ({m['wall_s']}s)",
                    file=sys.stderr,
                )
    return {
        "workload": name,
        "params": base.params,
        "num_requests": len(base),
        "prompt_tokens": base.prompt_tokens,
        "config": cfg.__dict__,
        "capacity": cap,
        "rates": rates,
        "runs": runs,
    }


def targets(res: dict[str, Any]) -> dict[str, Any]:
    """Issue 4's targets, measured."""
    by = {(r["policy"], r["rate"]): r for r in res["runs"]}
    pols = {r["policy"] for r in res["runs"]}
    out: dict[str, Any] = {}
    if "kvroute" not in pols:
        return out
    baselines = sorted(pols - {"kvroute", "oracle"})
    rows = []
    for rate in res["rates"]:
        k = by[("kvroute", rate)]
        row: dict[str, Any] = {"rate": rate, "kv_hit": k["hit_rate"], "kv_p90": k["ttft_p90_s"]}
        if "oracle" in pols:
            row["hit_vs_oracle"] = k["hit_rate"] / max(by[("oracle", rate)]["hit_rate"], 1e-12)
        if baselines:
            best = min(baselines, key=lambda p: by[(p, rate)]["ttft_p90_s"])
            row["best_baseline"] = best
            row["p90_vs_best"] = k["ttft_p90_s"] / max(by[(best, rate)]["ttft_p90_s"], 1e-12)
        if "cache_aware_sglang" in pols:
            s = by[("cache_aware_sglang", rate)]
            row["tput_vs_sglang"] = k["output_tokens_per_s"] / max(s["output_tokens_per_s"], 1e-12)
            row["p99_vs_sglang"] = k["ttft_p99_s"] / max(s["ttft_p99_s"], 1e-12)
        row["pred_err"] = k["pred_cached_err"]
        rows.append(row)
    out["per_rate"] = rows
    if res["workload"] in ("generated-shared-prefix", "b2b"):
        out["hit_ge_0.95_oracle"] = all(r.get("hit_vs_oracle", 0) >= 0.95 for r in rows)
        out["p90_le_0.8_best"] = all(r.get("p90_vs_best", 9) <= 0.8 for r in rows)
    if res["workload"] == "zipf":
        out["tput_ge_1.3_sglang"] = all(r.get("tput_vs_sglang", 0) >= 1.3 for r in rows)
        out["p99_no_worse_sglang"] = all(r.get("p99_vs_sglang", 9) <= 1.0 for r in rows)
    out["pred_err_le_0.02"] = all(r["pred_err"] <= 0.02 for r in rows)
    return out


def plot(res: dict[str, Any], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; skipping plots", file=sys.stderr)
        return []
    name = res["workload"]
    pols = list(dict.fromkeys(r["policy"] for r in res["runs"]))
    files = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in pols:
        rs = sorted((r for r in res["runs"] if r["policy"] == p), key=lambda r: r["rate"])
        ax.plot([r["rate"] for r in rs], [r["ttft_p90_s"] for r in rs], marker="o", label=p)
    ax.set(xlabel="request rate (req/s)", ylabel="TTFT p90 (s)", title=f"{name}: TTFT p90 vs rate", yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{name}_ttft_p90.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(str(path))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = res["rates"]
    width = 0.8 / max(len(rates), 1)
    for i, rate in enumerate(rates):
        hits = [next(r["hit_rate"] for r in res["runs"] if r["policy"] == p and r["rate"] == rate) for p in pols]
        ax.bar([j + i * width for j in range(len(pols))], hits, width, label=f"{rate:.1f} req/s")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(pols))], pols, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="prefix-cache hit rate (tokens)", title=f"{name}: hit rate per policy", ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{name}_hit_rate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(str(path))
    return files


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="generated-shared-prefix,b2b,zipf", help=f"comma list of {sorted(W.WORKLOADS)}, each optionally with :scale=X:len_scale=Y")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--policies", default="all", help="comma list, or 'all'")
    p.add_argument("--fractions", default="0.5,0.7,0.85,0.95", help="rates as fractions of the estimated capacity")
    p.add_argument("--rates", default=None, help="explicit request rates (req/s), comma list; overrides --fractions")
    options.add_trace(p)
    p.add_argument("--hardware", choices=sorted(COST_MODELS), default="gpu", help="cost model: gpu (this engine measured on an H100, Llama-3-8B shape), cpu (measured), or a step profile's name")
    p.add_argument("--kv-blocks", type=int, default=0, help="per-replica KV blocks (default: from hardware / workload)")
    p.add_argument("--kv-fraction", type=float, default=0.0, help="size KV so shared prefixes fill this fraction of the fleet (b2b: 0.73)")
    p.add_argument("--host-kv-factor", type=float, default=0.0,
                   help="a host tier of this many times each replica's device KV blocks (0: none)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--event-delay", type=float, default=0.0, help="seconds between a step's end and its KV events reaching the router")
    p.add_argument("--num-routers", type=int, default=1, help="routers taking the arrivals in turn, each fed every replica's events")
    p.add_argument("--peer-delay", type=float, default=0.0,
                   help="seconds before a router's decision reaches the others (< 0: never: independent routers)")
    options.add_output(p, "sim", folder=True)
    p.add_argument("-v", "--verbose", action="store_true", help="a line per run on stderr")


def run(args: argparse.Namespace) -> int:
    if args.policies == "all":
        try:
            from kvroute.router.policies import policy_names

            policies = [p for p in ALL_POLICIES if p in set(policy_names()) | {"kvroute"}]
        except ImportError:
            policies = list(ALL_POLICIES)
    else:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    cost = COST_MODELS[args.hardware]()
    out_dir = options.result_folder("sim", args.out_dir)
    t0 = time.perf_counter()
    results, plots, summary = [], [], []
    for name, wargs in parse_workloads(args.workloads, args):
        res = run_workload(name, wargs, cost, policies)
        res.update(scale=wargs.scale, len_scale=wargs.len_scale)
        res["targets"] = targets(res)
        results.append(res)
        plots += plot(res, out_dir)
        t = res["targets"]
        flags = ",".join(f"{k}={'Y' if v else 'N'}" for k, v in t.items() if isinstance(v, bool))
        summary.append(f"{name}[cap={res['capacity']['capacity_rps']:.1f}rps {flags}]")
    payload = {
        "benchmark": "sim",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "args": vars(args),
        "cost_model": cost.as_dict(),
        "replicas": args.replicas,
        "policies": policies,
        "scale": args.scale,
        "len_scale": args.len_scale,
        "seed": args.seed,
        "wall_s": round(time.perf_counter() - t0, 1),
        "workloads": results,
        "plots": plots,
    }
    path = out_dir / "sim.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"sim: {args.replicas} replicas, {len(policies)} policies, {args.hardware}: {' '.join(summary)} "
          f"in {payload['wall_s']}s  [{path}]")
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
