"""How long one engine step takes, from what the step computes.

    step_s = overhead_s
           + prefill_tokens / prefill_tokens_per_s
           + decode_batch * decode_s_per_seq
           + context_tokens * attn_s_per_ctx_token

``context_tokens`` is the KV the decode rows read (sum of their context lengths).

Two calibrations:

``gpu_h100_llama3_8b`` (H100 SXM, Llama-3-8B-class, bf16), from public figures:
  - prefill: Llama-3-8B costs ~2 x 8e9 = 16 GFLOP/token; an H100 SXM gives 989 dense
    bf16 TFLOP/s (NVIDIA datasheet); at ~25% MFU end to end (vLLM/SGLang prefill
    benchmarks report ~10-20k tokens/s for 8B on one H100) that is ~15,000 tokens/s.
  - decode: each step reads the 16 GB of weights at 3.35 TB/s HBM3 (~4.8 ms) plus
    launch/sampling overhead: overhead_s = 6 ms; per-sequence work (sampling, MLP
    activations, scheduler) ~0.1 ms; KV read per context token = 32 layers x 8 KV heads
    x 128 dims x 2 (K,V) x 2 bytes = 128 KiB -> 3.9e-8 s at 3.35 TB/s, ~5e-8 s at
    ~80% bandwidth. Batch 32 at 2k context: 6 + 3.2 + 3.3 = 12.5 ms; batch 64: ~19 ms
    (public vLLM H100 8B ITL figures are 10-25 ms at batch 32-64).
  - KV capacity: 80 GB - 16 GB weights - activations ~ 55 GB / 128 KiB per token
    ~ 430k tokens ~ 26,800 blocks of 16 tokens.

``cpu_measured`` (this repo's engine, SmolLM2-135M on the 2-core CI machine), from
results/offline.json when present: prefill tokens/s = ``prefill.tokens_per_s``
(604.7); decode: the offline run's decode time = ``ours.seconds - prefill.seconds``
over ``output_len`` steps of batch ``num_requests`` (26.4 s / 64 steps = 0.41 s per
step at batch 64), split into 20 ms overhead + the rest per sequence (6.1 ms);
attention term folded into the per-sequence cost (0).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    name: str
    overhead_s: float
    prefill_tokens_per_s: float
    decode_s_per_seq: float
    attn_s_per_ctx_token: float = 0.0
    kv_blocks_per_replica: int = 0  # the hardware's natural KV capacity (blocks of 16)
    source: str = ""

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if min(self.overhead_s, self.decode_s_per_seq, self.attn_s_per_ctx_token) < 0:
            raise ValueError("cost model constants must be >= 0")

    def step_time(self, prefill_tokens: int, decode_batch: int, context_tokens: int = 0) -> float:
        return (
            self.overhead_s
            + prefill_tokens / self.prefill_tokens_per_s
            + decode_batch * self.decode_s_per_seq
            + context_tokens * self.attn_s_per_ctx_token
        )

    def as_dict(self) -> dict:
        return asdict(self)


def gpu_h100_llama3_8b() -> CostModel:
    return CostModel(
        name="gpu_h100_llama3_8b",
        overhead_s=6e-3,
        prefill_tokens_per_s=15_000.0,
        decode_s_per_seq=1e-4,
        attn_s_per_ctx_token=5e-8,
        kv_blocks_per_replica=26_800,
        source="public figures: H100 SXM datasheet (989 TFLOP/s bf16, 3.35 TB/s), Llama-3-8B config; see cost_model.py",
    )


def cpu_measured(path: str | Path = "results/offline.json") -> CostModel:
    prefill, overhead, per_seq, src = 604.7, 0.02, 6.1e-3, "defaults (offline.json of 2026-11-22)"
    p = Path(path)
    if p.exists():
        d = json.loads(p.read_text())
        try:
            prefill = float(d["prefill"]["tokens_per_s"])
            steps, batch = int(d["output_len"]), int(d["num_requests"])
            decode_total = float(d["ours"]["seconds"]) - float(d["prefill"]["seconds"])
            per_step = max(decode_total / steps, overhead + 1e-4)
            per_seq = (per_step - overhead) / batch
            src = f"measured: {p}"
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            pass
    return CostModel("cpu_measured", overhead, prefill, per_seq, 0.0, kv_blocks_per_replica=2048, source=src)


COST_MODELS = {"gpu": gpu_h100_llama3_8b, "cpu": cpu_measured}
