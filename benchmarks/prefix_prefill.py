"""vLLM PR #3402's scenario scaled to CPU: 48 prompts of 1,025 tokens (distinct rotations
of one sequence), one output token each, run twice. The second pass finds every full
block cached; report its time against the first and the largest batch it formed.

    kvroute bench prefix_prefill
"""

from __future__ import annotations

import argparse
import random
import time

from kvroute.benchmarks.common import write_result
from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from kvroute.benchmarks import options


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=1025)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    options.add_seed(ap)
    options.add_output(ap, "prefix_prefill")


def run(args: argparse.Namespace) -> int:

    bs = args.block_size
    blocks_per_prompt = -(-(args.prompt_len + 1) // bs)
    llm = LLM(
        args.model,
        dtype="float32",
        block_size=bs,
        num_kv_blocks=args.num_prompts * blocks_per_prompt + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = random.Random(args.seed)
    base = [rng.randrange(100, llm.engine.arch.vocab_size) for _ in range(args.prompt_len)]
    prompts = [base[i:] + base[:i] for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    passes = []
    for _ in range(2):
        llm.engine.scheduler.max_batch_size = 0
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        passes.append(
            {
                "seconds": time.perf_counter() - t,
                "cached_tokens": sum(o.num_cached_tokens for o in outs),
                "max_batch_size": llm.engine.scheduler.max_batch_size,
            }
        )
    first, cached = passes
    speedup = first["seconds"] / cached["seconds"]
    result = {
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "first_pass": first,
        "cached_pass": cached,
        "speedup": speedup,
        "all_in_one_batch": cached["max_batch_size"] == args.num_prompts,
    }
    write_result(
        "prefix_prefill",
        result,
        f"first {first['seconds']:.2f}s, cached {cached['seconds']:.3f}s, speedup {speedup:.1f}x, "
        f"cached-pass max batch {cached['max_batch_size']}/{args.num_prompts}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
