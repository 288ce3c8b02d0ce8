"""The whole engine on the Triton kernels (interpreted on CPU) against the torch
references: identical greedy tokens for tiny Llama and Qwen3 models (fp32), through
chunked page-aligned prefill, prefix-cache hits (a prompt whose whole prefix is cached)
and padded decode batches (the CUDA-graph input path, run eagerly here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvroute.kernels import ops
from kvroute.replica.cuda_graphs import default_graph_sizes
from kvroute.replica.llm import LLM
from tests.replica.helpers import assert_no_leak, engine_greedy, prompts_for

NEW = 3
KW = dict(block_size=16, num_kv_blocks=64, dtype="float32", max_num_batched_tokens=32, device="cpu")


def _prompts(path):
    prompts = prompts_for(path)
    # 6, 21 and 24 tokens; the last extends the second, so it hits the prefix cache.
    return [prompts[0], prompts[1], prompts[1] + [11, 12, 13]]


@pytest.mark.usefixtures("triton_available")
def test_triton_engine_greedy_equals_reference(tiny_qwen3_path):
    """Qwen3: q/k norms, tied embeddings, GQA 2 (Llama's path is the subset without
    q/k norms, run by the padded-decode test below)."""
    path = tiny_qwen3_path
    prompts = _prompts(path)
    with ops.use_backend("torch"):
        want = engine_greedy(LLM(str(path), **KW), prompts, NEW)
    with ops.use_backend("triton"):
        llm = LLM(str(path), **KW)
        assert engine_greedy(llm, prompts, NEW) == want
        # Second pass: every prompt's prefix is cached, down to the last token.
        assert engine_greedy(llm, prompts, NEW) == want
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_no_leak(llm)


@pytest.mark.usefixtures("triton_available")
def test_padded_decode_batches_equal_unpadded(tiny_llama_path):
    """DecodeGraphs' static, padded buffers (graph sizes 1, 2, 4 for 3 sequences that
    finish at different times, so batches shrink and stale rows would show) give the
    same tokens as plain eager steps."""
    prompts = prompts_for(tiny_llama_path)[:3]
    kw = KW | dict(max_num_batched_tokens=128)  # all three prefill in one step, then decode together
    lens = (2, 4, 3)
    with ops.use_backend("torch"):
        llm = LLM(str(tiny_llama_path), **kw)
        want = [tuple(o.token_ids) for o in llm.generate(prompts, [_greedy(n) for n in lens], use_tqdm=False)]
    with ops.use_backend("triton"):
        llm = LLM(str(tiny_llama_path), **kw)
        runner = llm.engine.runner
        runner.use_decode_graphs([1, 2, 4], capture=False)
        calls = []
        load = runner.graphs.load
        runner.graphs.load = lambda *a: calls.append(len(a[0])) or load(*a)
        got = [tuple(o.token_ids) for o in llm.generate(prompts, [_greedy(n) for n in lens], use_tqdm=False)]
    assert got == want
    assert calls == [3, 2, 1], calls  # 3 padded to 4, then shrinking batches over stale rows


def _greedy(n):
    from tests.replica.helpers import greedy

    return greedy(n)


def test_default_graph_sizes():
    assert default_graph_sizes(1) == [1]
    assert default_graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_graph_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_backend_switch():
    cpu = torch.device("cpu")
    assert ops.backend() in ("auto", "torch", "triton")
    with ops.use_backend("auto"):
        assert not ops.uses_triton(cpu)  # the CPU engine never needs Triton
    with ops.use_backend("torch"):
        assert not ops.uses_triton(torch.device("cuda"))
    with pytest.raises(ValueError, match="backend"):
        with ops.use_backend("cuda"):
            pass


@pytest.mark.usefixtures("triton_available")
def test_lora_decode_graph_buffers_equal_merged_models(tiny_llama_path, tmp_path):
    """LoRA through the decode graphs' static buffers (run eagerly here, as a captured
    graph replays them): a batch of base rows and two adapters' rows interleaved, their
    slots read from the buffers' grouped layout, equals each adapter merged into the
    weights; a step without adapter rows takes the base graph; batches shrink over stale
    layouts as requests finish."""
    from tests.replica.test_lora import GREEDY, Fixture, _mixed

    fx = Fixture(tiny_llama_path, tmp_path)
    prompts, loras, want = _mixed(fx)
    with ops.use_backend("triton"):
        llm = fx.engine(max_num_seqs=16)
        runner = llm.engine.runner
        runner.use_decode_graphs([1, 2, 4, 8, 16], capture=False)
        graphs = runner.graphs
        assert graphs.has_lora
        replays = []
        replay = graphs.replay
        graphs.replay = lambda b, n, lora=False: replays.append((b, n, lora)) or replay(b, n, lora)
        lens = [GREEDY.max_tokens - 3 * (i % 4) for i in range(len(prompts))]  # finish at different steps
        params = [dataclasses.replace(GREEDY, max_tokens=n) for n in lens]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_name=loras)
        assert [o.token_ids for o in outs] == [w[:n] for w, n in zip(want, lens)]
        assert replays and all(lora for _, _, lora in replays) and replays[0][:2] == (16, 12)
        assert {b for b, _, _ in replays} >= {16, 8}
        replays.clear()
        base = [p for p, name in zip(prompts, loras) if name is None]
        outs = llm.generate(base, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [w for w, name in zip(want, loras) if name is None]
        assert replays and not any(lora for _, _, lora in replays)
    assert_no_leak(llm)
