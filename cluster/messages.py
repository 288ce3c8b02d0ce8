"""What crosses Ray between the client, the Serve request router and the replicas
(torch-free: the request router runs inside every caller's process), and the errors a
caller can act on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.sampling_params import SamplingParams

ROUTER_NAMESPACE = "kvroute"  # Ray namespace of the router actors


@dataclass
class GenerateRequest:
    """One generation call to a replica.

    ``block_hashes`` are the prompt's full-block hashes under the cluster's HashSpec,
    computed once by the caller; the request router ranks replicas with them.
    ``resume_output`` holds tokens already streamed by a replica that died (the new one
    continues after them). ``prompt`` is a text form of the prompt for routers that
    match on text: Ray Serve's PrefixCacheAffinityRouter reads the first of the
    attributes ``messages`` / ``prompt`` a request argument has, so this class must not
    have a ``messages`` attribute (it would be read even when None, and fail).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    block_hashes: Sequence[BlockHash]
    cache_salt: str | None = None
    resume_output: list[int] = field(default_factory=list)
    prompt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # Written by the caller's Serve request router (it runs in the caller's process and
    # sees this very object): ``route``, the router's decision, before Serve sends the
    # request (the replica takes the router's ticket from it); ``served_by``, the
    # replica Serve sent it to. The client turns them into the caller's RouteTrace.
    route: "RouteTrace | None" = None
    served_by: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class RouteTrace:
    """How one request was routed: the replica (the router's choice, or the one that
    served it), the cached tokens the router expected there (None when no router
    prediction applies), the reason, and the router's ticket (0: none), which the
    replica reports back in its load figures."""

    replica_id: str | None = None
    expected_cached_tokens: int | None = None
    reason: str | None = None
    ticket: int = 0
    available_tokens: int | None = None  # the longest prefix any candidate held (None: no prediction)

    def served(self, replica_id: str, resumed: bool = False) -> "RouteTrace":
        """This decision as it played out on ``replica_id``: a resumed request, or one
        Serve sent to the next ranked replica (the choice was full), keeps no
        prediction, since the router's was for another replica or another start."""
        if resumed:
            return RouteTrace(replica_id, None, "resumed", self.ticket)
        if self.replica_id is not None and self.replica_id != replica_id:
            return RouteTrace(replica_id, None, "next_ranked", self.ticket)
        return RouteTrace(replica_id, self.expected_cached_tokens, self.reason, self.ticket, self.available_tokens)


@dataclass(frozen=True)
class Ranking:
    """Candidates best first. ``replica_ids[0]`` is the router's decision (its blocks
    are recorded as pending there); the rest are fallbacks in order of load."""

    replica_ids: list[str]
    expected_cached_tokens: int
    reason: str
    ticket: int = 0  # the router's ticket for this request (RouteDecision.ticket)
    available_tokens: int = 0  # RouteDecision.available_tokens
    router_load: float = 0.0  # the answering router process's CPU use, in cores (RouterService.load)

    def trace(self) -> RouteTrace:
        return RouteTrace(self.replica_ids[0], self.expected_cached_tokens, self.reason, self.ticket, self.available_tokens)


@dataclass(frozen=True)
class ReplicaCall:
    """Addresses a non-generate method call to one replica by its Serve unique id
    (introspection: ``debug_state``, ``cached_block_hashes``)."""

    replica_id: str


class OverloadedError(RuntimeError):
    """Every replica is at ``max_ongoing_requests`` and the application's queue is full.
    The HTTP layer answers 429 with ``Retry-After: retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ReplicaUnavailableError(RuntimeError):
    """A request could not be served: its replicas kept dying past the retry budget,
    or no replica came up in time. The HTTP layer answers 503."""
