"""The GPU benchmarks' CPU-checkable parts: they refuse clearly without CUDA, and their
random checkpoint + synthetic steps go through the real loader and model runner."""

from __future__ import annotations

import pytest
import torch

from kvroute.benchmarks import gpu_engine, gpu_shapes, kernels
from kvroute.benchmarks.cli import main as bench

TINY = dict(
    model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    tie_word_embeddings=True, rope_theta=1000000.0, rope_scaling=None,
)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("name", ["kernels", "gpu_engine"])
def test_benchmarks_refuse_without_cuda(name):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench([name, "--quick"])


def test_random_checkpoint_loads_and_runs_synthetic_steps(tmp_path):
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams

    folder = gpu_shapes.random_checkpoint(TINY, tmp_path / "ckpt", torch.float32, "cpu")
    llm = LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=64, block_size=16)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0), use_tqdm=False)
    assert len(out[0].token_ids) == 3
    runner = llm.engine.runner
    # prefill of 2 x 20 tokens over 12 cached ones, then a decode step of both
    assert runner.execute(gpu_shapes._rows(2, 12, 20, 16)).shape == (2, 512)
    assert runner.execute(gpu_shapes._rows(2, 32, 1, 16)).shape == (2, 512)


def test_roofline_and_flop_accounting():
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch("llama", 100, 64, 2, 4, 2, 16, 128, 1e-6, 1024, 1e4)
    # 2 seqs x 10 tokens x 2 layers x (K + V) x 2 heads x 16 dims x 2 bytes
    assert gpu_shapes.decode_bytes(1000, arch, 2, 10, 2) == 1000 + 2 * 10 * 2 * 2 * 2 * 16 * 2
    # 3 new tokens after 2 cached: query-key pairs 3 + 4 + 5 = 12
    assert gpu_shapes.prefill_flops(50, arch, 2, 3) == 2 * 50 * 3 + 4 * 2 * 4 * 16 * 12 + 2 * 64 * 100


def test_kernel_benchmark_metadata_is_consistent():
    meta, nblocks = kernels._meta([5, 0, 20], [1, 7, 3], 4, "cpu")
    assert meta.block_tables.max() < nblocks
    slots = meta.slot_mapping.tolist()
    assert len(set(slots)) == len(slots) == 11
    # each token's slot lies in its sequence's block table at its position
    for s, (c, q) in enumerate(zip([5, 0, 20], [1, 7, 3])):
        for i in range(q):
            p = c + i
            row = meta.query_start_loc_cpu[s] + i
            assert slots[row] == int(meta.block_tables[s, p // 4]) * 4 + p % 4


def test_restore_benchmark_runs_the_real_copy_path(tmp_path):
    """``gpu_engine --restore``'s measurement, on the CPU at a tiny size: the restored
    blocks hold the prefix's KV and every figure is measured."""
    folder = gpu_shapes.random_checkpoint(TINY, tmp_path / "ckpt", torch.float32, "cpu")
    r = gpu_engine.bench_restore(folder, torch.device("cpu"), torch.float32, prefix_tokens=128, iters=2)
    assert r["restored_kv_exact"] and r["blocks"] == 8
    assert r["bytes"] == 8 * 16 * 2 * 2 * 2 * 16 * 4  # blocks x tokens x layers x (K, V) x kv heads x head_dim x fp32
    for key in ("prefill_ms", "restore_ms", "restore_ms_gpu_timed", "restore_and_suffix_ms", "prefill_with_offload_ms"):
        assert r[key] > 0, key
    assert r["restore_over_prefill"] == pytest.approx(r["restore_ms"] / r["prefill_ms"])
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu_engine.bench_restore(folder, torch.device("cpu"), torch.float32, prefix_tokens=100)
