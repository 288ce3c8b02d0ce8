"""Oracle: routes with the TRUE cache state, as an upper bound for the baselines.

Not a peer's policy: the simulator (benchmarks/sim) owns every replica's real KV cache
and hands this policy a ``true_match(replica_id, block_hashes) -> int`` callback giving
the number of leading blocks actually cached there right now. The policy then applies
the same TTFT idea as ``kvroute`` with perfect knowledge:

    predicted TTFT(r) = (queued_prefill_tokens(r) + uncached_tokens(r)) / rate(r)

where ``uncached_tokens = num_tokens - cached`` with ``cached = min(true blocks *
block_size, num_tokens - 1)`` (the last token is always computed) and ``rate`` is the
replica's measured prefill tokens/s, or ``default_prefill_tokens_per_s`` while it has
none. Smallest prediction wins; ties go to the longer true cached prefix, then the
shorter queue, then the earlier candidate. Reason ``"oracle"``;
``expected_cached_tokens`` is the true cached count, so its predicted-vs-actual error is
zero by construction. Decode interference is left out on purpose: the oracle is the
upper bound for cache hits, not a second TTFT model.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.policies.common import cached_tokens
from kvroute.router.policy import ClusterView, Policy
from kvroute.router.types import ReplicaId, RouteDecision, RouteRequest

TrueMatch = Callable[[ReplicaId, Sequence[BlockHash]], int]


class OraclePolicy(Policy):
    name: ClassVar[str] = "oracle"

    def __init__(
        self,
        true_match: TrueMatch,
        default_prefill_tokens_per_s: float = 10_000.0,
        seed: int = 0,
    ) -> None:
        if not callable(true_match):
            raise ValueError("OraclePolicy needs true_match(replica_id, block_hashes) -> int from the simulator")
        if default_prefill_tokens_per_s <= 0:
            raise ValueError(f"default_prefill_tokens_per_s must be > 0, got {default_prefill_tokens_per_s!r}")
        self._true_match = true_match
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        best: tuple[float, int, int] | None = None
        choice: tuple[ReplicaId, int] | None = None
        for r in request.candidates:
            blocks = self._true_match(r, request.block_hashes) if request.block_hashes else 0
            cached = cached_tokens(blocks, view.block_size, request.num_tokens)
            load = view.load(r)
            rate = load.prefill_tokens_per_s if load.prefill_tokens_per_s > 0 else self.default_prefill_tokens_per_s
            ttft = (load.queued_prefill_tokens + request.num_tokens - cached) / rate
            key = (ttft, -cached, load.queue_len)
            if best is None or key < best:
                best, choice = key, (r, cached)
        assert choice is not None, "candidates is never empty"
        return RouteDecision(choice[0], choice[1], "oracle")
