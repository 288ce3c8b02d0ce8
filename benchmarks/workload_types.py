"""What a workload is: its requests (``RequestSpec``: token ids, output length, arrival,
group, conversation turn, tenant salt, LoRA adapter) and the ``Workload`` that holds
them. ``workloads.py`` builds them; the simulator, the serving benchmark and the
reports read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class RequestSpec:
    """One request of a workload.

    ``arrival_s`` is seconds from the start of the run. ``after`` (multi-turn) names the
    request whose completion releases this one, ``think_time_s`` after it; then
    ``arrival_s`` is only a lower bound. ``output_token_ids`` (optional) are the tokens
    a simulator should "generate" so later turns find their history cached.
    ``cache_salt``: the tenant's salt, sent as the request's ``cache_salt`` (blocks of
    different salts never share KV, however equal their tokens). ``lora_name``: the LoRA
    adapter it names as its ``model`` (its blocks never share KV with another's either).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_s: float = 0.0
    group_id: int = 0
    session_id: int | None = None
    turn: int = 0
    after: str | None = None
    think_time_s: float = 0.0
    output_token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, eq=False)
class Workload:
    name: str
    requests: list[RequestSpec]
    params: dict[str, Any] = field(default_factory=dict)
    # Token ids every request of a group shares (for sizing KV capacity).
    shared_prefix_tokens: int = 0
    num_groups: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)
