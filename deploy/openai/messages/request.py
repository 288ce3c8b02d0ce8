"""The Anthropic Messages API's requests (``POST /v1/messages`` and
``/v1/messages/count_tokens``), validated field by field: Anthropic's fields, each
range-checked; an unknown one is a 400 naming it, as on the OpenAI routes.
``deploy/openai/messages/api.py`` translates a valid request onto the chat path.

- Accepted with no effect: ``metadata.user_id`` (an end-user id for the provider's abuse
  monitoring; kvroute keeps no such record) and ``cache_control`` on blocks and tools
  (the prefix cache holds every prompt's blocks without being asked;
  ``cache_read_input_tokens`` reports what it served).
- Refused with a 400 naming the block: image and document blocks (the served models
  read text), thinking blocks (the Messages API does not carry
  reasoning yet; the chat path does), and Anthropic's server tools.

Errors are Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``
(``MessagesError``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from kvroute.deploy.openai.errors import APIError
from kvroute.deploy.openai.messages.answer import error_body
from kvroute.deploy.openai.protocol import MAX_STOP_SEQUENCES
from kvroute.deploy.openai.request_fields import NullableModel, Text, field_of

__all__ = ["CountTokensRequest", "MessagesError", "MessagesRequest", "parse_request", "validation_message"]


class MessagesError(APIError):
    """An ``APIError`` whose body is Anthropic's error envelope (the app's ``APIError``
    handler answers it with this body and its status)."""

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)


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


class CountTokensRequest(NullableModel):
    """A ``POST /v1/messages/count_tokens`` body: the conversation and tools of a
    Messages request, without its sampling fields (unknown fields refused)."""

    model: Text = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: Optional[Union[Text, list[TextBlock]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None

    @model_validator(mode="after")
    def _tool_choice(self) -> "CountTokensRequest":
        choice, names = self.tool_choice, [t.name for t in self.tools or ()]
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f'tool_choice: type "{choice.type}" needs tools')
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice.name: {choice.name!r} is not one of the tools {names}")
        return self


class MessagesRequest(CountTokensRequest):
    """A ``POST /v1/messages`` body (unknown fields refused; ``null`` is the default)."""

    max_tokens: StrictInt = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)  # 0: no limit
    stop_sequences: Optional[list[Text]] = None
    stream: StrictBool = False
    metadata: Optional[Metadata] = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(v)}")
        if v is not None and not all(v):
            raise ValueError("stop sequences must be non-empty strings")
        return v


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


def parse_request(raw: bytes, model: type[CountTokensRequest] = MessagesRequest) -> Any:
    """The validated request (a ``model``) from the body's bytes (``MessagesError`` 400
    naming the field)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MessagesError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MessagesError(400, "the request body must be a JSON object")
    _refuse_blocks(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise MessagesError(400, validation_message(exc)) from None


def validation_message(exc: ValidationError, renames: Optional[dict[str, str]] = None) -> str:
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
