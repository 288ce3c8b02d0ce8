"""The OpenAI completions and chat APIs over any backend that streams TokenDeltas.

``OpenAIServing`` is plain Python (no FastAPI, no Ray): it turns a validated request into
token ids (tokenized once, here), validates them against the model's limits, fans
``n`` out into ``n`` engine requests, and shapes the results as OpenAI responses or SSE
chunks. Two hosts use it: the Ray Serve ingress (backend: the cluster client) and the
single-engine server (backend: one in-process ``AsyncEngine``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Protocol, Sequence, Union

from kvroute.cluster.messages import RouteTrace
from kvroute.deploy.errors import APIError, bad_request, error_body
from kvroute.deploy.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    template_messages,
)
from kvroute.replica.outputs import TokenDelta, TokenLogprob
from kvroute.replica.sampling_params import SamplingParams


class Backend(Protocol):
    def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        cache_salt: Optional[str],
        trace: RouteTrace,
    ) -> AsyncIterator[TokenDelta]:
        """Stream one request. Raises ValueError for a bad request and ``APIError``
        (429/503) when it cannot be served; closing the iterator aborts the request."""

    async def ready(self) -> bool:
        """True while at least one engine can take requests."""


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for; a request past these gets 400/413/408."""

    max_body_bytes: int = 4 * 2**20
    max_prompts: int = 64  # prompts in one /v1/completions list
    max_n: int = 16
    request_timeout_s: Optional[float] = 600.0
    api_key: Optional[str] = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_prompts < 1 or self.max_n < 1:
            raise ValueError("max_prompts and max_n must be >= 1")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")


@dataclass
class _Choice:
    """One choice's state while it streams."""

    index: int
    prompt_index: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    trace: RouteTrace = field(default_factory=RouteTrace)


class OpenAIServing:
    def __init__(
        self,
        model_name: str,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        backend: Backend,
        limits: ServerLimits = ServerLimits(),
        served_model_aliases: Sequence[str] = (),
    ) -> None:
        self.model_name = model_name
        self.model_names = (model_name, *served_model_aliases)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.backend = backend
        self.limits = limits
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.on_finished: list[Any] = []  # fn(choice_trace, num_cached_tokens) per finished choice

    # ------------------------------------------------------------------ small APIs
    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "kvroute",
                    "root": self.model_name,
                    "max_model_len": self.max_model_len,
                }
                for name in self.model_names
            ],
        }

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {list(self.model_names)}",
                param="model",
                code="model_not_found",
            )

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = await asyncio.to_thread(
                self._chat_ids, template_messages(req.messages), req.add_generation_prompt, False, "messages"
            )
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, req.tokens)}

    # ------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest) -> Union[dict[str, Any], AsyncIterator[bytes]]:
        self.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (it must equal n when given)", param="best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs (prompt logprobs) is not supported", param="echo")
        prompts = req.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise bad_request(
                f"prompt holds {len(prompts)} prompts; at most {self.limits.max_prompts} are allowed", param="prompt"
            )
        # Tokenizing a prompt near the body limit takes seconds: off the event loop.
        token_lists, echo_texts = await asyncio.to_thread(self._prompt_ids, prompts, req.echo)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        params = self._params_per_choice(req, token_lists, max_tokens, req.logprobs)
        kind = "text_completion"
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = self._run(rid, token_lists, params, req.n, req.cache_salt)
        if req.stream:
            return await self._event_stream(
                stream, len(params) * len(token_lists), lambda s: self._completion_chunks(rid, s, echo_texts, req.include_usage, kind)
            )
        choices = await self._collect(stream)
        return {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "text": echo_texts[c.prompt_index] + c.text,
                    "logprobs": self._completion_logprobs(c.logprobs, len(echo_texts[c.prompt_index])) if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ],
            "usage": self._usage(choices),
        }

    def _prompt_ids(self, prompts: list[Union[str, list[int]]], echo: bool) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt (text or ids, checked by pydantic), and the text echo
        returns in front of each choice."""
        token_lists: list[list[int]] = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            self._check_ids(ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            token_lists.append(ids)
        return token_lists, [self.tokenizer.decode(ids) if echo else "" for ids in token_lists]

    async def _completion_chunks(
        self, rid: str, stream: AsyncIterator[tuple[_Choice, TokenDelta]], echo: list[str], include_usage: bool, kind: str
    ) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        choices: dict[int, _Choice] = {}
        offsets: dict[int, int] = {}
        async for choice, delta in stream:
            first = choice.index not in choices
            choices[choice.index] = choice
            text = delta.text
            if first and echo[choice.prompt_index]:
                text = echo[choice.prompt_index] + text
            start = offsets.get(choice.index, len(echo[choice.prompt_index]) if first else 0)
            lp = None
            if delta.logprobs:
                lp = self._completion_logprobs(delta.logprobs, start)
                offsets[choice.index] = start + sum(len(t) for t in lp["tokens"])
            yield {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": choice.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": delta.finish_reason,
                        "stop_reason": delta.stop_reason,
                    }
                ],
            }
        if include_usage:
            yield {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": self._usage(list(choices.values())),
            }

    # ------------------------------------------------------------------ chat
    async def chat(self, req: ChatCompletionRequest) -> Union[dict[str, Any], AsyncIterator[bytes]]:
        self.check_model(req.model)
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt=false", param="continue_final_message")
        ids = await asyncio.to_thread(
            self._chat_ids, template_messages(req.messages), req.add_generation_prompt, req.continue_final_message, "messages"
        )
        self._check_ids(ids, "messages")
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = limit if limit is not None else max(1, self.max_model_len - len(ids))
        try:
            num_logprobs = req.num_logprobs()
        except ValueError as exc:
            raise bad_request(str(exc), param="top_logprobs") from None
        params = self._params_per_choice(req, [ids], max_tokens, num_logprobs, "max_completion_tokens")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self._run(rid, [ids], params, req.n, req.cache_salt)
        if req.stream:
            return await self._event_stream(
                stream, req.n, lambda s: self._chat_chunks(rid, s, req.n, req.include_usage, num_logprobs is not None)
            )
        choices = await self._collect(stream)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": {"content": self._chat_logprobs(c.logprobs)} if num_logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ],
            "usage": self._usage(choices),
        }

    async def _chat_chunks(
        self, rid: str, stream: AsyncIterator[tuple[_Choice, TokenDelta]], n: int, include_usage: bool, logprobs: bool
    ) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        for i in range(n):  # the role comes first, once per choice
            yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        choices: dict[int, _Choice] = {}
        async for choice, delta in stream:
            choices[choice.index] = choice
            lp = None
            if logprobs and delta.logprobs:
                lp = {"content": self._chat_logprobs(delta.logprobs)}
            body: dict[str, Any] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            yield {
                **base,
                "choices": [
                    {
                        "index": choice.index,
                        "delta": body,
                        "logprobs": lp,
                        "finish_reason": delta.finish_reason,
                        "stop_reason": delta.stop_reason,
                    }
                ],
            }
        if include_usage:
            yield {**base, "choices": [], "usage": self._usage(list(choices.values()))}

    # ------------------------------------------------------------------ shared machinery
    def _chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool, param: str) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(f"the model {self.model_name!r} has no chat template; use /v1/completions", param=param)
        try:
            out = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                tokenize=True,
            )
        except Exception as exc:  # a template that rejects the conversation (roles, order)
            raise bad_request(f"the chat template rejected the messages: {exc}", param=param) from None
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise bad_request(f"{param} must not be empty", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"{param} token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param=param)

    def _params_per_choice(
        self,
        req: Union[CompletionRequest, ChatCompletionRequest],
        token_lists: list[list[int]],
        max_tokens: int,
        logprobs: Optional[int],
        max_tokens_param: str = "max_tokens",
    ) -> list[SamplingParams]:
        if req.n > self.limits.max_n:
            raise bad_request(f"n={req.n} exceeds the server's limit of {self.limits.max_n}", param="n")
        for i, ids in enumerate(token_lists):
            if len(ids) >= self.max_model_len:
                raise bad_request(
                    f"the prompt{'' if len(token_lists) == 1 else f' {i}'} has {len(ids)} tokens; the model's "
                    f"context length is {self.max_model_len} tokens, and at least one output token must fit",
                    param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                    code="context_length_exceeded",
                )
            if len(ids) + max_tokens > self.max_model_len:
                raise bad_request(
                    f"{max_tokens_param}={max_tokens} plus the prompt's {len(ids)} tokens exceeds the model's "
                    f"context length of {self.max_model_len} tokens; lower {max_tokens_param} to at most "
                    f"{self.max_model_len - len(ids)}",
                    param=max_tokens_param,
                    code="context_length_exceeded",
                )
        try:
            return [req.sampling_params(max_tokens, logprobs, seed_offset=i) for i in range(req.n)]
        except ValueError as exc:
            raise bad_request(str(exc), param="min_tokens" if "min_tokens" in str(exc) else None) from None

    async def _run(
        self, rid: str, token_lists: list[list[int]], params: list[SamplingParams], n: int, cache_salt: Optional[str]
    ) -> AsyncIterator[tuple[_Choice, TokenDelta]]:
        """Every choice's deltas as they come, interleaved. Closing this iterator (the
        caller left) cancels every choice, which aborts its engine request."""
        choices = [
            _Choice(index=p * n + i, prompt_index=p) for p in range(len(token_lists)) for i in range(n)
        ]
        queue: asyncio.Queue[tuple[_Choice, Union[TokenDelta, BaseException, None]]] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                gen = self.backend.generate(
                    token_lists[choice.prompt_index],
                    params[choice.index % n],
                    request_id=f"{rid}-{choice.index}",
                    cache_salt=cache_salt,
                    trace=choice.trace,
                )
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
                choice.num_prompt_tokens = item.num_prompt_tokens
                choice.num_cached_tokens = item.num_cached_tokens
                choice.token_ids.extend(item.token_ids)
                choice.text += item.text
                if item.logprobs:
                    choice.logprobs.extend(item.logprobs)
                if item.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = item.finish_reason, item.stop_reason
                    for fn in self.on_finished:
                        fn(choice.trace, choice.num_cached_tokens)
                yield choice, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, stream: AsyncIterator[tuple[_Choice, TokenDelta]]) -> list[_Choice]:
        seen: dict[int, _Choice] = {}
        try:
            async with _timeout(self.limits.request_timeout_s):
                async for choice, _ in stream:
                    seen[choice.index] = choice
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        finally:
            await stream.aclose()
        return [seen[i] for i in sorted(seen)]

    async def _event_stream(
        self,
        stream: AsyncIterator[tuple[_Choice, TokenDelta]],
        num_choices: int,
        make_chunks: Callable[[AsyncIterator[tuple[_Choice, TokenDelta]]], AsyncIterator[dict[str, Any]]],
    ) -> AsyncIterator[bytes]:
        """SSE bytes for ``stream``. Every choice's first delta is awaited before
        returning, so a request the backend refuses, wholly or for one of its choices
        (bad input, overload), still gets its HTTP status instead of a 200 stream; a
        failure after that becomes an error event. However the response ends (finished,
        failed, client gone), ``stream`` is closed, which aborts every choice still
        running."""
        deadline = None if self.limits.request_timeout_s is None else time.monotonic() + self.limits.request_timeout_s
        head: list[tuple[_Choice, TokenDelta]] = []
        started: set[int] = set()
        try:
            async with _timeout(self.limits.request_timeout_s):
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

        async def replay() -> AsyncIterator[tuple[_Choice, TokenDelta]]:
            for item in head:
                yield item
            if len(started) == num_choices:
                async for item in stream:
                    yield item

        async def sse() -> AsyncIterator[bytes]:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                async with _timeout(left):
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

    def _usage(self, choices: list[_Choice]) -> dict[str, Any]:
        by_prompt: dict[int, list[_Choice]] = {}
        for c in choices:
            by_prompt.setdefault(c.prompt_index, []).append(c)
        prompt = sum(cs[0].num_prompt_tokens for cs in by_prompt.values())
        # n choices of one prompt run as n engine requests; the prompt's cache hit is
        # what every one of them found cached.
        cached = sum(min(c.num_cached_tokens for c in cs) for cs in by_prompt.values())
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _token_str(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text

    def _completion_logprobs(self, lps: list[TokenLogprob], start_offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = start_offset
        for lp in lps:
            s = self._token_str(lp.token_id)
            tokens.append(s)
            token_lps.append(lp.logprob)
            tops.append({self._token_str(t): v for t, v in lp.top.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            s = self._token_str(lp.token_id)
            out.append(
                {
                    "token": s,
                    "logprob": lp.logprob,
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {"token": (t := self._token_str(tid)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                        for tid, v in lp.top.items()
                    ],
                }
            )
        return out


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _timeout:
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
