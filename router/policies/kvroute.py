"""kvroute's own policy: the smallest predicted time to first token, sticky to owners.

Model (per candidate replica ``r``, for a request of ``n`` prompt tokens)::

    cached_r   = min(matched_blocks_r × block_size, n − 1)      # the last token is always computed
    work_r     = queued_prefill_tokens_r + (n − cached_r)        # tokens r must prefill before our first token
    prefill_r  = work_r / prefill_tokens_per_s_r
    interf_r   = ceil(work_r / step_tokens) × decode_step_s_r    if r has running decodes, else 0
    ttft_r     = prefill_r + interf_r

``queued_prefill_tokens`` and the rates come from the replica's last load report plus the
router's optimistic increments (``LoadView``). The decode-interference term charges one
decode step per engine step the prefill spans: with chunked prefill each step carries
the running decodes too, so a busy decoder stretches every chunk by about one decode
step. A replica with no measured rate yet uses the mean of its measured peers' rates, or,
before any measurement, ``default_prefill_tokens_per_s`` /
``default_decode_step_s``, so a cold cluster still routes sensibly.

Choice (hot-prefix replication without scattering): let ``best`` be the smallest
``ttft_r``. Every candidate within the slack, ``ttft_r ≤ slack_rel × best + slack_abs_s``,
is eligible; among them the one with the LONGEST cached prefix wins, then the smaller
``ttft_r``, then fewer requests in flight/queued, then candidate order. So a request
stays with a replica holding its prefix until that owner's predicted TTFT exceeds the
best alternative (which includes recomputing the prefix) by the slack; only then does a
second replica take it, and once that one holds the prefix (pending at once, then
confirmed) it competes as an owner, so the prefix spreads one replica at a time as
demand grows rather than over the whole fleet.

Reasons: ``"cold"`` (no candidate holds any leading block), ``"prefix"`` (the chosen
replica holds the longest prefix of any candidate), ``"hot_prefix_replica"`` (the chosen
holds none of it while another candidate does), ``"load"`` (the chosen holds a shorter,
non-empty prefix than the best).
"""

from __future__ import annotations

from typing import ClassVar

from kvroute.router.policy import ClusterView, Policy
from kvroute.router.types import ReplicaLoad, RouteDecision, RouteRequest


class KVRoutePolicy(Policy):
    """Smallest predicted TTFT; a longer cached prefix wins within ``slack`` of the best."""

    name: ClassVar[str] = "kvroute"

    def __init__(
        self,
        *,
        default_prefill_tokens_per_s: float = 10_000.0,
        default_decode_step_s: float = 0.02,
        step_tokens: int = 2048,
        slack_rel: float = 1.2,
        slack_abs_s: float = 0.01,
        fill_slack: float = 0.05,
    ) -> None:
        if default_prefill_tokens_per_s <= 0:
            raise ValueError(f"default_prefill_tokens_per_s must be positive, got {default_prefill_tokens_per_s!r}")
        if default_decode_step_s < 0:
            raise ValueError(f"default_decode_step_s must be >= 0, got {default_decode_step_s!r}")
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be positive, got {step_tokens!r}")
        if slack_rel < 1.0 or slack_abs_s < 0:
            raise ValueError(f"need slack_rel >= 1 and slack_abs_s >= 0, got {slack_rel!r}, {slack_abs_s!r}")
        self.default_prefill_tokens_per_s = float(default_prefill_tokens_per_s)
        self.default_decode_step_s = float(default_decode_step_s)
        self.step_tokens = int(step_tokens)
        self.slack_rel = float(slack_rel)
        self.slack_abs_s = float(slack_abs_s)
        if not 0 <= fill_slack <= 1:
            raise ValueError(f"fill_slack must be in [0, 1], got {fill_slack!r}")
        self.fill_slack = float(fill_slack)

    def fallback_rates(self, loads: list[ReplicaLoad]) -> tuple[float, float]:
        """(prefill tokens/s, decode step s) assumed for a replica not measured yet: the
        mean of its measured peers (fleets are homogeneous), or the configured defaults
        before any measurement."""
        rates = [ld.prefill_tokens_per_s for ld in loads if ld.prefill_tokens_per_s]
        steps = [ld.decode_step_s for ld in loads if ld.decode_step_s]
        return (
            sum(rates) / len(rates) if rates else self.default_prefill_tokens_per_s,
            sum(steps) / len(steps) if steps else self.default_decode_step_s,
        )

    def predict_ttft(self, load: ReplicaLoad, uncached_tokens: int, peers: list[ReplicaLoad] = ()) -> float:
        """Seconds until the first token of a request needing ``uncached_tokens`` of
        prefill; ``peers`` (the other candidates) supply the rates ``load`` lacks."""
        default_rate, default_step = self.fallback_rates([load, *peers])
        work = load.queued_prefill_tokens + uncached_tokens
        t = work / (load.prefill_tokens_per_s or default_rate)
        if load.num_running:
            steps = -(-work // self.step_tokens)
            t += steps * (load.decode_step_s or default_step)
        return t

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        cands = request.candidates
        matched = view.prefix_match(request.block_hashes, cands)
        load_of = view.load
        bs = view.block_size
        n = request.num_tokens
        cap = max(n - 1, 0)
        loads = [load_of(r) for r in cands]
        default_rate, default_step = self.fallback_rates(loads)
        step_tokens = self.step_tokens
        rows = []
        best = float("inf")
        longest = 0
        for i, load in enumerate(loads):  # predict_ttft, inlined: this loop is the request path
            r = cands[i]
            cached = matched[r] * bs
            if cached > cap:
                cached = cap
            work = load.queued_prefill_tokens + n - cached
            t = work / (load.prefill_tokens_per_s or default_rate)
            if load.num_running:
                t += -(-work // step_tokens) * (load.decode_step_s or default_step)
            rows.append((cached, t, i, load))
            if t < best:
                best = t
            if cached > longest:
                longest = cached
        limit = best * self.slack_rel + self.slack_abs_s
        pick = None
        eligible = [row for row in rows if row[1] <= limit]
        if longest == 0 and len(eligible) > 1:
            # A new prefix: TTFTs are near-ties, so place it where the cache has the
            # most room left, so it is not evicted before its group comes back.
            fill = getattr(view, "cache_fill", None)
            if fill is not None:
                low = min(fill(cands[row[2]]) for row in eligible)
                eligible = [row for row in eligible if fill(cands[row[2]]) <= low + self.fill_slack]
        for row in eligible:
            if pick is None or self._better(row, pick):
                pick = row
        assert pick is not None
        cached, _, i, _ = pick
        if longest == 0:
            reason = "cold"
        elif cached == longest:
            reason = "prefix"
        elif cached == 0:
            reason = "hot_prefix_replica"
        else:
            reason = "load"
        return RouteDecision(cands[i], cached, reason)

    @staticmethod
    def _better(a: tuple, b: tuple) -> bool:
        """Longer cached prefix, then smaller TTFT, then fewer queued/in flight, then order."""
        if a[0] != b[0]:
            return a[0] > b[0]
        if a[1] != b[1]:
            return a[1] < b[1]
        qa, qb = a[3].queue_len, b[3].queue_len
        if qa != qb:
            return qa < qb
        return a[2] < b[2]
