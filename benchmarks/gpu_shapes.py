"""What the GPU benchmarks share: the model shapes they build as random-weight
checkpoints (config, safetensors and a word-level fast tokenizer, loaded through the
engine's real loader), scheduled steps to time, the device's copy bandwidth and matmul
rate, and the bytes and FLOPs a step moves and computes."""

from __future__ import annotations

from types import SimpleNamespace
import statistics
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "llama-3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=True, rope_theta=1000000.0, rope_scaling=None,
    ),
}  # fmt: skip


def random_checkpoint(shape: dict[str, Any], folder: Path, dtype: torch.dtype, device: str) -> Path:
    """Save a random-weight Hugging Face checkpoint of ``shape`` (built on ``device`` for
    speed) with a word-level fast tokenizer covering the whole vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    kw = dict(shape)
    model_type = kw.pop("model_type")
    theta, scaling = kw.pop("rope_theta"), kw.pop("rope_scaling")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    else:
        kw.update(rope_theta=theta, rope_scaling=scaling)
    vocab = kw["vocab_size"]
    config = AutoConfig.for_model(model_type, bos_token_id=0, eos_token_id=1, pad_token_id=2, **kw)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(folder))
    del model
    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t2", unk_token="t3")
    fast.save_pretrained(str(folder))
    return folder


def shape_checkpoint(name: str, root: Path) -> Path:
    """The random bf16 checkpoint of ``SHAPES[name]`` in ``root / name``, saved there on
    first use (the tokenizer is written last, so its presence means complete)."""
    folder = root / name
    if not (folder / "tokenizer.json").exists():
        random_checkpoint(SHAPES[name], folder, torch.bfloat16, "cuda")
    return folder


def _rows(batch: int, ctx: int, new: int, block_size: int, first_block: int = 0) -> Any:
    """A SchedulerOutput of ``batch`` rows computing tokens [ctx, ctx + new) each, on
    disjoint block ranges (KV contents do not matter for timing)."""
    from kvroute.replica.scheduler import ScheduledRequest, SchedulerOutput

    per = -(-(ctx + new) // block_size)
    rows = []
    for i in range(batch):
        req = SimpleNamespace(token_ids=[5 + (i + j) % 1000 for j in range(ctx + new)], num_tokens=ctx + new,
                              params=SimpleNamespace(prompt_logprobs=None))
        blocks = tuple(range(first_block + i * per, first_block + (i + 1) * per))
        rows.append(ScheduledRequest(req, ctx, new, blocks))  # type: ignore[arg-type]
    return SchedulerOutput(rows=rows)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Any, iters: int, done: Any, warmup: int = 2) -> float:
    """Median seconds of ``fn(); done()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
        done()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        done()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _time_steps(runner: Any, step: Any, iters: int) -> float:
    """Median seconds of ``runner.execute(step)`` (the whole device synchronised)."""
    _sync(runner.device)
    return _median_seconds(lambda: runner.execute(step), iters, lambda: _sync(runner.device))


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def bf16_matmul_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def kv_bytes_per_token(arch: Any, elem: int) -> int:
    """K and V of one token over every layer."""
    return arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * elem


def weight_bytes_of(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, tied ones counted once."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def decode_bytes(weight_bytes: int, arch: Any, batch: int, ctx: int, elem: int) -> int:
    """Bytes one decode step must read: every weight once, plus each sequence's K and V."""
    return weight_bytes + batch * ctx * kv_bytes_per_token(arch, elem)


def prefill_flops(weights: int, arch: Any, ctx: int, new: int) -> int:
    """2 x non-embedding weights per computed token + causal attention over the cached
    prefix and the chunk (QK^T and PV) + the lm_head row that samples."""
    pairs = sum(ctx + i + 1 for i in range(new))
    return 2 * weights * new + 4 * arch.num_layers * arch.num_heads * arch.head_dim * pairs + 2 * arch.hidden_size * arch.vocab_size
