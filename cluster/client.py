"""The client every Ray process uses to generate: hash once, route, stream, fail over.

``generate`` hashes the prompt's full blocks with the cluster's HashSpec (the request
router ranks replicas with them), streams TokenDeltas from the chosen replica (whose
first item, a ``FirstDelta``, says where the request went and with which decision), and when
that replica dies mid-stream resumes on another one with the prompt plus the tokens
streamed so far (``resume_output``): the caller sees one uninterrupted stream, equal to
an undisturbed run for greedy and for seeded sampling. Retries are bounded; a request
that cannot be served ends with ``ReplicaUnavailableError``, overload with
``OverloadedError``, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from ray import serve
from ray.serve import context as serve_context
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.messages import FirstDelta, GenerateRequest, OverloadedError, ReplicaCall, ReplicaUnavailableError
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.outputs import RequestId, TokenDelta
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteOutcome


@contextlib.contextmanager
def _own_serve_request() -> Iterator[None]:
    """Make the handle calls inside this block a Serve request of their own.

    Inside a Serve replica (the HTTP ingress) every handle call inherits the incoming
    request's ``internal_request_id``, and Serve's request router files pending requests
    under that id: two calls made for one HTTP request (``n > 1``, a prompt list) would
    share it, the second would never be assigned, and its routing task would spin and
    hold one of the few routing slots everyone shares. A fresh id per call keeps them
    apart; the caller's other context (request id, route, app) is kept.
    """
    current = serve_context._get_serve_request_context()
    fresh = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    token = serve_context._serve_request_context.set(fresh)
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


class _StreamCut(Exception):
    """A replica's stream ended without a finished delta."""


_REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError, _StreamCut)


class KVRouteClient:
    def __init__(
        self,
        handle: Any,
        hash_spec: HashSpec,
        *,
        max_resume_attempts: int = 3,
        retry_backoff_s: float = 0.1,
        first_token_timeout_s: float | None = 300.0,
    ) -> None:
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self.hash_spec = hash_spec
        self.max_resume_attempts = max_resume_attempts
        self.retry_backoff_s = retry_backoff_s
        self.first_token_timeout_s = first_token_timeout_s
        # requests, resumes, overloaded, failed: this client's; fallbacks, failovers,
        # spills: what the decisions its requests were served with say (an ingress
        # exports them as kvroute:router_fallbacks / _failovers / _spills)
        self.stats = {"requests": 0, "resumes": 0, "overloaded": 0, "failed": 0, "fallbacks": 0, "failovers": 0,
                      "spills": 0}  # fmt: skip

    @classmethod
    def for_app(cls, config: ClusterConfig, **kwargs: Any) -> "KVRouteClient":
        handle = serve.get_deployment_handle(config.deployment_name, app_name=config.app_name)
        kwargs.setdefault("max_resume_attempts", config.max_resume_attempts)
        return cls(handle, config.hash_spec, **kwargs)

    async def generate(
        self,
        token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        on_route: Callable[[RouteOutcome], None] | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream one request (``lora_name``: with that LoRA adapter). ``on_route``, when
        given, is called with where the request went and the decision it was sent with,
        as its first token arrives (again after a resume, marked ``resumed``)."""
        ids = [int(t) for t in token_ids]  # checked by the replica's engine (Engine.make_request), once
        rid = RequestId(request_id or uuid.uuid4().hex)
        hashes = hash_blocks(self.hash_spec, ids, cache_salt, lora_name=lora_name)  # full blocks, as the engine hashes them
        if prompt is None:
            prompt = " ".join(map(str, ids))  # text stand-in for text-matching routers
        streamed: list[int] = []
        attempt = 0
        self.stats["requests"] += 1
        while True:
            request = GenerateRequest(
                request_id=rid if attempt == 0 else f"{rid}#resume{attempt}",
                token_ids=ids,
                params=params,
                block_hashes=hashes,
                cache_salt=cache_salt,
                resume_output=list(streamed),
                prompt=prompt,
                lora_name=lora_name,
            )
            with _own_serve_request():
                response = self._stream_handle.generate.remote(request)
            finished = False
            try:
                first = True
                iterator = response.__aiter__()
                while True:
                    try:
                        if first and self.first_token_timeout_s is not None:
                            delta = await asyncio.wait_for(iterator.__anext__(), self.first_token_timeout_s)
                        else:
                            delta = await iterator.__anext__()
                    except StopAsyncIteration:
                        break
                    except asyncio.TimeoutError:
                        self.stats["failed"] += 1
                        raise ReplicaUnavailableError(
                            f"request {rid}: no token within first_token_timeout_s={self.first_token_timeout_s}"
                        ) from None
                    if isinstance(delta, FirstDelta):
                        self._routed(delta.outcome, attempt > 0, on_route)
                        delta = delta.delta
                    first = False
                    streamed.extend(delta.token_ids)
                    finished = delta.finish_reason is not None
                    yield dataclasses.replace(delta, request_id=rid)
                    if finished:
                        return
                raise _StreamCut()
            except BackPressureError as exc:
                self.stats["overloaded"] += 1
                raise OverloadedError(f"request {rid} rejected: the application is overloaded ({exc})") from exc
            except _REPLICA_LOST as exc:
                attempt += 1
                if attempt > self.max_resume_attempts:
                    self.stats["failed"] += 1
                    raise ReplicaUnavailableError(
                        f"request {rid}: replicas failed {attempt} times (max_resume_attempts="
                        f"{self.max_resume_attempts}); last error: {type(exc).__name__}"
                    ) from exc
                self.stats["resumes"] += 1
                await asyncio.sleep(self.retry_backoff_s * attempt)
            finally:
                if not finished:  # the caller left (or the replica died): stop the work there
                    try:
                        response.cancel()
                    except Exception:  # a response that already failed re-raises its error here
                        pass

    def _routed(self, outcome: RouteOutcome, resumed: bool, on_route: Callable[[RouteOutcome], None] | None) -> None:
        """A replica's first item arrived: count what its decision says, tell the caller."""
        if resumed:
            outcome = dataclasses.replace(outcome, resumed=True)
        decision = outcome.decision
        if decision is not None:
            self.stats["fallbacks"] += decision.reason == "fallback"
            self.stats["failovers"] += decision.failovers
            self.stats["spills"] += decision.spills
        if on_route is not None:
            on_route(outcome)

    async def complete(self, token_ids: Sequence[int], params: SamplingParams, **kwargs: Any) -> list[TokenDelta]:
        """Every delta of one request (convenience for tests and batch jobs)."""
        return [d async for d in self.generate(token_ids, params, **kwargs)]

    async def load_lora(self, name: str, path: str, timeout_s: float = 300.0) -> None:
        """Load a LoRA adapter on one replica (any): how a new folder is checked before the
        application lists it. ValueError (the engine's, unwrapped) for a bad folder."""
        with _own_serve_request():
            response = self._handle.load_lora.remote(name, path)
        try:
            await asyncio.wait_for(response, timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise ReplicaUnavailableError(f"no replica loaded LoRA adapter {name!r} within {timeout_s} s") from None
        except ValueError as exc:  # Ray wraps the replica's error
            cause = getattr(exc, "cause", None)
            raise ValueError(str(cause) if isinstance(cause, ValueError) else str(exc)) from None

    async def debug_state(self, replica_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """One replica's exact cache and block state (needs the kvroute request router)."""
        with _own_serve_request():
            response = self._handle.debug_state.remote(ReplicaCall(replica_id))
        try:
            return await asyncio.wait_for(response, timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise ReplicaUnavailableError(f"replica {replica_id} did not answer within {timeout_s} s") from None
