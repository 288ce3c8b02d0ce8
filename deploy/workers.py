"""The ingress of a ``kvroute serve --workers`` application: the same OpenAI API, router
actors and ``/metrics`` as ``OpenAIIngress``, in front of external OpenAI-compatible
servers (vLLM, ``kvroute serve-replica``) instead of engine replicas.

Per request, ``ForwardingServing`` validates the body as the engine path does,
tokenizes the prompt once (the workers' model, from the local model folder; a
completions list is routed by its first prompt) and hands the raw request to
``WorkersBackend.forward``: block hashes under the application's ``HashSpec``, a
decision from a router actor (the first in ``RouterChoice``'s order, failing over to the
next, then a random order), and the request, unchanged but for ``model`` (the name the worker
serves), to the first worker in that order. The worker's answer passes through
unchanged (usage and ``prompt_tokens_details.cached_tokens`` included). A worker that
refuses the connection, drops it or answers 5xx before the first byte of a stream (or
before a whole body) is reported to the ``WorkerPool`` (``deploy/worker_pool.py``),
which takes it out of routing, and the request goes to the next worker; after the
first streamed byte a failure is an error event and ``[DONE]``.

Admin routes, behind the API key: ``GET /admin/workers``, ``POST /admin/workers``
(a ``WorkerSpec``), ``DELETE /admin/workers/{id}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from typing import Any, AsyncIterator, Optional, Union

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve

from kvroute.cluster.lora import WorkerAdapters
from kvroute.cluster.router_choice import RouterChoice
from kvroute.deploy.errors import APIError, bad_request, error_body
from kvroute.deploy.protocol import ChatCompletionRequest, CompletionRequest, template_messages
from kvroute.deploy.serving import OpenAIServing
from kvroute.deploy.worker_pool import WorkerSpec
from kvroute.deploy.worker_probe import check_specs, cluster_nodes
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.router.types import RouteDecision, RouteOutcome

log = logging.getLogger(__name__)

Answer = Union[dict[str, Any], AsyncIterator[bytes]]
WORKERS_FRESH_S = 0.5  # how long an ingress trusts its copy of the pool's up workers
POOL_TIMEOUT_S = 2.0  # how long /metrics and /admin/workers wait for the pool's answer


class ForwardingServing(OpenAIServing):
    """``OpenAIServing`` whose completions and chat go whole to a worker."""

    takes_raw_body = True

    async def completions(self, req: CompletionRequest, raw: dict[str, Any]) -> Answer:  # type: ignore[override]
        lora = await self.check_model(req.model)
        prompts = req.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise bad_request(f"prompt holds {len(prompts)} prompts; at most {self.limits.max_prompts} are allowed",
                              param="prompt")  # fmt: skip
        self._check_n(req.n)
        token_lists, _ = await asyncio.to_thread(self._prompt_ids, prompts[:1], False)
        return await self.backend.forward("/v1/completions", raw, token_lists[0], req.cache_salt, req.stream, lora)

    async def chat(self, req: ChatCompletionRequest, raw: dict[str, Any]) -> Answer:  # type: ignore[override]
        lora = await self.check_model(req.model)
        self._check_n(req.n)
        ids = await asyncio.to_thread(
            self._chat_ids, template_messages(req.messages), req.add_generation_prompt, req.continue_final_message, "messages"
        )
        return await self.backend.forward("/v1/chat/completions", raw, ids, req.cache_salt, req.stream, lora)

    def _check_n(self, n: int) -> None:
        if n > self.limits.max_n:
            raise bad_request(f"n={n} exceeds the server's limit of {self.limits.max_n}", param="n")


class WorkersBackend:
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
    async def forward(self, path: str, body: dict[str, Any], token_ids: list[int], cache_salt: Optional[str],
                      stream: bool, lora_name: Optional[str] = None) -> Answer:  # fmt: skip
        """Rank the workers that serve the request's model (its adapter, when it names
        one; the adapter keys its blocks as the workers' engines key them) and send it to
        the first that answers."""
        hashes = hash_blocks(self.hash_spec, token_ids, cache_salt, lora_name=lora_name)
        workers = {wid: w for wid, w in (await self.workers()).items() if lora_name is None or lora_name in w[2]}
        if not workers:
            raise APIError(503, "no worker is up" + (f" with the adapter {lora_name!r}" if lora_name else ""),
                           code="unavailable", retry_after_s=1.0)  # fmt: skip
        decision = await self._rank(hashes, len(token_ids), list(workers), lora_name)
        failed: list[str] = []
        for wid in (w for w in decision.order if w in workers):
            url, model, _ = workers[wid]
            try:
                return await self._send(url + path, {**body, "model": lora_name or model}, stream, decision, wid)
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
    from kvroute.deploy.worker_state import pool_metrics_text

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


# ---------------------------------------------------------------------- ingress
@serve.ingress()
class WorkersIngress:
    """HTTP ingress in front of external workers (``deploy/app.py``'s ``compose_app``)."""

    async def __init__(self, args: dict[str, Any], config: Any) -> None:
        from kvroute.cluster.router_actor import get_or_create_router_actors
        from kvroute.deploy.app import ingress_limits, load_model_info, parse_args
        from kvroute.deploy.app_metrics import IngressReporter
        from kvroute.deploy.metrics import DecisionQuality
        from kvroute.deploy.worker_pool import get_or_create_worker_pool

        parsed = parse_args(args)
        name = parsed.llm_configs[0].model_loading_config.model_id
        tokenizer, max_model_len, vocab_size = await load_model_info(config)
        self.router_actors = get_or_create_router_actors(config)
        for actor in self.router_actors:  # kept routers adopt a redeployed policy
            actor.adopt.remote(config.router_policy, config.router_policy_kwargs)
        source = config.engine.model
        names = {name, source, os.path.basename(source.rstrip("/"))}
        check_specs(parsed.workers or [], cluster_nodes())  # a clear error here, not the pool actor's
        self.pool = get_or_create_worker_pool(config, [w.model_dump() for w in parsed.workers or []], sorted(names),
                                              parsed.worker_poll_interval_s)  # fmt: skip
        await self.pool.up_workers.remote()  # starts its poll loop (after a restart too: every call does)
        self.accuracy = DecisionQuality()
        limits = ingress_limits(parsed)
        backend = WorkersBackend(self.pool, self.router_actors, config.hash_spec, limits.request_timeout_s, self.accuracy)
        aliases = () if source == name else (source,)
        self.serving = ForwardingServing(name, tokenizer, max_model_len, vocab_size, backend, limits, aliases,
                                         WorkerAdapters(backend))  # fmt: skip
        self.reporter = IngressReporter(self.router_actors, self.accuracy, backend.stats)

    async def check_health(self) -> None:
        """Serve's periodic health check: tells the pool an ingress still uses it (an
        unused one ends itself; the routers hear each ingress's reports)."""
        self.pool.touch.remote()

    def __serve_build_asgi_app__(self) -> Any:
        from kvroute.deploy.api import build_api
        from kvroute.deploy.app_metrics import router_metrics

        async def metrics() -> tuple[bytes, str]:
            body, content_type = await router_metrics(self.router_actors, self.serving.model_name, self.reporter)
            return body + await pool_metrics(self.pool, self.serving.model_name), content_type

        return build_api(self.serving, metrics, self._admin_routes)

    def _admin_routes(self, app: FastAPI) -> None:
        pool = self.pool

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
