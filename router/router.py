"""The Router: block directory + load view + a policy, behind one small API.

It implements ``ClusterView`` for its policy. ``route`` asks the policy, then records
the request's blocks as *pending* on the chosen replica (optimistic insert: the next
request sharing that new prefix sees it at once, instead of the whole burst scattering
before the replica's first KV event), bumps that replica's load increments under the
decision's ticket (``RouteDecision.ticket``; the caller hands it to the replica, whose
reports name the tickets they count: see ``LoadView``), and calls ``policy.on_routed``.
Nothing here is thread-safe: one caller (the router actor) drives it.

Request path: ``route`` matches the request once: ``candidate_table`` gives the
directory's depth and the load columns for every candidate in one object
(``CandidateTable``), which rides on the ``RouteRequest`` to the policy and gives
``route`` the chosen replica's matched blocks afterwards. ``note_routed`` applies
another router's decision (several active routers share their decisions). Each
candidate list is resolved against the directory and the load view once
(``_candidate_set``, kept by value until membership changes).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.directory import BlockDirectory, Selection
from kvroute.router.hot_prefixes import HotPrefixes, Move, handoff_plan, warmup_plan
from kvroute.router.load_view import LoadView
from kvroute.router.policy import Policy
from kvroute.router.types import CandidateTable, ReplicaId, ReplicaLoad, RouteDecision, RouteRequest


def _make_policy(policy: Policy | str, policy_kwargs: dict[str, Any]) -> Policy:
    if isinstance(policy, Policy):
        if policy_kwargs:
            raise ValueError(f"policy keyword arguments {sorted(policy_kwargs)} need a policy name, not an instance")
        return policy
    try:
        from kvroute.router.policies import make_policy
    except ImportError:
        if policy != "kvroute":
            raise
        from kvroute.router.policies.kvroute import KVRoutePolicy

        return KVRoutePolicy(**policy_kwargs)
    return make_policy(policy, **policy_kwargs)


class _CandidateSet:
    """One candidate list, resolved: ``ids`` (a tuple), the directory's selection and
    the load view's column getter."""

    __slots__ = ("ids", "directory", "loads")

    def __init__(self, ids: tuple[ReplicaId, ...], directory: Selection, loads: Callable[[list], Sequence] | None) -> None:
        self.ids = ids
        self.directory = directory
        self.loads = loads


class Router:
    """Routes requests to replicas; kept current by the replicas' KV events.

    ``apply(events)`` for an unknown replica (e.g. one removed while its last batch was
    in flight) is ignored and counted in ``stats()["events_unknown_replica"]``.
    """

    def __init__(
        self,
        policy: Policy | str = "kvroute",
        block_size: int = 16,
        *,
        pending_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        **policy_kwargs: Any,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.clock = clock
        self.policy = _make_policy(policy, policy_kwargs)
        self.directory = BlockDirectory(pending_ttl_s, clock)
        self.loads = LoadView(pending_ttl_s, clock)
        # tickets start at the wall clock in microseconds, so a restarted router's are
        # above its predecessor's (replicas report the highest they have seen)
        self._ticket = time.time_ns() // 1000
        self._reasons: Counter[str] = Counter()
        self._routed_to: Counter[str] = Counter()
        self._events_applied = 0
        self._peer_decisions = 0
        self._events_gap = 0
        self._events_unknown = 0
        self._block_updates = 0
        self.load = self.loads.load  # type: ignore[method-assign]  # one call less on the request path
        self.hot = HotPrefixes()  # every decision's prefix, for a joining or leaving replica's moves
        self._all: tuple[ReplicaId, ...] = ()  # every replica
        self._sets: dict[tuple[ReplicaId, ...], _CandidateSet] = {}  # resolved candidate sets, by value

    def set_policy(self, policy: Policy | str, policy_kwargs: dict[str, Any]) -> None:
        """Decide with another policy from the next request on; the directory, the load
        view and the tickets stay."""
        self.policy = _make_policy(policy, policy_kwargs)
        self._sets.clear()

    # ------------------------------------------------------------------ membership
    def add_replica(self, replica_id: str, capacity_blocks: int, host_capacity_blocks: int = 0) -> None:
        self.directory.add_replica(replica_id, capacity_blocks, host_capacity_blocks)
        self.loads.add_replica(replica_id, capacity_blocks)
        self._all = tuple(self.directory.replicas())
        self._sets.clear()

    def remove_replica(self, replica_id: str) -> None:
        self.directory.remove_replica(replica_id)
        self.loads.remove_replica(replica_id)
        self._all = tuple(self.directory.replicas())
        self._sets.clear()
        self.policy.on_replica_removed(ReplicaId(replica_id))

    def replicas(self) -> list[ReplicaId]:
        return self.directory.replicas()

    # ------------------------------------------------------------------ events
    def apply(self, events: KVEvents) -> bool:
        """Apply one batch of a replica's KV events. False: a ``seq`` gap, and the
        replica is now stale (ask it for ``cached_block_hashes()`` and call
        ``apply_snapshot``). The load figures are taken either way."""
        rid = events.replica_id
        if rid not in self.directory:
            self._events_unknown += 1
            return True
        if events.load is not None:
            self._observe_ticket(events.load.route_ticket)
            self.loads.report(rid, events.load)
        ok = self.directory.apply(rid, events.seq, events.stored, events.removed, events.cleared,
                                  events.host_stored, events.host_removed)  # fmt: skip
        if ok:
            self._events_applied += 1
            self._block_updates += len(events.stored) + len(events.removed) + len(events.host_stored) + len(events.host_removed)
        else:
            self._events_gap += 1
        return ok

    def apply_snapshot(
        self, replica_id: str, block_hashes: Sequence[BlockHash], seq: int, load: LoadFigures | None = None,
        host_hashes: Sequence[BlockHash] = (),
    ) -> None:
        """Replace the replica's entries by its full cache (both tiers) as of event ``seq``."""
        self.directory.apply_snapshot(replica_id, block_hashes, seq, host_hashes)
        if load is not None:
            self._observe_ticket(load.route_ticket)
            self.loads.report(replica_id, load)

    def register_snapshot(
        self, replica_id: str, capacity_blocks: int, host_capacity_blocks: int, block_hashes: Sequence[BlockHash],
        host_hashes: Sequence[BlockHash], seq: int, load: LoadFigures | None,
    ) -> None:
        """A registration: the replica added where it is new, then its snapshot applied
        (arguments in the order ``registrations`` lists them)."""
        if replica_id not in self.directory:
            self.add_replica(replica_id, capacity_blocks, host_capacity_blocks)
        self.apply_snapshot(replica_id, block_hashes, seq, load, host_hashes)

    def report_load(self, replica_id: str, load: LoadFigures) -> bool:
        """Load figures alone (an external worker's polled ``/metrics``), beside
        whatever feeds its cache entries; False: the replica is unknown."""
        if replica_id not in self.directory:
            return False
        self.loads.report(replica_id, load)
        return True

    def stale_replicas(self) -> list[ReplicaId]:
        return self.directory.stale_replicas()

    # ------------------------------------------------------------------ routing
    def route(
        self,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        candidates: Sequence[str] | None = None,
        unsalted_hashes: Sequence[BlockHash] | None = None,
        lora_name: str | None = None,
    ) -> RouteDecision:
        """Choose a replica for a request of ``num_tokens`` prompt tokens whose full
        blocks hash to ``block_hashes``; ``candidates`` None means every replica.
        ``unsalted_hashes``: see ``RouteRequest`` (the simulator's text-matching peers).
        ``lora_name``: the request's LoRA adapter (the table then says where it is cold)."""
        cs = self._candidate_set(candidates)
        cands = cs.ids
        if num_tokens < len(block_hashes) * self.block_size:
            raise ValueError(
                f"num_tokens={num_tokens} is less than {len(block_hashes)} blocks × block_size {self.block_size}"
            )
        table = self._table(block_hashes, cs)
        if lora_name is not None:
            table.adapter_cold, table.adapter_load_s, table.adapter_blocked = self.loads.adapters(cs.loads, lora_name)
        request = RouteRequest(block_hashes, num_tokens, cands, table, unsalted_hashes, lora_name)
        policy = self.policy
        decision = policy.choose(request, self)
        chosen = decision.replica_id
        try:  # the blocks the directory sees there (the policy's own belief may differ)
            held = request.table.depth[cands.index(chosen)]  # type: ignore[union-attr]
        except ValueError:
            raise AssertionError(f"policy {policy.name!r} chose {chosen!r}, not a candidate") from None
        cached = self._cap(held, num_tokens)
        if decision.pull_from is not None:  # the prefix arrives by a pull: only the rest is queued prefill
            cached = max(cached, decision.expected_cached_tokens)
        if held < len(block_hashes):
            self.directory.add_pending(chosen, block_hashes, start=held)
        # tickets follow the wall clock (microseconds) and every ticket seen
        # (_observe_ticket), so several routers' tickets order like their decisions and a
        # replica's highest accepted ticket covers them all
        self._ticket = ticket = max(self._ticket + 1, time.time_ns() // 1000)
        available = max(self._cap(request.table.longest(), num_tokens), decision.expected_cached_tokens)
        decision = replace(decision, available_tokens=available, ticket=ticket)
        self.loads.on_routed(chosen, num_tokens - cached, ticket, lora_name)
        policy.on_routed(request, decision)
        self.hot.observe(block_hashes)
        self._reasons[decision.reason] += 1
        self._routed_to[chosen] += 1
        return decision

    def note_routed(
        self, replica_id: str, block_hashes: Sequence[BlockHash], num_tokens: int, ticket: int, lora_name: str | None = None
    ) -> bool:
        """Another router sent a request of ``num_tokens`` to ``replica_id``: record its
        blocks as pending there and its load increment under its ticket, as ``route``
        does for its own (policies' own state hears only of their own decisions).
        False: unknown replica."""
        if replica_id not in self.directory:
            return False
        self._observe_ticket(ticket)
        held = self.directory.depth_on(replica_id, block_hashes)
        if held < len(block_hashes):
            self.directory.add_pending(replica_id, block_hashes, start=held)
        self.loads.on_routed(replica_id, num_tokens - self._cap(held, num_tokens), ticket, lora_name)
        self.hot.observe(block_hashes)
        self._peer_decisions += 1
        return True

    def note_peer_batch(self, batch: Iterable[Sequence[Any]]) -> int:
        """``note_routed`` for each of another router's decisions (replica, block hashes,
        prompt tokens, ticket, wall time sent, LoRA adapter); how many named a known replica."""
        return sum(self.note_routed(rid, hashes, n, ticket, lora) for rid, hashes, n, ticket, _, lora in batch)

    def count_decisions(self, reasons: dict[str, int], routed_to: dict[str, int]) -> None:
        """Count decisions this router's followers took in its name (``stats``)."""
        self._reasons.update(reasons)
        self._routed_to.update(routed_to)

    # ------------------------------------------------------------------ the fleet's changes
    def warmup_plan(self, replica_id: str, k: int = 8, max_blocks: int = 1024) -> list[Move]:
        """The hot prefixes a joining ``replica_id`` should pull first, each with a source
        (``hot_prefixes.warmup_plan``)."""
        return warmup_plan(self.hot, self.directory, replica_id, self._queue_len, k, max_blocks)

    def handoff_plan(self, replica_id: str, k: int = 8) -> list[Move]:
        """The hot prefixes a leaving ``replica_id`` should hand over, each with the
        survivor to take it (``hot_prefixes.handoff_plan``)."""
        return handoff_plan(self.hot, self.directory, replica_id, self._queue_len, k)

    def _queue_len(self, replica_id: str) -> int:
        return self.loads.load(replica_id).queue_len

    def _observe_ticket(self, ticket: int) -> None:
        """Tickets are a Lamport clock over the wall clock: a ticket seen from another
        router (its decisions) or a replica (the highest it accepted) moves this
        router's past it, so on nodes whose clocks disagree a later decision still gets
        a higher ticket than any the replicas have counted."""
        if ticket > self._ticket:
            self._ticket = ticket

    def _cap(self, blocks: int, num_tokens: int) -> int:
        """Cached tokens of ``blocks`` matched blocks (the last prompt token is always computed)."""
        cached = blocks * self.block_size
        return max(num_tokens - 1, 0) if cached >= num_tokens else cached

    # ------------------------------------------------------------------ ClusterView
    def prefix_match(self, block_hashes: Sequence[BlockHash], candidates: Sequence[str]) -> dict[ReplicaId, int]:
        return self.directory.match(block_hashes, candidates)

    def candidate_table(self, block_hashes: Sequence[BlockHash], candidates: Sequence[str] | None) -> CandidateTable:
        """The directory's match and the load columns for ``candidates`` (None: every
        replica), in their order."""
        return self._table(block_hashes, self._candidate_set(candidates))

    def _table(self, block_hashes: Sequence[BlockHash], cs: "_CandidateSet") -> CandidateTable:
        depths = self.directory.match_depths(block_hashes, cs.directory)
        rooms, selection = self.directory.cache_rooms, cs.directory
        table = CandidateTable(
            cs.ids, depths, *self.loads.columns(cs.loads), lambda positions: rooms(selection, positions)
        )
        table.release = lambda: self.loads.releases(cs.loads)
        if self.loads.any_pulls:
            table.pull = lambda: self._pull_figures(block_hashes, cs)
        table.max_requests = self.loads.max_requests
        table.host_depth = self.directory.host_depths(block_hashes, selection, depths)
        if table.host_depth is not None:
            table.host_rate = [self.loads.figures(rid).host_restore_tokens_per_s for rid in cs.ids]
        return table

    def _pull_figures(self, block_hashes: Sequence[BlockHash], cs: "_CandidateSet") -> tuple[list, list, list, list]:
        """``CandidateTable.pull()``: the candidates' reported pull figures and confirmed
        depths (not looked up where no candidate can pull: every depth 0 then)."""
        sizes, rates, setups = self.loads.pulls(cs.loads)
        if not any(sizes):
            return sizes, rates, setups, [0] * len(sizes)
        return sizes, rates, setups, self.directory.confirmed_depths(block_hashes, cs.directory)

    def _candidate_set(self, candidates: Sequence[str] | None) -> "_CandidateSet":
        """``candidates`` resolved against the directory and the load view, kept by
        value until membership changes (the cluster passes a fresh, usually equal,
        list per request)."""
        key = self._all if candidates is None else tuple(candidates)
        cs = self._sets.get(key)  # type: ignore[arg-type]  # (a tuple hashes its ids: O(candidates))
        if cs is not None:
            return cs
        if not key:
            if candidates is None:
                raise ValueError("the router has no replicas: call add_replica before routing")
            raise ValueError("candidates is empty: pass None for all replicas, or at least one replica id")
        unknown = [c for c in key if c not in self.directory]
        if unknown:
            raise ValueError(f"unknown candidate replicas {unknown}; known: {sorted(self.directory.replicas())}")
        if len(self._sets) >= 256:  # candidate subsets seen since the last membership change
            self._sets.clear()
        ids = tuple(ReplicaId(c) for c in key)
        cs = self._sets[ids] = _CandidateSet(ids, self.directory.select(ids), self.loads.select(ids))
        return cs

    def load(self, replica_id: str) -> ReplicaLoad:
        return self.loads.load(replica_id)

    def fallbacks(self, candidates: Sequence[str], chosen: str) -> list[ReplicaId]:
        """``candidates`` but ``chosen`` by ``load(r).queue_len``, shortest first
        (stable): one C-level sort of the candidate set's queue-length column, no
        ``ReplicaLoad`` built."""
        cs = self._candidate_set(candidates)
        ids, column = cs.ids, self.loads.queue_len
        queue_len = column if cs.loads is None else cs.loads(column)
        return [ids[i] for i in sorted(range(len(ids)), key=queue_len.__getitem__) if ids[i] != chosen]

    def cache_fill(self, replica_id: str) -> float:
        return self.directory.cache_fill(replica_id)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "replicas": len(self.directory.replicas()),
            "stale_replicas": self.directory.stale_replicas(),
            "directory_blocks": self.directory.num_blocks(),
            "directory_entries": self.directory.num_entries(),
            "pending_entries": self.directory.num_pending(),
            "decisions": sum(self._reasons.values()),
            "peer_decisions": self._peer_decisions,
            "decisions_by_reason": dict(self._reasons),
            "decisions_by_replica": dict(self._routed_to),
            # requests routed to each replica that no report of it counts yet
            "in_flight_by_replica": {rid: self.loads.load(rid).in_flight for rid in self.directory.replicas()},
            "events_applied": self._events_applied,
            "events_gap": self._events_gap,
            "events_unknown_replica": self._events_unknown,
            "block_updates": self._block_updates,
        }

    def registrations(self) -> list[tuple[Any, ...]]:
        """Each replica as a ``register`` would add it again: (id, capacity, host tier
        capacity, confirmed hashes, host hashes, last event seq, load figures), entries
        least recently touched first. Pending runs are left out (they expire anyway)."""
        d = self.directory
        return [(str(rid), *d.capacities(rid), d.confirmed(rid), d.host_confirmed(rid), d.last_seq(rid),
                 self.loads.figures(rid)) for rid in d.replicas()]  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        """JSON-serializable state (directory + last load figures) for ``restore``."""
        loads = {}
        for rid in self.directory.replicas():
            f = self.loads.figures(rid)
            loads[rid] = {k: getattr(f, k) for k in LoadFigures.__dataclass_fields__}
        return {"block_size": self.block_size, "directory": self.directory.snapshot(), "loads": loads}

    @classmethod
    def restore(cls, state: dict[str, Any], policy: Policy | str = "kvroute", **kwargs: Any) -> "Router":
        kwargs.setdefault("pending_ttl_s", state["directory"]["pending_ttl_s"])
        router = cls(policy, state["block_size"], **kwargs)
        router.directory = BlockDirectory.restore(state["directory"], router.clock)
        router.directory.pending_ttl_s = kwargs["pending_ttl_s"]
        router.loads = LoadView(kwargs["pending_ttl_s"], router.clock)
        router.load = router.loads.load  # type: ignore[method-assign]
        router._all = tuple(router.directory.replicas())
        router._sets.clear()
        for rid, rs in state["directory"]["replicas"].items():
            router.loads.add_replica(rid, rs["capacity_blocks"])
            fig = state.get("loads", {}).get(rid)
            if fig is not None:
                router.loads.report(rid, LoadFigures(**fig))
        return router
