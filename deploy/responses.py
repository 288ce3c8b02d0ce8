"""OpenAI response bodies and stream chunks, built from finished or streaming choices.

Pure shaping: no I/O, no engine. ``body`` and ``chunks`` shape a prepared request's
answer, whichever API it came through. Every body of one request shares one header
(``{id, object, created, model}``, see ``header``); the chunk builders turn the merged
delta stream of ``fanout.run_choices`` into OpenAI's streamed chunks.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from kvroute.deploy.fanout import Choice, Stream
from kvroute.deploy.protocol import PreparedRequest
from kvroute.replica.outputs import TokenLogprob


def body(req: PreparedRequest, choices: list[Choice], text_of: "TokenText") -> dict[str, Any]:
    """The JSON answer to ``req`` from its finished choices."""
    logprobs = req.logprobs is not None
    if req.chat:
        return chat_body(header(req.request_id, "chat.completion", req.model), choices, logprobs, text_of)
    return completion_body(header(req.request_id, "text_completion", req.model), choices, req.echo, logprobs, text_of)


def chunks(req: PreparedRequest, stream: Stream, text_of: "TokenText") -> AsyncIterator[dict[str, Any]]:
    """The streamed chunks of ``req``'s answer from its merged delta stream."""
    if req.chat:
        head = header(req.request_id, "chat.completion.chunk", req.model)
        return chat_chunks(head, stream, len(req.params), req.include_usage, req.logprobs is not None, text_of)
    return completion_chunks(header(req.request_id, "text_completion", req.model), stream, req.echo, req.include_usage,
                             text_of)  # fmt: skip


def header(rid: str, kind: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


class TokenText:
    """One token's text, decoded once (logprobs name every token they report)."""

    def __init__(self, tokenizer: Any, max_cached: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._text: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._text) < self.max_cached:
                self._text[token_id] = text
        return text


def usage(choices: list[Choice]) -> dict[str, Any]:
    by_prompt: dict[int, list[Choice]] = {}
    for c in choices:
        by_prompt.setdefault(c.prompt_index, []).append(c)
    prompt = sum(cs[0].num_prompt_tokens for cs in by_prompt.values())
    # n choices of one prompt run as n engine requests; the prompt's cache hit is what
    # every one of them found cached.
    cached = sum(min(c.num_cached_tokens for c in cs) for cs in by_prompt.values())
    details: dict[str, int] = {"cached_tokens": cached}
    host = sum(min(c.num_host_cached_tokens for c in cs) for cs in by_prompt.values())
    if host:  # a replica with a host KV tier restored part of the cached tokens from it
        details["host_cached_tokens"] = host
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


# ---------------------------------------------------------------------- completions
def completion_body(
    head: dict[str, Any], choices: list[Choice], echo: list[str], logprobs: bool, text_of: TokenText
) -> dict[str, Any]:
    return {
        **head,
        "choices": [
            {
                "index": c.index,
                "text": echo[c.prompt_index] + c.text,
                "logprobs": completion_logprobs(c.logprobs, len(echo[c.prompt_index]), text_of) if logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage(choices),
    }


async def completion_chunks(
    head: dict[str, Any], stream: Stream, echo: list[str], include_usage: bool, text_of: TokenText
) -> AsyncIterator[dict[str, Any]]:
    choices: dict[int, Choice] = {}
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
            lp = completion_logprobs(delta.logprobs, start, text_of)
            offsets[choice.index] = start + sum(len(t) for t in lp["tokens"])
        yield {
            **head,
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
        yield {**head, "choices": [], "usage": usage(list(choices.values()))}


def completion_logprobs(lps: list[TokenLogprob], start_offset: int, text_of: TokenText) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = start_offset
    for lp in lps:
        s = text_of(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({text_of(t): v for t, v in lp.top.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# ---------------------------------------------------------------------- chat
def chat_body(head: dict[str, Any], choices: list[Choice], logprobs: bool, text_of: TokenText) -> dict[str, Any]:
    return {
        **head,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": chat_logprobs(c.logprobs, text_of)} if logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage(choices),
    }


async def chat_chunks(
    head: dict[str, Any], stream: Stream, n: int, include_usage: bool, logprobs: bool, text_of: TokenText
) -> AsyncIterator[dict[str, Any]]:
    for i in range(n):  # the role comes first, once per choice
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    choices: dict[int, Choice] = {}
    async for choice, delta in stream:
        choices[choice.index] = choice
        lp = None
        if logprobs and delta.logprobs:
            lp = {"content": chat_logprobs(delta.logprobs, text_of)}
        body: dict[str, Any] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        yield {
            **head,
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
        yield {**head, "choices": [], "usage": usage(list(choices.values()))}


def chat_logprobs(lps: list[TokenLogprob], text_of: TokenText) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        s = text_of(lp.token_id)
        out.append(
            {
                "token": s,
                "logprob": lp.logprob,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := text_of(tid)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                    for tid, v in lp.top.items()
                ],
            }
        )
    return out
