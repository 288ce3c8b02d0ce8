"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvroute.replica.outputs import TokenLogprob
from kvroute.replica.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # |bias| bound, as OpenAI's API


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible: the random
    draw for output token *i* depends only on ``(seed, i)``, so a request recomputed after
    preemption, or resumed elsewhere with its tokens so far, samples the same tokens.
    ``logprobs=N`` returns the sampled token's logprob and the top-N alternatives;
    ``prompt_logprobs=N`` the same for every prompt token after the first (computed, not
    read from the prefix cache: a cached block has no logits).
    ``top_k`` 0 or -1: no top-k filter.

    Constraints (``replica/logits_constraints.py``), applied to the logits before the
    penalties: ``structured_output`` (the output matches a JSON schema, regex, choice or
    grammar; ``replica/structured_output.py``), ``logit_bias`` (``{token id: bias}``,
    bias in [-100, 100], added to the logits; stored as sorted ``(id, bias)`` pairs),
    ``allowed_token_ids`` (only these may be sampled) and ``bad_words`` (never complete
    one of these words: the last token of a word's token sequence is blocked when the
    output ends with the rest of it). Token ids are checked against the model's
    vocabulary when the engine takes the request.

    ``structured_output_after``: the grammar starts once the output holds this token
    sequence (a reasoning model's ``</think>``): the tokens up to its end are sampled
    without the grammar, the ones after it match the grammar from its start. Empty:
    the grammar applies from the first token. The other constraints apply throughout.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None
    logit_bias: Any = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    structured_output_after: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists/strings from callers but store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("n", "max_tokens", "min_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.n != 1:
            raise ValueError(f"n must be 1 for the engine (got {self.n}); fan out n>1 above the engine")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        self._check_constraints()

    def _check_constraints(self) -> None:
        """Type and range checks of the logits constraints; normalizes them to tuples."""
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = []
        for key, value in bias:
            tid = _token_id(key, "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"logit_bias[{tid}] must be a finite number, got {value!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{tid}] must be in [-100, 100], got {value}")
            pairs.append((tid, float(value)))
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))
        if self.allowed_token_ids is not None:
            ids = tuple(_token_id(t, "allowed_token_ids") for t in self.allowed_token_ids)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (None: no restriction)")
            object.__setattr__(self, "allowed_token_ids", ids)
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        if not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must be non-blank strings, got {list(words)!r}")
        object.__setattr__(self, "bad_words", words)
        after = tuple(_token_id(t, "structured_output_after") for t in self.structured_output_after)
        object.__setattr__(self, "structured_output_after", after)

    @property
    def constrained(self) -> bool:
        """True when a logits constraint applies (structured output, bias, allowed or bad words)."""
        return bool(self.structured_output or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _token_id(value: Any, name: str) -> int:
    """A token id given as an int or a decimal string (JSON object keys are strings)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} token ids must be integers >= 0, got {value!r}")
    return value


@dataclass
class SampleRequest:
    """One row of a batch to sample: the request's params and its tokens before this
    step (what the sampler, or the emulated engine's token source, reads)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class SamplerOutput:
    """One sampled token per row; ``logprobs[i]`` is None where row i asked for none."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
