"""The emulated model: what an engine runs instead of a model for ``EngineConfig(emulate=
PROFILE)`` (no torch, no weights).

Everything around the model stays real: the scheduler, KV cache manager, block pool,
prefix cache, KV events and load figures, detokenizer, and every host (``AsyncEngine``,
the Serve replica, the HTTP servers). A step takes the profile's time for what the
scheduler put in it (``step_seconds``: prefill tokens, decode rows and the context they
read, ``replica/profiles.py``), stretched by ``time_scale``, and each sampling row gets
a deterministic token: a function of the request's last tokens and its length, so a
request resumed on another replica continues exactly as it would have, and it never
emits an end-of-sequence or special token (emulated requests run to ``max_tokens``).
No logprobs: a row that asks for them gets None. No logits either, so the engine refuses
(ValueError at ``make_request``) a request with structured outputs or another logits
constraint (``logit_bias``, ``allowed_token_ids``, ``bad_words``) rather than ignore it.

LoRA adapters (``enable_lora``): only their configs are read (a folder's
``adapter_config.json``, for the rank); ``max_loras`` slots hold the resident ones (LRU,
``replica/lora/slots.py``), and a step that needs a cold one takes its slot load too,
the profile's ``adapter_load_time`` (bytes ÷ host → device bandwidth), scaled as the step.
A KV import from another replica takes the profile's ``pull_time`` for its bytes (``pull``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from kvroute.replica.lora.slots import EmulatedSlots
from kvroute.replica.profiles import StepProfile
from kvroute.replica.sampling_params import SampleRequest, SamplerOutput
from kvroute.replica.step_cost import attention_pairs

_FIRST_ORDINARY_ID = 1000  # ids below this are special tokens in the tokenizers we ship


def step_seconds(profile: StepProfile, sched: Any) -> float:
    """The profile's time for one scheduled step (``SchedulerOutput``): its prefill
    tokens and the positions they attend, its decode rows, the KV context those rows read, and the host-tier blocks
    it restores first (offloads overlap the step: not charged)."""
    prefill = decode = ctx = pairs = 0
    for row in sched.rows:
        if row.num_computed < row.request.num_prompt_tokens:
            prefill += row.num_new
            pairs += attention_pairs(row.num_computed, row.num_computed + row.num_new)
        else:
            decode += 1
            ctx += row.num_computed + row.num_new
    return profile.step_time(prefill, decode, ctx, pairs) + profile.restore_time(sched.restored_tokens)


class EmulatedModel:
    """Stands in for the model runner (``execute``) and the sampler (a call)."""

    def __init__(
        self,
        profile: StepProfile,
        vocab_size: int,
        avoid_ids: frozenset[int] = frozenset(),
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        lora_slots: tuple[int, int, int | None] | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
        if vocab_size <= _FIRST_ORDINARY_ID + len(avoid_ids):
            raise ValueError(f"vocab_size={vocab_size} leaves no ordinary token ids to emit")
        self.profile = profile
        self.time_scale = float(time_scale)
        self.vocab_size = vocab_size
        self.avoid_ids = avoid_ids
        self._clock, self._sleep = clock, sleep
        self.emulated_s = 0.0  # the profile's seconds of every step so far (unscaled)
        self._restores: list[tuple[int, float]] = []  # (tokens, scaled seconds) not yet taken
        # ``lora_slots=(max_loras, max_rank, max_cpu_loras)``: LoRA slots whose loads the profile prices
        self.lora = EmulatedSlots(*lora_slots, profile.adapter_load_time) if lora_slots is not None else None

    def execute(self, sched: Any) -> None:
        """Take the step's emulated time (from now: the scheduling before it is the
        host's own cost, as on a GPU where the CPU prepares the next step)."""
        start = self._clock()
        seconds = step_seconds(self.profile, sched)
        if self.lora is not None:
            seconds += self.lora.acquire({r.request.lora_name for r in sched.rows if r.request.lora_name is not None})
        if sched.restored_tokens:
            self._restores.append((sched.restored_tokens, self.profile.restore_time(sched.restored_tokens) * self.time_scale))
        self.emulated_s += seconds
        left = seconds * self.time_scale - (self._clock() - start)
        if left > 0:
            self._sleep(left)

    def pull(self, nbytes: int) -> float:
        """Take the profile's time to pull ``nbytes`` of KV from another replica (setup +
        bytes over its bandwidth, ``StepProfile.pull_time``), scaled as a step; returns
        the unscaled seconds. Runs in the import's worker thread, beside the steps."""
        seconds = self.profile.pull_time(nbytes)
        if seconds > 0:
            self._sleep(seconds * self.time_scale)
        return seconds

    def take_restore_timings(self) -> list[tuple[int, float]]:
        """``(tokens, seconds)`` of the restores since the last call, timed as the engine
        times its steps (scaled), like ``ModelRunner.take_restore_timings``."""
        out, self._restores = self._restores, []
        return out

    def __call__(self, logits: None, rows: Sequence[SampleRequest], mask: None = None) -> SamplerOutput:
        return SamplerOutput([self.next_token(r) for r in rows], [None] * len(rows))

    def next_token(self, row: SampleRequest) -> int:
        """A deterministic ordinary token id for the row's next position."""
        out = row.output_token_ids
        last = out[-1] if out else (row.prompt_token_ids[-1] if row.prompt_token_ids else 0)
        n = len(row.prompt_token_ids) + len(out)
        span = self.vocab_size - _FIRST_ORDINARY_ID
        token = _FIRST_ORDINARY_ID + (last * 7919 + n * 104_729) % span
        while token in self.avoid_ids or token in row.params.stop_token_ids:
            token = _FIRST_ORDINARY_ID + (token + 1 - _FIRST_ORDINARY_ID) % span
        return token
