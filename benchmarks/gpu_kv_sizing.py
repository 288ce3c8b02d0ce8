"""The KV cache an engine sizes by default on the card (CUDA only), per model shape
(random bf16 checkpoints, ``gpu_shapes.SHAPES``), with the engine's defaults
(``gpu_memory_utilization`` 0.9, ``max_num_batched_tokens`` 2048, ``max_num_seqs`` 256,
the model's context length, CUDA graphs):

- the start-up line (blocks, tokens, GiB, and the held / peak-activation figures);
- the KV's share of the memory left after everything else the engine holds (weights,
  CUDA context, graphs, allocator cache), measured from the free memory before and
  after the engine starts;
- then a full batch: ``max_num_seqs`` prompts whose prefill fills every step's
  ``max_num_batched_tokens``, each decoding a few sampled tokens, checked to finish with
  no out-of-memory; the memory the process then holds against the budget (the CUDA
  graphs, captured after the KV cache, are outside it by design) and the allocator's
  peak are reported.

    python3 -m kvroute.benchmarks.gpu_kv_sizing --checkpoints DIR [--shapes llama-3.2-1b,llama-3-8b] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from kvroute.benchmarks.gpu_shapes import shape_checkpoint

GIB = 2**30


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def size_one(folder: Path, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams

    lines = _Lines()
    logger = logging.getLogger("kvroute.replica.kv_sizing")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    gc.collect()
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    llm = LLM(str(folder), device="cuda", dtype="bfloat16")
    start_s = time.perf_counter() - t0
    logger.removeHandler(lines)
    free1, _ = torch.cuda.mem_get_info()
    runner, cfg = llm.engine.runner, llm.engine.config
    kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
    other = free0 - free1 - kv  # weights, context, graphs, the allocator's cache
    out = dict(total_gib=total / GIB, free_at_start_gib=free0 / GIB, kv_gib=kv / GIB, other_gib=other / GIB,
               kv_blocks=runner.kv_cache.shape[2], kv_tokens=runner.kv_cache.shape[2] * runner.block_size,
               kv_share_of_left=kv / (free0 - other), kv_share_of_budget=kv / (cfg.gpu_memory_utilization * total - other),
               start_line=next((s for s in lines.lines if s.startswith("KV cache")), ""), start_s=start_s,
               max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
               max_model_len=llm.engine.max_model_len)  # fmt: skip
    print(out["start_line"], flush=True)
    print(f"  KV {kv / GIB:.1f} GiB = {out['kv_share_of_left']:.1%} of the {(free0 - other) / GIB:.1f} GiB left after the "
          f"engine's other {other / GIB:.1f} GiB ({out['kv_share_of_budget']:.1%} of the 0.9 budget's); start {start_s:.1f} s",
          flush=True)  # fmt: skip
    # A full batch: max_num_seqs prompts of prompt_len tokens, prefilled max_num_batched_tokens a step.
    torch.cuda.reset_peak_memory_stats()
    prompts = [[5 + (i * 7 + j) % 1000 for j in range(prompt_len)] for i in range(cfg.max_num_seqs)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=new_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    free2, _ = torch.cuda.mem_get_info()
    used = free0 - free2
    out.update(full_batch_s=time.perf_counter() - t0, full_batch_tokens=sum(len(o.token_ids) for o in outs),
               peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB, used_after_batch_gib=used / GIB,
               over_budget_gib=(used - cfg.gpu_memory_utilization * total) / GIB,
               max_batch_size=llm.engine.stats().max_batch_size)  # fmt: skip
    print(f"  full batch: {len(prompts)} x {prompt_len}-token prompts, {out['full_batch_tokens']} tokens out in "
          f"{out['full_batch_s']:.1f} s, no OOM; process uses {used / GIB:.1f} GiB of {total / GIB:.1f} "
          f"(budget {cfg.gpu_memory_utilization * total / GIB:.1f}, the CUDA graphs outside it); widest step "
          f"{out['max_batch_size']} rows", flush=True)  # fmt: skip
    del llm, runner, outs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", required=True, help="folder keeping the random checkpoints across runs")
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {}
    for name in args.shapes.split(","):
        print(f"== {name}", flush=True)
        result[name] = size_one(shape_checkpoint(name, Path(args.checkpoints)), args.prompt_len, args.new_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
