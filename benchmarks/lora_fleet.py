"""Many LoRA adapters on one fleet, in the simulator: kvroute against the peers' rules.

    kvroute bench lora_fleet [--replicas 16] [--adapters 64] [--zipf 1.1]
        [--max-loras 8] [--load 0.85] [--requests 4096] [--hardware gpu] [--seed 0]
        [--policies kvroute,power_of_two,prefix_affinity_ray,cache_aware_vllm]
        [--out results/lora_fleet.json]
    kvroute bench lora_fleet --emulate PROFILE --time-scale K ...   (measured: benchmarks/lora_emulated.py)

Workload (``lora_zipf``): ``--adapters`` adapters with Zipf(``--zipf``) popularity,
each with its own system prompt (``--system-prompt-len`` tokens) that every request of
it starts with, then a question of its own; every request names its adapter (its
blocks hash under it, ARCHITECTURE.md §3.1). Each replica has ``--max-loras`` adapter
slots (LRU); a cold adapter's slot load takes the profile's bytes ÷ host → device
bandwidth (``StepProfile.adapter_load_time``: 1.7 ms for rank 16 on the H100 profile),
and a step holds at most ``max_loras`` adapters (a request of another one waits). The
arrival rate is ``--load`` × the fleet's capacity as ``sim.capacity.estimate_capacity``
prices it for a cache-ideal router (it does not count adapter loads).

Every number here is SIMULATED (``benchmarks/sim``: the real scheduler, KV cache and
router, steps timed by the profile; no HTTP, no Serve). The peers are the simulator's
re-implementations (router/POLICIES.md): Ray's power of two and PrefixCacheAffinityRouter
with Ray Serve's multiplexed-model preference for a LoRA request
(``policies.common.multiplex_candidates``), and vllm-router's cache_aware, whose tree
keys each adapter's prompts apart. Per policy: adapter loads per 1,000 requests, prefix
hit rate, TTFT p90, output tokens/s. Prints one summary line; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvroute.benchmarks import lora_emulated, options, real_speed
from kvroute.benchmarks import workloads as W
from kvroute.benchmarks.lora_report import compare, summary_line
from kvroute.benchmarks.workloads import lora_zipf
from kvroute.benchmarks.sim.capacity import estimate_capacity
from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
from kvroute.replica.profiles import get_profile

HARDWARE = {"gpu": "gpu_h100_llama3_8b", "cpu": "cpu_measured"}
PEERS = ("power_of_two", "prefix_affinity_ray", "cache_aware_vllm")


def summarize(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("completed", "adapter_loads", "adapter_loads_per_1k", "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
            "output_tokens_per_s", "makespan_s", "preemptions", "leaked_blocks")  # fmt: skip
    return {k: m[k] for k in keys}


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    cost = get_profile(HARDWARE.get(args.hardware, args.hardware))
    workload = lora_zipf(args.adapters, args.requests, args.system_prompt_len, args.question_len, args.output_len,
                         args.zipf, seed=args.seed)  # fmt: skip
    config = SimConfig(num_replicas=args.replicas, kv_blocks=args.kv_blocks or cost.kv_blocks_per_replica,
                       max_loras=args.max_loras, lora_rank=args.lora_rank)  # fmt: skip
    capacity = estimate_capacity(workload, cost, config)
    rate = args.load * capacity["capacity_rps"]
    timed = W.with_poisson_arrivals(workload, rate, args.seed)
    results = {}
    for policy in args.policies:
        t0 = time.perf_counter()
        results[policy] = {**summarize(Simulation(timed, policy, cost, config).run()), "wall_s": time.perf_counter() - t0}
    return {
        "benchmark": "lora_fleet", "simulated": True, "profile": cost.name, "adapter_load_s": cost.adapter_load_time(args.lora_rank),
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "rate_rps": rate, "capacity": capacity,
        "results": results, "comparison": compare(results),
    }  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--load", type=float, default=0.85, help="fraction of the fleet's estimated capacity")
    p.add_argument("--requests", type=int, default=4096)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kv-blocks", type=int, default=0, help="per replica (default: the profile's)")
    p.add_argument("--hardware", default="gpu", help="gpu, cpu or a step profile's name")
    p.add_argument("--policies", type=options.csv, default=["kvroute", *PEERS])
    options.add_seed(p)
    options.add_output(p, "lora_fleet")
    e = p.add_argument_group("measured on emulated replicas (benchmarks/lora_emulated.py)")
    e.add_argument("--emulate", default=None, metavar="PROFILE", help="run the routers on replicas emulating this profile")
    e.add_argument("--time-scale", type=float, default=1.0, help="the emulated steps take K times the profile's time")
    e.add_argument("--routers", type=options.csv, default=None,
                   help="compare_routers' router names (default: kvroute, power_of_two, prefix_affinity_ray, vllm_router)")
    e.add_argument("--model", default="smollm2-135m-instruct", help="the replicas' model folder (config and tokenizer)")
    e.add_argument("--num-cpus-per-replica", type=float, default=0.05)
    e.add_argument("--app-name", default="kvroute-lora")
    e.add_argument("--http-port", type=int, default=8000)
    e.add_argument("--timeout-s", type=float, default=1800.0)
    e.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else start one)")
    options.add_policy_kwargs(e)
    real_speed.add_args(p)


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1 or args.adapters < 1 or args.max_loras < 1 or args.requests < 1 or not args.load > 0:
        raise ValueError("--replicas, --adapters, --max-loras and --requests must be >= 1 and --load > 0")
    path = options.result_file("lora_fleet", args.out)
    if not args.emulate and (args.overhead_from or args.overhead_measure):
        raise ValueError("--overhead-from / --overhead-measure: with --emulate (the measured fleet)")
    out = lora_emulated.measure(args, path.with_suffix("")) if args.emulate else simulate(args)
    path.write_text(json.dumps(out, indent=2))
    print(summary_line(out))
    # a peer's errors are a measured outcome (replicas it overloaded); kvroute's mean something went wrong
    return 0 if not out["results"].get("kvroute", {}).get("errors") else 1


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
