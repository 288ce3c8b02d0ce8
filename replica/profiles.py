"""Step-time profiles: how long one engine step takes on a given card and model shape,
from what the step computes (stdlib only). The simulator (``benchmarks/sim``) and the
emulated engine (``EngineConfig(emulate=name)``, ``replica/emulated.py``) both load them
by name from ``PROFILES``.

    step_s = overhead_s
           + prefill_tokens / prefill_tokens_per_s
           + decode_batch * decode_s_per_seq
           + context_tokens * attn_s_per_ctx_token

``context_tokens`` is the KV the decode rows read (sum of their context lengths).

Three profiles are written here and the others are read from ``step_profiles/*.json``
(one per card and model shape, written by ``kvroute bench gpu_engine --cost-model
--shapes ... --save-profiles DIR``; each file names its card, date and command).
Where each constant comes from: benchmarks/RESULTS.md, "Step profiles".

- ``gpu_h100_llama3_8b``: this engine on an H100 80GB HBM3, Llama-3-8B shape, bf16.
- ``cpu_measured``: this engine on the machine that runs it, from
  ``results/offline.json`` (``kvroute bench offline``) when present, else defaults.
- ``cpu_avx2_slow``: a slow AVX2-only CPU, on which one long prompt stalls its replica.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class StepProfile:
    """One card and model shape: step-time constants, its KV capacity in blocks of
    ``block_size`` tokens, the emulated model's context length, and where the numbers
    come from."""

    name: str
    overhead_s: float
    prefill_tokens_per_s: float
    decode_s_per_seq: float
    attn_s_per_ctx_token: float = 0.0
    kv_blocks_per_replica: int = 0  # the hardware's natural KV capacity (blocks of block_size)
    source: str = ""
    block_size: int = 16
    max_model_len: int = 131_072
    kv_bytes_per_token: int = 0  # for host-tier copies
    host_copy_bytes_per_s: float = 0.0  # host -> device KV copy bandwidth (0: copies are free)
    prefill_s_per_pair: float = 0.0  # prefill attention: seconds per (new token, position it attends) pair
    lora_bytes_per_rank: int = 0  # one rank of an adapter on every linear of the shape (0: slot loads are free)
    # a pull of another replica's KV: device to device at this bandwidth (0: through the host, a copy out at
    # host_copy_bytes_per_s and one in), plus a fixed setup (the call to the source, the payload's metadata)
    peer_bytes_per_s: float = 0.0
    pull_setup_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if min(self.overhead_s, self.decode_s_per_seq, self.attn_s_per_ctx_token, self.prefill_s_per_pair) < 0:
            raise ValueError("cost model constants must be >= 0")

    def step_time(self, prefill_tokens: int, decode_batch: int, context_tokens: int = 0, prefill_pairs: int = 0) -> float:
        """Seconds of one step: ``prefill_pairs`` counts the prefill rows' attention
        (``replica.step_cost.attention_pairs``), which a CPU feels deep in a long prompt."""
        return (
            self.overhead_s
            + prefill_tokens / self.prefill_tokens_per_s
            + prefill_pairs * self.prefill_s_per_pair
            + decode_batch * self.decode_s_per_seq
            + context_tokens * self.attn_s_per_ctx_token
        )

    def restore_time(self, tokens: int) -> float:
        """Seconds to copy ``tokens`` tokens of KV from the host tier to the device."""
        if not tokens or not self.host_copy_bytes_per_s:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.host_copy_bytes_per_s

    def pull_bytes_per_s(self) -> float:
        """A pull's bandwidth: device to device where the profile has one, else through
        the host (two copies: half the host copy bandwidth); 0.0: not modelled."""
        return self.peer_bytes_per_s or self.host_copy_bytes_per_s / 2

    def pull_time(self, nbytes: int) -> float:
        """Seconds to pull ``nbytes`` of KV from another replica (0.0 where the profile
        models no transfers)."""
        rate = self.pull_bytes_per_s()
        return self.pull_setup_s + nbytes / rate if nbytes and rate else 0.0

    def adapter_load_time(self, rank: int) -> float:
        """Seconds to copy a rank-``rank`` LoRA adapter (every linear) into a device slot."""
        if not self.host_copy_bytes_per_s:
            return 0.0
        return rank * self.lora_bytes_per_rank / self.host_copy_bytes_per_s

    def as_dict(self) -> dict:
        return asdict(self)


# A LoRA adapter on every linear of Llama-3-8B, per rank, bf16: per layer (in + out) of
# q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096, gate and up 4096+14336, down 14336+4096
# = 81,920 values, x 32 layers x 2 bytes (rank 16: 84 MB).
LLAMA3_8B_LORA_BYTES_PER_RANK = 81_920 * 32 * 2


def gpu_h100_llama3_8b() -> StepProfile:
    return StepProfile(
        name="gpu_h100_llama3_8b",
        overhead_s=7.46e-3,
        prefill_tokens_per_s=38_700.0,
        decode_s_per_seq=1.49e-5,
        attn_s_per_ctx_token=5.46e-8,
        kv_blocks_per_replica=26_779,
        kv_bytes_per_token=131_072,
        host_copy_bytes_per_s=50.3e9,
        lora_bytes_per_rank=LLAMA3_8B_LORA_BYTES_PER_RANK,
        pull_setup_s=0.002,  # pulls through the host: 25 GB/s (peer_bytes_per_s=50e9 models device to device)
        source="measured: this engine on an H100 80GB HBM3, Llama-3-8B shape (gpu_engine --cost-model, 2026-11-23); see cost_model.py",
    )


def cpu_measured(path: str | Path = "results/offline.json") -> StepProfile:
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
    return StepProfile(
        "cpu_measured", overhead, prefill, per_seq, 0.0, kv_blocks_per_replica=2048, source=src, max_model_len=8192
    )


def cpu_avx2_slow() -> StepProfile:
    """SmolLM2-135M in fp32 on a slow AVX2-only CPU, where one long prompt stalls its
    replica for tens of seconds; prefill priced per token and per attention pair
    (benchmarks/RESULTS.md)."""
    return StepProfile(
        "cpu_avx2_slow", 0.05, 275.0, 0.0175, 1.18e-6, kv_blocks_per_replica=2048, max_model_len=8192,
        prefill_s_per_pair=1.18e-6, source="a user's AVX2 EPYC (49.1 s for 6,525 tokens), split measured here",
    )


STEP_PROFILES = Path(__file__).with_name("step_profiles")


def _saved(path: Path) -> Callable[[], StepProfile]:
    """A profile that ``gpu_engine --cost-model`` saved (its card, date and command are
    kept in the file beside the fields)."""

    def load() -> StepProfile:
        d = json.loads(path.read_text())
        return StepProfile(**{f.name: d[f.name] for f in fields(StepProfile) if f.name in d})

    return load


PROFILES: dict[str, Callable[[], StepProfile]] = {
    "gpu_h100_llama3_8b": gpu_h100_llama3_8b,
    "cpu_measured": cpu_measured,
    "cpu_avx2_slow": cpu_avx2_slow,
    **{p.stem: _saved(p) for p in sorted(STEP_PROFILES.glob("*.json"))},
}


def get_profile(name: str) -> StepProfile:
    """The profile called ``name`` (ValueError naming the known ones)."""
    make = PROFILES.get(name)
    if make is None:
        raise ValueError(f"unknown emulation profile {name!r}; known: {sorted(PROFILES)}")
    return make()
