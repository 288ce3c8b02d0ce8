"""asyncio front of the engine: ``generate`` streams TokenDeltas while the step loop
runs in a worker thread, so the event loop is never blocked by a forward pass."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from kvroute.replica.block_hash import BlockHash, HashSpec
from kvroute.replica.config import EngineConfig
from kvroute.replica.engine import Engine
from kvroute.replica.kv_payload import KVPayload
from kvroute.replica.kv_transfer import ImportResult
from kvroute.replica.kv_events import LoadFigures
from kvroute.replica.outputs import RequestId, TokenDelta
from kvroute.replica.request import Request
from kvroute.replica.request_metrics import EngineMetrics
from kvroute.replica.sampling_params import SamplingParams

T = TypeVar("T")
_BACKGROUND: set[asyncio.Future] = set()  # transfers settling after their caller left


class AsyncEngine:
    """Owns an Engine; all engine mutations happen on the event loop between steps.

    ``generate`` validates synchronously (bad input raises ValueError before anything is
    queued); a caller that stops iterating (cancelled, disconnected) aborts its request,
    which frees its blocks at the next step boundary.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[RequestId, asyncio.Queue[TokenDelta | BaseException]] = {}
        self._to_add: list[Request] = []
        self._to_abort: list[RequestId] = []
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self.last_events = None  # the latest KVEvents, for whoever publishes them
        self._event_listeners: list = []
        self._step_lock: asyncio.Lock | None = None
        self.metrics = EngineMetrics()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(Engine(config))

    def add_event_listener(self, fn) -> None:
        """``fn(KVEvents)`` is called on the event loop after every step, and when
        requests were added between steps (their load, before the next step runs)."""
        self._event_listeners.append(fn)

    async def generate(
        self,
        token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        resume_output: Sequence[int] = (),
        route_ticket: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = self.engine.make_request(rid, token_ids, params, cache_salt, resume_output, route_ticket, lora_name)
        queue: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        self._to_add.append(req)
        self._ensure_loop()
        finished = False
        arrival = last = time.monotonic()
        first_token = True
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                now = time.monotonic()
                if item.token_ids:
                    self.metrics.on_token(now - arrival, None if first_token else now - last, len(item.token_ids))
                    first_token, last = False, now
                if item.finish_reason is not None:
                    finished = True  # before the yield: a caller may close after the last delta
                    self.metrics.on_finish(item.finish_reason, now - arrival, item.num_prompt_tokens)
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.metrics.finished["abort"] = self.metrics.finished.get("abort", 0) + 1
                self._to_abort.append(rid)
                self._ensure_loop()

    @property
    def failure(self) -> BaseException | None:
        """The exception that ended the step loop, if one did."""
        task = self._loop_task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    async def between_steps(self, fn):
        """``fn()``'s result, called on the event loop while no step is in flight and
        after the listeners have seen every finished step (a consistent snapshot)."""
        async with self._lock():
            return fn()

    def _lock(self) -> asyncio.Lock:
        if self._step_lock is None:
            self._step_lock = asyncio.Lock()
        return self._step_lock

    async def metrics_report(self) -> dict:
        """Engine figures (gauges and counters, as of a step boundary) and the request
        latency histograms, as one JSON-able dict."""

        def read() -> dict:
            stats = dataclasses.asdict(self.engine.stats(with_ref_counts=False))
            stats.pop("block_ref_counts")
            return {"engine": stats, **self.metrics.report(), "kv_transfer": self.engine.kv_transfer.metrics.report()}

        return await self.between_steps(read)

    # ------------------------------------------------------------------ what hosts read
    @property
    def replica_id(self) -> str:
        return self.engine.config.replica_id

    @property
    def hash_spec(self) -> HashSpec:
        return self.engine.hash_spec

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.kv.num_blocks

    @property
    def num_host_kv_blocks(self) -> int:
        return self.engine.host_kv_blocks

    async def cache_snapshot(self, also: Callable[[], T]) -> tuple[list[BlockHash], list[BlockHash], LoadFigures, T]:
        """The cached block hashes (device, then host tier), the load figures and
        ``also()``, all as of one step boundary (a replica registers with them, ``also``
        naming its event sequence)."""
        e = self.engine
        return await self.between_steps(lambda: (e.cached_block_hashes(), e.host_block_hashes(), e.load(), also()))

    async def debug_state(self) -> dict[str, Any]:
        """The engine's exact cache and block state, as of a step boundary."""

        def read() -> dict[str, Any]:
            stats = self.engine.stats()
            return {
                "cached_block_hashes": self.engine.cached_block_hashes(),
                "blocks_in_use": sum(1 for c in stats.block_ref_counts if c > 0),
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "num_free_blocks": stats.num_free_blocks,
                "num_kv_blocks": stats.num_kv_blocks,
                "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "num_preemptions": stats.num_preemptions,
                "route_ticket": self.engine.scheduler.route_ticket,
            }

        return await self.between_steps(read)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False while a request holds one."""
        return bool(await self.between_steps(self.engine.reset_prefix_cache))

    async def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter folder as ``name`` between steps (``Engine.load_lora``);
        the folder is read in a worker thread."""
        e = self.engine
        if e.lora is None:
            raise ValueError("loading a LoRA adapter needs enable_lora=True")
        adapter = await asyncio.to_thread(e.lora.read, name, path)
        await self.between_steps(lambda: e.register_lora(adapter))

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; ValueError while a request (queued or running) uses it."""

        def unload() -> None:
            self._apply_pending()  # requests added (or aborted) before this call count
            self.engine.unload_lora(name)

        await self.between_steps(unload)

    async def list_loras(self) -> dict[str, str]:
        """The loaded adapters' folders by name, in load order (what /v1/models lists)."""
        return self.engine.list_loras()

    async def find_lora(self, name: str) -> bool:
        """Whether adapter ``name`` is loaded (this host loads nothing on demand)."""
        return name in self.engine.list_loras()

    # ------------------------------------------------------------------ KV transfer
    def report_pulls(self) -> None:
        """Report in every load figure what pulling KV into this engine costs
        (``KVTransfer.pull_figures``), so routers may ask it to pull a prefix: for a host
        that acts on a decision's ``pull_from`` (the Serve replica), not for one that
        would ignore it."""
        self.engine.telemetry.pull_state = self.engine.kv_transfer.pull_figures

    async def export_blocks(self, token_ids: Sequence[int] | None = None, **kwargs: Any) -> KVPayload:
        """``Engine.export_blocks`` without holding up the step loop: the blocks are
        referenced between steps, copied in a worker thread while steps go on (no step
        writes a referenced cached block), and released between steps once the copy has
        ended, also when the caller gives up first (the release then follows the copy)."""
        xfer = self.engine.kv_transfer
        on_device = kwargs.pop("on_device", False)
        lease = await self.between_steps(lambda: xfer.lease(token_ids, **kwargs))
        return await self._beside_steps(lambda: xfer.copy(lease, on_device), lambda _: xfer.release(lease))

    async def import_blocks(self, payload: KVPayload) -> ImportResult:
        """``Engine.import_blocks`` without holding up the step loop: checked and reserved
        between steps (ValueError, nothing changed, when refused), written in a worker
        thread into blocks only the import holds, then committed between steps, or
        released uncached if the write fails or the caller gives up before it ends.
        The routers hear of the new blocks at once."""
        xfer = self.engine.kv_transfer
        res = await self.between_steps(lambda: xfer.reserve(payload))

        def settle(failed: bool) -> ImportResult | None:
            if failed:
                xfer.abort(res)
                return None
            result = xfer.commit(res)
            self._publish(self.engine.events())
            return result

        return await self._beside_steps(lambda: xfer.write(res), settle)  # type: ignore[return-value]

    async def _beside_steps(self, work: Callable[[], T], settle: Callable[[bool], Any]) -> Any:
        """``work()`` in a worker thread while steps run, then ``settle(failed)`` between
        steps, which runs even if the caller is cancelled (after ``work`` has ended: it
        may still be reading or writing blocks); ``failed``: ``work`` raised or the
        caller gave up (a pull past its deadline imports nothing). Returns ``work()``'s result, or
        ``settle(False)``'s where that is not None."""
        task = asyncio.ensure_future(asyncio.to_thread(work))
        gave_up: list[bool] = []
        done = asyncio.ensure_future(self._settle_after(task, settle, gave_up))
        _BACKGROUND.add(done)  # the loop holds tasks weakly: this one must outlive a cancelled caller
        done.add_done_callback(_BACKGROUND.discard)
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            gave_up.append(True)
            raise
        except BaseException:
            await asyncio.shield(done)
            raise
        settled = await asyncio.shield(done)
        return result if settled is None else settled

    async def _settle_after(self, task: asyncio.Future, settle: Callable[[bool], Any], gave_up: list[bool]) -> Any:
        await asyncio.wait({task})
        failed = bool(gave_up) or task.cancelled() or task.exception() is not None
        return await self.between_steps(lambda: settle(failed))

    async def abort(self, request_id: str) -> None:
        self._to_abort.append(RequestId(request_id))
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._wake is None or self._loop is not loop:
            # An asyncio.Event binds to the first loop that waits on it, so a new loop
            # (a second asyncio.run over the same engine) needs its own Event and step task.
            self._loop = loop
            self._wake = asyncio.Event()
            self._step_lock = None
            self._loop_task = None
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._run())
        self._wake.set()

    def _apply_pending(self) -> bool:
        """Apply the queued adds and aborts; True if a request was added."""
        adds, self._to_add = self._to_add, []
        added = False
        for req in adds:
            if req.request_id in self._queues:  # its caller may already have gone
                self.engine.add(req)
                added = True
        aborts, self._to_abort = self._to_abort, []
        for rid in aborts:
            req = self.engine.requests.get(rid)
            if self.engine.abort(rid) and req is not None:
                q = self._queues.get(rid)
                if q is not None:  # aborted via abort(): end its stream instead of leaving it waiting
                    q.put_nowait(
                        TokenDelta(rid, [], "", None, "abort", req.num_prompt_tokens, max(req.num_cached_tokens, 0))
                    )
        return added

    def _publish(self, events) -> None:
        self.last_events = events
        for fn in self._event_listeners:
            fn(events)

    async def _run(self) -> None:
        assert self._wake is not None
        try:
            while True:
                if self._apply_pending():
                    # Report the new requests now, not after the step: a CPU step can
                    # outlast the router's patience for requests it routed here.
                    self._publish(self.engine.events())
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    if self._to_add or self._to_abort:
                        continue
                    await self._wake.wait()
                    continue
                async with self._lock():
                    out = await asyncio.to_thread(self.engine.step)
                    for delta in out.deltas:
                        q = self._queues.get(delta.request_id)
                        if q is not None:
                            q.put_nowait(delta)
                    self._publish(out.kv_events)
        except BaseException as exc:  # a crashed step must not leave callers hanging
            for q in self._queues.values():
                q.put_nowait(RuntimeError(f"engine step failed: {exc!r}") if not isinstance(exc, asyncio.CancelledError) else exc)
            raise
