"""GPU tests (CUDA only; skipped elsewhere by tests/conftest.py): the interpreter cases at
real sizes, the engine's greedy tokens on Triton vs the torch references, and CUDA-graph
decode vs eager.

Tolerances as on CPU: fp32 1e-4 (IEEE dots in the kernel, but long softmax sums), bf16
2e-2; copies and RoPE are exact; RMSNorm within one bf16 ulp.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvroute.kernels import ops
from kvroute.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kvroute.kernels.kv_store import store_kv_reference, store_kv_triton
from kvroute.kernels.paged_attention import paged_attention_triton
from kvroute.kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_triton
from kvroute.kernels.rotary import rotary_reference_, rotary_triton_
from kvroute.replica.llm import LLM
from kvroute.replica.models.rope import RotaryEmbedding
from tests.kernels.batches import assert_attention_matches, build_batch
from tests.replica.helpers import assert_no_leak, engine_greedy, greedy

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# (num_heads, num_kv_heads, head_dim): Llama-3.2-1B, Qwen3-0.6B, MHA, GQA 3
SHAPES = [(32, 8, 64), (16, 8, 128), (8, 8, 64), (12, 4, 128)]
REAL = (
    [0, 1000, 1500, 2047, 0, 4000, 31, 16],  # cached context per sequence
    [512, 1, 500, 1, 1, 1, 97, 16],  # new tokens: prefill, decode, chunk over a prefix, whole prefix cached, ...
)


def _attention_case(ctx_lens, q_lens, shape, block_size, dtype, num_splits=1):
    h, kvh, d = shape
    kc, vc, meta, full_k, full_v, new_k, new_v = build_batch(ctx_lens, q_lens, block_size, kvh, d, dtype, device="cuda")
    store_kv_triton(new_k, new_v, kc, vc, meta.slot_mapping)
    q = torch.randn(sum(q_lens), h, d, device="cuda").to(dtype)
    scale = 1 / math.sqrt(d)
    out = paged_attention_triton(q, kc, vc, meta, scale, num_splits=num_splits)
    torch.cuda.synchronize()
    assert_attention_matches(out, q, kc, vc, meta, full_k, full_v, ctx_lens, q_lens, scale, TOL[dtype])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_real_sizes(shape, block_size, dtype):
    _attention_case(*REAL, shape, block_size, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 8, 16])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_split_k_decode_long_context(num_splits, shape):
    _attention_case([4095, 8000, 100, 0], [1, 1, 1, 1], shape, 16, torch.bfloat16, num_splits)


def test_kv_store_real_sizes_exact():
    kc, vc, meta, _, _, new_k, new_v = build_batch(REAL[0], REAL[1], 16, 8, 128, torch.bfloat16, device="cuda")
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_reference(new_k, new_v, want_k, want_v, meta.slot_mapping)
    store_kv_triton(new_k, new_v, kc, vc, meta.slot_mapping)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_and_rotary_real_sizes(dtype):
    x = torch.randn(3000, 2048, device="cuda").to(dtype)
    res = torch.randn(3000, 2048, device="cuda").to(dtype)
    w = torch.rand(2048, device="cuda").to(dtype)
    out, new_res = rms_norm_triton(x, w, 1e-5, res)
    want, want_res = fused_add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(new_res, want_res)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    rope = RotaryEmbedding(128, 40960, 1e6, None).cuda()
    cos, sin = rope.tables(torch.randint(0, 40960, (3000,), device="cuda"), dtype)
    q, k = torch.randn(3000, 16, 128, device="cuda").to(dtype), torch.randn(3000, 8, 128, device="cuda").to(dtype)
    q2, k2 = q.clone(), k.clone()
    rotary_reference_(q, k, cos, sin)
    rotary_triton_(q2, k2, cos, sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_real_sizes(dtype):
    """The fused kernel against torch's silu-then-mul (Llama-3.2-1B's 8192-wide MLP):
    bf16 within one ulp (the two exps may differ in their last float32 bit)."""
    x = (torch.randn(300, 2 * 8192, device="cuda") * 4).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x), atol=tol, rtol=tol)


NEW = 24
# Tiny random checkpoints built here with a word-level tokenizer (the device machines have
# no gguf, so the SmolLM2-tokenizer fixtures of tests/conftest.py cannot be built there).
# initializer_range 0.2 keeps greedy outputs varied (see tests/conftest.py).
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=1e6, rope_scaling=None,
            initializer_range=0.2)  # fmt: skip
KINDS = {"llama": dict(tie_word_embeddings=False), "qwen2": dict(tie_word_embeddings=True),
         "qwen3": dict(tie_word_embeddings=True)}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from kvroute.benchmarks.gpu_shapes import random_checkpoint

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return {
            kind: random_checkpoint(dict(TINY, model_type=kind, **extra), tmp_path_factory.mktemp(kind), torch.float32, "cpu")
            for kind, extra in KINDS.items()
        }


def _batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 1024, (n,), generator=g).tolist() for n in (5, 17, 33, 64, 100)]
    return [prompts[i % len(prompts)] + [11 + i] * (i % 5) for i in range(12)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_triton_equals_reference_greedy(kind, tiny_paths):
    path = tiny_paths[kind]
    batch = _batch()
    kw = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=512, max_num_batched_tokens=64, enforce_eager=True)
    with ops.use_backend("torch"):
        want = engine_greedy(LLM(str(path), **kw), batch, NEW)
    llm = LLM(str(path), **kw)
    assert engine_greedy(llm, batch, NEW) == want
    assert engine_greedy(llm, batch, NEW) == want  # second pass: prefix-cache hits
    assert_no_leak(llm)


def test_cuda_graph_decode_equals_eager(tiny_paths):
    """Requests of different lengths finish at different steps, so graph batches shrink
    and pad over rows whose block tables belonged to finished requests; a second wave
    reuses freed blocks. fp32: a padded batch may make cuBLAS pick another algorithm
    than the unpadded eager one, which bf16 rounding could turn into a different token."""
    dtype = "float32"
    tiny_llama_path = tiny_paths["llama"]
    batch = _batch()
    params = [greedy(4 + 3 * i) for i in range(len(batch))]
    kw = dict(device="cuda", dtype=dtype, block_size=16, num_kv_blocks=512, max_num_seqs=16)
    eager = LLM(str(tiny_llama_path), enforce_eager=True, **kw)
    graphs = LLM(str(tiny_llama_path), **kw)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    for _ in range(2):
        want = [o.token_ids for o in eager.generate(batch, params, use_tqdm=False)]
        got = [o.token_ids for o in graphs.generate(batch, params, use_tqdm=False)]
        assert got == want
    assert_no_leak(graphs)


def test_decode_graph_logits_equal_eager_bf16(tiny_paths):
    """bf16: a graph-replayed decode step's logits, written into the graphs' shared
    buffer, equal the eager step's."""
    from kvroute.benchmarks.gpu_shapes import _rows

    llm = LLM(str(tiny_paths["qwen2"]), device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=512, max_num_seqs=16)
    runner = llm.engine.runner
    assert runner.graphs is not None
    for b in (1, 5, 16):
        step = _rows(b, 40, 1, 16)
        graph = runner.execute(step).float().clone()
        graphs, runner.graphs = runner.graphs, None
        eager = runner.execute(step).float()
        runner.graphs = graphs
        assert graph.shape == eager.shape == (b, 1024)
        assert float((graph - eager).norm() / eager.norm()) < 2e-2, b


def test_structured_output_on_cuda_equals_reference(tiny_llama_path):
    """The token bitmask applied by its Triton kernel on the device (grammar rows of a
    JSON schema, a regex and a choice beside an unconstrained row, greedy and seeded):
    the same tokens as the torch reference mask, and every constrained output valid."""
    import json
    import re

    import jsonschema

    from kvroute.replica.sampling_params import SamplingParams
    from kvroute.replica.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"]}  # fmt: skip
    regex = r"[A-Z][a-z]{2,5}-\d{3}"
    params = [
        SamplingParams(max_tokens=120, temperature=0.0, structured_output=StructuredOutput("json", schema)),
        SamplingParams(max_tokens=120, temperature=1.0, seed=5, structured_output=StructuredOutput("json", schema)),
        SamplingParams(max_tokens=30, temperature=0.0, structured_output=StructuredOutput("regex", regex)),
        SamplingParams(max_tokens=10, temperature=0.7, seed=3, structured_output=StructuredOutput("choice", ["red", "dark blue"])),
        SamplingParams(max_tokens=20, temperature=0.0),
    ]
    prompts = ["Describe a person as JSON.", "Another person, as JSON:", "Give a code:", "Pick a color:", "Say anything:"]
    kw = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256)
    with ops.use_backend("torch"):
        want = [o.text for o in LLM(str(tiny_llama_path), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama_path), **kw)
    got = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    for text in got[:2]:
        jsonschema.validate(json.loads(text), schema)
    assert re.fullmatch(regex, got[2]) and got[3] in ("red", "dark blue")
    assert_no_leak(llm)


def test_lora_decode_graphs_equal_eager(tiny_llama_path, tmp_path):
    """LoRA decode steps replayed from captured CUDA graphs (base rows and two adapters
    interleaved, batches shrinking as requests finish) give the eager LoRA engine's
    tokens; steps without adapter rows replay the base graphs."""
    import dataclasses

    from tests.replica.test_lora import GREEDY, Fixture, _mixed

    fx = Fixture(tiny_llama_path, tmp_path)
    prompts, loras, _ = _mixed(fx)
    params = [dataclasses.replace(GREEDY, max_tokens=GREEDY.max_tokens - 3 * (i % 4)) for i in range(len(prompts))]
    eager = fx.engine(device="cuda", max_num_seqs=16, enforce_eager=True)
    llm = fx.engine(device="cuda", max_num_seqs=16)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.has_lora and (16, True) in graphs.graphs
    replays = []
    replay = graphs.replay
    graphs.replay = lambda b, n, lora=False: replays.append(lora) or replay(b, n, lora)
    for _ in range(2):
        want = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False, lora_name=loras)]
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_name=loras)] == want
    assert replays and all(replays)
    replays.clear()
    base = [p for p, name in zip(prompts, loras) if name is None]
    want = [o.token_ids for o in eager.generate(base, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(base, GREEDY, use_tqdm=False)] == want
    assert replays and not any(replays)
    assert_no_leak(llm)
