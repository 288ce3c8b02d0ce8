"""OpenAI's streamed chunks, built from the merged delta stream of ``fanout.run_choices``
(pure shaping, like ``answers/bodies``, whose header and usage they share).

- Completions: one chunk per engine delta. With echo, a choice's first chunk starts
  with the prompt's text (with echo and logprobs, its logprobs start with the prompt's
  tokens, the first one null); with ``echo_only`` the one generated token is dropped,
  so each choice streams one chunk, the prompt, finishing with "length".
- Chat: a role chunk per choice first, then the text. With a tool plan each choice's
  text goes through its own stream parser (``ToolPlan.new_parser``): every delta the
  parser sends (content, a call's id and name, argument fragments) is a chunk; the
  engine delta's logprobs ride on the first of its chunks, the finish reason (the
  plan's: "tool_calls" once the choice called one) on the last.
- Reasoning (a server with ``--reasoning-parser``): each choice's text goes first
  through its ``ReasoningStream``; its reasoning goes out as ``delta.reasoning``, the
  rest on as above (content, or the tool parser's deltas).
- vLLM's ``prompt_logprobs`` are not streamed (the ingress refuses them with
  ``stream`` unless 0), as vLLM does.
- ``return_token_ids`` (vLLM's): each chunk carries the token ids it adds, and the
  prompt's ids come with the first chunk (chat) or each choice's first (completions).
- ``continuous_usage``: every chunk carries its choice's usage so far (vLLM's
  continuous_usage_stats); with ``include_usage`` a last chunk with no choices carries
  the whole answer's usage.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from kvroute.deploy.openai.answers.logprobs import (
    Entry,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    generated_entries,
    prompt_entries,
)
from kvroute.deploy.openai.fanout import Choice, Stream
from kvroute.deploy.openai.protocol import PreparedRequest
from kvroute.deploy.openai.answers.bodies import header, running_usage, usage
from kvroute.replica.outputs import TokenDelta


def chunks(req: PreparedRequest, stream: Stream, text_of: TokenText) -> AsyncIterator[dict[str, Any]]:
    """The streamed chunks of ``req``'s answer from its merged delta stream."""
    if req.chat:
        return chat_chunks(req, stream, text_of)
    return completion_chunks(req, stream, text_of)


# ---------------------------------------------------------------------- completions
async def completion_chunks(req: PreparedRequest, stream: Stream, text_of: TokenText) -> AsyncIterator[dict[str, Any]]:
    head = header(req.request_id, "text_completion", req.model)
    choices: dict[int, Choice] = {}
    offsets: dict[int, int] = {}  # per choice, where its next token's text starts
    async for choice, delta in stream:
        first = choice.index not in choices
        choices[choice.index] = choice
        item = _completion_item(req, choice, delta, first, offsets, text_of)
        if req.return_token_ids:  # vLLM: each chunk's new ids, the prompt's with a choice's first
            item["token_ids"] = [] if req.echo_only else list(delta.token_ids)
            if first:
                item["prompt_token_ids"] = req.prompts[choice.prompt_index]
        chunk = {**head, "choices": [item]}
        if req.continuous_usage:
            chunk["usage"] = running_usage(choice.num_prompt_tokens, 0 if req.echo_only else len(choice.token_ids))
        yield chunk
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage(list(choices.values()), req.echo_only)}


def _completion_item(
    req: PreparedRequest, choice: Choice, delta: TokenDelta, first: bool, offsets: dict[int, int], text_of: TokenText
) -> dict[str, Any]:
    """One choice's part of a chunk: its new text and logprobs (the echo in front of
    its first)."""
    p = choice.prompt_index
    text = "" if req.echo_only else delta.text
    entries: list[Entry] = [] if req.echo_only else generated_entries(delta.logprobs)
    if first:
        text = req.echo[p] + text
        offsets[choice.index] = 0 if req.echo_logprobs else len(req.echo[p])
        if req.echo_logprobs:
            entries = prompt_entries(req.prompts[p], choice.prompt_logprobs) + entries
    lp = None
    if req.logprobs is not None and entries:
        lp = completion_logprobs(entries, offsets[choice.index], text_of)
        offsets[choice.index] += sum(len(t) for t in lp["tokens"])
    finish, stop = delta.finish_reason, delta.stop_reason
    if req.echo_only and finish is not None:
        finish, stop = "length", None
    return {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}


# ---------------------------------------------------------------------- chat
async def chat_chunks(req: PreparedRequest, stream: Stream, text_of: TokenText) -> AsyncIterator[dict[str, Any]]:
    head = header(req.request_id, "chat.completion.chunk", req.model)
    n = len(req.params)
    num_prompt = len(req.prompts[0])
    for i in range(n):  # the role comes first, once per choice
        role = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}  # fmt: skip
        if req.continuous_usage:
            role["usage"] = running_usage(num_prompt, 0)
        if req.return_token_ids:  # vLLM: the prompt's ids in the first chunk
            role["prompt_token_ids"] = req.prompts[0]
        yield role
    parsers = {i: req.tools.new_parser() if req.tools is not None else None for i in range(n)}
    reasoners = {i: req.reasoning.new_stream() if req.reasoning is not None else None for i in range(n)}
    choices: dict[int, Choice] = {}
    async for choice, delta in stream:
        choices[choice.index] = choice
        lp = None
        if req.logprobs is not None and delta.logprobs:
            lp = {"content": chat_logprobs(delta.logprobs, text_of)}
        for k, chunk in enumerate(_chat_delta_chunks(req, head, choice, delta, lp, parsers[choice.index],
                                                     reasoners[choice.index])):  # fmt: skip
            if req.return_token_ids:  # the engine delta's ids ride on the first of its chunks
                chunk["choices"][0]["token_ids"] = list(delta.token_ids) if k == 0 else []
            if req.continuous_usage:
                chunk["usage"] = running_usage(choice.num_prompt_tokens, len(choice.token_ids))
            yield chunk
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage(list(choices.values()))}


def _chat_delta_chunks(
    req: PreparedRequest, head: dict[str, Any], choice: Choice, delta: TokenDelta,
    lp: Optional[dict[str, Any]], parser: Any, reasoner: Any = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The chunks one engine delta of a chat choice makes: with a reasoning plan its
    ``reasoning`` first (``reasoner``, the choice's ``ReasoningStream``), then the
    content, through the tool parser when there is one."""
    finished = delta.finish_reason is not None
    if parser is None and req.reasoning is None:  # the text is the content
        body: dict[str, Any] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return [_chat_chunk(head, choice.index, body, lp, delta.finish_reason, delta.stop_reason)]
    text, deltas = delta.text, []
    if req.reasoning is not None:
        thought, text = req.reasoning.feed(reasoner, delta.text, finished)
        deltas = [{"reasoning": thought}] if thought else []
    if parser is None:
        deltas += [{"content": text}] if text else []
        finish = delta.finish_reason
    else:
        deltas += parser.feed(text) + (parser.finish() if finished else [])
        finish = req.tools.finish_reason(delta.finish_reason, parser.called) if finished else None
    if not deltas and (finished or lp is not None or req.return_token_ids):
        deltas = [{}]  # nothing to send yet, but the finish reason, logprobs or token ids must go out
    out = []
    for k, d in enumerate(deltas):
        last = k == len(deltas) - 1
        out.append(_chat_chunk(head, choice.index, d, lp if k == 0 else None,
                               finish if last else None, delta.stop_reason if last and finished else None))  # fmt: skip
    return out


def _chat_chunk(
    head: dict[str, Any], index: int, delta: dict[str, Any], lp: Optional[dict[str, Any]],
    finish: Optional[str], stop_reason: Any = None,
) -> dict[str, Any]:  # fmt: skip
    return {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                                 "stop_reason": stop_reason}]}  # fmt: skip
