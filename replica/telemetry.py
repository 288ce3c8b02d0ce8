"""What a replica reports after each step: KV events numbered by ``seq`` and load figures
with measured rates and its queued prefill priced in seconds by the scheduler's step
cost model, which each step's duration feeds. Shared by the engine and the simulator's
replicas, so both speak to the router in exactly the same way.

The KV in use counts the free cached blocks its waiting requests will hit (a pulled
prefix waiting for its request among them) with the blocks requests hold: a router
that read them as free would place another prompt's KV (a second pull, a recompute)
in blocks the queue's admission takes."""

from __future__ import annotations

from typing import Callable

from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.replica.scheduler import Scheduler, SchedulerOutput

_EMA = 0.2  # weight of the newest step in the rate estimates


class ReplicaTelemetry:
    def __init__(self, replica_id: str, scheduler: Scheduler, kv: KVCacheManager) -> None:
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.kv = kv
        self.seq = 0
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0
        self.host_restore_tokens_per_s = 0.0
        # () -> (adapters resident in device slots, seconds a slot load takes); None: no adapters
        self.lora_state: Callable[[], tuple[tuple[str, ...], float]] | None = None
        self.max_requests = 0  # the serving layer's cap on requests at once (EngineConfig.max_requests)
        # () -> (KV bytes per token, pull bytes/s, pull setup s), set by a host that acts on pulls; None: it does not
        self.pull_state: Callable[[], tuple[int, float, float]] | None = None

    def observe_step(self, step: SchedulerOutput, seconds: float) -> None:
        """Fold one step's duration into the prefill rate and the step cost model
        (steps with prefill) or the decode step time (decode-only steps)."""
        if step.num_prefill_tokens:
            self.scheduler.cost.observe(step.num_tokens, step.attention_pairs, seconds)
            rate = step.num_tokens / max(seconds, 1e-9)
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if not old else (1 - _EMA) * old + _EMA * rate
        else:
            old = self.decode_step_s
            self.decode_step_s = seconds if not old else (1 - _EMA) * old + _EMA * seconds

    def observe_restores(self, tokens: int, seconds: float) -> None:
        """Fold one step's host -> device copies into the restore rate."""
        if tokens and seconds > 0:
            rate, old = tokens / seconds, self.host_restore_tokens_per_s
            self.host_restore_tokens_per_s = rate if not old else (1 - _EMA) * old + _EMA * rate

    def load(self) -> LoadFigures:
        s = self.scheduler
        spans, held = s.queued()
        resident, load_s = ((), 0.0) if self.lora_state is None else self.lora_state()
        slots = s.config.max_loras
        running = tuple(sorted({r.lora_name for r in s.running if r.lora_name is not None})) if slots else ()
        release_s, release_blocks = self._release()
        kv_bytes, pull_rate, pull_setup = (0, 0.0, 0.0) if self.pull_state is None else self.pull_state()
        return LoadFigures(
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            queued_prefill_tokens=sum(end - start for start, end in spans),
            queued_prefill_s=sum(s.cost.span_seconds(start, end) for start, end in spans),
            kv_usage=self.kv.usage + held / self.kv.num_blocks,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_step_s=self.decode_step_s,
            route_ticket=s.route_ticket,
            host_restore_tokens_per_s=self.host_restore_tokens_per_s,
            resident_loras=resident,
            adapter_load_s=load_s,
            running_loras=running,
            max_loras=slots,
            release_s=release_s,
            release_blocks=release_blocks,
            max_requests=self.max_requests,
            kv_bytes_per_token=kv_bytes,
            pull_bytes_per_s=pull_rate,
            pull_setup_s=pull_setup,
        )

    def _release(self) -> tuple[float, int]:
        """(seconds until the running request with the fewest tokens left to its
        ``max_tokens`` finishes, the blocks only it holds less those the other running
        requests allocate as they decode until then); (0.0, 0) with nothing running or
        no decode step measured yet."""
        running, step = self.scheduler.running, self.decode_step_s
        if not running or not step:
            return 0.0, 0
        soonest = min(running, key=lambda r: r.params.max_tokens - r.num_output_tokens)
        left = max(1, soonest.params.max_tokens - soonest.num_output_tokens)
        held, size = self.kv.req_blocks, self.kv.block_size
        freed = sum(1 for b in held.get(soonest.request_id, ()) if b.ref_cnt == 1)
        for r in running:
            if r is not soonest:
                grown = r.num_tokens + min(left, r.params.max_tokens - r.num_output_tokens)
                freed -= max(0, -(-grown // size) - len(held.get(r.request_id, ())))
        return left * step, max(0, freed)

    def events(self) -> KVEvents:
        """The step's net cache changes, numbered one after the last batch."""
        stored, removed, cleared = self.kv.take_events()
        host_stored, host_removed, host_cleared = self.kv.take_host_events()
        self.seq += 1
        return KVEvents(self.replica_id, self.seq, stored, removed, cleared or host_cleared, self.load(),
                        host_stored, host_removed)  # fmt: skip
