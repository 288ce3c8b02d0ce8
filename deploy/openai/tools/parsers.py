"""Tool-call parsers chosen by name, as vLLM's ``--tool-call-parser`` chooses them, one
module per output format: ``hermes``, ``llama3_json``, ``mistral`` (each module says the
format); and which ``tool_choice`` a request gets from the server's flags.

Every parser is a ``StreamParser`` (``tools/stream.py``): ``feed`` a text delta, get
OpenAI deltas; ``finish`` at the end; ``Parser.parse(text)`` for a whole output.
"""

from __future__ import annotations

from typing import Optional

from kvroute.deploy.openai.tools.calls import ToolChoice, ToolFields
from kvroute.deploy.openai.tools.hermes import HermesParser
from kvroute.deploy.openai.tools.llama3_json import Llama3JsonParser
from kvroute.deploy.openai.tools.mistral import MistralParser
from kvroute.deploy.openai.tools.stream import StreamParser


TOOL_PARSERS: dict[str, type[StreamParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_tool_parser(name: str) -> type[StreamParser]:
    """The parser class ``--tool-call-parser NAME`` selects (ValueError naming the choices)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


def resolve_tool_choice(fields: ToolFields, parser: Optional[str], enable_auto: bool) -> ToolChoice:
    """The choice a request gets from what the server's flags allow, as vLLM has it: an
    explicit ``auto`` needs ``--enable-auto-tool-choice`` and a ``--tool-call-parser``
    (ValueError naming tool_choice); left out, it is ``auto`` where that is enabled and
    ``none`` otherwise. ``required`` and a named function are constrained by structured
    outputs and need no parser."""
    if fields.tool_choice == "auto" and not (enable_auto and parser):
        raise ValueError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser')
    if fields.tool_choice is None and fields.tools and not (enable_auto and parser):
        return "none"
    return fields.choice()
