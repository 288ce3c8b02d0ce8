"""One simulated replica: the REAL KV cache manager and scheduler, no model.

A step goes exactly like ``Engine.step``: ``schedule()`` (admission, cache hits,
allocation, blocks registered in the prefix cache), then the model's time, here
``profile.step_time(...)`` (``replica/profiles.py``) seconds of simulated time, then ``update_after_step``,
one token appended per sampling row (the spec's planned answer token, or a
deterministic id), ``finish`` at the output length, and the step's KV events from
``kv.take_events()`` with the same load figures (and the same EMA rate estimates) the
engine publishes. LoRA adapters (``max_loras`` > 0): ``max_loras`` slots, least
recently used evicted (``replica/lora/slots.py``), adapters registered on first use;
a step that needs a cold adapter takes its slot load too (the profile's
``adapter_load_time`` of a rank-``lora_rank`` adapter), as the emulated engine does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from kvroute.replica.lora.slots import AdapterInfo, EmulatedSlots
from kvroute.replica.emulated import step_seconds
from kvroute.replica.profiles import StepProfile
from kvroute.benchmarks.workloads import RequestSpec
from kvroute.replica.block_hash import BlockHash, HashSpec
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.replica.telemetry import ReplicaTelemetry
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

_VOCAB = 32000


@dataclass
class SimRequest:
    """A spec in flight, with what the metrics need."""

    spec: RequestSpec
    request: Request
    arrival_s: float
    replica_id: str
    expected_cached_tokens: int
    reason: str
    first_token_s: float | None = None
    available_tokens: int = 0
    finish_s: float | None = None
    pulled_tokens: int = 0  # prompt tokens pulled from another replica before it queued


def planned_token(spec: RequestSpec, i: int) -> int:
    """Output token ``i`` of ``spec``: the planned answer, else a deterministic id."""
    if spec.output_token_ids is not None and i < len(spec.output_token_ids):
        return spec.output_token_ids[i]
    return 100 + (zlib.crc32(spec.request_id.encode()) + i * 7919) % (_VOCAB - 100)


class SimReplica:
    def __init__(
        self,
        replica_id: str,
        num_blocks: int,
        hash_spec: HashSpec,
        cost: StepProfile,
        sched_config: SchedulerConfig,
        host_blocks: int = 0,
        max_loras: int = 0,
        lora_rank: int = 16,
    ) -> None:
        self.replica_id = replica_id
        self.hash_spec = hash_spec
        self.cost = cost
        self.kv = KVCacheManager(num_blocks, hash_spec.block_size, enable_caching=True, host_blocks=host_blocks)
        self.scheduler = Scheduler(sched_config, self.kv)
        self.requests: dict[RequestId, SimRequest] = {}
        self.busy = False
        self._current: SchedulerOutput | None = None
        self._step_s = 0.0
        self.telemetry = ReplicaTelemetry(replica_id, self.scheduler, self.kv)
        self.loras: EmulatedSlots | None = None
        if max_loras:
            self.loras = EmulatedSlots(max_loras, lora_rank, None, cost.adapter_load_time)
            self.telemetry.lora_state = self.loras.state
        self.lora_rank = lora_rank
        self.num_steps = 0
        self.busy_s = 0.0

    # ------------------------------------------------------------------ requests
    def make_request(self, spec: RequestSpec, block_hashes: list[BlockHash], now: float) -> Request:
        params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
        if spec.lora_name is not None:
            if self.loras is None:
                raise ValueError(f"request {spec.request_id} names LoRA adapter {spec.lora_name!r}; set max_loras")
            if spec.lora_name not in self.loras.adapters:  # every adapter is on every replica's host
                self.loras.register(AdapterInfo(spec.lora_name, None, self.lora_rank))
        req = Request(RequestId(spec.request_id), list(spec.prompt_token_ids), params, self.hash_spec, spec.cache_salt,
                      spec.lora_name, arrival_time=now)  # fmt: skip
        req.block_hashes = list(block_hashes)  # memoized: the router already hashed the prompt
        return req

    def add(self, sim_req: SimRequest) -> None:
        self.requests[sim_req.request.request_id] = sim_req
        self.scheduler.add(sim_req.request)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def true_match(self, block_hashes: list[BlockHash]) -> int:
        """Leading blocks of ``block_hashes`` in this replica's prefix cache right now
        (what admission would hit; the oracle's view)."""
        cached = self.kv.pool._cached  # the truth, read-only  # noqa: SLF001
        n = 0
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ stepping
    def start_step(self) -> float | None:
        """Schedule one step; returns its duration, or None when there is nothing to run."""
        sched = self.scheduler.schedule()
        if sched.empty:
            return None
        self._step_s = step_seconds(self.cost, sched)
        if self.loras is not None:
            self._step_s += self.loras.acquire({r.request.lora_name for r in sched.rows if r.request.lora_name is not None})
        self._current = sched
        self.busy = True
        return self._step_s

    def finish_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest], KVEvents]:
        """End the running step at ``now``: returns (first tokens, finished, events)."""
        sched = self._current
        assert sched is not None and self.busy
        self._current, self.busy = None, False
        self.num_steps += 1
        self.busy_s += self._step_s
        self.scheduler.update_after_step(sched)
        first: list[SimRequest] = []
        done: list[SimRequest] = []
        for row in sched.rows:
            if not row.samples:
                continue
            req = row.request
            sim = self.requests[req.request_id]
            req.append_token(planned_token(sim.spec, req.num_output_tokens))
            if sim.first_token_s is None:
                sim.first_token_s = now
                req.first_token_time = now
                first.append(sim)
            if req.num_output_tokens >= sim.spec.output_len:
                self.scheduler.finish(req, "length")
                sim.finish_s = now
                del self.requests[req.request_id]
                done.append(sim)
        self.telemetry.observe_step(sched, self._step_s)
        return first, done, self.telemetry.events()

    def load(self) -> LoadFigures:
        return self.telemetry.load()

    def block_ref_counts(self) -> list[int]:
        return [b.ref_cnt for b in self.kv.pool.blocks]
