"""The backend of a ``kvroute serve --workers`` application: it forwards each prepared
request to one of the external OpenAI-compatible servers (vLLM, ``kvroute
serve-replica``) the application fronts instead of engine replicas.

``OpenAIServing`` validated and tokenized the request as for any backend (a completions
list is routed by its first prompt); ``WorkersBackend.answer`` hashes its blocks under
the application's ``HashSpec``, takes a decision from a router actor (the first in
``RouterChoice``'s order, failing over to the next, then a random order), and sends the
request's body, unchanged but for ``model`` (the name the worker serves), to the first
worker in that order. The worker's answer passes through unchanged (usage and
``prompt_tokens_details.cached_tokens`` included). A worker that refuses the
connection, drops it or answers 5xx before the first byte of a stream (or before a
whole body) is reported to the ``WorkerPool`` (``cluster/worker_pool.py``), which takes
it out of routing, and the request goes to the next worker; after the first streamed
byte a failure is an error event and ``[DONE]``.

``WorkerAdapters`` is the LoRA adapter host in front of the workers (``/v1/models``, the
load and unload routes). ``admin_routes``: ``GET /admin/workers``, ``POST
/admin/workers`` (a ``WorkerSpec``), ``DELETE /admin/workers/{id}``, behind the API key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Any, AsyncIterator, Callable, Optional

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvroute.cluster.router_choice import RouterChoice
from kvroute.cluster.worker_state import WorkerSpec, pool_metrics_text
from kvroute.deploy.openai.errors import APIError, error_body
from kvroute.deploy.openai.protocol import Answer, PreparedRequest
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.router.types import RouteDecision, RouteOutcome

log = logging.getLogger(__name__)

WORKERS_FRESH_S = 0.5  # how long an ingress trusts its copy of the pool's up workers
POOL_TIMEOUT_S = 2.0  # how long /metrics and /admin/workers wait for the pool's answer


class WorkersBackend:
    """The ``Backend`` (``deploy/openai/serving.py``) over the pool's up workers: ``answer``
    forwards a prepared request whole (module docstring); ``accuracy`` (``/metrics``'
    decision quality) counts what the workers report cached."""

    forwards_body = True  # vLLM's fields that only the workers honour pass through to them

    def __init__(self, pool: Any, router_actors: list[Any], hash_spec: HashSpec, request_timeout_s: Optional[float],
                 accuracy: Any = None) -> None:  # fmt: skip
        self.pool = pool
        self.routers = list(router_actors)
        self.stats = {"fallbacks": 0, "failovers": 0, "spills": 0}  # this ingress's (/metrics: kvroute:router_*)
        self._choice = RouterChoice(len(self.routers), self.stats)
        self.hash_spec = hash_spec
        self.accuracy = accuracy
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))  # fmt: skip
        self._up: dict[str, tuple[str, str, dict[str, str]]] = {}
        self._fresh_until = 0.0

    async def health(self) -> dict[str, Any]:
        up = await self.workers(fresh=True)
        return {"ready": bool(up), "workers_up": len(up)}

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters of the up workers (as last fetched): name -> root."""
        return {name: root for _, _, adapters in self._up.values() for name, root in adapters.items()}

    async def workers(self, fresh: bool = False) -> dict[str, tuple[str, str, dict[str, str]]]:
        """The pool's up workers, as of at most ``WORKERS_FRESH_S`` ago."""
        if fresh or time.monotonic() >= self._fresh_until:
            try:
                self._up = await asyncio.wait_for(self.pool.up_workers.remote(), 2.0)
                self._fresh_until = time.monotonic() + WORKERS_FRESH_S
            except Exception as exc:  # the pool restarting: keep what we knew
                log.warning("the worker pool did not answer: %r", exc)
        return self._up

    # ------------------------------------------------------------------ forwarding
    async def answer(self, request: PreparedRequest) -> Answer:
        """Rank the workers that serve the request's model (its adapter, when it names
        one; the adapter keys its blocks as the workers' engines key them) and send its
        body to the first that answers."""
        token_ids, lora_name = request.prompts[0], request.lora_name
        hashes = hash_blocks(self.hash_spec, token_ids, request.cache_salt, lora_name=lora_name)
        workers = {wid: w for wid, w in (await self.workers()).items() if lora_name is None or lora_name in w[2]}
        if not workers:
            raise APIError(503, "no worker is up" + (f" with the adapter {lora_name!r}" if lora_name else ""),
                           code="unavailable", retry_after_s=1.0)  # fmt: skip
        decision = await self._rank(hashes, len(token_ids), list(workers), lora_name)
        body, failed = json.loads(request.body), []
        for wid in (w for w in decision.order if w in workers):
            url, model, _ = workers[wid]
            try:
                return await self._send(url + request.path, {**body, "model": lora_name or model}, request.stream, decision,
                                        wid)  # fmt: skip
            except _WorkerFailed as exc:
                failed.append(wid)
                await self._take_out(wid, str(exc))
        raise APIError(503, f"no worker could serve the request (failed: {failed})", code="unavailable", retry_after_s=1.0)

    async def _send(self, url: str, body: dict[str, Any], stream: bool, decision: RouteDecision, wid: str) -> Answer:
        """The worker's answer: a dict, the SSE bytes (its first chunk already read), or
        its 4xx as an ``APIError``. ``_WorkerFailed``: try another worker."""
        try:
            resp = await self.client.send(self.client.build_request("POST", url, json=body), stream=True)
        except httpx.TimeoutException as exc:
            if not isinstance(exc, httpx.ConnectTimeout):
                raise APIError(408, f"the worker did not answer in time: {exc!r}", code="timeout") from None
            raise _WorkerFailed(repr(exc)) from None
        except httpx.TransportError as exc:
            raise _WorkerFailed(repr(exc)) from None
        try:
            if resp.status_code >= 500:
                raise _WorkerFailed(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            if resp.status_code >= 400:
                raise _worker_error(resp.status_code, await resp.aread())
            if not stream:
                answer = json.loads(await resp.aread())
                self._account(decision, wid, answer.get("usage"))
                return answer
            chunks = resp.aiter_raw()
            first = await chunks.__anext__()
        except httpx.TimeoutException as exc:
            await resp.aclose()
            raise APIError(408, f"the worker did not answer in time: {exc!r}", code="timeout") from None
        except httpx.TransportError as exc:
            await resp.aclose()
            raise _WorkerFailed(repr(exc)) from None
        except StopAsyncIteration:
            await resp.aclose()
            raise _WorkerFailed("the stream ended before its first byte") from None
        except BaseException:
            await resp.aclose()
            raise
        return self._relay(resp, first, chunks, decision, wid)

    async def _relay(self, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes], decision: RouteDecision,
                     wid: str) -> AsyncIterator[bytes]:  # fmt: skip
        tail = first[-_TAIL_BYTES:]  # the stream's end: its usage chunk, with include_usage
        try:
            yield first
            async for chunk in chunks:
                tail = (tail + chunk)[-_TAIL_BYTES:]
                yield chunk
        except httpx.TransportError as exc:  # the worker died mid-stream: nothing to resume from
            await self._take_out(wid, repr(exc))
            body = error_body(503, f"worker {wid} failed mid-stream: {exc!r}", code="unavailable")
            yield b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
        else:
            self._account(decision, wid, _stream_usage(tail))
        finally:
            await resp.aclose()

    async def _take_out(self, wid: str, reason: str) -> None:
        self._up.pop(wid, None)
        try:
            await asyncio.wait_for(self.pool.mark_down.remote(wid, reason), 2.0)
        except Exception as exc:
            log.warning("could not report worker %s down to the pool: %r", wid, exc)

    # ------------------------------------------------------------------ routing
    async def _rank(self, hashes: list, num_tokens: int, candidates: list[str], lora_name: Optional[str]) -> RouteDecision:
        """The decision of the first router (in ``RouterChoice``'s order) that answers
        within a second; none: a fallback in random order (counted)."""
        async def ask(i: int) -> RouteDecision:
            try:
                return await asyncio.wait_for(self.routers[i].rank.remote(hashes, num_tokens, candidates, lora_name), 1.0)
            except Exception as exc:
                log.warning("router %d did not rank: %r", i, exc)
                raise

        try:
            return await self._choice.first_answer(ask)
        except Exception:
            self.stats["fallbacks"] += 1
            return RouteDecision(None, 0, "fallback", fallbacks=random.sample(candidates, len(candidates)))

    def _account(self, decision: RouteDecision, wid: str, usage: Optional[dict[str, Any]]) -> None:
        """Decision quality (``/metrics``) from a whole answer's usage."""
        if self.accuracy is None or not isinstance(usage, dict):
            return
        delivered = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.accuracy.add(RouteOutcome(wid, decision), int(usage.get("prompt_tokens", 0)), delivered)


_TAIL_BYTES = 8192


def _stream_usage(tail: bytes) -> Optional[dict[str, Any]]:
    """The ``usage`` of an SSE stream's last chunk that has one (None without)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = json.loads(line[6:]).get("usage")
            except ValueError:
                return None  # cut at the tail's start
            if usage:
                return usage
    return None


async def pool_metrics(pool: Any, model_name: str) -> bytes:
    """The pool's liveness and its workers' state for ``/metrics`` (``worker_state.py``'s
    ``pool_metrics_text``); ``kvroute:worker_pool_up`` 0 when it does not answer in time."""
    try:
        described = await asyncio.wait_for(pool.describe.remote(), POOL_TIMEOUT_S)
    except Exception as exc:
        log.warning("the worker pool did not answer for /metrics: %r", exc)
        described = None
    return pool_metrics_text(described, model_name)


class _WorkerFailed(Exception):
    """The worker failed before answering: take it out, try the next."""


def _worker_error(status: int, raw: bytes) -> APIError:
    """A worker's 4xx, as our error (its message, param and code kept)."""
    try:
        err = json.loads(raw)["error"]
        return APIError(status, str(err.get("message")), param=err.get("param"), code=err.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(status, f"the worker answered {status}: {raw[:200]!r}")


class WorkerAdapters:
    """The adapter host in front of external workers (``WorkersBackend``): an adapter
    any up worker lists is served (by the workers that list it). Loading one goes to every up worker, unloading to those that list it
    (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``); it succeeds
    where at least one worker did it (a worker without LoRA refuses), then the pool
    reads their ``/v1/models`` again."""

    def __init__(self, backend: WorkersBackend) -> None:
        self.backend = backend

    async def list_loras(self) -> dict[str, str]:
        await self.backend.workers()
        return self.backend.adapters()

    async def find_lora(self, name: str) -> bool:
        return name in await self.list_loras()

    async def load_lora(self, name: str, path: str) -> None:
        workers = await self.backend.workers(fresh=True)
        await self._call([w[0] for w in workers.values()], "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora(self, name: str) -> None:
        workers = await self.backend.workers(fresh=True)
        await self._call([w[0] for w in workers.values() if name in w[2]], "/v1/unload_lora_adapter", {"lora_name": name})

    async def _call(self, urls: list[str], path: str, body: dict[str, str]) -> None:
        backend = self.backend
        answers = await asyncio.gather(*(backend.client.post(url + path, json=body) for url in urls), return_exceptions=True)
        await backend.pool.refresh_models.remote()
        await backend.workers(fresh=True)
        if not any(not isinstance(a, BaseException) and a.status_code < 400 for a in answers):
            why = [repr(a) if isinstance(a, BaseException) else _worker_error(a.status_code, a.content).message for a in answers]
            raise ValueError(f"no worker could {path.rsplit('/', 1)[1].replace('_', ' ')}: {why or 'no worker is up'}")


def admin_routes(pool: Any) -> Callable[[FastAPI], None]:
    """The routes that list, add and remove the pool's workers (module docstring)."""

    def add(app: FastAPI) -> None:
        @app.get("/admin/workers")
        async def list_workers() -> dict[str, Any]:
            try:
                described = await asyncio.wait_for(pool.describe.remote(), POOL_TIMEOUT_S)
            except Exception as exc:  # the pool restarting, or stuck
                raise APIError(503, f"the worker pool did not answer: {exc!r}", code="unavailable", retry_after_s=1.0)
            return {"object": "list", "data": described["workers"], "pool": described["pool"]}

        @app.post("/admin/workers")
        async def add_worker(spec: WorkerSpec) -> JSONResponse:
            answer = await pool.add.remote(spec.model_dump())
            if "error" in answer:
                raise APIError(answer["status"], answer["error"], param="url", code="worker_rejected")
            return JSONResponse(answer["worker"], status_code=201)

        @app.delete("/admin/workers/{worker_id}")
        async def remove_worker(worker_id: str) -> dict[str, Any]:
            if not await pool.remove.remote(worker_id):
                raise APIError(404, f"no worker {worker_id!r} in the pool", param="worker_id", code="worker_not_found")
            return {"id": worker_id, "object": "worker", "deleted": True}

    return add
