"""One HTTP request's engine requests: fan-out, the merged delta stream, collection
with a deadline, and SSE framing.

A prepared request with ``n`` choices over ``P`` prompts runs as ``n * P`` engine
requests (``run_choices``), each an ``EngineRequest`` handed to the backend's
``generate``; their deltas arrive interleaved as ``(Choice, TokenDelta)``
pairs. ``collect`` drains that stream for a JSON response, ``event_stream`` turns it into
SSE bytes. Closing the stream (finished, failed, client gone, timed out) aborts every
choice still running.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

from kvroute.deploy.openai.errors import APIError, bad_request, error_body
from kvroute.deploy.openai.protocol import PreparedRequest
from kvroute.replica.outputs import TokenDelta, TokenLogprob
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteOutcome

Stream = AsyncIterator[tuple["Choice", TokenDelta]]


def _unrouted(outcome: RouteOutcome) -> None:
    """An ``EngineRequest`` nobody asked where it ran."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One engine request: one choice of one prompt of a prepared request, as a backend
    runs it. ``lora_name``: with that LoRA adapter (None: the base model);
    ``on_route`` gets where it went (once it is there). Frozen: the fan-out hands the
    same value to a backend that may retry or resume it elsewhere."""

    token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str
    cache_salt: Optional[str] = None
    lora_name: Optional[str] = None
    on_route: Callable[[RouteOutcome], None] = _unrouted


# A backend's one engine request: its deltas as they come. Raises ValueError for a bad
# request and ``APIError`` (429/503) when it cannot be served; closing the iterator
# aborts the request.
Generate = Callable[[EngineRequest], AsyncIterator[TokenDelta]]


@dataclass
class Choice:
    """One choice's state while it streams."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # one per prompt token (None first), when the request asked the engine for them
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    outcome: RouteOutcome = RouteOutcome()  # how its routing played out (once it is known)

    def routed(self, outcome: RouteOutcome) -> None:
        self.outcome = outcome

    def absorb(self, delta: TokenDelta) -> None:
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_host_cached_tokens = delta.num_host_cached_tokens
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            # the first token's delta brings them; a request resumed on another replica
            # sends them again (its prompt then holds the tokens streamed so far)
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


async def run_choices(generate: Generate, request: PreparedRequest, on_finished: Callable[[Choice], None]) -> Stream:
    """Every choice's deltas as they come, interleaved (``PreparedRequest`` says which
    prompt and parameters each choice runs); ``on_finished(choice)`` as each finishes.
    Closing this iterator (the caller left) cancels every choice, which aborts its
    engine request."""
    rid, n = request.request_id, len(request.params)
    choices = [Choice(index=p * n + i, prompt_index=p) for p in range(len(request.prompts)) for i in range(n)]
    queue: asyncio.Queue[tuple[Choice, Union[TokenDelta, BaseException, None]]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            gen = generate(EngineRequest(tuple(request.prompts[choice.prompt_index]), request.params[choice.index % n],
                                         f"{rid}-{choice.index}", request.cache_salt, request.lora_name, choice.routed))
            try:
                async for delta in gen:
                    await queue.put((choice, delta))
            finally:
                await gen.aclose()
            await queue.put((choice, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put((choice, exc))

    tasks = [asyncio.get_running_loop().create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
                if choice.finish_reason is None:
                    raise APIError(503, f"request {rid}: choice {choice.index} ended without finishing")
                continue
            if isinstance(item, BaseException):
                raise item
            choice.absorb(item)
            if item.finish_reason is not None:
                on_finished(choice)
            yield choice, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(stream: Stream, timeout_s: Optional[float]) -> list[Choice]:
    """Every choice, finished, in index order (408 past ``timeout_s``)."""
    seen: dict[int, Choice] = {}
    try:
        async with Deadline(timeout_s):
            async for choice, _ in stream:
                seen[choice.index] = choice
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    finally:
        await stream.aclose()
    return [seen[i] for i in sorted(seen)]


async def event_stream(
    stream: Stream,
    num_choices: int,
    make_chunks: Callable[[Stream], AsyncIterator[dict[str, Any]]],
    timeout_s: Optional[float],
) -> AsyncIterator[bytes]:
    """SSE bytes for ``stream``. Every choice's first delta is awaited before returning,
    so a request the backend refuses, wholly or for one of its choices (bad input,
    overload), still gets its HTTP status instead of a 200 stream; a failure after that
    becomes an error event. However the response ends (finished, failed, client gone),
    ``stream`` is closed, which aborts every choice still running."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    head: list[tuple[Choice, TokenDelta]] = []
    started: set[int] = set()
    try:
        async with Deadline(timeout_s):
            while len(started) < num_choices:
                head.append(await stream.__anext__())
                started.add(head[-1][0].index)
    except StopAsyncIteration:
        pass
    except ValueError as exc:
        await stream.aclose()
        raise bad_request(str(exc)) from None
    except BaseException:
        await stream.aclose()
        raise

    async def replay() -> Stream:
        for item in head:
            yield item
        if len(started) == num_choices:
            async for item in stream:
                yield item

    async def sse() -> AsyncIterator[bytes]:
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            async with Deadline(left):
                async for chunk in make_chunks(replay()):
                    yield _sse(chunk)
        except APIError as exc:
            yield _sse(exc.body())
        except ValueError as exc:
            yield _sse(error_body(400, str(exc)))
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    return sse()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Deadline:
    """``asyncio.timeout`` that tolerates ``None`` and raises APIError(408)."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.seconds = seconds
        self._cm = None

    async def __aenter__(self) -> None:
        if self.seconds is not None:
            self._cm = asyncio.timeout(self.seconds)
            await self._cm.__aenter__()

    async def __aexit__(self, et, exc, tb) -> bool:
        if self._cm is None:
            return False
        try:
            return bool(await self._cm.__aexit__(et, exc, tb))
        except TimeoutError:
            raise APIError(408, f"request timed out after request_timeout_s={self.seconds}") from None
