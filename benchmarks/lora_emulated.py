"""The LoRA fleet measured on emulated replicas (``lora_fleet --emulate PROFILE``): the
routers in front of real replicas that emulate the profile's steps and adapter slot loads.

    kvroute bench lora_fleet --emulate gpu_h100_llama3_8b --time-scale 10
        [--replicas 16] [--adapters 64] [--max-loras 8] [--load 0.85]
        [--routers kvroute,power_of_two,prefix_affinity_ray,vllm_router] [--model PATH]

The same ``lora-zipf`` trace as the simulated run (``workloads.lora_zipf``), at ``--load``
× the fleet's capacity as the simulator prices it, is served by
``benchmarks/compare_routers.py``'s fleets, each router from cold caches and empty
adapter slots, each replica accepting as many requests at once as its engine batches
(Serve's ``max_ongoing_requests`` = ``max_num_seqs``, the batch the capacity estimate
assumes; a lower cap would overload the fleet at any load and pass requests on by queue
length): kvroute, Ray's power of two and PrefixCacheAffinityRouter on one Serve
application of ``--replicas`` emulated engines, and the real vllm-router (``cache_aware``)
in front of ``--replicas`` ``kvroute serve-replica --emulate ... --enable-lora``
processes. Every replica knows every adapter (``lora_modules``): PEFT folders this
module writes, ``adapter_config.json`` only (rank ``--lora-rank`` on every linear: the
emulated engine reads nothing else and prices a slot load at the profile's bytes per rank,
ARCHITECTURE.md §6). A request names its adapter as ``model``. Unlike the simulator's
re-implementations, Ray's routers here get no multiplexed model id (the Serve app does
not tag a LoRA request with one), so they route a LoRA request as any other: without
Ray Serve LLM's preference for the replicas that have its adapter loaded.

Per router: adapter slot loads per 1,000 completed requests (the replicas' own
``kvroute:lora_slot_loads``, from the Serve app's or each serve-replica's ``/metrics``),
prefix hit rate, TTFT p50/p90, output tokens/s and errors, in unscaled seconds (with
``--overhead-from DATA_PATH_JSON`` or ``--overhead-measure``, also TTFT plus each router's
real-speed added latency, ``benchmarks/real_speed.py``). The compare_routers outputs (JSON
per run, table, plots) go beside the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvroute.benchmarks.fleets import external_available, fleet_from_args
from kvroute.benchmarks.lora_report import compare
from kvroute.benchmarks.real_speed import SUFFIX
from kvroute.benchmarks.serving_config import quiet_load
from kvroute.benchmarks.sim.capacity import estimate_capacity
from kvroute.benchmarks.sim.simulator import SimConfig
from kvroute.benchmarks.workloads import lora_zipf
from kvroute.replica.lora.peft import CONFIG_FILE, MODULES
from kvroute.replica.profiles import get_profile

BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192
SERVE_PEERS = ("kvroute", "power_of_two", "prefix_affinity_ray")


def default_routers() -> list[str]:
    return [*SERVE_PEERS, *(["vllm_router"] if external_available("vllm_router") else [])]


def write_adapters(folder: Path, num_adapters: int, rank: int) -> dict[str, str]:
    """``lora-0`` … ``lora-<n-1>``: PEFT folders with ``adapter_config.json`` alone
    (rank ``rank`` on every linear); ``{name: folder}``."""
    out = {}
    for g in range(num_adapters):
        d = folder / f"lora-{g}"
        d.mkdir(parents=True, exist_ok=True)
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none",
                  "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}  # fmt: skip
        (d / CONFIG_FILE).write_text(json.dumps(config), encoding="utf-8")
        out[f"lora-{g}"] = str(d.resolve())
    return out


def router_result(row: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """One router's figures: its table row and its run's per-replica counters (and, where
    the row carries it, the router's real-speed added latency and the TTFTs plus it)."""
    loads = sum(c.get("adapter_loads", 0.0) for c in run.get("per_replica", {}).values())
    plus = {}
    if "ttft_p90_ms" + SUFFIX in row:
        plus = {k: row[k] for k in ("router_added_system", "router_added_p50_ms", "router_added_p99_ms")}
        for key, ms in (("ttft_p50_s", "ttft_median_ms"), ("ttft_p90_s", "ttft_p90_ms")):
            plus[key + SUFFIX] = None if row[ms + SUFFIX] is None else row[ms + SUFFIX] / 1000
    return {**plus,
        "completed": row["completed"], "errors": row["failed"], "adapter_loads": loads,
        "adapter_loads_per_1k": 1000 * loads / max(row["completed"], 1), "hit_rate": row["hit_rate"],
        "ttft_p50_s": row["ttft_median_ms"] / 1000, "ttft_p90_s": row["ttft_p90_ms"] / 1000,
        "output_tokens_per_s": row["out_tok_s"], "fleet": run.get("fleet"),
    }  # fmt: skip


def measure(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """``lora_fleet --emulate``: every router on the emulated fleet; compare_routers'
    outputs go to ``out_dir`` (beside the JSON), with the adapters' folders."""
    from kvroute.benchmarks import compare_routers, real_speed

    profile = get_profile(args.emulate)
    routers = tuple(args.routers or default_routers())
    overhead = real_speed.from_args(args, routers, out_dir, args.time_scale)
    workload = lora_zipf(args.adapters, args.requests, args.system_prompt_len, args.question_len, args.output_len,
                         args.zipf, seed=args.seed)  # fmt: skip
    biggest = max(-(-(r.num_prompt_tokens + r.output_len) // BLOCK_SIZE) for r in workload.requests)
    kv_blocks = max(args.kv_blocks or profile.kv_blocks_per_replica, 4 * biggest)
    config = SimConfig(num_replicas=args.replicas, kv_blocks=kv_blocks, block_size=BLOCK_SIZE,
                       max_num_batched_tokens=MAX_BATCHED_TOKENS, max_loras=args.max_loras, lora_rank=args.lora_rank)  # fmt: skip
    capacity = estimate_capacity(workload, profile, config)
    rate = round(args.load * capacity["capacity_rps"], 4)
    modules = write_adapters(out_dir / "adapters", args.adapters, args.lora_rank)
    engine_kwargs = {"block_size": BLOCK_SIZE, "num_kv_blocks": kv_blocks, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                     "max_model_len": profile.max_model_len, "enable_lora": True, "max_loras": args.max_loras,
                     "max_lora_rank": args.lora_rank, "lora_modules": modules}  # fmt: skip
    combined = compare_routers.compare(compare_routers.CompareConfig(
        workload=workload, load=quiet_load(timeout_s=args.timeout_s, seed=args.seed, time_scale=args.time_scale),
        fleet=fleet_from_args(args, model=args.model, max_ongoing_requests=config.max_num_seqs), request_rates=(rate,),
        routers=routers, engine_kwargs=engine_kwargs, emulate=args.emulate, out_dir=str(out_dir), label="lora-zipf",
        overhead=overhead,
    ))  # fmt: skip
    results = {row["router"]: router_result(row, json.loads((out_dir / f"{row['run']}.json").read_text()))
               for row in combined["rows"]}  # fmt: skip
    return {
        "benchmark": "lora_fleet", "simulated": False, "profile": profile.name, "time_scale": args.time_scale,
        "adapter_load_s": profile.adapter_load_time(args.lora_rank), "kv_blocks_per_replica": kv_blocks,
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "rate_rps": rate, "capacity": capacity,
        "results": results, "comparison": compare(results), "compare_routers_dir": str(out_dir),
        "router_overhead": overhead and overhead.describe(),
    }  # fmt: skip
