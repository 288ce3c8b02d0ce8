"""kvroute's own policy: the smallest predicted time to first token, sticky to owners.

The rule, per candidate replica ``r`` of a request of ``n`` prompt tokens::

    cached_r = min(matched_blocks_r × block_size, n − 1)      # the last token is always computed
               − restored_r × prefill_rate / restore_rate_r      # host-tier blocks cost their copy
    wait_r   = queued_prefill_s_r + unpriced_r / fleet_rate      # the queue as r priced it, + what it has not
    work_r   = queued_prefill_tokens_r + n − cached_r
    ttft_r   = wait_r + (n − cached_r) / fleet_rate + ceil(work_r / step_tokens) × decode_step_r (0 if r runs no decodes)

A LoRA request waits for a slot load where its adapter is not resident (``r``'s
``adapter_load_s``; unknown: the candidates' mean, else ``default_adapter_load_s``), and
a candidate whose running requests hold every slot with other adapters is skipped while
another can take it. With ``scarcity`` each cold slot is priced by what it evicts
(``adapter_sets``); only candidates evicting no live adapter against its rules stay
admissible (else the cheapest). With ``eviction`` a full cache pays for the cached
tokens the request's computed ones push out (``eviction.py``), and a KV-short owner whose
next release covers it pays that wait instead of being skipped. ``survival`` (an
option) credits cached tokens by their chance to survive until admission.

``queued_prefill_s_r`` is the replica's own estimate of its reported queue (its
measured step cost: a long prompt's deep positions cost more per token than a short
prompt's); ``unpriced_r`` the queued tokens it does not cover (routed since its last
report, or its whole queue before it has measured a step).

Among the admissible candidates (batch: a queue at most ``max(1.5 × mean, mean + 16)``
of the candidates' and below the serving layer's cap, ``table.max_requests``; KV: free
blocks, less the queued prefills', for what the request needs there), ``best`` is the
smallest TTFT. An owner whose TTFT is within ``best`` plus its share
``cached_r / n`` of the slack is eligible (plus ``cached_r / fleet_rate`` while every
candidate has a queue), and the longest eligible prefix wins. With no owner eligible:
a new prefix goes to the roomiest cache among the near-best, then (where that one must
evict) the one serving the fewest live prefixes, anything else to ``best``.
With ``pulls``, a candidate whose recompute a pull of the deepest match from its least
loaded holder beats takes the pull's TTFT instead (``kv_pull_pricing.py``), and a
decision placing the request there names the source (``pull_from``, ``pull_tokens``);
with ``pull_kv_room`` (the default) a candidate whose free KV less its queued prefills
and its running answers' growth cannot hold the copy and the rest is passed over, pull
and recompute alike, while another is admissible.
Reasons: ``cold``, ``prefix``, ``hot_prefix_replica`` (the chosen holds none of a prefix
another holds), ``load`` (a shorter one), ``pull``. Why each rule: ``router/POLICIES.md``.
"""

from __future__ import annotations

from itertools import compress, repeat
from math import inf
from operator import and_, eq, ge, le
from typing import ClassVar, Sequence

from kvroute.router.adapter_sets import AdapterDemand, cheapest, slot_price
from kvroute.router.eviction import ReuseValue, eviction_seconds, kv_admissible
from kvroute.router.live_prefixes import LivePrefixes
from kvroute.router.policies.kv_pull_pricing import DEFAULT_PULL_BYTES_PER_S, DEFAULT_PULL_SETUP_S, PullPricing
from kvroute.router.policy import ClusterView, Policy
from kvroute.router.survival import survive
from kvroute.router.types import CandidateTable, ReplicaId, ReplicaLoad, RouteDecision, RouteRequest

BATCH_SLACK_REL = 1.5
BATCH_SLACK_ABS = 16
HOST_RATE_DEFAULT = 10.0  # a host-tier restore not measured yet: this many times the prefill rate


class KVRoutePolicy(Policy):
    """Smallest predicted TTFT; a longer cached prefix wins within ``slack`` of the best;
    no replica's batch runs ahead of the candidates' mean by more than the batch slack."""

    name: ClassVar[str] = "kvroute"
    _shortcut: ClassVar[bool] = True  # the owner shortcut in choose_from (tests turn it off to compare)

    def __init__(
        self,
        *,
        default_prefill_tokens_per_s: float = 10_000.0,
        default_decode_step_s: float = 0.02,
        step_tokens: int = 2048,
        slack_rel: float = 1.2,
        slack_abs_s: float = 0.01,
        fill_slack: float = 0.5,
        batch_slack_rel: float = BATCH_SLACK_REL,
        batch_slack_abs: int = BATCH_SLACK_ABS,
        saturated_stick: bool = True,
        default_adapter_load_s: float = 0.05,
        scarcity: bool = True,
        adapter_half_life: float = 256.0,
        adapter_hysteresis: float = 2.0,
        adapter_copies: bool = False,
        survival: bool = False,
        eviction: bool = True,
        reuse_half_life: float = 256.0,
        max_reuse: float = 4.0,
        balance_prefixes: bool = True,
        live_horizon: int = 2048,
        pulls: bool = True,
        default_pull_bytes_per_s: float = DEFAULT_PULL_BYTES_PER_S,
        default_pull_setup_s: float = DEFAULT_PULL_SETUP_S,
        pull_kv_room: bool = True,
    ) -> None:
        if default_prefill_tokens_per_s <= 0:
            raise ValueError(f"default_prefill_tokens_per_s must be positive, got {default_prefill_tokens_per_s!r}")
        if default_decode_step_s < 0:
            raise ValueError(f"default_decode_step_s must be >= 0, got {default_decode_step_s!r}")
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be positive, got {step_tokens!r}")
        if slack_rel < 1.0 or slack_abs_s < 0:
            raise ValueError(f"need slack_rel >= 1 and slack_abs_s >= 0, got {slack_rel!r}, {slack_abs_s!r}")
        if batch_slack_rel < 1.0 or batch_slack_abs < 0:
            raise ValueError(
                f"need batch_slack_rel >= 1 and batch_slack_abs >= 0, got {batch_slack_rel!r}, {batch_slack_abs!r}"
            )
        self.default_prefill_tokens_per_s = float(default_prefill_tokens_per_s)
        self.default_decode_step_s = float(default_decode_step_s)
        self.step_tokens = int(step_tokens)
        self.slack_rel = float(slack_rel)
        self.slack_abs_s = float(slack_abs_s)
        if fill_slack < 0:
            raise ValueError(f"fill_slack must be >= 0 (in requests), got {fill_slack!r}")
        self.fill_slack = float(fill_slack)
        self.batch_slack_rel = float(batch_slack_rel)
        self.batch_slack_abs = int(batch_slack_abs)
        self.saturated_stick = bool(saturated_stick)
        if default_adapter_load_s < 0:
            raise ValueError(f"default_adapter_load_s must be >= 0, got {default_adapter_load_s!r}")
        self.default_adapter_load_s = float(default_adapter_load_s)
        self.scarcity = bool(scarcity)  # the scarcity rules: adapter slot prices (router/POLICIES.md)
        self.demand = AdapterDemand(adapter_half_life)
        self.adapter_hysteresis = float(adapter_hysteresis)  # a copy evicts one only this many times colder per copy
        self.adapter_copies = bool(adapter_copies)  # an adapter past a replica's fair share may evict for a copy
        self.survival = bool(survival)  # credit a cached prefix by its chance to survive until admission
        self.eviction = bool(eviction)  # price what a placement evicts from a full cache (router/eviction.py)
        self.reuse = ReuseValue(reuse_half_life, max_reuse)
        self.live = LivePrefixes(live_horizon) if balance_prefixes else None  # new prefixes: the fewest live first
        # (checks the defaults either way); pull_kv_room: no pull or recompute where the prompt crowds running answers
        pricing = PullPricing(default_pull_bytes_per_s, default_pull_setup_s, pull_kv_room)
        self.pulls = pricing if pulls else None  # move a held prefix where that beats recomputing it

    def fallback_rates(self, loads: list[ReplicaLoad]) -> tuple[float, float]:
        """(the fleet's prefill tokens/s, the decode step s of a replica not measured
        yet): the means over the measured candidates, or the configured defaults
        before any measurement (why the fleet's rate: router/POLICIES.md)."""
        return self._fallback([ld.prefill_tokens_per_s for ld in loads], [ld.decode_step_s for ld in loads])

    def _fallback(self, rates: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
        rates = [x for x in rates if x]
        steps = [x for x in steps if x]
        return (
            sum(rates) / len(rates) if rates else self.default_prefill_tokens_per_s,
            sum(steps) / len(steps) if steps else self.default_decode_step_s,
        )

    def ttfts(
        self, waits: Sequence[float], queued: Sequence[int], own: Sequence[int], interference: Sequence[float],
        fleet_rate: float,
    ) -> list[float]:
        """THE TTFT formula: for each candidate, the ``wait`` for its queue (seconds),
        the request's ``own`` uncached tokens at ``fleet_rate``, plus one decode step
        (``interference``, 0.0 where no decodes run) per engine step the ``queued``
        and own tokens span."""
        S = self.step_tokens
        return [w + o / fleet_rate + -(-(q + o) // S) * d for w, q, o, d in zip(waits, queued, own, interference)]

    @staticmethod
    def waits(queued_s: Sequence[float], unpriced: Sequence[int], fleet_rate: float) -> list[float]:
        """Seconds each candidate's queue takes: its own estimate, plus the tokens it
        leaves out at ``fleet_rate``."""
        return [s + u / fleet_rate for s, u in zip(queued_s, unpriced)]

    def adapter_waits(self, waits: Sequence[float], cold: Sequence[bool], load_s: Sequence[float]) -> list[float]:
        """``waits`` plus, where the request's adapter is ``cold``, its slot load: that
        replica's ``load_s``, or where unknown (0.0) the known ones' mean (else the default)."""
        known = [x for x in load_s if x]
        default = sum(known) / len(known) if known else self.default_adapter_load_s
        return [w + (x or default) if c else w for w, c, x in zip(waits, cold, load_s)]

    def predict_ttft(self, load: ReplicaLoad, uncached_tokens: int, peers: Sequence[ReplicaLoad] = ()) -> float:
        """Seconds until the first token of a request needing ``uncached_tokens`` of
        prefill; ``peers`` (the other candidates) supply the rates ``load`` lacks."""
        fleet_rate, default_step = self.fallback_rates([load, *peers])
        interference = (load.decode_step_s or default_step) if load.num_running else 0.0
        unpriced = load.unpriced_tokens if load.queued_prefill_s else load.queued_prefill_tokens
        wait = self.waits([load.queued_prefill_s], [unpriced], fleet_rate)
        return self.ttfts(wait, [load.queued_prefill_tokens], [uncached_tokens], [interference], fleet_rate)[0]

    def batch_limit(self, queue_lens: Sequence[int]) -> float:
        """The most requests (waiting + running + routed since the last report) a
        replica may hold and still take one more: the candidates' mean count times
        ``batch_slack_rel``, or plus ``batch_slack_abs``, whichever is larger. (The
        mean, not the lightest: an empty replica joining a busy fleet would otherwise
        put every owner over the limit and draw every request, each a miss.)"""
        mean = sum(queue_lens) / len(queue_lens)
        return max(mean * self.batch_slack_rel, mean + self.batch_slack_abs)

    def _slack(self, best: float) -> float:
        """How much slower than ``best`` (the smallest admissible TTFT) a replica may
        be and still count as near it."""
        return best * (self.slack_rel - 1.0) + self.slack_abs_s

    def _per_token(self, best: float, n: int, fleet_rate: float, saturated: bool) -> float:
        """An owner's slack per cached token of an ``n``-token prompt: its share of the
        slack, plus, while every candidate has requests waiting, the prefill time each
        cached token saves the fleet."""
        slack = self._slack(best)
        return slack / n + 1.0 / fleet_rate if saturated else slack / n

    @staticmethod
    def _fastest(positions: list[int], ts: list[float], qlen: Sequence[int], key: int = 0) -> int:
        """The position with the smallest TTFT, then the shorter queue, then one of
        those still tied by ``key`` (``_tie``), in C-level passes."""
        sub = list(map(ts.__getitem__, positions))
        m = min(sub)
        if sub.count(m) == 1:
            return positions[sub.index(m)]
        return _tie(list(compress(positions, map(eq, sub, repeat(m)))), qlen, key)

    # ------------------------------------------------------------------ choice
    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        table = request.table if request.table is not None else CandidateTable.from_view(request, view)
        key = request.block_hashes[0] if request.block_hashes else request.num_tokens
        slots = None
        if self.scarcity and request.lora_name is not None and table.adapter_cold is not None and any(table.adapter_cold):
            loads = [view.load(r) for r in request.candidates]
            slots = slot_price(request.lora_name, [ld.resident_loras for ld in loads], [ld.max_loras for ld in loads],
                               self.demand, self.adapter_hysteresis, self.adapter_copies)  # fmt: skip
        return self.choose_from(table, request.num_tokens, view.block_size, len(request.block_hashes), key, slots)

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        if self.scarcity:
            self.demand.observe(request.lora_name)
        if self.eviction:
            c = decision.expected_cached_tokens
            self.reuse.observe(c, request.num_tokens - c)
        if self.live is not None:
            self.live.observe(decision.replica_id, request.block_hashes[0] if request.block_hashes else None)

    def on_replica_removed(self, replica_id: ReplicaId) -> None:
        if self.live is not None:
            self.live.forget(replica_id)

    def choose_from(
        self, table: CandidateTable, num_tokens: int, block_size: int, num_blocks: int = 0, key: int = 0,
        slots: Sequence[float] | None = None,
    ) -> RouteDecision:
        """The decision for a request of ``num_tokens`` tokens over ``table``: estimate
        the owners, settle a clear owner at once, else compute every TTFT, filter the
        admissible, pick an owner within its slack, else place the request (``key``
        breaks exact ties: ``_tie``; ``slots``: each candidate's adapter slot price,
        ``adapter_sets.slot_price``, and only the cheapest stay)."""
        n = num_tokens
        est = self._estimate(table, n, block_size)
        qlen = table.queue_len
        saturated = self.saturated_stick and min(table.backlog) > 0
        blimit = self.batch_limit(qlen)
        cap = table.max_requests
        full = cap and max(qlen) >= cap > min(qlen)  # some candidate would pass the request on by queue length
        if full:
            blimit = min(blimit, cap - 1)
            slots = None if slots is None else [inf if q >= cap else c for q, c in zip(qlen, slots)]
        over = max(qlen) > blimit
        least = min(table.free_blocks)
        kv_short = least < inf and least * block_size - max(table.queued) < n  # someone may lack KV room
        top = est.top
        blocked = table.adapter_blocked if table.adapter_blocked is not None and any(table.adapter_blocked) else None
        cheap = None if slots is None else cheapest(slots)
        pulls = self.pulls if self.pulls is not None and est.longest and table.pull is not None else None
        if (top >= 0 and self._shortcut and not kv_short and not (over and qlen[top] > blimit)
                and not (blocked and blocked[top]) and (cheap is None or cheap[top])):  # fmt: skip
            pull_lb = inf if pulls is None else pulls.lower_bound(table, est.waits, n, block_size, est.fleet_rate)
            if self._clear_owner(est, n, saturated, pull_lb):
                return RouteDecision(table.candidates[top], est.held.get(top, est.longest), "prefix")
        figures = None if pulls is None else pulls.possible(table)
        own = [n] * len(qlen)
        for i, c in est.cached.items():
            own[i] -= c
        ts = self.ttfts(est.waits, table.queued, own, est.interference, est.fleet_rate)
        crowded = None if figures is None else pulls.crowded(table, figures, n, block_size)  # type: ignore[union-attr]
        offers = {} if figures is None else pulls.offers(  # type: ignore[union-attr]
            table, figures, n, block_size, est.waits, est.interference, est.fleet_rate, self.step_tokens, ts, crowded)
        for i, offer in offers.items():  # a pull beats recomputing there: its TTFT
            ts[i] = offer.ttft
        if (self.eviction and table.room is not None and est.longest and self.reuse.value > 0
                and est.cached.get(ts.index(min(ts)), 0) < est.longest):  # fmt: skip
            # a copy evicts as much as it computes (priced only where an owner is not the fastest already)
            rooms = table.room(range(len(own)))
            evict = eviction_seconds(own, table.queued, rooms, block_size, self.reuse.value, est.fleet_rate)
            ts = [t + e for t, e in zip(ts, evict)]
        ok = [x <= blimit for x in qlen] if over else None
        if crowded is not None:  # short of KV beside its running answers: passed over, pull or recompute
            roomy = [not c for c in crowded] if ok is None else [a and not c for a, c in zip(ok, crowded)]
            ok = roomy if any(roomy) else ok
        if kv_short:  # (a restore needs device blocks as a recompute does: only device hits spare them)
            ok, kv_waits = kv_admissible(table, {**est.cached, **est.on_device}, n, block_size, saturated, ok)
            if kv_waits is not None:  # short of blocks until a running request ends there: its wait
                ts = [t + w for t, w in zip(ts, kv_waits)]
        if blocked is not None:  # no free adapter slot: the request would wait for running ones to finish
            free = [not b for b in blocked] if ok is None else [a and not b for a, b in zip(ok, blocked)]
            ok = free if any(free) else ok
        if cheap is not None:  # a slot taken from an adapter still in use: the cheapest slots win over load
            both = cheap if ok is None else [a and b for a, b in zip(ok, cheap)]
            ok = both if any(both) else cheap
        best = min(ts) if ok is None else min(compress(ts, ok))
        pick = self._eligible_owner(est, ts, ok, best, n, saturated, qlen)
        if pick < 0:
            pick = self._place(table, est, ts, ok, best, num_blocks, key, slots)
        offer = offers.get(pick)
        if offer is not None:
            return RouteDecision(table.candidates[pick], offer.cached, "pull", pull_from=table.candidates[offer.source],
                                 pull_tokens=offer.blocks_from * block_size)  # fmt: skip
        c = est.cached.get(pick, 0)
        return RouteDecision(table.candidates[pick], est.held.get(pick, c), _reason(c, est.longest))

    def _estimate(self, table: CandidateTable, n: int, block_size: int) -> "_Estimate":
        """The fleet's prefill rate, each candidate's decode interference, and the
        owners' cached tokens and TTFTs."""
        if table.measured:
            fleet_rate = sum(table.rate) / len(table.rate)
            interference = table.interference
        else:  # an unmeasured replica borrows its peers' mean decode step
            fleet_rate, default_step = self._fallback(table.rate, table.decode_step)
            interference = [(d or default_step) if b else 0.0 for d, b in zip(table.decode_step, table.running)]
        waits = self.waits(table.queued_s, table.unpriced, fleet_rate)
        if table.adapter_cold is not None:
            waits = self.adapter_waits(waits, table.adapter_cold, table.adapter_load_s)
        est = _Estimate(fleet_rate, interference, waits)
        depth, host = table.depth, table.host_depth
        held = depth if host is None else [d + h for d, h in zip(depth, host)]
        if any(held):
            cap = max(n - 1, 0)
            cached = est.cached
            for i in compress(range(len(held)), held):
                c = min(held[i] * block_size, cap)
                if host is not None and host[i]:  # a host-tier token costs its copy, at the prefill rate's scale
                    est.held[i] = c
                    est.on_device[i] = min(depth[i] * block_size, cap)
                    restored = c - est.on_device[i]
                    c -= round(restored * fleet_rate / (table.host_rate[i] or HOST_RATE_DEFAULT * fleet_rate))
                cached[i] = c
            if self.survival and table.room is not None:
                survive(table, cached, n, block_size)
            for i, c in cached.items():
                if c > est.longest:
                    est.longest, est.top = c, i
                elif c == est.longest:
                    est.top = -1
            owners = list(cached)
            waits, queued = [est.waits[i] for i in owners], [table.queued[i] for i in owners]
            own = self.ttfts(waits, queued, [n - cached[i] for i in owners], [interference[i] for i in owners], fleet_rate)
            est.own_ts = dict(zip(owners, own))
        return est

    def _clear_owner(self, est: "_Estimate", n: int, saturated: bool, pull_lb: float = inf) -> bool:
        """Whether the one owner with the longest prefix (admissible, nobody KV-short)
        is eligible, without the other candidates' TTFTs: ``lb`` (the shortest wait's
        uncached TTFT without interference, or an owner's) bounds the best admissible
        TTFT from below, and the slack grows with the best, so an owner within the
        slack of ``lb`` is within the slack of the best, and the unique longest
        eligible owner wins the full pass too. ``pull_lb`` bounds a pull's TTFT likewise."""
        lb = min(min(est.waits) + n / est.fleet_rate, min(est.own_ts.values()), pull_lb)
        return est.own_ts[est.top] <= lb + self._per_token(lb, n, est.fleet_rate, saturated) * est.longest

    def _eligible_owner(
        self, est: "_Estimate", ts: list[float], ok: list[bool] | None, best: float, n: int, saturated: bool,
        qlen: Sequence[int],
    ) -> int:
        """The admissible owner within its share of the slack with the longest prefix
        (then the smaller TTFT, the shorter queue, the first); -1 if none."""
        cached = est.cached
        if not cached:
            return -1
        per_token = self._per_token(best, n, est.fleet_rate, saturated)
        owners = [i for i in cached if ts[i] <= best + per_token * cached[i] and (ok is None or ok[i])]
        if len(owners) == 1:
            return owners[0]
        if owners:
            return min(owners, key=lambda i: (-cached[i], ts[i], qlen[i], i))
        return -1

    def _place(
        self, table: CandidateTable, est: "_Estimate", ts: list[float], ok: list[bool] | None, best: float,
        num_blocks: int, key: int, slots: Sequence[float] | None = None,
    ) -> int:
        """No owner eligible: a new prefix goes to the roomiest cache among the
        admissible near-best (those with the request's adapter resident first, if any),
        then, where even that cache must evict to hold it, the one serving the fewest
        live prefixes (``live_prefixes.py``), then the fastest; anything else to the
        fastest admissible replica (then the shorter queue, the first)."""
        qlen = table.queue_len
        if not est.longest and table.room is not None:
            near = map(le, ts, repeat(best + self._slack(best)))
            eligible = list(compress(range(len(ts)), near if ok is None else map(and_, near, ok)))
            cold = table.adapter_cold
            if cold is not None and len(eligible) > 1:  # a slot load evicts another adapter: avoid it when near-equal
                eligible = [i for i in eligible if not cold[i]] or eligible
                if slots is not None and cold[eligible[0]]:  # no copy near-best: the least live demand resident
                    low = min(slots[i] for i in eligible)
                    eligible = [i for i in eligible if slots[i] == low]
            evicts = True
            if len(eligible) > 1:
                rooms = table.room(eligible)
                evicts = max(rooms) < num_blocks  # even the roomiest cache evicts something to hold the request
                high = max(rooms) - self.fill_slack * num_blocks
                eligible = list(compress(eligible, map(ge, rooms, repeat(high))))
            if self.live is not None and evicts and len(eligible) > 1:  # then the fewest prefixes in use
                live = [self.live.count(table.candidates[i]) for i in eligible]
                eligible = list(compress(eligible, map(eq, live, repeat(min(live)))))
            return self._fastest(eligible, ts, qlen, key)
        if ts.count(best) == 1:  # the usual case: one fastest replica
            return ts.index(best)
        return _tie([i for i, t in enumerate(ts) if t == best and (ok is None or ok[i])], qlen, key)


def _tie(tied: list[int], qlen: Sequence[int], key: int) -> int:
    """Of positions tied on TTFT: one of the shortest queues, picked by ``key`` (the
    request's first block hash). Several routers whose views agree but lag each other
    would all take the first of a tie (every idle replica, say) and pile onto it; by
    the key they spread different prefixes over the tie, and agree, unseen, on where
    one new prefix goes (figures: benchmarks/RESULTS.md)."""
    if len(tied) > 1:
        short = min(map(qlen.__getitem__, tied))
        tied = [i for i in tied if qlen[i] == short]
    return tied[key % len(tied)]


class _Estimate:
    """What ``_estimate`` finds for one request: each candidate's queue ``waits``
    (seconds); ``cached`` and ``own_ts`` by owner position; ``top``, the one owner with the longest prefix (-1: none, or shared).
    An owner whose prefix reaches into its host tier has ``cached`` less the copy's
    price, in ``held`` the tokens it will actually report cached, and in
    ``on_device`` those its device cache holds."""

    __slots__ = ("fleet_rate", "interference", "waits", "cached", "own_ts", "longest", "top", "held", "on_device")

    def __init__(self, fleet_rate: float, interference: Sequence[float], waits: list[float]) -> None:
        self.fleet_rate = fleet_rate
        self.interference = interference
        self.waits = waits
        self.cached: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.on_device: dict[int, int] = {}
        self.own_ts: dict[int, float] = {}
        self.longest = 0
        self.top = -1


def _reason(cached: int, longest: int) -> str:
    if not longest:
        return "cold"
    if cached == longest:
        return "prefix"
    return "hot_prefix_replica" if cached == 0 else "load"
