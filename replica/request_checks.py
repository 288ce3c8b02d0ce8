"""What makes a request impossible for an engine, checked before it is queued: each
failure is a ValueError a caller can act on, naming the field and the limit (so a request
that could never run is refused when added, never stuck in the queue)."""

from __future__ import annotations

from typing import Sequence

from kvroute.replica.config import EngineConfig
from kvroute.replica.sampling_params import SamplingParams


def check_tokens(prompt: Sequence[int], resumed: Sequence[int], params: SamplingParams, vocab: int) -> None:
    """Token ids in the vocabulary; ``resume_output`` shorter than ``max_tokens``."""
    if not prompt:
        raise ValueError("prompt must not be empty (got 0 tokens)")
    for what, tokens in (("prompt", prompt), ("resume_output", resumed)):
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} token ids must be in [0, {vocab}); got {bad[:5]}")
    if len(resumed) >= params.max_tokens:
        raise ValueError(f"resume_output has {len(resumed)} tokens; it must be shorter than max_tokens={params.max_tokens}")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad_stop[:5]}")


def check_fits(num_prompt: int, params: SamplingParams, max_model_len: int, kv_blocks: int, config: EngineConfig) -> None:
    """The prompt plus ``max_tokens`` fits the context, the KV cache and, without chunked
    prefill, one step's token budget."""
    total = num_prompt + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"the model's context length max_model_len={max_model_len}"
        )
    bs = config.block_size
    if -(-total // bs) > kv_blocks:
        raise ValueError(
            f"prompt + max_tokens = {total} tokens needs {-(-total // bs)} KV blocks but the cache "
            f"has only num_kv_blocks={kv_blocks} of {bs} tokens"
        )
    if not config.enable_chunked_prefill and total > config.max_num_batched_tokens:
        raise ValueError(
            f"prompt + max_tokens = {total} exceeds max_num_batched_tokens="
            f"{config.max_num_batched_tokens} with chunked prefill disabled"
        )
