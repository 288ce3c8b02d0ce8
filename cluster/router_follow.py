"""Deciding in the ingress's own process: a router actor's change log, and the
follower that replays it.

Asking a router actor for each request's decision costs an actor call each way (on
the 2-core box about 2 ms of CPU across the two processes) and its round trip on the
request's path. A ``RouterFollower`` instead keeps a ``Router`` in the ingress's
process, kept equal to the actor's by replaying, in the actor's order, every change
the actor applies: registrations with their snapshots, the replicas' coalesced KV
event batches, load figures, removals, and other routers' and followers' decisions.
It decides locally (microseconds) and hands its decisions to the actor with its next
``follow`` call; the actor applies them as a peer's (pending blocks and load under
their ticket), passes them to the other router actors as its own, and logs them for
the other followers. A follower calls ``follow`` every ``FOLLOW_S`` while it decides
and every ``IDLE_FOLLOW_S`` otherwise, so the calls no longer grow with requests.

What it gives up is freshness, bounded: a replica's events reach a follower up to
``FOLLOW_S`` after they reach the actor, and two ingresses see each other's
decisions up to ``FOLLOW_S`` apart (each sees its own at once, as pending runs and
load). The log records only while a follower followed within ``FOLLOWER_TTL_S``; a
follower whose cursor the log does not cover (a new epoch: the actor restarted,
reset or changed policy; it fell more than ``LOG_OPS`` changes behind; it was away)
gets every replica's registration instead and starts over from those. A follower
that has not heard from the actor for ``STALE_S`` is not ready, and the process asks
the router actors per request again (``KVRouteRequestRouter``), with their failover
and fallbacks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import threading
import time
import uuid
from collections import Counter, deque
from typing import Any, Callable, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.router import Router
from kvroute.router.types import RouteDecision

log = logging.getLogger(__name__)

FOLLOW_S = 0.05  # a deciding follower's period
IDLE_FOLLOW_S = 0.5  # one that has not decided for BUSY_FOR_S
BUSY_FOR_S = 1.0
STALE_S = 1.0  # a follower not synced for this long is not ready
FOLLOWER_TTL_S = 10.0  # the log records while a follower followed within this
LOG_OPS = 16384

# One decision as peers receive it: replica, block hashes, prompt tokens, ticket, wall time, LoRA adapter.
PeerDecision = tuple[str, Sequence[BlockHash], int, int, float, "str | None"]
Op = tuple  # ("reg", id, capacity, host capacity, hashes, host hashes, seq, load) | ("push", KVEvents)
# | ("load", id, LoadFigures) | ("remove", id) | ("peer", source, [PeerDecision])
# What ``follow`` answers: epoch, seq, the changes since the cursor, and the
# (policy, policy kwargs, block size, registrations) to start from, or None.
Reply = tuple[str, int, list[Op], "tuple[str, dict[str, Any], int, list[tuple]] | None"]


def peer_decision(decision: RouteDecision, block_hashes: Sequence[BlockHash], num_tokens: int,
                  lora_name: str | None) -> PeerDecision:  # fmt: skip
    """``decision`` (of a request with these blocks) as the other routers apply it."""
    return decision.replica_id, list(block_hashes), num_tokens, decision.ticket, time.time(), lora_name


class ChangeLog:
    """The changes a router actor applied, numbered, while anyone follows them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_ops: int = LOG_OPS) -> None:
        self.clock = clock
        self.max_ops = max_ops
        self._followed_at = float("-inf")
        self.restart()

    def restart(self) -> None:
        """Invalidate every follower's cursor (they start over from registrations)."""
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._ops: deque[Op] = deque(maxlen=self.max_ops)

    def record(self, *op: Any) -> None:
        if self.clock() - self._followed_at < FOLLOWER_TTL_S:
            self.seq += 1
            self._ops.append(op)

    def since(self, epoch: str | None, seq: int) -> list[Op] | None:
        """The changes after ``(epoch, seq)``, or None where the log does not cover them."""
        now = self.clock()
        away = now - self._followed_at >= FOLLOWER_TTL_S  # nothing was recorded meanwhile
        self._followed_at = now
        if away:
            self.restart()
            return None
        if epoch != self.epoch or not self.seq - len(self._ops) <= seq <= self.seq:
            return None
        return list(itertools.islice(self._ops, len(self._ops) - (self.seq - seq), None))


class RouterFollower:
    """A ``Router`` replaying one router actor's changes, deciding in this process."""

    def __init__(self, follower_id: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.id = follower_id or uuid.uuid4().hex
        self.clock = clock
        self.router: Router | None = None
        self.epoch: str | None = None
        self.seq = 0
        self.synced_at = float("-inf")
        self.decided_at = float("-inf")
        self._outbox: list[PeerDecision] = []
        self._reasons: Counter[str] = Counter()
        self._routed: Counter[str] = Counter()
        self.stats = {"decisions": 0, "syncs": 0, "starts": 0, "changes": 0}
        self._lock = threading.Lock()  # Serve may run the request router on a loop of its own

    def ready(self) -> bool:
        return self.router is not None and self.clock() - self.synced_at < STALE_S

    def period(self) -> float:
        return FOLLOW_S if self.clock() - self.decided_at < BUSY_FOR_S else IDLE_FOLLOW_S

    def rank(
        self, block_hashes: Sequence[BlockHash], num_tokens: int, candidates: Sequence[str], lora_name: str | None = None
    ) -> RouteDecision | None:
        """``RouterService.rank`` here; None when not ready or no candidate is known yet
        (the router actor then answers, and counts the unregistered route)."""
        with self._lock:
            return self._rank(block_hashes, num_tokens, candidates, lora_name) if self.ready() else None

    def _rank(self, block_hashes: Sequence[BlockHash], num_tokens: int, candidates: Sequence[str],
              lora_name: str | None) -> RouteDecision | None:  # fmt: skip
        router = self.router
        known, unknown = router.directory.known(candidates)  # type: ignore[union-attr]
        if not known:
            return None
        decision = router.route(block_hashes, num_tokens, known, lora_name=lora_name)  # type: ignore[union-attr]
        self._outbox.append(peer_decision(decision, block_hashes, num_tokens, lora_name))
        self._reasons[decision.reason] += 1
        self._routed[decision.replica_id] += 1
        self.stats["decisions"] += 1
        self.decided_at = self.clock()
        random.shuffle(unknown)
        return dataclasses.replace(decision, fallbacks=[*router.fallbacks(known, decision.replica_id), *unknown])  # type: ignore[union-attr]

    def request(self) -> tuple[str, str | None, int, list[PeerDecision], tuple[dict[str, int], dict[str, int]]]:
        """``follow``'s arguments: the cursor, and the decisions (with their counts) since
        the last call, handed over."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
            counts = (dict(self._reasons), dict(self._routed))
            self._reasons.clear()
            self._routed.clear()
        return self.id, self.epoch, self.seq, outbox, counts

    def apply(self, reply: Reply) -> None:
        with self._lock:
            self._apply(reply)

    def _apply(self, reply: Reply) -> None:
        epoch, seq, ops, start = reply
        if start is not None:
            policy, policy_kwargs, block_size, registrations = start
            self.router = Router(policy, block_size, clock=self.clock, **policy_kwargs)
            self.stats["starts"] += 1
            for reg in registrations:
                self._replay(("reg", *reg))
        for op in ops:
            self._replay(op)
        self.epoch, self.seq, self.synced_at = epoch, seq, self.clock()
        self.stats["syncs"] += 1
        self.stats["changes"] += len(ops)

    def _replay(self, op: Op) -> None:
        router, kind = self.router, op[0]
        assert router is not None
        if kind == "push":
            router.apply(op[1])
        elif kind == "load":
            router.report_load(op[1], op[2])
        elif kind == "peer":
            if op[1] != self.id:  # its own decisions are in its router already
                router.note_peer_batch(op[2])
        elif kind == "reg":
            router.register_snapshot(*op[1:])
        elif kind == "remove":
            if op[1] in router.directory:
                router.remove_replica(op[1])
        else:
            raise ValueError(f"unknown change {kind!r}")


async def follow_forever(follower: RouterFollower, names: Sequence[str], namespace: str, timeout_s: float = 1.0) -> None:
    """Keep ``follower`` in step with the router actors ``names`` (the first that
    answers; the next one after a failure), until cancelled."""
    import ray

    actors: dict[str, Any] = {}
    i, last_log = 0, float("-inf")
    while True:
        await asyncio.sleep(follower.period())
        name = names[i % len(names)]
        try:
            actor = actors.get(name)
            if actor is None:
                actor = actors[name] = await asyncio.wait_for(asyncio.to_thread(ray.get_actor, name, namespace=namespace), timeout_s)
            ref = actor.follow.remote(*follower.request())
            follower.apply(await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # not started yet, restarting, dead: the next one
            actors.pop(name, None)
            i += 1
            if time.monotonic() - last_log > 10.0:
                last_log = time.monotonic()
                log.warning("router follower: router %s did not answer (%r); trying the next", name, exc)
