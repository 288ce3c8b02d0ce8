"""Greedy outputs of our engine equal transformers' generate, in every scheduling mode; in
bf16, every CPU mode's equal the machine's own path."""

from __future__ import annotations

import pytest

from kvroute.kernels import cpu_capability
from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from tests.conftest import cpu_env
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


BF16_TOL = 0.1  # nats: three bf16 ulps of logits of order 4-8, where these models' top logits lie
BF16_GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=5)


def _bf16_greedy(path):
    llm = LLM(str(path), block_size=16, num_kv_blocks=256, dtype="bfloat16")
    outs = llm.generate(prompts_for(path), BF16_GREEDY, use_tqdm=False)
    assert_no_leak(llm)
    return [o.logprobs for o in outs]


@pytest.fixture(scope="module")
def bf16_on_the_machine(tiny_llama_path, tiny_qwen2_path):
    """bf16 greedy outputs on this CPU's own fast paths (nothing forced, native kernels on)."""
    with cpu_env({cpu_capability.ENV: None, "KVROUTE_NATIVE": None}):
        return {path: _bf16_greedy(path) for path in (tiny_llama_path, tiny_qwen2_path)}


@pytest.mark.usefixtures("cpu_mode")
@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])  # no bias, q/k/v bias
def test_bfloat16_greedy_matches_the_machines_path_within_bf16_rounding(fixture, request, bf16_on_the_machine):
    """Forced down to AVX2 (bf16 Linears packed in fp32, C kernels for x86-64-v3) or without
    the native kernels, bf16 sums in another order than the machine's own path: each
    token's logprob agrees within BF16_TOL, and the tokens are the same until a near tie
    (the two tokens within BF16_TOL of each other in both runs) goes the other way."""
    path = request.getfixturevalue(fixture)
    for got, want in zip(_bf16_greedy(path), bf16_on_the_machine[path], strict=True):
        for g, w in zip(got, want, strict=True):
            if g.token_id != w.token_id:
                assert w.logprob - w.top.get(g.token_id, -1e9) <= BF16_TOL, (g, w)
                assert g.logprob - g.top.get(w.token_id, -1e9) <= BF16_TOL, (g, w)
                break  # the continuations differ from here
            assert abs(g.logprob - w.logprob) <= BF16_TOL, (g, w)
