"""KV pulls in the simulator (``SimConfig(pulls=True)``), as the Serve application does
them (``cluster/route_pull.py``): a decision naming ``pull_from`` holds the request at
its replica while the prefix moves, then queues it there, where it hits the prefix.

Each replica reports the profile's pull figures (``StepProfile.pull_time``: setup +
bytes over the device-to-device or through-the-host bandwidth), as an emulated Serve
replica does, so the router prices pulls against recompute and wait. At the decision
the source's leading run of the request's blocks (up to ``pull_tokens``) is taken as
the export's lease takes it; after the profile's time for the blocks the destination
lacks, those are registered there as an import commits them (fresh blocks, parent
first, released tail first: cached blocks the request then hits), as many as its free
blocks allow. A source holding none of it is a fallback: the request is queued at once
and recomputes.

A joining replica's warm-up (``SimConfig.warmup_prefixes``, as ``cluster/fleet_moves.py``
does it): the router's warm-up plan is pulled one prefix after another over the
replica's link (``warm_up``), and the routers add it once the last one is cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvroute.benchmarks.sim.replica import SimReplica
from kvroute.replica.block_hash import BlockHash


def report_pulls(rep: SimReplica) -> None:
    """Have ``rep`` report its profile's pull figures with its load, as an emulated
    Serve replica does (the router then prices pulls into it)."""
    cost = rep.cost
    rep.telemetry.pull_state = lambda: (cost.kv_bytes_per_token, cost.pull_bytes_per_s(), cost.pull_setup_s)


@dataclass
class PullStats:
    pulls: int = 0
    pulled_tokens: int = 0
    pulled_bytes: int = 0
    seconds: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"pulls": self.pulls, "pulled_tokens": self.pulled_tokens, "pulled_bytes": self.pulled_bytes,
                "pull_s": round(self.seconds, 6), "fallbacks": dict(self.fallbacks)}  # fmt: skip


@dataclass(frozen=True)
class Lease:
    """The source's run as exported: each block's hash, tokens, parent, salt and adapter."""

    blocks: tuple[tuple[BlockHash, tuple[int, ...], BlockHash | None, str | None, str | None], ...]


def lease(src: SimReplica, hashes: list[BlockHash], max_blocks: int) -> Lease:
    """The leading run of ``hashes`` (at most ``max_blocks``) ``src`` caches now."""
    pool, run = src.kv.pool, []
    for h in hashes[:max_blocks]:
        b = pool.cached_block(h)
        if b is None:
            break
        run.append((h, b.token_ids, b.parent_hash, b.salt, b.lora_name))
    return Lease(tuple(run))


def warm_up(router: Any, dst: SimReplica, replicas: dict[str, SimReplica], k: int, block_size: int) -> float:
    """Cache at ``dst`` the ``k`` hot prefixes ``router`` plans for it; the seconds the
    pulls take (the profile's time for the blocks it lacked)."""
    seconds = 0.0
    for hashes, holder in router.warmup_plan(dst.replica_id, k, max(1, dst.kv.pool.num_free_blocks // 2)):
        run = lease(replicas[holder], hashes, len(hashes))
        seconds += dst.cost.pull_time(missing(dst, run) * block_size * dst.cost.kv_bytes_per_token)
        commit(dst, run)
    return seconds


def joined_window(done: list, joined: set[str], since: float, window_s: float = 60.0) -> dict[str, Any]:
    """The scale-out figures over the requests that arrive within ``window_s`` from
    ``since`` (the join): the joined replicas' hit rate (cached / prompt tokens), the
    fleet's, and the joined replicas' share of those requests."""
    window = [s for s in done if since <= s.arrival_s < since + window_s]
    mine = [s for s in window if s.replica_id in joined]

    def hit(sims: list) -> float | None:
        prompt = sum(s.spec.num_prompt_tokens for s in sims)
        return sum(max(s.request.num_cached_tokens, 0) for s in sims) / prompt if prompt else None

    return {"hit_rate": hit(mine), "fleet_hit_rate": hit(window), "share": len(mine) / len(window) if window else None}


def missing(dst: SimReplica, lease: Lease) -> int:
    """Blocks of ``lease`` that ``dst`` does not cache (what the pull moves)."""
    pool = dst.kv.pool
    return sum(1 for h, *_ in lease.blocks if pool.cached_block(h) is None)


def commit(dst: SimReplica, lease: Lease) -> int:
    """Register the leased run at ``dst``: its leading blocks already cached there are
    kept, each other one takes a fresh block while free blocks last. Returns the run's
    blocks ``dst`` caches now."""
    pool, chain = dst.kv.pool, []
    for h, tokens, parent, salt, lora in lease.blocks:
        block = pool.cached_block(h)
        if block is not None and block.token_ids == tokens:
            pool.touch([block])  # referenced while the run is built: no take below evicts it
        elif block is None and pool.num_free_blocks:
            (block,) = pool.take_new_blocks(1)  # type: ignore[misc]
            pool.cache_block(block, h, tokens, parent, salt, lora)
        else:
            break
        chain.append(block)
    pool.free(reversed(chain))  # tail first, as a finished request releases its blocks
    return len(chain)
