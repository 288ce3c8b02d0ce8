"""Shared helpers for engine tests: Hugging Face greedy references and engine runs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams

TEXTS = [
    "The quick brown fox",
    "In a distant galaxy, far beyond the reach of ordinary telescopes, astronomers discovered a strange signal that",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy. Madrid is the capital of Spain. Lisbon is the capital of",
    "1, 2, 3, 5, 8, 13,",
]


def prompts_for(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return [tok.encode(t) for t in TEXTS]


@lru_cache(maxsize=None)
def hf_greedy(path: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int) -> tuple[tuple[int, ...], ...]:
    """transformers' own greedy continuation of each prompt (fp32, EOS suppressed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([list(p)])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(tuple(gen[0, len(p) :].tolist()))
    return tuple(outs)


def greedy(new_tokens: int) -> SamplingParams:
    # min_tokens mirrors transformers' min_new_tokens: EOS is masked, not just ignored.
    return SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)


def engine_greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[tuple[int, ...]]:
    outs = llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
    return [tuple(o.token_ids) for o in outs]


def assert_no_leak(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert set(stats.block_ref_counts) <= {0}, "a block is still referenced"
    assert stats.num_free_blocks == stats.num_kv_blocks
