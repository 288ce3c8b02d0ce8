"""Forced tool calls: ``tool_choice`` ``required`` or a named function, enforced with
structured outputs so even a tiny model returns calls that parse and match the tools'
``parameters`` schemas. This follows vLLM, whatever ``--tool-call-parser`` says:

- a named function: the output is constrained to that function's ``parameters``
  schema, so the whole output is the arguments object;
- ``required``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``
  objects, at least one (exactly one when ``parallel_tool_calls`` is false), each
  naming one of the tools and carrying arguments that match its schema.

``forced_tool_schema`` builds the JSON schema for the engine's json-schema structured
output; ``ForcedToolParser`` reads the constrained output back as tool calls, streamed
or whole (``parse_forced``).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from kvroute.deploy.openai.tools.calls import NamedToolChoice, ToolCall, ToolChoice, ToolDefinition
from kvroute.deploy.openai.tools.stream import StreamParser


def _tool_by_name(tools: list[ToolDefinition], name: str) -> ToolDefinition:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise ValueError(f"tool_choice: function {name!r} is not one of the tools {[t.function.name for t in tools]}")


def _hoist_defs(params: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Move a tool's ``$defs`` to the array schema's top level, where its
    ``#/$defs/...`` references resolve once the schema is nested."""
    params = copy.deepcopy(params)
    for name, schema in params.pop("$defs", {}).items():
        if name in defs and defs[name] != schema:
            raise ValueError(f"tools: two tools define $defs {name!r} differently; forced calls need one definition")
        defs[name] = schema
    return params


def forced_tool_schema(
    tools: Optional[list[ToolDefinition]], tool_choice: ToolChoice, parallel_tool_calls: bool = True
) -> Optional[dict[str, Any]]:
    """The JSON schema the output must follow, or None where the choice forces nothing
    (``none``, ``auto``)."""
    if tool_choice in ("none", "auto"):
        return None
    if not tools:
        raise ValueError(f"tool_choice: {tool_choice!r} needs tools")
    if isinstance(tool_choice, NamedToolChoice):
        return copy.deepcopy(_tool_by_name(tools, tool_choice.function.name).function.parameters_schema())
    defs: dict[str, Any] = {}
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _hoist_defs(t.function.parameters_schema(), defs),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class ForcedToolParser(StreamParser):
    """Reads the output ``forced_tool_schema`` constrained: the arguments object of the
    named function, or the array of ``{name, parameters}`` objects. Text after the JSON
    (whitespace, at most) is dropped; output that is not such JSON (cut short by
    ``max_tokens``) stays content."""

    def __init__(self, eager: bool = True, tool_choice: ToolChoice = "required") -> None:
        super().__init__(eager)
        if isinstance(tool_choice, NamedToolChoice):
            self.name: Optional[str] = tool_choice.function.name
            self.mode = "args"
        elif tool_choice == "required":
            self.name = None
            self.mode = "open"
        else:
            raise ValueError(f"tool_choice: {tool_choice!r} forces no call")

    def _mode_args(self) -> bool:
        return self._read_call("end", name=self.name)

    def _mode_open(self) -> bool:
        if not self._skip_ws():
            if self.final:
                self._revert()
            return self.final
        if self.buf[0] != "[":
            self._revert()
            return True
        self.raw.append("[")
        self.buf, self.mode = self.buf[1:], "item"
        return True

    def _mode_item(self) -> bool:
        return self._read_call("sep", arg_keys=("parameters",))

    def _mode_sep(self) -> bool:
        self._skip_ws()
        if self.buf.startswith(","):
            self.raw, self.buf, self.mode = [","], self.buf[1:], "item"
            return True
        if self.buf:
            self.mode = "end"  # the array's "]", and nothing else, follows
            return True
        return False

    def _mode_end(self) -> bool:
        self.buf = ""
        return False


def parse_forced(text: str, tool_choice: ToolChoice) -> list[ToolCall]:
    """The calls in a whole forced output; empty when it is not the constrained JSON."""
    return ForcedToolParser.parse(text, tool_choice=tool_choice)[1]
