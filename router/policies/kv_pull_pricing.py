"""Pricing a pull: move a cached prefix to a replica instead of recomputing it there.

The exact directory knows every replica holding every block, so a request has three
ways to get its prefix: wait at a replica that holds it, recompute it on another, or
have another replica pull the prefix's KV from a holder and compute only the rest. The
kvroute policy prices the first two already (its TTFT per candidate); this module
prices the third, per candidate ``r`` of a request of ``n`` prompt tokens, where ``D``
is the most leading blocks any candidate has confirmed on its device (a pending run is
still being filled, and host-tier blocks are not exported) and ``d_r`` what ``r`` holds
or will hold (pending included)::

    source_r  = the least loaded holder of D blocks (shortest queue, then wait, then order)
    cached'_r = min(D × block_size, n − 1)
    pull_s_r  = setup_r + (D − d_r) × block_size × kv_bytes_per_token / bandwidth_r
    ttft'_r   = max(wait_r, pull_s_r) + (n − cached'_r) / fleet_rate
                + ceil((queued_r + n − cached'_r) / step_tokens) × interference_r

The pull and the queue overlap: the replica pulls first and queues the request once
the prefix is cached, while its queue drains. With ``kv_room`` a candidate pulls only
where the copy and the request fit beside its running answers (``copy_room``: free KV
less its queued prefills less what those answers still decode); else the copied blocks
would take the KV its running answers need next, and the engine preempts one. Such a
candidate is ``crowded``: recomputing there would take the same blocks, so the policy
passes it over for the recompute too while another candidate is admissible. ``r``
takes the pull where ``ttft'_r`` is below its recompute TTFT; the policy then compares
that TTFT with every other candidate's, so a busy owner keeps the request only while
waiting there beats a pull elsewhere (within the owner's slack: ``router/POLICIES.md``).

Bandwidth and setup are what the replicas report (``LoadFigures.pull_bytes_per_s``,
measured from their pulls or their emulation profile's; ``pull_setup_s``): a candidate
that has not measured borrows the mean of those that have, else the defaults. Only
replicas whose host acts on a pull report ``kv_bytes_per_token``; a candidate or
source reporting 0 (an external worker, a simulator without transfers) never pulls,
and a pair reporting different sizes (another model) never exchanges KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvroute.router.types import CandidateTable

Figures = tuple[Sequence[int], Sequence[float], Sequence[float], Sequence[int]]  # CandidateTable.pull()

DEFAULT_PULL_BYTES_PER_S = 1e9  # through Ray's object store on a 2-core CPU box: 1.08 GB/s measured
DEFAULT_PULL_SETUP_S = 0.01
# ``copy_room`` counts the running answers' estimated growth this many times: the estimate
# scales the one answer nearest its end, and the candidates it lets through are those where
# that answer reads low (at the simulated B2B pulls: a median 0.42-0.53 of the true growth)
GROWTH_MARGIN = 2.0


@dataclass(frozen=True, slots=True)
class PullOffer:
    """Candidate position ``source`` can fill another candidate's cache with the
    request's first ``blocks_from`` blocks (``blocks`` of them moved, ``cached`` tokens
    then cached for the request) in ``seconds``; the first token there is then
    ``ttft`` seconds away."""

    source: int
    cached: int
    blocks: int
    seconds: float
    ttft: float
    blocks_from: int


class PullPricing:
    """The pull option of each candidate (``offers``), and a lower bound on any
    candidate's TTFT with a pull (``lower_bound``) for the policy's owner shortcut."""

    def __init__(self, default_bytes_per_s: float = DEFAULT_PULL_BYTES_PER_S,
                 default_setup_s: float = DEFAULT_PULL_SETUP_S, kv_room: bool = False) -> None:  # fmt: skip
        if default_bytes_per_s <= 0 or default_setup_s < 0:
            raise ValueError(f"need default_pull_bytes_per_s > 0 and default_pull_setup_s >= 0, got "
                             f"{default_bytes_per_s!r}, {default_setup_s!r}")  # fmt: skip
        self.default_bytes_per_s = float(default_bytes_per_s)
        self.default_setup_s = float(default_setup_s)
        self.kv_room = bool(kv_room)  # pull only where the copy fits beside the running answers

    @staticmethod
    def possible(table: CandidateTable) -> Figures | None:
        """The candidates' pull figures when some candidate short of the deepest
        confirmed match could pull it from one holding it (both reporting the same KV
        size)."""
        if table.pull is None or not max(table.depth, default=0):
            return None
        figures = table.pull()
        sizes, confirmed = figures[0], figures[3]
        top = max(confirmed)
        held = {sizes[i] for i, d in enumerate(confirmed) if d == top and sizes[i]} if top else ()
        if any(sizes[i] in held for i, d in enumerate(table.depth) if d < top):
            return figures
        return None

    def lower_bound(self, table: CandidateTable, waits: Sequence[float], n: int, block_size: int,
                    fleet_rate: float) -> float:  # fmt: skip
        """No candidate's TTFT with a pull is below this: the shortest wait plus the
        prefill of what the deepest match (pending included) leaves (the pull's own
        time left out)."""
        cached = min(max(table.depth) * block_size, max(n - 1, 0))
        return min(waits) + (n - cached) / fleet_rate

    def offers(
        self, table: CandidateTable, figures: Figures, n: int,
        block_size: int, waits: Sequence[float], interference: Sequence[float], fleet_rate: float, step_tokens: int,
        recompute: Sequence[float], crowded: Sequence[bool] | None = None,
    ) -> dict[int, PullOffer]:
        """Each candidate's pull where it beats its ``recompute`` TTFT, by position; none
        for a ``crowded`` candidate (``crowded``'s answer, taken once per decision)."""
        sizes, rates, setups, confirmed = figures
        depth, qlen, queued = table.depth, table.queue_len, table.queued
        top = max(confirmed)
        holders = [i for i, d in enumerate(confirmed) if d == top and sizes[i]]
        measured = [x for x in rates if x]
        rate_default = sum(measured) / len(measured) if measured else self.default_bytes_per_s
        timed = [x for x in setups if x]
        setup_default = sum(timed) / len(timed) if timed else self.default_setup_s
        cached = min(top * block_size, max(n - 1, 0))
        own = n - cached
        out: dict[int, PullOffer] = {}
        for i, d in enumerate(depth):
            if d >= top or not sizes[i]:
                continue
            if crowded is not None and crowded[i]:  # takes its running answers' KV
                continue
            sources = [h for h in holders if sizes[h] == sizes[i]]
            if not sources:
                continue
            src = min(sources, key=lambda h: (qlen[h], waits[h], h))
            blocks = top - d
            seconds = (setups[i] or setup_default) + blocks * block_size * sizes[i] / (rates[i] or rate_default)
            ttft = (max(waits[i], seconds) + own / fleet_rate
                    + -(-(queued[i] + own) // step_tokens) * interference[i])  # fmt: skip
            if ttft < recompute[i]:
                out[i] = PullOffer(src, cached, blocks, seconds, ttft, top)
        return out

    def crowded(self, table: CandidateTable, figures: Figures, n: int, block_size: int) -> list[bool] | None:
        """With ``kv_room``: the candidates to pass over, pull and recompute alike, while
        another may take the request (a holder always may: it needs only the rest). The
        request's prompt there (the copy and the rest, or all of it recomputed: the same
        blocks) does not fit beside their running answers' growth. None where no
        candidate is short."""
        if not self.kv_room:
            return None
        short = self._short(table, figures, n, block_size)
        return short if any(short) else None

    @staticmethod
    def _short(table: CandidateTable, figures: Figures, n: int, block_size: int) -> list[bool]:
        """Per candidate: one that could pull (short of the deepest confirmed match,
        reporting a KV size) whose ``copy_room`` does not hold the copy and the rest."""
        sizes, top = figures[0], max(figures[3])
        own = n - min(top * block_size, max(n - 1, 0))
        room = copy_room(table, block_size)
        return [d < top and bool(sizes[i]) and room[i] < (top - d) * block_size + own for i, d in enumerate(table.depth)]


def copy_room(table: CandidateTable, block_size: int) -> list[float]:
    """Per candidate: the tokens of KV a copy may take there without pushing out a running
    answer. Its free blocks (as it reports them: the cached blocks its waiting
    requests will hit, a pulled prefix among them, are not free), less its queued
    prefills, less what its ``r`` running answers still decode: the one nearest its end
    has ``left = release_s / decode_step`` tokens to go, and with ``r`` answers spread
    evenly over their length the mean one has ``(r + 1) / 2`` times that, so they grow
    by ``r (r + 1) / 2 × left`` tokens, counted ``GROWTH_MARGIN`` times."""
    n = len(table.free_blocks)
    release_s = table.release()[0] if table.release is not None else [0.0] * n
    out = []
    for f, q, r, step, rs in zip(table.free_blocks, table.queued, table.running, table.decode_step, release_s):
        grow = GROWTH_MARGIN * r * (r + 1) / 2 * rs / step if r and step and rs else 0.0
        out.append(f * block_size - q - grow)
    return out
