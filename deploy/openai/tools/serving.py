"""Tool calling as a front end uses it: the server's settings (``--chat-template``,
``--enable-auto-tool-choice``, ``--tool-call-parser``, and ``--reasoning-parser``, which
``deploy/openai/reasoning.py`` applies; as vLLM spells them) and, per
request, a ``ToolPlan``: what the template renders, what constrains the output, and what
reads the output back as content and tool calls.

Per request: validate ``ToolFields`` and the messages (``ToolChatMessage``), then
``plan = plan_tools(config, fields)``; render ``template_messages(messages)`` with
``plan.tools`` through a ``ChatRenderer``; sample with ``plan.structured_output()``
(and special tokens kept where ``plan.keep_special_tokens``); read each choice's text
with ``plan.new_parser()`` (streamed) or ``plan.parse(text)``; report
``plan.finish_reason(...)``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from kvroute.deploy.openai.chat_template import load_chat_template
from kvroute.deploy.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from kvroute.deploy.openai.tools.calls import ToolCall, ToolChoice, ToolFields, finish_reason
from kvroute.deploy.openai.tools.forcing import ForcedToolParser, forced_tool_schema
from kvroute.deploy.openai.tools.parsers import TOOL_PARSERS, get_tool_parser, resolve_tool_choice
from kvroute.deploy.openai.tools.stream import StreamParser


@dataclass(frozen=True)
class ToolServingConfig:
    """The server's tool settings; plain values, so it pickles to any process."""

    chat_template: Optional[str] = None  # the template's text (load_chat_template), None: the tokenizer's
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: Optional[str] = None  # reasoning_parsers.REASONING_PARSERS (None: the output is all content)

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {sorted(TOOL_PARSERS)})")

    @classmethod
    def from_flags(cls, chat_template: Optional[str] = None, tool_call_parser: Optional[str] = None,
                   enable_auto_tool_choice: bool = False, reasoning_parser: Optional[str] = None) -> "ToolServingConfig":  # fmt: skip
        """From the flags' values (``chat_template`` as ``--chat-template`` takes it)."""
        text = load_chat_template(chat_template) if chat_template else None
        return cls(text, tool_call_parser, enable_auto_tool_choice, reasoning_parser)


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """The tool-calling flags of a serving command."""
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="serve this chat template (a Jinja file, inline Jinja, or 'chatml_tools': ChatML with "
                             "Hermes-style tools, for SmolLM2) instead of the tokenizer's")  # fmt: skip
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide to call tools (tool_choice auto); needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how tool calls appear in the model's output (hermes: Qwen2.5/Qwen3 and chatml_tools)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split <think>...</think> out of the output into the message's `reasoning` (the "
                             "output up to </think>, as vLLM 0.32's parser of that name reads it), and start a "
                             "structured output or forced tool call after </think>")


def tool_config_from_args(args: argparse.Namespace) -> ToolServingConfig:
    return ToolServingConfig.from_flags(args.chat_template, args.tool_call_parser, args.enable_auto_tool_choice,
                                        args.reasoning_parser)  # fmt: skip


@dataclass(frozen=True)
class ToolPlan:
    """One request's tool handling. ``tools``: what the chat template gets (None: no
    tools rendered); ``schema``: the JSON schema a forced call constrains the output to;
    ``parser``: the format parser for ``auto`` (None when the output is not parsed)."""

    choice: ToolChoice
    tools: Optional[list[dict[str, Any]]]
    schema: Optional[dict[str, Any]]
    parser: Optional[type[StreamParser]]
    parallel: bool = True  # false: an auto choice returns its first call only (a forced one is constrained to one)

    @property
    def forced(self) -> bool:
        return self.schema is not None

    @property
    def keep_special_tokens(self) -> bool:
        """Whether the detokenizer must keep special tokens (the format's markers are some)."""
        return self.parser is not None and self.parser.needs_special_tokens

    def structured_output(self) -> Any:
        """The engine's structured-output spec for a forced call (None otherwise)."""
        if self.schema is None:
            return None
        from kvroute.replica.structured_output import StructuredOutput

        return StructuredOutput("json", self.schema, field="tool_choice")

    def new_parser(self) -> Optional[StreamParser]:
        """A fresh streaming reader for one choice; None: pass the text through as content."""
        if self.forced:
            return ForcedToolParser(tool_choice=self.choice)
        return self.parser(max_calls=self._max_calls()) if self.parser is not None else None

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """A whole choice's ``(content, tool_calls)``."""
        if self.forced:
            return ForcedToolParser.parse(text, tool_choice=self.choice)
        if self.parser is None:
            return text, []
        return self.parser.parse(text, max_calls=self._max_calls())

    def _max_calls(self) -> Optional[int]:
        return None if self.parallel else 1

    def message(self, text: str) -> dict[str, Any]:
        """A whole choice as OpenAI's assistant ``message``: ``content`` (null when only
        calls came) and ``tool_calls`` when there are any."""
        content, calls = self.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message

    def finish_reason(self, engine_reason: Optional[str], called: bool) -> Optional[str]:
        return finish_reason(engine_reason, self.choice, called)


def plan_tools(config: ToolServingConfig, fields: ToolFields) -> ToolPlan:
    """The plan for a request's (validated) tool fields; ValueError naming tool_choice
    when the server's settings do not allow it."""
    choice = resolve_tool_choice(fields, config.tool_call_parser, config.enable_auto_tool_choice)
    schema = forced_tool_schema(fields.tools, choice, fields.parallel())
    tools = fields.template_tools() if choice != "none" else None
    parser = get_tool_parser(config.tool_call_parser) if choice == "auto" and config.tool_call_parser else None
    return ToolPlan(choice, tools, schema, parser, fields.parallel())
