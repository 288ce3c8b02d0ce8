"""Small result objects that leave the engine: per-step deltas and final outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

RequestId = NewType("RequestId", str)


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of a sampled token plus the top-N alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None  # 1-based: how many tokens are at least as likely (None: not computed)


@dataclass(frozen=True)
class TokenDelta:
    """What one request gained in one engine step.

    ``finish_reason`` is ``None`` while the request runs, then "stop", "length" or
    "abort". ``text`` is the new detokenized text (never a split UTF-8 character, never
    part of a stop string).
    """

    request_id: RequestId
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # both tiers
    stop_reason: str | int | None = None
    num_host_cached_tokens: int = 0  # of which restored from the host tier
    # with the first token of a request that asked for them: one per prompt token
    # (None for the first, which has no context)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestOutput:
    """The whole result of one finished request (offline API)."""

    request_id: RequestId
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: TokenDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_host_cached_tokens = delta.num_host_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
