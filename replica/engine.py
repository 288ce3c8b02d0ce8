"""The replica engine: requests in, token deltas and KV events out. No Ray, no asyncio."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvroute.replica.block_hash import BlockHash, HashSpec
from kvroute.replica.config import EngineConfig
from kvroute.replica.detokenizer import IncrementalDetokenizer
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.replica.telemetry import ReplicaTelemetry
from kvroute.replica.outputs import RequestId, TokenDelta, TokenLogprob
from kvroute.replica.request import Request
from kvroute.replica.request_checks import check_fits, check_tokens
from kvroute.replica.sampling_params import SampleRequest, SamplingParams
from kvroute.replica.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from kvroute.replica.kv_payload import KVPayload
    from kvroute.replica.kv_transfer import ImportResult, KVTransfer
    from kvroute.replica.logits_constraints import EngineConstraints
    from kvroute.replica.lora.slots import AdapterSlots

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StepOutput:
    deltas: list[TokenDelta]
    kv_events: KVEvents
    num_scheduled_tokens: int = 0
    num_rows: int = 0


@dataclass(frozen=True)
class EngineStats(LoadFigures):
    """The engine's load figures (what it reports to the router) and its counters."""

    num_kv_blocks: int = 0
    num_free_blocks: int = 0
    num_host_kv_blocks: int = 0
    num_host_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0  # either tier
    prefix_cache_host_hits: int = 0
    num_preemptions: int = 0
    max_batch_size: int = 0
    num_loras: int = 0  # adapters loaded
    num_resident_loras: int = 0  # of which in a device slot
    lora_slot_loads: int = 0  # adapters copied into a device slot (a cold adapter's load)
    block_ref_counts: list[int] = field(repr=False, default_factory=list)


class Engine:
    """Continuous-batching engine over a paged, prefix-cached KV cache.

    Not thread-safe: one caller drives ``add_request`` / ``step`` / ``abort``.
    """

    def __init__(self, config: EngineConfig) -> None:
        from kvroute.replica.checkpoint import load_generation_eos, load_hf_config, load_tokenizer, resolve_model
        from kvroute.replica.models.arch import ModelArch

        self.config = config
        self.model_path = resolve_model(config.model, weights=config.emulate is None)  # an emulation reads no weights
        light = config.emulate is not None  # no model to run: no transformers config classes, no torch
        self.arch = ModelArch.from_hf_config(load_hf_config(self.model_path, light))
        self.tokenizer = load_tokenizer(self.model_path, light)
        eos = set(self.arch.eos_token_ids) | set(load_generation_eos(self.model_path))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.max_model_len = config.context_length(self.arch.max_position_embeddings)
        bs = config.block_size
        self.hash_spec = HashSpec(bs, config.hash_seed, self.model_id)
        if config.emulate is not None:
            from kvroute.replica.emulated import EmulatedModel
            from kvroute.replica.profiles import get_profile

            profile = get_profile(config.emulate)
            num_blocks = config.num_kv_blocks or max(1, profile.kv_blocks_per_replica * profile.block_size // bs)
            self.host_kv_blocks = config.host_blocks(profile.kv_bytes_per_token * bs)
            self.runner = self.sampler = EmulatedModel(profile, self.arch.vocab_size, self.eos_token_ids, config.time_scale,
                                                       lora_slots=self._lora_slots(config))  # fmt: skip
        else:
            num_blocks = self._load_model(config)
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, self.host_kv_blocks)
        target = None if config.step_target_s is None else config.step_target_s * config.time_scale
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens, config.max_num_seqs, config.enable_chunked_prefill, config.page_aligned,
                target,
                config.max_loras if config.enable_lora else 0,
            ),
            self.kv,
        )
        self.requests: dict[RequestId, Request] = {}
        self._lora_served: set[str] = set()  # adapter names that have run a request here
        for name, path in config.lora_modules.items():
            self.load_lora(name, path)
        self.constraints = self._constraints(config)
        self.telemetry = ReplicaTelemetry(config.replica_id, self.scheduler, self.kv)
        self.telemetry.max_requests = config.max_requests
        if self.lora is not None:
            self.telemetry.lora_state = self.lora.state

    @staticmethod
    def _lora_slots(config: EngineConfig) -> tuple[int, int, int | None] | None:
        """The runner's LoRA slots ``(max_loras, max_rank, max_cpu_loras)``; None without LoRA."""
        return (config.max_loras, config.max_lora_rank, config.max_cpu_loras) if config.enable_lora else None

    @property
    def lora(self) -> AdapterSlots | None:
        """The runner's LoRA adapters and slots (None without ``enable_lora``)."""
        return self.runner.lora

    def _constraints(self, config: EngineConfig) -> "EngineConstraints | None":
        """Structured outputs and the other logits constraints; None for an emulated engine
        (no logits: a constrained request is refused in ``make_request``)."""
        if config.emulate is not None:
            return None
        from kvroute.replica.logits_constraints import EngineConstraints

        return EngineConstraints(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)

    def _load_model(self, config: EngineConfig) -> int:
        """The model runner (weights on the device) and the sampler; returns the KV
        cache's size in blocks."""
        from kvroute.replica.cuda_graphs import default_graph_sizes
        from kvroute.replica.kv_sizing import KVSizer
        from kvroute.replica.model_runner import ModelRunner, kv_bytes_per_block, pick_device, pick_dtype
        from kvroute.replica.sampler import Sampler

        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        bs = config.block_size
        block_bytes = kv_bytes_per_block(self.arch, bs, dtype)
        self.host_kv_blocks = config.host_blocks(block_bytes)
        graph_sizes = () if config.enforce_eager else default_graph_sizes(config.max_num_seqs)
        sizer = KVSizer(config, block_bytes, device)  # (on CUDA, reads the free memory before the weights load)
        self.runner = ModelRunner(self.arch, self.model_path, sizer, bs, device, dtype, self.max_model_len, graph_sizes,
                                  self.host_kv_blocks, self._lora_slots(config))  # fmt: skip
        self.sampler = Sampler(config.seed)
        return sizer.size.num_blocks

    @property
    def model_id(self) -> str:
        return self.config.model

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        resume_output: Sequence[int] = (),
        route_ticket: int = 0,
        lora_name: str | None = None,
    ) -> Request:
        """Validate a request without touching engine state (safe from another thread).

        ``resume_output``: output tokens this request already produced elsewhere (a
        replica that died mid-stream). They count toward ``max_tokens`` / ``min_tokens``,
        penalties, seeded sampling and the detokenizer's state, and are not streamed
        again, so the continuation equals an uninterrupted run. ``route_ticket``: the
        router's ticket for this request (reported back in ``LoadFigures.route_ticket``).
        ``lora_name``: the loaded LoRA adapter to run with (None: the base model).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        rid = RequestId(str(request_id))
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        ids = [int(t) for t in token_ids]
        resumed = [int(t) for t in resume_output]
        check_tokens(ids, resumed, params, self.arch.vocab_size)
        check_fits(len(ids), params, self.max_model_len, self.kv.num_blocks, self.config)
        if params.prompt_logprobs is not None and self.config.emulate is not None:
            raise ValueError("prompt_logprobs needs a model's logits; the emulated engine has none")
        if type(route_ticket) is not int or route_ticket < 0:
            raise ValueError(f"route_ticket must be a non-negative int, got {route_ticket!r}")
        self._check_lora(lora_name)
        req = Request(rid, ids, params, self.hash_spec, cache_salt, lora_name, self.eos_token_ids)
        req.route_ticket = route_ticket
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
        if params.constrained:  # its grammar's compile starts now; resumed tokens are replayed
            if self.constraints is None:
                raise ValueError("structured outputs, logit_bias, allowed_token_ids and bad_words need a "
                                 "model's logits; the emulated engine has none")  # fmt: skip
            req.constraints = self.constraints.for_request(params)
        if resumed:
            req.token_ids.extend(resumed)
            # Every token before the last one went through the detokenizer (none stopped
            # the request); its text was already streamed by the first replica.
            _, stop = req.detokenizer.add_tokens(resumed)
            if stop is not None:
                raise ValueError(f"resume_output already contains the stop string {stop!r}")
        return req

    def add(self, request: Request) -> None:
        """Queue a request built by :meth:`make_request`."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self._check_lora(request.lora_name)  # it may have been unloaded since make_request
        if request.lora_name is not None:
            self._lora_served.add(request.lora_name)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        if request.constraints is not None:
            self.constraints.add(request)  # type: ignore[union-attr]

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        resume_output: Sequence[int] = (),
        route_ticket: int = 0,
        lora_name: str | None = None,
    ) -> Request:
        req = self.make_request(request_id, token_ids, params, cache_salt, resume_output, route_ticket, lora_name)
        self.add(req)
        return req

    # ------------------------------------------------------------------ LoRA adapters
    def _check_lora(self, name: str | None) -> None:
        if name is None:
            return
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r} was requested but this engine runs without enable_lora")
        self.lora.require(name)

    def load_lora(self, name: str, path: str) -> None:
        """Register the PEFT adapter in folder ``path`` as ``name`` (ValueError naming the
        file and field when the folder is bad; nothing is kept then)."""
        if self.lora is None:
            raise ValueError("loading a LoRA adapter needs enable_lora=True")
        self.register_lora(self.lora.read(name, path))

    def register_lora(self, adapter) -> None:
        """Register an adapter ``self.lora.read`` returned (the second half of ``load_lora``)."""
        if self.lora is None:
            raise ValueError("loading a LoRA adapter needs enable_lora=True")
        name = adapter.name
        if name in self._lora_served and name not in self.lora.adapters:
            # The name is the adapter's identity in the block hash: KV cached under an
            # earlier adapter of this name must not serve the new one.
            if not self.reset_prefix_cache():
                raise ValueError(f"LoRA adapter name {name!r} was served before and its cached KV cannot be "
                                 "dropped while requests run; load it under a new name or retry when idle")  # fmt: skip
            self._lora_served.discard(name)
        self.lora.register(adapter)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; refused (ValueError) while a request uses it."""
        self._check_lora(name)
        users = sum(1 for r in self.requests.values() if r.lora_name == name)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it once they finish")
        assert self.lora is not None
        self.lora.unregister(name)

    def list_loras(self) -> dict[str, str]:
        """The loaded adapters' paths by name, in load order."""
        return {} if self.lora is None else {name: str(a.path) for name, a in self.lora.adapters.items()}

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already done."""
        req = self.requests.pop(RequestId(str(request_id)), None)
        if req is None:
            return False
        self.scheduler.finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepOutput:
        deltas = [] if self.constraints is None else [self._refuse(r, why) for r, why in self.constraints.poll()]
        sched = self.scheduler.schedule()
        if sched.empty and self.constraints is not None:
            self.constraints.wait(0.01)  # nothing else to run: give a pending grammar compile time
        if not sched.empty:
            t0 = time.perf_counter()
            # the step's token mask is built while the model runs
            mask = None if self.constraints is None else self.constraints.step_mask_async([r.request for r in sched.rows if r.samples])
            logits = self.runner.execute(sched)
            for tokens, seconds in self.runner.take_restore_timings():
                self.telemetry.observe_restores(tokens, seconds)
            self.scheduler.update_after_step(sched)
            sampling_rows = [r for r in sched.rows if r.samples]
            if logits is not None and logits.shape[0] > len(sampling_rows):  # prompt logprobs' rows follow
                from kvroute.replica.sampler import record_prompt_logprobs

                record_prompt_logprobs(sched.rows, logits[len(sampling_rows) :])
                logits = logits[: len(sampling_rows)]
            for row, result in zip(sampling_rows, self._sample(logits, sampling_rows, mask)):
                deltas.append(self._deliver(row.request, result))
            self.telemetry.observe_step(sched, time.perf_counter() - t0)
        return StepOutput(deltas, self.telemetry.events(), sched.num_tokens, len(sched.rows))

    def _sample(self, logits: Any, rows: list[Any], mask: Any) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """Each sampled row's (token, logprob), or the exception that row raises alone.

        A batch whose mask or sampling fails is sampled again row by row, each row with
        its own mask: one request's fault (a matcher error, parameters the sampler
        rejects) then ends that request, and a fault that only a batch's mix provokes
        ends none. The model's forward pass is not retried: its failure is the engine's."""
        batch = [SampleRequest(r.request.params, r.request.prompt_token_ids, r.request.output_token_ids,
                               r.request.eos_token_ids) for r in rows]  # fmt: skip
        try:
            out = self.sampler(logits, batch, None if mask is None else mask.result())
            return list(zip(out.token_ids, out.logprobs))
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling each row alone", len(rows))
        results: list[tuple[int, TokenLogprob | None] | Exception] = []
        for i, (row, one) in enumerate(zip(rows, batch)):
            try:
                row_mask = None if self.constraints is None else self.constraints.step_mask([row.request])
                out = self.sampler(logits[i : i + 1], [one], row_mask)
                results.append((out.token_ids[0], out.logprobs[0]))
            except Exception as exc:
                results.append(exc)
        return results

    def _deliver(self, req: Request, result: tuple[int, TokenLogprob | None] | Exception) -> TokenDelta:
        """The request's delta for its sampled token; a failure to sample or take it in
        ends this request alone ("abort", the error as stop_reason), its blocks freed."""
        if not isinstance(result, Exception):
            try:
                return self._append(req, *result)
            except Exception as exc:
                result = exc
        log.error("request %s failed in its step", req.request_id, exc_info=result)
        return self._refuse(req, f"internal error: {type(result).__name__}: {result}")

    def _refuse(self, req: Request, reason: str) -> TokenDelta:
        """End a request whose grammar cannot run (its compile failed or ran past the time
        limit, or a resumed token does not match it): "abort", the reason as stop_reason."""
        log.warning("request %s refused: %s", req.request_id, reason)
        self.scheduler.finish(req, "abort")
        self.requests.pop(req.request_id, None)
        return TokenDelta(req.request_id, [], "", None, "abort", req.num_prompt_tokens, 0, reason)

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None) -> TokenDelta:
        p = req.params
        req.append_token(token)
        grammar = None if req.constraints is None else req.constraints.accept(token, req.output_token_ids)
        first = req.first_token_time is None
        if first:
            req.first_token_time = time.monotonic()
        if logprob is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(logprob)
        n_out = req.num_output_tokens
        reason: str | None = None
        stop_reason: str | int | None = None
        text = ""
        if n_out >= p.min_tokens and not p.ignore_eos and token in req.eos_token_ids:
            reason = "stop"
        elif n_out >= p.min_tokens and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        else:
            text, stop_str = req.detokenizer.add_tokens([token])
            if stop_str is not None and n_out >= p.min_tokens:
                reason, stop_reason = "stop", stop_str
            elif n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is None and grammar is not None:  # the grammar is complete (or broken)
            reason = "stop" if grammar == "stop" else "abort"
        if reason is not None:
            if not isinstance(stop_reason, str):
                text += req.detokenizer.flush()  # release held-back text: no stop string ended it
            self.scheduler.finish(req, reason)
            req.stop_reason = stop_reason
            del self.requests[req.request_id]
        return TokenDelta(
            req.request_id,
            [token],
            text,
            None if logprob is None else [logprob],
            reason,
            req.num_prompt_tokens,
            max(req.num_cached_tokens, 0),
            stop_reason,
            req.num_host_cached_tokens,
            req.prompt_logprobs if first and p.prompt_logprobs is not None else None,
        )

    # ------------------------------------------------------------------ introspection
    def events(self) -> KVEvents:
        """The cache changes since the last batch and the load figures now, numbered
        next: a host publishes them when it adds requests between steps."""
        return self.telemetry.events()

    def load(self) -> LoadFigures:
        return self.telemetry.load()

    def stats(self, with_ref_counts: bool = True) -> EngineStats:
        """``with_ref_counts=False`` skips the O(num_blocks) per-block ref counts."""
        s = self.scheduler
        return EngineStats(
            **vars(self.telemetry.load()),
            num_kv_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_host_kv_blocks=self.host_kv_blocks,
            num_host_cached_blocks=len(self.kv.host or ()),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            prefix_cache_host_hits=self.kv.host_hits,
            num_preemptions=s.num_preemptions,
            max_batch_size=s.max_batch_size,
            num_loras=0 if self.lora is None else len(self.lora.adapters),
            num_resident_loras=0 if self.lora is None else len(self.lora.resident),
            lora_slot_loads=0 if self.lora is None else self.lora.num_slot_loads,
            block_ref_counts=[b.ref_cnt for b in self.kv.pool.blocks] if with_ref_counts else [],
        )

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.kv.cached_block_hashes()

    def host_block_hashes(self) -> list[BlockHash]:
        return self.kv.host_block_hashes()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and, with LoRA, empty the adapter slots (a cold start:
        the next request of each adapter loads it); False, nothing changed, while a
        request holds a block."""
        if not self.kv.reset_prefix_cache():
            return False
        if self.lora is not None:
            self.lora.evict_all()
        return True

    # ------------------------------------------------------------------ KV transfer
    @functools.cached_property
    def kv_transfer(self) -> KVTransfer:
        """Export and import of runs of cached KV blocks (``replica/kv_transfer.py``);
        its ``lease``/``copy``/``release`` and ``reserve``/``write``/``commit`` phases let
        a host copy beside its steps (``AsyncEngine``)."""
        from kvroute.replica.kv_transfer import KVTransfer

        return KVTransfer(self)

    def export_blocks(self, token_ids: Sequence[int] | None = None, **kwargs: Any) -> KVPayload:
        """Every layer's K/V of the longest cached run of ``token_ids``'s full blocks (or
        of ``block_hashes=``), with the header an importer checks; call between steps.
        Keywords: ``block_hashes``, ``cache_salt``, ``lora_name``, ``max_blocks``, ``on_device``."""
        return self.kv_transfer.export(token_ids, **kwargs)

    def import_blocks(self, payload: KVPayload) -> ImportResult:
        """Cache ``payload``'s blocks here as prefix-cache blocks (ValueError, nothing
        imported, when its header or hashes do not match this engine); between steps."""
        return self.kv_transfer.import_(payload)

    def note_lora_served(self, name: str) -> None:
        """KV of adapter ``name`` is cached here: loading another adapter under this name
        must drop the prefix cache first (``register_lora``)."""
        self._lora_served.add(name)
