"""What crosses Ray between the client, the Serve request router and the replicas
(torch-free: the request router runs inside every caller's process), and the errors a
caller can act on. A routing decision travels as a value: the router actor returns a
``RouteDecision``, the caller's request router adds it to the call as its ``route``
argument (``ROUTE_ARG``), and the replica answers with a ``FirstDelta`` that carries the
``RouteOutcome``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.outputs import TokenDelta
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteDecision, RouteOutcome

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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


# The keyword argument of ``EngineReplica.generate`` that carries the router's
# ``RouteDecision``: the caller's Serve request router adds it to the call it sends.
ROUTE_ARG = "route"


@dataclass(frozen=True)
class FirstDelta:
    """A replica's first stream item: its first ``TokenDelta`` with how the request's
    routing played out (``RouteOutcome``: this replica, the decision it received), so
    the caller learns where its request went from the stream itself."""

    outcome: RouteOutcome
    delta: TokenDelta


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


class RouteSlot:
    """Where the decision of a ``handle.choose_replica`` call lands: Serve keeps the
    call's keyword arguments to itself, so a caller that chooses without dispatching
    (the direct path's ingress request router) passes one of these among the arguments
    and reads the decision the ranker made from it. Its ``follower``, when it has one
    (``router_follow.RouterFollower``), decides in this process while it is ready,
    instead of a ``rank`` call to a router actor. It lives here, not beside the
    request router: Serve loads the request router's module a second time, and an
    ``isinstance`` against that copy's class never matches the caller's instance."""

    __slots__ = ("decision", "follower")

    def __init__(self, follower: Any = None) -> None:
        self.decision: RouteDecision | None = None
        self.follower = follower
