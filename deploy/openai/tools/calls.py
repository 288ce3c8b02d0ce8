"""OpenAI tool calling, as data: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``; conversation messages that carry assistant ``tool_calls`` and
``tool`` results; the tool calls a response returns; and the conversion of a
conversation to the dicts a Hugging Face chat template renders.

No HTTP, engine or Ray here: every check raises ``ValueError`` (inside pydantic, a
``ValidationError``) whose message starts with the field it is about, so any front end
can turn it into a 400 that names the field.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

# OpenAI's rule for function names; templates and parsers can rely on it.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ID_CHARS = string.ascii_letters + string.digits
_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _unicode(v: str) -> str:
    """JSON can spell an unpaired UTF-16 surrogate (``"\\ud800"``), which no tokenizer or
    UTF-8 encoder takes: refuse it here rather than fail deep in rendering."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains an unpaired UTF-16 surrogate at character {exc.start}; text must be valid Unicode") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]


def new_call_id(style: str = "openai") -> str:
    """A fresh tool-call id: OpenAI's shape ``call_`` + 24 letters and digits, or for
    Mistral's templates (which reject any other) exactly 9 letters and digits."""
    if style == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _check_name(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError(f"name must be 1-64 letters, digits, '_' or '-', got {v!r}")
    return v


# Deeper JSON than this is refused before any recursive walk (ours, jsonschema's, the
# grammar compiler's) could exhaust Python's stack; real tool schemas nest a few levels.
MAX_SCHEMA_DEPTH = 64


def check_depth(value: Any, where: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """ValueError when ``value`` nests objects and lists deeper than ``limit`` (walked
    without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ValueError(f"{where} nests deeper than {limit} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _check_schema_node(node: Any, where: str) -> None:
    """The structural rules a JSON schema must keep for us to constrain output with it."""
    if not isinstance(node, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(node).__name__}")
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    bad = [k for k in kinds if k not in _SCHEMA_TYPES]
    if bad:
        raise ValueError(f"{where}.type {bad[0]!r} is not a JSON schema type ({', '.join(sorted(_SCHEMA_TYPES))})")
    props = node.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ValueError(f"{where}.properties must be an object")
        for key, sub in props.items():
            _check_schema_node(sub, f"{where}.properties.{key}")
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise ValueError(f"{where}.required must be a list of property names")
    if isinstance(node.get("items"), dict):
        _check_schema_node(node["items"], f"{where}.items")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v)

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if v is None:
            return v
        if v.get("type", "object") != "object":
            raise ValueError(f"parameters must be a schema of type 'object', got type {v.get('type')!r}")
        check_depth(v, "parameters")
        _check_schema_node(v, "parameters")
        try:
            import jsonschema
        except ImportError:  # the structural checks above still ran
            return v
        try:
            jsonschema.Draft202012Validator.check_schema(v)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"parameters is not a valid JSON schema: {exc.message}") from None
        return v

    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema (OpenAI: no ``parameters`` means an empty object)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolFields(BaseModel):
    """A chat request's tool fields, checked together (mix into the request model, or
    validate them from the request body on their own)."""

    model_config = ConfigDict(extra="ignore")

    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _consistent(self) -> "ToolFields":
        if self.tools is not None and not self.tools:
            raise ValueError("tools: an empty list; give at least one tool or leave tools out")
        names = [t.function.name for t in self.tools or ()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tools: function names must be unique, {dup[0]!r} is given more than once")
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if not names:
                raise ValueError(f"tool_choice: {self.choice_label()} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not one of the tools {names}")
        return self

    def choice(self) -> ToolChoice:
        """The effective choice: as given, else OpenAI's default (``auto`` with tools)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def choice_label(self) -> str:
        c = self.choice()
        return f"function {c.function.name!r}" if isinstance(c, NamedToolChoice) else repr(c)

    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools as chat templates take them (``apply_chat_template(tools=...)``); none
        when the choice is ``none``, so a model told not to call tools is shown none
        (vLLM shows them unless started with --exclude-tools-when-tool-choice-none)."""
        if not self.tools or self.choice() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def json_object(text: str, field: Optional[str] = None) -> dict[str, Any]:
    """The JSON object ``text`` encodes (a call's arguments: chat templates render them as
    an object). ValueError when it is not JSON or encodes something else; with ``field``
    the message starts with it and quotes the text's start, without it the message is
    bare, for a pydantic validator whose error already names the field."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if field is None:
            raise ValueError(f"not valid JSON ({exc.msg})") from None
        raise ValueError(f"{field} is not valid JSON ({exc.msg}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field + ' ' if field else ''}must encode a JSON object, got {type(value).__name__}")
    return value


class ToolCallFunction(BaseModel):
    name: Text
    arguments: Optional[Union[Text, dict[str, Any]]] = None

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments as a dict (chat templates expect one); empty when absent."""
        if not self.arguments:
            return {}
        if isinstance(self.arguments, dict):
            return self.arguments
        return json_object(self.arguments, "function.arguments")


class AssistantToolCall(BaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction

    @model_validator(mode="after")
    def _arguments(self) -> "AssistantToolCall":
        self.function.arguments_dict()  # raises naming function.arguments
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: Text


class ToolChatMessage(BaseModel):
    """A conversation turn, tool fields included: ``tool_calls`` on an assistant turn,
    ``tool_call_id`` (and optionally ``name``) on a ``tool`` turn. An assistant turn's
    reasoning comes as ``reasoning`` (vLLM 0.32's name) or ``reasoning_content`` (the
    older one); ``reasoning`` wins where both are given."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[Text, list[TextPart]]] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[AssistantToolCall]] = None
    tool_call_id: Optional[Text] = Field(default=None, min_length=1)
    reasoning: Optional[Text] = None
    reasoning_content: Optional[Text] = None

    @model_validator(mode="after")
    def _role_fields(self) -> "ToolChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool_calls, not {self.role!r} ones")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of the tool call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only tool messages carry tool_call_id, not {self.role!r} ones")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def check_tool_history(messages: list[ToolChatMessage]) -> None:
    """Every ``tool`` message answers a call of an earlier assistant turn, as OpenAI
    requires (ValueError naming ``messages[i].tool_call_id``)."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.tool_calls or ():
            called.add(call.id)
        if m.role == "tool" and m.tool_call_id not in called:
            raise ValueError(f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no tool call of an earlier assistant message")


def template_messages(messages: list[ToolChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: text content, ``developer`` as a
    system turn, tool-call arguments parsed to dicts (as vLLM passes them to Hugging Face
    templates, which expect dicts), and each ``tool`` message's ``name`` filled in from
    the call it answers when the client left it out (templates that print it need it),
    and a turn's reasoning under both ``reasoning`` and ``reasoning_content`` (as vLLM
    passes it: Qwen3's and DeepSeek-R1's templates read ``reasoning_content``)."""
    check_tool_history(messages)
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments_dict()}}
                for c in m.tool_calls
            ]
            names.update((c.id, c.function.name) for c in m.tool_calls)
        if m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id
            name = m.name or names.get(m.tool_call_id or "")
            if name:
                turn["name"] = name
        elif m.name is not None:
            turn["name"] = m.name
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            turn["reasoning"] = turn["reasoning_content"] = reasoning
        out.append(turn)
    return out


@dataclass(frozen=True)
class ToolCall:
    """One call a response returns; ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def finish_reason(engine_reason: Optional[str], choice: ToolChoice, called: bool) -> Optional[str]:
    """The ``finish_reason`` OpenAI gives: ``tool_calls`` when the model stopped after
    calling tools under ``auto`` or ``required``; a named function's forced call keeps
    ``stop`` (OpenAI's behaviour, which vLLM copies); a cut-off output keeps ``length``."""
    if called and engine_reason == "stop" and not isinstance(choice, NamedToolChoice):
        return "tool_calls"
    return engine_reason
