"""What the router believes about each replica's load (pure Python).

A replica reports ``LoadFigures`` on every KV-event batch (and repeats the last ones on
its heartbeat). Between two reports the router adds optimistic increments for each
request it routed there: one more in flight, and the request's *uncached* prompt tokens
(as the router predicted them) more queued prefill. A report supersedes the increments
of the requests it already counts, and only those: each routed request carries its
ticket (``RouteDecision.ticket``, increasing) to the replica, the report names the
highest ticket the replica had accepted when its figures were taken
(``LoadFigures.route_ticket``), and the increments of later tickets stay, until a report
counts them or ``ttl_s`` passes (a request redirected or cancelled on its way). Without
tickets a report taken before a request arrived would erase it: on a CPU replica, whose
steps take seconds and which takes new requests only between steps, every heartbeat
during a long prefill did, and the router saw that replica idle (a 2-replica run sent
31 of 48 requests to one of them).

The queue is priced in two parts: ``queued_s``, the seconds the replica itself
estimated for the queue it reported (``LoadFigures.queued_prefill_s``, from its measured
step cost, so a long prompt's deep positions cost what they cost there), and
``unpriced``, the tokens nobody priced yet (the increments, or the whole reported queue
of a replica with no estimate), which the policy prices at the fleet's rate.

LoRA adapters: each report names the adapters resident in the replica's device slots
(``LoadFigures.resident_loras``) and what a slot load takes there (``adapter_load_s``); a
request routed there with an adapter counts that adapter resident until a report that
no longer needs the increment (it will be loaded for the request), so a burst of one
adapter's requests sees it where the first went. Likewise running: a replica whose
running requests hold all of its ``max_loras`` slots makes a request of another adapter
wait for one to free (``adapters``' ``blocked``).

Layout: each replica owns a slot (reused after removal) and every figure the policies
read on the request path is a column (a list indexed by slot), so a report or an
increment is a few list stores and ``columns`` hands a policy each column for its
candidates with one C-level ``itemgetter`` call (built once per candidate set by
``select``). ``load(replica)`` builds the
``ReplicaLoad`` object from the columns, cached until that replica's figures change.
"""

from __future__ import annotations

import time
from collections import deque
from operator import itemgetter
from typing import Callable, Sequence

from kvroute.replica.kv_events import LoadFigures
from kvroute.router.types import ReplicaId, ReplicaLoad, free_kv_blocks

# (queued, rate, running, decode_step, interference, queue_len, backlog, free_blocks, measured, queued_s, unpriced)
Columns = tuple[
    Sequence[int], Sequence[float], Sequence[int], Sequence[float], Sequence[float], Sequence[int], Sequence[int],
    Sequence[float], bool, Sequence[float], Sequence[int],
]


class LoadView:
    """Per-replica last report + optimistic increments for the requests routed there
    that no report counts yet."""

    def __init__(self, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self._slot: dict[ReplicaId, int] = {}
        self._free: list[int] = []
        # columns, by slot; ``queued`` includes the routed-since-report increments
        self.queued: list[int] = []
        self.rate: list[float] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.in_flight: list[int] = []
        self.decode_step: list[float] = []
        self.interference: list[float] = []  # decode_step if running decodes, else 0.0
        self.queue_len: list[int] = []  # waiting + running + in_flight
        self.backlog: list[int] = []  # waiting + in_flight
        self.free_blocks: list[float] = []  # KV blocks free at the last report ((1 - kv_usage) x capacity)
        self.queued_s: list[float] = []  # the reported queue's seconds, as the replica estimated them (0.0: none)
        self.unpriced: list[int] = []  # queued tokens not in queued_s: the increments (all, without an estimate)
        self.resident: list[frozenset[str]] = []  # LoRA adapters in device slots, and those routed there since
        self.adapter_load_s: list[float] = []  # seconds a slot load takes there (0.0: unknown)
        self.running_loras: list[frozenset[str]] = []  # adapters of running requests, and those routed there since
        self.max_loras: list[int] = []  # its adapter slots (0: no adapters)
        self.max_requests = 0  # the serving layer's cap on a replica's requests, as the latest report says (0: none)
        self._unmeasured: set[int] = set()  # slots without a prefill rate or decode step time
        self._pullers: set[int] = set()  # slots whose replica reports a pull's cost (kv_bytes_per_token)
        # per slot: (ticket, uncached tokens, deadline, adapter) of each request routed
        # there that no report counts yet, oldest first (tickets and deadlines both increase)
        self._transit: list[deque[tuple[int, int, float, str | None]]] = []
        self._figures: list[LoadFigures] = []
        self._capacity: list[int] = []
        self._reports: list[int] = []
        self._cached: list[ReplicaLoad | None] = []

    # ------------------------------------------------------------------ membership
    def add_replica(self, replica_id: str, capacity_blocks: int) -> None:
        rid = ReplicaId(replica_id)
        if rid in self._slot:
            raise ValueError(f"replica {replica_id!r} is already in the load view")
        if self._free:
            s = min(self._free)
            self._free.remove(s)
        else:
            s = len(self.queued)
            for col in self._all_columns():
                col.append(None)
        self._slot[rid] = s
        self._capacity[s] = capacity_blocks
        self._reports[s] = 0
        self._transit[s] = deque()
        self._set(s, LoadFigures())

    def remove_replica(self, replica_id: str) -> None:
        s = self._slot.pop(ReplicaId(replica_id), None)
        if s is not None:
            self._free.append(s)
            self._unmeasured.discard(s)
            self._pullers.discard(s)
            self._cached[s] = None

    # ------------------------------------------------------------------ updates
    def report(self, replica_id: str, figures: LoadFigures) -> None:
        """A report from the replica: take its figures, drop the increments of the
        requests it counts (tickets up to ``figures.route_ticket``) and of those past
        their deadline, and keep the rest on top. The same figures again with no
        increment on top (a heartbeat, an event batch of an idle replica) cost one
        comparison."""
        s = self._get(replica_id)
        self._reports[s] += 1
        transit = self._transit[s]
        if not transit and figures == self._figures[s]:
            return  # the columns hold exactly these figures already (no increment since)
        self._set(s, figures)
        if transit:  # (not in ticket order: other routers' decisions arrive late)
            seen, now = figures.route_ticket, self.clock()
            self._transit[s] = transit = deque(t for t in transit if t[0] > seen and t[2] > now)
            for _, tokens, _, lora in transit:
                self._bump(s, tokens, lora)

    def on_routed(self, replica_id: str, uncached_tokens: int, ticket: int = 0, lora_name: str | None = None) -> None:
        """A request routed to ``replica_id`` (with LoRA adapter ``lora_name``); a
        ``ticket`` of 0 (none) is superseded by the next report whatever it counts."""
        s = self._get(replica_id)
        if ticket and ticket <= self._figures[s].route_ticket:
            return  # another router's decision that reached us after the report counting it
        self._bump(s, uncached_tokens, lora_name)
        self._transit[s].append((ticket, uncached_tokens, self.clock() + self.ttl_s, lora_name))

    def _bump(self, slot: int, uncached_tokens: int, lora_name: str | None = None) -> None:
        if lora_name is not None and lora_name not in self.resident[slot]:
            self.resident[slot] = self.resident[slot] | {lora_name}
        if lora_name is not None and lora_name not in self.running_loras[slot]:
            self.running_loras[slot] = self.running_loras[slot] | {lora_name}
        self.in_flight[slot] += 1
        self.queue_len[slot] += 1
        self.backlog[slot] += 1
        if uncached_tokens > 0:
            self.queued[slot] += uncached_tokens
            self.unpriced[slot] += uncached_tokens
        self._cached[slot] = None

    def _set(self, s: int, f: LoadFigures) -> None:
        self._figures[s] = f
        if f.kv_bytes_per_token:
            self._pullers.add(s)
        else:
            self._pullers.discard(s)
        self.queued[s] = f.queued_prefill_tokens
        self.rate[s] = f.prefill_tokens_per_s
        self.running[s] = f.num_running
        self.waiting[s] = f.num_waiting
        self.decode_step[s] = f.decode_step_s
        self.interference[s] = f.decode_step_s if f.num_running else 0.0
        self.queue_len[s] = f.num_waiting + f.num_running
        self.backlog[s] = f.num_waiting
        self.free_blocks[s] = free_kv_blocks(f.kv_usage, self._capacity[s])
        self.queued_s[s] = f.queued_prefill_s
        self.unpriced[s] = 0 if f.queued_prefill_s else f.queued_prefill_tokens
        self.resident[s] = frozenset(f.resident_loras)
        self.adapter_load_s[s] = f.adapter_load_s
        self.running_loras[s] = frozenset(f.running_loras)
        self.max_loras[s] = f.max_loras
        if f.max_requests:
            self.max_requests = f.max_requests
        if f.prefill_tokens_per_s and f.decode_step_s:
            self._unmeasured.discard(s)
        else:
            self._unmeasured.add(s)
        self.in_flight[s] = 0
        self._cached[s] = None

    # ------------------------------------------------------------------ queries
    def slot(self, replica_id: str) -> int:
        return self._get(replica_id)

    def select(self, candidates: Sequence[str]) -> Callable[[list], Sequence] | None:
        """A getter of ``candidates``' entries from a column, in their order (None: the
        candidates are every slot in slot order, so the columns themselves serve).
        Valid until a replica is added or removed."""
        slots = [self._get(c) for c in candidates]
        if slots == list(range(len(self.queued))):
            return None
        if len(slots) == 1:
            only = slots[0]
            return lambda col: (col[only],)
        return itemgetter(*slots)

    def columns(self, getter: Callable[[list], Sequence] | None) -> Columns:
        """(queued, rate, running, decode_step, interference, queue_len, backlog,
        free_blocks, measured, queued_s, unpriced) for the candidates ``getter`` selects (``select``), in
        their order: ``CandidateTable``'s fields. The live columns come back when the
        candidates are every slot (read-only)."""
        if getter is None:
            return (
                self.queued, self.rate, self.running, self.decode_step, self.interference, self.queue_len,
                self.backlog, self.free_blocks, not self._unmeasured, self.queued_s, self.unpriced,
            )  # fmt: skip
        rate, step = getter(self.rate), getter(self.decode_step)
        return (
            getter(self.queued),
            rate,
            getter(self.running),
            step,
            getter(self.interference),
            getter(self.queue_len),
            getter(self.backlog),
            getter(self.free_blocks),
            not self._unmeasured or (all(rate) and all(step)),
            getter(self.queued_s),
            getter(self.unpriced),
        )

    def adapters(
        self, getter: Callable[[list], Sequence] | None, lora_name: str
    ) -> tuple[list[bool], Sequence[float], list[bool]]:
        """For the candidates ``getter`` selects: whether ``lora_name`` must be loaded
        into a slot there (not resident), the seconds such a load takes (0.0: unknown),
        and whether it must wait for a slot (every slot held by running requests of
        other adapters)."""
        pick = (lambda col: col) if getter is None else getter
        running, slots = pick(self.running_loras), pick(self.max_loras)
        blocked = [bool(m) and lora_name not in run and len(run) >= m for run, m in zip(running, slots)]
        return [lora_name not in r for r in pick(self.resident)], pick(self.adapter_load_s), blocked

    def has_report(self, replica_id: str) -> bool:
        return self._reports[self._get(replica_id)] > 0

    def load(self, replica_id: str) -> ReplicaLoad:
        s = self._slot.get(replica_id)  # type: ignore[call-overload]
        if s is not None:
            cached = self._cached[s]
            if cached is not None:
                return cached
        s = self._get(replica_id)
        f = self._figures[s]
        cached = self._cached[s] = ReplicaLoad(
            num_waiting=f.num_waiting,
            num_running=f.num_running,
            queued_prefill_tokens=self.queued[s],
            queued_prefill_s=f.queued_prefill_s,
            kv_usage=f.kv_usage,
            prefill_tokens_per_s=f.prefill_tokens_per_s,
            decode_step_s=f.decode_step_s,
            route_ticket=f.route_ticket,
            capacity_blocks=self._capacity[s],
            in_flight=self.in_flight[s],
            unpriced_tokens=self.unpriced[s],
            resident_loras=tuple(sorted(self.resident[s])),
            adapter_load_s=f.adapter_load_s,
            running_loras=tuple(sorted(self.running_loras[s])),
            max_loras=f.max_loras,
            release_s=f.release_s,
            release_blocks=f.release_blocks,
            kv_bytes_per_token=f.kv_bytes_per_token,
            pull_bytes_per_s=f.pull_bytes_per_s,
            pull_setup_s=f.pull_setup_s,
        )
        return cached

    @property
    def any_pulls(self) -> bool:
        """Whether some replica reports what a pull into it costs (else nobody pulls)."""
        return bool(self._pullers)

    def pulls(self, getter: Callable[[list], Sequence] | None) -> tuple[list[int], list[float], list[float]]:
        """For the candidates ``getter`` selects: each one's ``kv_bytes_per_token``,
        ``pull_bytes_per_s`` and ``pull_setup_s`` as last reported."""
        figures = self._figures if getter is None else getter(self._figures)
        return ([f.kv_bytes_per_token for f in figures], [f.pull_bytes_per_s for f in figures],
                [f.pull_setup_s for f in figures])  # fmt: skip

    def releases(self, getter: Callable[[list], Sequence] | None) -> tuple[list[float], list[int]]:
        """For the candidates ``getter`` selects: each one's ``release_s`` and
        ``release_blocks`` as last reported."""
        figures = self._figures if getter is None else getter(self._figures)
        return [f.release_s for f in figures], [f.release_blocks for f in figures]

    def figures(self, replica_id: str) -> LoadFigures:
        return self._figures[self._get(replica_id)]

    # ------------------------------------------------------------------ internals
    def _all_columns(self) -> list[list]:
        return [
            self.queued, self.rate, self.running, self.waiting, self.in_flight, self.decode_step,
            self.interference, self.queue_len, self.backlog, self.free_blocks, self.queued_s, self.unpriced,
            self.resident, self.adapter_load_s, self.running_loras, self.max_loras, self._transit, self._figures,
            self._capacity, self._reports, self._cached,
        ]  # fmt: skip

    def _get(self, replica_id: str) -> int:
        s = self._slot.get(replica_id)  # type: ignore[call-overload]
        if s is None:
            raise ValueError(f"unknown replica {replica_id!r}; known: {sorted(self._slot)}")
        return s
