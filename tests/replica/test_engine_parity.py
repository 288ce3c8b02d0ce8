"""Greedy outputs of our engine equal transformers' generate, in every scheduling mode."""

from __future__ import annotations

import pytest

from kvroute.replica.llm import LLM
from tests.replica.helpers import assert_no_leak, engine_greedy, hf_greedy, prompts_for

NEW = 32


def _reference(path, prompts):
    return list(hf_greedy(str(path), tuple(map(tuple, prompts)), NEW))


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path", "tiny_qwen3_path"])
def test_tiny_models_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    prompts = prompts_for(path)
    llm = LLM(str(path), block_size=16, num_kv_blocks=256, dtype="float32")
    assert engine_greedy(llm, prompts, NEW) == _reference(path, prompts)
    assert_no_leak(llm)


def test_smollm2_matches_transformers(smollm2_path):
    prompts = prompts_for(smollm2_path)[:3]
    llm = LLM("smollm2-135m-instruct", num_kv_blocks=128, dtype="float32")
    assert llm.model_path == smollm2_path
    assert engine_greedy(llm, prompts, NEW) == _reference(smollm2_path, prompts)
    assert_no_leak(llm)


MODES = {
    "default": dict(),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "no_chunked_prefill": dict(enable_chunked_prefill=False),
    "small_chunks_page_aligned": dict(max_num_batched_tokens=24),
    "small_chunks_unaligned": dict(max_num_batched_tokens=24, page_aligned=False),
    "block_size_4": dict(block_size=4, num_kv_blocks=1024),
    "one_seq_at_a_time": dict(max_num_seqs=1),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_scheduling_modes_give_identical_greedy_outputs(mode, tiny_llama_path):
    prompts = prompts_for(tiny_llama_path)
    # 32 requests at once, sharing prefixes with each other, so caching matters.
    batch = [prompts[i % len(prompts)] + [11 + i // len(prompts)] * (i % 3) for i in range(32)]
    kwargs = dict(block_size=8, num_kv_blocks=512, dtype="float32") | MODES[mode]
    llm = LLM(str(tiny_llama_path), **kwargs)
    want = list(hf_greedy(str(tiny_llama_path), tuple(map(tuple, batch)), NEW))
    assert engine_greedy(llm, batch, NEW) == want
    # A second pass hits the prefix cache (when on) and must not change anything.
    assert engine_greedy(llm, batch, NEW) == want
    stats = llm.engine.stats()
    if kwargs.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
    assert_no_leak(llm)


def test_preemption_under_a_tiny_kv_cache_keeps_outputs(tiny_llama_path):
    prompts = prompts_for(tiny_llama_path)
    batch = [p + [7 + i] for i, p in enumerate(prompts * 3)]
    longest = max(len(p) for p in batch) + NEW
    llm = LLM(str(tiny_llama_path), block_size=8, num_kv_blocks=-(-longest // 8) + 4, dtype="float32")
    want = list(hf_greedy(str(tiny_llama_path), tuple(map(tuple, batch)), NEW))
    assert engine_greedy(llm, batch, NEW) == want
    assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)
