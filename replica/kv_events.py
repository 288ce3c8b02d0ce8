"""KV events: what a replica tells the router after each step (stdlib only).

The router may import this module as well as ``block_hash`` (both are torch-free): it is
the wire contract between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.replica.block_hash import BlockHash


@dataclass(frozen=True)
class LoadFigures:
    """A replica's load as of the end of a step.

    ``route_ticket``: the highest router ticket (``RouteDecision.ticket``, carried on the
    request) among the requests this replica had accepted when the figures were taken,
    0 before any. The router keeps its optimistic increments for the requests it routed
    here with a later ticket (still in transit, or waiting for the step in flight to
    end) and drops the rest, which these figures already count.

    ``kv_usage``: the share of its KV blocks taken: held by its requests, or cached
    blocks no request holds yet that a waiting request's prefix hit covers (each counted
    once), since its admission takes them out of the free queue: a prefix pulled in
    for a queued request is not free for the next prompt. What is left is free for new
    KV (cached blocks among it may be evicted for it).

    ``queued_prefill_s``: the replica's own estimate of the seconds its queued prefill
    takes, from its measured step cost (attention grows with position, so a long
    prompt's tokens cost more than a short one's); 0.0 while it has measured no step.

    ``resident_loras``: the LoRA adapters in its device slots (a request of another one
    waits for a slot load first), and ``adapter_load_s`` what such a load takes there
    (measured, or its emulation profile's; 0.0: unknown or no adapters).
    ``running_loras``: the adapters of its running requests; once they are ``max_loras``
    (its slots; 0: no adapters), a request of another adapter waits until the one with
    the fewest running requests drains (the requests behind it of running adapters go
    on).

    ``release_s`` and ``release_blocks``: when its running request nearest its
    ``max_tokens`` will have finished (remaining tokens × its decode step; 0.0: no
    running request or no step measured), and the KV blocks that frees (those no other
    request shares) less those its other running requests allocate as they decode until
    then. A request short of free blocks there waits about that long for them; an answer
    ending early at a stop token only shortens the wait.

    ``max_requests``: the most requests its serving layer hands it at once (Ray Serve's
    ``max_ongoing_requests``; 0: no cap). One holding that many is passed over for the
    replica with the shortest queue, whatever its cache or adapters hold.

    ``kv_bytes_per_token``, ``pull_bytes_per_s`` and ``pull_setup_s``: what pulling a
    cached prefix from another replica into this one costs (its KV bytes per token, the
    bandwidth it measured or its emulation profile models, and the fixed part of a
    pull), reported only by a host that acts on a router's pull (0: it does not; a
    router then never asks it to pull)."""

    num_waiting: int = 0
    num_running: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_s: float = 0.0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    route_ticket: int = 0
    host_restore_tokens_per_s: float = 0.0  # measured host -> device KV copy rate (0: no host tier or not yet)
    resident_loras: tuple[str, ...] = ()
    adapter_load_s: float = 0.0
    running_loras: tuple[str, ...] = ()
    max_loras: int = 0
    release_s: float = 0.0
    release_blocks: int = 0
    max_requests: int = 0
    kv_bytes_per_token: int = 0
    pull_bytes_per_s: float = 0.0
    pull_setup_s: float = 0.0


@dataclass(frozen=True)
class KVEvents:
    """Net cache changes of one step. ``seq`` grows by one per published batch.

    ``stored`` and ``removed`` are disjoint: a hash stored and evicted within the same
    batch (or the reverse) cancels out, so applying ``cleared`` first, then ``removed``,
    then ``stored`` in any order reproduces the replica's cache exactly. The same holds
    for the host tier's ``host_stored``/``host_removed`` (``cleared`` empties both
    tiers). A block may be in both tiers at once (the host tier is inclusive).
    """

    replica_id: str
    seq: int
    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    cleared: bool = False
    load: LoadFigures | None = None
    host_stored: list[BlockHash] = field(default_factory=list)
    host_removed: list[BlockHash] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.stored or self.removed or self.cleared or self.host_stored or self.host_removed)


class PendingEvents:
    """One cache's hash changes since they were last taken, netted: a store and a
    removal of the same hash in between cancel out, so the stored and removed lists
    taken are disjoint. ``clear`` records that the whole cache was emptied (changes
    before it no longer matter)."""

    def __init__(self) -> None:
        self._net: dict[BlockHash, bool] = {}  # hash -> True stored, False removed
        self._cleared = False

    def note(self, block_hash: BlockHash, stored: bool) -> None:
        if self._net.get(block_hash) is (not stored):
            del self._net[block_hash]
        else:
            self._net[block_hash] = stored

    def clear(self) -> None:
        self._net.clear()
        self._cleared = True

    def take(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(stored, removed, cleared) since the last call."""
        stored = [h for h, s in self._net.items() if s]
        removed = [h for h, s in self._net.items() if not s]
        cleared, self._net, self._cleared = self._cleared, {}, False
        return stored, removed, cleared
