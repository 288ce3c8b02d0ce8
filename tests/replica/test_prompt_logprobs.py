"""Prompt logprobs: every prompt token's logprob under the model (as transformers computes
it), in every chunking, never read from the prefix cache, and recorded once across a
preemption."""

from __future__ import annotations

import math

import pytest
import torch

from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from tests.replica.helpers import assert_no_leak, prompts_for


def _reference(path, prompt: list[int], k: int) -> list[tuple[float, dict[int, float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out = []
    for i in range(1, len(prompt)):
        v, ix = lp[i - 1].topk(k)
        out.append((lp[i - 1, prompt[i]].item(), dict(zip(ix.tolist(), v.tolist()))))
    return out


def _check(got, want, prompt):
    assert got[0] is None and len(got) == len(prompt)
    for pos, (g, (w, top)) in enumerate(zip(got[1:], want), start=1):
        assert g.token_id == prompt[pos]
        assert math.isclose(g.logprob, w, abs_tol=2e-4), (pos, g.logprob, w)
        assert set(g.top) == set(top) and all(math.isclose(g.top[t], top[t], abs_tol=2e-4) for t in top)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_match_transformers(tiny_llama_path, chunk):
    prompt = prompts_for(tiny_llama_path)[3]
    kwargs = dict(block_size=4, num_kv_blocks=256, dtype="float32")
    if chunk:
        kwargs |= dict(max_num_batched_tokens=chunk)
    llm = LLM(str(tiny_llama_path), **kwargs)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    want = _reference(tiny_llama_path, prompt, 3)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    _check(first.prompt_logprobs, want, prompt)
    # Again: the prompt's blocks are cached now, but a prompt-logprobs request computes
    # them (a cached block has no logits), and an ordinary one still hits them.
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    _check(again.prompt_logprobs, want, prompt)
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert plain.token_ids == first.token_ids
    assert_no_leak(llm)


def test_prompt_logprobs_survive_preemption(tiny_llama_path):
    """A cache too small for the batch preempts and recomputes; each request's prompt
    logprobs still have one entry per prompt token and the reference's values."""
    prompts = prompts_for(tiny_llama_path)
    llm = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=40, dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(out.prompt_logprobs, [(w, {}) for w, _ in _reference(tiny_llama_path, prompt, 1)], prompt)
    assert_no_leak(llm)


def test_prompt_logprobs_validated():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
