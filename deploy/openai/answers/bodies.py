"""OpenAI response bodies, built from finished choices (``answers/chunks`` builds the
streamed chunks).

Pure shaping: no I/O, no engine. ``body`` shapes a prepared request's answer,
whichever API it came through. Every body of one request shares one header
(``{id, object, created, model}``, see ``header``). What a choice carries beyond its
text follows the request: chat ``tool_calls`` read from the text by the request's
``ToolPlan``; logprobs (``answers/logprobs``), with echo's prompt tokens in front;
vLLM's ``prompt_logprobs`` (per choice on completions, once per answer on chat, as vLLM
places them). With ``echo_only`` (echo, max_tokens 0) the engine ran one token, which
the answer drops: the text is the prompt, usage counts no completion tokens.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from kvroute.deploy.openai.answers.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    generated_entries,
    prompt_entries,
    prompt_logprobs,
)
from kvroute.deploy.openai.fanout import Choice
from kvroute.deploy.openai.protocol import PreparedRequest

__all__ = ["TokenText", "body", "header", "usage", "running_usage"]


def body(req: PreparedRequest, choices: list[Choice], text_of: TokenText) -> dict[str, Any]:
    """The JSON answer to ``req`` from its finished choices."""
    if req.chat:
        return chat_body(req, choices, text_of)
    return completion_body(req, choices, text_of)


def header(rid: str, kind: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def usage(choices: list[Choice], echo_only: bool = False) -> dict[str, Any]:
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
    completion = 0 if echo_only else sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """One streamed chunk's usage (continuous usage stats): its choice's counts so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


# ---------------------------------------------------------------------- completions
def completion_body(req: PreparedRequest, choices: list[Choice], text_of: TokenText) -> dict[str, Any]:
    head = header(req.request_id, "text_completion", req.model)
    return {**head, "choices": [completion_choice(req, c, text_of) for c in choices],
            "usage": usage(choices, req.echo_only)}  # fmt: skip


def completion_choice(req: PreparedRequest, c: Choice, text_of: TokenText) -> dict[str, Any]:
    echo = req.echo[c.prompt_index]
    out: dict[str, Any] = {
        "index": c.index,
        "text": echo if req.echo_only else echo + c.text,
        "logprobs": completion_choice_logprobs(req, c, text_of),
        "finish_reason": "length" if req.echo_only else c.finish_reason,
        "stop_reason": None if req.echo_only else c.stop_reason,
    }
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(req.prompts[c.prompt_index], c.prompt_logprobs, text_of)
    if req.return_token_ids:  # vLLM: per choice, its prompt's ids and its own
        out["prompt_token_ids"] = req.prompts[c.prompt_index]
        out["token_ids"] = [] if req.echo_only else c.token_ids
    return out


def completion_choice_logprobs(req: PreparedRequest, c: Choice, text_of: TokenText) -> Optional[dict[str, Any]]:
    """A finished choice's ``logprobs``: with echo and logprobs, the prompt's tokens
    first and offsets from the start of the prompt's text."""
    if req.logprobs is None:
        return None
    entries = [] if req.echo_only else generated_entries(c.logprobs)
    if req.echo_logprobs:
        return completion_logprobs(prompt_entries(req.prompts[c.prompt_index], c.prompt_logprobs) + entries, 0, text_of)
    return completion_logprobs(entries, len(req.echo[c.prompt_index]), text_of)


# ---------------------------------------------------------------------- chat
def chat_body(req: PreparedRequest, choices: list[Choice], text_of: TokenText) -> dict[str, Any]:
    head = header(req.request_id, "chat.completion", req.model)
    out: dict[str, Any] = {**head, "choices": [chat_choice(req, c, text_of) for c in choices], "usage": usage(choices)}
    if req.prompt_logprobs is not None:  # one prompt: vLLM reports it once, beside the choices
        out["prompt_logprobs"] = prompt_logprobs(req.prompts[0], choices[0].prompt_logprobs if choices else None, text_of)
    if req.return_token_ids:  # vLLM: the prompt's ids beside the choices, each choice's own
        out["prompt_token_ids"] = req.prompts[0]
        for item, c in zip(out["choices"], choices):
            item["token_ids"] = c.token_ids
    return out


def chat_choice(req: PreparedRequest, c: Choice, text_of: TokenText) -> dict[str, Any]:
    """One finished chat choice; with a reasoning plan its ``reasoning`` is split out
    first; with a tool plan the content reads back as content and ``tool_calls``, and
    a choice that called a tool finishes with "tool_calls"."""
    plan = req.tools
    if req.reasoning is not None:
        message: dict[str, Any] = req.reasoning.message(c.text, plan)
    elif plan is None:
        message = {"role": "assistant", "content": c.text}
    else:
        message = plan.message(c.text)
    finish = c.finish_reason if plan is None else plan.finish_reason(c.finish_reason, "tool_calls" in message)
    return {
        "index": c.index,
        "message": message,
        "logprobs": {"content": chat_logprobs(c.logprobs, text_of)} if req.logprobs is not None else None,
        "finish_reason": finish,
        "stop_reason": c.stop_reason,
    }
