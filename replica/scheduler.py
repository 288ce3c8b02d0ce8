"""Continuous-batching scheduler: one mixed batch of prefill chunks and decodes per step.

Rules (ARCHITECTURE.md §4): admission counts cached blocks (host-tier hits too: they
are restored by a copy before the step, not recomputed); the token budget and
``max_num_seqs`` are charged only for tokens that will be computed; only the blocks a
step's chunk needs are allocated; a non-final prefill chunk ends on a page boundary
(page-aligned prefill); the last prompt token is always computed; under KV pressure the
newest running request is preempted (recompute) and later resumes from its cache hits.
With LoRA, the running requests use at most ``max_loras`` distinct adapters: a waiting
request of another adapter waits (in order) until one of them has no running request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvroute.replica.kv_cache_manager import CopyPlan, HostHit, KVCacheManager
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request, RequestStatus


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
    max_loras: int = 0  # LoRA adapters one step may hold (0: no adapters to count)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


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

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if request.route_ticket > self.route_ticket:
            self.route_ticket = request.route_ticket

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill_tokens(self) -> int:
        """Prefill tokens still to compute. A running request counts the rest of its
        prompt. A waiting request counts the part of its prompt that neither the prefix
        cache nor a request ahead of it (running, or earlier in the queue) will hold by
        its admission: a prefix shared by queued requests is computed once, by the
        first, and counted once (a burst of one group's requests is one prefill and
        their suffixes, not a prefill each)."""
        total = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in self.running)
        if not self.kv.enable_caching:  # nothing is shared: every prompt is computed whole
            return total + sum(r.num_tokens for r in self.waiting)
        bs = self.block_size
        ahead: set = set()  # hashes of the blocks a request ahead will compute
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                ahead.update(r.update_block_hashes()[r.num_computed_tokens // bs : r.num_prompt_tokens // bs])
        for r in self.waiting:
            hashes = r.update_block_hashes()
            hit = self.kv.get_computed_blocks(r)[1] // bs
            last = min((r.num_tokens - 1) // bs, len(hashes))  # the last token is always computed
            while hit < last and hashes[hit] in ahead:
                hit += 1
            total += r.num_tokens - hit * bs
            ahead.update(hashes[hit:last])
        return total

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

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget, req.num_computed_tokens)
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
            self._admit(scheduled, budget)

        for req, num_computed, num_new in scheduled:
            out.rows.append(
                ScheduledRequest(req, num_computed, num_new, tuple(self.kv.block_ids(req.request_id)))
            )
        out.copies = self.kv.take_copies()
        self.max_batch_size = max(self.max_batch_size, len(out.rows))
        return out

    def _admit(self, scheduled: list[tuple[Request, int, int]], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._adapter_fits(req):
                break
            hits, num_hit = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._chunk(req, remaining, budget, num_hit)
            if num_new == 0:
                break
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.num_host_cached_tokens = sum(isinstance(h, HostHit) for h in hits) * self.block_size
                self.kv.record_query(req.num_prompt_tokens, num_hit, req.num_host_cached_tokens)
            self.running.append(req)
            scheduled.append((req, num_hit, num_new))
            budget -= num_new

    def _adapter_fits(self, req: Request) -> bool:
        """False when ``req``'s adapter would be one more than ``max_loras`` in the step."""
        if req.lora_name is None or not self.config.max_loras:
            return True
        names = {r.lora_name for r in self.running if r.lora_name is not None}
        return req.lora_name in names or len(names) < self.config.max_loras

    def _chunk(self, req: Request, remaining: int, budget: int, start: int) -> int:
        """Tokens to compute this step: all that remain if they fit, else a chunk that ends
        on a page boundary (when page-aligned), possibly 0."""
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
