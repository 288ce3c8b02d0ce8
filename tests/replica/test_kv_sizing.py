"""The KV cache's size (replica/kv_sizing.py): the arithmetic, the config's checks, and
real engines sized on CPU end to end (the embedded SmolLM2 at the default, tiny random
models for exact figures); the CUDA path on a GPU."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvroute.replica import kv_sizing
from kvroute.replica.config import EngineConfig
from kvroute.replica.kv_sizing import GIB, KVSize, blocks_for_bytes, cpu_kv_bytes, cuda_kv_bytes
from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams

# the tiny models: 2 layers x K and V x 2 KV heads x head_dim 16 x 4 bytes (fp32) per token
TINY_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


def test_cpu_share_and_cap() -> None:
    assert cpu_kv_bytes(8 * GIB) == int(0.05 * 8 * GIB)
    assert cpu_kv_bytes(200 * GIB) == 4 * GIB  # capped
    assert cpu_kv_bytes(0) == 0
    with pytest.raises(ValueError, match="mem_available"):
        cpu_kv_bytes(-1)


def test_cuda_budget_less_held_and_peak() -> None:
    # 80 GiB card, 79 free at start; the engine holds 17 GiB, its activations peak at 3
    assert cuda_kv_bytes(0.9, 80 * GIB, 79 * GIB, 17 * GIB, 3 * GIB) == int(0.9 * 80 * GIB) - 20 * GIB
    assert cuda_kv_bytes(0.5, 80 * GIB, 79 * GIB, 17 * GIB, 3 * GIB) == 20 * GIB
    with pytest.raises(ValueError, match=r"free device memory at start \(30.00/80.00 GiB\).*gpu_memory_utilization=0.9"):
        cuda_kv_bytes(0.9, 80 * GIB, 30 * GIB, 1, 1)  # another process holds 50 GiB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        cuda_kv_bytes(1.5, 80 * GIB, 79 * GIB, 1, 1)
    # weights and activations past the budget: nothing left, a clear error
    kv = cuda_kv_bytes(0.9, 80 * GIB, 79 * GIB, 70 * GIB, 3 * GIB)
    with pytest.raises(ValueError, match="no room for the KV cache.*raise gpu_memory_utilization"):
        blocks_for_bytes(kv, 2**20, "raise gpu_memory_utilization")


def test_blocks_and_description() -> None:
    assert blocks_for_bytes(10 * 2**20 + 5, 2**20, "x") == 10
    with pytest.raises(ValueError, match="block_bytes"):
        blocks_for_bytes(GIB, 0, "x")
    size = KVSize(num_blocks=1024, block_size=16, block_bytes=2**20, source="num_kv_blocks")
    assert (size.tokens, size.gib) == (16384, 1.0)
    assert size.describe() == "KV cache: 1024 blocks x 16 tokens = 16384 tokens, 1.00 GiB (num_kv_blocks)"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_kv_blocks": 64, "kv_cache_memory_gb": 1.0}, "not both"),
        ({"kv_cache_memory_gb": 0.0}, "kv_cache_memory_gb must be > 0"),
        ({"kv_cache_memory_gb": -2.0}, "kv_cache_memory_gb must be > 0"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.01}, "gpu_memory_utilization"),
    ],
)
def test_config_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def _kv_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvroute.replica.kv_sizing"]


def test_embedded_model_default_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    """The default engine on CPU: one INFO line, a size within the share and the cap of
    the RAM it saw, and the engine's reported capacity (what the router gets) that size."""
    caplog.set_level(logging.INFO, logger="kvroute.replica.kv_sizing")
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    engine = llm.engine
    (line,) = _kv_lines(caplog)
    m = re.fullmatch(r"KV cache: (\d+) blocks x 16 tokens = (\d+) tokens, ([\d.]+) GiB "
                     r"\(5% of ([\d.]+) GiB available RAM, at most 4 GiB\)", line)  # fmt: skip
    assert m, line
    blocks, tokens, gib, avail = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    # SmolLM2-135M: 30 layers x K and V x 3 KV heads x head_dim 64 x 4 bytes, 16 tokens a block
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16
    assert engine.kv.num_blocks == blocks == engine.stats().num_kv_blocks == engine.runner.kv_cache.shape[2]
    assert tokens == blocks * 16 and gib == pytest.approx(blocks * block_bytes / GIB, abs=0.006)
    expected = min(0.05 * avail * GIB, 4 * GIB) // block_bytes  # avail is rounded to 0.1 GiB in the line
    assert abs(blocks - expected) <= 0.05 * 0.05 * GIB // block_bytes + 1
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_serve_replica_prints_the_kv_line(tiny_llama_path: Path) -> None:
    """The start-up line reaches the console of ``kvroute serve-replica`` (the default
    sizing on CPU)."""
    import httpx

    from tests.conftest import free_port, wait_until
    from tests.deploy.server import start_cli, stop_cli

    port = free_port()
    proc, lines = start_cli(["serve-replica", "--model", str(tiny_llama_path), "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "256"], "serving")  # fmt: skip

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 120, "serve-replica to answer /health", interval_s=0.2)
    finally:
        output = stop_cli(proc, lines)
    (line,) = [x for x in output.splitlines() if "KV cache:" in x]
    assert re.fullmatch(r"INFO kvroute.replica.kv_sizing: KV cache: \d+ blocks x 16 tokens = \d+ tokens, [\d.]+ GiB "
                        r"\(5% of [\d.]+ GiB available RAM, at most 4 GiB\)", line), line  # fmt: skip


def test_cpu_default_follows_available_ram(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Exact sizes from the available RAM the engine reads (5 % of it; the cap is
    checked on the arithmetic alone, not by allocating 4 GiB)."""
    caplog.set_level(logging.INFO, logger="kvroute.replica.kv_sizing")
    block_bytes = TINY_TOKEN_BYTES * 16
    monkeypatch.setattr(kv_sizing, "mem_available", lambda: 2 * GIB)
    llm = LLM(str(tiny_llama_path), dtype="float32", device="cpu", max_model_len=256)
    assert llm.engine.kv.num_blocks == int(0.05 * 2 * GIB) // block_bytes == 13107
    assert _kv_lines(caplog)[-1] == ("KV cache: 13107 blocks x 16 tokens = 209712 tokens, 0.10 GiB "
                                     "(5% of 2.0 GiB available RAM, at most 4 GiB)")  # fmt: skip
    monkeypatch.setattr(kv_sizing, "mem_available", lambda: 1000)
    with pytest.raises(ValueError, match="no room for the KV cache.*set kv_cache_memory_gb"):
        LLM(str(tiny_llama_path), dtype="float32", device="cpu", max_model_len=256)


def test_explicit_sizes_win(tiny_llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.replica.kv_sizing")
    llm = LLM(str(tiny_llama_path), dtype="float32", num_kv_blocks=40, block_size=8, max_model_len=128)
    assert llm.engine.kv.num_blocks == 40 and _kv_lines(caplog)[-1].endswith("(num_kv_blocks)")
    llm = LLM(str(tiny_llama_path), dtype="float32", kv_cache_memory_gb=0.01, block_size=8, max_model_len=128)
    assert llm.engine.kv.num_blocks == int(0.01 * GIB) // (TINY_TOKEN_BYTES * 8)
    assert _kv_lines(caplog)[-1].endswith("(kv_cache_memory_gb=0.01)")


def test_emulated_engine_keeps_its_profile_capacity(tiny_llama_path: Path) -> None:
    from kvroute.replica.profiles import get_profile

    llm = LLM(str(tiny_llama_path), emulate="cpu_measured", block_size=16)
    assert llm.engine.kv.num_blocks == get_profile("cpu_measured").kv_blocks_per_replica * get_profile("cpu_measured").block_size // 16


def test_profile_forward_is_the_models_forward(tiny_llama_path: Path) -> None:
    """The profile run's logits are the model's: each even split of zero tokens gives the
    logits whose argmax is the greedy token after that many zeros; a run longer than the
    context length is split into sequences that fit."""
    import torch

    llm = LLM(str(tiny_llama_path), dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=64)
    runner = llm.engine.runner
    logits = runner.profile_forward(10, 2)  # two sequences of 5 zeros
    assert logits.shape == (2, llm.engine.arch.vocab_size) and torch.equal(logits[0], logits[1])
    greedy = llm.generate([[0] * 5], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    assert int(logits[0].argmax()) == greedy.token_ids[0]
    assert runner.profile_forward(200, 1).shape[0] == 4  # 64 tokens at most a sequence: 4 of 50
    with pytest.raises(ValueError, match="num_seqs"):
        runner.profile_forward(4, 5)


@pytest.mark.gpu
def test_cuda_default_takes_the_fraction(tiny_llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """On CUDA the default leaves the process within gpu_memory_utilization of the card
    after a full-budget prefill, and the KV takes most of what the weights leave."""
    import torch

    caplog.set_level(logging.INFO, logger="kvroute.replica.kv_sizing")
    free0, total = torch.cuda.mem_get_info()
    llm = LLM(str(tiny_llama_path), device="cuda", gpu_memory_utilization=0.5, max_model_len=2048,
              max_num_batched_tokens=2048, enforce_eager=True)  # fmt: skip
    assert "gpu_memory_utilization=0.5 of" in _kv_lines(caplog)[-1]
    kv_bytes = llm.engine.runner.kv_cache.numel() * llm.engine.runner.kv_cache.element_size()
    assert kv_bytes >= 0.85 * (0.5 * total - (free0 - torch.cuda.mem_get_info()[0] - kv_bytes))
    prompts = [[1 + i] * 1000 for i in range(8)]  # two full 2048-token steps of prefill
    llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    assert free0 - torch.cuda.mem_get_info()[0] <= 0.5 * total
