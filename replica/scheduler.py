"""Continuous-batching scheduler: one mixed batch of prefill chunks and decodes per step.

Rules (ARCHITECTURE.md §4): admission counts cached blocks (host-tier hits too: they
are restored by a copy before the step, not recomputed); the token budget and
``max_num_seqs`` are charged only for tokens that will be computed; only the blocks a
step's chunk needs are allocated; a non-final prefill chunk ends on a page boundary
(page-aligned prefill); the last prompt token is always computed; under KV pressure the
newest running request is preempted (recompute) and later resumes from its cache hits.

A step's time is bounded as well as its tokens: while more than one request is running
or waiting, ``step_target_s`` (less the step overhead and the decodes, down to half of
it) is a pool of seconds the rows with prompt left take shortest remaining prompt first,
each prefill chunk cut to what its seconds buy at the measured cost
(``replica/step_cost.py``), one block at least, so a short prompt is prefilled in the
next step and a long one still advances. A lone prompt's chunk may take ``LONE_STEPS``
targets: a request arriving meanwhile joins only at the next step. Before any step is
measured, a chunk is at most ``PROBE_TOKENS``.

A waiting request whose structured-output grammar is still compiling is passed over
(it keeps its place; the requests behind it are admitted) until the compile is done.

With LoRA, the running requests use at most ``max_loras`` distinct adapters. A waiting
request of another adapter is passed over (it keeps its place) and the requests behind
it whose adapters are running are admitted, so one cold adapter does not hold up every
request queued behind it; but the running adapter with the fewest running requests
takes no new ones until it drains, and the passed-over request then takes its slot
(waiting requests are scanned in order).
"""

from __future__ import annotations

from collections import deque
import itertools
from dataclasses import dataclass, field

from kvroute.replica.block_pool import Block
from kvroute.replica.kv_cache_manager import CopyPlan, HostHit, KVCacheManager
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request, RequestStatus
from kvroute.replica.step_cost import StepCostModel, attention_pairs

LONE_STEPS = 4  # a lone prompt's chunk: up to this many step targets (bigger chunks, fewer steps)
PROBE_TOKENS = 128  # a chunk's most tokens before any step is measured, when steps are time-bounded


@dataclass(frozen=True)
class ScheduledRequest:
    """One row of a step: compute tokens [num_computed, num_computed + num_new)."""

    request: Request
    num_computed: int
    num_new: int
    block_ids: tuple[int, ...]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens (a next token is due)."""
        return self.num_computed + self.num_new == self.request.num_tokens


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[RequestId] = field(default_factory=list)
    # KV copies to perform before the forward pass (host tier): offloads, then restores
    copies: CopyPlan = field(default_factory=lambda: CopyPlan([], []))
    block_size: int = 16

    @property
    def restored_tokens(self) -> int:
        return len(self.copies.restores) * self.block_size

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new for r in self.rows)

    @property
    def attention_pairs(self) -> int:
        return sum(attention_pairs(r.num_computed, r.num_computed + r.num_new) for r in self.rows)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_new for r in self.rows if r.num_computed < r.request.num_prompt_tokens)

    @property
    def empty(self) -> bool:
        return not self.rows


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    page_aligned: bool = True
    step_target_s: float | None = None  # seconds a step with other requests aims at (None: tokens only)
    max_loras: int = 0  # LoRA adapters one step may hold (0: no adapters to count)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.step_target_s is not None and not self.step_target_s > 0:
            raise ValueError(f"step_target_s must be > 0 or None, got {self.step_target_s!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.max_batch_size = 0  # largest number of rows in one step (for benchmarks)
        self.route_ticket = 0  # highest router ticket of any request added (LoadFigures.route_ticket)
        self.cost = StepCostModel()  # fed by the engine's telemetry after each step

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if request.route_ticket > self.route_ticket:
            self.route_ticket = request.route_ticket

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill_tokens(self) -> int:
        return sum(end - start for start, end in self.queued_spans())

    def queued_spans(self) -> list[tuple[int, int]]:
        """The prefill still to compute, as ``(start, end)`` positions per request
        (``queued``'s first part)."""
        return self.queued()[0]

    def queued(self) -> tuple[list[tuple[int, int]], int]:
        """(the prefill still to compute as ``(start, end)`` positions per request, the
        free blocks the waiting requests will take as cache hits), in one pass over the
        waiting requests' blocks.

        A running request has the rest of its prompt. A waiting request has the part of
        its prompt that neither the prefix cache nor a request ahead of it (running, or
        earlier in the queue) will hold by its admission: a prefix shared by queued
        requests is computed once, by the first, and counted once (a burst of one
        group's requests is one prefill and their suffixes, not a prefill each).

        The second figure counts each cached block no request holds (in the free queue)
        that a waiting request's prefix hit covers, once however many share it: a
        pulled prefix waiting for its request, or a finished request's prefix that a
        queued one continues. Admission takes them out of the free queue, so they are
        not free for anything else (``LoadFigures.kv_usage``)."""
        spans = [(r.num_computed_tokens, r.num_prompt_tokens) for r in self.running
                 if r.num_computed_tokens < r.num_prompt_tokens]  # fmt: skip
        if not self.kv.enable_caching:  # nothing is shared: every prompt is computed whole
            return spans + [(0, r.num_tokens) for r in self.waiting], 0
        bs = self.block_size
        ahead: set = set()  # hashes of the blocks a request ahead will compute
        held: set[int] = set()  # ids of the free cached blocks a waiting request hits
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                ahead.update(r.update_block_hashes()[r.num_computed_tokens // bs : r.num_prompt_tokens // bs])
        for r in self.waiting:
            hashes = r.update_block_hashes()
            hits, hit_tokens = self.kv.get_computed_blocks(r)
            held.update(b.block_id for b in hits if isinstance(b, Block) and not b.ref_cnt)
            hit = hit_tokens // bs
            last = min((r.num_tokens - 1) // bs, len(hashes))  # the last token is always computed
            while hit < last and hashes[hit] in ahead:
                hit += 1
            spans.append((hit * bs, r.num_tokens))
            ahead.update(hashes[hit:last])
        return spans, len(held)

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request wherever it is and free its blocks (idempotent)."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_size=self.block_size)
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []  # request, num_computed, num_new
        allot = self._allot()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget, req.num_computed_tokens, allot)
            if num_new == 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # preempted itself: nothing older is left to make room for
            scheduled.append((req, req.num_computed_tokens, num_new))
            budget -= num_new
            i += 1

        if not out.preempted:
            self._admit(scheduled, budget, allot)

        for req, num_computed, num_new in scheduled:
            out.rows.append(
                ScheduledRequest(req, num_computed, num_new, tuple(self.kv.block_ids(req.request_id)))
            )
        out.copies = self.kv.take_copies()
        self.max_batch_size = max(self.max_batch_size, len(out.rows))
        return out

    def _admit(self, scheduled: list[tuple[Request, int, int]], budget: int, allot: dict[int, float] | None) -> None:
        skip = 0  # requests passed over (grammar compiling, adapter waiting for a slot): they keep their place
        draining: str | None = None  # the running adapter a passed-over one waits for: it takes no new requests
        while len(self.waiting) > skip and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[skip]
            if req.constraints is not None and not req.constraints.ready:
                skip += 1
                continue
            if not self._adapter_fits(req) or (draining is not None and req.lora_name == draining):
                draining = draining or self._drain_target()
                skip += 1
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._chunk(req, remaining, budget, num_hit, allot)
            if num_new == 0:
                break
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            del self.waiting[skip]
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.num_host_cached_tokens = sum(isinstance(h, HostHit) for h in hits) * self.block_size
                self.kv.record_query(req.num_prompt_tokens, num_hit, req.num_host_cached_tokens)
            self.running.append(req)
            scheduled.append((req, num_hit, num_new))
            budget -= num_new

    def _drain_target(self) -> str:
        """The running adapter with the fewest running requests (then the first by
        name): a request passed over for a slot waits for it to drain, so it cannot be
        starved by adapters that keep taking new requests."""
        counts: dict[str, int] = {}
        for r in self.running:
            if r.lora_name is not None:
                counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
        return min(counts, key=lambda a: (counts[a], a))

    def _adapter_fits(self, req: Request) -> bool:
        """False when ``req``'s adapter would be one more than ``max_loras`` in the step."""
        if req.lora_name is None or not self.config.max_loras:
            return True
        names = {r.lora_name for r in self.running if r.lora_name is not None}
        return req.lora_name in names or len(names) < self.config.max_loras

    def _allot(self) -> dict[int, float] | None:
        """Seconds of this step each row with prompt left may spend on its chunk (by
        ``id`` of its request), or None for no bound (no target, nothing measured yet,
        or no chunking). The pool is the step target less the overhead and the
        decodes' cost (at least half the target: a machine whose overhead alone passes
        it still makes progress); the rows take it shortest remaining prompt first (the
        running ones and the waiting ones that may be admitted), so a short prompt is
        prefilled whole in the next step while a long one takes what is left (at least
        a block: ``_chunk``). A lone request's chunk may take ``LONE_STEPS`` targets."""
        target = self.config.step_target_s
        if not (target and self.cost.fitted and self.config.enable_chunked_prefill):
            return None
        if len(self.running) + len(self.waiting) < 2:
            return {id(r): LONE_STEPS * target for r in (*self.running, *self.waiting)}
        pool = target - self.cost.overhead_s
        spans: list[tuple[int, int, Request]] = []
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                spans.append((r.num_computed_tokens, r.num_tokens, r))
            else:
                pool -= self.cost.span_seconds(r.num_computed_tokens, r.num_tokens)
        room = max(self.config.max_num_seqs - len(self.running), 0)
        spans += [(r.num_computed_tokens, r.num_tokens, r) for r in itertools.islice(self.waiting, room)]
        pool = max(pool, target / 2)
        allot: dict[int, float] = {}
        for start, end, r in sorted(spans, key=lambda s: s[1] - s[0]):
            allot[id(r)] = give = min(self.cost.span_seconds(start, end), pool)
            pool -= give
        return allot

    def _chunk(self, req: Request, remaining: int, budget: int, start: int, allot: dict[int, float] | None) -> int:
        """Tokens to compute this step: all that remain if they fit the budget (and the
        row's seconds in ``allot``, when bounded), else a chunk that ends on a page
        boundary (when page-aligned), possibly 0. The time bound never cuts below one
        block, so every prompt advances."""
        if allot is not None:
            seconds = allot.get(id(req), 0.0)
            budget = min(budget, max(self.cost.tokens_within(seconds, start), self.block_size))
        elif self.config.step_target_s and not self.cost.fitted:
            budget = min(budget, PROBE_TOKENS)  # a short first step to measure, not seconds of blind prefill
        if remaining <= budget:
            return remaining
        if not self.config.enable_chunked_prefill and req.num_computed_tokens == 0:
            return 0
        num_new = budget
        if self.config.page_aligned:
            end = (start + num_new) // self.block_size * self.block_size
            num_new = max(end - start, 0)
        return num_new

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance each row's computed count once the model has run the step."""
        for row in out.rows:
            if row.request.status is RequestStatus.RUNNING:
                row.request.num_computed_tokens = row.num_computed + row.num_new
