"""The Anthropic Messages API (``POST /v1/messages``) as a translation onto the chat path.

A Messages request is validated here field by field (Anthropic's fields; an unknown one
is a 400 naming it, as on the OpenAI routes), translated into a chat completion request
and served by ``OpenAIServing.prepare_chat`` and its ``Backend`` exactly as a chat
request is: the same template, tool plan, structured output for forced calls, context
check, routing and engine. ``deploy/messages_answer.py`` shapes the chat answer back
into a message or Anthropic's events. No engine or tool machinery lives here.

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
- Accepted with no effect: ``metadata.user_id`` (an end-user id for the provider's abuse
  monitoring; kvroute keeps no such record) and ``cache_control`` on blocks and tools
  (the prefix cache holds every prompt's blocks without being asked;
  ``cache_read_input_tokens`` reports what it served).
- Refused with a 400 naming the block: image and document blocks (the served models
  read text), thinking blocks (the Messages API does not carry
  reasoning yet; the chat path does), and Anthropic's server tools.

Errors are Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``,
with the chat path's status (``MessagesError``).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from kvroute.deploy.errors import APIError
from kvroute.deploy.messages_answer import error_body, message_body, message_events, message_id
from kvroute.deploy.protocol import MAX_STOP_SEQUENCES, Answer, ChatCompletionRequest
from kvroute.deploy.request_fields import NullableModel, Text, field_of
from kvroute.deploy.serving import OpenAIServing

__all__ = ["MessagesError", "MessagesRequest", "create_message", "chat_request"]

log = logging.getLogger(__name__)


class MessagesError(APIError):
    """An ``APIError`` whose body is Anthropic's error envelope (the app's ``APIError``
    handler answers it with this body and its status)."""

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)


# ---------------------------------------------------------------------- the request
class CacheControl(BaseModel):
    """Anthropic's cache breakpoint: accepted with no effect (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_control: Optional[CacheControl] = None


class TextBlock(_Block):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1)
    content: Union[Text, list[TextBlock]] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: Union[Text, list[Block]]

    @model_validator(mode="after")
    def _blocks_of_role(self) -> "Message":
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        wrong = "tool_use" if self.role == "user" else "tool_result"
        if wrong in kinds:
            raise ValueError(f"content: {wrong} blocks belong in {'assistant' if wrong == 'tool_use' else 'user'} turns")
        return self


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text
    description: Optional[Text] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[Text] = None
    disable_parallel_tool_use: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _name(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name: give it with type "tool" (the tool to call), and only then')
        return self


class Metadata(BaseModel):
    """``user_id`` is accepted with no effect (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    user_id: Optional[Text] = Field(default=None, max_length=256)


class MessagesRequest(NullableModel):
    """A ``POST /v1/messages`` body (unknown fields refused; ``null`` is the default)."""

    model: Text = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    system: Optional[Union[Text, list[TextBlock]]] = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)  # 0: no limit
    stop_sequences: Optional[list[Text]] = None
    stream: StrictBool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    metadata: Optional[Metadata] = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(v)}")
        if v is not None and not all(v):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @model_validator(mode="after")
    def _tool_choice(self) -> "MessagesRequest":
        choice, names = self.tool_choice, [t.name for t in self.tools or ()]
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f'tool_choice: type "{choice.type}" needs tools')
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice.name: {choice.name!r} is not one of the tools {names}")
        return self


# Blocks each place takes; any other is refused before validation, naming where it is.
_TAKES = {"system": ("text",), "message": ("text", "tool_use", "tool_result"), "tool_result": ("text",)}
_WHY = {
    "image": "the served model reads text only",
    "document": "the served model reads text only",
    "thinking": "the Messages API does not carry reasoning (the chat API does, with --reasoning-parser)",
    "redacted_thinking": "the Messages API does not carry reasoning (the chat API does, with --reasoning-parser)",
}


def _refuse_blocks(data: dict[str, Any]) -> None:
    """A 400 for the first block of a kind this API does not take (image, document,
    thinking, server tools), naming its place."""

    def check(blocks: Any, where: str, takes: tuple[str, ...]) -> None:
        if not isinstance(blocks, list):
            return
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in takes:
                why = _WHY.get(kind, f"{where} takes {', '.join(takes)} blocks")
                raise MessagesError(400, f"{where}[{j}]: {kind} blocks are not supported: {why}")
            if kind == "tool_result":
                check(block.get("content"), f"{where}[{j}].content", _TAKES["tool_result"])

    check(data.get("system"), "system", _TAKES["system"])
    for i, message in enumerate(data.get("messages") or ()):
        if isinstance(message, dict):
            check(message.get("content"), f"messages[{i}].content", _TAKES["message"])


def parse_request(raw: bytes) -> MessagesRequest:
    """The validated request from the body's bytes (``MessagesError`` 400 naming the field)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MessagesError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MessagesError(400, "the request body must be a JSON object")
    _refuse_blocks(data)
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as exc:
        raise MessagesError(400, _validation_message(exc)) from None


def _validation_message(exc: ValidationError, renames: Optional[dict[str, str]] = None) -> str:
    """The first error as ``path: what`` (pydantic's union tags left out of the path;
    ``renames``: the chat path's names for this API's fields)."""
    errors = exc.errors()
    # a check that ran past the type test, else the union member that got furthest
    first = max(errors, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))))
    path, prev = "", None
    for part in first.get("loc", ()):
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or (part in _TAKES["message"] and isinstance(prev, int)):
            pass  # a union member's tag (a type, or a block's type right after its index), not a field
        else:
            path += f".{part}" if path else part
        prev = part
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    for old, new in (renames or {}).items():
        path, msg = path.replace(old, new), msg.replace(old, new)
    if first.get("type") == "missing":
        return f"{path}: required"
    if first.get("type") == "extra_forbidden":
        return f"{path}: unknown field; kvroute's Messages API does not implement it (docs/api.md lists the fields it takes)"
    if not path:
        return msg
    return f"{path}.{msg}" if field_of(msg) else f"{path}: {msg}"  # a check over a model names its field first


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-wrap"}


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
    try:
        req = parse_request(raw)
        chat = chat_request(req)
        try:
            chat_req = ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            raise MessagesError(400, _validation_message(exc, _CHAT_NAMES)) from None
        prepared = await serving.prepare_chat(chat_req, json.dumps(chat).encode())
        answer = await serving.backend.answer(prepared)
        stops = req.stop_sequences or ()
        msg_id = message_id(prepared.request_id)
        if isinstance(answer, dict):
            return message_body(answer, msg_id, prepared.model, stops)
        return message_events(answer, msg_id, prepared.model, len(prepared.prompts[0]), stops)
    except MessagesError:
        raise
    except APIError as exc:
        raise _messages_error(exc) from None
    except ValueError as exc:
        raise MessagesError(400, str(exc)) from None
    except Exception as exc:
        log.exception("POST /v1/messages failed")
        raise MessagesError(500, f"internal error: {type(exc).__name__}: {exc}") from None
