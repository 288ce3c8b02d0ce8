"""The Anthropic Messages API (``POST /v1/messages``, and ``/v1/messages/count_tokens``
for a request's prompt size) as a translation onto the chat path.

A Messages request, validated field by field (``deploy/openai/messages/request.py``; an
unknown field is a 400 naming it, as on the OpenAI routes), is translated into a chat
completion request and served by ``OpenAIServing.prepare_chat`` and its ``Backend``
exactly as a chat request is: the same template, tool plan, structured output for
forced calls, context check, routing and engine. ``deploy/openai/messages/answer.py`` shapes
the chat answer back into a message or Anthropic's events. No engine or tool machinery
lives here.

The translation:

- ``system`` (text or text blocks) is the first, system, turn.
- A user turn's text blocks are a user turn; each ``tool_result`` block is a ``tool``
  turn answering its ``tool_use_id`` (``is_error: true`` puts ``Error:`` in front of
  its text, so the model reads that the tool failed). An assistant turn's text is its
  content and its ``tool_use`` blocks its ``tool_calls`` (the ids kept, so the template
  pairs calls and results).
- A conversation that ends with an assistant turn is continued (Anthropic's prefill):
  the answer is what follows that text.
- ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` as on the chat path;
  ``stop_sequences`` as ``stop``; ``tools`` (``name``, ``description``,
  ``input_schema``) as functions; ``tool_choice`` ``auto``/``any``/``tool``/``none`` as
  ``auto``/``required``/the named function/``none``, ``disable_parallel_tool_use`` as
  ``parallel_tool_calls: false``. Without ``tool_choice`` the chat path's default holds:
  ``auto`` where the server enables it (``--enable-auto-tool-choice``), else ``none``.
- What is accepted with no effect and what is refused: ``deploy/openai/messages/request.py``.

Errors are Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``,
with the chat path's status (``MessagesError``).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, TypeVar

from pydantic import ValidationError

from kvroute.deploy.openai.errors import APIError
from kvroute.deploy.openai.messages.answer import message_body, message_events, message_id
from kvroute.deploy.openai.messages.request import (CountTokensRequest, MessagesError, MessagesRequest, Message, TextBlock,
                                             ToolUseBlock, parse_request, validation_message)
from kvroute.deploy.openai.protocol import Answer, ChatCompletionRequest, PreparedRequest
from kvroute.deploy.openai.serving import OpenAIServing

__all__ = ["MessagesError", "chat_request", "count_tokens", "create_message"]

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------------- the translation
def _parts(blocks: list[TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _turns(message: Message, index: int, called: set[str]) -> list[dict[str, Any]]:
    """The chat turns of one Messages turn (``called``: the tool_use ids so far)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        texts = [b for b in message.content if isinstance(b, TextBlock)]
        uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
        turn: dict[str, Any] = {"role": "assistant", "content": _parts(texts) if texts else None}
        if uses:
            turn["tool_calls"] = [{"id": u.id, "type": "function",
                                   "function": {"name": u.name, "arguments": json.dumps(u.input)}} for u in uses]  # fmt: skip
            called.update(u.id for u in uses)
        return [turn]
    turns: list[dict[str, Any]] = []
    pending: list[TextBlock] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            pending.append(block)
            continue
        if block.tool_use_id not in called:
            raise MessagesError(400, f"messages[{index}].content[{j}].tool_use_id: {block.tool_use_id!r} answers no "
                                     "tool_use block of an earlier assistant turn")  # fmt: skip
        if pending:
            turns.append({"role": "user", "content": _parts(pending)})
            pending = []
        turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
    if pending or not turns:
        turns.append({"role": "user", "content": _parts(pending)})
    return turns


def chat_request(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion request (as JSON) that serves ``req``."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _parts(req.system)
        messages.append({"role": "system", "content": system})
    called: set[str] = set()
    for i, message in enumerate(req.messages):
        messages += _turns(message, i, called)
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens,
                            "temperature": req.temperature, "stream": req.stream}  # fmt: skip
    last = req.messages[-1]
    if last.role == "assistant" and "tool_calls" not in messages[-1]:
        chat.update(add_generation_prompt=False, continue_final_message=True)  # prefill: continue its text
    if req.top_p is not None:
        chat["top_p"] = req.top_p
    if req.top_k is not None:
        chat["top_k"] = req.top_k
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in req.tools]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat


# What the chat path calls a field, as this API calls it (in its errors).
_CHAT_NAMES = {".function.parameters": ".input_schema", "parameters": "input_schema",
               "max_completion_tokens": "max_tokens", ".function.name": ".name"}  # fmt: skip
_CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def _messages_error(exc: APIError) -> MessagesError:
    message = exc.message
    for old, new in _CHAT_NAMES.items():
        message = message.replace(old, new)
    param = _CHAT_PARAMS.get(exc.param or "", exc.param)
    if param == "stop_sequences" and message.startswith("stop:"):
        message = "stop_sequences:" + message[len("stop:") :]
    return MessagesError(exc.status, message, param=param, code=exc.code, retry_after_s=exc.retry_after_s)


async def create_message(serving: OpenAIServing, raw: bytes) -> Answer:
    """Serve one ``POST /v1/messages`` body through the chat path: the message as a
    dict, or Anthropic's SSE events. Every failure is a ``MessagesError``."""

    async def serve() -> Answer:
        req = parse_request(raw)
        prepared = await _prepare(serving, req)
        answer = await serving.backend.answer(prepared)
        stops = req.stop_sequences or ()
        msg_id = message_id(prepared.request_id)
        if isinstance(answer, dict):
            return message_body(answer, msg_id, prepared.model, stops)
        return message_events(answer, msg_id, prepared.model, len(prepared.prompts[0]), stops)

    return await _anthropic_errors(serve(), "POST /v1/messages")


async def count_tokens(serving: OpenAIServing, raw: bytes) -> dict[str, Any]:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt's tokens
    as ``/v1/messages`` would send the same conversation, system prompt and tools to the
    engine (the same checks, translation, template and tokenizer: the request is
    prepared as a one-token message and not run). Every failure is a ``MessagesError``."""

    async def count() -> dict[str, Any]:
        conversation = parse_request(raw, CountTokensRequest)
        prepared = await _prepare(serving, MessagesRequest(**dict(conversation), max_tokens=1))
        return {"input_tokens": len(prepared.prompts[0])}

    return await _anthropic_errors(count(), "POST /v1/messages/count_tokens")


async def _prepare(serving: OpenAIServing, req: MessagesRequest) -> PreparedRequest:
    """``req`` as the chat request that serves it, checked, templated and tokenized by
    the chat path."""
    chat = chat_request(req)
    try:
        chat_req = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise MessagesError(400, validation_message(exc, _CHAT_NAMES)) from None
    return await serving.prepare_chat(chat_req, json.dumps(chat).encode())


async def _anthropic_errors(work: Awaitable[T], route: str) -> T:
    """``work``'s result; whatever it raises as a ``MessagesError`` (the chat path's
    errors with this API's field names, a ValueError a 400, anything else a 500)."""
    try:
        return await work
    except MessagesError:
        raise
    except APIError as exc:
        raise _messages_error(exc) from None
    except ValueError as exc:
        raise MessagesError(400, str(exc)) from None
    except Exception as exc:
        log.exception("%s failed", route)
        raise MessagesError(500, f"internal error: {type(exc).__name__}: {exc}") from None
