"""The external workers of a ``kvroute serve --workers`` application: which
OpenAI-compatible servers (vLLM, ``kvroute serve-replica``) exist, which are up, and
what the router actors know of them.

One ``WorkerPool`` per application, a detached Ray actor that every ingress replica asks
for the up workers. Every ``poll_interval_s`` each up worker's ``/metrics`` becomes
``LoadFigures`` (``cluster/worker_load.py``) handed to every router (``report_load``, also
its sign of life); a worker whose poll fails, or that an ingress reports dead
(``mark_down``), leaves every router and is probed (``/health``, ``/v1/models``: it must
serve the application's model) until it answers again. Its LoRA adapters are read again
every ``MODELS_REFRESH_S``. Its cache entries come from its KV events where it has an
event endpoint (``cluster/worker_state.py``); without one it is registered empty.

No worker stalls the others: every HTTP call is bounded (``HTTP_TIMEOUT_S``, the whole
answer) and so is every router call; each worker ticks as its own task under
``TICK_TIMEOUT_S``, a round waits for slow ticks only until the next is due, and a worker
still ticking is skipped. A take-out is one step with no await (``_detach``: down, the
subscriber handed over, a new ``generation``), so a failed poll and an ingress' report of
one death take it out once and stop its subscriber once, and a tick begun before it
drops what it learnt. The pool's liveness (rounds, the last one's age) is in
``describe()``, ``/admin/workers`` and ``/metrics``. As an actor it keeps its worker list
in the GCS internal KV under its actor name and starts from it when Ray restarts it, so
runtime ``add``/``remove`` survive a crash; on a cluster of several nodes it refuses
loopback addresses (``cluster/worker_probe.py``).

Load tickets: a worker does not know the routers' tickets, so a poll's figures count
every request routed more than ``TRANSIT_MARGIN_US`` before the poll started (its
``route_ticket``; tickets follow the wall clock), and the increments of later ones stay
on top (``router/load_view.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, Awaitable, Optional, Sequence

import httpx
import ray

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.kv_subscriber import STOP_TIMEOUT_S, KVEventSubscriber
from kvroute.cluster.messages import ROUTER_NAMESPACE
from kvroute.cluster.router_actor import get_or_create_router_actors
from kvroute.cluster.saved_state import load_json, save_json
from kvroute.cluster import worker_probe as probe
from kvroute.cluster.worker_load import parse_load
from kvroute.cluster.worker_state import Worker, WorkerSpec, adapters_of, describe_worker, recheck_events, subscribe
from kvroute.replica.kv_events import LoadFigures

log = logging.getLogger(__name__)

TRANSIT_MARGIN_US = 100_000  # a request routed this long before a poll has reached its worker
UNKNOWN_CAPACITY_BLOCKS = 1 << 20  # a worker that names no KV capacity: never skipped for room
MODELS_REFRESH_S = 2.0  # how often an up worker's /v1/models is read again (adapters loaded at run time)
HTTP_TIMEOUT_S = 5.0  # one call to a worker (/health, /v1/models, /metrics): its whole answer
TICK_TIMEOUT_S = 30.0  # one worker's tick (a probe is up to four calls, a take-out a subscriber's stop): a backstop
ROUTER_TIMEOUT_S = 5.0  # register, report_load, remove_replica on every router
EVENTS_RECHECK_S = 5.0  # how often a worker's KV event endpoint is checked again


class WorkerPool:
    """Plain state and one poll loop (started by the first call); ``WorkerPoolActor``
    is it as a Ray actor. ``nodes``: the Ray cluster's node count (None: asked)."""

    def __init__(self, config: ClusterConfig, specs: Sequence[dict], model_names: Sequence[str],
                 poll_interval_s: float = 1.0, routers: Optional[list] = None, nodes: Optional[int] = None) -> None:  # fmt: skip
        self.config = config
        self.model_names = set(model_names)
        self.poll_interval_s = poll_interval_s
        self.routers = routers if routers is not None else get_or_create_router_actors(config)
        self._nodes = nodes
        self.workers: dict[str, Worker] = {}
        self._adding: set[str] = set()  # ids and urls being probed by add()
        self.state_key = probe.pool_state_key()
        saved = load_json(self.state_key) if self.state_key and probe.restarted() else None
        if saved is None:
            probe.check_specs(specs, self.nodes())
        for s in saved if saved is not None else specs:
            spec = WorkerSpec.model_validate(s)
            if self._clash(spec):
                raise ValueError(f"worker {spec.worker_id} ({spec.url}) is listed twice")
            self.workers[spec.worker_id] = Worker(spec)
        if saved is not None:
            log.warning("worker pool restarted: %d workers restored from %s", len(self.workers), self.state_key)
        self._save()
        self._task: Optional[asyncio.Task] = None
        self._background: set[asyncio.Task] = set()
        self.ticks = 0  # rounds of ticks completed
        self.last_tick_at: Optional[float] = None  # time.time() of the last one
        self._last_tick_mono: Optional[float] = None

    # ------------------------------------------------------------------ API
    async def up_workers(self) -> dict[str, tuple[str, str, dict[str, str]]]:
        """``{worker id: (url, the model name it serves, its LoRA adapters {name: root})}``
        of the workers that are up."""
        self._start()
        return {wid: (w.spec.url, w.model, w.adapters) for wid, w in self.workers.items() if w.up and w.model}

    async def refresh_models(self) -> None:
        """Read every up worker's ``/v1/models`` again now (its adapters changed)."""
        self._start()
        up = [w for w in self.workers.values() if w.up]
        for w, models in zip(up, await asyncio.gather(*(self._models(w) for w in up), return_exceptions=True)):
            if not isinstance(models, BaseException):
                w.adapters, w.models_at = adapters_of(models), time.monotonic()

    async def describe(self) -> dict[str, Any]:
        """``{"workers": [one dict per worker], "pool": the pool's own liveness}``."""
        self._start()
        now = time.monotonic()
        return {"workers": [describe_worker(w, now) for w in self.workers.values()],
                "pool": {"ticks": self.ticks, "last_tick_at": self.last_tick_at, "poll_interval_s": self.poll_interval_s,
                         "last_tick_age_s": None if self._last_tick_mono is None else now - self._last_tick_mono,
                         "num_workers": len(self.workers), "num_up": sum(w.up for w in self.workers.values())}}  # fmt: skip

    async def add(self, spec: dict) -> dict[str, Any]:
        """Add a worker (probed at once: up if it answers). ``{"worker": ...}`` or
        ``{"error": message, "status": 400 | 409}``."""
        self._start()
        parsed = WorkerSpec.model_validate(spec)
        try:
            probe.check_addresses(parsed.url, (parsed.kv_events_endpoint, parsed.replay_endpoint), self.nodes())
        except ValueError as exc:
            return {"error": str(exc), "status": 400}
        if self._clash(parsed):
            return {"error": f"worker {parsed.worker_id} ({parsed.url}) is already in the pool", "status": 409}
        w = Worker(parsed)
        self._adding |= {parsed.worker_id, parsed.url}
        try:
            await asyncio.wait_for(self._probe(w), TICK_TIMEOUT_S)
        except ValueError as exc:
            await w.close_client()
            return {"error": str(exc), "status": 400}
        except asyncio.TimeoutError:
            w.last_error = f"probe did not finish within {TICK_TIMEOUT_S:g} s"
        finally:
            self._adding -= {parsed.worker_id, parsed.url}
        self.workers[parsed.worker_id] = w
        self._save()
        return {"worker": describe_worker(w, time.monotonic())}

    async def remove(self, worker_id: str) -> bool:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return False
        self._save()
        if w.task is not None:
            w.task.cancel()
        await self._take_out(w, "removed")
        return True

    async def mark_down(self, worker_id: str, reason: str) -> None:
        """An ingress saw the worker fail (connection refused or lost, a 5xx): out of
        routing now; its subscriber and the routers are told in the background."""
        w = self.workers.get(worker_id)
        if w is not None and w.up:
            self._spawn(self._release(w, self._detach(w, reason)))

    async def stop(self) -> None:
        for task in [self._task, *(w.task for w in self.workers.values()), *self._background]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(self._take_out(w, "pool stopped") for w in self.workers.values()), return_exceptions=True)
        await asyncio.gather(*(w.close_client() for w in self.workers.values()), return_exceptions=True)

    def nodes(self) -> int:
        return self._nodes if self._nodes is not None else probe.cluster_nodes()

    # ------------------------------------------------------------------ loop
    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _loop(self) -> None:
        """One round per ``poll_interval_s``: a tick task for every worker not ticking
        already, waited for until the next round is due at most (at least a second)."""
        while True:
            began = time.monotonic()
            try:
                for w in list(self.workers.values()):
                    if w.task is None or w.task.done():
                        w.task = asyncio.ensure_future(self._guarded_tick(w))
                ticking = [w.task for w in self.workers.values() if w.task is not None and not w.task.done()]
                if ticking:
                    await asyncio.wait(ticking, timeout=max(self.poll_interval_s, 1.0))
                self.ticks += 1
                self.last_tick_at, self._last_tick_mono = time.time(), time.monotonic()
            except Exception:  # never let the loop end: the pool would go silent for good
                log.exception("worker pool round failed")
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - began)))

    async def _guarded_tick(self, w: Worker) -> None:
        try:
            await asyncio.wait_for(self._tick(w), TICK_TIMEOUT_S)
        except asyncio.TimeoutError:
            why = f"tick did not finish within {TICK_TIMEOUT_S:g} s"
            if w.up:
                self._spawn(self._release(w, self._detach(w, why)))
            else:
                w.last_error = why
        except Exception:
            log.exception("worker %s: tick failed", w.spec.worker_id)
        finally:
            w.ticked_at = time.monotonic()

    async def _tick(self, w: Worker) -> None:
        if self.workers.get(w.spec.worker_id) is not w:
            return  # removed meanwhile
        if not w.up:
            try:
                await self._probe(w)
            except ValueError as exc:
                w.last_error = str(exc)
            return
        gen = w.generation
        try:
            load, _ = await self._poll(w)
            adapters = None
            if time.monotonic() - w.models_at >= MODELS_REFRESH_S:
                adapters = adapters_of(await self._models(w))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            if w.generation == gen:
                await self._take_out(w, f"metrics poll failed: {exc!r}")
            return
        if w.generation != gen:
            return  # taken out meanwhile: these figures are of a worker the routers no longer have
        w.load = load
        if adapters is not None:
            w.adapters, w.models_at = adapters, time.monotonic()
        await self._report(w, gen)
        if w.spec.kv_events_endpoint and time.monotonic() - w.events_checked_at >= EVENTS_RECHECK_S:
            await recheck_events(w, gen, self.config, self.routers)

    async def _poll(self, w: Worker) -> tuple[LoadFigures, dict[str, int]]:
        ticket = time.time_ns() // 1000 - TRANSIT_MARGIN_US
        r = await w.get(HTTP_TIMEOUT_S, "/metrics")
        r.raise_for_status()
        w.counters["polls"] += 1
        return parse_load(r.text, ticket, w.rates)

    async def _probe(self, w: Worker) -> None:
        """Bring ``w`` up if it answers and serves our model (ValueError if it serves
        another); otherwise note why and leave it down."""
        gen = w.generation
        try:
            if (await w.get(HTTP_TIMEOUT_S, "/health")).status_code != 200:
                w.last_error = "health probe did not answer 200"
                return
            models = await self._models(w)
            names = {m["id"] for m in models} | {str(m.get("root")) for m in models if m.get("root")}
            if not names & self.model_names:
                raise ValueError(f"worker {w.spec.worker_id} serves {sorted(names)}, not this application's model "
                                 f"(one of {sorted(self.model_names)})")  # fmt: skip
            load, cache = await self._poll(w)
            block_size = self.config.hash_spec.block_size
            if cache.get("block_size", block_size) != block_size:
                raise ValueError(f"worker {w.spec.worker_id} has KV blocks of {cache['block_size']} tokens; this "
                                 f"application hashes blocks of {block_size} (set --block-size to the workers')")  # fmt: skip
            capacity = w.spec.capacity_blocks or cache.get("num_gpu_blocks") or await self._server_info_capacity(w)
        except (httpx.HTTPError, KeyError, TypeError, json.JSONDecodeError) as exc:
            w.last_error = f"probe failed: {exc!r}"
            return
        events_error = await probe.endpoint_error(w.spec.kv_events_endpoint) if w.spec.kv_events_endpoint else None
        if w.generation != gen or w.up:
            return  # removed or taken out while it was probed
        ids = [m["id"] for m in models]
        w.model = next((i for i in ids if i in self.model_names), ids[0])  # the name to send it
        w.load, w.capacity = load, capacity
        w.adapters, w.models_at = adapters_of(models), time.monotonic()
        w.up, w.last_error = True, ""
        w.counters["ups"] += 1
        subscribe(w, events_error, self.config, self.routers)
        if w.subscriber is None:
            await self._register(w)
        log.info("worker %s (%s) is up: %s, %d KV blocks", w.spec.worker_id, w.spec.url, w.model, w.capacity)

    async def _models(self, w: Worker) -> list[dict[str, Any]]:
        r = await w.get(HTTP_TIMEOUT_S, "/v1/models")
        r.raise_for_status()
        return r.json()["data"]

    async def _server_info_capacity(self, w: Worker) -> int:
        """``serve-replica``'s ``/get_server_info`` names its KV blocks; else unknown."""
        r = await w.get(HTTP_TIMEOUT_S, "/get_server_info")
        blocks = r.json().get("num_kv_blocks") if r.status_code == 200 else None
        return int(blocks) if isinstance(blocks, int) and blocks > 0 else UNKNOWN_CAPACITY_BLOCKS

    async def _register(self, w: Worker, routers: Optional[list] = None) -> None:
        """Register ``w`` with an empty cache (no KV events) on ``routers`` (default: all)."""
        calls = [r.register.remote(w.spec.worker_id, self.config.hash_spec, w.capacity, [], 0, w.load)
                 for r in (routers or self.routers)]  # fmt: skip
        for exc in (a for a in await probe.bounded(calls, ROUTER_TIMEOUT_S) if isinstance(a, BaseException)):
            log.warning("worker %s: a router refused or missed its registration: %r", w.spec.worker_id, exc)

    async def _report(self, w: Worker, gen: int) -> None:
        calls = [r.report_load.remote(w.spec.worker_id, w.load) for r in self.routers]
        answers = await probe.bounded(calls, ROUTER_TIMEOUT_S)
        unknown = [r for r, ok in zip(self.routers, answers) if ok is False]
        if unknown and w.subscriber is None and w.generation == gen:  # a router restarted empty
            await self._register(w, unknown)

    def _detach(self, w: Worker, reason: str) -> Optional[KVEventSubscriber]:
        """Take ``w`` out of routing, with no await: however many callers see it fail,
        one counts the take-out and gets its subscriber to stop."""
        sub, w.subscriber = w.subscriber, None
        was_up, w.up, w.last_error = w.up, False, reason
        w.generation += 1
        if was_up:
            w.counters["downs"] += 1
            log.warning("worker %s (%s) taken out of routing: %s", w.spec.worker_id, w.spec.url, reason)
        return sub

    async def _release(self, w: Worker, sub: Optional[KVEventSubscriber]) -> None:
        """What a take-out tells others: the subscriber stops (off the event loop; it
        unregisters the worker), every router removes the worker (unless it came back
        up meanwhile)."""
        gen = w.generation
        if sub is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(sub.stop), 3 * STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("worker %s: its KV event subscriber did not stop in time", w.spec.worker_id)
        if w.generation == gen and not w.up:
            await probe.bounded([r.remove_replica.remote(w.spec.worker_id) for r in self.routers], ROUTER_TIMEOUT_S)
        if self.workers.get(w.spec.worker_id) is not w:  # removed: close its connections
            await w.close_client()

    async def _take_out(self, w: Worker, reason: str) -> None:
        await self._release(w, self._detach(w, reason))

    # ------------------------------------------------------------------ helpers
    def _clash(self, spec: WorkerSpec) -> bool:
        return (spec.worker_id in self.workers or any(w.spec.url == spec.url for w in self.workers.values())
                or bool({spec.worker_id, spec.url} & self._adding))  # fmt: skip

    def _save(self) -> None:
        """The worker list into the GCS internal KV (as an actor; module docstring)."""
        if self.state_key:
            try:
                save_json(self.state_key, [w.spec.model_dump(exclude_none=True) for w in self.workers.values()])
            except Exception as exc:  # the GCS unreachable: a restart would start from the config
                log.warning("could not save the worker list: %r", exc)


class _AppWorkerPool(WorkerPool):
    """The application's pool as a detached actor: it ends itself once no ingress has
    pinged it (``touch``, on Serve's health check) for ``idle_exit_s``, so the pool of
    a config that was redeployed or deleted goes away by itself."""

    def __init__(self, config: ClusterConfig, *args: Any) -> None:
        super().__init__(config, *args)
        self.last_touch = time.monotonic()
        threading.Thread(target=self._watch_idle, args=(config.idle_exit_s,), daemon=True).start()

    def touch(self) -> None:
        self.last_touch = time.monotonic()

    def _watch_idle(self, idle_exit_s: float) -> None:
        while True:
            time.sleep(min(5.0, idle_exit_s / 4))
            if time.monotonic() - self.last_touch > idle_exit_s:
                log.warning("worker pool unused for %.0f s (its application was removed or redeployed): exiting",
                            idle_exit_s)  # fmt: skip
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


WorkerPoolActor = ray.remote(num_cpus=0, max_restarts=-1)(_AppWorkerPool)


def pool_actor_name(config: ClusterConfig, specs: Sequence[dict], poll_interval_s: float) -> str:
    """Keyed by the application's generation and its worker settings: a redeploy with
    other settings gets a new pool, an unchanged one keeps it."""
    import hashlib

    digest = hashlib.sha256(json.dumps([list(specs), poll_interval_s], sort_keys=True).encode()).hexdigest()[:8]
    return f"{config.actor_name('workers')}-{digest}"


def get_or_create_worker_pool(config: ClusterConfig, specs: Sequence[dict], model_names: Sequence[str],
                              poll_interval_s: float) -> Any:  # fmt: skip
    """The application's pool actor, created on first use (detached, like the routers)."""
    return WorkerPoolActor.options(name=pool_actor_name(config, specs, poll_interval_s), namespace=ROUTER_NAMESPACE,
                                   lifetime="detached", get_if_exists=True).remote(
        config, list(specs), list(model_names), poll_interval_s)  # fmt: skip
