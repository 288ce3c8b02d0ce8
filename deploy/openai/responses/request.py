"""The Responses API's request (``POST /v1/responses``) and its translation onto the
chat path: a Responses request becomes the body of a ``/v1/chat/completions`` request,
which ``OpenAIServing.prepare_chat`` validates, templates and tokenizes like any chat
request, so tools, forced calls, structured outputs, routing and the backends work here
unchanged.

The conversation is a list of items, kept in one normal form (``conversation_items``),
which is also what a stored response keeps for a later ``previous_response_id``:

- ``{"type": "message", "role", "content": text}`` (roles user, system, developer,
  assistant; content parts joined),
- ``{"type": "function_call", "call_id", "name", "arguments"}``,
- ``{"type": "function_call_output", "call_id", "output": text}``,
- ``{"type": "reasoning", "text": text}`` (an assistant turn's reasoning, which the
  template renders where it renders past reasoning).

``chat_body`` renders it as chat messages: ``instructions`` as a first system message
(not carried over to a continuation, as OpenAI does), an assistant message followed by
function calls as one assistant turn with ``tool_calls``, consecutive calls as one turn,
each output as a ``tool`` message. A continuation therefore renders the previous
request's conversation first, so its prompt starts with the previous prompt's tokens
and the prefix-aware router sends it to the replica that holds their KV.

Unknown fields are refused with a 400 naming them (``NullableModel``), as on the chat
routes. Accepted with no effect, each because what it asks for is what kvroute does:
``include`` empty, ``truncation`` "disabled" (a prompt over the context is a 400), and
on items replayed from an earlier response their ``id``, ``status``, and an output
text's ``logprobs`` and empty ``annotations``, which describe that output and are not
part of the prompt.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, ValidationError, field_validator,
                      model_validator)

from kvroute.deploy.openai.request_fields import NullableModel, Text
from kvroute.deploy.openai.tools.calls import FunctionDefinition, json_object

MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """A text content part: ``input_text`` (what a caller wrote) or ``output_text``
    (an assistant's earlier output, replayed)."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Optional[list[Any]] = Field(default=None, max_length=0)  # we never produce any
    logprobs: Optional[list[Any]] = None  # of the earlier output; not part of the prompt


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[Text, list[TextPart]]
    id: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    arguments: Text
    id: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    @field_validator("arguments")
    @classmethod
    def _object(cls, v: str) -> str:
        """Chat templates render a call's arguments as an object."""
        json_object(v)
        return v


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Union[Text, list[TextPart]]
    id: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningPart(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Strict):
    """An assistant turn's reasoning, replayed from an earlier response (its ``content``,
    else its ``summary``): the chat path gives it to the template as the turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: Optional[list[ReasoningPart]] = None
    encrypted_content: Optional[Text] = None
    id: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    @field_validator("encrypted_content")
    @classmethod
    def _plain(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            raise ValueError("kvroute returns its reasoning as text and reads no encrypted reasoning")
        return v

    def text(self) -> str:
        return "".join(p.text for p in (self.content if self.content else self.summary))


_ITEMS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}  # fmt: skip


class ReasoningConfig(_Strict):
    """``reasoning``: ``effort`` becomes the chat path's ``reasoning_effort`` (a template
    variable); summaries are not written (the reasoning item carries the reasoning text)."""

    effort: Optional[Literal["low", "medium", "high"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None

    @model_validator(mode="after")
    def _no_summary(self) -> "ReasoningConfig":
        if self.summary is not None or self.generate_summary is not None:
            raise ValueError("reasoning.summary: kvroute writes no reasoning summaries; with a reasoning parser the "
                             "reasoning item carries the reasoning text itself")  # fmt: skip
        return self


class FunctionTool(_Strict):
    """``{"type": "function", "name", "description", "parameters", "strict"}``: the chat
    path's function definition (whose checks it runs), flattened as the Responses API
    spells it. ``type`` comes first, so a tool of another type is refused by its type."""

    type: Literal["function"]
    name: Text
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _as_chat_function(self) -> "FunctionTool":
        try:
            FunctionDefinition.model_validate(self.model_dump(exclude={"type"}, exclude_none=True))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            message = str(first["msg"]).removeprefix("Value error, ")
            raise ValueError(message if message.startswith(f"{field}") else f"{field}: {message}") from None
        return self

    def chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(_Strict):
    """``{"type": "function", "name"}``: call exactly this function."""

    type: Literal["function"]
    name: Text


class TextFormat(_Strict):
    """``text.format``: plain text, a JSON schema (``name``, ``schema``, ``strict``,
    ``description``) or any JSON object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"]
    name: Optional[Text] = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None
    description: Optional[Text] = None

    def check(self) -> None:
        """The fields its type needs and takes (ValueError naming ``text.format.*``; run
        from the request, so the message's field is the whole path)."""
        if self.type == "json_schema":
            if self.schema_ is None:
                raise ValueError("text.format.schema: required with type json_schema")
            if self.name is None:
                raise ValueError("text.format.name: required with type json_schema")
        elif any(v is not None for v in (self.name, self.schema_, self.strict, self.description)):
            raise ValueError(f"text.format: name, schema, strict and description go with type json_schema, not {self.type}")

    def response_format(self) -> Optional[dict[str, Any]]:
        """The chat path's ``response_format`` (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(_Strict):
    format: TextFormat = TextFormat(type="text")


class ResponsesRequest(NullableModel):
    """``POST /v1/responses``. ``input`` items are checked in order and the first bad
    one is named (``input[i].field``)."""

    model: Optional[Text] = None
    input: Union[Text, list[dict[str, Any]]] = Field(default_factory=list)
    instructions: Optional[Text] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: Optional[Text] = Field(default=None, min_length=1)
    metadata: Optional[dict[Text, Text]] = None
    user: Optional[Text] = None
    include: Optional[list[Text]] = Field(default=None, max_length=0)  # nothing extra to include
    truncation: Literal["disabled"] = "disabled"
    reasoning: Optional[ReasoningConfig] = None

    _items: list[BaseModel] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        if isinstance(self.input, list):
            self._items = [_item(i, raw) for i, raw in enumerate(self.input)]
        if self.text is not None:
            self.text.format.check()
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA_PAIRS:
                raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(self.metadata)}")
            for key, value in self.metadata.items():
                if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                    raise ValueError(f"metadata: keys are at most {MAX_METADATA_KEY} characters and values "
                                     f"{MAX_METADATA_VALUE}; {key[:40]!r} is longer")  # fmt: skip
        if isinstance(self.tool_choice, FunctionChoice) or self.tool_choice == "required":
            names = [t.name for t in self.tools or ()]
            if not names:
                raise ValueError("tool_choice: forcing a call needs tools")
            if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in names:
                raise ValueError(f"tool_choice: function {self.tool_choice.name!r} is not one of the tools {names}")
        return self

    def conversation_items(self) -> list[dict[str, Any]]:
        """This request's input in the normal form (a text input is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self._items:
            if isinstance(item, MessageItem):
                out.append({"type": "message", "role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                out.append({"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments})
            elif isinstance(item, ReasoningItem):
                out.append({"type": "reasoning", "text": item.text()})
            else:
                assert isinstance(item, FunctionCallOutputItem)
                out.append({"type": "function_call_output", "call_id": item.call_id, "output": item.text()})
        return out

    def text_format(self) -> dict[str, Any]:
        """``text.format`` as the response echoes it."""
        return (self.text or TextConfig()).format.model_dump(by_alias=True, exclude_none=True)

    def chat_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice


def _item(index: int, raw: dict[str, Any]) -> BaseModel:
    """One input item, by its ``type`` (a message may leave it out); ValueError naming
    ``input[index]`` and the field."""
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"input[{index}].type: {kind!r} is not supported; kvroute takes "
                         f"{', '.join(_ITEMS)} items")  # fmt: skip
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()  # a union field fails once per member: name the member that was meant
        first = next((e for e in errors if not str(e["type"]).endswith("_type")), errors[0])
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"] if isinstance(p, int) or "[" not in p)
        msg = str(first["msg"]).removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = f"unknown field of a {kind} item; kvroute does not implement it"
        raise ValueError(f"input[{index}]{path}: {msg}") from None


def chat_body(req: ResponsesRequest, previous: list[dict[str, Any]], items: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body that serves ``req``: the conversation
    ``previous + items`` (``previous``: what ``previous_response_id`` stored) behind
    ``req.instructions``, and the request's sampling, tool and format fields under their
    chat names. ValueError naming ``input[i]`` for a function output that answers no
    call of the conversation, or an empty conversation."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    called: set[str] = set()
    for i, item in enumerate(previous + items):
        where = f"input[{i - len(previous)}]"
        kind = item["type"]
        last = messages[-1] if messages else None
        if kind == "message" and item["role"] == "assistant" and _reasoning_only(last):
            last["content"] = item["content"]  # the text that followed the reasoning: one turn
        elif kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": "", "reasoning": item["text"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if last is not None and last["role"] == "assistant":  # the text before the calls, or a call before
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            called.add(item["call_id"])
        else:
            if item["call_id"] not in called:
                raise ValueError(f"{where}.call_id: {item['call_id']!r} answers no function_call of the input "
                                 "or of the previous response")  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not messages:
        raise ValueError("input: give at least one input item or instructions")
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    fields = {"model": req.model, "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
              "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.chat_tool_choice(),
              "tools": [t.chat_tool() for t in req.tools] if req.tools else None,
              "response_format": (req.text or TextConfig()).format.response_format(),
              "reasoning_effort": req.reasoning.effort if req.reasoning else None}  # fmt: skip
    body.update({k: v for k, v in fields.items() if v is not None})
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _reasoning_only(message: Optional[dict[str, Any]]) -> bool:
    """An assistant turn that so far holds only reasoning (a replayed reasoning item)."""
    return (message is not None and message["role"] == "assistant" and message.get("reasoning") is not None
            and not message["content"] and not message.get("tool_calls"))  # fmt: skip
