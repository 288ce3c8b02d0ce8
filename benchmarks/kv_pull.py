"""Pulling a long prefix's KV from another replica against recomputing it: a source
engine in a Ray actor holds a prefix; the destination engine (this process) either
prefills it cold or pulls its KV through Ray's object store (``cluster/kv_pull.py``) and
then computes only the last block. Reports the pull's seconds and bytes, the first-token
time after it, the cold first-token time, their ratio, and that the greedy output after a
pull equals the cold run's.

    kvroute bench kv_pull                      # 2,000 tokens of SmolLM2-135M in fp32
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import ray

from kvroute.benchmarks import options
from kvroute.benchmarks.common import write_result
from kvroute.cluster.kv_pull import export_payload, pull_prefix
from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.config import EngineConfig
from kvroute.replica.sampling_params import SamplingParams


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared after a pull and a cold run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    options.add_seed(ap)
    options.add_output(ap, "kv_pull")


class _Source:
    """The replica that holds the prefix (what ``EngineReplica.export_kv`` runs)."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = AsyncEngine.from_config(config)

    async def generate(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        return [t async for d in self.engine.generate(token_ids, params) for t in d.token_ids]

    async def export_kv(self, token_ids: list[int]):
        return await export_payload(self.engine, token_ids)


async def _first_token(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    """(seconds to the first token, the output, cached prompt tokens)."""
    start, first, tokens, cached = time.perf_counter(), None, [], 0
    async for delta in engine.generate(prompt, params):
        if first is None and delta.token_ids:
            first = time.perf_counter() - start
        tokens += delta.token_ids
        cached = delta.num_cached_tokens
    return first or 0.0, tokens, cached


def run(args: argparse.Namespace) -> int:
    bs = args.block_size
    blocks = -(-(args.prefix_len + args.new_tokens) // bs) + 8
    config = EngineConfig(model=args.model, dtype=args.dtype, block_size=bs, num_kv_blocks=blocks)
    rng = random.Random(args.seed)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        source = ray.remote(_Source).options(num_cpus=0).remote(config)
        dest = AsyncEngine.from_config(config)
        prompt = [rng.randrange(100, dest.engine.arch.vocab_size) for _ in range(args.prefix_len)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        reference = ray.get(source.generate.remote(prompt, greedy))  # the source computes and caches it
        result = asyncio.run(_measure(dest, source, prompt, greedy, reference, args))
    finally:
        ray.shutdown()
    pull, cold = result["pull"], result["cold"]
    write_result(
        "kv_pull",
        result,
        f"{args.prefix_len}-token prefix, {pull['nbytes'] / 1e6:.0f} MB: pull {pull['seconds']:.3f}s "
        f"({pull['nbytes'] / pull['seconds'] / 1e9:.2f} GB/s) + first token {pull['ttft_s']:.3f}s = "
        f"{pull['total_s']:.3f}s vs recompute {cold['ttft_s']:.3f}s: {result['ratio']:.3f}x; "
        f"greedy equal: {result['greedy_equal']}",
        args.out,
    )
    return 0 if result["greedy_equal"] else 1


async def _measure(dest: AsyncEngine, source, prompt, greedy, reference, args) -> dict:
    """Median over ``repeats`` of: a cold prefill's first-token time; a pull then the
    first-token time with the prefix cached. The cache is reset before each."""
    colds, pulls, outputs = [], [], []
    for _ in range(args.repeats):
        assert await dest.reset_prefix_cache()
        ttft, tokens, cached = await _first_token(dest, prompt, greedy)
        colds.append(ttft)
        outputs.append(("cold", tokens, cached))
        assert await dest.reset_prefix_cache()
        pulled = await pull_prefix(dest, lambda: source.export_kv.remote(prompt), args.timeout_s)
        if not pulled.ok:
            raise RuntimeError(f"the pull fell back: {pulled}")
        ttft, tokens, cached = await _first_token(dest, prompt, greedy)
        pulls.append((pulled.seconds, ttft, pulled.nbytes, pulled.tokens, cached))
        outputs.append(("pull", tokens, cached))
    med = statistics.median
    pull_s, ttft_s = med(p[0] for p in pulls), med(p[1] for p in pulls)
    cold_s = med(colds)
    return {
        "prefix_len": args.prefix_len,
        "block_size": args.block_size,
        "model": args.model,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "cold": {"ttft_s": cold_s, "runs": colds},
        "pull": {
            "seconds": pull_s, "ttft_s": ttft_s, "total_s": pull_s + ttft_s, "nbytes": pulls[0][2],
            "tokens": pulls[0][3], "cached_tokens": pulls[0][4], "runs": [list(p) for p in pulls],
        },  # fmt: skip
        "ratio": (pull_s + ttft_s) / cold_s,
        "greedy_equal": all(tokens == reference for _, tokens, _ in outputs),
        "transfer_metrics": dest.engine.kv_transfer.metrics.report(),
    }


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
