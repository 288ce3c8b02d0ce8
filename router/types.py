"""Small objects the router hands across its boundary (pure Python, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NewType, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.kv_events import LoadFigures

ReplicaId = NewType("ReplicaId", str)


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of one request: its full-block hashes (computed once, at
    the caller, with the cluster's HashSpec), its prompt length in tokens, and the
    candidates. ``table``: the candidates' matched depths and load columns, built by
    the ``Router`` for this request (None for a policy driven by a hand-built view)."""

    block_hashes: Sequence[BlockHash]
    num_tokens: int
    candidates: Sequence[ReplicaId]
    table: CandidateTable | None = None
    # The prompt's block hashes without the tenant's cache_salt, where it has one: what
    # a router matching prompt TEXT sees (tenants sharing a system prompt look alike).
    # The simulator gives it to the text-matching peers' re-implementations.
    unsalted_hashes: Sequence[BlockHash] | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (its hashes already fold it in)

    @property
    def text_hashes(self) -> Sequence[BlockHash]:
        """The hashes a text-matching router keys its tree on."""
        return self.block_hashes if self.unsalted_hashes is None else self.unsalted_hashes


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """A routing decision as the router makes it: where a request goes
    (``replica_id``; None: no router decided, reason "fallback"), how many of its tokens
    the router expects to be cached there, and why (a short machine-readable reason,
    e.g. "prefix", "load", "hot_prefix_replica", "round_robin", "unregistered").

    Set by the ``Router`` (policies leave them at their defaults): ``ticket``, unique
    and increasing across its decisions; the replica receives it with the request and
    its load reports name the highest ticket they count (``LoadFigures.route_ticket``).
    ``available_tokens``: the longest prefix of the request any candidate holds (either
    tier) as its directory saw it at decision time, so ``available - expected`` is what
    the choice gave up.

    Set by the router actor and the caller that asked it: ``fallbacks``, the other
    candidates in the order to try them when the choice is full (best first: ``order``);
    ``router_load``, the answering router process's CPU use in cores
    (``RouterService.load``); ``failovers`` and ``spills``, the routers the caller
    went past to get this answer (one that failed; a busy one: ``RouterChoice``).

    Set by a policy that prices moving KV (``router/policies/kv_pull_pricing.py``):
    ``pull_from``, the replica the chosen one pulls the request's prefix from before it
    runs the request (None: no pull), and ``pull_tokens``, the prefix's tokens the pull
    should leave cached there (whole blocks; ``expected_cached_tokens`` counts them).

    Frozen: whoever completes a decision makes a new one (``dataclasses.replace``)."""

    replica_id: ReplicaId | None
    expected_cached_tokens: int
    reason: str
    ticket: int = 0
    available_tokens: int = 0
    fallbacks: Sequence[str] = ()
    router_load: float = 0.0
    failovers: int = 0
    spills: int = 0
    pull_from: ReplicaId | None = None
    pull_tokens: int = 0

    @property
    def order(self) -> list[str]:
        """The replicas to try, best first: the choice, then the fallbacks."""
        return list(self.fallbacks) if self.replica_id is None else [self.replica_id, *self.fallbacks]


@dataclass(frozen=True)
class RouteOutcome:
    """How a request's routing played out: the replica that served it (``served_by``),
    the ``decision`` it was sent with (None: no kvroute router decided, e.g. Serve's own
    request routers or a single engine), and whether this serving is a ``resumed`` one
    (the request continues after tokens another replica streamed).

    The decision's prediction holds only when the request runs, from its start, on the
    replica the decision chose; otherwise (another ranked replica served it because the
    choice was full, a resume, a fallback) it has none (``predicted`` False, the
    expectation None) and its reason says why ("next_ranked", "resumed", "fallback").
    ``pulled_tokens``: the prompt tokens the serving replica pulled from the decision's
    ``pull_from`` before running the request (0: no pull, or it fell back)."""

    served_by: str | None = None
    decision: RouteDecision | None = None
    resumed: bool = False
    pulled_tokens: int = 0

    @property
    def predicted(self) -> bool:
        d = self.decision
        return d is not None and d.replica_id is not None and d.replica_id == self.served_by and not self.resumed

    @property
    def reason(self) -> str | None:
        d = self.decision
        if self.resumed:
            return "resumed"
        if d is not None and d.replica_id is not None and d.replica_id != self.served_by:
            return "next_ranked"
        return None if d is None else d.reason

    @property
    def expected_cached_tokens(self) -> int | None:
        return self.decision.expected_cached_tokens if self.predicted else None  # type: ignore[union-attr]

    @property
    def available_tokens(self) -> int | None:
        return self.decision.available_tokens if self.predicted else None  # type: ignore[union-attr]

    @property
    def ticket(self) -> int:
        return 0 if self.decision is None else self.decision.ticket


def free_kv_blocks(kv_usage: float, capacity_blocks: int) -> float:
    """KV blocks neither a running request holds nor a waiting one's prefix hit will
    take: ``(1 - kv_usage) × capacity_blocks``, or infinite when the capacity is
    unknown (0)."""
    return round((1.0 - kv_usage) * capacity_blocks) if capacity_blocks else math.inf


@dataclass(frozen=True)
class ReplicaLoad(LoadFigures):
    """A replica's load as the router sees it: its last reported ``LoadFigures``, with
    the optimistic increments for requests routed there since that report folded into
    ``queued_prefill_tokens`` and counted in ``in_flight``, and its KV capacity.
    ``unpriced_tokens``: the queued tokens ``queued_prefill_s`` does not price (the
    increments; every queued token of a replica that sent no estimate)."""

    capacity_blocks: int = 0
    in_flight: int = 0  # routed here since the last report
    unpriced_tokens: int = 0

    @property
    def queue_len(self) -> int:
        return self.num_waiting + self.num_running + self.in_flight


class CandidateTable:
    """One request's view of its candidates, column by column (index ``i`` is
    ``candidates[i]``): what the kvroute policy reads, laid out so its per-candidate
    work is a few C-level passes instead of attribute lookups on 32 objects.

    ``depth[i]``: leading blocks of the request candidate ``i`` holds (the directory's
    match). Load columns, from ``ReplicaLoad``: ``queued`` = ``queued_prefill_tokens``,
    ``rate`` = ``prefill_tokens_per_s``, ``running`` = ``num_running``,
    ``decode_step`` = ``decode_step_s``, ``queue_len``; ``interference[i]`` is
    ``decode_step[i]`` if candidate ``i`` has running decodes, else 0.0;
    ``free_blocks[i]``: ``free_kv_blocks`` as of the last report. ``measured``:
    no candidate lacks a rate or a decode step time (else the policy fills them in).
    ``queued_s[i]``: the seconds candidate ``i`` estimated for its reported queue, and
    ``unpriced[i]`` the queued tokens that estimate leaves out (see ``LoadView``).
    ``room(positions)`` gives the blocks of room left in those candidates' caches
    (capacity - cached - pending; None when the view cannot tell). Columns are sequences the caller must not mutate.
    ``host_depth[i]``: blocks past ``depth[i]`` that candidate ``i``'s host tier holds
    (None: no candidate has any), restored at ``host_rate[i]`` tokens/s (0: unmeasured).
    ``adapter_cold[i]``: the request's LoRA adapter is not resident on candidate ``i``
    (None: a base-model request), a slot load of ``adapter_load_s[i]`` seconds (0.0: unknown);
    ``adapter_blocked[i]``: it would wait there for a slot that running requests hold.
    ``release()`` gives, when asked (a request short of KV somewhere), each candidate's
    ``release_s`` and ``release_blocks`` as reported (``LoadFigures``; None: the view cannot tell).
    ``max_requests``: the most requests a replica accepts at once (the serving layer's
    cap, Ray Serve's ``max_ongoing_requests``; 0: none): one holding that many passes
    a request on to another by queue length, not by cache or adapter.
    ``pull()`` gives, when asked (a request whose prefix some candidate holds), each
    candidate's ``kv_bytes_per_token``, ``pull_bytes_per_s`` and ``pull_setup_s`` as
    reported (``LoadFigures``) and its confirmed depth (``depth`` without pending runs:
    what it can hand over now); None where no replica reports pulls (or the view cannot
    tell), and nobody pulls.
    """

    __slots__ = (
        "candidates", "depth", "queued", "rate", "running", "decode_step", "interference", "queue_len",
        "backlog", "free_blocks", "measured", "queued_s", "unpriced", "room", "host_depth", "host_rate",
        "adapter_cold", "adapter_load_s", "adapter_blocked", "release", "max_requests", "pull",
    )  # fmt: skip

    def __init__(
        self,
        candidates: Sequence[ReplicaId],
        depth: Sequence[int],
        queued: Sequence[int],
        rate: Sequence[float],
        running: Sequence[int],
        decode_step: Sequence[float],
        interference: Sequence[float],
        queue_len: Sequence[int],
        backlog: Sequence[int],
        free_blocks: Sequence[float],
        measured: bool,
        queued_s: Sequence[float],
        unpriced: Sequence[int],
        room: Callable[[Sequence[int]], list[int]] | None,
    ) -> None:
        self.candidates = candidates
        self.depth = depth
        self.queued = queued
        self.rate = rate
        self.running = running
        self.decode_step = decode_step
        self.interference = interference
        self.queue_len = queue_len
        self.backlog = backlog
        self.free_blocks = free_blocks
        self.measured = measured
        self.queued_s = queued_s
        self.unpriced = unpriced
        self.room = room
        self.host_depth: Sequence[int] | None = None
        self.host_rate: Sequence[float] = ()
        self.adapter_cold: Sequence[bool] | None = None
        self.adapter_load_s: Sequence[float] = ()
        self.adapter_blocked: Sequence[bool] | None = None
        self.release: Callable[[], tuple[Sequence[float], Sequence[int]]] | None = None
        self.max_requests = 0
        self.pull: Callable[[], tuple[Sequence[int], Sequence[float], Sequence[float], Sequence[int]]] | None = None

    def longest(self) -> int:
        """The most leading blocks any candidate holds, counting both tiers."""
        if self.host_depth is None:
            return max(self.depth, default=0)
        return max((d + h for d, h in zip(self.depth, self.host_depth)), default=0)

    @classmethod
    def from_view(cls, request: RouteRequest, view: Any) -> "CandidateTable":
        """The table from the plain ``ClusterView`` calls (hand-built views in tests)."""
        cands = request.candidates
        matched = view.prefix_match(request.block_hashes, cands)
        fill = getattr(view, "cache_fill", None)
        loads = [view.load(r) for r in cands]

        def room(positions: Sequence[int]) -> list[int]:
            return [round((1 - fill(cands[i])) * loads[i].capacity_blocks) for i in positions]  # type: ignore[misc]

        table = cls.from_loads(cands, [matched[r] for r in cands], loads, None if fill is None else room)
        if request.lora_name is not None:
            table.adapter_cold = [request.lora_name not in ld.resident_loras for ld in loads]
            table.adapter_load_s = [ld.adapter_load_s for ld in loads]
            table.adapter_blocked = [bool(ld.max_loras) and request.lora_name not in ld.running_loras
                                     and len(ld.running_loras) >= ld.max_loras for ld in loads]  # fmt: skip
        return table

    @classmethod
    def from_loads(
        cls,
        candidates: Sequence[ReplicaId],
        depth: Sequence[int],
        loads: Sequence[ReplicaLoad],
        room: Callable[[Sequence[int]], list[int]] | None = None,
    ) -> "CandidateTable":
        rate = [ld.prefill_tokens_per_s for ld in loads]
        step = [ld.decode_step_s for ld in loads]
        running = [ld.num_running for ld in loads]
        table = cls(
            candidates,
            depth,
            [ld.queued_prefill_tokens for ld in loads],
            rate,
            running,
            step,
            [d if b else 0.0 for d, b in zip(step, running)],
            [ld.queue_len for ld in loads],
            [ld.num_waiting + ld.in_flight for ld in loads],
            [free_kv_blocks(ld.kv_usage, ld.capacity_blocks) for ld in loads],
            all(rate) and all(step),
            [ld.queued_prefill_s for ld in loads],
            [ld.unpriced_tokens if ld.queued_prefill_s else ld.queued_prefill_tokens for ld in loads],
            room,
        )
        table.release = lambda: ([ld.release_s for ld in loads], [ld.release_blocks for ld in loads])
        if any(ld.kv_bytes_per_token for ld in loads):
            table.pull = lambda: ([ld.kv_bytes_per_token for ld in loads], [ld.pull_bytes_per_s for ld in loads],
                                  [ld.pull_setup_s for ld in loads], depth)  # fmt: skip
        return table
