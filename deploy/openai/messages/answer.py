"""The Anthropic Messages API's answers, shaped from the chat path's: the whole message
from a chat completion body, and Anthropic's SSE events from the chat chunks' SSE bytes.

Pure shaping, like ``answers/bodies`` and ``answers/chunks``: the request already ran through
``OpenAIServing`` and its ``Backend`` as a chat completion, and whatever backend answered
(an engine, the Serve replicas, an external worker that forwarded it) the answer has the
chat shape, so one translation serves them all.

- Content: the choice's text is a ``text`` block (left out when empty), each tool call a
  ``tool_use`` block whose ``input`` is the call's arguments as an object.
- ``stop_reason``: ``tool_use`` when a tool was called (also a forced named call, whose
  chat finish reason stays ``stop``), ``max_tokens`` for a cut-off answer,
  ``stop_sequence`` (with ``stop_sequence``) when one of the request's stop sequences
  ended it, else ``end_turn``.
- ``usage``: Anthropic counts cache reads apart from the input, so ``input_tokens`` is
  the prompt's tokens less ``cache_read_input_tokens`` (the engine's ``cached_tokens``);
  ``cache_creation_input_tokens`` is 0: the prefix cache fills by itself, nothing is
  written on request.
- Streamed: ``message_start`` (its usage counts the whole prompt as input: the cache hit
  is known only at the end), per block ``content_block_start``, ``content_block_delta``
  (``text_delta`` or ``input_json_delta``), ``content_block_stop``, then
  ``message_delta`` with the stop reason and the final usage (which Anthropic's clients
  take over the start's) and ``message_stop``. A failure after the start is an ``error``
  event.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional, Sequence

# Anthropic's error types by HTTP status (a 4xx it does not list is an invalid request).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# The OpenAI envelope's error types (``deploy/openai/errors.py``) as Anthropic names them, for
# an error that arrives inside the chat stream.
_FROM_OPENAI = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "timeout_error": "timeout_error",
    "rate_limit_error": "rate_limit_error",
    "server_error": "api_error",
    "service_unavailable_error": "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope for an HTTP status."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def message_id(request_id: str) -> str:
    """``msg_`` and the chat request's hex id, so logs of both name the same request."""
    return "msg_" + request_id.rpartition("-")[2]


def stop_reason(finish: Optional[str], matched: Any, called: bool,
                stop_sequences: Sequence[str]) -> tuple[Optional[str], Optional[str]]:  # fmt: skip
    """``(stop_reason, stop_sequence)`` from the chat finish reason and vLLM's
    ``stop_reason`` (the stop string or token id that ended the text)."""
    if finish is None:
        return None, None
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_usage: Optional[dict[str, Any]]) -> dict[str, int]:
    """Anthropic's usage from the chat answer's (input excludes the cache reads)."""
    chat_usage = chat_usage or {}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "output_tokens": int(chat_usage.get("completion_tokens") or 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}  # fmt: skip


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A call's arguments (JSON text, as the chat answer carries them) as an object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"a tool call's arguments are not valid JSON ({exc.msg}): {str(arguments)[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"a tool call's arguments are not a JSON object: {str(arguments)[:80]!r}")
    return value


def message_body(chat: dict[str, Any], msg_id: str, model: str, stop_sequences: Sequence[str]) -> dict[str, Any]:
    """The whole message from a chat completion body (one choice). ``model``: the name
    the request was served as (a worker's answer carries the worker's name for it)."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call["id"], "name": fn.get("name"), "input": _tool_input(fn.get("arguments"))})
    called = any(block["type"] == "tool_use" for block in content)
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), called, stop_sequences)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat.get("usage"))}  # fmt: skip


def event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event with its ``event:`` line, as Anthropic's clients read them."""
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def sse_data(stream: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data`` of each SSE event in a byte stream, however its bytes are cut (a
    forwarding backend passes a worker's bytes as they came)."""
    buf = b""
    async for piece in stream:
        buf = (buf + piece).replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            lines = [line[5:].removeprefix(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
            if lines:
                yield b"\n".join(lines).decode()


class _Blocks:
    """The content blocks of a streamed message as the chat deltas open and fill them."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: Optional[str] = None  # the open block's type
        self.called = False
        self.finish: Optional[str] = None
        self.matched: Any = None
        self.usage: Optional[dict[str, Any]] = None

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.count, "content_block": block}))
        self.open = block["type"]
        self.count += 1
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.count - 1, "delta": delta})

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events one chat chunk makes."""
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id"):  # a call's header: a new block
                    self.called = True
                    out += self._start({"type": "tool_use", "id": call["id"], "name": fn.get("name"), "input": {}})
                if fn.get("arguments") and self.open == "tool_use":
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if choice.get("finish_reason") is not None:
                self.finish, self.matched = choice["finish_reason"], choice.get("stop_reason")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return out


async def message_events(chunks: AsyncIterator[bytes], msg_id: str, model: str, prompt_tokens: int,
                         stop_sequences: Sequence[str]) -> AsyncIterator[bytes]:  # fmt: skip
    """Anthropic's SSE events from a chat answer's SSE bytes (asked with usage).
    Closing this iterator closes ``chunks``, which aborts the engine work."""
    start = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}  # fmt: skip
    blocks = _Blocks()
    try:
        yield event("message_start", {"type": "message_start", "message": start})
        async for data in sse_data(chunks):
            if data.strip() == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"] or {}
                kind = _FROM_OPENAI.get(error.get("type"), "api_error")
                yield event("error", {"type": "error", "error": {"type": kind, "message": error.get("message", "")}})
                return
            for item in blocks.feed(chunk):
                yield item
        if blocks.finish is None:
            yield event("error", error_body(500, "the answer ended before it finished"))
            return
        for item in blocks.close():
            yield item
        reason, sequence = stop_reason(blocks.finish, blocks.matched, blocks.called, stop_sequences)
        yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(blocks.usage or {"prompt_tokens": prompt_tokens})})  # fmt: skip
        yield event("message_stop", {"type": "message_stop"})
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
