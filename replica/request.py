"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvroute.replica.block_hash import BlockHash, HashSpec, hash_blocks, root_hash
from kvroute.replica.outputs import RequestId, TokenLogprob
from kvroute.replica.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token ids (prompt then output), progress, and memoized block hashes.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (computed or hit).
    ``block_hashes`` grows as blocks fill and is never recomputed (ARCHITECTURE.md §3.1).
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    hash_spec: HashSpec
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)

    token_ids: list[int] = field(init=False)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_computed_tokens: int = field(init=False, default=0)
    num_cached_tokens: int = field(init=False, default=-1)  # set at first admission (both tiers)
    num_host_cached_tokens: int = field(init=False, default=0)  # of which restored from the host tier
    num_preemptions: int = field(init=False, default=0)
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)
    logprobs: list[TokenLogprob] | None = field(init=False, default=None)
    prompt_logprobs: list[TokenLogprob | None] = field(init=False, default_factory=lambda: [None])
    finish_reason: str | None = field(init=False, default=None)
    stop_reason: str | int | None = field(init=False, default=None)
    first_token_time: float | None = field(init=False, default=None)
    detokenizer: Any = field(init=False, default=None)
    route_ticket: int = field(init=False, default=0)  # the router's ticket for this request (0: none)
    constraints: Any = field(init=False, default=None)  # logits_constraints.RequestConstraints, if any

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self._root = root_hash(self.hash_spec, self.cache_salt, self.lora_name)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def update_block_hashes(self) -> list[BlockHash]:
        """Extend the memoized hashes to every full block of ``token_ids``; O(new blocks)."""
        bs = self.hash_spec.block_size
        have = len(self.block_hashes)
        full = len(self.token_ids) // bs
        if full > have:
            parent = self.block_hashes[-1] if have else self._root
            new_tokens = self.token_ids[have * bs : full * bs]
            self.block_hashes.extend(hash_blocks(self.hash_spec, new_tokens, parent=parent))
        return self.block_hashes
